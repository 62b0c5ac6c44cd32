// Tensor operations: the kernels the layers, FSDP and the optimizer use.
//
// Each op validates its arguments in one place (shapes, dtypes, devices;
// errors are InvalidArgument naming the op and the shapes) and dispatches by
// device: tensor/cpu (loops + oneDNN) or tensor/cuda (kernels + cuBLASLt,
// under --config=cuda). On meta tensors an op validates and does nothing, so
// a model can be "run" on meta to check shapes. Outputs are preallocated by
// the caller (no hidden allocation on the hot path). Unless an op says it
// accumulates, it overwrites its output. Float ops accept f32, bf16 and f16
// storage and compute in f32.
#ifndef FSDPP_TENSOR_OPS_H_
#define FSDPP_TENSOR_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace fsdpp {

// ------------------------------------------------------------ data movement

// dst = src, converting dtype (any float <-> any float; ints to ints of the
// same dtype) and moving between devices. Shapes must have equal numel.
absl::Status Copy(const Tensor& src, Tensor* dst);

// Columns [src_first, src_first + count) of src [R, S] into columns
// [dst_first, dst_first + count) of dst [R, D]: the same dtype (any), one
// device, the ranges within each row (e.g. a context-parallel rank's chunks
// of a batch's ids).
absl::Status CopyColumns(const Tensor& src, int64_t src_first, int64_t count,
                         Tensor* dst, int64_t dst_first);

// Every element of `t` (float dtype) = value.
absl::Status Fill(Tensor* t, float value);

// Every byte of `t` = 0.
absl::Status Zero(Tensor* t);

// ---------------------------------------------------------- elementwise

// out = a + b (same shape and dtype; out may alias a or b).
absl::Status Add(const Tensor& a, const Tensor& b, Tensor* out);
// out = a * b.
absl::Status Mul(const Tensor& a, const Tensor& b, Tensor* out);
// out = alpha * x (out may alias x).
absl::Status Scale(const Tensor& x, float alpha, Tensor* out);
// y += alpha * x.
absl::Status Axpy(float alpha, const Tensor& x, Tensor* y);

// out = GELU(x), tanh approximation.
absl::Status Gelu(const Tensor& x, Tensor* out);
// dx = dy * GELU'(x).
absl::Status GeluBackward(const Tensor& x, const Tensor& dy, Tensor* dx);
// out = x * sigmoid(x).
absl::Status Silu(const Tensor& x, Tensor* out);
// dx = dy * SiLU'(x).
absl::Status SiluBackward(const Tensor& x, const Tensor& dy, Tensor* dx);

// ------------------------------------------------------------- reductions

// out (f32, one element) = sum of x, accumulated in f64 on CPU.
absl::Status Sum(const Tensor& x, Tensor* out);
// out (f32, one element) = sum of x^2.
absl::Status SumOfSquares(const Tensor& x, Tensor* out);
// out[c] += sum over rows of x[r, c]: x viewed as [rows, C] with C =
// out.numel() (bias gradients). out has x's dtype or f32.
absl::Status SumRowsAccumulate(const Tensor& x, Tensor* out);
// The single element of a one-element tensor, as float (copies to host).
absl::StatusOr<float> Item(const Tensor& t);

// ----------------------------------------------------------------- matmul

struct MatmulOptions {
  bool transpose_a = false;  // a is stored [.., K, M]
  bool transpose_b = false;  // b is stored [.., N, K]
  float alpha = 1.0f;        // c = alpha * op(a) @ op(b) + beta * c
  float beta = 0.0f;         // 1 accumulates into c (gradients)
  // [N], c's dtype and device: added to every row of c, in the matmul's own
  // pass (c = op(a) @ op(b) + bias; a Linear's bias). Needs alpha == 1 and
  // beta == 0.
  const Tensor* bias = nullptr;
};

// c[.., M, N] = alpha * op(a)[.., M, K] @ op(b)[.., K, N] + beta * c.
// a and b: f32, bf16 or f16 (same dtype); c: f32 or a's dtype. Accumulates
// in f32. (f16 on the CPU: oneDNN 2.6 has no f16 matmul there, so a, b and
// c go through f32 copies — exact for the inputs, slower.) Batch dims of a and
// c must be equal; b has the same batch dims or is 2-D (shared weights).
absl::Status Matmul(const Tensor& a, const Tensor& b, Tensor* c,
                    const MatmulOptions& options = {});

