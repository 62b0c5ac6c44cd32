// Linear: y = x W^T + b over the last dim of x (leading dims are flattened
// into rows), with an explicit backward.
//
// The weight is [out, in] (PyTorch layout), so a tied LM head can reuse an
// embedding table [V, C] as-is: the shared-weight constructor registers the
// table with ShareParameter, so it is listed (and initialised, sharded,
// checkpointed) once, under the embedding's name, and both layers accumulate
// into the same Parameter::grad. The bias is added in the matmul's own pass
// (MatmulOptions::bias), so a bf16 output is rounded once. Compute follows
// the input dtype; parameters of another dtype are cast for the call.
//
// LoRA (EnableLora): y = x W^T + b + (alpha / r) (x A^T) B^T with two child
// Linears, lora_A [r, in] ~ Uniform(+-1/sqrt(in)) (PEFT's Kaiming-uniform
// default) and lora_B [out, r] = 0, named "<this>.lora_A.weight" and
// "<this>.lora_B.weight" (PEFT's names); the base weight and bias are
// frozen (requires_grad false). With dropout p the adapter's input is
// dropped (nn/dropout.h: keyed by the batch's rows, which a training
// forward installs, and this layer's key; nothing is dropped without
// them), PEFT's lora_dropout.
#ifndef FSDPP_NN_LINEAR_H_
#define FSDPP_NN_LINEAR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

struct DropoutRows;

// y[.., out] = x[.., in] W^T + b.
class Linear : public Module {
 public:
  // Owns weight [out_features, in_features] ~ Normal(0, init_std) and, with
  // `bias`, bias [out_features] = 0, both of `dtype`. Change weight()->init
  // before InitWeights for another distribution.
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         float init_std = 0.02f, DType dtype = DType::kF32);
  // Uses `shared_weight` ([out, in], owned by another module that must
  // outlive this one) as the weight: tied weights. With `bias`, owns a zero
  // bias [out] of the weight's dtype.
  explicit Linear(Parameter* shared_weight, bool bias = false);

  // Input and output widths.
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  // The weight (owned or shared).
  Parameter* weight() const { return weight_; }
  // The bias, or nullptr without one.
  Parameter* bias() const { return bias_; }
  // False when the weight is shared from another module.
  bool owns_weight() const { return owns_weight_; }
  // The widths this process computes with: the weight piece's under tensor
  // parallelism (Parameter::LocalShape), otherwise the whole.
  int64_t local_in_features() const { return weight_->LocalShape()[1]; }
  int64_t local_out_features() const { return weight_->LocalShape()[0]; }
  // Whether Forward adds the bias (default true). Row-wise tensor
  // parallelism sums the ranks' outputs, so only one rank adds it; Backward
  // computes the bias gradient either way.
  void set_add_bias_in_forward(bool add) { add_bias_in_forward_ = add; }

  // Adds a rank-`rank` adapter scaled by alpha / rank and freezes the base
  // (see the file comment); on the meta device like any new parameter.
  // `dropout` in [0, 1) on the adapter's input, masked by `dropout_key`
  // (one per layer: models::AddLoraAdapters hashes the layer's name).
  // FailedPrecondition for a shared (tied) weight, a tensor-parallel piece
  // or a second adapter; InvalidArgument for rank < 1 or such a dropout.
  absl::Status EnableLora(int64_t rank, float alpha, float dropout = 0.0f,
                          uint64_t dropout_key = 0);
  // The adapter's layers (nullptr without one) and its scale alpha / r.
  Linear* lora_a() const { return lora_a_; }
  Linear* lora_b() const { return lora_b_; }
  float lora_scale() const { return lora_scale_; }
  float lora_dropout() const { return lora_dropout_; }
  uint64_t lora_dropout_key() const { return lora_dropout_key_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override { return {&saved_x_}; }

 private:
  // The adapter's input: x, or x dropped (dropout under installed rows).
  absl::StatusOr<Tensor> LoraInput(const Tensor& x) const;
  // The same mask on the adapter's input gradient, in place.
  absl::Status LoraInputGradient(Tensor* dx) const;
  // KeyedDropout of `in` into `out` under `rows` with this layer's p, key
  // and the features' place in the whole layer.
  absl::Status LoraDropout(const Tensor& in, const DropoutRows& rows,
                           Tensor* out) const;

  int64_t in_features_;
  int64_t out_features_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  bool owns_weight_ = true;
  bool add_bias_in_forward_ = true;
  Linear* lora_a_ = nullptr;
  Linear* lora_b_ = nullptr;
  float lora_scale_ = 0.0f;
  float lora_dropout_ = 0.0f;
  uint64_t lora_dropout_key_ = 0;
  Tensor saved_x_;  // Forward's input (undefined outside forward..backward).
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_LINEAR_H_
