// Transformer feed-forward blocks: the GPT-2 MLP (GELU, tanh approximation)
// and the Llama SwiGLU, with explicit backward.
//
// The projections are child Linear modules (so their hooks fire and FSDP can
// treat them like any other submodule); only the elementwise part is done
// here. To keep activation memory low, SwiGlu saves the two projection
// outputs and recomputes silu(gate) in backward instead of saving it.
#ifndef FSDPP_NN_MLP_H_
#define FSDPP_NN_MLP_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/linear.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y = proj(gelu(fc(x))): children "fc" Linear(dim, hidden) and "proj"
// Linear(hidden, dim), both with bias. hidden = 0 means 4 * dim (GPT-2).
class Mlp : public Module {
 public:
  // fc's weight ~ Normal(0, init_std), proj's ~ Normal(0, proj_init_std)
  // (GPT-2 scales it by 1 / sqrt(2 n_layers)); parameters of `dtype`.
  explicit Mlp(int64_t dim, int64_t hidden = 0, float init_std = 0.02f,
               float proj_init_std = 0.02f, DType dtype = DType::kF32);

  // The child projections.
  Linear* fc() const { return fc_; }
  Linear* proj() const { return proj_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override { return {&saved_h_}; }

 private:
  Linear* fc_;
  Linear* proj_;
  Tensor saved_h_;  // fc's output (GELU's input).
};

// y = down(silu(gate(x)) * up(x)): children "gate" and "up" Linear(dim,
// hidden) and "down" Linear(hidden, dim), none with bias.
class SwiGlu : public Module {
 public:
  // gate's and up's weights ~ Normal(0, init_std), down's ~ Normal(0,
  // down_init_std); parameters of `dtype`.
  SwiGlu(int64_t dim, int64_t hidden, float init_std = 0.02f,
         float down_init_std = 0.02f, DType dtype = DType::kF32);

  // The child projections.
  Linear* gate() const { return gate_; }
  Linear* up() const { return up_; }
  Linear* down() const { return down_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&saved_gate_, &saved_up_};
  }

 private:
  Linear* gate_;
  Linear* up_;
  Linear* down_;
  Tensor saved_gate_;  // gate(x)
  Tensor saved_up_;    // up(x)
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_MLP_H_
