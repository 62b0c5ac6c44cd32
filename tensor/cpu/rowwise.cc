// Highway row-wise kernels behind rowwise.h, compiled once per target by
// hwy/foreach_target.h (this file includes itself through it) and chosen at
// run time by HWY_DYNAMIC_DISPATCH. Built with -ffp-contract=off (BUILD) so
// the column sums stay bit-exact with the scalar reference.
#include "tensor/cpu/rowwise.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "tensor/kernels/elementwise.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tensor/cpu/rowwise.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "tensor/cpu/convert-inl.h"
#include "tensor/cpu/math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace cpu {
namespace rowwise_internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using simd_convert::HWY_NAMESPACE::DF;
using simd_convert::HWY_NAMESPACE::LoadF;
using simd_convert::HWY_NAMESPACE::StoreF;
using VF = hn::Vec<DF>;
using simd_math::HWY_NAMESPACE::Exp;

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>()) for the storage type of a float dtype.
template <class Fn>
HWY_INLINE void ByDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      fn(Tag<float>());
      return;
    case DType::kBF16:
      fn(Tag<BFloat16>());
      return;
    case DType::kF16:
      fn(Tag<Float16>());
      return;
    default:
      return;  // Not a float dtype: the backend rejected it before.
  }
}

HWY_INLINE float SumLanes(DF d, VF v) {
  return hn::GetLane(hn::SumOfLanes(d, v));
}

// max_j x[j] over n >= 1 elements.
template <typename T>
HWY_INLINE float RowMax(const T* x, size_t n) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  float m = ToFloat(x[0]);
  size_t i = 0;
  if (n >= lanes) {
    VF vm = LoadF(d, x);
    for (i = lanes; i + lanes <= n; i += lanes) {
      vm = hn::Max(vm, LoadF(d, x + i));
    }
    m = hn::GetLane(hn::MaxOfLanes(d, vm));
  }
  for (; i < n; ++i) m = fmaxf(m, ToFloat(x[i]));
  return m;
}

// sum_j exp(x[j] - max) over n elements.
template <typename T>
HWY_INLINE float RowSumExp(const T* x, size_t n, float max) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const VF vmax = hn::Set(d, max);
  VF a0 = hn::Zero(d), a1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    a0 = hn::Add(a0, Exp(d, hn::Sub(LoadF(d, x + i), vmax)));
    a1 = hn::Add(a1, Exp(d, hn::Sub(LoadF(d, x + i + lanes), vmax)));
  }
  for (; i + lanes <= n; i += lanes) {
    a0 = hn::Add(a0, Exp(d, hn::Sub(LoadF(d, x + i), vmax)));
  }
  float s = SumLanes(d, hn::Add(a0, a1));
  for (; i < n; ++i) s += kernels::ExpApprox(ToFloat(x[i]) - max);
  return s;
}

// ---------------------------------------------------------------- softmax

template <typename T>
void SoftmaxRowForward(const T* x, size_t n, size_t valid, T* y) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const float max = RowMax(x, valid);
  const float inv = 1.0f / RowSumExp(x, valid, max);
  const VF vmax = hn::Set(d, max), vinv = hn::Set(d, inv);
  size_t j = 0;
  for (; j + lanes <= valid; j += lanes) {
    StoreF(d, hn::Mul(Exp(d, hn::Sub(LoadF(d, x + j), vmax)), vinv), y + j);
  }
  for (; j < valid; ++j) {
    y[j] = FromFloat<T>(kernels::ExpApprox(ToFloat(x[j]) - max) * inv);
  }
  // +0 is all-zero bits in every float dtype.
  if (n > valid)
    std::memset(static_cast<void*>(y + valid), 0, (n - valid) * sizeof(T));
}