// ---------------------------------------------------------------- row ops

// Softmax over the last dim. With `causal`, x is [.., Tq, Tk] and key k of
// query q is masked when k > q + (Tk - Tq) (its output is 0).
absl::Status Softmax(const Tensor& x, Tensor* y, bool causal = false);
// dx = y * (dy - sum(dy * y)) over the last dim.
absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, Tensor* dx);

// Fused causal attention, flash-attention style (tensor/kernels/attention.h
// has the math): q [B, H, T, hd], k and v [B, KV, T, hd] (KV divides H; query
// head h uses kv head h / (H / KV)), all of one float dtype on one device;
// out [B, H, T, hd] in that dtype; lse [B, H, T] f32, the log-sum-exp of
// each query row's scaled scores, saved for the backward. Query i attends
// to keys 0..i; no [T, T] matrix is materialised (memory O(T) per row tile).
// Other masks through `keys` (KeyRange): document masking (lo =
// DocumentMask's key starts) and context parallelism's blocks (a rank's
// queries against another rank's keys). On CUDA such calls run the
// reference kernel (one thread per row), not cuDNN.
//
// KeyRange (tensor/tensor.h): the keys each query row attends to. A row
// with no key gets out 0 and lse -inf (and adds nothing to dk, dv); calls
// over disjoint parts of the keys merge exactly with MergeAttention.
absl::Status CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v,
                             float scale, Tensor* out, Tensor* lse,
                             const KeyRange& keys = {});
// Its backward from dout (like out): dq like q, dk and dv like k and v
// (overwritten). Recomputes the probabilities from q, k and lse; `keys` as
// in the forward. With a part of the keys, out and lse must be the whole
// attention's (merged) ones: dq then sums over the parts' calls, and each
// part's dk and dv are its keys' whole gradients from these queries.
absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout,
                                     float scale, Tensor* dq, Tensor* dk,
                                     Tensor* dv, const KeyRange& keys = {});

// Merges the attention of the same queries over another part of the keys
// (out_part [B, H, T, hd], lse_part [B, H, T] f32) into (out, lse): lse' =
// log(exp(lse) + exp(lse_part)), out' = exp(lse - lse') out + exp(lse_part -
// lse') out_part, per row (a row -inf on one side takes the other's). The
// partial results of CausalAttention over disjoint key ranges merge into
// the whole one's, in any order, to rounding.
absl::Status MergeAttention(const Tensor& out_part, const Tensor& lse_part,
                            Tensor* out, Tensor* lse);

// Packed documents in ids [B, T] (i32 or i64): a document begins at every
// `eot_id` token (the llm.c layout: each document is its end-of-text token
// followed by its text) and at the start of each row. key_start (i32 [B, T])
// gets, for every token, the index of its document's first token in the row;
// positions (i32 [B, T]) its position in its document (i - key_start[i]).
// CausalAttention's mask (KeyRange::lo) and Rope's / an embedding's
// positions.
absl::Status DocumentMask(const Tensor& ids, int64_t eot_id, Tensor* key_start,
                          Tensor* positions);

// Attention's head layouts, one pass each: SplitHeads copies heads
// [first, first + n) of src [B, T, N, hd] into dst [B, n, T, hd]; MergeHeads
// copies src [B, n, T, hd] into heads [first, first + n) of dst [B, T, N, hd]
// (the other heads of dst are left as they are). Any dtype, one device.
absl::Status SplitHeads(const Tensor& src, int64_t first, Tensor* dst);
absl::Status MergeHeads(const Tensor& src, int64_t first, Tensor* dst);

// Rotary position embedding in place on x [.., T, hd] (hd even; a row's
// position is its index along T): each pair (x[i], x[i + hd/2]) rotates by
// the angle position * inv_freq[i] (hd/2 frequencies, f32, on the host; see
// kernels::RopeInvFreqs), or back by it with `inverse` (the backward). The
// math is tensor/kernels/rope.h's, on every backend. With `positions` (i32
// [B, T], x [B, N, T, hd]; DocumentMask's) row t of batch row b is at
// positions[b, t] instead (any position >= 0, e.g. a context-parallel
// rank's global ones; negative ones count as 0).
absl::Status Rope(Tensor* x, const std::vector<float>& inv_freq, bool inverse,
                  const Tensor* positions = nullptr);

