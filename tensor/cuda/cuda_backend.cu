// CUDA kernels; see cuda_backend.h.
//
// Every kernel computes the f32 math of tensor/kernels/*.h (the CPU
// backend's), laid out for the GPU: elementwise ops per element; row ops
// (LayerNorm, RMSNorm, softmax) a warp per row and cross-entropy a block per
// row, with lanes striding over the row (coalesced) and fixed-order
// butterfly reductions; parameter gradients (bias, LayerNorm / RMSNorm
// weight and bias) in two stages, per-chunk column sums over fixed chunks of
// kRowChunk rows and then the chunks in order; EmbeddingBackward sorts the
// ids (stable radix sort) and sums each id's rows in position order. No
// result depends on the launch configuration or on atomics, so reruns are
// bit-identical; the reduction order differs from the CPU's serial loops, so
// results agree with the CPU to rounding. Attention in bf16 / f16 runs on
// cuDNN's fused SDPA (tensor/cuda/cudnn_attention.h); the row-per-thread
// attention kernel below is the f32 path and the fallback. Sum /
// SumOfSquares accumulate in double in two stages whose split depends only
// on the element count. Everything runs on the legacy default stream (which
// orders work from all host threads). Ids are range-checked before a kernel
// reads them, in the CPU backend's words: on the host when the caller did so
// (Tensor::MarkIdsCheckedBelow: the trainer's batches), else by copying them
// to the host (a synchronisation).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/device_wait.h"
#include "core/status.h"
#include "tensor/cuda/cublaslt_matmul.h"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/cuda/cudnn_attention.h"
#include "tensor/kernels/attention.h"
#include "tensor/kernels/elementwise.h"
#include "tensor/kernels/rope.h"
#include "tensor/kernels/rowwise.h"

namespace fsdpp {
namespace gpu {
namespace {

// Threads per block of the elementwise, column and reduction kernels.
constexpr int kThreads = 256;
// Threads per block of the remaining one-thread-per-row kernels (RoPE's
// frequencies, the f32 attention): rows are few and heavy, so small blocks
// spread them over more SMs.
constexpr int kRowThreads = 64;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Column sums (parameter gradients): blocks of kColumnTile columns x
// kColumnStripes row stripes, each block summing one chunk of kRowChunk rows.
constexpr int kColumnTile = 32;
constexpr int kColumnStripes = 8;
constexpr int64_t kRowChunk = 256;
constexpr int64_t kMaxGridY = 65535;
// Stage-one blocks of a reduction (a fixed cap keeps the split a function of
// the element count only).
constexpr int kReduceBlocks = 1024;
// Grid size cap per SM (grid-stride loops cover the rest).
constexpr int kBlocksPerSm = 32;
// Used when the SM count cannot be queried (the calls fail later anyway).
constexpr int kFallbackSms = 128;

__device__ __forceinline__ int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(blockDim.x) * gridDim.x;
}

// Warp-per-row loops: the row of this thread's warp, and the step between
// rows (blockDim.x is a multiple of kWarpSize).
__device__ __forceinline__ int64_t FirstWarp() {
  return FirstIndex() / kWarpSize;
}
__device__ __forceinline__ int64_t WarpStride() {
  return GridStride() / kWarpSize;
}
__device__ __forceinline__ int Lane() {
  return static_cast<int>(threadIdx.x) % kWarpSize;
}

// Butterfly reductions: every lane gets the same value, in a fixed order.
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    v += __shfl_xor_sync(kFullMask, v, o);
  }
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  }
  return v;
}

// Block-wide sum (or max) that every thread gets; `sh` holds kWarpSize
// floats; blockDim.x a multiple of kWarpSize; every thread must call it.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float v, float* sh) {
  v = kMax ? WarpMax(v) : WarpSum(v);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  if (Lane() == 0) sh[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  v = Lane() < warps ? sh[Lane()] : (kMax ? -INFINITY : 0.0f);
  v = kMax ? WarpMax(v) : WarpSum(v);
  __syncthreads();
  return v;
}

// Online softmax statistics: (max, sum of exp(x - max)) of the values seen.
struct MaxSum {
  float max = -INFINITY;
  float sum = 0.0f;
  __device__ __forceinline__ void Add(float x) {
    if (x > max) {
      sum = sum * __expf(max - x) + 1.0f;
      max = x;
    } else {
      sum += __expf(x - max);
    }
  }
};

// Combines every thread's MaxSum into the block's (every thread gets it).
__device__ __forceinline__ MaxSum BlockMaxSum(MaxSum m, float* sh) {
  MaxSum out;
  out.max = BlockReduce<true>(m.max, sh);
  out.sum = BlockReduce<false>(
      m.max == -INFINITY ? 0.0f : m.sum * __expf(m.max - out.max), sh);
  return out;
}

// ------------------------------------------------------------ elementwise

template <typename S, typename D>
__global__ void CastKernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    dst[i] = FromFloat<D>(ToFloat(src[i]));
  }
}

template <typename T>
__global__ void FillKernel(T* p, int64_t n, T value) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) p[i] = value;
}

template <typename T, typename Op>
__global__ void UnaryKernel(const T* x, T* out, int64_t n, Op op) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    out[i] = FromFloat<T>(op(ToFloat(x[i])));
  }
}

template <typename T, typename Op>
__global__ void BinaryKernel(const T* a, const T* b, T* out, int64_t n, Op op) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    out[i] = FromFloat<T>(op(ToFloat(a[i]), ToFloat(b[i])));
  }
}

// Elementwise over kVec elements per thread-iteration through aligned
// vector loads and stores (16 bytes of bf16 / f16, 32 of f32), when every
// pointer is aligned to its vector: n_vec vectors; the caller runs the
// scalar kernel over the tail.
constexpr int kVec = 8;
template <typename T>
struct alignas(kVec * sizeof(T)) Vec {
  T v[kVec];
};

template <typename S, typename D>
__global__ void CastVecKernel(const Vec<S>* src, Vec<D>* dst, int64_t n_vec) {
  for (int64_t i = FirstIndex(); i < n_vec; i += GridStride()) {
    const Vec<S> a = src[i];
    Vec<D> r;
#pragma unroll
    for (int k = 0; k < kVec; ++k) r.v[k] = FromFloat<D>(ToFloat(a.v[k]));
    dst[i] = r;
  }
}

template <typename T, typename Op>
__global__ void UnaryVecKernel(const Vec<T>* x, Vec<T>* out, int64_t n_vec,
                               Op op) {
  for (int64_t i = FirstIndex(); i < n_vec; i += GridStride()) {
    const Vec<T> a = x[i];
    Vec<T> r;
#pragma unroll
    for (int k = 0; k < kVec; ++k) r.v[k] = FromFloat<T>(op(ToFloat(a.v[k])));
    out[i] = r;
  }
}

template <typename T, typename Op>
__global__ void BinaryVecKernel(const Vec<T>* a, const Vec<T>* b, Vec<T>* out,
                                int64_t n_vec, Op op) {
  for (int64_t i = FirstIndex(); i < n_vec; i += GridStride()) {
    const Vec<T> x = a[i], y = b[i];
    Vec<T> r;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      r.v[k] = FromFloat<T>(op(ToFloat(x.v[k]), ToFloat(y.v[k])));
    }
    out[i] = r;
  }
}

// True when every pointer is aligned for Vec loads of its type.
template <typename T>
bool VecAligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Vec<T>) == 0;
}

// -------------------------------------------------------------- reductions

// Sums sh[0, kThreads) into sh[0] in a fixed tree order.
__device__ __forceinline__ void BlockTreeSum(double* sh) {
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) {
      sh[threadIdx.x] += sh[threadIdx.x + stride];
    }
    __syncthreads();
  }
}

// Stage one (blockDim.x == kThreads): partial[block] = the block's sum of x
// (or of x^2) over a grid-stride slice.
template <typename T, bool kSquares>
__global__ void ReducePartialKernel(const T* x, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const double v = ToFloat(x[i]);
    acc += kSquares ? v * v : v;
  }
  sh[threadIdx.x] = acc;
  BlockTreeSum(sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// Stage two (one block of kThreads): out[0] = sum of the partials.
__global__ void ReduceFinalKernel(const double* partial, int count,
                                  float* out) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) acc += partial[i];
  sh[threadIdx.x] = acc;
  BlockTreeSum(sh);
  if (threadIdx.x == 0) out[0] = static_cast<float>(sh[0]);
}

