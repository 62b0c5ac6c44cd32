// LayerNorm over the last dim, with an explicit backward.
//
// Forward saves its input (by handle, no copy) and the per-row mean and
// reciprocal std (f32, tagged kActivations) so Backward does not recompute
// the statistics. Compute follows the input dtype; weight and bias of another
// dtype are cast for the call. In namespace fsdpp::nn because tensor/ops.h
// has the op fsdpp::LayerNorm.
#ifndef FSDPP_NN_LAYER_NORM_H_
#define FSDPP_NN_LAYER_NORM_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y = (x - mean) / sqrt(var + eps) * weight + bias, per row of x [.., dim].
class LayerNorm : public Module {
 public:
  // weight [dim] = 1 and, with `bias`, bias [dim] = 0, of `dtype`.
  explicit LayerNorm(int64_t dim, float eps = 1e-5f, bool bias = true,
                     DType dtype = DType::kF32);

  // Normalised width and epsilon, as constructed.
  int64_t dim() const { return dim_; }
  float eps() const { return eps_; }
  // The scale [dim].
  Parameter* weight() const { return weight_; }
  // The bias, or nullptr without one.
  Parameter* bias() const { return bias_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&saved_x_, &saved_mean_, &saved_rstd_};
  }

 private:
  int64_t dim_;
  float eps_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  // Saved by Forward for Backward.
  Tensor saved_x_;
  Tensor saved_mean_;  // f32 [rows]
  Tensor saved_rstd_;  // f32 [rows]
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LAYER_NORM_H_
