// bf16 and f32 causal attention through oneDNN's matmuls on blocks of query
// rows (see attention.h), compiled once per SIMD target by
// hwy/foreach_target.h (this file includes itself through it) for its
// row-wise parts.
//
// Query rows are taken kBlockRows at a time; block [r0, r1) needs keys [0,
// r1) only (causal), so each block is a handful of batched matmuls over all
// (batch, head) pairs at once, every one [rows, hd] x [hd, r1] or [rows, r1]
// x [r1, hd]: oneDNN runs them on its bf16 dot-product kernels and spreads
// the batch over the OpenMP pool. Between them the rows are exact softmaxes
// (a block sees all of its keys, so no online rescaling): scores in f32;
// for bf16 the probabilities are rounded to bf16 for the next matmul, as
// the unfused path rounds them, while f32 keeps them (and dS) in place in
// the f32 score buffers. Work memory is O(b h kBlockRows T): scores of one
// block.
//
// Forward per block: S = scale Q K^T; P = softmax(S) (masked), lse; O = P V.
// Backward per block: S again, P = exp(S - lse); dP = dO V^T; dS = P (dP -
// D) with D = rowsum(dO O); dQ = scale dS K (final for these rows); dV +=
// P^T dO and dK += scale dS^T Q into f32 accumulators over the blocks (the
// heads sharing a kv head contract together: their rows are one matrix).
//
// bf16 where bf16 matmuls are widened (onednn_matmul.h: a CPU whose bf16
// dot products are slower than its f32 FMAs): each group of kv heads'
// q, k, v (and, backward, dout) are widened to f32 once and the block matmuls
// run on the f32 kernels, with P and dS rounded to bf16 values in f32 storage
// (Bf16InF32) as the native path rounds them, and out, dq, dk, dv rounded
// to bf16 at the end: the native path's products and roundings, summed in
// another order.
//
// Key ranges (key_lo, key_hi: document masks, context parallelism's
// blocks): each row's softmax masks the keys outside its [lo, hi) (a row
// with none gets probabilities 0 and lse -inf), and a block's matmuls run
// over the keys from its rows' smallest lo to their largest hi (of every
// head of the group), so packed short documents skip most of the keys.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/parallel.h"
#include "core/status.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/cpu/simd.h"
#include "tensor/kernels/attention.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tensor/cpu/attention_blocked.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "tensor/cpu/convert-inl.h"
#include "tensor/cpu/math-inl.h"

#ifndef FSDPP_TENSOR_CPU_ATTENTION_BLOCKED_ONCE_
#define FSDPP_TENSOR_CPU_ATTENTION_BLOCKED_ONCE_
namespace fsdpp {
namespace cpu {
namespace blocked_internal {

// Row strides of the score buffers are multiples of this many floats, so
// every row-wise vector loop runs whole vectors (AVX-512: 16 lanes).
constexpr int64_t kRowAlign = 16;

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// An f32 holding a bf16 value: the widened path's P and dS, which its f32
// matmuls read. StoreF rounds to nearest even as the bf16 store does.
struct Bf16InF32 {
  float value;
};

// The storage of the probabilities and score gradients the next matmuls
// read (SoftmaxRows, ProbabilityRows, ScoreGradRows).
enum class PKind { kF32, kBF16, kBf16InF32 };

}  // namespace blocked_internal
}  // namespace cpu
}  // namespace fsdpp
#endif  // FSDPP_TENSOR_CPU_ATTENTION_BLOCKED_ONCE_

