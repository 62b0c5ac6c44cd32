// Vectorised row-wise host kernels for the CPU backend: softmax (with the
// causal mask), LayerNorm, RMSNorm and cross-entropy, each forward and
// backward, plus the column sums behind bias and norm-weight gradients.
// Google Highway, compiled for every x86 target and dispatched at run time
// (one binary for any x86-64), like tensor/cpu/simd.h.
//
// The math is that of tensor/kernels/rowwise.h (the scalar reference, which
// the CUDA kernels run), in f32 whatever the storage dtype. Two things
// differ, and the tests (rowwise_test) hold these kernels to the reference
// within a stated tolerance rather than bitwise:
//  * sums along a row (mean, variance, softmax denominators, dot products)
//    add lane-wise partial sums and then the lanes, not left to right;
//  * exp is kernels::ExpApprox (measured 7.9e-8 relative), not libm's expf.
// Each row's result depends only on that row, its length and the SIMD target
// the CPU dispatches to (its vector width sets the lanes): never on the
// alignment, the thread count or the split, so runs stay deterministic and
// every data-parallel layout on one kind of CPU computes the same numbers.
// (Machines with different vector widths agree to the tolerance, not the
// bit.)
//
// Column sums (SumRowsAccumulate, and the weight / bias gradients of the
// norms) are vectorised across columns, each column still summed over rows in
// order: those are bit-exact with the reference (this file is compiled
// without FMA contraction).
//
// All take a float dtype (f32, bf16, f16) for their tensors; mean / rstd /
// losses / dlosses are f32; targets are int64. They run on the OpenMP pool
// above kParallelElements (core/parallel.h).
#ifndef FSDPP_TENSOR_CPU_ROWWISE_H_
#define FSDPP_TENSOR_CPU_ROWWISE_H_

#include <cstdint>

#include "core/dtype.h"

namespace fsdpp {
namespace cpu {
namespace rowwise {

// y = softmax over each row of n; with causal_offset >= 0 row r keeps its
// first min(n, r % tq + causal_offset + 1) entries and the rest are 0.
void SoftmaxForward(DType dtype, const void* x, int64_t rows, int64_t n,
                    int64_t tq, int64_t causal_offset, void* y);
// dx = y * (dy - sum(dy * y)) per row.
void SoftmaxBackward(DType dtype, const void* y, const void* dy, int64_t rows,
                     int64_t n, void* dx);

// out = (x - mean) * rstd * weight + bias (bias may be null), per row of c.
void LayerNormForward(DType dtype, const void* x, const void* weight,
                      const void* bias, float eps, int64_t rows, int64_t c,
                      void* out, float* mean, float* rstd);
// dx (overwritten); dweight and dbias (may be null) accumulated.
void LayerNormBackward(DType dtype, const void* dy, const void* x,
                       const void* weight, const float* mean, const float* rstd,
                       int64_t rows, int64_t c, void* dx, void* dweight,
                       void* dbias);

// out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
void RmsNormForward(DType dtype, const void* x, const void* weight, float eps,
                    int64_t rows, int64_t c, void* out, float* rstd);
// dx (overwritten); dweight accumulated.
void RmsNormBackward(DType dtype, const void* dy, const void* x,
                     const void* weight, const float* rstd, int64_t rows,
                     int64_t c, void* dx, void* dweight);

// losses[i] = -log softmax(logits row i)[targets[i]], 0 where ignored;
// lse[i] (unless null) = the row's log-sum-exp, 0 where ignored. Targets
// are in [0, v) or ignore_index (the caller checked).
void CrossEntropyForward(DType dtype, const void* logits,
                         const int64_t* targets, int64_t n, int64_t v,
                         int64_t ignore_index, float* losses, float* lse);
// dlogits row i = dlosses[i] * (softmax - onehot(target)), zero if ignored;
// softmax = exp(x - lse[i]) when lse is not null.
void CrossEntropyBackward(DType dtype, const void* logits,
                          const int64_t* targets, const float* dlosses,
                          const float* lse, int64_t n, int64_t v,
                          int64_t ignore_index, void* dlogits);

// Rotary embedding in place on rows of head_dim (row r at position
// r % seq_len, or with `positions` ([batch, seq_len]) at positions[r /
// (rows / batch) * seq_len + r % seq_len], negative ones as 0), or its
// inverse: kernels::RopeRowForward / RopeRowBackward bit for bit (the cos /
// sin of each position are computed once per call, with the same cosf /
// sinf of the same angle).
void Rope(DType dtype, void* x, int64_t rows, int64_t seq_len, int64_t head_dim,
          const float* inv_freq, bool inverse,
          const int32_t* positions = nullptr, int64_t batch = 1);

// sum of x[i] (or of x[i]^2 with `squares`) over n elements, accumulated in
// double: lane-wise partial sums, then the lanes (single-threaded; the
// backend splits long arrays across threads and adds the parts in order).
double SumF64(DType dtype, const void* x, int64_t n, bool squares);

// Loss parallel (ops.h's CrossEntropyShardStats / Backward): local_targets[i]
// is row i's target index in this slice, -1 when another slice holds it;
// `ignored` rows get zeros.
void CrossEntropyShardStats(DType dtype, const void* logits,
                            const int64_t* local_targets, const bool* ignored,
                            int64_t n, int64_t v, float* max, float* sumexp,
                            float* target_logit);
void CrossEntropyShardBackward(DType dtype, const void* logits,
                               const int64_t* local_targets,
                               const bool* ignored, const float* max,
                               const float* sumexp, const float* dlosses,
                               int64_t n, int64_t v, void* dlogits);

// out[j] += sum over r of x[r * cols + j] (x of x_dtype, out of out_dtype;
// bit-exact with the scalar loop: each column summed over rows in order).
void SumRowsAccumulate(DType x_dtype, const void* x, int64_t rows, int64_t cols,
                       DType out_dtype, void* out);

}  // namespace rowwise
}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_ROWWISE_H_
