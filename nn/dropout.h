// Dropout whose mask is a pure function of where an element sits, so that
// every layout drops exactly what one rank would: element (row b, token t,
// feature f) of a layer's input is kept when
//
//   RandomUniform(layer_key, rows.keys[b], rows.columns[t] x features +
//                 feature_offset + f) >= p          (core/rng.h's Philox)
//
// and then scaled by 1 / (1 - p) (inverted dropout, PyTorch's and PEFT's
// convention). The row key names the sample (the data loader's epoch and
// window: the same sample has the same key on any data-parallel rank or in
// any micro-batch), the column is the token's place in the whole sequence
// (context parallelism's ranks hold other columns), and the feature offset is
// where a tensor-parallel slice of the features begins. A backward applies
// the same mask to the gradient (dropout is linear in its input).
//
// A model installs the keys of the batch it trains on (DropoutRows::Scope)
// over its training forward and its backward; where none is installed
// (evaluation, inference) nothing is dropped.
#ifndef FSDPP_NN_DROPOUT_H_
#define FSDPP_NN_DROPOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// The keys of a batch's rows and the whole-sequence columns of its tokens.
struct DropoutRows {
  std::vector<uint64_t> keys;    // One per row.
  std::vector<int64_t> columns;  // One per token of a row this rank holds.

  // The rows installed on this thread, or null.
  static const DropoutRows* Active();
  // Installs `rows` (null: none) on this thread for the scope.
  class Scope {
   public:
    explicit Scope(const DropoutRows* rows);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const DropoutRows* previous_;
  };
};

// out = x masked as the file comment says, for x [B, T, F] (f32 or bf16,
// on the CPU; out may be x) with B = rows.keys.size(), T =
// rows.columns.size(), F + feature_offset <= features. p in [0, 1). Meta
// tensors: checks only. InvalidArgument for other shapes or p,
// Unimplemented for other dtypes or devices.
absl::Status KeyedDropout(const Tensor& x, float p, uint64_t layer_key,
                          int64_t feature_offset, int64_t features,
                          const DropoutRows& rows, Tensor* out);

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_DROPOUT_H_