template <typename T>
void SoftmaxRowBackward(const T* y, const T* dy, size_t n, T* dx) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  VF acc = hn::Zero(d);
  size_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    acc = hn::MulAdd(LoadF(d, y + j), LoadF(d, dy + j), acc);
  }
  float dot = SumLanes(d, acc);
  for (; j < n; ++j) dot += ToFloat(y[j]) * ToFloat(dy[j]);
  const VF vdot = hn::Set(d, dot);
  j = 0;
  for (; j + lanes <= n; j += lanes) {
    StoreF(d, hn::Mul(LoadF(d, y + j), hn::Sub(LoadF(d, dy + j), vdot)),
           dx + j);
  }
  for (; j < n; ++j) {
    dx[j] = FromFloat<T>(ToFloat(y[j]) * (ToFloat(dy[j]) - dot));
  }
}

void SoftmaxForwardAll(DType dtype, const void* x_raw, int64_t rows, int64_t n,
                       int64_t tq, int64_t causal_offset, void* y_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(x_raw);
    T* y = static_cast<T*>(y_raw);
#pragma omp parallel for schedule(static) if (rows * n > kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t valid =
          causal_offset < 0 ? n : std::min(n, r % tq + causal_offset + 1);
      SoftmaxRowForward(x + r * n, n, valid, y + r * n);
    }
  });
}

void SoftmaxBackwardAll(DType dtype, const void* y_raw, const void* dy_raw,
                        int64_t rows, int64_t n, void* dx_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* y = static_cast<const T*>(y_raw);
    const T* dy = static_cast<const T*>(dy_raw);
    T* dx = static_cast<T*>(dx_raw);
#pragma omp parallel for schedule(static) if (rows * n > kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      SoftmaxRowBackward(y + r * n, dy + r * n, n, dx + r * n);
    }
  });
}

// ----------------------------------------------------------- column sums

// Columns [begin, end): out[j] += sum over r of term(r, j), rows in order,
// `term` as a vector over lanes columns (vterm) and for one column (sterm).
template <typename O, class VTerm, class STerm>
HWY_INLINE void ColumnSums(int64_t rows, int64_t begin, int64_t end, O* out,
                           VTerm vterm, STerm sterm) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t j = begin;
  for (; j + lanes <= end; j += lanes) {
    VF acc = hn::Zero(d);
    for (int64_t r = 0; r < rows; ++r) acc = hn::Add(acc, vterm(d, r, j));
    StoreF(d, hn::Add(LoadF(d, out + j), acc), out + j);
  }
  for (; j < end; ++j) {
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) acc += sterm(r, j);
    out[j] = FromFloat<O>(ToFloat(out[j]) + acc);
  }
}

// out[j] += sum over r of x[r * cols + j], columns [begin, end).
template <typename T, typename O>
HWY_INLINE void PlainColumnSums(const T* x, int64_t rows, int64_t cols,
                                int64_t begin, int64_t end, O* out) {
  ColumnSums(
      rows, begin, end, out,
      [&](DF d, int64_t r, int64_t j) { return LoadF(d, x + r * cols + j); },
      [&](int64_t r, int64_t j) { return ToFloat(x[r * cols + j]); });
}

void SumRowsAccumulateAll(DType x_dtype, const void* x_raw, int64_t rows,
                          int64_t cols, DType out_dtype, void* out_raw) {
  ByDType(x_dtype, [&](auto tag_x) {
    using T = typename decltype(tag_x)::type;
    const T* x = static_cast<const T*>(x_raw);
    ByDType(out_dtype, [&](auto tag_o) {
      using O = typename decltype(tag_o)::type;
      O* out = static_cast<O*>(out_raw);
      ParallelChunks(cols, rows * cols, [&](int64_t begin, int64_t end) {
        PlainColumnSums(x, rows, cols, begin, end, out);
      });
    });
  });
}

// -------------------------------------------------------------- LayerNorm