// Column sums in two stages (bias and norm-weight gradients). Stage one:
// partial[o][chunk][j] = sum over the chunk's rows of term's output o at
// (r, j); block (kColumnTile, kColumnStripes), blockIdx.x a column tile,
// blockIdx.y (grid-stride) a chunk of kRowChunk rows. Each stripe sums every
// kColumnStripes-th row of the chunk, then the stripes are added in order.
template <int kOutputs, typename Term>
__global__ void ColumnPartialKernel(Term term, int64_t rows, int64_t cols,
                                    int64_t chunks, float* partial) {
  __shared__ float sh[kOutputs][kColumnStripes][kColumnTile + 1];
  const int64_t j =
      static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    float acc[kOutputs];
    for (int o = 0; o < kOutputs; ++o) acc[o] = 0.0f;
    const int64_t end = min(rows, (chunk + 1) * kRowChunk);
    if (j < cols) {
      for (int64_t r = chunk * kRowChunk + threadIdx.y; r < end;
           r += kColumnStripes) {
        term(r, j, acc);
      }
    }
    for (int o = 0; o < kOutputs; ++o) sh[o][threadIdx.y][threadIdx.x] = acc[o];
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
      for (int o = 0; o < kOutputs; ++o) {
        float sum = 0.0f;
        for (int y = 0; y < kColumnStripes; ++y) sum += sh[o][y][threadIdx.x];
        partial[(o * chunks + chunk) * cols + j] = sum;
      }
    }
    __syncthreads();
  }
}

// Stage two: out_o[j] += sum of the chunks' partials in order (out1 may be
// null).
template <int kOutputs, typename O>
__global__ void ColumnFinishKernel(const float* partial, int64_t chunks,
                                   int64_t cols, O* out0, O* out1) {
  for (int64_t j = FirstIndex(); j < cols; j += GridStride()) {
    for (int o = 0; o < kOutputs; ++o) {
      O* out = o == 0 ? out0 : out1;
      if (out == nullptr) continue;
      float sum = 0.0f;
      for (int64_t k = 0; k < chunks; ++k) {
        sum += partial[(o * chunks + k) * cols + j];
      }
      out[j] = FromFloat<O>(ToFloat(out[j]) + sum);
    }
  }
}

// The column terms: x itself (bias gradients), LayerNorm's dweight and
// dbias, RMSNorm's dweight.
template <typename T>
struct SumTerm {
  const T* x;
  int64_t cols;
  __device__ __forceinline__ void operator()(int64_t r, int64_t j,
                                             float* acc) const {
    acc[0] += ToFloat(x[r * cols + j]);
  }
};

template <typename T>
struct LayerNormParamTerm {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  int64_t cols;
  __device__ __forceinline__ void operator()(int64_t r, int64_t j,
                                             float* acc) const {
    const float g = ToFloat(dy[r * cols + j]);
    acc[0] += g * (ToFloat(x[r * cols + j]) - mean[r]) * rstd[r];
    acc[1] += g;
  }
};

template <typename T>
struct RmsNormParamTerm {
  const T* dy;
  const T* x;
  const float* rstd;
  int64_t cols;
  __device__ __forceinline__ void operator()(int64_t r, int64_t j,
                                             float* acc) const {
    acc[0] += ToFloat(dy[r * cols + j]) * ToFloat(x[r * cols + j]) * rstd[r];
  }
};

// ---------------------------------------------------------------- row ops

// Softmax, a warp per row: y[j] = exp(x[j] - max) / sum for j < valid, 0
// after (causal: valid = r % tq + causal_offset + 1, capped at n).
template <typename T>
__global__ void SoftmaxKernel(const T* x, int64_t rows, int64_t n, int64_t tq,
                              int64_t causal_offset, T* y) {
  const int lane = Lane();
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const int64_t valid = causal_offset < 0 || r % tq + causal_offset + 1 > n
                              ? n
                              : r % tq + causal_offset + 1;
    const T* xr = x + r * n;
    float max = -INFINITY;
    for (int64_t j = lane; j < valid; j += kWarpSize) {
      max = fmaxf(max, ToFloat(xr[j]));
    }
    max = WarpMax(max);
    float sum = 0.0f;
    for (int64_t j = lane; j < valid; j += kWarpSize) {
      sum += expf(ToFloat(xr[j]) - max);
    }
    const float inv = 1.0f / WarpSum(sum);
    for (int64_t j = lane; j < n; j += kWarpSize) {
      y[r * n + j] =
          FromFloat<T>(j < valid ? expf(ToFloat(xr[j]) - max) * inv : 0.0f);
    }
  }
}

// dx = y * (dy - sum(dy * y)), a warp per row.
template <typename T>
__global__ void SoftmaxBackwardKernel(const T* y, const T* dy, int64_t rows,
                                      int64_t n, T* dx) {
  const int lane = Lane();
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const int64_t o = r * n;
    float dot = 0.0f;
    for (int64_t j = lane; j < n; j += kWarpSize) {
      dot += ToFloat(y[o + j]) * ToFloat(dy[o + j]);
    }
    dot = WarpSum(dot);
    for (int64_t j = lane; j < n; j += kWarpSize) {
      dx[o + j] = FromFloat<T>(ToFloat(y[o + j]) * (ToFloat(dy[o + j]) - dot));
    }
  }
}

// c[r, j] = bias[j] for every row r (a matmul's bias, before the product is
// added with beta = 1).
template <typename T>
__global__ void BroadcastRowKernel(const T* bias, T* c, int64_t rows,
                                   int64_t n) {
  for (int64_t e = FirstIndex(); e < rows * n; e += GridStride()) {
    c[e] = bias[e % n];
  }
}

// Head layouts (see Backend::CopyHeads): one thread per unit U (an element,
// or 16 bytes of a head row when rows are 16-byte multiples) of the narrow
// [b, n, t, row] tensor, row = hd in units; 32-bit index math when the
// sizes allow (IndexT), it is most of the kernel's cost otherwise.
template <typename U, typename IndexT>
__global__ void CopyHeadsKernel(const U* src, U* dst, IndexT b, IndexT t,
                                IndexT heads, IndexT first, IndexT n,
                                IndexT row, bool merge) {
  const IndexT total = b * n * t * row;
  const IndexT stride = static_cast<IndexT>(blockDim.x) * gridDim.x;
  for (IndexT e = static_cast<IndexT>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < total; e += stride) {
    const IndexT j = e % row, r = e / row;
    const IndexT i = r % t, bh = r / t;
    const IndexT h = bh % n, bi = bh / n;
    const IndexT wide = ((bi * t + i) * heads + first + h) * row + j;
    if (merge) {
      dst[wide] = src[e];
    } else {
      dst[e] = src[wide];
    }
  }
}

// Rotary embedding: one thread per rotated pair (x[i], x[i + half]) of a
// row, in place; the frequencies travel in the kernel's parameters
// (head_dim <= 2 * kMaxRopeFrequencies).
constexpr int64_t kMaxRopeFrequencies = 256;
struct RopeFrequencies {
  float inv_freq[kMaxRopeFrequencies];
};

// Row r is at position r % seq_len, or with `positions` ([batch, seq_len])
// at positions[r / rows_per_batch * seq_len + r % seq_len] (negative ones
// as 0).
template <typename T>
__global__ void RopeKernel(T* x, int64_t rows, int64_t seq_len,
                           int64_t head_dim, RopeFrequencies f, bool inverse,
                           const int32_t* positions, int64_t rows_per_batch) {
  const int64_t half = head_dim / 2;
  for (int64_t e = FirstIndex(); e < rows * half; e += GridStride()) {
    const int64_t r = e / half, i = e % half;
    T* row = x + r * head_dim;
    int64_t p = r % seq_len;
    if (positions != nullptr) {
      p = positions[r / rows_per_batch * seq_len + p];
      p = p < 0 ? 0 : p;
    }
    const float angle = static_cast<float>(p) * f.inv_freq[i];
    const float c = cosf(angle), sn = sinf(angle);
    const float a = ToFloat(row[i]), b = ToFloat(row[i + half]);
    if (inverse) {
      row[i] = FromFloat<T>(a * c + b * sn);
      row[i + half] = FromFloat<T>(b * c - a * sn);
    } else {
      row[i] = FromFloat<T>(a * c - b * sn);
      row[i + half] = FromFloat<T>(b * c + a * sn);
    }
  }
}

// Fused causal attention (tensor/kernels/attention.h): one thread per query
// row (forward, dq) or per key row (dk, dv), f32 accumulators of at most
// kMaxAttentionHeadDim floats in local memory. lo, hi: the rows' key ranges
// (ops.h KeyRange), each null or [b, t]: query i of batch row bi attends to
// keys [KeyLo, KeyHi).
constexpr int64_t kMaxAttentionHeadDim = 256;

// Batch row bi of a [b, t] bound, or null.
__device__ __forceinline__ const int32_t* BoundRow(const int32_t* bound,
                                                   int64_t bi, int64_t t) {
  return bound == nullptr ? nullptr : bound + bi * t;
}

// ops.h MergeAttention: one thread per row.
template <typename T>
__global__ void MergeAttentionKernel(const T* out_part, const float* lse_part,
                                     int64_t rows, int64_t hd, T* out,
                                     float* lse) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::MergeAttentionRow(out_part + r * hd, lse_part[r], hd, out + r * hd,
                               lse + r);
  }
}

