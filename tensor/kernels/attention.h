// Fused causal attention (flash-attention style) math shared by the CPU
// kernels (tensor/cpu/attention.cc), the CUDA kernels and the tests.
//
// Layout: q [B, H, T, hd], k and v [B, KV, T, hd] with KV dividing H (query
// head h reads kv head h / (H / KV)); out [B, H, T, hd]; lse [B, H, T] f32.
// Query i attends to keys 0..i. With s_ij = scale q_i . k_j:
//   lse_i = log sum_{j <= i} exp(s_ij)          (saved for the backward)
//   p_ij  = exp(s_ij - lse_i),  out_i = sum_j p_ij v_j
// and the backward, recomputing p from lse (no [T, T] matrix is kept):
//   D_i    = dout_i . out_i
//   ds_ij  = p_ij (dout_i . v_j - D_i)
//   dq_i   = scale sum_j ds_ij k_j
//   dk_j   = scale sum_{i >= j} ds_ij q_i   (summed over the heads of a kv
//   dv_j   = sum_{i >= j} p_ij dout_i        head too)
// Everything accumulates in f32; exp is kernels::ExpApprox (the vectorised
// CPU kernels compute the same function), log is the platform's logf.
//
// The functions here are the plain reference, one query (or key) row at a
// time: CausalAttentionRow runs the online softmax one key at a time, which
// is what the tiled CPU kernel does a tile at a time.
//
// Key ranges (tensor/ops.h KeyRange): query i may attend to keys [lo_i,
// hi_i) instead of 0..i (document masks, context parallelism's blocks); a
// row with no key gets out 0 and lse -inf, and adds nothing to dk, dv.
#ifndef FSDPP_TENSOR_KERNELS_ATTENTION_H_
#define FSDPP_TENSOR_KERNELS_ATTENTION_H_

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/macros.h"
#include "tensor/kernels/elementwise.h"

