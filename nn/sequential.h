// Sequential: runs its children in order; backward runs them in reverse.
//
// Children are named by position ("0", "1", ...), as in torch.nn.Sequential,
// so a stack of blocks gives names like "blocks.3.mlp.fc.weight". It saves
// nothing itself: each child keeps what its own backward needs.
#ifndef FSDPP_NN_SEQUENTIAL_H_
#define FSDPP_NN_SEQUENTIAL_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y = children[n-1](... children[0](x)).
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  // Takes `modules` as children "0", "1", ... in order.
  explicit Sequential(std::vector<std::unique_ptr<Module>> modules);

  // Appends `module` as the next child (named by its position); returns it.
  template <typename M>
  M* Append(std::unique_ptr<M> module) {
    M* raw = AddModule(std::to_string(layers_.size()), std::move(module));
    layers_.push_back(raw);
    return raw;
  }

  // Number of children.
  size_t size() const { return layers_.size(); }
  // The i-th child.
  Module* at(size_t i) const { return layers_.at(i); }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  // The first child's dx may be undefined (an Embedding); any other child
  // returning an undefined gradient is an error naming it.
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;

 private:
  std::vector<Module*> layers_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_SEQUENTIAL_H_