HWY_BEFORE_NAMESPACE();
namespace fsdpp {
namespace cpu {
namespace blocked_internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using simd_convert::HWY_NAMESPACE::StoreF;
using simd_math::HWY_NAMESPACE::Exp;

// f32 lanes rounded to bf16 values, stored as f32: bit for bit the f32 of
// what StoreF writes to bf16.
HWY_INLINE void StoreF(DF d, VF v, Bf16InF32* p) {
  hn::StoreU(hn::BitCast(d, simd_convert::HWY_NAMESPACE::Bf16HighBits(d, v)), d,
             reinterpret_cast<float*>(p));
}

// row[j] = exp(row[j] - shift) for first <= j < valid, 0 for the other j <
// ld (a multiple of the vector width), also into `copy` unless null; returns
// the sum.
template <typename T>
HWY_INLINE float MaskedExpRow(float* row, int64_t first, int64_t valid,
                              int64_t ld, float shift, T* copy) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const VF sh = hn::Set(d, shift);
  VF sum = hn::Zero(d);
  for (int64_t j = 0; j < ld; j += n) {
    const auto keep = hn::AndNot(
        hn::FirstN(d, static_cast<size_t>(std::max<int64_t>(0, first - j))),
        hn::FirstN(d, static_cast<size_t>(std::max<int64_t>(0, valid - j))));
    const VF e =
        hn::IfThenElseZero(keep, Exp(d, hn::Sub(hn::LoadU(d, row + j), sh)));
    hn::StoreU(e, d, row + j);
    if (copy != nullptr) StoreF(d, e, copy + j);
    sum = hn::Add(sum, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// Score row r's entries [first, valid): causal, [0, first_valid + r %
// rows_per_head + 1) clamped to `cols`; or [row_lo[r], row_hi[r]) when the
// block has key ranges (both arrays non-null).
struct RowEntries {
  int64_t first, valid;
};
HWY_INLINE RowEntries Entries(int64_t r, int64_t rows_per_head,
                              int64_t first_valid, int64_t cols,
                              const int32_t* row_lo, const int32_t* row_hi) {
  if (row_lo != nullptr) return {row_lo[r], row_hi[r]};
  return {0, std::min(cols, first_valid + r % rows_per_head + 1)};
}

// Softmax of each of `rows` score rows (f32, stride ld) over its entries
// (Entries): p (stride ld; may be s itself) gets the probabilities and
// zeros up to ld; lse[r] = max + log(sum of exp) (a row with no entry: p 0,
// lse -inf).
template <typename T>
HWY_INLINE void SoftmaxRowsOf(float* s, int64_t rows, int64_t rows_per_head,
                              int64_t first_valid, int64_t cols, int64_t ld,
                              const int32_t* row_lo, const int32_t* row_hi,
                              T* p, float* lse) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    T* out = p + r * ld;
    const auto [first, valid] =
        Entries(r, rows_per_head, first_valid, cols, row_lo, row_hi);
    VF m = hn::Set(d, -INFINITY);
    for (int64_t j = first / n * n; j < valid; j += n) {
      const auto keep = hn::AndNot(
          hn::FirstN(d, static_cast<size_t>(std::max<int64_t>(0, first - j))),
          hn::FirstN(d, static_cast<size_t>(valid - j)));
      m = hn::Max(m, hn::IfThenElse(keep, hn::LoadU(d, row + j),
                                    hn::Set(d, -INFINITY)));
    }
    const float max = hn::GetLane(hn::MaxOfLanes(d, m));
    // The exponentials once, kept in the score row (0 where masked).
    const float total = first < valid ? MaskedExpRow(row, first, valid, ld, max,
                                                     static_cast<T*>(nullptr))
                                      : 0;
    const VF inv = hn::Set(d, total > 0.0f ? 1.0f / total : 0.0f);
    for (int64_t j = 0; j < ld; j += n) {
      StoreF(d,
             hn::Mul(hn::IfThenElseZero(hn::Ne(inv, hn::Zero(d)),
                                        hn::LoadU(d, row + j)),
                     inv),
             out + j);
    }
    lse[r] = total > 0.0f ? max + std::log(total) : -INFINITY;
  }
}

// fn(typed p) for p of `kind`.
template <typename Fn>
HWY_INLINE void WithP(PKind kind, void* p, Fn&& fn) {
  switch (kind) {
    case PKind::kF32:
      return fn(static_cast<float*>(p));
    case PKind::kBF16:
      return fn(static_cast<BFloat16*>(p));
    case PKind::kBf16InF32:
      return fn(static_cast<Bf16InF32*>(p));
  }
}

// SoftmaxRowsOf for p of `p_kind`.
void SoftmaxRows(float* s, int64_t rows, int64_t rows_per_head,
                 int64_t first_valid, int64_t cols, int64_t ld,
                 const int32_t* row_lo, const int32_t* row_hi, PKind p_kind,
                 void* p, float* lse) {
  WithP(p_kind, p, [&](auto* typed) {
    SoftmaxRowsOf(s, rows, rows_per_head, first_valid, cols, ld, row_lo, row_hi,
                  typed, lse);
  });
}

// Backward's probabilities: s[r][j] = exp(s[r][j] - lse[r]) over the valid
// entries (as SoftmaxRows counts them), 0 elsewhere; p (of `p_kind`) = the
// same rounded, unless null (f32 reads them from s).
void ProbabilityRows(float* s, int64_t rows, int64_t rows_per_head,
                     int64_t first_valid, int64_t cols, int64_t ld,
                     const int32_t* row_lo, const int32_t* row_hi,
                     const float* lse, PKind p_kind, void* p) {
  WithP(p_kind, p, [&](auto* typed) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const auto [first, valid] =
          Entries(r, rows_per_head, first_valid, cols, row_lo, row_hi);
      MaskedExpRow(s + r * ld, first, valid, ld, lse[r],
                   typed == nullptr ? nullptr : typed + r * ld);
    }
  });
}

// ds[r][j] = p[r][j] (dp[r][j] - delta[r]), over the whole stride (ds may be
// dp itself).
template <typename T>
HWY_INLINE void ScoreGradRowsOf(const float* p, const float* dp, int64_t rows,
                                int64_t ld, const float* delta, T* ds) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const VF dl = hn::Set(d, delta[r]);
    for (int64_t j = 0; j < ld; j += n) {
      const VF g = hn::Mul(hn::LoadU(d, p + r * ld + j),
                           hn::Sub(hn::LoadU(d, dp + r * ld + j), dl));
      StoreF(d, g, ds + r * ld + j);
    }
  }
}