// Packed documents (ops.h DocumentMask): one thread per batch row.
template <typename Id>
__global__ void DocumentMaskKernel(const Id* ids, int64_t b, int64_t t,
                                   int64_t eot_id, int32_t* key_start,
                                   int32_t* positions) {
  for (int64_t r = FirstIndex(); r < b; r += GridStride()) {
    kernels::DocumentMaskRow(ids + r * t, t, eot_id, key_start + r * t,
                             positions + r * t);
  }
}

template <typename T>
__global__ void CausalAttentionKernel(const T* q, const T* k, const T* v,
                                      int64_t b, int64_t h, int64_t kv,
                                      int64_t t, int64_t hd, float scale,
                                      const int32_t* lo, const int32_t* hi,
                                      T* out, float* lse) {
  for (int64_t r = FirstIndex(); r < b * h * t; r += GridStride()) {
    const int64_t head = r / t, i = r % t;
    const int64_t kv_head = (head / h) * kv + (head % h) / (h / kv);
    const int64_t first = kernels::KeyLo(BoundRow(lo, head / h, t), i, t);
    const int64_t end = kernels::KeyHi(BoundRow(hi, head / h, t), i, t);
    float acc[kMaxAttentionHeadDim];
    kernels::CausalAttentionRow(q + r * hd, k + (kv_head * t + first) * hd,
                                v + (kv_head * t + first) * hd,
                                end > first ? end - first : 0, hd, scale, acc,
                                out + r * hd, lse + r);
  }
}

template <typename T>
__global__ void CausalAttentionDqKernel(const T* q, const T* k, const T* v,
                                        const T* out, const float* lse,
                                        const T* dout, int64_t b, int64_t h,
                                        int64_t kv, int64_t t, int64_t hd,
                                        float scale, const int32_t* lo,
                                        const int32_t* hi, T* dq) {
  for (int64_t r = FirstIndex(); r < b * h * t; r += GridStride()) {
    const int64_t head = r / t, i = r % t;
    const int64_t kv_head = (head / h) * kv + (head % h) / (h / kv);
    const int64_t first = kernels::KeyLo(BoundRow(lo, head / h, t), i, t);
    const int64_t end = kernels::KeyHi(BoundRow(hi, head / h, t), i, t);
    float acc[kMaxAttentionHeadDim];
    const float delta = kernels::DotF32(dout + r * hd, out + r * hd, hd);
    kernels::CausalAttentionDqRow(q + r * hd, k + (kv_head * t + first) * hd,
                                  v + (kv_head * t + first) * hd, dout + r * hd,
                                  delta, lse[r], end > first ? end - first : 0,
                                  hd, scale, acc, dq + r * hd);
  }
}

template <typename T>
__global__ void CausalAttentionDkDvKernel(const T* q, const T* k, const T* v,
                                          const T* out, const float* lse,
                                          const T* dout, int64_t b, int64_t h,
                                          int64_t kv, int64_t t, int64_t hd,
                                          float scale, const int32_t* lo,
                                          const int32_t* hi, T* dk, T* dv) {
  const int64_t rep = h / kv;
  for (int64_t r = FirstIndex(); r < b * kv * t; r += GridStride()) {
    const int64_t kv_head = r / t, j = r % t, bi = kv_head / kv;
    const int64_t first = bi * h + (kv_head % kv) * rep;
    const int32_t* lo_row = BoundRow(lo, bi, t);
    const int32_t* hi_row = BoundRow(hi, bi, t);
    float dk_acc[kMaxAttentionHeadDim], dv_acc[kMaxAttentionHeadDim];
    for (int64_t e = 0; e < hd; ++e) dk_acc[e] = dv_acc[e] = 0.0f;
    for (int64_t head = first; head < first + rep; ++head) {
      // Causal rows i < j never see key j.
      for (int64_t i = hi == nullptr ? j : 0; i < t; ++i) {
        if (j < kernels::KeyLo(lo_row, i, t) ||
            j >= kernels::KeyHi(hi_row, i, t)) {
          continue;  // key j is outside row i's range
        }
        const int64_t row = head * t + i;
        const float delta =
            kernels::DotF32(dout + row * hd, out + row * hd, hd);
        kernels::CausalAttentionDkDvTerm(q + row * hd, k + r * hd, v + r * hd,
                                         dout + row * hd, delta, lse[row], hd,
                                         scale, dk_acc, dv_acc);
      }
    }
    for (int64_t e = 0; e < hd; ++e) {
      dk[r * hd + e] = FromFloat<T>(dk_acc[e]);
      dv[r * hd + e] = FromFloat<T>(dv_acc[e]);
    }
  }
}

// Row ops run two ways: a Vec<T> per lane at a time when c is a multiple of
// kVec and every row pointer is aligned (RowsVectorizable: GPT-2's and
// Llama's widths), else an element per lane at a time.
template <typename T>
bool RowsVectorizable(int64_t c, std::initializer_list<const void*> pointers) {
  if (c % kVec != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % alignof(Vec<T>) != 0) {
      return false;
    }
  }
  return true;
}

// Calls f(j, row[j] as float) for the elements of a row of c that this lane
// owns: the elements of vectors lane, lane + 32, ... (kVectors), else
// elements lane, lane + 32, ...
template <bool kVectors, typename T, typename F>
__device__ __forceinline__ void ForLaneElements(const T* row, int64_t c, F f) {
  const int lane = Lane();
  if (kVectors) {
    const Vec<T>* vecs = reinterpret_cast<const Vec<T>*>(row);
    for (int64_t q = lane; q < c / kVec; q += kWarpSize) {
      const Vec<T> a = vecs[q];
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(q * kVec + k, ToFloat(a.v[k]));
    }
  } else {
    for (int64_t j = lane; j < c; j += kWarpSize) f(j, ToFloat(row[j]));
  }
}

// Writes out[j] = g(j) for the elements this lane owns (as ForLaneElements).
template <bool kVectors, typename T, typename G>
__device__ __forceinline__ void StoreLaneElements(T* out, int64_t c, G g) {
  const int lane = Lane();
  if (kVectors) {
    Vec<T>* vecs = reinterpret_cast<Vec<T>*>(out);
    for (int64_t q = lane; q < c / kVec; q += kWarpSize) {
      Vec<T> r;
#pragma unroll
      for (int k = 0; k < kVec; ++k) r.v[k] = FromFloat<T>(g(q * kVec + k));
      vecs[q] = r;
    }
  } else {
    for (int64_t j = lane; j < c; j += kWarpSize) out[j] = FromFloat<T>(g(j));
  }
}

// LayerNorm, a warp per row (two passes for mean and variance, as the CPU).
template <bool kVectors, typename T>
__global__ void LayerNormKernel(const T* x, const T* weight, const T* bias,
                                float eps, int64_t rows, int64_t c, T* out,
                                float* mean, float* rstd) {
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const T* xr = x + r * c;
    float sum = 0.0f;
    ForLaneElements<kVectors>(xr, c, [&](int64_t, float v) { sum += v; });
    const float m = WarpSum(sum) * inv_c;
    float var = 0.0f;
    ForLaneElements<kVectors>(xr, c, [&](int64_t, float v) {
      const float d = v - m;
      var += d * d;
    });
    const float rs = 1.0f / sqrtf(WarpSum(var) * inv_c + eps);
    StoreLaneElements<kVectors>(out + r * c, c, [&](int64_t j) {
      float v = (ToFloat(xr[j]) - m) * rs * ToFloat(weight[j]);
      if (bias != nullptr) v += ToFloat(bias[j]);
      return v;
    });
    if (Lane() == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
  }
}

// LayerNorm's dx, a warp per row.
template <bool kVectors, typename T>
__global__ void LayerNormBackwardRowsKernel(const T* dy, const T* x,
                                            const T* weight, const float* mean,
                                            const float* rstd, int64_t rows,
                                            int64_t c, T* dx) {
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const int64_t o = r * c;
    const float m = mean[r], rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    ForLaneElements<kVectors>(dy + o, c, [&](int64_t j, float d) {
      const float g = d * ToFloat(weight[j]);
      sg += g;
      sgx += g * (ToFloat(x[o + j]) - m) * rs;
    });
    const float mean_g = WarpSum(sg) * inv_c;
    const float mean_gx = WarpSum(sgx) * inv_c;
    StoreLaneElements<kVectors>(dx + o, c, [&](int64_t j) {
      const float g = ToFloat(dy[o + j]) * ToFloat(weight[j]);
      const float xhat = (ToFloat(x[o + j]) - m) * rs;
      return rs * (g - mean_g - xhat * mean_gx);
    });
  }
}

