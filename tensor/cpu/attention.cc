// Fused causal attention on the CPU (see attention.h), compiled once per
// SIMD target by hwy/foreach_target.h (this file includes itself through
// it) and dispatched at run time.
//
// Forward, one task per (batch, query head), tasks spread over the OpenMP
// pool: the head's keys are converted to f32 once, transposed ([hd][T], so a
// query row times a key tile is a run of broadcast multiply-adds over
// contiguous keys), and its values as f32 rows. Query tiles of kQueryTile
// rows then walk the key tiles of kKeyTile keys up to the diagonal (tiles
// above it are never touched), keeping per row the running max, the running
// sum of exponentials and the f32 output accumulator (online softmax);
// scores exist only as one [kQueryTile, kKeyTile] tile. The query tile is
// pre-multiplied by `scale`.
//
// Backward, one task per (batch, kv head), so the heads that share a kv head
// accumulate its dk and dv without races: for each of those query heads and
// query tile, the probabilities of each key tile are recomputed from lse,
// dP = dout V^T, dS = P (dP - D), and dq, dk, dv accumulate in f32.
//
// Head dims are padded with zeros to a multiple of 16 floats and sequence
// lengths to a multiple of kKeyTile in the f32 work buffers, so every vector
// loop runs whole vectors; padded keys are masked like future ones.
//
// Key ranges (key_lo, key_hi: document masks, context parallelism's
// blocks): row i masks the keys outside [lo_i, hi_i), and a query tile
// walks the key tiles from the one holding its rows' smallest lo to the one
// holding their largest hi - 1 (a row may then see a tile with none of its
// keys: its probabilities there are 0; a row with no key at all gets out 0
// and lse -inf).
#include "tensor/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "tensor/kernels/attention.h"
#include "tensor/kernels/elementwise.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tensor/cpu/attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "tensor/cpu/math-inl.h"