// ScoreGradRowsOf for ds of `ds_kind`.
void ScoreGradRows(const float* p, const float* dp, int64_t rows, int64_t ld,
                   const float* delta, PKind ds_kind, void* ds) {
  WithP(ds_kind, ds,
        [&](auto* typed) { ScoreGradRowsOf(p, dp, rows, ld, delta, typed); });
}

}  // namespace HWY_NAMESPACE
}  // namespace blocked_internal
}  // namespace cpu
}  // namespace fsdpp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fsdpp {
namespace cpu {
namespace blocked_internal {
HWY_EXPORT(SoftmaxRows);
HWY_EXPORT(ProbabilityRows);
HWY_EXPORT(ScoreGradRows);

// The probabilities and score gradients as the next matmuls read them (P):
// bf16 copies for bf16 operands (T); for f32 operands the score buffers
// themselves (P = float), or, widened, f32 copies rounded to bf16 values
// (P = Bf16InF32).
template <typename P>
constexpr bool kInPlace = std::is_same_v<P, float>;
template <typename P>
constexpr PKind kPKind = std::is_same_v<P, float>      ? PKind::kF32
                         : std::is_same_v<P, BFloat16> ? PKind::kBF16
                                                       : PKind::kBf16InF32;
// dk and dv sum over the blocks in f32: in place for f32 operands (T), in
// accumulators for bf16 ones.
template <typename T>
constexpr bool kAccInPlace = std::is_same_v<T, float>;

// The matmuls see a batch of b * kv matrices: per kv head, the rows of its
// rep query heads stacked ([rep * rows, ...]; gathered into a contiguous
// buffer when rep > 1, read in place when rep == 1).
struct Dims {
  int64_t b, h, kv, rep, t, hd;
  int64_t batch() const { return b * kv; }
};

// Keys [k0, k0 + keys) of a [b, kv, t, hd] tensor (k, v) as [b * kv, keys,
// hd], or transposed as [b * kv, hd, keys].
template <typename T>
StridedOperand KvRows(const void* data, const Dims& d, int64_t k0, int64_t keys,
                      bool transpose) {
  const T* at = static_cast<const T*>(data) + k0 * d.hd;
  if (transpose) return {at, {d.batch(), d.hd, keys}, {d.t * d.hd, 1, d.hd}};
  return {at, {d.batch(), keys, d.hd}, {d.t * d.hd, d.hd, 1}};
}

// A block's query-side rows (q, dout, out's or dq's block) as [b * kv, rep
// * rows, hd]: in place for rep == 1, else in `gathered` (contiguous).
struct BlockRowsView {
  StridedOperand op;
  int64_t c_strides[3];
};

template <typename T>
BlockRowsView QueryRows(const void* data, const Dims& d, int64_t r0,
                        int64_t rows, const T* gathered) {
  if (d.rep == 1) {
    const T* base = static_cast<const T*>(data) + r0 * d.hd;
    return {{base, {d.batch(), rows, d.hd}, {d.t * d.hd, d.hd, 1}},
            {d.t * d.hd, d.hd, 1}};
  }
  const int64_t n = d.rep * rows;
  return {{gathered, {d.batch(), n, d.hd}, {n * d.hd, d.hd, 1}},
          {n * d.hd, d.hd, 1}};
}

// Rows [r0, r0 + rows) of every head of `src` ([b, h, t, hd]) into dst
// ([b * h, rows, hd]: per kv head its rep heads' rows, one after another),
// or back (`scatter`).
template <typename T>
void MoveRows(const Dims& d, int64_t r0, int64_t rows, bool scatter, T* wide,
              T* narrow) {
  const int64_t heads = d.b * d.h;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < heads; ++bh) {
    T* w = wide + (bh * d.t + r0) * d.hd;
    T* n = narrow + bh * rows * d.hd;
    if (scatter) {
      std::copy(n, n + rows * d.hd, w);
    } else {
      std::copy(w, w + rows * d.hd, n);
    }
  }
}

// The calling thread's work memory, one buffer per WorkSlot: grown on
// demand and kept for the thread's next call (as oneDNN's scratchpad in
// onednn_matmul.cc), since fresh pages on every call (page faults, the
// kernel zeroing them) cost more than the row-wise work itself. Forward and
// backward name the same slots, so a thread keeps one set.
enum WorkSlot {
  kScores,      // f32 scores, then probabilities
  kScoreGrads,  // f32 dP
  kProbs,       // bf16 P (f32: in kScores)
  kProbGrads,   // bf16 dS (f32: in kScoreGrads)
  kBlockLse,
  kBlockDelta,
  kDelta,
  kDkSum,
  kDvSum,
  kQRows,  // gathered rows (rep > 1)
  kDoutRows,
  kOutRows,    // out's or dq's rows before the scatter
  kRowBounds,  // the block rows' key ranges (key_lo, key_hi)
  // The widened path's f32 copies of a group's tensors.
  kWideQ,
  kWideK,
  kWideV,
  kWideOut,
  kWideDout,
  kWideDq,
  kWideDk,
  kWideDv,
  kWorkSlots
};

char* WorkMemory(WorkSlot slot, size_t bytes) {
  struct Held {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  thread_local Held held[kWorkSlots];
  Held& h = held[slot];
  bytes = std::max<size_t>(1, bytes);
  if (h.bytes < bytes) {
    h.data.reset();  // the old one first: peak = the new size
    h.data.reset(new char[bytes]);
    h.bytes = bytes;
  }
  return h.data.get();
}

// n elements of T, not initialised, in `slot` of the work memory.
template <typename T>
class Buffer {
 public:
  Buffer(WorkSlot slot, int64_t n)
      : data_(reinterpret_cast<T*>(WorkMemory(slot, n * sizeof(T)))),
        size_(n) {}
  T* data() { return data_; }
  int64_t size() const { return size_; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  T& operator[](int64_t i) { return data_[i]; }

 private:
  T* data_;
  int64_t size_;
};

template <typename T>
const T* Gather(const void* src, const Dims& d, int64_t r0, int64_t rows,
                Buffer<T>* buffer) {
  if (d.rep == 1) return nullptr;
  MoveRows(d, r0, rows, /*scatter=*/false,
           const_cast<T*>(static_cast<const T*>(src)), buffer->data());
  return buffer->data();
}

// A block's score-shaped buffer ([b * kv, rep * rows, ld]) as an operand
// with `cols` columns, or transposed ([b * kv, cols, rep * rows]).
StridedOperand ScoreOperand(const void* data, const Dims& d, int64_t rows,
                            int64_t cols, int64_t ld, bool transpose) {
  const int64_t n = d.rep * rows;
  if (transpose) return {data, {d.batch(), cols, n}, {n * ld, 1, ld}};
  return {data, {d.batch(), n, cols}, {n * ld, ld, 1}};
}

// A block's scores s = scale q k^T (keys [k0, k0 + keys)), f32 with
// strides s_strides.
template <typename T>
absl::Status Scores(const Dims& d, const BlockRowsView& q, const void* k,
                    int64_t k0, int64_t keys, const int64_t s_strides[3],
                    float scale, float* s) {
  return OneDnnStridedMatmul(DTypeOf<T>::value, DType::kF32, q.op,
                             KvRows<T>(k, d, k0, keys, /*transpose=*/true), s,
                             s_strides, scale, 0.0f);
}

int64_t BlockRows(int64_t t) {
  return std::min<int64_t>(t, kBlockedAttentionRows);
}

// The key ranges of a group's calls: the whole batch's bounds (each null
// or [batch, t]), the group's first unit (kv head of a batch row: unit / kv
// is its batch row) and the whole call's kv heads.
struct GroupKeys {
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  int64_t first_unit = 0;
  int64_t kv = 1;
  bool causal() const { return lo == nullptr && hi == nullptr; }
};

// The keys block [r0, r0 + rows) multiplies against, [k0, k1), and every
// row's entries [lo, hi) relative to k0 (in the score rows' order,
// [d.batch() rep, rows]; null when causal: keys [0, r0 + rows) then).
struct BlockKeys {
  int64_t k0 = 0, k1 = 0;
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
};

// `bounds` holds 2 heads x rows entries.
BlockKeys KeysOfBlock(const Dims& d, const GroupKeys& gk, int64_t r0,
                      int64_t rows, Buffer<int32_t>* bounds) {
  if (gk.causal()) return {0, r0 + rows, nullptr, nullptr};
  const int64_t heads = d.b * d.h, n = heads * rows;
  int32_t* lo = bounds->data();
  int32_t* hi = lo + n;
  int64_t k0 = d.t, k1 = 0;
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t batch = (gk.first_unit + bh / d.rep) / gk.kv;
    const int32_t* lo_row = gk.lo == nullptr ? nullptr : gk.lo + batch * d.t;
    const int32_t* hi_row = gk.hi == nullptr ? nullptr : gk.hi + batch * d.t;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t a = kernels::KeyLo(lo_row, r0 + i, d.t);
      const int64_t b = kernels::KeyHi(hi_row, r0 + i, d.t);
      lo[bh * rows + i] = static_cast<int32_t>(a);
      hi[bh * rows + i] = static_cast<int32_t>(b);
      if (a < b) {
        k0 = std::min(k0, a);
        k1 = std::max(k1, b);
      }
    }
  }
  if (k0 >= k1) {  // no row has a key: one key, masked for every row
    k0 = std::min<int64_t>(r0, d.t - 1);
    k1 = k0 + 1;
  }
  for (int64_t r = 0; r < n; ++r) {
    lo[r] = static_cast<int32_t>(std::clamp<int64_t>(lo[r] - k0, 0, k1 - k0));
    hi[r] = static_cast<int32_t>(std::clamp<int64_t>(hi[r] - k0, 0, k1 - k0));
  }
  return {k0, k1, lo, hi};
}

// T: the operands' type; P: the probabilities' (kInPlace).
template <typename T, typename P>
absl::Status ForwardGroup(const void* q, const void* k, const void* v,
                          int64_t b, int64_t h, int64_t kv, int64_t t,
                          int64_t hd, float scale, const GroupKeys& gk,
                          void* out, float* lse) {
  const Dims d{b, h, kv, h / kv, t, hd};
  const int64_t block = BlockRows(t), heads = b * h;
  const int64_t ld_max = RoundUp(t, kRowAlign);
  const int64_t scores = heads * block * ld_max;
  const int64_t gathered = d.rep > 1 ? heads * block * hd : 0;
  Buffer<float> s(kScores, scores), block_lse(kBlockLse, heads * block);
  Buffer<T> q_rows(kQRows, gathered), out_rows(kOutRows, gathered);
  Buffer<P> p_copy(kProbs, kInPlace<P> ? 0 : scores);
  P* p = kInPlace<P> ? reinterpret_cast<P*>(s.data()) : p_copy.data();
  Buffer<int32_t> bounds(kRowBounds, gk.causal() ? 0 : 2 * heads * block);
  for (int64_t r0 = 0; r0 < t; r0 += block) {
    const int64_t rows = std::min(block, t - r0);
    const BlockKeys bk = KeysOfBlock(d, gk, r0, rows, &bounds);
    const int64_t k0 = bk.k0, keys = bk.k1 - k0;
    const int64_t ld = RoundUp(keys, kRowAlign);
    const int64_t s_strides[3] = {d.rep * rows * ld, ld, 1};
    const BlockRowsView qv =
        QueryRows<T>(q, d, r0, rows, Gather(q, d, r0, rows, &q_rows));
    FSDPP_RETURN_IF_ERROR(
        Scores<T>(d, qv, k, k0, keys, s_strides, scale, s.data()));
    HWY_DYNAMIC_DISPATCH(SoftmaxRows)
    (s.data(), heads * rows, rows, r0 - k0, keys, ld, bk.lo, bk.hi, kPKind<P>,
     p, block_lse.data());
    for (int64_t bh = 0; bh < heads; ++bh) {
      std::copy(block_lse.begin() + bh * rows,
                block_lse.begin() + (bh + 1) * rows, lse + bh * t + r0);
    }
    // out = P v.
    const BlockRowsView ov = QueryRows<T>(out, d, r0, rows, out_rows.data());
    FSDPP_RETURN_IF_ERROR(OneDnnStridedMatmul(
        DTypeOf<T>::value, DTypeOf<T>::value,
        ScoreOperand(p, d, rows, keys, ld, false),
        KvRows<T>(v, d, k0, keys, false), const_cast<void*>(ov.op.data),
        ov.c_strides, 1.0f, 0.0f));
    if (d.rep > 1) {
      MoveRows(d, r0, rows, /*scatter=*/true, static_cast<T*>(out),
               out_rows.data());
    }
  }
  return absl::OkStatus();
}

// D = rowsum(dout * out) of `rows` rows of hd (of U) into the work memory,
// per (batch, head, row): the backward's `delta`.
template <typename U>
const float* RowDots(const void* out, const void* dout, int64_t rows,
                     int64_t hd) {
  Buffer<float> delta(kDelta, rows);
  const U* o = static_cast<const U*>(out);
  const U* g = static_cast<const U*>(dout);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (int64_t e = 0; e < hd; ++e) {
      acc += ToFloat(o[r * hd + e]) * ToFloat(g[r * hd + e]);
    }
    delta[r] = acc;
  }
  return delta.data();
}