// RMSNorm, a warp per row.
template <typename T>
__global__ void RmsNormKernel(const T* x, const T* weight, float eps,
                              int64_t rows, int64_t c, T* out, float* rstd) {
  const int lane = Lane();
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const T* xr = x + r * c;
    float ss = 0.0f;
    for (int64_t j = lane; j < c; j += kWarpSize) {
      const float v = ToFloat(xr[j]);
      ss += v * v;
    }
    const float rs = 1.0f / sqrtf(WarpSum(ss) / static_cast<float>(c) + eps);
    for (int64_t j = lane; j < c; j += kWarpSize) {
      out[r * c + j] = FromFloat<T>(ToFloat(xr[j]) * rs * ToFloat(weight[j]));
    }
    if (lane == 0) rstd[r] = rs;
  }
}

// RMSNorm's dx, a warp per row.
template <typename T>
__global__ void RmsNormBackwardRowsKernel(const T* dy, const T* x,
                                          const T* weight, const float* rstd,
                                          int64_t rows, int64_t c, T* dx) {
  const int lane = Lane();
  for (int64_t r = FirstWarp(); r < rows; r += WarpStride()) {
    const int64_t o = r * c;
    const float rs = rstd[r];
    float sgx = 0.0f;
    for (int64_t j = lane; j < c; j += kWarpSize) {
      sgx += ToFloat(dy[o + j]) * ToFloat(weight[j]) * ToFloat(x[o + j]) * rs;
    }
    const float mean_gx = WarpSum(sgx) / static_cast<float>(c);
    for (int64_t j = lane; j < c; j += kWarpSize) {
      const float g = ToFloat(dy[o + j]) * ToFloat(weight[j]);
      dx[o + j] = FromFloat<T>(rs * (g - ToFloat(x[o + j]) * rs * mean_gx));
    }
  }
}

// Whether a row of v elements at `row` reads as whole aligned vectors.
template <typename T>
__device__ __forceinline__ bool RowVectors(const T* row, int64_t v) {
  return v % kVec == 0 &&
         reinterpret_cast<uintptr_t>(row) % alignof(Vec<T>) == 0;
}

// The block's MaxSum of one row of v logits (every thread gets it): one
// pass, a vector of kVec logits at a time where the row allows.
template <typename T>
__device__ __forceinline__ MaxSum RowMaxSum(const T* row, int64_t v,
                                            float* sh) {
  MaxSum m;
  if (RowVectors(row, v)) {
    const Vec<T>* vecs = reinterpret_cast<const Vec<T>*>(row);
    for (int64_t q = threadIdx.x; q < v / kVec; q += blockDim.x) {
      const Vec<T> a = vecs[q];
      float x[kVec];
      float chunk_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        x[k] = ToFloat(a.v[k]);
        chunk_max = fmaxf(chunk_max, x[k]);
      }
      if (chunk_max > m.max) {
        m.sum = m.max == -INFINITY ? 0.0f : m.sum * __expf(m.max - chunk_max);
        m.max = chunk_max;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) m.sum += __expf(x[k] - m.max);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      m.Add(ToFloat(row[j]));
    }
  }
  return BlockMaxSum(m, sh);
}

// dlogits = dloss * (exp(x - max) / sum - onehot(target)) over one row, by
// the block's threads (target -1: none in this row).
template <typename T>
__device__ __forceinline__ void RowSoftmaxGrad(const T* row, int64_t v,
                                               int64_t target, float max,
                                               float sum, float dloss,
                                               T* drow) {
  const float scale = dloss / sum;
  if (RowVectors(row, v) && RowVectors(drow, v)) {
    const Vec<T>* in = reinterpret_cast<const Vec<T>*>(row);
    Vec<T>* out = reinterpret_cast<Vec<T>*>(drow);
    for (int64_t q = threadIdx.x; q < v / kVec; q += blockDim.x) {
      const Vec<T> a = in[q];
      Vec<T> r;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float g = __expf(ToFloat(a.v[k]) - max) * scale;
        if (q * kVec + k == target) g -= dloss;
        r.v[k] = FromFloat<T>(g);
      }
      out[q] = r;
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    float g = __expf(ToFloat(row[j]) - max) * scale;
    if (j == target) g -= dloss;
    drow[j] = FromFloat<T>(g);
  }
}

// drow[0, v) = 0 by the block's threads (an ignored target's gradient).
template <typename T>
__device__ __forceinline__ void ZeroRow(T* drow, int64_t v) {
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    drow[j] = FromFloat<T>(0.0f);
  }
}

// Cross-entropy, a block per row (one online pass for max and sum).
template <typename T, typename I>
__global__ void CrossEntropyKernel(const T* logits, const I* targets, int64_t n,
                                   int64_t v, int64_t ignore_index,
                                   float* losses, float* lse) {
  __shared__ float sh[kWarpSize];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t == ignore_index) {
      if (threadIdx.x == 0) {
        losses[i] = 0.0f;
        if (lse != nullptr) lse[i] = 0.0f;
      }
      continue;
    }
    const T* row = logits + i * v;
    const MaxSum m = RowMaxSum(row, v, sh);
    if (threadIdx.x == 0) {
      const float row_lse = logf(m.sum) + m.max;
      // t is range-checked before the launch; never read outside the row.
      losses[i] = t >= 0 && t < v ? row_lse - ToFloat(row[t]) : NAN;
      if (lse != nullptr) lse[i] = row_lse;
    }
  }
}

template <typename T, typename I>
__global__ void CrossEntropyBackwardKernel(const T* logits, const I* targets,
                                           const float* dlosses,
                                           const float* lse, int64_t n,
                                           int64_t v, int64_t ignore_index,
                                           T* dlogits) {
  __shared__ float sh[kWarpSize];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    T* drow = dlogits + i * v;
    if (t == ignore_index) {
      ZeroRow(drow, v);
      continue;
    }
    const T* row = logits + i * v;
    if (lse != nullptr) {  // exp(x - lse): one pass
      RowSoftmaxGrad(row, v, t, lse[i], 1.0f, dlosses[i], drow);
      continue;
    }
    const MaxSum m = RowMaxSum(row, v, sh);
    RowSoftmaxGrad(row, v, t, m.max, m.sum, dlosses[i], drow);
  }
}

// Loss parallel: a block per row of this rank's vocabulary slice.
template <typename T, typename I>
__global__ void CrossEntropyShardStatsKernel(
    const T* logits, const I* targets, int64_t n, int64_t v, int64_t offset,
    int64_t ignore_index, float* max, float* sumexp, float* target_logit) {
  __shared__ float sh[kWarpSize];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t == ignore_index) {
      if (threadIdx.x == 0) max[i] = sumexp[i] = target_logit[i] = 0.0f;
      continue;
    }
    const T* row = logits + i * v;
    const MaxSum m = RowMaxSum(row, v, sh);
    if (threadIdx.x == 0) {
      const int64_t local = kernels::LocalTarget(t, ignore_index, offset, v);
      max[i] = m.max;
      sumexp[i] = m.sum;
      target_logit[i] = local >= 0 ? ToFloat(row[local]) : 0.0f;
    }
  }
}

template <typename T, typename I>
__global__ void CrossEntropyShardBackwardKernel(
    const T* logits, const I* targets, const float* max, const float* sumexp,
    const float* dlosses, int64_t n, int64_t v, int64_t offset,
    int64_t ignore_index, T* dlogits) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    T* drow = dlogits + i * v;
    if (t == ignore_index) {
      ZeroRow(drow, v);
      continue;
    }
    RowSoftmaxGrad(logits + i * v, v,
                   kernels::LocalTarget(t, ignore_index, offset, v), max[i],
                   sumexp[i], dlosses[i], drow);
  }
}

// -------------------------------------------------------------- embedding

// out[i, j] = table[ids[i], j], one thread per output element.
template <typename T, typename I>
__global__ void EmbeddingKernel(const I* ids, const T* table, int64_t n,
                                int64_t v, int64_t c, int64_t row_offset,
                                T* out) {
  const int64_t total = n * c;
  for (int64_t e = FirstIndex(); e < total; e += GridStride()) {
    const int64_t i = e / c, j = e % c;
    const int64_t row = static_cast<int64_t>(ids[i]) - row_offset;
    out[e] = row >= 0 && row < v ? table[row * c + j] : FromFloat<T>(0.0f);
  }
}

// EmbeddingBackward over ids sorted stably (sorted_ids, and positions: the
// index in ids of each): a block per run of equal ids (blockIdx.x, at the
// run's start) and tile of kEmbeddingColumns columns (blockIdx.y), a thread
// per column adding the run's dout rows in position order onto dtable[id]
// with the CPU's per-step rounding to T: the result is the CPU's bit for bit
// and no two blocks write one element. The run's positions are staged in
// shared memory and eight rows' loads are in flight before their adds.
constexpr int kEmbeddingColumns = 128;
constexpr int kEmbeddingChunk = 256;