#ifndef FSDPP_TENSOR_CPU_ATTENTION_ONCE_
#define FSDPP_TENSOR_CPU_ATTENTION_ONCE_
namespace fsdpp {
namespace cpu {
namespace attention_internal {

constexpr int64_t kQueryTile = 32;  // divides kKeyTile: without document
constexpr int64_t kKeyTile = 64;    // masks no row of a processed tile is
constexpr int64_t kHeadPad = 16;    // wholly masked

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One batch row's key bounds ([t] arrays, null for the causal defaults).
struct RowKeys {
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  // Batch row `row` of [b, t] bounds (each null or [b, t]).
  static RowKeys Of(const int32_t* lo, const int32_t* hi, int64_t row,
                    int64_t t) {
    return {lo == nullptr ? nullptr : lo + row * t,
            hi == nullptr ? nullptr : hi + row * t};
  }
  int64_t Lo(int64_t i, int64_t t) const { return kernels::KeyLo(lo, i, t); }
  int64_t Hi(int64_t i, int64_t t) const { return kernels::KeyHi(hi, i, t); }
};

// The key tiles query rows [q0, q0 + rows) need: [begin, end), begin the
// start of the tile holding their smallest lo, end past their largest hi.
struct TileRange {
  int64_t begin, end;
};
inline TileRange KeyTiles(const RowKeys& keys, int64_t q0, int64_t rows,
                          int64_t t) {
  int64_t lo = t, hi = 0;
  for (int64_t i = q0; i < q0 + rows; ++i) {
    if (keys.Lo(i, t) >= keys.Hi(i, t)) continue;  // no key
    lo = std::min(lo, keys.Lo(i, t));
    hi = std::max(hi, keys.Hi(i, t));
  }
  if (lo >= hi) return {0, 0};
  return {lo / kKeyTile * kKeyTile, hi};
}

// `rows` rows of `width` elements of T (row stride `width`) as f32 rows of
// stride `ld` (zero padded), each multiplied by `scale`.
template <typename T>
void RowsToF32(const T* src, int64_t rows, int64_t width, float scale,
               float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < width; ++e) {
      dst[r * ld + e] = scale * ToFloat(src[r * width + e]);
    }
    for (int64_t e = width; e < ld; ++e) dst[r * ld + e] = 0.0f;
  }
}

// The same rows transposed: dst[e * ld + r] (zero padded to `padded_rows`
// columns and `padded_width` rows).
template <typename T>
void RowsToF32Transposed(const T* src, int64_t rows, int64_t width,
                         int64_t padded_rows, int64_t padded_width,
                         float* dst) {
  std::fill(dst, dst + padded_width * padded_rows, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < width; ++e) {
      dst[e * padded_rows + r] = ToFloat(src[r * width + e]);
    }
  }
}

}  // namespace attention_internal
}  // namespace cpu
}  // namespace fsdpp
#endif  // FSDPP_TENSOR_CPU_ATTENTION_ONCE_

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace cpu {
namespace attention_internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using simd_math::HWY_NAMESPACE::Exp;

// For r < R: out[r * kKeyTile + j] = sum_e a[r * hdp + e] * bt[e * ld + j]
// for j < kKeyTile (bt: hdp rows). R rows at once share the loads of bt and
// keep 4 R independent accumulator chains in flight.
template <int R>
HWY_INLINE void RowsTimesTile(const float* a, const float* bt, int64_t ld,
                              int64_t hdp, float* out) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t j = 0; j < kKeyTile; j += 4 * n) {
    VF s[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) s[r][c] = hn::Zero(d);
    }
    for (int64_t e = 0; e < hdp; ++e) {
      const float* row = bt + e * ld + j;
      const VF b0 = hn::LoadU(d, row), b1 = hn::LoadU(d, row + n),
               b2 = hn::LoadU(d, row + 2 * n), b3 = hn::LoadU(d, row + 3 * n);
      for (int r = 0; r < R; ++r) {
        const VF x = hn::Set(d, a[r * hdp + e]);
        s[r][0] = hn::MulAdd(x, b0, s[r][0]);
        s[r][1] = hn::MulAdd(x, b1, s[r][1]);
        s[r][2] = hn::MulAdd(x, b2, s[r][2]);
        s[r][3] = hn::MulAdd(x, b3, s[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) {
        hn::StoreU(s[r][c], d, out + r * kKeyTile + j + c * n);
      }
    }
  }
}