// delta: RowDots of the group's out and dout.
template <typename T, typename P>
absl::Status BackwardGroup(const void* q, const void* k, const void* v,
                           const float* delta, const float* lse,
                           const void* dout, int64_t b, int64_t h, int64_t kv,
                           int64_t t, int64_t hd, float scale,
                           const GroupKeys& gk, void* dq, void* dk, void* dv) {
  const Dims d{b, h, kv, h / kv, t, hd};
  const int64_t block = BlockRows(t), heads = b * h;
  const int64_t ld_max = RoundUp(t, kRowAlign);
  // Not initialised: every element read is written first (the score
  // rows' padding up to ld is masked, never read by a matmul).
  const int64_t scores = heads * block * ld_max;
  const int64_t gathered = d.rep > 1 ? heads * block * hd : 0;
  Buffer<float> s(kScores, scores), dp(kScoreGrads, scores);
  Buffer<P> p_copy(kProbs, kInPlace<P> ? 0 : scores),
      ds_copy(kProbGrads, kInPlace<P> ? 0 : scores);
  P* p = kInPlace<P> ? reinterpret_cast<P*>(s.data()) : p_copy.data();
  P* ds = kInPlace<P> ? reinterpret_cast<P*>(dp.data()) : ds_copy.data();
  Buffer<float> block_lse(kBlockLse, heads * block),
      block_delta(kBlockDelta, heads * block);
  // f32 accumulators of dk and dv over the blocks (f32: dk and dv).
  const int64_t kv_elements = b * kv * t * hd;
  Buffer<float> dk_sum(kDkSum, kAccInPlace<T> ? 0 : kv_elements),
      dv_sum(kDvSum, kAccInPlace<T> ? 0 : kv_elements);
  float* dk_acc = kAccInPlace<T> ? static_cast<float*>(dk) : dk_sum.data();
  float* dv_acc = kAccInPlace<T> ? static_cast<float*>(dv) : dv_sum.data();
  std::fill(dk_acc, dk_acc + kv_elements, 0.0f);
  std::fill(dv_acc, dv_acc + kv_elements, 0.0f);
  Buffer<T> q_rows(kQRows, gathered), dout_rows(kDoutRows, gathered),
      dq_rows(kOutRows, gathered);
  Buffer<int32_t> bounds(kRowBounds, gk.causal() ? 0 : 2 * heads * block);
  const int64_t acc_strides[3] = {t * hd, hd, 1};
  for (int64_t r0 = 0; r0 < t; r0 += block) {
    const int64_t rows = std::min(block, t - r0);
    const BlockKeys bk = KeysOfBlock(d, gk, r0, rows, &bounds);
    const int64_t k0 = bk.k0, keys = bk.k1 - k0;
    const int64_t ld = RoundUp(keys, kRowAlign);
    const int64_t s_strides[3] = {d.rep * rows * ld, ld, 1};
    for (int64_t bh = 0; bh < heads; ++bh) {
      std::copy(lse + bh * t + r0, lse + bh * t + r0 + rows,
                block_lse.begin() + bh * rows);
      std::copy(delta + bh * t + r0, delta + bh * t + r0 + rows,
                block_delta.begin() + bh * rows);
    }
    const BlockRowsView qv =
        QueryRows<T>(q, d, r0, rows, Gather(q, d, r0, rows, &q_rows));
    const BlockRowsView gv =
        QueryRows<T>(dout, d, r0, rows, Gather(dout, d, r0, rows, &dout_rows));
    constexpr DType kT = DTypeOf<T>::value;
    // P = exp(scale q k^T - lse).
    FSDPP_RETURN_IF_ERROR(
        Scores<T>(d, qv, k, k0, keys, s_strides, scale, s.data()));
    HWY_DYNAMIC_DISPATCH(ProbabilityRows)
    (s.data(), heads * rows, rows, r0 - k0, keys, ld, bk.lo, bk.hi,
     block_lse.data(), kPKind<P>, kInPlace<P> ? nullptr : p_copy.data());
    // dP = dout v^T; dS = P (dP - D).
    FSDPP_RETURN_IF_ERROR(OneDnnStridedMatmul(
        kT, DType::kF32, gv.op, KvRows<T>(v, d, k0, keys, true), dp.data(),
        s_strides, 1.0f, 0.0f));
    HWY_DYNAMIC_DISPATCH(ScoreGradRows)
    (s.data(), dp.data(), heads * rows, ld, block_delta.data(), kPKind<P>, ds);
    // dq = scale dS k: these rows' final values.
    const BlockRowsView dqv = QueryRows<T>(dq, d, r0, rows, dq_rows.data());
    FSDPP_RETURN_IF_ERROR(OneDnnStridedMatmul(
        kT, kT, ScoreOperand(ds, d, rows, keys, ld, false),
        KvRows<T>(k, d, k0, keys, false), const_cast<void*>(dqv.op.data),
        dqv.c_strides, scale, 0.0f));
    if (d.rep > 1) {
      MoveRows(d, r0, rows, /*scatter=*/true, static_cast<T*>(dq),
               dq_rows.data());
    }
    // dv += P^T dout, dk += scale dS^T q (keys [k0, k0 + keys)).
    FSDPP_RETURN_IF_ERROR(OneDnnStridedMatmul(
        kT, DType::kF32, ScoreOperand(p, d, rows, keys, ld, true), gv.op,
        dv_acc + k0 * hd, acc_strides, 1.0f, 1.0f));
    FSDPP_RETURN_IF_ERROR(OneDnnStridedMatmul(
        kT, DType::kF32, ScoreOperand(ds, d, rows, keys, ld, true), qv.op,
        dk_acc + k0 * hd, acc_strides, scale, 1.0f));
  }
  if constexpr (!kAccInPlace<T>) {
    T* dk_out = static_cast<T*>(dk);
    T* dv_out = static_cast<T*>(dv);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < kv_elements; ++i) {
      dk_out[i] = FromFloat<T>(dk_acc[i]);
      dv_out[i] = FromFloat<T>(dv_acc[i]);
    }
  }
  return absl::OkStatus();
}