template <typename T, typename I>
__global__ void EmbeddingBackwardRunsKernel(const I* sorted_ids,
                                            const int32_t* positions,
                                            const T* dout, int64_t n, int64_t v,
                                            int64_t c, int64_t row_offset,
                                            T* dtable) {
  __shared__ int32_t pos[kEmbeddingChunk];
  const int64_t j =
      static_cast<int64_t>(blockIdx.y) * kEmbeddingColumns + threadIdx.x;
  for (int64_t start = blockIdx.x; start < n; start += gridDim.x) {
    // Block-uniform: every thread takes the same branches.
    const I id = sorted_ids[start];
    if (start > 0 && sorted_ids[start - 1] == id) continue;  // not a run start
    const int64_t row = static_cast<int64_t>(id) - row_offset;
    if (row < 0 || row >= v) continue;  // Another rank's row.
    int64_t end = start + 1;
    while (end < n && sorted_ids[end] == id) ++end;
    T acc = j < c ? dtable[row * c + j] : FromFloat<T>(0.0f);
    for (int64_t base = start; base < end; base += kEmbeddingChunk) {
      const int64_t left = end - base;
      const int count = static_cast<int>(
          left < kEmbeddingChunk ? left : int64_t{kEmbeddingChunk});
      __syncthreads();  // the previous chunk's positions are consumed
      for (int k = threadIdx.x; k < count; k += blockDim.x) {
        pos[k] = positions[base + k];
      }
      __syncthreads();
      if (j >= c) continue;
      int k = 0;
      for (; k + 8 <= count; k += 8) {
        float d[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          d[u] = ToFloat(dout[static_cast<int64_t>(pos[k + u]) * c + j]);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc = FromFloat<T>(ToFloat(acc) + d[u]);
      }
      for (; k < count; ++k) {
        acc = FromFloat<T>(ToFloat(acc) +
                           ToFloat(dout[static_cast<int64_t>(pos[k]) * c + j]));
      }
    }
    if (j < c) dtable[row * c + j] = acc;
  }
}

__global__ void IotaKernel(int32_t* out, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    out[i] = static_cast<int32_t>(i);
  }
}

// ---------------------------------------------------------------- backend

// True when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) intersect.
bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

