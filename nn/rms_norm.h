// RmsNorm over the last dim (Llama), with an explicit backward.
//
// Forward saves its input (by handle, no copy) and the per-row reciprocal RMS
// (f32, tagged kActivations). Compute follows the input dtype; a weight of
// another dtype is cast for the call. In namespace fsdpp::nn because
// tensor/ops.h has the op fsdpp::RmsNorm.
#ifndef FSDPP_NN_RMS_NORM_H_
#define FSDPP_NN_RMS_NORM_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y = x / sqrt(mean(x^2) + eps) * weight, per row of x [.., dim].
class RmsNorm : public Module {
 public:
  // weight [dim] = 1, of `dtype`.
  explicit RmsNorm(int64_t dim, float eps = 1e-6f, DType dtype = DType::kF32);

  // Normalised width and epsilon, as constructed.
  int64_t dim() const { return dim_; }
  float eps() const { return eps_; }
  // The scale [dim].
  Parameter* weight() const { return weight_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&saved_x_, &saved_rstd_};
  }

 private:
  int64_t dim_;
  float eps_;
  Parameter* weight_;
  // Saved by Forward for Backward.
  Tensor saved_x_;
  Tensor saved_rstd_;  // f32 [rows]
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_RMS_NORM_H_