// How a call runs: on f32 operands, on bf16 ones, or on bf16 ones widened
// to f32 (Widened* below).
enum class Path { kF32, kBF16, kWidened };

// Work bytes per kv head (with its rep query heads) of a ForwardGroup /
// BackwardGroup call: its score-shaped buffers (f32: s and dP, 8 bytes a
// score; bf16: and the bf16 P and dS, 12; widened: f32 P and dS, 16) and,
// widened, the f32 copies of its q, out, dout, dq, k, v, dk and dv.
int64_t WorkBytesPerKvHead(Path path, int64_t rep, int64_t t, int64_t hd) {
  const int64_t scores = rep * BlockRows(t) * RoundUp(t, kRowAlign);
  switch (path) {
    case Path::kF32:
      return scores * 8;
    case Path::kBF16:
      return scores * 12;
    case Path::kWidened:
      return scores * 16 + (4 * rep + 4) * t * hd * 4;
  }
  return scores * 16;
}

// Kv heads per group: as many as keep the work buffers within work_bytes,
// at least one. [b, h, t, hd] is [b * kv, rep, t, hd], so a run of kv heads
// is a contiguous slice of every tensor.
int64_t KvHeadsPerGroup(Path path, int64_t rep, int64_t t, int64_t hd,
                        int64_t work_bytes) {
  return std::max<int64_t>(1,
                           work_bytes / WorkBytesPerKvHead(path, rep, t, hd));
}

