// Tracing of compute and communication as Chrome trace events (the JSON
// format Perfetto and chrome://tracing open), plus always-on per-category
// time totals (e.g. the time the training thread spent waiting for
// collectives: the exposed communication time), plus an op profile: per
// named span, its calls and its self time (time in no span nested inside
// it), like PyTorch profiler's key_averages() table.
//
// A TraceRecorder belongs to one rank. The thread that trains installs it as
// its thread's current recorder (ScopedCurrentTrace); TraceSpans on that
// thread record into it, and collectives issued from that thread capture it
// at issue time and record their execution on the comm thread that runs
// them, on a track named after that thread's stream. So ranks that are
// threads of one process (tests) keep separate traces.
//
// Events are only stored while recording is enabled (a chosen window of
// steps); totals are kept whenever a recorder is current. Timestamps are
// wall-clock microseconds, so the traces of processes on one machine line
// up.
#ifndef FSDPP_CORE_TRACE_H_
#define FSDPP_CORE_TRACE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fsdpp {

// One complete event ("ph": "X").
struct TraceEvent {
  std::string name;
  std::string category;  // e.g. "compute", "comm", "comm_wait"
  std::string track;     // the row it is drawn on (a thread or stream)
  int64_t start_us = 0;  // wall clock
  int64_t duration_us = 0;
  std::string detail;  // optional, shown as args.detail
};

class TraceRecorder {
 public:
  // `pid` identifies the rank in a merged trace; `process_name` labels it.
  TraceRecorder(int pid, std::string process_name);

  // Starts / stops storing events (totals are kept either way).
  void SetRecording(bool recording) { recording_.store(recording); }
  bool recording() const { return recording_.load(); }

  // Adds an event (stored only while recording) and its duration to the
  // total of its category. Thread-safe.
  void Record(TraceEvent event);

  // Microseconds spent in events of `category` so far (recording or not).
  int64_t TotalMicros(absl::string_view category) const;

  // The stored events, in the order recorded.
  std::vector<TraceEvent> events() const;
  size_t num_events() const;
  // Drops the stored events.
  void ClearEvents();

  int pid() const { return pid_; }
  const std::string& process_name() const { return process_name_; }

  // This recorder's events as a JSON array body (comma-separated event
  // objects, no brackets), with process and track name metadata; pieces of
  // several ranks are joined by ChromeTraceJson.
  std::string EventsJson() const;

 private:
  const int pid_;
  const std::string process_name_;
  std::atomic<bool> recording_{false};
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
  std::map<std::string, int64_t, std::less<>> totals_;
};

// A complete Chrome trace document from EventsJson() pieces (empty pieces
// are skipped).
std::string ChromeTraceJson(const std::vector<std::string>& pieces);

// Writes `contents` to `path` (via a temporary file and a rename).
absl::Status WriteTraceFile(const std::string& path,
                            const std::string& contents);

// Wall-clock microseconds.
int64_t TraceNowMicros();

// The calling thread's current recorder, or nullptr.
TraceRecorder* CurrentTrace();

// Makes `recorder` the calling thread's current recorder for its lifetime
// (restoring the previous one after).
class ScopedCurrentTrace {
 public:
  explicit ScopedCurrentTrace(TraceRecorder* recorder);
  ~ScopedCurrentTrace();
  ScopedCurrentTrace(const ScopedCurrentTrace&) = delete;
  ScopedCurrentTrace& operator=(const ScopedCurrentTrace&) = delete;

 private:
  TraceRecorder* previous_;
};

// Calls and times of the spans (TraceSpan, OpSpan) of the threads it is
// current on, by name. A span's self time is its time minus that of the
// spans nested inside it on its thread, so the self times of a step's spans
// add up to the outermost span's time. Thread-safe.
class OpProfile {
 public:
  struct Row {
    std::string name;
    std::string category;
    int64_t calls = 0;
    int64_t self_ns = 0;
    int64_t total_ns = 0;  // with nested spans (recursion counted once each)
  };

  // Adds one finished span.
  void Add(const char* name, const char* category, int64_t self_ns,
           int64_t total_ns);
  // The rows, merged by (name, category), largest self time first.
  std::vector<Row> Rows() const;
  void Clear();

 private:
  mutable std::mutex mu_;
  // Keyed by the span's name literal; merged by text in Rows().
  absl::flat_hash_map<const char*, Row> rows_;
};

// The calling thread's current op profile, or nullptr.
OpProfile* CurrentOpProfile();

// Makes `profile` the calling thread's current op profile for its lifetime
// (restoring the previous one after; nullptr turns profiling off).
class ScopedOpProfile {
 public:
  explicit ScopedOpProfile(OpProfile* profile);
  ~ScopedOpProfile();
  ScopedOpProfile(const ScopedOpProfile&) = delete;
  ScopedOpProfile& operator=(const ScopedOpProfile&) = delete;

 private:
  OpProfile* previous_;
};

// A text table of `rows` (Rows()' order): per op its calls, self time per
// step and share of `step_ns` (the measured steps' time over `steps`
// steps), then the shares of the categories. At most `max_rows` ops.
std::string FormatOpTable(const std::vector<OpProfile::Row>& rows,
                          int64_t step_ns, int64_t steps, int max_rows = 25);

namespace trace_internal {
// One open span of a thread's op profile (a stack through `parent`).
struct ProfileFrame {
  OpProfile* profile = nullptr;
  int64_t start_ns = 0;
  int64_t child_ns = 0;
  ProfileFrame* parent = nullptr;
};
void Open(ProfileFrame* frame, OpProfile* profile);
void Close(ProfileFrame* frame, const char* name, const char* category);
}  // namespace trace_internal

// Records [construction, destruction) into `recorder` (default: the calling
// thread's current one; nothing when there is none) and into the thread's
// op profile when one is current. `name` and `category` must outlive the
// span (string literals).
class TraceSpan {
 public:
  TraceSpan(const char* name, const char* category,
            TraceRecorder* recorder = CurrentTrace(),
            const char* track = "main");
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  // Extra text for the event's args (e.g. bytes moved).
  void set_detail(std::string detail) { detail_ = std::move(detail); }

 private:
  TraceRecorder* recorder_;
  const char* name_;
  const char* category_;
  const char* track_;
  int64_t start_us_;
  std::string detail_;
  trace_internal::ProfileFrame frame_;
};

// A fine-grained span (one kernel call: a matmul, a norm, a copy): recorded
// into the thread's op profile when one is current, and as a trace event
// only while the thread's recorder is recording (no per-category total, so
// it costs two thread-local reads when neither is on). String literals.
class OpSpan {
 public:
  explicit OpSpan(const char* name, const char* category = "op") {
    OpProfile* profile = CurrentOpProfile();
    TraceRecorder* recorder = CurrentTrace();
    if (profile == nullptr && (recorder == nullptr || !recorder->recording())) {
      return;
    }
    Start(name, category, profile, recorder);
  }
  ~OpSpan() {
    if (name_ != nullptr) Finish();
  }
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;

 private:
  void Start(const char* name, const char* category, OpProfile* profile,
             TraceRecorder* recorder);
  void Finish();

  const char* name_ = nullptr;
  const char* category_ = nullptr;
  TraceRecorder* recorder_ = nullptr;  // only while recording
  int64_t start_us_ = 0;
  trace_internal::ProfileFrame frame_;
};

}  // namespace fsdpp

#endif  // FSDPP_CORE_TRACE_H_
