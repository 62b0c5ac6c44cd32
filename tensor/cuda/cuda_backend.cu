// CUDA kernels; see cuda_backend.h.
//
// Every kernel is a grid-stride loop around the functions of
// tensor/kernels/*.h with the CPU backend's decomposition: elementwise ops
// per element, row ops one thread per row, parameter gradients and
// EmbeddingBackward one thread per column walking the rows in order. So each
// output element is computed by the same f32 expression as on the CPU, and no
// result depends on the launch configuration or on atomics. Sum /
// SumOfSquares accumulate in double in two stages whose split depends only on
// the element count, so they are bitwise reproducible. Everything runs on the
// legacy default stream (which orders work from all host threads); ids are
// copied to the host and range-checked before a kernel reads them, trading a
// synchronisation for the CPU backend's exact error messages.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/status.h"
#include "tensor/cuda/cublaslt_matmul.h"
#include "tensor/cuda/cuda_backend.h"
#include "tensor/kernels/attention.h"
#include "tensor/kernels/elementwise.h"
#include "tensor/kernels/rope.h"
#include "tensor/kernels/rowwise.h"

namespace fsdpp {
namespace gpu {
namespace {

// Threads per block of the elementwise, column and reduction kernels.
constexpr int kThreads = 256;
// Threads per block of the one-thread-per-row kernels: rows are few and heavy,
// so small blocks spread them over more SMs.
constexpr int kRowThreads = 64;
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

// One thread per column: out[j] += sum over rows of x[r, j], rows in order.
template <typename T, typename O>
__global__ void SumRowsKernel(const T* x, int64_t rows, int64_t cols, O* out) {
  for (int64_t j = FirstIndex(); j < cols; j += GridStride()) {
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) acc += ToFloat(x[r * cols + j]);
    out[j] = FromFloat<O>(ToFloat(out[j]) + acc);
  }
}

// ---------------------------------------------------------------- row ops

template <typename T>
__global__ void SoftmaxKernel(const T* x, int64_t rows, int64_t n, int64_t tq,
                              int64_t causal_offset, T* y) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    const int64_t valid = causal_offset < 0 || r % tq + causal_offset + 1 > n
                              ? n
                              : r % tq + causal_offset + 1;
    kernels::SoftmaxRowForward(x + r * n, n, valid, y + r * n);
  }
}

template <typename T>
__global__ void SoftmaxBackwardKernel(const T* y, const T* dy, int64_t rows,
                                      int64_t n, T* dx) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::SoftmaxRowBackward(y + r * n, dy + r * n, n, dx + r * n);
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

// Head layouts (see Backend::CopyHeads): one thread per element of the
// narrow [b, n, t, hd] tensor, E a type of the element's size.
template <typename E>
__global__ void CopyHeadsKernel(const E* src, E* dst, int64_t b, int64_t t,
                                int64_t heads, int64_t first, int64_t n,
                                int64_t hd, bool merge) {
  const int64_t total = b * n * t * hd;
  for (int64_t e = FirstIndex(); e < total; e += GridStride()) {
    const int64_t j = e % hd, i = (e / hd) % t, h = (e / (hd * t)) % n,
                  bi = e / (hd * t * n);
    const int64_t wide = ((bi * t + i) * heads + first + h) * hd + j;
    if (merge) {
      dst[wide] = src[e];
    } else {
      dst[e] = src[wide];
    }
  }
}

// Rotary embedding: one thread per row, in place; the frequencies travel in
// the kernel's parameters (head_dim <= 2 * kMaxRopeFrequencies).
constexpr int64_t kMaxRopeFrequencies = 256;
struct RopeFrequencies {
  float inv_freq[kMaxRopeFrequencies];
};

template <typename T>
__global__ void RopeKernel(T* x, int64_t rows, int64_t seq_len,
                           int64_t head_dim, RopeFrequencies f, bool inverse) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    T* row = x + r * head_dim;
    if (inverse) {
      kernels::RopeRowBackward(row, r % seq_len, f.inv_freq, head_dim, row);
    } else {
      kernels::RopeRowForward(row, r % seq_len, f.inv_freq, head_dim, row);
    }
  }
}

// Fused causal attention (tensor/kernels/attention.h): one thread per query
// row (forward, dq) or per key row (dk, dv), f32 accumulators of at most
// kMaxAttentionHeadDim floats in local memory.
constexpr int64_t kMaxAttentionHeadDim = 256;