// Runs fn(n, q_offset, kv_offset, lse_offset, keys) for each group of n kv
// heads (KvHeadsPerGroup) of a [b, h | kv, t, hd] call: the offsets, in
// elements, of the group's first query head, kv head and lse row.
template <typename Fn>
absl::Status ForEachKvGroup(Path path, int64_t b, int64_t h, int64_t kv,
                            int64_t t, int64_t hd, int64_t work_bytes,
                            const int32_t* key_lo, const int32_t* key_hi,
                            Fn&& fn) {
  const int64_t rep = h / kv, units = b * kv;
  const int64_t group = KvHeadsPerGroup(path, rep, t, hd, work_bytes);
  for (int64_t u = 0; u < units; u += group) {
    FSDPP_RETURN_IF_ERROR(fn(std::min(group, units - u), u * rep * t * hd,
                             u * t * hd, u * rep * t,
                             GroupKeys{key_lo, key_hi, u, kv}));
  }
  return absl::OkStatus();
}

// Element `offset` of a raw buffer of T.
template <typename T>
const T* At(const void* p, int64_t offset) {
  return static_cast<const T*>(p) + offset;
}
template <typename T>
T* At(void* p, int64_t offset) {
  return static_cast<T*>(p) + offset;
}

// n elements from `from` to `to` (bf16 <-> f32), split across the pool.
void CastOnPool(DType from, const void* src, DType to, void* dst, int64_t n) {
  const size_t from_size = DTypeSize(from), to_size = DTypeSize(to);
  ParallelChunks(n, [&](int64_t begin, int64_t end) {
    simd::Cast(from, static_cast<const char*>(src) + begin * from_size, to,
               static_cast<char*>(dst) + begin * to_size, end - begin);
  });
}