template <typename T>
void LayerNormRowForward(const T* x, const T* w, const T* b, size_t c,
                         float eps, T* out, float* mean_out, float* rstd_out) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  VF acc = hn::Zero(d);
  size_t j = 0;
  for (; j + lanes <= c; j += lanes) acc = hn::Add(acc, LoadF(d, x + j));
  float sum = SumLanes(d, acc);
  for (; j < c; ++j) sum += ToFloat(x[j]);
  const float mean = sum / static_cast<float>(c);
  const VF vmean = hn::Set(d, mean);
  acc = hn::Zero(d);
  for (j = 0; j + lanes <= c; j += lanes) {
    const VF dv = hn::Sub(LoadF(d, x + j), vmean);
    acc = hn::MulAdd(dv, dv, acc);
  }
  float var = SumLanes(d, acc);
  for (; j < c; ++j) {
    const float dv = ToFloat(x[j]) - mean;
    var += dv * dv;
  }
  var /= static_cast<float>(c);
  const float rstd = 1.0f / sqrtf(var + eps);
  const VF vrstd = hn::Set(d, rstd);
  for (j = 0; j + lanes <= c; j += lanes) {
    VF v = hn::Mul(hn::Mul(hn::Sub(LoadF(d, x + j), vmean), vrstd),
                   LoadF(d, w + j));
    if (b != nullptr) v = hn::Add(v, LoadF(d, b + j));
    StoreF(d, v, out + j);
  }
  for (; j < c; ++j) {
    float v = (ToFloat(x[j]) - mean) * rstd * ToFloat(w[j]);
    if (b != nullptr) v += ToFloat(b[j]);
    out[j] = FromFloat<T>(v);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

template <typename T>
void LayerNormRowBackward(const T* dy, const T* x, const T* w, float mean,
                          float rstd, size_t c, T* dx) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const VF vmean = hn::Set(d, mean), vrstd = hn::Set(d, rstd);
  VF ag = hn::Zero(d), agx = hn::Zero(d);
  size_t j = 0;
  for (; j + lanes <= c; j += lanes) {
    const VF g = hn::Mul(LoadF(d, dy + j), LoadF(d, w + j));
    const VF xhat = hn::Mul(hn::Sub(LoadF(d, x + j), vmean), vrstd);
    ag = hn::Add(ag, g);
    agx = hn::MulAdd(g, xhat, agx);
  }
  float mean_g = SumLanes(d, ag), mean_gx = SumLanes(d, agx);
  for (; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(w[j]);
    mean_g += g;
    mean_gx += g * ((ToFloat(x[j]) - mean) * rstd);
  }
  mean_g /= static_cast<float>(c);
  mean_gx /= static_cast<float>(c);
  const VF vmg = hn::Set(d, mean_g), vmgx = hn::Set(d, mean_gx);
  for (j = 0; j + lanes <= c; j += lanes) {
    const VF g = hn::Mul(LoadF(d, dy + j), LoadF(d, w + j));
    const VF xhat = hn::Mul(hn::Sub(LoadF(d, x + j), vmean), vrstd);
    StoreF(d, hn::Mul(vrstd, hn::Sub(hn::Sub(g, vmg), hn::Mul(xhat, vmgx))),
           dx + j);
  }
  for (; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(w[j]);
    const float xhat = (ToFloat(x[j]) - mean) * rstd;
    dx[j] = FromFloat<T>(rstd * (g - mean_g - xhat * mean_gx));
  }
}

void LayerNormForwardAll(DType dtype, const void* x_raw, const void* w_raw,
                         const void* b_raw, float eps, int64_t rows, int64_t c,
                         void* out_raw, float* mean, float* rstd) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(x_raw);
    const T* w = static_cast<const T*>(w_raw);
    const T* b = static_cast<const T*>(b_raw);
    T* out = static_cast<T*>(out_raw);
#pragma omp parallel for schedule(static) if (rows * c > kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      LayerNormRowForward(x + r * c, w, b, c, eps, out + r * c, mean + r,
                          rstd + r);
    }
  });
}

