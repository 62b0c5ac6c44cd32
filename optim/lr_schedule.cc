// Learning-rate schedules; see lr_schedule.h.
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/logging.h"

namespace fsdpp {

absl::StatusOr<LrSchedule> LrSchedule::Create(const LrScheduleOptions& o) {
  if (!std::isfinite(o.base_lr) || o.base_lr < 0.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LrSchedule: base_lr must be finite and >= 0, got ", o.base_lr));
  }
  if (o.warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LrSchedule: warmup_steps must be >= 0, got ", o.warmup_steps));
  }
  if (o.decay != LrDecay::kConstant) {
    if (!(o.min_lr_ratio >= 0.0 && o.min_lr_ratio <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LrSchedule: min_lr_ratio must be in [0, 1], got ", o.min_lr_ratio));
    }
    if (o.total_steps < o.warmup_steps) {
      return absl::InvalidArgumentError(
          absl::StrCat("LrSchedule: total_steps (", o.total_steps,
                       ") must be >= warmup_steps (", o.warmup_steps, ")"));
    }
  }
  return LrSchedule(o);
}

double LrSchedule::LrAt(int64_t step) const {
  CHECK_GE(step, 0) << "LrSchedule::LrAt: negative step";
  const LrScheduleOptions& o = options_;
  if (step < o.warmup_steps) {
    return o.base_lr * static_cast<double>(step + 1) /
           static_cast<double>(o.warmup_steps);
  }
  if (o.decay == LrDecay::kConstant) return o.base_lr;
  const double min_lr = o.base_lr * o.min_lr_ratio;
  const int64_t span = o.total_steps - o.warmup_steps;
  const double progress =
      span > 0 ? std::min(1.0, static_cast<double>(step - o.warmup_steps) /
                                   static_cast<double>(span))
               : 1.0;
  if (o.decay == LrDecay::kLinear) {
    return min_lr + (o.base_lr - min_lr) * (1.0 - progress);
  }
  return min_lr +
         (o.base_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace fsdpp
