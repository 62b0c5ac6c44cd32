// The per-device kernel interface behind tensor/ops.h.
//
// ops.cc validates every call once, then hands already-checked tensors plus
// the derived sizes to the Backend of the tensors' device. tensor/cpu and
// tensor/cuda each implement this interface; both take their non-GEMM math
// from tensor/kernels/*.h. Backends never see meta tensors.
#ifndef FSDPP_TENSOR_BACKEND_H_
#define FSDPP_TENSOR_BACKEND_H_

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "tensor/tensor.h"

namespace fsdpp {

enum class UnaryKind { kScale, kGelu, kSilu };
enum class BinaryKind { kAdd, kMul, kAxpy, kGeluBackward, kSiluBackward };
enum class ReduceKind { kSum, kSumOfSquares };

// Matmul in row-major terms: c[b] = alpha * op(a[b]) @ op(b[b or 0]) + beta *
// c[b].
struct MatmulArgs {
  const Tensor* a;
  const Tensor* b;
  Tensor* c;
  int64_t batch, m, n, k;
  bool transpose_a, transpose_b;
  bool broadcast_b;  // b is 2-D and shared by every batch entry.
  float alpha, beta;
  const Tensor* bias;  // [n] of c's dtype, or null (then alpha, beta as given;
                       // with a bias alpha == 1 and beta == 0).
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Same device; dst and src have equal numel; float<->float casts or equal
  // dtypes.
  virtual absl::Status Copy(const Tensor& src, Tensor* dst) = 0;
  // `count` elements from column src_first of each of `rows` rows of src
  // into column dst_first of dst's (2-d, equal dtypes, ranges in bounds).
  virtual absl::Status CopyColumns(const Tensor& src, int64_t src_first,
                                   Tensor* dst, int64_t dst_first, int64_t rows,
                                   int64_t count) = 0;
  virtual absl::Status Fill(Tensor* t, float value) = 0;
  // out = op(alpha, x).
  virtual absl::Status Unary(UnaryKind kind, float alpha, const Tensor& x,
                             Tensor* out) = 0;
  // out = op(a, b) (kAxpy: out = a + alpha * b; backward kinds: a = x, b = dy).
  virtual absl::Status Binary(BinaryKind kind, float alpha, const Tensor& a,
                              const Tensor& b, Tensor* out) = 0;
  // out: f32, one element.
  virtual absl::Status Reduce(ReduceKind kind, const Tensor& x,
                              Tensor* out) = 0;
  virtual absl::Status SumRowsAccumulate(const Tensor& x, int64_t rows,
                                         int64_t cols, Tensor* out) = 0;
  virtual absl::Status Matmul(const MatmulArgs& args) = 0;
  // causal_offset < 0: no mask; else row r keeps keys k <= (r % tq) + offset.
  virtual absl::Status Softmax(const Tensor& x, int64_t rows, int64_t n,
                               int64_t tq, int64_t causal_offset,
                               Tensor* y) = 0;
  virtual absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy,
                                       int64_t rows, int64_t n, Tensor* dx) = 0;
  // Fused causal attention (tensor/kernels/attention.h): q [b, h, t, hd],
  // k and v [b, kv, t, hd], out [b, h, t, hd] in q's dtype, lse [b, h, t]
  // f32; keys: the rows' key ranges (ops.h KeyRange), lo and hi each null or
  // i32 [b, t]. Shapes and dtypes are checked by tensor/ops.cc.
  virtual absl::Status CausalAttention(const Tensor& q, const Tensor& k,
                                       const Tensor& v, int64_t b, int64_t h,
                                       int64_t kv, int64_t t, int64_t hd,
                                       float scale, const KeyRange& keys,
                                       Tensor* out, Tensor* lse) = 0;
  // Its backward, recomputing the probabilities from lse: dq like q, dk and
  // dv like k and v (overwritten, not accumulated).
  virtual absl::Status CausalAttentionBackward(
      const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
      const Tensor& lse, const Tensor& dout, int64_t b, int64_t h, int64_t kv,
      int64_t t, int64_t hd, float scale, const KeyRange& keys, Tensor* dq,
      Tensor* dk, Tensor* dv) = 0;
  // ops.h MergeAttention over `rows` rows of hd (lse: rows floats).
  virtual absl::Status MergeAttention(const Tensor& out_part,
                                      const Tensor& lse_part, int64_t rows,
                                      int64_t hd, Tensor* out, Tensor* lse) = 0;
  // ops.h DocumentMask on ids [b, t] (i32 or i64).
  virtual absl::Status DocumentMask(const Tensor& ids, int64_t b, int64_t t,
                                    int64_t eot_id, Tensor* key_start,
                                    Tensor* positions) = 0;
  // Head layouts: the wide tensor is [b, t, heads, hd], the other [b, n, t,
  // hd] holding heads [first, first + n); merge copies into the wide one.
  virtual absl::Status CopyHeads(const Tensor& src, Tensor* dst, int64_t b,
                                 int64_t t, int64_t heads, int64_t first,
                                 int64_t n, int64_t hd, bool merge) = 0;
  // Rotary embedding in place on `rows` rows of head_dim (row r at position
  // r % seq_len, or with `positions` (i32 [batch, seq_len]) at
  // positions[r / (rows / batch), r % seq_len]); inv_freq: head_dim / 2
  // floats on the host.
  virtual absl::Status Rope(Tensor* x, int64_t rows, int64_t seq_len,
                            int64_t head_dim, const float* inv_freq,
                            bool inverse, const Tensor* positions) = 0;
  virtual absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                                 const Tensor* bias, float eps, int64_t rows,
                                 int64_t c, Tensor* out, Tensor* mean,
                                 Tensor* rstd) = 0;
  virtual absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                                         const Tensor& weight,
                                         const Tensor& mean, const Tensor& rstd,
                                         int64_t rows, int64_t c, Tensor* dx,
                                         Tensor* dweight, Tensor* dbias) = 0;
  virtual absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                               int64_t rows, int64_t c, Tensor* out,
                               Tensor* rstd) = 0;
  virtual absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                                       const Tensor& weight, const Tensor& rstd,
                                       int64_t rows, int64_t c, Tensor* dx,
                                       Tensor* dweight) = 0;
  // Ids are range-checked by the backend (it can read them cheaply).
  // The table holds rows [row_offset, row_offset + v) of a `vocab`-row one.
  virtual absl::Status Embedding(const Tensor& ids, const Tensor& table,
                                 int64_t n, int64_t v, int64_t c,
                                 int64_t row_offset, int64_t vocab,
                                 Tensor* out) = 0;
  virtual absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                                         int64_t n, int64_t v, int64_t c,
                                         int64_t row_offset, int64_t vocab,
                                         Tensor* dtable) = 0;
  // lse: null, or [n] f32 (ops.h).
  virtual absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                                    int64_t n, int64_t v, int64_t ignore_index,
                                    Tensor* losses, Tensor* lse) = 0;
  virtual absl::Status CrossEntropyBackward(const Tensor& logits,
                                            const Tensor& targets,
                                            const Tensor& dlosses, int64_t n,
                                            int64_t v, int64_t ignore_index,
                                            const Tensor* lse,
                                            Tensor* dlogits) = 0;
  // Loss parallel (ops.h): logits [n, v] are the columns [vocab_offset,
  // vocab_offset + v) of a vocabulary of vocab_size (targets are checked
  // against vocab_size).
  virtual absl::Status CrossEntropyShardStats(
      const Tensor& logits, const Tensor& targets, int64_t n, int64_t v,
      int64_t vocab_offset, int64_t vocab_size, int64_t ignore_index,
      Tensor* max, Tensor* sumexp, Tensor* target_logit) = 0;
  virtual absl::Status CrossEntropyShardBackward(
      const Tensor& logits, const Tensor& targets, const Tensor& max,
      const Tensor& sumexp, const Tensor& dlosses, int64_t n, int64_t v,
      int64_t vocab_offset, int64_t vocab_size, int64_t ignore_index,
      Tensor* dlogits) = 0;
};