template <typename T>
__global__ void CausalAttentionKernel(const T* q, const T* k, const T* v,
                                      int64_t b, int64_t h, int64_t kv,
                                      int64_t t, int64_t hd, float scale,
                                      T* out, float* lse) {
  for (int64_t r = FirstIndex(); r < b * h * t; r += GridStride()) {
    const int64_t head = r / t, i = r % t;
    const int64_t kv_head = (head / h) * kv + (head % h) / (h / kv);
    float acc[kMaxAttentionHeadDim];
    kernels::CausalAttentionRow(q + r * hd, k + kv_head * t * hd,
                                v + kv_head * t * hd, i + 1, hd, scale, acc,
                                out + r * hd, lse + r);
  }
}

template <typename T>
__global__ void CausalAttentionDqKernel(const T* q, const T* k, const T* v,
                                        const T* out, const float* lse,
                                        const T* dout, int64_t b, int64_t h,
                                        int64_t kv, int64_t t, int64_t hd,
                                        float scale, T* dq) {
  for (int64_t r = FirstIndex(); r < b * h * t; r += GridStride()) {
    const int64_t head = r / t, i = r % t;
    const int64_t kv_head = (head / h) * kv + (head % h) / (h / kv);
    float acc[kMaxAttentionHeadDim];
    const float delta = kernels::DotF32(dout + r * hd, out + r * hd, hd);
    kernels::CausalAttentionDqRow(q + r * hd, k + kv_head * t * hd,
                                  v + kv_head * t * hd, dout + r * hd, delta,
                                  lse[r], i + 1, hd, scale, acc, dq + r * hd);
  }
}

template <typename T>
__global__ void CausalAttentionDkDvKernel(const T* q, const T* k, const T* v,
                                          const T* out, const float* lse,
                                          const T* dout, int64_t b, int64_t h,
                                          int64_t kv, int64_t t, int64_t hd,
                                          float scale, T* dk, T* dv) {
  const int64_t rep = h / kv;
  for (int64_t r = FirstIndex(); r < b * kv * t; r += GridStride()) {
    const int64_t kv_head = r / t, j = r % t;
    const int64_t first = (kv_head / kv) * h + (kv_head % kv) * rep;
    float dk_acc[kMaxAttentionHeadDim], dv_acc[kMaxAttentionHeadDim];
    for (int64_t e = 0; e < hd; ++e) dk_acc[e] = dv_acc[e] = 0.0f;
    for (int64_t head = first; head < first + rep; ++head) {
      for (int64_t i = j; i < t; ++i) {
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

template <typename T>
__global__ void LayerNormKernel(const T* x, const T* weight, const T* bias,
                                float eps, int64_t rows, int64_t c, T* out,
                                float* mean, float* rstd) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::LayerNormRowForward(x + r * c, weight, bias, c, eps, out + r * c,
                                 mean + r, rstd + r);
  }
}

template <typename T>
__global__ void LayerNormBackwardRowsKernel(const T* dy, const T* x,
                                            const T* weight, const float* mean,
                                            const float* rstd, int64_t rows,
                                            int64_t c, T* dx) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::LayerNormRowBackward(dy + r * c, x + r * c, weight, mean[r],
                                  rstd[r], c, dx + r * c);
  }
}

template <typename T>
__global__ void LayerNormBackwardColumnsKernel(const T* dy, const T* x,
                                               const float* mean,
                                               const float* rstd, int64_t rows,
                                               int64_t c, T* dweight,
                                               T* dbias) {
  for (int64_t j = FirstIndex(); j < c; j += GridStride()) {
    kernels::LayerNormColumnBackward(dy, x, mean, rstd, rows, c, j, dweight,
                                     dbias);
  }
}

template <typename T>
__global__ void RmsNormKernel(const T* x, const T* weight, float eps,
                              int64_t rows, int64_t c, T* out, float* rstd) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::RmsNormRowForward(x + r * c, weight, c, eps, out + r * c,
                               rstd + r);
  }
}

template <typename T>
__global__ void RmsNormBackwardRowsKernel(const T* dy, const T* x,
                                          const T* weight, const float* rstd,
                                          int64_t rows, int64_t c, T* dx) {
  for (int64_t r = FirstIndex(); r < rows; r += GridStride()) {
    kernels::RmsNormRowBackward(dy + r * c, x + r * c, weight, rstd[r], c,
                                dx + r * c);
  }
}