void LayerNormBackwardAll(DType dtype, const void* dy_raw, const void* x_raw,
                          const void* w_raw, const float* mean,
                          const float* rstd, int64_t rows, int64_t c,
                          void* dx_raw, void* dw_raw, void* db_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy = static_cast<const T*>(dy_raw);
    const T* x = static_cast<const T*>(x_raw);
    const T* w = static_cast<const T*>(w_raw);
    T* dx = static_cast<T*>(dx_raw);
    T* dw = static_cast<T*>(dw_raw);
    T* db = static_cast<T*>(db_raw);
#pragma omp parallel if (rows * c > kParallelElements)
    {
#pragma omp for schedule(static) nowait
      for (int64_t r = 0; r < rows; ++r) {
        LayerNormRowBackward(dy + r * c, x + r * c, w, mean[r], rstd[r], c,
                             dx + r * c);
      }
      int64_t begin, end;
      ThreadChunk(c, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
      // kernels::LayerNormColumnBackward's terms: dy * (x - mean) * rstd.
      ColumnSums(
          rows, begin, end, dw,
          [&](DF d, int64_t r, int64_t j) {
            return hn::Mul(
                hn::Mul(LoadF(d, dy + r * c + j),
                        hn::Sub(LoadF(d, x + r * c + j), hn::Set(d, mean[r]))),
                hn::Set(d, rstd[r]));
          },
          [&](int64_t r, int64_t j) {
            return ToFloat(dy[r * c + j]) * (ToFloat(x[r * c + j]) - mean[r]) *
                   rstd[r];
          });
      if (db != nullptr) {
        PlainColumnSums(dy, rows, c, begin, end, db);
      }
    }
  });
}

// ---------------------------------------------------------------- RMSNorm

template <typename T>
void RmsNormRowForward(const T* x, const T* w, size_t c, float eps, T* out,
                       float* rstd_out) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  VF acc = hn::Zero(d);
  size_t j = 0;
  for (; j + lanes <= c; j += lanes) {
    const VF v = LoadF(d, x + j);
    acc = hn::MulAdd(v, v, acc);
  }
  float ss = SumLanes(d, acc);
  for (; j < c; ++j) ss += ToFloat(x[j]) * ToFloat(x[j]);
  const float rstd = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  const VF vrstd = hn::Set(d, rstd);
  for (j = 0; j + lanes <= c; j += lanes) {
    StoreF(d, hn::Mul(hn::Mul(LoadF(d, x + j), vrstd), LoadF(d, w + j)),
           out + j);
  }
  for (; j < c; ++j) {
    out[j] = FromFloat<T>(ToFloat(x[j]) * rstd * ToFloat(w[j]));
  }
  *rstd_out = rstd;
}

template <typename T>
void RmsNormRowBackward(const T* dy, const T* x, const T* w, float rstd,
                        size_t c, T* dx) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const VF vrstd = hn::Set(d, rstd);
  VF acc = hn::Zero(d);
  size_t j = 0;
  for (; j + lanes <= c; j += lanes) {
    const VF g = hn::Mul(LoadF(d, dy + j), LoadF(d, w + j));
    acc = hn::MulAdd(g, LoadF(d, x + j), acc);
  }
  float gx = SumLanes(d, acc);
  for (; j < c; ++j) gx += ToFloat(dy[j]) * ToFloat(w[j]) * ToFloat(x[j]);
  const float mean_gx = gx * rstd / static_cast<float>(c);
  const VF vmgx = hn::Set(d, mean_gx);
  for (j = 0; j + lanes <= c; j += lanes) {
    const VF g = hn::Mul(LoadF(d, dy + j), LoadF(d, w + j));
    const VF xhat = hn::Mul(LoadF(d, x + j), vrstd);
    StoreF(d, hn::Mul(vrstd, hn::Sub(g, hn::Mul(xhat, vmgx))), dx + j);
  }
  for (; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(w[j]);
    const float xhat = ToFloat(x[j]) * rstd;
    dx[j] = FromFloat<T>(rstd * (g - xhat * mean_gx));
  }
}

void RmsNormForwardAll(DType dtype, const void* x_raw, const void* w_raw,
                       float eps, int64_t rows, int64_t c, void* out_raw,
                       float* rstd) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(x_raw);
    const T* w = static_cast<const T*>(w_raw);
    T* out = static_cast<T*>(out_raw);