// A group's bf16 tensor of n elements widened into work slot `slot`.
const float* Widen(WorkSlot slot, const void* src, int64_t n) {
  Buffer<float> wide(slot, n);
  CastOnPool(DType::kBF16, src, DType::kF32, wide.data(), n);
  return wide.data();
}

// The path of a bf16 call: widened where bf16 matmuls are, as long as one
// kv head's widened work (its f32 tensor copies grow with T hd) fits the
// default budget; beyond that (long sequences) native, whose work per kv
// head is the smaller.
absl::StatusOr<Path> Bf16Path(int64_t h, int64_t kv, int64_t t, int64_t hd) {
  FSDPP_ASSIGN_OR_RETURN(const Bf16MatmulMode mode, OneDnnBf16MatmulMode());
  return mode == Bf16MatmulMode::kWidened &&
                 WorkBytesPerKvHead(Path::kWidened, h / kv, t, hd) <=
                     kBlockedAttentionWorkBytes
             ? Path::kWidened
             : Path::kBF16;
}

absl::Status NotBlocked(const char* what, DType dtype) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": dtype ", DTypeName(dtype),
                   " is not one of the blocked path's (bf16, f32)"));
}

template <typename T>
absl::Status Forward(Path path, const void* q, const void* k, const void* v,
                     int64_t b, int64_t h, int64_t kv, int64_t t, int64_t hd,
                     float scale, void* out, float* lse, const int32_t* key_lo,
                     const int32_t* key_hi, int64_t work_bytes) {
  const int64_t rep = h / kv;
  return ForEachKvGroup(
      path, b, h, kv, t, hd, work_bytes, key_lo, key_hi,
      [&](int64_t n, int64_t qo, int64_t ko, int64_t lo,
          const GroupKeys& keys) -> absl::Status {
        if (path != Path::kWidened) {
          return ForwardGroup<T, T>(At<T>(q, qo), At<T>(k, ko), At<T>(v, ko), n,
                                    rep, 1, t, hd, scale, keys, At<T>(out, qo),
                                    lse + lo);
        }
        const int64_t nq = n * rep * t * hd, nk = n * t * hd;
        Buffer<float> out32(kWideOut, nq);
        FSDPP_RETURN_IF_ERROR((ForwardGroup<float, Bf16InF32>(
            Widen(kWideQ, At<T>(q, qo), nq), Widen(kWideK, At<T>(k, ko), nk),
            Widen(kWideV, At<T>(v, ko), nk), n, rep, 1, t, hd, scale, keys,
            out32.data(), lse + lo)));
        CastOnPool(DType::kF32, out32.data(), DType::kBF16, At<T>(out, qo), nq);
        return absl::OkStatus();
      });
}

