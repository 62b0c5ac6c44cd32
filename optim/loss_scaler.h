// Dynamic loss scaling for fp16 training (torch.cuda.amp.GradScaler).
//
// The loss is multiplied by scale() before backward so small fp16 gradients
// do not flush to zero; UnscaleAndCheck() divides the gradients back and
// reports whether any rank saw an inf or NaN. The decision must be the same
// on every rank (a rank stepping alone would desynchronise the replicas and
// shards), so the per-rank flags go through ONE all-reduce (max) over the
// whole mesh. Update() then backs the scale off after an overflow and grows
// it after growth_interval clean steps in a row, with torch's exact rules;
// the scale is kept in f32 like torch's.
#ifndef FSDPP_OPTIM_LOSS_SCALER_H_
#define FSDPP_OPTIM_LOSS_SCALER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tensor/dtensor.h"

namespace fsdpp {

// GradScaler's defaults.
struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16.
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // InvalidArgument unless init_scale is finite and > 0, growth_factor > 1,
  // backoff_factor in (0, 1) and growth_interval >= 1.
  static absl::StatusOr<LossScaler> Create(const LossScalerOptions& options);

  // The factor to multiply the loss by before backward.
  float scale() const { return scale_; }
  // Clean steps since the last growth or backoff.
  int64_t growth_tracker() const { return growth_tracker_; }

  // Multiplies every grad's local shard (f32, on one mesh) in place by
  // 1 / scale() and returns whether the optimizer should step: false when any
  // element on any rank of the mesh was inf or NaN. One all-reduce of a flag
  // over the mesh's flat group, so every rank must call it with the same
  // list. An empty list checks nothing and returns true.
  absl::StatusOr<bool> UnscaleAndCheck(
      const std::vector<DTensor*>& grads,
      absl::Duration timeout = absl::Minutes(30));

  // Adjusts the scale after a step: found_inf halves it (backoff_factor) and
  // restarts the count; otherwise the count grows and, at growth_interval,
  // the scale is multiplied by growth_factor (if that stays finite) and the
  // count restarts.
  void Update(bool found_inf);

  // Restores a saved state (checkpoint resume); InvalidArgument unless scale
  // is finite and > 0 and growth_tracker is in [0, growth_interval).
  absl::Status Restore(float scale, int64_t growth_tracker);

 private:
  explicit LossScaler(const LossScalerOptions& options)
      : options_(options), scale_(static_cast<float>(options.init_scale)) {}

  LossScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace fsdpp

#endif  // FSDPP_OPTIM_LOSS_SCALER_H_