#pragma omp parallel for schedule(static) if (rows * c > kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      RmsNormRowForward(x + r * c, w, c, eps, out + r * c, rstd + r);
    }
  });
}

void RmsNormBackwardAll(DType dtype, const void* dy_raw, const void* x_raw,
                        const void* w_raw, const float* rstd, int64_t rows,
                        int64_t c, void* dx_raw, void* dw_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy = static_cast<const T*>(dy_raw);
    const T* x = static_cast<const T*>(x_raw);
    const T* w = static_cast<const T*>(w_raw);
    T* dx = static_cast<T*>(dx_raw);
    T* dw = static_cast<T*>(dw_raw);
#pragma omp parallel if (rows * c > kParallelElements)
    {
#pragma omp for schedule(static) nowait
      for (int64_t r = 0; r < rows; ++r) {
        RmsNormRowBackward(dy + r * c, x + r * c, w, rstd[r], c, dx + r * c);
      }
      int64_t begin, end;
      ThreadChunk(c, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
      // kernels::RmsNormColumnBackward's terms: dy * x * rstd.
      ColumnSums(
          rows, begin, end, dw,
          [&](DF d, int64_t r, int64_t j) {
            return hn::Mul(
                hn::Mul(LoadF(d, dy + r * c + j), LoadF(d, x + r * c + j)),
                hn::Set(d, rstd[r]));
          },
          [&](int64_t r, int64_t j) {
            return ToFloat(dy[r * c + j]) * ToFloat(x[r * c + j]) * rstd[r];
          });
    }
  });
}

// ---------------------------------------------------------- cross-entropy

void CrossEntropyForwardAll(DType dtype, const void* logits_raw,
                            const int64_t* targets, int64_t n, int64_t v,
                            int64_t ignore_index, float* losses, float* lse) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* logits = static_cast<const T*>(logits_raw);
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] == ignore_index) {
        losses[i] = 0.0f;
        if (lse != nullptr) lse[i] = 0.0f;
        continue;
      }
      const T* row = logits + i * v;
      const float max = RowMax(row, v);
      const float row_lse = logf(RowSumExp(row, v, max)) + max;
      losses[i] = row_lse - ToFloat(row[targets[i]]);
      if (lse != nullptr) lse[i] = row_lse;
    }
  });
}

// out = dloss * (exp(x - max) * inv - onehot(target)) over a row of v (no
// one-hot term when target < 0).
template <typename T>
HWY_INLINE void SoftmaxGradRow(const T* row, int64_t v, float max, float inv,
                               float dloss, int64_t target, T* out) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF vmax = hn::Set(d, max);
  const VF vscale = hn::Set(d, inv * dloss);
  // The target's entry, dloss * (p - 1), read before the row is written
  // (out may be row: the gradient in place of the logits).
  const float target_grad =
      target >= 0
          ? dloss *
                (kernels::ExpApprox(ToFloat(row[target]) - max) * inv - 1.0f)
          : 0.0f;
  int64_t j = 0;
  for (; j + lanes <= v; j += lanes) {
    StoreF(d, hn::Mul(Exp(d, hn::Sub(LoadF(d, row + j), vmax)), vscale),
           out + j);
  }
  for (; j < v; ++j) {
    out[j] =
        FromFloat<T>(kernels::ExpApprox(ToFloat(row[j]) - max) * (inv * dloss));
  }
  if (target >= 0) out[target] = FromFloat<T>(target_grad);
}