// x: [.., C]; weight, bias: [C] (bias optional: pass nullptr); out like x;
// mean, rstd: f32 with one element per row (saved for backward).
absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                       const Tensor* bias, float eps, Tensor* out, Tensor* mean,
                       Tensor* rstd);
// dx = dLoss/dx (overwritten); dweight (and dbias if given) accumulate.
absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                               const Tensor& weight, const Tensor& mean,
                               const Tensor& rstd, Tensor* dx, Tensor* dweight,
                               Tensor* dbias);

// out = x / sqrt(mean(x^2) + eps) * weight; rstd: f32, one per row.
absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                     Tensor* out, Tensor* rstd);
// dx overwritten; dweight accumulates.
absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                             const Tensor& weight, const Tensor& rstd,
                             Tensor* dx, Tensor* dweight);

// ------------------------------------------------------------- embedding

// Which rows of the whole table a table argument holds: rows [row_offset,
// row_offset + table rows) of a `vocab`-row table (vocabulary-parallel
// embeddings). The default is the whole table (vocab = -1: the table's rows).
struct EmbeddingRows {
  int64_t row_offset = 0;
  int64_t vocab = -1;
};

// out[i, :] = table[ids[i], :]. ids: i32 or i64, any shape with N elements;
// table [V, C]; out [.., C] with N rows. Ids outside [0, V) are an error.
// With `rows`, ids are checked against rows.vocab and those outside the held
// rows give zero rows.
absl::Status Embedding(const Tensor& ids, const Tensor& table, Tensor* out,
                       EmbeddingRows rows = {});
// dtable[ids[i], :] += dout[i, :] (scatter-add; repeated ids add up). With
// `rows`, ids outside the held rows add nothing.
absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                               Tensor* dtable, EmbeddingRows rows = {});

// --------------------------------------------------------- cross-entropy

// losses[i] (f32) = -log softmax(logits[i])[targets[i]], 0 where the target
// is `ignore_index`. logits [.., V] with N rows; targets i32/i64, N elements.
// With `lse` (f32, N elements): also each row's log-sum-exp (0 where
// ignored), for the backward over the same logits.
absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                          int64_t ignore_index, Tensor* losses,
                          Tensor* lse = nullptr);
// dlogits[i] = dlosses[i] * (softmax(logits[i]) - onehot(targets[i])), zero
// rows where ignored. dlosses: f32, N elements. With `lse` from the forward
// over these logits, softmax = exp(x - lse) in one pass over each row
// (otherwise its max and sum are found again: two more).
absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                  int64_t ignore_index, const Tensor& dlosses,
                                  Tensor* dlogits, const Tensor* lse = nullptr);

// Loss parallel: cross-entropy over a vocabulary of `vocab_size` split across
// ranks, this rank holding logits [N, Vl] = columns [vocab_offset,
// vocab_offset + Vl). Per row (f32, N elements each): `max` of this slice,
// `sumexp` = sum of exp(x - max) over it, `target_logit` = the target's logit
// if this slice holds it, else 0. Rows whose target is ignore_index get 0 in
// all three. The full row's loss is log(sum over slices of sumexp_s *
// exp(max_s - M)) + M - (sum over slices of target_logit_s), M the largest
// max_s (parallel/ combines them with three all-reduces); no rank ever holds
// the whole row. Targets must be in [0, vocab_size) or ignore_index.
absl::Status CrossEntropyShardStats(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_offset, int64_t vocab_size,
                                    int64_t ignore_index, Tensor* max,
                                    Tensor* sumexp, Tensor* target_logit);
// This slice's dlogits (like logits) = dlosses[i] * (exp(x - max[i]) /
// sumexp[i] - onehot(target - vocab_offset)), with the whole row's max and
// sumexp (f32, N each); zero rows where the target is ignored.
absl::Status CrossEntropyShardBackward(const Tensor& logits,
                                       const Tensor& targets,
                                       int64_t vocab_offset, int64_t vocab_size,
                                       int64_t ignore_index, const Tensor& max,
                                       const Tensor& sumexp,
                                       const Tensor& dlosses, Tensor* dlogits);

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_OPS_H_
