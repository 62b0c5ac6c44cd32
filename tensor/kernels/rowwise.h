// Row-wise math shared by the CPU loops and the CUDA kernels: softmax,
// LayerNorm, RMSNorm, cross-entropy, each forward and backward.
//
// A "row" is the last dimension (C or V contiguous elements). The CPU runs
// rows in an OpenMP loop, the GPU one row per thread (or per block), calling
// these same functions, so both paths compute the same arithmetic (in f32,
// whatever the storage type T). Parameter gradients (LayerNorm / RMSNorm
// weight and bias) are column sums over rows; they are computed by the
// *Column* functions, one column at a time, so no two workers write the same
// element and the result does not depend on the number of threads.
#ifndef FSDPP_TENSOR_KERNELS_ROWWISE_H_
#define FSDPP_TENSOR_KERNELS_ROWWISE_H_

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/macros.h"

namespace fsdpp {
namespace kernels {

// ---------------------------------------------------------------- softmax

// y[j] = exp(x[j] - max) / sum for j < valid; y[j] = 0 for j >= valid
// (masked, e.g. causal attention). valid >= 1.
template <typename T>
FSDPP_INLINE void SoftmaxRowForward(const T* x, int64_t n, int64_t valid,
                                    T* y) {
  float max = ToFloat(x[0]);
  for (int64_t j = 1; j < valid; ++j) max = fmaxf(max, ToFloat(x[j]));
  float sum = 0.0f;
  for (int64_t j = 0; j < valid; ++j) sum += expf(ToFloat(x[j]) - max);
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < valid; ++j) {
    y[j] = FromFloat<T>(expf(ToFloat(x[j]) - max) * inv);
  }
  for (int64_t j = valid; j < n; ++j) y[j] = FromFloat<T>(0.0f);
}

// dx = y * (dy - sum(dy * y)).
template <typename T>
FSDPP_INLINE void SoftmaxRowBackward(const T* y, const T* dy, int64_t n,
                                     T* dx) {
  float dot = 0.0f;
  for (int64_t j = 0; j < n; ++j) dot += ToFloat(y[j]) * ToFloat(dy[j]);
  for (int64_t j = 0; j < n; ++j) {
    dx[j] = FromFloat<T>(ToFloat(y[j]) * (ToFloat(dy[j]) - dot));
  }
}

// -------------------------------------------------------------- LayerNorm

// out = (x - mean) * rstd * weight + bias (bias may be null); also returns
// mean and rstd = 1 / sqrt(var + eps) (biased variance, two passes).
template <typename T>
FSDPP_INLINE void LayerNormRowForward(const T* x, const T* weight,
                                      const T* bias, int64_t c, float eps,
                                      T* out, float* mean_out,
                                      float* rstd_out) {
  float sum = 0.0f;
  for (int64_t j = 0; j < c; ++j) sum += ToFloat(x[j]);
  const float mean = sum / static_cast<float>(c);
  float var = 0.0f;
  for (int64_t j = 0; j < c; ++j) {
    const float d = ToFloat(x[j]) - mean;
    var += d * d;
  }
  var /= static_cast<float>(c);
  const float rstd = 1.0f / sqrtf(var + eps);
  for (int64_t j = 0; j < c; ++j) {
    float v = (ToFloat(x[j]) - mean) * rstd * ToFloat(weight[j]);
    if (bias != nullptr) v += ToFloat(bias[j]);
    out[j] = FromFloat<T>(v);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// dx for one row: rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
template <typename T>
FSDPP_INLINE void LayerNormRowBackward(const T* dy, const T* x, const T* weight,
                                       float mean, float rstd, int64_t c,
                                       T* dx) {
  float mean_g = 0.0f, mean_gx = 0.0f;
  for (int64_t j = 0; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(weight[j]);
    const float xhat = (ToFloat(x[j]) - mean) * rstd;
    mean_g += g;
    mean_gx += g * xhat;
  }
  mean_g /= static_cast<float>(c);
  mean_gx /= static_cast<float>(c);
  for (int64_t j = 0; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(weight[j]);
    const float xhat = (ToFloat(x[j]) - mean) * rstd;
    dx[j] = FromFloat<T>(rstd * (g - mean_g - xhat * mean_gx));
  }
}

// Column `j` of the weight / bias gradients over `rows` rows, added to
// dweight[j] / dbias[j] (dbias may be null).
template <typename T>
FSDPP_INLINE void LayerNormColumnBackward(const T* dy, const T* x,
                                          const float* mean, const float* rstd,
                                          int64_t rows, int64_t c, int64_t j,
                                          T* dweight, T* dbias) {
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float g = ToFloat(dy[r * c + j]);
    dw += g * (ToFloat(x[r * c + j]) - mean[r]) * rstd[r];
    db += g;
  }
  dweight[j] = FromFloat<T>(ToFloat(dweight[j]) + dw);
  if (dbias != nullptr) dbias[j] = FromFloat<T>(ToFloat(dbias[j]) + db);
}

// ---------------------------------------------------------------- RMSNorm

// out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
template <typename T>
FSDPP_INLINE void RmsNormRowForward(const T* x, const T* weight, int64_t c,
                                    float eps, T* out, float* rstd_out) {
  float ss = 0.0f;
  for (int64_t j = 0; j < c; ++j) {
    const float v = ToFloat(x[j]);
    ss += v * v;
  }
  const float rstd = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  for (int64_t j = 0; j < c; ++j) {
    out[j] = FromFloat<T>(ToFloat(x[j]) * rstd * ToFloat(weight[j]));
  }
  *rstd_out = rstd;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
template <typename T>
FSDPP_INLINE void RmsNormRowBackward(const T* dy, const T* x, const T* weight,
                                     float rstd, int64_t c, T* dx) {
  float mean_gx = 0.0f;
  for (int64_t j = 0; j < c; ++j) {
    mean_gx += ToFloat(dy[j]) * ToFloat(weight[j]) * ToFloat(x[j]) * rstd;
  }
  mean_gx /= static_cast<float>(c);
  for (int64_t j = 0; j < c; ++j) {
    const float g = ToFloat(dy[j]) * ToFloat(weight[j]);
    const float xhat = ToFloat(x[j]) * rstd;
    dx[j] = FromFloat<T>(rstd * (g - xhat * mean_gx));
  }
}

// Column `j` of the weight gradient, added to dweight[j].
template <typename T>
FSDPP_INLINE void RmsNormColumnBackward(const T* dy, const T* x,
                                        const float* rstd, int64_t rows,
                                        int64_t c, int64_t j, T* dweight) {
  float dw = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    dw += ToFloat(dy[r * c + j]) * ToFloat(x[r * c + j]) * rstd[r];
  }
  dweight[j] = FromFloat<T>(ToFloat(dweight[j]) + dw);
}

// ---------------------------------------------------------- cross-entropy

// -log softmax(logits)[target]; 0 when target == ignore_index.
template <typename T>
FSDPP_INLINE float CrossEntropyRowForward(const T* logits, int64_t v,
                                          int64_t target,
                                          int64_t ignore_index) {
  if (target == ignore_index) return 0.0f;
  float max = ToFloat(logits[0]);
  for (int64_t j = 1; j < v; ++j) max = fmaxf(max, ToFloat(logits[j]));
  float sum = 0.0f;
  for (int64_t j = 0; j < v; ++j) sum += expf(ToFloat(logits[j]) - max);
  return logf(sum) + max - ToFloat(logits[target]);
}

// dlogits = dloss * (softmax(logits) - onehot(target)); zero when ignored.
template <typename T>
FSDPP_INLINE void CrossEntropyRowBackward(const T* logits, int64_t v,
                                          int64_t target, int64_t ignore_index,
                                          float dloss, T* dlogits) {
  if (target == ignore_index) {
    for (int64_t j = 0; j < v; ++j) dlogits[j] = FromFloat<T>(0.0f);
    return;
  }
  float max = ToFloat(logits[0]);
  for (int64_t j = 1; j < v; ++j) max = fmaxf(max, ToFloat(logits[j]));
  float sum = 0.0f;
  for (int64_t j = 0; j < v; ++j) sum += expf(ToFloat(logits[j]) - max);
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < v; ++j) {
    float p = expf(ToFloat(logits[j]) - max) * inv;
    if (j == target) p -= 1.0f;
    dlogits[j] = FromFloat<T>(dloss * p);
  }
}

// ------------------------------------------------ cross-entropy, loss parallel

// One rank's slice of a row of logits (loss parallel: the vocabulary is split
// across ranks). local_target: the target's index in this slice, or -1 when
// another rank holds it. Writes the slice's max, the sum of exp(x - max) over
// it and the target's logit (0 when not here).
template <typename T>
FSDPP_INLINE void CrossEntropyShardRowStats(const T* logits, int64_t v,
                                            int64_t local_target,
                                            float* max_out, float* sumexp_out,
                                            float* target_out) {
  float max = ToFloat(logits[0]);
  for (int64_t j = 1; j < v; ++j) max = fmaxf(max, ToFloat(logits[j]));
  float sum = 0.0f;
  for (int64_t j = 0; j < v; ++j) sum += expf(ToFloat(logits[j]) - max);
  *max_out = max;
  *sumexp_out = sum;
  *target_out = local_target >= 0 ? ToFloat(logits[local_target]) : 0.0f;
}

// The slice's dlogits = dloss * (exp(x - max) / sumexp - onehot(local_target)),
// max and sumexp being the whole row's (all slices combined).
template <typename T>
FSDPP_INLINE void CrossEntropyShardRowBackward(const T* logits, int64_t v,
                                               int64_t local_target, float max,
                                               float sumexp, float dloss,
                                               T* dlogits) {
  const float inv = 1.0f / sumexp;
  for (int64_t j = 0; j < v; ++j) {
    float p = expf(ToFloat(logits[j]) - max) * inv;
    if (j == local_target) p -= 1.0f;
    dlogits[j] = FromFloat<T>(dloss * p);
  }
}

// The slice-local target index of `target` for a slice [offset, offset + v):
// -1 when ignored or outside.
FSDPP_INLINE int64_t LocalTarget(int64_t target, int64_t ignore_index,
                                 int64_t offset, int64_t v) {
  if (target == ignore_index || target < offset || target >= offset + v) {
    return -1;
  }
  return target - offset;
}

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_KERNELS_ROWWISE_H_