void CrossEntropyBackwardAll(DType dtype, const void* logits_raw,
                             const int64_t* targets, const float* dlosses,
                             const float* lse, int64_t n, int64_t v,
                             int64_t ignore_index, void* dlogits_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* logits = static_cast<const T*>(logits_raw);
    T* dlogits = static_cast<T*>(dlogits_raw);
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits + i * v;
      T* out = dlogits + i * v;
      if (targets[i] == ignore_index) {
        std::memset(static_cast<void*>(out), 0, v * sizeof(T));
        continue;
      }
      if (lse != nullptr) {  // exp(x - lse): one pass
        SoftmaxGradRow(row, v, lse[i], 1.0f, dlosses[i], targets[i], out);
        continue;
      }
      const float max = RowMax(row, v);
      const float inv = 1.0f / RowSumExp(row, v, max);
      SoftmaxGradRow(row, v, max, inv, dlosses[i], targets[i], out);
    }
  });
}

void CrossEntropyShardStatsAll(DType dtype, const void* logits_raw,
                               const int64_t* local_targets,
                               const bool* ignored, int64_t n, int64_t v,
                               float* max, float* sumexp, float* target_logit) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* logits = static_cast<const T*>(logits_raw);
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      if (ignored[i]) {
        max[i] = sumexp[i] = target_logit[i] = 0.0f;
        continue;
      }
      const T* row = logits + i * v;
      max[i] = RowMax(row, v);
      sumexp[i] = RowSumExp(row, v, max[i]);
      target_logit[i] =
          local_targets[i] >= 0 ? ToFloat(row[local_targets[i]]) : 0.0f;
    }
  });
}

void CrossEntropyShardBackwardAll(DType dtype, const void* logits_raw,
                                  const int64_t* local_targets,
                                  const bool* ignored, const float* max,
                                  const float* sumexp, const float* dlosses,
                                  int64_t n, int64_t v, void* dlogits_raw) {
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* logits = static_cast<const T*>(logits_raw);
    T* dlogits = static_cast<T*>(dlogits_raw);
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      T* out = dlogits + i * v;
      if (ignored[i]) {
        std::memset(static_cast<void*>(out), 0, v * sizeof(T));
        continue;
      }
      SoftmaxGradRow(logits + i * v, v, max[i], 1.0f / sumexp[i], dlosses[i],
                     local_targets[i], out);
    }
  });
}

// ------------------------------------------------------- double-precision sum

// Chunks of 256 elements go through f32 (converted into a stack buffer
// unless already f32), then into two f64 accumulators, half an f32 vector
// at a time; the last partial chunk runs the scalar loop.
template <typename T>
double SumF64T(const T* x, size_t n, bool squares) {
  const DF d;
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const size_t lanes = hn::Lanes(d), half = hn::Lanes(dd);
  constexpr size_t kChunk = 256;  // A multiple of every target's lanes.
  HWY_ALIGN float buf[kChunk];
  auto a0 = hn::Zero(dd), a1 = hn::Zero(dd);
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    const float* p = buf;
    if constexpr (std::is_same_v<T, float>) {
      p = x + i;
    } else {
      for (size_t j = 0; j < kChunk; j += lanes) {
        hn::Store(LoadF(d, x + i + j), d, buf + j);
      }
    }
    for (size_t j = 0; j < kChunk; j += 2 * half) {
      const auto v0 = hn::PromoteTo(dd, hn::LoadU(dfh, p + j));
      const auto v1 = hn::PromoteTo(dd, hn::LoadU(dfh, p + j + half));
      if (squares) {
        a0 = hn::MulAdd(v0, v0, a0);
        a1 = hn::MulAdd(v1, v1, a1);
      } else {
        a0 = hn::Add(a0, v0);
        a1 = hn::Add(a1, v1);
      }
    }
  }
  double total = hn::GetLane(hn::SumOfLanes(dd, hn::Add(a0, a1)));
  for (; i < n; ++i) {
    const double v = ToFloat(x[i]);
    total += squares ? v * v : v;
  }
  return total;
}

double SumF64All(DType dtype, const void* x, int64_t n, bool squares) {
  double total = 0.0;
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    total = SumF64T(static_cast<const T*>(x), n, squares);
  });
  return total;
}

// ------------------------------------------------------------------- RoPE

