// Elastic rendezvous of launchers; see elastic.h.
#include "runtime/elastic.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace fsdpp {
namespace launch {
namespace {

// How often node 0 looks at a round's join count while closing it, and a
// waiting node at whether it finished.
constexpr absl::Duration kPollInterval = absl::Milliseconds(50);
// The longest single store wait of a node waiting for a round to close.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);

absl::StatusOr<int64_t> ParseRound(const std::string& text) {
  int64_t round = 0;
  if (!absl::SimpleAtoi(text, &round) || round < 0) {
    return absl::DataLossError(
        absl::StrCat("elastic rendezvous: bad round number '", text, "'"));
  }
  return round;
}

}  // namespace

ElasticRendezvous::ElasticRendezvous(Store* store, ElasticOptions options)
    : store_(store), options_(std::move(options)) {}

std::string ElasticRendezvous::Key(int64_t round,
                                   const std::string& name) const {
  return absl::StrCat("elastic/r", round, "/", name);
}

absl::StatusOr<std::vector<int>> ElasticRendezvous::Close(int64_t round) {
  const absl::Time open = absl::Now();
  absl::Time last_join = open;
  int64_t seen = 0;
  int64_t count = 0;
  while (true) {
    FSDPP_ASSIGN_OR_RETURN(count, store_->Add(Key(round, "count"), 0));
    const absl::Time now = absl::Now();
    if (count != seen) {
      seen = count;
      last_join = now;
    }
    if (count >= options_.max_nodes) break;
    if (count >= options_.min_nodes && now - last_join >= options_.last_call) {
      break;
    }
    if (options_.cancelled && options_.cancelled()) {
      return absl::CancelledError(absl::StrCat("elastic rendezvous round ",
                                               round, ": cancelled while ",
                                               count, " node(s) had joined"));
    }
    if (now - open >= options_.timeout) {
      if (count >= options_.min_nodes) break;
      return absl::DeadlineExceededError(absl::StrCat(
          "elastic rendezvous round ", round, ": ", count, " of at least ",
          options_.min_nodes, " nodes joined within ",
          absl::FormatDuration(options_.timeout)));
    }
    absl::SleepFor(kPollInterval);
  }
  // Every node that joined so far (count may have grown since the loop
  // looked), then the max_nodes smallest ids are the members: node 0 always
  // is, whatever the join order; the others wait for the next round.
  std::vector<int> members;
  for (int64_t slot = 0; slot < count; ++slot) {
    FSDPP_ASSIGN_OR_RETURN(
        const std::string who,
        store_->Get(Key(round, absl::StrCat("slot", slot)), options_.timeout));
    const std::vector<std::string> parts = absl::StrSplit(who, ' ');
    int id = 0;
    int nproc = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) ||
        !absl::SimpleAtoi(parts[1], &nproc)) {
      return absl::DataLossError(absl::StrCat("elastic rendezvous round ",
                                              round, ": bad slot ", slot, " '",
                                              who, "'"));
    }
    if (nproc != options_.nproc_per_node) {
      return absl::InvalidArgumentError(absl::StrCat(
          "elastic rendezvous round ", round, ": node ", id, " starts ", nproc,
          " ranks, node ", options_.node_id, " starts ",
          options_.nproc_per_node, "; every node must start the same number"));
    }
    if (std::find(members.begin(), members.end(), id) != members.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "elastic rendezvous round ", round, ": two launchers joined as node ",
          id, " (each node needs its own --node_rank)"));
    }
    members.push_back(id);
  }
  std::sort(members.begin(), members.end());
  if (static_cast<int64_t>(members.size()) > options_.max_nodes) {
    members.resize(options_.max_nodes);
  }
  FSDPP_RETURN_IF_ERROR(
      store_->Set(Key(round, "members"), absl::StrJoin(members, ",")));
  FSDPP_RETURN_IF_ERROR(store_->Set("elastic/closed", absl::StrCat(round)));
  return members;
}