// A type carried as a value, for generic lambdas: [](auto tag) { using T =
// typename decltype(tag)::type; ... }.
template <typename T>
struct TypeTag {
  using type = T;
};

namespace backend_internal {
// fn(tag) as a Status (void results count as OK).
template <typename Fn, typename Tag>
absl::Status Call(Fn& fn, Tag tag) {
  if constexpr (std::is_void_v<decltype(fn(tag))>) {
    fn(tag);
    return absl::OkStatus();
  } else {
    return fn(tag);
  }
}
}  // namespace backend_internal

// Runs fn(TypeTag<T>{}) with T the storage type (float, BFloat16, Float16)
// of a float dtype; shared by the CPU and CUDA backends.
template <typename Fn>
absl::Status DispatchFloat(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return backend_internal::Call(fn, TypeTag<float>{});
    case DType::kBF16:
      return backend_internal::Call(fn, TypeTag<BFloat16>{});
    case DType::kF16:
      return backend_internal::Call(fn, TypeTag<Float16>{});
    default:
      return absl::InternalError(
          absl::StrCat("backend: unexpected float dtype ", DTypeName(dtype)));
  }
}

// Runs fn(TypeTag<I>{}) with I = int32_t or int64_t for an id dtype.
template <typename Fn>
absl::Status DispatchId(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kI32:
      return backend_internal::Call(fn, TypeTag<int32_t>{});
    case DType::kI64:
      return backend_internal::Call(fn, TypeTag<int64_t>{});
    default:
      return absl::InternalError(
          absl::StrCat("backend: unexpected id dtype ", DTypeName(dtype)));
  }
}

// Reads element i of an i32 / i64 id tensor on the host.
inline int64_t IdAt(const void* ids, DType dtype, int64_t i) {
  return dtype == DType::kI32 ? static_cast<const int32_t*>(ids)[i]
                              : static_cast<const int64_t*>(ids)[i];
}

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_BACKEND_H_