// One row: (a, b) = (x[i], x[i + half]) -> (a c - b s, b c + a s), or the
// inverse (a c + b s, b c - a s), as kernels::RopeRowForward / Backward.
template <typename T>
void RopeRow(T* x, const float* cs, const float* sn, size_t half,
             bool inverse) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= half; i += lanes) {
    const VF a = LoadF(d, x + i), b = LoadF(d, x + half + i);
    const VF c = hn::LoadU(d, cs + i), s = hn::LoadU(d, sn + i);
    if (inverse) {
      StoreF(d, hn::Add(hn::Mul(a, c), hn::Mul(b, s)), x + i);
      StoreF(d, hn::Sub(hn::Mul(b, c), hn::Mul(a, s)), x + half + i);
    } else {
      StoreF(d, hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), x + i);
      StoreF(d, hn::Add(hn::Mul(b, c), hn::Mul(a, s)), x + half + i);
    }
  }
  for (; i < half; ++i) {
    const float a = ToFloat(x[i]), b = ToFloat(x[i + half]);
    const float c = cs[i], s = sn[i];
    x[i] = FromFloat<T>(inverse ? a * c + b * s : a * c - b * s);
    x[i + half] = FromFloat<T>(inverse ? b * c - a * s : b * c + a * s);
  }
}

void RopeAll(DType dtype, void* x_raw, int64_t rows, int64_t seq_len,
             int64_t head_dim, const float* inv_freq, bool inverse,
             const int32_t* positions, int64_t batch) {
  const int64_t half = head_dim / 2;
  const int64_t rows_per_batch = std::max<int64_t>(1, rows / batch);
  // cos and sin of every (entry, frequency), as the reference computes them
  // for each row: an entry per position 0 .. seq_len - 1; with `positions`
  // one per position 0 .. their largest (documents' positions: < seq_len),
  // or, when that is more, one per (batch row, t) at its given position
  // (a context-parallel rank's global positions).
  int64_t largest = 0;
  if (positions != nullptr) {
    for (int64_t e = 0; e < batch * seq_len; ++e) {
      largest = std::max<int64_t>(largest, positions[e]);
    }
  }
  const bool per_entry = positions != nullptr && largest >= batch * seq_len;
  const int64_t entries = positions == nullptr ? seq_len
                          : per_entry          ? batch * seq_len
                                               : largest + 1;
  std::vector<float> cs(entries * half), sn(entries * half);
#pragma omp parallel for schedule(static) if (entries * half > 4096)
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t p = per_entry ? std::max<int64_t>(positions[e], 0) : e;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(p) * inv_freq[i];
      cs[e * half + i] = cosf(angle);
      sn[e * half + i] = sinf(angle);
    }
  }
  ByDType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* x = static_cast<T*>(x_raw);
#pragma omp parallel for schedule(static) if (rows * head_dim > \
                                              kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      int64_t e = r % seq_len;
      if (positions != nullptr) {
        const int64_t at = r / rows_per_batch * seq_len + e;
        e = per_entry ? at : std::max<int64_t>(positions[at], 0);
      }
      RopeRow(x + r * head_dim, cs.data() + e * half, sn.data() + e * half,
              half, inverse);
    }
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace rowwise_internal
}  // namespace cpu
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdpp {
namespace cpu {
namespace rowwise_internal {
HWY_EXPORT(SoftmaxForwardAll);
HWY_EXPORT(SoftmaxBackwardAll);
HWY_EXPORT(SumRowsAccumulateAll);
HWY_EXPORT(RopeAll);
HWY_EXPORT(SumF64All);
HWY_EXPORT(LayerNormForwardAll);
HWY_EXPORT(LayerNormBackwardAll);
HWY_EXPORT(RmsNormForwardAll);
HWY_EXPORT(RmsNormBackwardAll);
HWY_EXPORT(CrossEntropyForwardAll);
HWY_EXPORT(CrossEntropyBackwardAll);
HWY_EXPORT(CrossEntropyShardStatsAll);
HWY_EXPORT(CrossEntropyShardBackwardAll);
}  // namespace rowwise_internal

namespace rowwise {

void SoftmaxForward(DType dtype, const void* x, int64_t rows, int64_t n,
                    int64_t tq, int64_t causal_offset, void* y) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::SoftmaxForwardAll)
  (dtype, x, rows, n, tq, causal_offset, y);
}

void SoftmaxBackward(DType dtype, const void* y, const void* dy, int64_t rows,
                     int64_t n, void* dx) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::SoftmaxBackwardAll)
  (dtype, y, dy, rows, n, dx);
}