template <typename T>
__global__ void RmsNormBackwardColumnsKernel(const T* dy, const T* x,
                                             const float* rstd, int64_t rows,
                                             int64_t c, T* dweight) {
  for (int64_t j = FirstIndex(); j < c; j += GridStride()) {
    kernels::RmsNormColumnBackward(dy, x, rstd, rows, c, j, dweight);
  }
}

template <typename T, typename I>
__global__ void CrossEntropyKernel(const T* logits, const I* targets, int64_t n,
                                   int64_t v, int64_t ignore_index,
                                   float* losses) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    losses[i] = kernels::CrossEntropyRowForward(
        logits + i * v, v, static_cast<int64_t>(targets[i]), ignore_index);
  }
}

template <typename T, typename I>
__global__ void CrossEntropyBackwardKernel(const T* logits, const I* targets,
                                           const float* dlosses, int64_t n,
                                           int64_t v, int64_t ignore_index,
                                           T* dlogits) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    kernels::CrossEntropyRowBackward(logits + i * v, v,
                                     static_cast<int64_t>(targets[i]),
                                     ignore_index, dlosses[i], dlogits + i * v);
  }
}

// Loss parallel: one thread per row of this rank's vocabulary slice.
template <typename T, typename I>
__global__ void CrossEntropyShardStatsKernel(
    const T* logits, const I* targets, int64_t n, int64_t v, int64_t offset,
    int64_t ignore_index, float* max, float* sumexp, float* target_logit) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t == ignore_index) {
      max[i] = sumexp[i] = target_logit[i] = 0.0f;
      continue;
    }
    kernels::CrossEntropyShardRowStats(
        logits + i * v, v, kernels::LocalTarget(t, ignore_index, offset, v),
        max + i, sumexp + i, target_logit + i);
  }
}

template <typename T, typename I>
__global__ void CrossEntropyShardBackwardKernel(
    const T* logits, const I* targets, const float* max, const float* sumexp,
    const float* dlosses, int64_t n, int64_t v, int64_t offset,
    int64_t ignore_index, T* dlogits) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const int64_t t = static_cast<int64_t>(targets[i]);
    if (t == ignore_index) {
      for (int64_t j = 0; j < v; ++j) dlogits[i * v + j] = FromFloat<T>(0.0f);
      continue;
    }
    kernels::CrossEntropyShardRowBackward(
        logits + i * v, v, kernels::LocalTarget(t, ignore_index, offset, v),
        max[i], sumexp[i], dlosses[i], dlogits + i * v);
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

