// Sequential container; see sequential.h.
#include "nn/sequential.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace nn {

Sequential::Sequential(std::vector<std::unique_ptr<Module>> modules)
    : Sequential() {
  for (std::unique_ptr<Module>& m : modules) Append(std::move(m));
}

absl::StatusOr<Tensor> Sequential::ForwardImpl(const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    absl::StatusOr<Tensor> next = layers_[i]->Forward(h);
    if (!next.ok()) return Annotate(next.status(), absl::StrCat("child ", i));
    h = *std::move(next);
  }
  return h;
}

absl::StatusOr<Tensor> Sequential::BackwardImpl(const Tensor& dy) {
  Tensor g = dy;
  for (size_t i = layers_.size(); i-- > 0;) {
    if (!g.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "child ", i + 1, " (", layers_[i + 1]->kind(),
          ") returned no input gradient but is not the first child"));
    }
    absl::StatusOr<Tensor> next = layers_[i]->Backward(g);
    if (!next.ok()) return Annotate(next.status(), absl::StrCat("child ", i));
    g = *std::move(next);
  }
  return g;
}

}  // namespace nn
}  // namespace fsdpp