template <typename T>
absl::Status Backward(Path path, const void* q, const void* k, const void* v,
                      const void* out, const float* lse, const void* dout,
                      int64_t b, int64_t h, int64_t kv, int64_t t, int64_t hd,
                      float scale, void* dq, void* dk, void* dv,
                      const int32_t* key_lo, const int32_t* key_hi,
                      int64_t work_bytes) {
  const int64_t rep = h / kv;
  return ForEachKvGroup(
      path, b, h, kv, t, hd, work_bytes, key_lo, key_hi,
      [&](int64_t n, int64_t qo, int64_t ko, int64_t lo,
          const GroupKeys& keys) -> absl::Status {
        const int64_t nq = n * rep * t * hd, nk = n * t * hd;
        // From out and dout as they are (widened, the same values).
        const float* delta =
            RowDots<T>(At<T>(out, qo), At<T>(dout, qo), n * rep * t, hd);
        if (path != Path::kWidened) {
          return BackwardGroup<T, T>(At<T>(q, qo), At<T>(k, ko), At<T>(v, ko),
                                     delta, lse + lo, At<T>(dout, qo), n, rep,
                                     1, t, hd, scale, keys, At<T>(dq, qo),
                                     At<T>(dk, ko), At<T>(dv, ko));
        }
        Buffer<float> dq32(kWideDq, nq), dk32(kWideDk, nk), dv32(kWideDv, nk);
        FSDPP_RETURN_IF_ERROR((BackwardGroup<float, Bf16InF32>(
            Widen(kWideQ, At<T>(q, qo), nq), Widen(kWideK, At<T>(k, ko), nk),
            Widen(kWideV, At<T>(v, ko), nk), delta, lse + lo,
            Widen(kWideDout, At<T>(dout, qo), nq), n, rep, 1, t, hd, scale,
            keys, dq32.data(), dk32.data(), dv32.data())));
        CastOnPool(DType::kF32, dq32.data(), DType::kBF16, At<T>(dq, qo), nq);
        CastOnPool(DType::kF32, dk32.data(), DType::kBF16, At<T>(dk, ko), nk);
        CastOnPool(DType::kF32, dv32.data(), DType::kBF16, At<T>(dv, ko), nk);
        return absl::OkStatus();
      });
}

}  // namespace blocked_internal

absl::StatusOr<bool> BlockedAttentionWidensBf16(int64_t h, int64_t kv,
                                                int64_t t, int64_t hd) {
  if (h <= 0 || kv <= 0 || h % kv != 0 || t <= 0 || hd <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BlockedAttentionWidensBf16: h ", h, ", kv ", kv, ", t ",
                     t, ", hd ", hd, " (all > 0, h a multiple of kv)"));
  }
  FSDPP_ASSIGN_OR_RETURN(const blocked_internal::Path path,
                         blocked_internal::Bf16Path(h, kv, t, hd));
  return path == blocked_internal::Path::kWidened;
}

absl::Status BlockedAttentionForward(DType dtype, const void* q, const void* k,
                                     const void* v, int64_t b, int64_t h,
                                     int64_t kv, int64_t t, int64_t hd,
                                     float scale, void* out, float* lse,
                                     const int32_t* key_lo,
                                     const int32_t* key_hi,
                                     int64_t work_bytes) {
  using namespace blocked_internal;  // NOLINT
  switch (dtype) {
    case DType::kBF16: {
      FSDPP_ASSIGN_OR_RETURN(const Path path, Bf16Path(h, kv, t, hd));
      return Forward<BFloat16>(path, q, k, v, b, h, kv, t, hd, scale, out, lse,
                               key_lo, key_hi, work_bytes);
    }
    case DType::kF32:
      return Forward<float>(Path::kF32, q, k, v, b, h, kv, t, hd, scale, out,
                            lse, key_lo, key_hi, work_bytes);
    default:
      return NotBlocked("BlockedAttentionForward", dtype);
  }
}

absl::Status BlockedAttentionBackward(
    DType dtype, const void* q, const void* k, const void* v, const void* out,
    const float* lse, const void* dout, int64_t b, int64_t h, int64_t kv,
    int64_t t, int64_t hd, float scale, void* dq, void* dk, void* dv,
    const int32_t* key_lo, const int32_t* key_hi, int64_t work_bytes) {
  using namespace blocked_internal;  // NOLINT
  switch (dtype) {
    case DType::kBF16: {
      FSDPP_ASSIGN_OR_RETURN(const Path path, Bf16Path(h, kv, t, hd));
      return Backward<BFloat16>(path, q, k, v, out, lse, dout, b, h, kv, t, hd,
                                scale, dq, dk, dv, key_lo, key_hi, work_bytes);
    }
    case DType::kF32:
      return Backward<float>(Path::kF32, q, k, v, out, lse, dout, b, h, kv, t,
                             hd, scale, dq, dk, dv, key_lo, key_hi, work_bytes);
    default:
      return NotBlocked("BlockedAttentionBackward", dtype);
  }
}

}  // namespace cpu
}  // namespace fsdpp
#endif  // HWY_ONCE
