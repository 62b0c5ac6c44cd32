// Learning-rate schedules: linear warmup, then cosine or linear decay to a
// floor, or constant (the schedules of nanoGPT, llm.c and torchtitan).
//
// A schedule is a pure function of the step, so resuming from a checkpoint
// needs only the optimizer's step counter. `step` is the 0-based index of the
// step about to be taken (AdamW::step() before Step()); warmup is
// base_lr * (step + 1) / warmup_steps, so the very first step already has a
// non-zero rate and step warmup_steps - 1 reaches base_lr.
#ifndef FSDPP_OPTIM_LR_SCHEDULE_H_
#define FSDPP_OPTIM_LR_SCHEDULE_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace fsdpp {

// What follows the warmup.
enum class LrDecay {
  kCosine,    // base -> min along half a cosine.
  kLinear,    // base -> min along a straight line.
  kConstant,  // base forever (total_steps and min_lr_ratio unused).
};

struct LrScheduleOptions {
  double base_lr = 1e-3;      // Peak rate, reached at the end of warmup.
  int64_t warmup_steps = 0;   // 0: start at base_lr.
  int64_t total_steps = 0;    // Step at which decay reaches the floor.
  double min_lr_ratio = 0.0;  // Floor = base_lr * min_lr_ratio.
  LrDecay decay = LrDecay::kCosine;
};

class LrSchedule {
 public:
  // InvalidArgument unless base_lr is finite and >= 0, warmup_steps >= 0,
  // min_lr_ratio in [0, 1] and (for decays) total_steps >= warmup_steps.
  static absl::StatusOr<LrSchedule> Create(const LrScheduleOptions& options);

  // The rate for 0-based `step` (>= 0): warmup below warmup_steps, then the
  // decay over [warmup_steps, total_steps], then the floor.
  double LrAt(int64_t step) const;

  // The options it was created with.
  const LrScheduleOptions& options() const { return options_; }

 private:
  explicit LrSchedule(const LrScheduleOptions& options) : options_(options) {}
  LrScheduleOptions options_;
};

}  // namespace fsdpp

#endif  // FSDPP_OPTIM_LR_SCHEDULE_H_