// For r < R: acc_r[e] = acc_r[e] * keep[r] +
// sum_{j < count} w[r * w_row + j * w_col] * rows[j * hdp + e] over e < hdp,
// acc_r = acc + r * hdp. R accumulator rows share the loads of `rows`.
template <int R>
HWY_INLINE void AccumulateRows(const float* w, int64_t w_row, int64_t w_col,
                               const float* rows, int64_t count, int64_t hdp,
                               const float* keep, float* acc) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  int64_t e = 0;
  for (; e + 4 * n <= hdp; e += 4 * n) {
    VF a[R][4];
    for (int r = 0; r < R; ++r) {
      const VF k = hn::Set(d, keep[r]);
      for (int c = 0; c < 4; ++c) {
        a[r][c] = hn::Mul(k, hn::LoadU(d, acc + r * hdp + e + c * n));
      }
    }
    for (int64_t j = 0; j < count; ++j) {
      const float* row = rows + j * hdp + e;
      const VF b0 = hn::LoadU(d, row), b1 = hn::LoadU(d, row + n),
               b2 = hn::LoadU(d, row + 2 * n), b3 = hn::LoadU(d, row + 3 * n);
      for (int r = 0; r < R; ++r) {
        const VF x = hn::Set(d, w[r * w_row + j * w_col]);
        a[r][0] = hn::MulAdd(x, b0, a[r][0]);
        a[r][1] = hn::MulAdd(x, b1, a[r][1]);
        a[r][2] = hn::MulAdd(x, b2, a[r][2]);
        a[r][3] = hn::MulAdd(x, b3, a[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) {
        hn::StoreU(a[r][c], d, acc + r * hdp + e + c * n);
      }
    }
  }
  for (; e < hdp; e += n) {
    for (int r = 0; r < R; ++r) {
      VF a = hn::Mul(hn::Set(d, keep[r]), hn::LoadU(d, acc + r * hdp + e));
      for (int64_t j = 0; j < count; ++j) {
        a = hn::MulAdd(hn::Set(d, w[r * w_row + j * w_col]),
                       hn::LoadU(d, rows + j * hdp + e), a);
      }
      hn::StoreU(a, d, acc + r * hdp + e);
    }
  }
}

// Sets s[j] (j < kKeyTile) for key key0 + j outside [lo, hi) to -inf;
// returns the max of the row.
HWY_INLINE float MaskAndMax(float* s, int64_t key0, int64_t lo, int64_t hi) {
  for (int64_t j = std::max<int64_t>(hi - key0, 0); j < kKeyTile; ++j) {
    s[j] = -INFINITY;
  }
  for (int64_t j = 0; j < std::min(lo - key0, kKeyTile); ++j) {
    s[j] = -INFINITY;
  }
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  VF m = hn::Set(d, -INFINITY);
  for (int64_t j = 0; j < kKeyTile; j += n) m = hn::Max(m, hn::LoadU(d, s + j));
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

// s[j] = exp(s[j] - shift) for j < kKeyTile; returns their sum.
HWY_INLINE float ExpShifted(float* s, float shift) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const VF sh = hn::Set(d, shift);
  VF sum = hn::Zero(d);
  for (int64_t j = 0; j < kKeyTile; j += n) {
    const VF p = Exp(d, hn::Sub(hn::LoadU(d, s + j), sh));
    hn::StoreU(p, d, s + j);
    sum = hn::Add(sum, p);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// ds[j] = p[j] * (dp[j] - delta) for j < kKeyTile (in place in dp).
HWY_INLINE void SoftmaxGrad(const float* p, float delta, float* dp) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const VF dl = hn::Set(d, delta);
  for (int64_t j = 0; j < kKeyTile; j += n) {
    hn::StoreU(hn::Mul(hn::LoadU(d, p + j), hn::Sub(hn::LoadU(d, dp + j), dl)),
               d, dp + j);
  }
}

// One key tile of a row's online softmax: masks the scores s (keys key0 + j
// outside the row's [lo, hi)), turns them into exp(s - new max) in place,
// updates *max and *sum, and returns the factor the row's accumulator must
// be multiplied by (exp(old max - new max); 1 with the probabilities all 0
// when the tile has no key for this row).
HWY_INLINE float OnlineSoftmaxStep(float* s, int64_t key0, int64_t lo,
                                   int64_t hi, float* max, float* sum) {
  const float tile_max = MaskAndMax(s, key0, lo, hi);
  if (tile_max == -INFINITY) {
    std::fill(s, s + kKeyTile, 0.0f);
    return 1.0f;
  }
  const float new_max = std::max(*max, tile_max);
  const float keep = kernels::ExpApprox(*max - new_max);
  *sum = *sum * keep + ExpShifted(s, new_max);
  *max = new_max;
  return keep;
}

// Per-thread f32 work buffers of one forward task.
struct ForwardWork {
  std::vector<float> kt, v, q, s, acc, max, sum;
};

// `keys`: the batch row's key bounds.
template <typename T>
void ForwardHead(const T* q, const T* k, const T* v, int64_t t, int64_t hd,
                 float scale, const RowKeys& keys, T* out, float* lse,
                 ForwardWork& w) {
  const int64_t hdp = RoundUp(hd, kHeadPad), tp = RoundUp(t, kKeyTile);
  w.kt.resize(hdp * tp);
  w.v.resize(tp * hdp);
  w.q.resize(kQueryTile * hdp);
  w.s.resize(2 * kKeyTile);
  w.acc.resize(kQueryTile * hdp);
  RowsToF32Transposed(k, t, hd, tp, hdp, w.kt.data());
  RowsToF32(v, t, hd, 1.0f, w.v.data(), hdp);
  std::fill(w.v.begin() + t * hdp, w.v.end(), 0.0f);
  float max[kQueryTile], sum[kQueryTile];
  for (int64_t q0 = 0; q0 < t; q0 += kQueryTile) {
    const int64_t rows = std::min(kQueryTile, t - q0);
    RowsToF32(q + q0 * hd, rows, hd, scale, w.q.data(), hdp);
    std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    std::fill(max, max + kQueryTile, -INFINITY);
    std::fill(sum, sum + kQueryTile, 0.0f);
    const TileRange tiles = KeyTiles(keys, q0, rows, t);
    for (int64_t k0 = tiles.begin; k0 < tiles.end; k0 += kKeyTile) {
      const int64_t count = std::min(kKeyTile, t - k0);
      const float* kt = w.kt.data() + k0;
      const float* vk = w.v.data() + k0 * hdp;
      int64_t i = 0;
      for (; i + 1 < rows; i += 2) {
        RowsTimesTile<2>(w.q.data() + i * hdp, kt, tp, hdp, w.s.data());
        float keep[2];
        for (int r = 0; r < 2; ++r) {
          const int64_t query = q0 + i + r;
          keep[r] = OnlineSoftmaxStep(w.s.data() + r * kKeyTile, k0,
                                      keys.Lo(query, t), keys.Hi(query, t),
                                      &max[i + r], &sum[i + r]);
        }
        AccumulateRows<2>(w.s.data(), kKeyTile, 1, vk, count, hdp, keep,
                          w.acc.data() + i * hdp);
      }
      if (i < rows) {
        RowsTimesTile<1>(w.q.data() + i * hdp, kt, tp, hdp, w.s.data());
        const float keep =
            OnlineSoftmaxStep(w.s.data(), k0, keys.Lo(q0 + i, t),
                              keys.Hi(q0 + i, t), &max[i], &sum[i]);
        AccumulateRows<1>(w.s.data(), kKeyTile, 1, vk, count, hdp, &keep,
                          w.acc.data() + i * hdp);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;  // 0: no key
      for (int64_t e = 0; e < hd; ++e) {
        out[(q0 + i) * hd + e] = FromFloat<T>(w.acc[i * hdp + e] * inv);
      }
      lse[q0 + i] = sum[i] > 0.0f ? max[i] + std::log(sum[i]) : -INFINITY;
    }
  }
}

template <typename T>
void ForwardT(const void* q_raw, const void* k_raw, const void* v_raw,
              int64_t b, int64_t h, int64_t kv, int64_t t, int64_t hd,
              float scale, void* out_raw, float* lse, const int32_t* key_lo,
              const int32_t* key_hi) {
  const T* q = static_cast<const T*>(q_raw);
  const T* k = static_cast<const T*>(k_raw);
  const T* v = static_cast<const T*>(v_raw);
  T* out = static_cast<T*>(out_raw);
  const int64_t rep = h / kv, tasks = b * h, head = t * hd;
#pragma omp parallel
  {
    ForwardWork work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t bi = task / h, hi = task % h;
      const int64_t kv_head = bi * kv + hi / rep;
      ForwardHead(q + task * head, k + kv_head * head, v + kv_head * head, t,
                  hd, scale, RowKeys::Of(key_lo, key_hi, bi, t),
                  out + task * head, lse + task * t, work);
    }
  }
}

void ForwardF32(const void* q, const void* k, const void* v, int64_t b,
                int64_t h, int64_t kv, int64_t t, int64_t hd, float scale,
                void* out, float* lse, const int32_t* key_lo,
                const int32_t* key_hi) {
  ForwardT<float>(q, k, v, b, h, kv, t, hd, scale, out, lse, key_lo, key_hi);
}
void ForwardBf16(const void* q, const void* k, const void* v, int64_t b,
                 int64_t h, int64_t kv, int64_t t, int64_t hd, float scale,
                 void* out, float* lse, const int32_t* key_lo,
                 const int32_t* key_hi) {
  ForwardT<BFloat16>(q, k, v, b, h, kv, t, hd, scale, out, lse, key_lo, key_hi);
}
void ForwardF16(const void* q, const void* k, const void* v, int64_t b,
                int64_t h, int64_t kv, int64_t t, int64_t hd, float scale,
                void* out, float* lse, const int32_t* key_lo,
                const int32_t* key_hi) {
  ForwardT<Float16>(q, k, v, b, h, kv, t, hd, scale, out, lse, key_lo, key_hi);
}

// Per-thread f32 work buffers of one backward task.
struct BackwardWork {
  std::vector<float> kt, k, vt, dk, dv, q, dout, p, dp, dq, col;
};

// The backward of the query heads [h0, h0 + rep) that share one kv head.
template <typename T>
void BackwardKvHead(const T* q, const T* k, const T* v, const T* out,
                    const float* lse, const T* dout, int64_t rep, int64_t t,
                    int64_t hd, float scale, const RowKeys& keys, T* dq, T* dk,
                    T* dv, BackwardWork& w) {
  const int64_t hdp = RoundUp(hd, kHeadPad), tp = RoundUp(t, kKeyTile);
  const int64_t head = t * hd;
  w.kt.resize(hdp * tp);
  w.vt.resize(hdp * tp);
  w.k.resize(tp * hdp);
  w.dk.assign(tp * hdp, 0.0f);
  w.dv.assign(tp * hdp, 0.0f);
  w.q.resize(kQueryTile * hdp);
  w.dout.resize(kQueryTile * hdp);
  w.p.resize(kQueryTile * kKeyTile);
  w.dp.resize(kQueryTile * kKeyTile);
  w.dq.resize(kQueryTile * hdp);
  w.col.resize(kQueryTile);
  RowsToF32Transposed(k, t, hd, tp, hdp, w.kt.data());
  RowsToF32Transposed(v, t, hd, tp, hdp, w.vt.data());
  RowsToF32(k, t, hd, 1.0f, w.k.data(), hdp);
  std::fill(w.k.begin() + t * hdp, w.k.end(), 0.0f);
  for (int64_t r = 0; r < rep; ++r) {
    const T* qh = q + r * head;
    const T* oh = out + r * head;
    const T* doh = dout + r * head;
    const float* lh = lse + r * t;
    T* dqh = dq + r * head;
    for (int64_t q0 = 0; q0 < t; q0 += kQueryTile) {
      const int64_t rows = std::min(kQueryTile, t - q0);
      RowsToF32(qh + q0 * hd, rows, hd, scale, w.q.data(), hdp);
      RowsToF32(doh + q0 * hd, rows, hd, 1.0f, w.dout.data(), hdp);
      float delta[kQueryTile];
      for (int64_t i = 0; i < rows; ++i) {
        delta[i] = kernels::DotF32(doh + (q0 + i) * hd, oh + (q0 + i) * hd, hd);
      }
      std::fill(w.dq.begin(), w.dq.end(), 0.0f);
      const TileRange tiles = KeyTiles(keys, q0, rows, t);
      for (int64_t k0 = tiles.begin; k0 < tiles.end; k0 += kKeyTile) {
        const int64_t count = std::min(kKeyTile, t - k0);
        const float* kt = w.kt.data() + k0;
        const float* vt = w.vt.data() + k0;
        const float* kk = w.k.data() + k0 * hdp;
        const float ones[2] = {1.0f, 1.0f};
        int64_t i = 0;
        for (; i < rows; i += 2) {
          const int r = i + 1 < rows ? 2 : 1;
          float* p = w.p.data() + i * kKeyTile;
          float* ds = w.dp.data() + i * kKeyTile;
          if (r == 2) {
            RowsTimesTile<2>(w.q.data() + i * hdp, kt, tp, hdp, p);
            RowsTimesTile<2>(w.dout.data() + i * hdp, vt, tp, hdp, ds);
          } else {
            RowsTimesTile<1>(w.q.data() + i * hdp, kt, tp, hdp, p);
            RowsTimesTile<1>(w.dout.data() + i * hdp, vt, tp, hdp, ds);
          }
          for (int x = 0; x < r; ++x) {
            const int64_t query = q0 + i + x;
            MaskAndMax(p + x * kKeyTile, k0, keys.Lo(query, t),
                       keys.Hi(query, t));
            if (lh[query] == -INFINITY) {  // a row with no key
              std::fill(p + x * kKeyTile, p + (x + 1) * kKeyTile, 0.0f);
            } else {
              ExpShifted(p + x * kKeyTile, lh[query]);  // masked: 0
            }
            SoftmaxGrad(p + x * kKeyTile, delta[i + x], ds + x * kKeyTile);
          }
          // dq_i += sum_j ds_ij k_j (scaled at the end).
          if (r == 2) {
            AccumulateRows<2>(ds, kKeyTile, 1, kk, count, hdp, ones,
                              w.dq.data() + i * hdp);
          } else {
            AccumulateRows<1>(ds, kKeyTile, 1, kk, count, hdp, ones,
                              w.dq.data() + i * hdp);
          }
        }
        // dk_j += sum_i ds_ij (scale q_i); dv_j += sum_i p_ij dout_i.
        int64_t j = 0;
        for (; j + 1 < count; j += 2) {
          AccumulateRows<2>(w.dp.data() + j, 1, kKeyTile, w.q.data(), rows, hdp,
                            ones, w.dk.data() + (k0 + j) * hdp);
          AccumulateRows<2>(w.p.data() + j, 1, kKeyTile, w.dout.data(), rows,
                            hdp, ones, w.dv.data() + (k0 + j) * hdp);
        }
        if (j < count) {
          AccumulateRows<1>(w.dp.data() + j, 1, kKeyTile, w.q.data(), rows, hdp,
                            ones, w.dk.data() + (k0 + j) * hdp);
          AccumulateRows<1>(w.p.data() + j, 1, kKeyTile, w.dout.data(), rows,
                            hdp, ones, w.dv.data() + (k0 + j) * hdp);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t e = 0; e < hd; ++e) {
          dqh[(q0 + i) * hd + e] = FromFloat<T>(scale * w.dq[i * hdp + e]);
        }
      }
    }
  }
  for (int64_t j = 0; j < t; ++j) {
    for (int64_t e = 0; e < hd; ++e) {
      dk[j * hd + e] = FromFloat<T>(w.dk[j * hdp + e]);
      dv[j * hd + e] = FromFloat<T>(w.dv[j * hdp + e]);
    }
  }
}

template <typename T>
void BackwardT(const void* q_raw, const void* k_raw, const void* v_raw,
               const void* out_raw, const float* lse, const void* dout_raw,
               int64_t b, int64_t h, int64_t kv, int64_t t, int64_t hd,
               float scale, void* dq_raw, void* dk_raw, void* dv_raw,
               const int32_t* key_lo, const int32_t* key_hi) {
  const T* q = static_cast<const T*>(q_raw);
  const T* k = static_cast<const T*>(k_raw);
  const T* v = static_cast<const T*>(v_raw);
  const T* out = static_cast<const T*>(out_raw);
  const T* dout = static_cast<const T*>(dout_raw);
  T* dq = static_cast<T*>(dq_raw);
  T* dk = static_cast<T*>(dk_raw);
  T* dv = static_cast<T*>(dv_raw);
  const int64_t rep = h / kv, tasks = b * kv, head = t * hd;
#pragma omp parallel
  {
    BackwardWork work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t first = (task / kv) * h + (task % kv) * rep;  // q head
      BackwardKvHead(
          q + first * head, k + task * head, v + task * head,
          out + first * head, lse + first * t, dout + first * head, rep, t, hd,
          scale, RowKeys::Of(key_lo, key_hi, task / kv, t), dq + first * head,
          dk + task * head, dv + task * head, work);
    }
  }
}

void BackwardF32(const void* q, const void* k, const void* v, const void* out,
                 const float* lse, const void* dout, int64_t b, int64_t h,
                 int64_t kv, int64_t t, int64_t hd, float scale, void* dq,
                 void* dk, void* dv, const int32_t* key_lo,
                 const int32_t* key_hi) {
  BackwardT<float>(q, k, v, out, lse, dout, b, h, kv, t, hd, scale, dq, dk, dv,
                   key_lo, key_hi);
}
void BackwardBf16(const void* q, const void* k, const void* v, const void* out,
                  const float* lse, const void* dout, int64_t b, int64_t h,
                  int64_t kv, int64_t t, int64_t hd, float scale, void* dq,
                  void* dk, void* dv, const int32_t* key_lo,
                  const int32_t* key_hi) {
  BackwardT<BFloat16>(q, k, v, out, lse, dout, b, h, kv, t, hd, scale, dq, dk,
                      dv, key_lo, key_hi);
}
void BackwardF16(const void* q, const void* k, const void* v, const void* out,
                 const float* lse, const void* dout, int64_t b, int64_t h,
                 int64_t kv, int64_t t, int64_t hd, float scale, void* dq,
                 void* dk, void* dv, const int32_t* key_lo,
                 const int32_t* key_hi) {
  BackwardT<Float16>(q, k, v, out, lse, dout, b, h, kv, t, hd, scale, dq, dk,
                     dv, key_lo, key_hi);
}

}  // namespace HWY_NAMESPACE
}  // namespace attention_internal
}  // namespace cpu
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdpp {
namespace cpu {
namespace attention_internal {
HWY_EXPORT(ForwardF32);
HWY_EXPORT(ForwardBf16);
HWY_EXPORT(ForwardF16);
HWY_EXPORT(BackwardF32);
HWY_EXPORT(BackwardBf16);
HWY_EXPORT(BackwardF16);
}  // namespace attention_internal

void CausalAttentionForward(DType dtype, const void* q, const void* k,
                            const void* v, int64_t b, int64_t h, int64_t kv,
                            int64_t t, int64_t hd, float scale, void* out,
                            float* lse, const int32_t* key_lo,
                            const int32_t* key_hi) {
  using namespace attention_internal;  // NOLINT: HWY_DYNAMIC_DISPATCH names
  switch (dtype) {
    case DType::kF32:
      return HWY_DYNAMIC_DISPATCH(ForwardF32)(q, k, v, b, h, kv, t, hd, scale,
                                              out, lse, key_lo, key_hi);
    case DType::kBF16:
      return HWY_DYNAMIC_DISPATCH(ForwardBf16)(q, k, v, b, h, kv, t, hd, scale,
                                               out, lse, key_lo, key_hi);
    default:
      return HWY_DYNAMIC_DISPATCH(ForwardF16)(q, k, v, b, h, kv, t, hd, scale,
                                              out, lse, key_lo, key_hi);
  }
}

void CausalAttentionBackward(DType dtype, const void* q, const void* k,
                             const void* v, const void* out, const float* lse,
                             const void* dout, int64_t b, int64_t h, int64_t kv,
                             int64_t t, int64_t hd, float scale, void* dq,
                             void* dk, void* dv, const int32_t* key_lo,
                             const int32_t* key_hi) {
  using namespace attention_internal;  // NOLINT: HWY_DYNAMIC_DISPATCH names
  switch (dtype) {
    case DType::kF32:
      return HWY_DYNAMIC_DISPATCH(BackwardF32)(q, k, v, out, lse, dout, b, h,
                                               kv, t, hd, scale, dq, dk, dv,
                                               key_lo, key_hi);
    case DType::kBF16:
      return HWY_DYNAMIC_DISPATCH(BackwardBf16)(q, k, v, out, lse, dout, b, h,
                                                kv, t, hd, scale, dq, dk, dv,
                                                key_lo, key_hi);
    default:
      return HWY_DYNAMIC_DISPATCH(BackwardF16)(q, k, v, out, lse, dout, b, h,
                                               kv, t, hd, scale, dq, dk, dv,
                                               key_lo, key_hi);
  }
}

}  // namespace cpu
}  // namespace fsdpp
#endif  // HWY_ONCE