class CudaBackendImpl final : public Backend {
 public:
  explicit CudaBackendImpl(int device) : device_(device) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
            cudaSuccess ||
        sms <= 0) {
      cudaGetLastError();  // Not sticky; the first real call reports it.
      sms = kFallbackSms;
    }
    max_blocks_ = sms * kBlocksPerSm;
  }

  absl::Status Copy(const Tensor& src, Tensor* dst) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    if (src.dtype() == dst->dtype() &&
        (src.numel() == 0 || src.raw_data() == dst->raw_data())) {
      return absl::OkStatus();
    }
    const bool overlap =
        Overlap(src.raw_data(), src.nbytes(), dst->raw_data(), dst->nbytes());
    if (src.dtype() == dst->dtype() && !overlap) {
      FSDPP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst->raw_data(), src.raw_data(), src.nbytes(),
                          cudaMemcpyDeviceToDevice, cudaStreamLegacy));
      return absl::OkStatus();
    }
    if (!overlap) return Cast(src, dst);
    // Overlapping views of one storage: stage src in a fresh buffer, which
    // must outlive the work reading it (allocator blocks are reusable as soon
    // as they are freed), hence the synchronisation.
    FSDPP_ASSIGN_OR_RETURN(
        Tensor staged, Tensor::Empty(src.shape(), src.dtype(), src.device()));
    FSDPP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staged.raw_data(), src.raw_data(), src.nbytes(),
                        cudaMemcpyDeviceToDevice, cudaStreamLegacy));
    if (src.dtype() == dst->dtype()) {
      FSDPP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst->raw_data(), staged.raw_data(), src.nbytes(),
                          cudaMemcpyDeviceToDevice, cudaStreamLegacy));
    } else {
      FSDPP_RETURN_IF_ERROR(Cast(staged, dst));
    }
    CountHostSync();
    FSDPP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
    return absl::OkStatus();
  }

  absl::Status Fill(Tensor* t, float value) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t n = t->numel();
    return DispatchFloat(t->dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("Fill", n, kThreads, FillKernel<T>,
                    static_cast<T*>(t->raw_data()), n, FromFloat<T>(value));
    });
  }

  absl::Status Unary(UnaryKind kind, float alpha, const Tensor& x,
                     Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t n = x.numel();
    return DispatchFloat(x.dtype(), [&](auto tag_T) -> absl::Status {
      using T = typename decltype(tag_T)::type;
      const T* in = static_cast<const T*>(x.raw_data());
      T* o = static_cast<T*>(out->raw_data());
      switch (kind) {
        case UnaryKind::kScale:
          return UnaryOp("Scale", in, o, n, kernels::ScaleOp{alpha});
        case UnaryKind::kGelu:
          return UnaryOp("Gelu", in, o, n, kernels::GeluOp{});
        case UnaryKind::kSilu:
          return UnaryOp("Silu", in, o, n, kernels::SiluOp{});
      }
      return absl::InternalError("cuda backend: unknown UnaryKind");
    });
  }

  absl::Status Binary(BinaryKind kind, float alpha, const Tensor& a,
                      const Tensor& b, Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t n = a.numel();
    return DispatchFloat(a.dtype(), [&](auto tag_T) -> absl::Status {
      using T = typename decltype(tag_T)::type;
      const T* pa = static_cast<const T*>(a.raw_data());
      const T* pb = static_cast<const T*>(b.raw_data());
      T* o = static_cast<T*>(out->raw_data());
      switch (kind) {
        case BinaryKind::kAdd:
          return BinaryOp("Add", pa, pb, o, n, kernels::AddOp{});
        case BinaryKind::kMul:
          return BinaryOp("Mul", pa, pb, o, n, kernels::MulOp{});
        case BinaryKind::kAxpy:
          return BinaryOp("Axpy", pa, pb, o, n, kernels::AxpyOp{alpha});
        case BinaryKind::kGeluBackward:
          return BinaryOp("GeluBackward", pa, pb, o, n,
                          kernels::GeluBackwardOp{});
        case BinaryKind::kSiluBackward:
          return BinaryOp("SiluBackward", pa, pb, o, n,
                          kernels::SiluBackwardOp{});
      }
      return absl::InternalError("cuda backend: unknown BinaryKind");
    });
  }

  absl::Status Reduce(ReduceKind kind, const Tensor& x, Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t n = x.numel();
    // Both stages share the scratch buffer: keep other threads' reductions
    // from interleaving their launches with ours.
    std::lock_guard<std::mutex> lock(reduce_mu_);
    if (reduce_scratch_ == nullptr) {
      FSDPP_CUDA_RETURN_IF_ERROR(
          cudaMalloc(&reduce_scratch_, kReduceBlocks * sizeof(double)));
    }
    const int blocks = static_cast<int>(
        std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kReduceBlocks));
    FSDPP_RETURN_IF_ERROR(DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* px = static_cast<const T*>(x.raw_data());
      if (kind == ReduceKind::kSumOfSquares) {
        ReducePartialKernel<T, true>
            <<<blocks, kThreads, 0, cudaStreamLegacy>>>(px, n, reduce_scratch_);
      } else {
        ReducePartialKernel<T, false>
            <<<blocks, kThreads, 0, cudaStreamLegacy>>>(px, n, reduce_scratch_);
      }
      return CudaStatus(cudaGetLastError(), "Reduce stage one launch");
    }));
    ReduceFinalKernel<<<1, kThreads, 0, cudaStreamLegacy>>>(
        reduce_scratch_, blocks, out->data<float>());
    return CudaStatus(cudaGetLastError(), "Reduce stage two launch");
  }

  absl::Status SumRowsAccumulate(const Tensor& x, int64_t rows, int64_t cols,
                                 Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchFloat(out->dtype(), [&](auto tag_O) {
        using O = typename decltype(tag_O)::type;
        return ColumnSums<1>(
            "SumRowsAccumulate",
            SumTerm<T>{static_cast<const T*>(x.raw_data()), cols}, rows, cols,
            static_cast<O*>(out->raw_data()), static_cast<O*>(nullptr));
      });
    });
  }

  absl::Status Matmul(const MatmulArgs& m) override {
    float beta = m.beta;
    // The bias through cuBLASLt's epilogue where it takes it; else broadcast
    // into c first.
    const void* epilogue_bias =
        m.bias != nullptr && m.bias->dtype() == m.c->dtype() &&
                CublasLtTakesBias(m.batch, m.bias->raw_data())
            ? m.bias->raw_data()
            : nullptr;
    if (m.bias != nullptr && epilogue_bias == nullptr) {
      // The bias in every row of c, then the product added onto it.
      FSDPP_RETURN_IF_ERROR(Prepare());
      const int64_t rows = m.batch * m.m;
      FSDPP_RETURN_IF_ERROR(DispatchFloat(m.c->dtype(), [&](auto tag_T) {
        using T = typename decltype(tag_T)::type;
        return Launch("Matmul bias", rows * m.n, kThreads,
                      BroadcastRowKernel<T>,
                      static_cast<const T*>(m.bias->raw_data()),
                      static_cast<T*>(m.c->raw_data()), rows, m.n);
      }));
      beta = 1.0f;
    }
    return CublasLtMatmul(device_, m.a->raw_data(), m.b->raw_data(),
                          m.c->raw_data(), m.a->dtype(), m.c->dtype(), m.batch,
                          m.m, m.n, m.k, m.transpose_a, m.transpose_b,
                          m.broadcast_b, m.alpha, beta, epilogue_bias);
  }

  absl::Status Softmax(const Tensor& x, int64_t rows, int64_t n, int64_t tq,
                       int64_t causal_offset, Tensor* y) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("Softmax", rows * kWarpSize, kThreads, SoftmaxKernel<T>,
                    static_cast<const T*>(x.raw_data()), rows, n, tq,
                    causal_offset, static_cast<T*>(y->raw_data()));
    });
  }

  absl::Status CopyColumns(const Tensor& src, int64_t src_first, Tensor* dst,
                           int64_t dst_first, int64_t rows,
                           int64_t count) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const size_t esize = DTypeSize(src.dtype());
    FSDPP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        static_cast<char*>(dst->raw_data()) + dst_first * esize,
        dst->dim(1) * esize,
        static_cast<const char*>(src.raw_data()) + src_first * esize,
        src.dim(1) * esize, count * esize, rows, cudaMemcpyDeviceToDevice,
        cudaStreamLegacy));
    return absl::OkStatus();
  }

  absl::Status CopyHeads(const Tensor& src, Tensor* dst, int64_t b, int64_t t,
                         int64_t heads, int64_t first, int64_t n, int64_t hd,
                         bool merge) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t esize = DTypeSize(src.dtype());
    const bool vec = hd * esize % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(src.raw_data()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst->raw_data()) % 16 == 0;
    const int64_t row = vec ? hd * esize / 16 : hd;
    auto launch = [&](auto unit, auto index) {
      using U = decltype(unit);
      using IndexT = decltype(index);
      return Launch("CopyHeads", b * n * t * row, kThreads,
                    CopyHeadsKernel<U, IndexT>,
                    static_cast<const U*>(src.raw_data()),
                    static_cast<U*>(dst->raw_data()), static_cast<IndexT>(b),
                    static_cast<IndexT>(t), static_cast<IndexT>(heads),
                    static_cast<IndexT>(first), static_cast<IndexT>(n),
                    static_cast<IndexT>(row), merge);
    };
    // 32-bit indices when the wide tensor's units fit.
    const bool narrow_index = b * t * heads * row < (int64_t{1} << 31);
    auto by_index = [&](auto unit) {
      return narrow_index ? launch(unit, uint32_t()) : launch(unit, int64_t());
    };
    if (vec) return by_index(uint4());
    switch (esize) {
      case 1:
        return by_index(uint8_t());
      case 2:
        return by_index(uint16_t());
      case 4:
        return by_index(uint32_t());
      default:
        return by_index(uint64_t());
    }
  }

  absl::Status Rope(Tensor* x, int64_t rows, int64_t seq_len, int64_t head_dim,
                    const float* inv_freq, bool inverse,
                    const Tensor* positions) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    if (head_dim / 2 > kMaxRopeFrequencies) {
      return absl::InvalidArgumentError(
          absl::StrCat("Rope on CUDA: head dim ", head_dim,
                       " is above the kernel's ", 2 * kMaxRopeFrequencies));
    }
    RopeFrequencies f = {};
    for (int64_t i = 0; i < head_dim / 2; ++i) f.inv_freq[i] = inv_freq[i];
    return DispatchFloat(x->dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const int64_t batch = positions != nullptr ? positions->dim(0) : 1;
      return Launch("Rope", rows * (head_dim / 2), kThreads, RopeKernel<T>,
                    static_cast<T*>(x->raw_data()), rows, seq_len, head_dim, f,
                    inverse,
                    positions != nullptr ? positions->data<int32_t>() : nullptr,
                    std::max<int64_t>(1, rows / batch));
    });
  }

  absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, int64_t rows,
                               int64_t n, Tensor* dx) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(y.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("SoftmaxBackward", rows * kWarpSize, kThreads,
                    SoftmaxBackwardKernel<T>,
                    static_cast<const T*>(y.raw_data()),
                    static_cast<const T*>(dy.raw_data()), rows, n,
                    static_cast<T*>(dx->raw_data()));
    });
  }

  absl::Status CausalAttention(const Tensor& q, const Tensor& k,
                               const Tensor& v, int64_t b, int64_t h,
                               int64_t kv, int64_t t, int64_t hd, float scale,
                               const KeyRange& keys, Tensor* out,
                               Tensor* lse) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const AttentionCall call{q.dtype(), b, h, kv, t, hd, scale};
    // Document masks: the reference kernel (cuDNN's graphs here take whole
    // causal sequences only).
    if (Causal(keys) && CudnnAttention::Applies(call, false)) {
      FSDPP_ASSIGN_OR_RETURN(const bool ran,
                             CudnnAttention::ForDevice(device_)->Forward(
                                 call, q.raw_data(), k.raw_data(), v.raw_data(),
                                 out->raw_data(), lse->data<float>()));
      if (ran) return absl::OkStatus();
    }
    FSDPP_RETURN_IF_ERROR(CheckAttentionHeadDim(hd));
    return DispatchFloat(q.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("CausalAttention", b * h * t, kRowThreads,
                    CausalAttentionKernel<T>,
                    static_cast<const T*>(q.raw_data()),
                    static_cast<const T*>(k.raw_data()),
                    static_cast<const T*>(v.raw_data()), b, h, kv, t, hd, scale,
                    Bound(keys.lo), Bound(keys.hi),
                    static_cast<T*>(out->raw_data()), lse->data<float>());
    });
  }

  absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& dout,
                                       int64_t b, int64_t h, int64_t kv,
                                       int64_t t, int64_t hd, float scale,
                                       const KeyRange& keys, Tensor* dq,
                                       Tensor* dk, Tensor* dv) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const AttentionCall call{q.dtype(), b, h, kv, t, hd, scale};
    if (Causal(keys) && CudnnAttention::Applies(call, true)) {
      FSDPP_ASSIGN_OR_RETURN(
          const bool ran,
          CudnnAttention::ForDevice(device_)->Backward(
              call, q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
              lse.data<float>(), dout.raw_data(), dq->raw_data(),
              dk->raw_data(), dv->raw_data()));
      if (ran) return absl::OkStatus();
    }
    FSDPP_RETURN_IF_ERROR(CheckAttentionHeadDim(hd));
    return DispatchFloat(q.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pq = static_cast<const T*>(q.raw_data());
      const T* pk = static_cast<const T*>(k.raw_data());
      const T* pv = static_cast<const T*>(v.raw_data());
      const T* po = static_cast<const T*>(out.raw_data());
      const T* pdo = static_cast<const T*>(dout.raw_data());
      FSDPP_RETURN_IF_ERROR(Launch("CausalAttentionBackward dq", b * h * t,
                                   kRowThreads, CausalAttentionDqKernel<T>, pq,
                                   pk, pv, po, lse.data<float>(), pdo, b, h, kv,
                                   t, hd, scale, Bound(keys.lo), Bound(keys.hi),
                                   static_cast<T*>(dq->raw_data())));
      return Launch(
          "CausalAttentionBackward dk dv", b * kv * t, kRowThreads,
          CausalAttentionDkDvKernel<T>, pq, pk, pv, po, lse.data<float>(), pdo,
          b, h, kv, t, hd, scale, Bound(keys.lo), Bound(keys.hi),
          static_cast<T*>(dk->raw_data()), static_cast<T*>(dv->raw_data()));
    });
  }

  absl::Status DocumentMask(const Tensor& ids, int64_t b, int64_t t,
                            int64_t eot_id, Tensor* key_start,
                            Tensor* positions) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const auto launch = [&](const auto* id) {
      using Id = std::remove_const_t<std::remove_pointer_t<decltype(id)>>;
      return Launch("DocumentMask", b, kThreads, DocumentMaskKernel<Id>, id, b,
                    t, eot_id, key_start->data<int32_t>(),
                    positions->data<int32_t>());
    };
    if (ids.dtype() == DType::kI32) return launch(ids.data<int32_t>());
    return launch(ids.data<int64_t>());
  }

  static const int32_t* Bound(const Tensor* bound) {
    return bound != nullptr ? bound->data<int32_t>() : nullptr;
  }
  static bool Causal(const KeyRange& keys) {
    return keys.lo == nullptr && keys.hi == nullptr;
  }

  absl::Status MergeAttention(const Tensor& out_part, const Tensor& lse_part,
                              int64_t rows, int64_t hd, Tensor* out,
                              Tensor* lse) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(out->dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("MergeAttention", rows, kThreads, MergeAttentionKernel<T>,
                    static_cast<const T*>(out_part.raw_data()),
                    lse_part.data<float>(), rows, hd,
                    static_cast<T*>(out->raw_data()), lse->data<float>());
    });
  }

  static absl::Status CheckAttentionHeadDim(int64_t hd) {
    if (hd <= kMaxAttentionHeadDim) return absl::OkStatus();
    return absl::UnimplementedError(
        absl::StrCat("CausalAttention on CUDA: head_dim ", hd,
                     " is over the supported ", kMaxAttentionHeadDim));
  }

  absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                         const Tensor* bias, float eps, int64_t rows, int64_t c,
                         Tensor* out, Tensor* mean, Tensor* rstd) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pb = bias ? static_cast<const T*>(bias->raw_data()) : nullptr;
      const bool vec = RowsVectorizable<T>(
          c, {x.raw_data(), weight.raw_data(), pb, out->raw_data()});
      return Launch("LayerNorm", rows * kWarpSize, kThreads,
                    vec ? LayerNormKernel<true, T> : LayerNormKernel<false, T>,
                    static_cast<const T*>(x.raw_data()),
                    static_cast<const T*>(weight.raw_data()), pb, eps, rows, c,
                    static_cast<T*>(out->raw_data()), mean->data<float>(),
                    rstd->data<float>());
    });
  }

  absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd, int64_t rows, int64_t c,
                                 Tensor* dx, Tensor* dweight,
                                 Tensor* dbias) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pdy = static_cast<const T*>(dy.raw_data());
      const T* px = static_cast<const T*>(x.raw_data());
      const float* pm = mean.data<float>();
      const float* pr = rstd.data<float>();
      T* pdb = dbias ? static_cast<T*>(dbias->raw_data()) : nullptr;
      const bool vec =
          RowsVectorizable<T>(c, {pdy, px, weight.raw_data(), dx->raw_data()});
      FSDPP_RETURN_IF_ERROR(
          Launch("LayerNormBackward rows", rows * kWarpSize, kThreads,
                 vec ? LayerNormBackwardRowsKernel<true, T>
                     : LayerNormBackwardRowsKernel<false, T>,
                 pdy, px, static_cast<const T*>(weight.raw_data()), pm, pr,
                 rows, c, static_cast<T*>(dx->raw_data())));
      return ColumnSums<2>("LayerNormBackward columns",
                           LayerNormParamTerm<T>{pdy, px, pm, pr, c}, rows, c,
                           static_cast<T*>(dweight->raw_data()), pdb);
    });
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                       int64_t rows, int64_t c, Tensor* out,
                       Tensor* rstd) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("RmsNorm", rows * kWarpSize, kThreads, RmsNormKernel<T>,
                    static_cast<const T*>(x.raw_data()),
                    static_cast<const T*>(weight.raw_data()), eps, rows, c,
                    static_cast<T*>(out->raw_data()), rstd->data<float>());
    });
  }

  absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                               const Tensor& weight, const Tensor& rstd,
                               int64_t rows, int64_t c, Tensor* dx,
                               Tensor* dweight) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pdy = static_cast<const T*>(dy.raw_data());
      const T* px = static_cast<const T*>(x.raw_data());
      const float* pr = rstd.data<float>();
      FSDPP_RETURN_IF_ERROR(Launch("RmsNormBackward rows", rows * kWarpSize,
                                   kThreads, RmsNormBackwardRowsKernel<T>, pdy,
                                   px, static_cast<const T*>(weight.raw_data()),
                                   pr, rows, c,
                                   static_cast<T*>(dx->raw_data())));
      return ColumnSums<1>(
          "RmsNormBackward columns", RmsNormParamTerm<T>{pdy, px, pr, c}, rows,
          c, static_cast<T*>(dweight->raw_data()), static_cast<T*>(nullptr));
    });
  }

  absl::Status Embedding(const Tensor& ids, const Tensor& table, int64_t n,
                         int64_t v, int64_t c, int64_t row_offset,
                         int64_t vocab, Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(CheckIds(ids, n, vocab, false, 0, "Embedding"));
    return DispatchFloat(table.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(ids.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("Embedding", n * c, kThreads, EmbeddingKernel<T, I>,
                      static_cast<const I*>(ids.raw_data()),
                      static_cast<const T*>(table.raw_data()), n, v, c,
                      row_offset, static_cast<T*>(out->raw_data()));
      });
    });
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                                 int64_t n, int64_t v, int64_t c,
                                 int64_t row_offset, int64_t vocab,
                                 Tensor* dtable) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(
        CheckIds(ids, n, vocab, false, 0, "EmbeddingBackward"));
    if (n == 0) return absl::OkStatus();
    return DispatchFloat(dout.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(ids.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return EmbeddingBackwardSorted<T, I>(
            static_cast<const I*>(ids.raw_data()),
            static_cast<const T*>(dout.raw_data()), n, v, c, row_offset, vocab,
            static_cast<T*>(dtable->raw_data()));
      });
    });
  }

  absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                            int64_t n, int64_t v, int64_t ignore_index,
                            Tensor* losses, Tensor* lse) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropy"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropy", n * kThreads, kThreads,
                      CrossEntropyKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()), n, v,
                      ignore_index, losses->data<float>(),
                      lse == nullptr ? nullptr : lse->data<float>());
      });
    });
  }

  absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                    const Tensor& dlosses, int64_t n, int64_t v,
                                    int64_t ignore_index, const Tensor* lse,
                                    Tensor* dlogits) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropyBackward"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropyBackward", n * kThreads, kThreads,
                      CrossEntropyBackwardKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()),
                      dlosses.data<float>(),
                      lse == nullptr ? nullptr : lse->data<float>(), n, v,
                      ignore_index, static_cast<T*>(dlogits->raw_data()));
      });
    });
  }

  absl::Status CrossEntropyShardStats(const Tensor& logits,
                                      const Tensor& targets, int64_t n,
                                      int64_t v, int64_t vocab_offset,
                                      int64_t vocab_size, int64_t ignore_index,
                                      Tensor* max, Tensor* sumexp,
                                      Tensor* target_logit) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(CheckIds(targets, n, vocab_size, true, ignore_index,
                                   "CrossEntropyShardStats"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropyShardStats", n * kThreads, kThreads,
                      CrossEntropyShardStatsKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()), n, v,
                      vocab_offset, ignore_index, max->data<float>(),
                      sumexp->data<float>(), target_logit->data<float>());
      });
    });
  }

  absl::Status CrossEntropyShardBackward(
      const Tensor& logits, const Tensor& targets, const Tensor& max,
      const Tensor& sumexp, const Tensor& dlosses, int64_t n, int64_t v,
      int64_t vocab_offset, int64_t vocab_size, int64_t ignore_index,
      Tensor* dlogits) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(CheckIds(targets, n, vocab_size, true, ignore_index,
                                   "CrossEntropyShardBackward"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropyShardBackward", n * kThreads, kThreads,
                      CrossEntropyShardBackwardKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()),
                      max.data<float>(), sumexp.data<float>(),
                      dlosses.data<float>(), n, v, vocab_offset, ignore_index,
                      static_cast<T*>(dlogits->raw_data()));
      });
    });
  }

 private:
  // out = op(in) elementwise: aligned vectors, then the scalar tail.
  template <typename T, typename Op>
  absl::Status UnaryOp(const char* what, const T* in, T* out, int64_t n,
                       Op op) const {
    int64_t done = 0;
    if (VecAligned(in) && VecAligned(out) && n >= kVec) {
      const int64_t n_vec = n / kVec;
      FSDPP_RETURN_IF_ERROR(Launch(what, n_vec, kThreads, UnaryVecKernel<T, Op>,
                                   reinterpret_cast<const Vec<T>*>(in),
                                   reinterpret_cast<Vec<T>*>(out), n_vec, op));
      done = n_vec * kVec;
    }
    return Launch(what, n - done, kThreads, UnaryKernel<T, Op>, in + done,
                  out + done, n - done, op);
  }

  // out = op(a, b) elementwise, likewise.
  template <typename T, typename Op>
  absl::Status BinaryOp(const char* what, const T* a, const T* b, T* out,
                        int64_t n, Op op) const {
    int64_t done = 0;
    if (VecAligned(a) && VecAligned(b) && VecAligned(out) && n >= kVec) {
      const int64_t n_vec = n / kVec;
      FSDPP_RETURN_IF_ERROR(Launch(what, n_vec, kThreads,
                                   BinaryVecKernel<T, Op>,
                                   reinterpret_cast<const Vec<T>*>(a),
                                   reinterpret_cast<const Vec<T>*>(b),
                                   reinterpret_cast<Vec<T>*>(out), n_vec, op));
      done = n_vec * kVec;
    }
    return Launch(what, n - done, kThreads, BinaryKernel<T, Op>, a + done,
                  b + done, out + done, n - done, op);
  }

  // A device buffer of at least `bytes` that the backend owns (grown, never
  // shrunk: cudaFree waits for the kernels using the old one). The caller
  // holds scratch_mu_ until its kernels are enqueued; later users enqueue
  // after them on the same stream.
  absl::StatusOr<char*> Scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      if (scratch_ != nullptr) {
        FSDPP_CUDA_RETURN_IF_ERROR(cudaFree(scratch_));
        scratch_ = nullptr;
        scratch_bytes_ = 0;
      }
      FSDPP_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, bytes));
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  // out0[j] += sum over rows of term's output 0 at (r, j), out1 likewise
  // with output 1 (may be null): ColumnPartialKernel, ColumnFinishKernel.
  template <int kOutputs, typename Term, typename O>
  absl::Status ColumnSums(const char* what, const Term& term, int64_t rows,
                          int64_t cols, O* out0, O* out1) {
    if (rows <= 0 || cols <= 0) return absl::OkStatus();
    const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
    std::lock_guard<std::mutex> lock(scratch_mu_);
    FSDPP_ASSIGN_OR_RETURN(char* scratch,
                           Scratch(kOutputs * chunks * cols * sizeof(float)));
    float* partial = reinterpret_cast<float*>(scratch);
    const dim3 grid(
        static_cast<unsigned>((cols + kColumnTile - 1) / kColumnTile),
        static_cast<unsigned>(std::min(chunks, kMaxGridY)));
    const dim3 block(kColumnTile, kColumnStripes);
    ColumnPartialKernel<kOutputs, Term><<<grid, block, 0, cudaStreamLegacy>>>(
        term, rows, cols, chunks, partial);
    FSDPP_RETURN_IF_ERROR(CudaStatus(
        cudaGetLastError(), absl::StrCat(what, " stage one launch").c_str()));
    return Launch(what, cols, kThreads, ColumnFinishKernel<kOutputs, O>,
                  static_cast<const float*>(partial), chunks, cols, out0, out1);
  }

  // EmbeddingBackward: the ids sorted stably with their positions (CUB's
  // radix sort over the bits of ids below `vocab`, which CheckIds
  // guaranteed), then a block per run of equal ids.
  template <typename T, typename I>
  absl::Status EmbeddingBackwardSorted(const I* ids, const T* dout, int64_t n,
                                       int64_t v, int64_t c, int64_t row_offset,
                                       int64_t vocab, T* dtable) {
    if (n > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "EmbeddingBackward on CUDA: ", n, " ids, over 2^31 - 1"));
    }
    int end_bit = 1;
    while (end_bit < static_cast<int>(8 * sizeof(I)) &&
           (int64_t{1} << end_bit) < vocab) {
      ++end_bit;
    }
    const int items = static_cast<int>(n);
    size_t temp_bytes = 0;
    FSDPP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, static_cast<const I*>(nullptr),
        static_cast<I*>(nullptr), static_cast<const int32_t*>(nullptr),
        static_cast<int32_t*>(nullptr), items, 0, end_bit, cudaStreamLegacy));
    auto round_up = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    const size_t ids_bytes = round_up(n * sizeof(I));
    const size_t pos_bytes = round_up(n * sizeof(int32_t));
    std::lock_guard<std::mutex> lock(scratch_mu_);
    FSDPP_ASSIGN_OR_RETURN(char* scratch,
                           Scratch(ids_bytes + 2 * pos_bytes + temp_bytes));
    I* sorted = reinterpret_cast<I*>(scratch);
    int32_t* positions_in = reinterpret_cast<int32_t*>(scratch + ids_bytes);
    int32_t* positions =
        reinterpret_cast<int32_t*>(scratch + ids_bytes + pos_bytes);
    void* temp = scratch + ids_bytes + 2 * pos_bytes;
    FSDPP_RETURN_IF_ERROR(Launch("EmbeddingBackward iota", n, kThreads,
                                 IotaKernel, positions_in, n));
    FSDPP_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        temp, temp_bytes, ids, sorted, positions_in, positions, items, 0,
        end_bit, cudaStreamLegacy));
    const dim3 grid(
        static_cast<unsigned>(std::min<int64_t>(n, int64_t{1} << 30)),
        static_cast<unsigned>((c + kEmbeddingColumns - 1) / kEmbeddingColumns));
    EmbeddingBackwardRunsKernel<T, I>
        <<<grid, kEmbeddingColumns, 0, cudaStreamLegacy>>>(
            sorted, positions, dout, n, v, c, row_offset, dtable);
    return CudaStatus(cudaGetLastError(), "EmbeddingBackward kernel launch");
  }

  // Makes this backend's GPU current for the calling thread.
  absl::Status Prepare() const {
    FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return absl::OkStatus();
  }

  // Launches kernel<<<grid, threads>>>(args...) on the legacy default stream
  // over `work` grid-stride items (nothing when work == 0) and reports a
  // launch failure naming `what`.
  template <typename... Params, typename... Args>
  absl::Status Launch(const char* what, int64_t work, int threads,
                      void (*kernel)(Params...), Args&&... args) const {
    if (work <= 0) return absl::OkStatus();
    const int blocks = static_cast<int>(std::min<int64_t>(
        (work + threads - 1) / threads, static_cast<int64_t>(max_blocks_)));
    kernel<<<blocks, threads, 0, cudaStreamLegacy>>>(
        std::forward<Args>(args)...);
    const cudaError_t error = cudaGetLastError();
    if (error == cudaSuccess) return absl::OkStatus();
    return CudaStatus(error, absl::StrCat(what, " kernel launch").c_str());
  }

  // Elementwise dtype conversion of non-overlapping src into dst.
  absl::Status Cast(const Tensor& src, Tensor* dst) const {
    const int64_t n = src.numel();
    return DispatchFloat(src.dtype(), [&](auto tag_S) {
      using S = typename decltype(tag_S)::type;
      return DispatchFloat(dst->dtype(), [&](auto tag_D) {
        using D = typename decltype(tag_D)::type;
        const S* in = static_cast<const S*>(src.raw_data());
        D* out = static_cast<D*>(dst->raw_data());
        int64_t done = 0;
        if (VecAligned(in) && VecAligned(out) && n >= kVec) {
          const int64_t n_vec = n / kVec;
          FSDPP_RETURN_IF_ERROR(Launch("Copy", n_vec, kThreads,
                                       CastVecKernel<S, D>,
                                       reinterpret_cast<const Vec<S>*>(in),
                                       reinterpret_cast<Vec<D>*>(out), n_vec));
          done = n_vec * kVec;
        }
        return Launch("Copy", n - done, kThreads, CastKernel<S, D>, in + done,
                      out + done, n - done);
      });
    });
  }

  // Copies the ids to the host and returns InvalidArgument naming the first
  // one outside [0, v) (ignore_index passes when allow_ignore), in the CPU
  // backend's words; a host sync, skipped for ids already checked on the
  // host.
  static absl::Status CheckIds(const Tensor& ids, int64_t n, int64_t v,
                               bool allow_ignore, int64_t ignore_index,
                               const char* op) {
    if (n == 0) return absl::OkStatus();
    // Checked on the host already (Tensor::MarkIdsCheckedBelow).
    const int64_t checked = ids.ids_checked_below();
    if (checked > 0 && checked <= v) return absl::OkStatus();
    const size_t bytes = n * DTypeSize(ids.dtype());
    std::vector<int64_t> host((bytes + sizeof(int64_t) - 1) / sizeof(int64_t));
    CountHostSync();
    FSDPP_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(host.data(), ids.raw_data(), bytes, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = IdAt(host.data(), ids.dtype(), i);
      if (allow_ignore && id == ignore_index) continue;
      if (id < 0 || id >= v) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": id ", id, " at position ", i, " is outside [0, ", v, ")"));
      }
    }
    return absl::OkStatus();
  }

  const int device_;
  int max_blocks_ = kFallbackSms * kBlocksPerSm;
  std::mutex reduce_mu_;
  double* reduce_scratch_ = nullptr;  // kReduceBlocks doubles; reduce_mu_.
  std::mutex scratch_mu_;
  char* scratch_ = nullptr;  // scratch_bytes_ bytes; scratch_mu_.
  size_t scratch_bytes_ = 0;
};

}  // namespace

Backend* CudaBackend(int device) {
  static auto* mu = new std::mutex;
  static auto* backends =
      new std::unordered_map<int, std::unique_ptr<CudaBackendImpl>>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<CudaBackendImpl>& backend = (*backends)[device];
  if (backend == nullptr) backend = std::make_unique<CudaBackendImpl>(device);
  return backend.get();
}

}  // namespace gpu
}  // namespace fsdpp