absl::StatusOr<std::vector<int>> ElasticRendezvous::Members(int64_t round) {
  // Waited for in slices, so that a cancellation is seen.
  const absl::Time deadline = absl::Now() + options_.timeout;
  absl::StatusOr<std::string> text;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    text = store_->Get(Key(round, "members"),
                       std::min(left, kWaitSlice) < absl::ZeroDuration()
                           ? absl::ZeroDuration()
                           : std::min(left, kWaitSlice));
    if (!absl::IsDeadlineExceeded(text.status())) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("elastic rendezvous round ", round,
                       ": node 0 did not close it within ",
                       absl::FormatDuration(options_.timeout)));
    }
    if (options_.cancelled && options_.cancelled()) {
      return absl::CancelledError(
          absl::StrCat("elastic rendezvous round ", round,
                       ": cancelled while waiting for node 0 to close it"));
    }
  }
  FSDPP_RETURN_IF_ERROR(text.status());
  std::vector<int> members;
  for (absl::string_view part : absl::StrSplit(*text, ',')) {
    int id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::DataLossError(absl::StrCat(
          "elastic rendezvous round ", round, ": bad members '", *text, "'"));
    }
    members.push_back(id);
  }
  return members;
}

absl::StatusOr<ElasticRound> ElasticRendezvous::Join() {
  // The round to join: the one after the last joined or closed one.
  int64_t round = round_ + 1;
  FSDPP_ASSIGN_OR_RETURN(const bool any_closed,
                         store_->Check({"elastic/closed"}));
  if (any_closed) {
    FSDPP_ASSIGN_OR_RETURN(const std::string closed,
                           store_->Get("elastic/closed", options_.timeout));
    FSDPP_ASSIGN_OR_RETURN(const int64_t last, ParseRound(closed));
    if (last + 1 > round) {
      // A round this node is not part of runs (or ran): have it restart so
      // the next one takes this node in (a no-op once it ended or another
      // reason was given).
      round_ = last;
      FSDPP_RETURN_IF_ERROR(RequestRestart(
          absl::StrCat("join: node ", options_.node_id, " is waiting")));
      round = last + 1;
    }
  }
  while (true) {
    FSDPP_ASSIGN_OR_RETURN(const int64_t slot,
                           store_->Add(Key(round, "count"), 1));
    FSDPP_RETURN_IF_ERROR(store_->Set(
        Key(round, absl::StrCat("slot", slot - 1)),
        absl::StrCat(options_.node_id, " ", options_.nproc_per_node)));
    std::vector<int> members;
    if (options_.node_id == 0) {
      FSDPP_ASSIGN_OR_RETURN(members, Close(round));
    } else {
      FSDPP_ASSIGN_OR_RETURN(members, Members(round));
    }
    const auto me = std::find(members.begin(), members.end(), options_.node_id);
    if (me != members.end()) {
      round_ = round;
      members_n_ = static_cast<int64_t>(members.size());
      ElasticRound result;
      result.round = round;
      result.members = members;
      result.group_rank = static_cast<int>(me - members.begin());
      result.world_size =
          static_cast<int>(members.size()) * options_.nproc_per_node;
      result.rank_offset = result.group_rank * options_.nproc_per_node;
      return result;
    }
    if (options_.node_id == 0) {
      return absl::InternalError(absl::StrCat(
          "elastic rendezvous round ", round, ": node 0 is not a member"));
    }
    // Too late for this round: have it restart, and be in the next.
    round_ = round;
    FSDPP_RETURN_IF_ERROR(RequestRestart(
        absl::StrCat("join: node ", options_.node_id, " is waiting")));
    ++round;
  }
}

absl::StatusOr<std::optional<std::string>>
ElasticRendezvous::RestartRequested() {
  FSDPP_ASSIGN_OR_RETURN(const bool set,
                         store_->Check({Key(round_, "restart")}));
  if (!set) return std::optional<std::string>();
  FSDPP_ASSIGN_OR_RETURN(std::string reason,
                         store_->Get(Key(round_, "restart"), options_.timeout));
  return std::optional<std::string>(std::move(reason));
}

absl::Status ElasticRendezvous::RequestRestart(const std::string& reason) {
  FSDPP_ASSIGN_OR_RETURN(const int64_t n,
                         store_->Add(Key(round_, "restart_n"), 1));
  if (n == 1) return store_->Set(Key(round_, "restart"), reason);
  return absl::OkStatus();
}

absl::Status ElasticRendezvous::MarkFinished() {
  return store_->Add(Key(round_, "finished"), 1).status();
}

absl::Status ElasticRendezvous::WaitAllFinished(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    FSDPP_ASSIGN_OR_RETURN(const int64_t done,
                           store_->Add(Key(round_, "finished"), 0));
    if (done >= members_n_) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "elastic rendezvous round ", round_, ": ", done, " of ", members_n_,
          " nodes finished within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPollInterval);
  }
}

}  // namespace launch
}  // namespace fsdpp
