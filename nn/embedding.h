// Embedding: a lookup table mapping integer ids to rows, with a scatter-add
// backward.
//
// Forward takes the ids tensor itself as its input (i32 or i64, any shape,
// typically [B, T]) and returns [.., dim] in the table's dtype. The ids have
// no gradient, so Backward returns an undefined Tensor; a Sequential that
// starts with an Embedding therefore ends its backward there. The layers live
// in namespace fsdpp::nn: tensor/ops.h has free functions fsdpp::Embedding,
// LayerNorm and RmsNorm, which would hide same-named classes in fsdpp.
#ifndef FSDPP_NN_EMBEDDING_H_
#define FSDPP_NN_EMBEDDING_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/module.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// y[.., :] = weight[ids[..], :]. Under tensor parallelism the table may be
// a piece (Parameter::SetPiece): rows [r0, r1) give y = weight row for ids in
// range and zeros otherwise (the ranks' outputs sum to the whole lookup);
// all rows and a range of columns give those columns of y.
class Embedding : public Module {
 public:
  // Table weight [num_embeddings, dim] ~ Normal(0, init_std), of `dtype`.
  Embedding(int64_t num_embeddings, int64_t dim, float init_std = 0.02f,
            DType dtype = DType::kF32);

  // Rows of the table (vocabulary size) and their width.
  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t dim() const { return dim_; }
  // The table (a tied LM head shares it: Linear(embedding->weight())).
  Parameter* weight() const { return weight_; }

 protected:
  // x: ids (i32/i64); ids outside [0, num_embeddings) are InvalidArgument.
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& ids) override;
  // Adds dy's rows into the table gradient; returns an undefined Tensor.
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override { return {&saved_ids_}; }

 private:
  // The table rows this process holds (a piece under tensor parallelism:
  // vocabulary-parallel rows give zeros for the other rows' ids, and a
  // column piece narrows the output to its columns).
  EmbeddingRows Rows() const;

  int64_t num_embeddings_;
  int64_t dim_;
  Parameter* weight_;
  Tensor saved_ids_;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_EMBEDDING_H_