// One thread per column j: dtable[ids[i], j] += dout[i, j] for i in order, so
// repeated ids add up without atomics, deterministically.
template <typename T, typename I>
__global__ void EmbeddingBackwardKernel(const I* ids, const T* dout, int64_t n,
                                        int64_t v, int64_t c,
                                        int64_t row_offset, T* dtable) {
  for (int64_t j = FirstIndex(); j < c; j += GridStride()) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = static_cast<int64_t>(ids[i]) - row_offset;
      if (row < 0 || row >= v) continue;  // Another rank's row.
      T* slot = dtable + row * c + j;
      *slot = FromFloat<T>(ToFloat(*slot) + ToFloat(dout[i * c + j]));
    }
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
          return Launch("Scale", n, kThreads, UnaryKernel<T, kernels::ScaleOp>,
                        in, o, n, kernels::ScaleOp{alpha});
        case UnaryKind::kGelu:
          return Launch("Gelu", n, kThreads, UnaryKernel<T, kernels::GeluOp>,
                        in, o, n, kernels::GeluOp{});
        case UnaryKind::kSilu:
          return Launch("Silu", n, kThreads, UnaryKernel<T, kernels::SiluOp>,
                        in, o, n, kernels::SiluOp{});
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
          return Launch("Add", n, kThreads, BinaryKernel<T, kernels::AddOp>, pa,
                        pb, o, n, kernels::AddOp{});
        case BinaryKind::kMul:
          return Launch("Mul", n, kThreads, BinaryKernel<T, kernels::MulOp>, pa,
                        pb, o, n, kernels::MulOp{});
        case BinaryKind::kAxpy:
          return Launch("Axpy", n, kThreads, BinaryKernel<T, kernels::AxpyOp>,
                        pa, pb, o, n, kernels::AxpyOp{alpha});
        case BinaryKind::kGeluBackward:
          return Launch("GeluBackward", n, kThreads,
                        BinaryKernel<T, kernels::GeluBackwardOp>, pa, pb, o, n,
                        kernels::GeluBackwardOp{});
        case BinaryKind::kSiluBackward:
          return Launch("SiluBackward", n, kThreads,
                        BinaryKernel<T, kernels::SiluBackwardOp>, pa, pb, o, n,
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
        return Launch("SumRowsAccumulate", cols, kThreads, SumRowsKernel<T, O>,
                      static_cast<const T*>(x.raw_data()), rows, cols,
                      static_cast<O*>(out->raw_data()));
      });
    });
  }

  absl::Status Matmul(const MatmulArgs& m) override {
    float beta = m.beta;
    if (m.bias != nullptr) {
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
                          m.broadcast_b, m.alpha, beta);
  }

  absl::Status Softmax(const Tensor& x, int64_t rows, int64_t n, int64_t tq,
                       int64_t causal_offset, Tensor* y) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("Softmax", rows, kRowThreads, SoftmaxKernel<T>,
                    static_cast<const T*>(x.raw_data()), rows, n, tq,
                    causal_offset, static_cast<T*>(y->raw_data()));
    });
  }

  absl::Status CopyHeads(const Tensor& src, Tensor* dst, int64_t b, int64_t t,
                         int64_t heads, int64_t first, int64_t n, int64_t hd,
                         bool merge) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    const int64_t total = b * n * t * hd;
    auto launch = [&](auto tag) {
      using E = decltype(tag);
      return Launch("CopyHeads", total, kThreads, CopyHeadsKernel<E>,
                    static_cast<const E*>(src.raw_data()),
                    static_cast<E*>(dst->raw_data()), b, t, heads, first, n, hd,
                    merge);
    };
    switch (DTypeSize(src.dtype())) {
      case 1:
        return launch(uint8_t());
      case 2:
        return launch(uint16_t());
      case 4:
        return launch(uint32_t());
      default:
        return launch(uint64_t());
    }
  }

  absl::Status Rope(Tensor* x, int64_t rows, int64_t seq_len, int64_t head_dim,
                    const float* inv_freq, bool inverse) override {
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
      return Launch("Rope", rows, kRowThreads, RopeKernel<T>,
                    static_cast<T*>(x->raw_data()), rows, seq_len, head_dim, f,
                    inverse);
    });
  }

  absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, int64_t rows,
                               int64_t n, Tensor* dx) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(y.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("SoftmaxBackward", rows, kRowThreads,
                    SoftmaxBackwardKernel<T>,
                    static_cast<const T*>(y.raw_data()),
                    static_cast<const T*>(dy.raw_data()), rows, n,
                    static_cast<T*>(dx->raw_data()));
    });
  }

  absl::Status CausalAttention(const Tensor& q, const Tensor& k,
                               const Tensor& v, int64_t b, int64_t h,
                               int64_t kv, int64_t t, int64_t hd, float scale,
                               Tensor* out, Tensor* lse) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(CheckAttentionHeadDim(hd));
    return DispatchFloat(q.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("CausalAttention", b * h * t, kRowThreads,
                    CausalAttentionKernel<T>,
                    static_cast<const T*>(q.raw_data()),
                    static_cast<const T*>(k.raw_data()),
                    static_cast<const T*>(v.raw_data()), b, h, kv, t, hd, scale,
                    static_cast<T*>(out->raw_data()), lse->data<float>());
    });
  }

  absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& dout,
                                       int64_t b, int64_t h, int64_t kv,
                                       int64_t t, int64_t hd, float scale,
                                       Tensor* dq, Tensor* dk,
                                       Tensor* dv) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(CheckAttentionHeadDim(hd));
    return DispatchFloat(q.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pq = static_cast<const T*>(q.raw_data());
      const T* pk = static_cast<const T*>(k.raw_data());
      const T* pv = static_cast<const T*>(v.raw_data());
      const T* po = static_cast<const T*>(out.raw_data());
      const T* pdo = static_cast<const T*>(dout.raw_data());
      FSDPP_RETURN_IF_ERROR(
          Launch("CausalAttentionBackward dq", b * h * t, kRowThreads,
                 CausalAttentionDqKernel<T>, pq, pk, pv, po, lse.data<float>(),
                 pdo, b, h, kv, t, hd, scale, static_cast<T*>(dq->raw_data())));
      return Launch("CausalAttentionBackward dk dv", b * kv * t, kRowThreads,
                    CausalAttentionDkDvKernel<T>, pq, pk, pv, po,
                    lse.data<float>(), pdo, b, h, kv, t, hd, scale,
                    static_cast<T*>(dk->raw_data()),
                    static_cast<T*>(dv->raw_data()));
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
      return Launch("LayerNorm", rows, kRowThreads, LayerNormKernel<T>,
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
      FSDPP_RETURN_IF_ERROR(Launch("LayerNormBackward rows", rows, kRowThreads,
                                   LayerNormBackwardRowsKernel<T>, pdy, px,
                                   static_cast<const T*>(weight.raw_data()), pm,
                                   pr, rows, c,
                                   static_cast<T*>(dx->raw_data())));
      return Launch("LayerNormBackward columns", c, kThreads,
                    LayerNormBackwardColumnsKernel<T>, pdy, px, pm, pr, rows, c,
                    static_cast<T*>(dweight->raw_data()), pdb);
    });
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                       int64_t rows, int64_t c, Tensor* out,
                       Tensor* rstd) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    return DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return Launch("RmsNorm", rows, kRowThreads, RmsNormKernel<T>,
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
      FSDPP_RETURN_IF_ERROR(Launch("RmsNormBackward rows", rows, kRowThreads,
                                   RmsNormBackwardRowsKernel<T>, pdy, px,
                                   static_cast<const T*>(weight.raw_data()), pr,
                                   rows, c, static_cast<T*>(dx->raw_data())));
      return Launch("RmsNormBackward columns", c, kThreads,
                    RmsNormBackwardColumnsKernel<T>, pdy, px, pr, rows, c,
                    static_cast<T*>(dweight->raw_data()));
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
        return Launch("EmbeddingBackward", c, kThreads,
                      EmbeddingBackwardKernel<T, I>,
                      static_cast<const I*>(ids.raw_data()),
                      static_cast<const T*>(dout.raw_data()), n, v, c,
                      row_offset, static_cast<T*>(dtable->raw_data()));
      });
    });
  }

  absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                            int64_t n, int64_t v, int64_t ignore_index,
                            Tensor* losses) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropy"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropy", n, kRowThreads, CrossEntropyKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()), n, v,
                      ignore_index, losses->data<float>());
      });
    });
  }

  absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                    const Tensor& dlosses, int64_t n, int64_t v,
                                    int64_t ignore_index,
                                    Tensor* dlogits) override {
    FSDPP_RETURN_IF_ERROR(Prepare());
    FSDPP_RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropyBackward"));
    return DispatchFloat(logits.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      return DispatchId(targets.dtype(), [&](auto tag_I) {
        using I = typename decltype(tag_I)::type;
        return Launch("CrossEntropyBackward", n, kRowThreads,
                      CrossEntropyBackwardKernel<T, I>,
                      static_cast<const T*>(logits.raw_data()),
                      static_cast<const I*>(targets.raw_data()),
                      dlosses.data<float>(), n, v, ignore_index,
                      static_cast<T*>(dlogits->raw_data()));
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
        return Launch("CrossEntropyShardStats", n, kRowThreads,
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
        return Launch("CrossEntropyShardBackward", n, kRowThreads,
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
        return Launch("Copy", n, kThreads, CastKernel<S, D>,
                      static_cast<const S*>(src.raw_data()),
                      static_cast<D*>(dst->raw_data()), n);
      });
    });
  }

  // Copies the ids to the host and returns InvalidArgument naming the first
  // one outside [0, v) (ignore_index passes when allow_ignore), in the CPU
  // backend's words.
  static absl::Status CheckIds(const Tensor& ids, int64_t n, int64_t v,
                               bool allow_ignore, int64_t ignore_index,
                               const char* op) {
    if (n == 0) return absl::OkStatus();
    const size_t bytes = n * DTypeSize(ids.dtype());
    std::vector<int64_t> host((bytes + sizeof(int64_t) - 1) / sizeof(int64_t));
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
