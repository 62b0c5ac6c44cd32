// Embedding layer; see embedding.h.
#include "nn/embedding.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {

Embedding::Embedding(int64_t num_embeddings, int64_t dim, float init_std,
                     DType dtype)
    : Module("Embedding"), num_embeddings_(num_embeddings), dim_(dim) {
  weight_ = AddParameter("weight", {num_embeddings, dim},
                         InitSpec::Normal(init_std), dtype);
}

EmbeddingRows Embedding::Rows() const {
  if (!weight_->has_piece()) return {};
  return {weight_->piece.offset[0], num_embeddings_};
}

absl::StatusOr<Tensor> Embedding::ForwardImpl(const Tensor& ids) {
  if (!ids.defined() ||
      (ids.dtype() != DType::kI32 && ids.dtype() != DType::kI64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ids must be i32 or i64, got ", ids.ToString()));
  }
  Shape out_shape = ids.shape();
  out_shape.push_back(weight_->LocalShape()[1]);
  FSDPP_ASSIGN_OR_RETURN(
      Tensor y,
      EmptyActivation(out_shape, weight_->data.dtype(), ids.device()));
  FSDPP_RETURN_IF_ERROR(fsdpp::Embedding(ids, weight_->data, &y, Rows()));
  saved_ids_ = ids;
  return y;
}

absl::StatusOr<Tensor> Embedding::BackwardImpl(const Tensor& dy) {
  if (!saved_ids_.defined()) return NoSavedForward(kind());
  Shape out_shape = saved_ids_.shape();
  out_shape.push_back(weight_->LocalShape()[1]);
  if (!dy.defined() || dy.shape() != out_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dy must be ", ShapeToString(out_shape), ", got ", dy.ToString()));
  }
  if (weight_->requires_grad) {
    FSDPP_ASSIGN_OR_RETURN(GradSink dw,
                           GradSink::For(weight_, dy.dtype(), false));
    FSDPP_RETURN_IF_ERROR(
        EmbeddingBackward(saved_ids_, dy, dw.target(), Rows()));
    FSDPP_RETURN_IF_ERROR(dw.Commit());
  }
  saved_ids_ = Tensor();
  return Tensor();
}

}  // namespace nn
}  // namespace fsdpp
