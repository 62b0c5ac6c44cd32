// What the trainer measures and how it reports it: the unigram baseline of
// the data, the measured matmul peak behind MFU, throughput with warm-up
// steps left out, the per-rank memory table, the progress line and the
// metrics JSONL.
//
// MFU = achieved model FLOP/s / peak FLOP/s, per rank. Model FLOPs per token
// come from the model (models::FlopsPerToken: 6 N plus the attention core,
// forward and backward, no recomputation counted). On a GPU the peak comes
// from a table of datasheet numbers; a CPU has no datasheet number that means
// anything for our kernels, so the peak is measured once at start-up: one
// rank-sized matmul (the compute dtype, this rank's threads) timed over a
// fixed budget, with all ranks measuring at the same time so they contend
// for the machine as they do in training. metrics.peak_tflops overrides it.
#ifndef FSDPP_TRAINER_METRICS_H_
#define FSDPP_TRAINER_METRICS_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "trainer/data/token_store.h"

namespace fsdpp {
namespace trainer {

// The cross-entropy (nats) of predicting every token of [begin, end) of
// `tokens` by the tokens' own frequencies in that range: the loss a model
// that learned nothing but the unigram distribution reaches. With a loss
// mask (SFT data) over the loss targets only, as the loss is. 0 for a range
// without any.
double UnigramLoss(const TokenStore& tokens, int64_t begin, int64_t end);

// Step times and tokens, with warm-up steps kept out of the averages.
class ThroughputMeter {
 public:
  // One optimizer step of `seconds` that processed `tokens` (globally).
  void Add(double seconds, int64_t tokens, bool warmup);
  // `seconds` more for the last step Add counted (time spent after it, e.g.
  // waiting for its values from a GPU).
  void AddToLast(double seconds, bool warmup);
  // Tokens per second over the non-warm-up steps (over all steps when every
  // step so far was warm-up; 0 before the first).
  double tokens_per_s() const;
  // Mean seconds per step, same selection.
  double mean_step_s() const;
  // Steps counted in the averages.
  int64_t measured_steps() const;

 private:
  double seconds_ = 0, warm_seconds_ = 0;
  int64_t tokens_ = 0, warm_tokens_ = 0;
  int64_t steps_ = 0, warm_steps_ = 0;
};

// Per-rank memory as the seeds' tables show it: one row per component
// (parameters, gradients, optimizer state, activations, comm buffers,
// other), then total, peak and the bytes held from the system (a caching
// allocator's cache included), one column per rank, in MiB.
// `per_rank[r]` is rank r's allocator statistics.
std::string FormatMemoryTable(const std::vector<MemoryStats>& per_rank,
                              const std::string& title);

// "2h03m", "4m05s", "9s"; "?" for a negative or non-finite value.
std::string FormatEta(double seconds);

// A JSON number, or null for NaN / infinities (JSON has no such numbers).
std::string JsonNumber(double value);

// The metrics JSONL's records, one object per line with a "kind" (read by
// tools/plot and by whoever reads the file): the schema is here, once.
//
// {"kind":"run", ...}: the run's header, once per start (a resumed run
// appends another).
struct RunRecord {
  std::string model;
  int world_size = 0;
  int64_t params = 0, tokens_per_step = 0, steps = 0, start_step = 0;
  int64_t trainable_params = 0;  // params minus the frozen ones
  double unigram_loss = 0, peak_tflops_per_rank = 0, flops_per_token = 0;
};
// {"kind":"train", ...}: one logged optimizer step. The loss scale and
// whether the step was skipped appear only with f16 (has_loss_scale).
struct TrainRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0, tokens_per_s_per_rank = 0, tflops_per_rank = 0;
  double mfu = 0, step_time_s = 0, exposed_comm_s = 0, elapsed_s = 0;
  bool warmup = false;
  bool has_loss_scale = false;
  double loss_scale = 1;
  bool skipped = false;
  // On a GPU: the times the host blocked on it during the step (the loss
  // and gradient-norm readbacks included); -1 (not written) on the CPU.
  int64_t host_syncs = -1;
  // A mixture of experts (trainer.h StepLog): the auxiliary loss and the
  // tokens per expert; written when expert_tokens is not empty.
  double aux_loss = 0;
  std::vector<int64_t> expert_tokens;
};
// {"kind":"val", ...}: one validation.
struct ValidationRecord {
  int64_t step = 0;
  double val_loss = 0;
};
// {"kind":"profile", ...}: one op of the --profile_steps table (rank 0's
// spans, core/trace.h's OpProfile), per profiled step.
struct ProfileRecord {
  std::string op, category;
  int64_t steps = 0;
  double calls_per_step = 0, self_ms_per_step = 0, total_ms_per_step = 0;
  double share_of_step = 0;  // self time / step time
};
// {"kind":"summary", ...}: the run's end (val_loss null without one).
struct SummaryRecord {
  int64_t steps = 0;
  double loss = 0, val_loss = 0;
  double tokens_per_s = 0, tokens_per_s_per_rank = 0, tflops_per_rank = 0;
  double mfu = 0, exposed_comm_s_per_step = 0;
  // Mean over the measured (non-warm-up) steps.
  double step_time_s = 0;
  // On a GPU: the host's waits on it over the run's steps; -1 leaves it out.
  int64_t host_syncs = -1;
};
// Each record as its JSON line (no newline); non-finite numbers are null.
std::string ToJson(const RunRecord& r);
std::string ToJson(const TrainRecord& r);
std::string ToJson(const ValidationRecord& r);
std::string ToJson(const SummaryRecord& r);
std::string ToJson(const ProfileRecord& r);

// Appends lines to a file, flushing each (a crash loses at most the line
// being written).
class JsonlWriter {
 public:
  // Opens `path` for appending (creating its directory). An error names the
  // path.
  static absl::StatusOr<std::unique_ptr<JsonlWriter>> Open(
      const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  // Writes `json` and a newline.
  absl::Status Write(const std::string& json);
  // Writes a record's line.
  template <typename Record>
  absl::Status WriteRecord(const Record& record) {
    return Write(ToJson(record));
  }
  const std::string& path() const { return path_; }

 private:
  JsonlWriter(std::string path, std::FILE* file)
      : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
};

// The directory part of `path` ("" when none).
std::string DirName(const std::string& path);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_METRICS_H_