namespace fsdpp {
namespace kernels {

// a . b over n elements of storage type T, in f32.
template <typename T>
FSDPP_INLINE float DotF32(const T* a, const T* b, int64_t n) {
  float s = 0.0f;
  for (int64_t d = 0; d < n; ++d) s += ToFloat(a[d]) * ToFloat(b[d]);
  return s;
}

// The key range of query row i among t keys: [KeyLo, KeyHi), from the
// row's entries of lo / hi (a batch row's [t] arrays, null for the causal
// defaults 0 and i + 1), clamped to [0, t].
FSDPP_INLINE int64_t KeyLo(const int32_t* lo, int64_t i, int64_t t) {
  if (lo == nullptr) return 0;
  const int64_t v = lo[i];
  return v < 0 ? 0 : (v > t ? t : v);
}
FSDPP_INLINE int64_t KeyHi(const int32_t* hi, int64_t i, int64_t t) {
  if (hi == nullptr) return i + 1;
  const int64_t v = hi[i];
  return v < 0 ? 0 : (v > t ? t : v);
}

// One query row: out (hd elements) and lse from q (hd) against the first
// `keys` rows of k and v (row stride hd); no keys: out 0, lse -inf. `acc` is
// hd floats of scratch.
template <typename T>
FSDPP_INLINE void CausalAttentionRow(const T* q, const T* k, const T* v,
                                     int64_t keys, int64_t hd, float scale,
                                     float* acc, T* out, float* lse) {
  float max = -INFINITY, sum = 0.0f;
  for (int64_t d = 0; d < hd; ++d) acc[d] = 0.0f;
  for (int64_t j = 0; j < keys; ++j) {
    const float s = scale * DotF32(q, k + j * hd, hd);
    const float new_max = s > max ? s : max;
    const float correction = ExpApprox(max - new_max);  // exp(-inf) = 0
    const float p = ExpApprox(s - new_max);
    sum = sum * correction + p;
    for (int64_t d = 0; d < hd; ++d) {
      acc[d] = acc[d] * correction + p * ToFloat(v[j * hd + d]);
    }
    max = new_max;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int64_t d = 0; d < hd; ++d) out[d] = FromFloat<T>(acc[d] * inv);
  *lse = sum > 0.0f ? max + logf(sum) : -INFINITY;
}

// Merging two attentions of one query row over disjoint key sets (ops.h
// MergeAttention): out = self out_self + part out_part, with the merged
// log-sum-exp `lse`. A side with lse -inf (no key) has weight 0.
struct MergeWeights {
  float self, part, lse;
};
FSDPP_INLINE MergeWeights MergeAttentionWeights(float lse_self,
                                                float lse_part) {
  if (lse_part == -INFINITY) return {1.0f, 0.0f, lse_self};
  if (lse_self == -INFINITY) return {0.0f, 1.0f, lse_part};
  const float m = lse_self > lse_part ? lse_self : lse_part;
  const float a = expf(lse_self - m), b = expf(lse_part - m);
  const float sum = a + b;
  return {a / sum, b / sum, m + logf(sum)};
}

// One row of t ids of ops.h DocumentMask: each token's document's first
// index (a document begins at every eot_id and at the row's start) and its
// position within the document.
template <typename Id>
FSDPP_INLINE void DocumentMaskRow(const Id* ids, int64_t t, int64_t eot_id,
                                  int32_t* key_start, int32_t* positions) {
  int32_t start = 0;
  for (int64_t i = 0; i < t; ++i) {
    if (static_cast<int64_t>(ids[i]) == eot_id) start = static_cast<int32_t>(i);
    key_start[i] = start;
    positions[i] = static_cast<int32_t>(i) - start;
  }
}

// One row of MergeAttention: out (hd) and *lse take in out_part and
// lse_part.
template <typename T>
FSDPP_INLINE void MergeAttentionRow(const T* out_part, float lse_part,
                                    int64_t hd, T* out, float* lse) {
  const MergeWeights w = MergeAttentionWeights(*lse, lse_part);
  for (int64_t e = 0; e < hd; ++e) {
    out[e] =
        FromFloat<T>(w.self * ToFloat(out[e]) + w.part * ToFloat(out_part[e]));
  }
  *lse = w.lse;
}

// p_ij = exp(s_ij - lse_i) (0 when lse_i is -inf: no keys).
FSDPP_INLINE float AttentionProbability(float score, float lse) {
  return ExpApprox(score - lse);
}

// dq for one query row i (hd floats, accumulated in f32 then stored): from
// q_i, dout_i, D_i = dout_i . out_i and lse_i, over keys 0..keys-1.
template <typename T>
FSDPP_INLINE void CausalAttentionDqRow(const T* q, const T* k, const T* v,
                                       const T* dout, float delta, float lse,
                                       int64_t keys, int64_t hd, float scale,
                                       float* acc, T* dq) {
  for (int64_t d = 0; d < hd; ++d) acc[d] = 0.0f;
  for (int64_t j = 0; j < keys; ++j) {
    const float p =
        AttentionProbability(scale * DotF32(q, k + j * hd, hd), lse);
    const float ds = p * (DotF32(dout, v + j * hd, hd) - delta);
    for (int64_t d = 0; d < hd; ++d) acc[d] += ds * ToFloat(k[j * hd + d]);
  }
  for (int64_t d = 0; d < hd; ++d) dq[d] = FromFloat<T>(scale * acc[d]);
}

// The contribution of one query row i to key row j's dk and dv (f32
// accumulators of hd floats each).
template <typename T>
FSDPP_INLINE void CausalAttentionDkDvTerm(const T* q, const T* k, const T* v,
                                          const T* dout, float delta, float lse,
                                          int64_t hd, float scale,
                                          float* dk_acc, float* dv_acc) {
  const float p = AttentionProbability(scale * DotF32(q, k, hd), lse);
  const float ds = p * (DotF32(dout, v, hd) - delta);
  for (int64_t d = 0; d < hd; ++d) {
    dk_acc[d] += scale * ds * ToFloat(q[d]);
    dv_acc[d] += p * ToFloat(dout[d]);
  }
}

}  // namespace kernels
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_KERNELS_ATTENTION_H_
