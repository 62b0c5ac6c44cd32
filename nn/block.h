// Pre-norm residual transformer block (GPT-2, Llama):
//   y = x + attn(norm1(x));  z = y + mlp(norm2(y)).
//
// The four parts are arbitrary Modules mapping [.., C] -> [.., C] (so the
// block does not depend on a particular attention, norm or MLP, and tests can
// stand a Linear in for attention). The residual sums are fresh buffers: a
// child's output is never written in place, since a child may have saved it.
// Backward adds the residual gradient to each branch's input gradient.
#ifndef FSDPP_NN_BLOCK_H_
#define FSDPP_NN_BLOCK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// Children "norm1", "attn", "norm2", "mlp", in that order.
// The children's names of a Block (they appear in the parameters' qualified
// names).
struct BlockChildNames {
  std::string norm1 = "norm1", attn = "attn", norm2 = "norm2", mlp = "mlp";
};

class Block : public Module {
 public:
  using ChildNames = BlockChildNames;

  // All four must be non-null. `kind` names the module in messages.
  Block(std::unique_ptr<Module> norm1, std::unique_ptr<Module> attn,
        std::unique_ptr<Module> norm2, std::unique_ptr<Module> mlp,
        const ChildNames& names = BlockChildNames(),
        const std::string& kind = "Block");

  // The children, as given to the constructor.
  Module* norm1() const { return norm1_; }
  Module* attn() const { return attn_; }
  Module* norm2() const { return norm2_; }
  Module* mlp() const { return mlp_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dz) override;

 private:
  Module* norm1_;
  Module* attn_;
  Module* norm2_;
  Module* mlp_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_BLOCK_H_