void LayerNormForward(DType dtype, const void* x, const void* weight,
                      const void* bias, float eps, int64_t rows, int64_t c,
                      void* out, float* mean, float* rstd) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::LayerNormForwardAll)
  (dtype, x, weight, bias, eps, rows, c, out, mean, rstd);
}

void LayerNormBackward(DType dtype, const void* dy, const void* x,
                       const void* weight, const float* mean, const float* rstd,
                       int64_t rows, int64_t c, void* dx, void* dweight,
                       void* dbias) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::LayerNormBackwardAll)
  (dtype, dy, x, weight, mean, rstd, rows, c, dx, dweight, dbias);
}

void RmsNormForward(DType dtype, const void* x, const void* weight, float eps,
                    int64_t rows, int64_t c, void* out, float* rstd) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::RmsNormForwardAll)
  (dtype, x, weight, eps, rows, c, out, rstd);
}

void RmsNormBackward(DType dtype, const void* dy, const void* x,
                     const void* weight, const float* rstd, int64_t rows,
                     int64_t c, void* dx, void* dweight) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::RmsNormBackwardAll)
  (dtype, dy, x, weight, rstd, rows, c, dx, dweight);
}

void CrossEntropyForward(DType dtype, const void* logits,
                         const int64_t* targets, int64_t n, int64_t v,
                         int64_t ignore_index, float* losses, float* lse) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::CrossEntropyForwardAll)
  (dtype, logits, targets, n, v, ignore_index, losses, lse);
}

void CrossEntropyBackward(DType dtype, const void* logits,
                          const int64_t* targets, const float* dlosses,
                          const float* lse, int64_t n, int64_t v,
                          int64_t ignore_index, void* dlogits) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::CrossEntropyBackwardAll)
  (dtype, logits, targets, dlosses, lse, n, v, ignore_index, dlogits);
}

void CrossEntropyShardStats(DType dtype, const void* logits,
                            const int64_t* local_targets, const bool* ignored,
                            int64_t n, int64_t v, float* max, float* sumexp,
                            float* target_logit) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::CrossEntropyShardStatsAll)
  (dtype, logits, local_targets, ignored, n, v, max, sumexp, target_logit);
}

void CrossEntropyShardBackward(DType dtype, const void* logits,
                               const int64_t* local_targets,
                               const bool* ignored, const float* max,
                               const float* sumexp, const float* dlosses,
                               int64_t n, int64_t v, void* dlogits) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::CrossEntropyShardBackwardAll)
  (dtype, logits, local_targets, ignored, max, sumexp, dlosses, n, v, dlogits);
}

double SumF64(DType dtype, const void* x, int64_t n, bool squares) {
  return HWY_DYNAMIC_DISPATCH(rowwise_internal::SumF64All)(dtype, x, n,
                                                           squares);
}

void Rope(DType dtype, void* x, int64_t rows, int64_t seq_len, int64_t head_dim,
          const float* inv_freq, bool inverse, const int32_t* positions,
          int64_t batch) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::RopeAll)
  (dtype, x, rows, seq_len, head_dim, inv_freq, inverse, positions, batch);
}

void SumRowsAccumulate(DType x_dtype, const void* x, int64_t rows, int64_t cols,
                       DType out_dtype, void* out) {
  HWY_DYNAMIC_DISPATCH(rowwise_internal::SumRowsAccumulateAll)
  (x_dtype, x, rows, cols, out_dtype, out);
}

}  // namespace rowwise
}  // namespace cpu
}  // namespace fsdpp
#endif  // HWY_ONCE
