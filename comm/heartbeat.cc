// Heartbeat publication and peer diagnosis; see heartbeat.h.
#include "comm/heartbeat.h"

#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/logging.h"

namespace fsdpp {

Heartbeat::Heartbeat(Store* group_store, int rank, int size, std::string name,
                     absl::Duration interval)
    : store_(group_store),
      rank_(rank),
      size_(size),
      name_(std::move(name)),
      interval_(interval) {
  // The first beat is published before the group is usable, so a peer that
  // joined always has one: "no heartbeat" then means it never joined, not
  // that its beating thread had not been scheduled yet.
  Beat(1);
  thread_ = std::thread([this] { Loop(); });
}

void Heartbeat::Beat(uint64_t beat) {
  absl::Status s = store_->Set(absl::StrCat("heartbeat/", rank_),
                               absl::StrCat(started_.load(), ",", beat));
  LOG_IF(WARNING, !s.ok() && beat % 20 == 1)
      << "group '" << name_ << "' heartbeat: " << s;
}

Heartbeat::~Heartbeat() {
  Stop();
  thread_.join();
}

void Heartbeat::MarkStarted(uint64_t seq) {
  uint64_t seen = started_.load();
  while (seen < seq + 1 && !started_.compare_exchange_weak(seen, seq + 1)) {
  }
}

void Heartbeat::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stop_ = true;
  cv_.notify_all();
}

void Heartbeat::Loop() {
  uint64_t beat = 1;  // Published by the constructor.
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, absl::ToChronoNanoseconds(interval_),
                 [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    Beat(++beat);
    lock.lock();
  }
}

namespace {
// Bound on each store read of a peer's heartbeat while diagnosing.
constexpr absl::Duration kDiagnosisReadTimeout = absl::Milliseconds(200);

// The diagnosis when the store itself is gone.
std::string StoreUnreachable(const absl::Status& status) {
  return absl::StrCat(
      "the store cannot be reached, so no peer can be checked (its host, "
      "where rank 0 runs, is down or cut off?): ",
      status.message());
}

}  // namespace

absl::Duration Heartbeat::MaxDiagnosisTime() const {
  // Two reads of every peer, three beats apart, and a second of slack.
  return 2 * (size_ - 1) * kDiagnosisReadTimeout + 3 * interval_ +
         absl::Seconds(1);
}

std::string Heartbeat::DiagnosePeers(uint64_t seq) {
  struct Beat {
    bool present = false;
    uint64_t started = 0, beat = 0;
  };
  // A store that cannot be reached (its host down or cut off) says nothing
  // about the peers: that is the diagnosis then.
  absl::Status unreachable;
  auto read = [&]() {
    std::vector<Beat> beats(size_);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      absl::StatusOr<std::string> v =
          store_->Get(absl::StrCat("heartbeat/", r), kDiagnosisReadTimeout);
      if (!v.ok()) {
        if (absl::IsUnavailable(v.status()) && unreachable.ok()) {
          unreachable = v.status();
        }
        continue;
      }
      std::vector<std::string> parts = absl::StrSplit(*v, ',');
      if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &beats[r].started) &&
          absl::SimpleAtoi(parts[1], &beats[r].beat)) {
        beats[r].present = true;
      }
    }
    return beats;
  };
  std::vector<Beat> first = read();
  if (!unreachable.ok()) return StoreUnreachable(unreachable);
  absl::SleepFor(interval_ * 3);
  std::vector<Beat> second = read();
  if (!unreachable.ok()) return StoreUnreachable(unreachable);
  std::vector<std::string> culprits;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (!second[r].present) {
      culprits.push_back(absl::StrCat(r, " (no heartbeat)"));
    } else if (first[r].present && second[r].beat == first[r].beat) {
      culprits.push_back(
          absl::StrCat(r, " (heartbeat stopped: process dead or stuck)"));
    } else if (second[r].started <= seq) {
      culprits.push_back(
          absl::StrCat(r, " (alive, has not reached this op; last started #",
                       static_cast<int64_t>(second[r].started) - 1, ")"));
    }
  }
  if (culprits.empty()) return "every peer is alive and has reached this op";
  return absl::StrCat("ranks that did not answer: ",
                      absl::StrJoin(culprits, ", "));
}

}  // namespace fsdpp
