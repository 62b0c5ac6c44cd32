#include "core/trace.h"

#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/json_quote.h"

namespace fsdpp {
namespace {

thread_local TraceRecorder* current_trace = nullptr;

}  // namespace

TraceRecorder::TraceRecorder(int pid, std::string process_name)
    : pid_(pid), process_name_(std::move(process_name)) {}

void TraceRecorder::Record(TraceEvent event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = totals_.find(event.category);
  if (it == totals_.end()) {
    totals_.emplace(event.category, event.duration_us);
  } else {
    it->second += event.duration_us;
  }
  if (recording_.load()) events_.push_back(std::move(event));
}

int64_t TraceRecorder::TotalMicros(absl::string_view category) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = totals_.find(category);
  return it == totals_.end() ? 0 : it->second;
}

std::vector<TraceEvent> TraceRecorder::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

size_t TraceRecorder::num_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

void TraceRecorder::ClearEvents() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

std::string TraceRecorder::EventsJson() const {
  const std::vector<TraceEvent> events = this->events();
  std::vector<std::string> parts;
  parts.push_back(
      absl::StrCat("{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":", pid_,
                   ",\"args\":{\"name\":", JsonQuote(process_name_), "}}"));
  parts.push_back(absl::StrCat(
      "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":", pid_,
      ",\"args\":{\"sort_index\":", pid_, "}}"));
  // Tracks become thread ids in first-seen order (the main track first).
  std::map<std::string, int> tids;
  auto tid_of = [&](const std::string& track) {
    auto it = tids.find(track);
    if (it != tids.end()) return it->second;
    const int tid = static_cast<int>(tids.size()) + 1;
    tids.emplace(track, tid);
    parts.push_back(absl::StrCat(
        "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":", pid_,
        ",\"tid\":", tid, ",\"args\":{\"name\":", JsonQuote(track), "}}"));
    parts.push_back(absl::StrCat(
        "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":", pid_,
        ",\"tid\":", tid, ",\"args\":{\"sort_index\":", tid, "}}"));
    return tid;
  };
  tid_of("main");
  for (const TraceEvent& e : events) {
    const int tid = tid_of(e.track);
    std::string event = absl::StrCat(
        "{\"ph\":\"X\",\"name\":", JsonQuote(e.name),
        ",\"cat\":", JsonQuote(e.category), ",\"pid\":", pid_, ",\"tid\":", tid,
        ",\"ts\":", e.start_us, ",\"dur\":", e.duration_us);
    if (!e.detail.empty()) {
      absl::StrAppend(&event, ",\"args\":{\"detail\":", JsonQuote(e.detail),
                      "}");
    }
    event += "}";
    parts.push_back(std::move(event));
  }
  return absl::StrJoin(parts, ",\n");
}

std::string ChromeTraceJson(const std::vector<std::string>& pieces) {
  std::vector<std::string> nonempty;
  for (const std::string& p : pieces) {
    if (!p.empty()) nonempty.push_back(p);
  }
  return absl::StrCat("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n",
                      absl::StrJoin(nonempty, ",\n"), "\n]}\n");
}

absl::Status WriteTraceFile(const std::string& path,
                            const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return absl::PermissionDeniedError(
          absl::StrCat("trace: cannot write ", tmp));
    }
    out << contents;
    out.flush();
    if (!out) {
      return absl::DataLossError(
          absl::StrCat("trace: writing ", tmp, " failed (disk full?)"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("trace: cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

int64_t TraceNowMicros() { return absl::GetCurrentTimeNanos() / 1000; }

TraceRecorder* CurrentTrace() { return current_trace; }

ScopedCurrentTrace::ScopedCurrentTrace(TraceRecorder* recorder)
    : previous_(current_trace) {
  current_trace = recorder;
}

ScopedCurrentTrace::~ScopedCurrentTrace() { current_trace = previous_; }

TraceSpan::TraceSpan(const char* name, const char* category,
                     TraceRecorder* recorder, const char* track)
    : recorder_(recorder),
      name_(name),
      category_(category),
      track_(track),
      start_us_(recorder != nullptr ? TraceNowMicros() : 0) {}

TraceSpan::~TraceSpan() {
  if (recorder_ == nullptr) return;
  const int64_t end = TraceNowMicros();
  recorder_->Record(TraceEvent{name_, category_, track_, start_us_,
                               end - start_us_, std::move(detail_)});
}

}  // namespace fsdpp
