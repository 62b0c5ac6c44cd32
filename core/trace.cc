#include "core/trace.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/json_quote.h"

namespace fsdpp {
namespace {

thread_local TraceRecorder* current_trace = nullptr;
thread_local OpProfile* current_profile = nullptr;
// The innermost open profiled span of this thread.
thread_local trace_internal::ProfileFrame* open_frame = nullptr;

int64_t MonotonicNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
      start_us_(recorder != nullptr ? TraceNowMicros() : 0) {
  if (OpProfile* profile = CurrentOpProfile(); profile != nullptr) {
    trace_internal::Open(&frame_, profile);
  }
}

TraceSpan::~TraceSpan() {
  if (frame_.profile != nullptr) {
    trace_internal::Close(&frame_, name_, category_);
  }
  if (recorder_ == nullptr) return;
  const int64_t end = TraceNowMicros();
  recorder_->Record(TraceEvent{name_, category_, track_, start_us_,
                               end - start_us_, std::move(detail_)});
}

void OpSpan::Start(const char* name, const char* category, OpProfile* profile,
                   TraceRecorder* recorder) {
  name_ = name;
  category_ = category;
  if (recorder != nullptr && recorder->recording()) {
    recorder_ = recorder;
    start_us_ = TraceNowMicros();
  }
  if (profile != nullptr) trace_internal::Open(&frame_, profile);
}

void OpSpan::Finish() {
  if (frame_.profile != nullptr) {
    trace_internal::Close(&frame_, name_, category_);
  }
  if (recorder_ != nullptr) {
    recorder_->Record(TraceEvent{name_, category_, "main", start_us_,
                                 TraceNowMicros() - start_us_, ""});
  }
}

namespace trace_internal {

void Open(ProfileFrame* frame, OpProfile* profile) {
  frame->profile = profile;
  frame->parent = open_frame;
  frame->child_ns = 0;
  open_frame = frame;
  frame->start_ns = MonotonicNanos();
}

void Close(ProfileFrame* frame, const char* name, const char* category) {
  const int64_t total = MonotonicNanos() - frame->start_ns;
  // Spans close in reverse order of opening on one thread; a frame of
  // another profile (one installed inside this span) is not this one's.
  open_frame = frame->parent;
  if (frame->parent != nullptr && frame->parent->profile == frame->profile) {
    frame->parent->child_ns += total;
  }
  frame->profile->Add(name, category,
                      std::max<int64_t>(0, total - frame->child_ns), total);
}

}  // namespace trace_internal

void OpProfile::Add(const char* name, const char* category, int64_t self_ns,
                    int64_t total_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  Row& row = rows_[name];
  if (row.calls == 0) {
    row.name = name;
    row.category = category;
  }
  ++row.calls;
  row.self_ns += self_ns;
  row.total_ns += total_ns;
}

std::vector<OpProfile::Row> OpProfile::Rows() const {
  std::map<std::pair<std::string, std::string>, Row> merged;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, row] : rows_) {
      Row& m = merged[{row.name, row.category}];
      m.name = row.name;
      m.category = row.category;
      m.calls += row.calls;
      m.self_ns += row.self_ns;
      m.total_ns += row.total_ns;
    }
  }
  std::vector<Row> rows;
  rows.reserve(merged.size());
  for (auto& [key, row] : merged) rows.push_back(std::move(row));
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.self_ns > b.self_ns;
  });
  return rows;
}

void OpProfile::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  rows_.clear();
}

OpProfile* CurrentOpProfile() { return current_profile; }

ScopedOpProfile::ScopedOpProfile(OpProfile* profile)
    : previous_(current_profile) {
  current_profile = profile;
}

ScopedOpProfile::~ScopedOpProfile() { current_profile = previous_; }

std::string FormatOpTable(const std::vector<OpProfile::Row>& rows,
                          int64_t step_ns, int64_t steps, int max_rows) {
  const double per_step = steps > 0 ? 1.0 / steps : 0.0;
  const double step_ms = step_ns * per_step / 1e6;
  auto share = [&](int64_t ns) {
    return step_ns > 0 ? 100.0 * ns / step_ns : 0.0;
  };
  std::string out = absl::StrFormat("%-34s %-10s %9s %12s %12s %7s\n",
                                    "op (self time: nested spans "
                                    "excluded)",
                                    "category", "calls/step", "self ms/step",
                                    "total ms/step", "% step");
  std::map<std::string, int64_t> categories;
  int64_t spanned = 0;
  int shown = 0;
  for (const OpProfile::Row& r : rows) {
    categories[r.category] += r.self_ns;
    spanned += r.self_ns;
    if (shown++ >= max_rows) continue;
    absl::StrAppendFormat(&out, "%-34s %-10s %9.1f %12.3f %12.3f %6.1f%%\n",
                          r.name, r.category, r.calls * per_step,
                          r.self_ns * per_step / 1e6,
                          r.total_ns * per_step / 1e6, share(r.self_ns));
  }
  if (shown > max_rows) {
    absl::StrAppendFormat(&out, "(%d more ops)\n", shown - max_rows);
  }
  std::vector<std::pair<int64_t, std::string>> by_time;
  for (const auto& [name, ns] : categories) by_time.push_back({ns, name});
  std::sort(by_time.rbegin(), by_time.rend());
  absl::StrAppendFormat(
      &out, "step %.3f ms (mean of %d); by category:", step_ms, steps);
  for (const auto& [ns, name] : by_time) {
    absl::StrAppendFormat(&out, " %s %.1f%%", name, share(ns));
  }
  absl::StrAppendFormat(&out, "; in no span %.1f%%\n",
                        share(std::max<int64_t>(0, step_ns - spanned)));
  return out;
}

}  // namespace fsdpp
