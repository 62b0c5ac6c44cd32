// CausalAttention / CausalAttentionBackward (the fused, flash-style kernels)
// against a plain double-precision reference that forms the whole masked
// [T, T] probability matrix, against the scalar row functions of
// tensor/kernels/attention.h (the CUDA math), and against central finite
// differences; on odd sizes (T not a multiple of either tile, head dims not
// a multiple of the vector width, T = 1), grouped-query heads and every
// float dtype, with and without document masks; plus DocumentMask, Rope at
// a document's positions and the argument checks.
#include "tensor/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/trace.h"
#include "gtest/gtest.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/kernels/rope.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using testing_util::AllClose;
using testing_util::GatherRows;
using testing_util::RandomTensor;
using testing_util::RelTol;
using testing_util::Values;

struct Dims {
  int64_t b, h, kv, t, hd;
};

// What the double reference computes.
struct Expected {
  std::vector<double> out, lse, dq, dk, dv;
};

// The rows' key ranges (ops.h KeyRange) as host arrays [B, T]; empty: the
// causal defaults (lo 0, hi i + 1).
struct Mask {
  std::vector<int32_t> lo, hi;
  int64_t Lo(const Dims& d, int64_t bi, int64_t i) const {
    return lo.empty() ? 0 : std::clamp<int64_t>(lo[bi * d.t + i], 0, d.t);
  }
  int64_t Hi(const Dims& d, int64_t bi, int64_t i) const {
    return hi.empty() ? i + 1 : std::clamp<int64_t>(hi[bi * d.t + i], 0, d.t);
  }
};

// Causal; document masks (lo only); arbitrary ranges (lo and hi: keys after
// the query, empty rows, out-of-range values that clamp), as context
// parallelism's blocks need.
enum class MaskKind { kCausal, kDocuments, kRanges };

uint64_t NextRandom(uint64_t* x) {
  *x = *x * 6364136223846793005ull + 1442695040888963407ull;
  return *x >> 33;
}

// Documents: packed documents of random lengths (1 to 2.5 key tiles, so
// that some cross the CPU kernels' tiles and blocks and some are single
// tokens), a new one at each batch row's start. Ranges: per row, one row in
// 8 empty, the others [lo, hi) anywhere in [-2, T + 2).
Mask MakeMask(const Dims& d, MaskKind kind, uint64_t seed) {
  Mask m;
  if (kind == MaskKind::kCausal) return m;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  m.lo.resize(d.b * d.t);
  if (kind == MaskKind::kDocuments) {
    for (int64_t bi = 0; bi < d.b; ++bi) {
      int64_t start = 0, left = 0;
      for (int64_t i = 0; i < d.t; ++i) {
        if (left == 0) {
          left = 1 + static_cast<int64_t>(NextRandom(&x) % 160);
          start = i;
        }
        --left;
        m.lo[bi * d.t + i] = static_cast<int32_t>(start);
      }
    }
    return m;
  }
  m.hi.resize(d.b * d.t);
  const uint64_t span = static_cast<uint64_t>(d.t) + 4;
  for (int64_t r = 0; r < d.b * d.t; ++r) {
    int64_t a = static_cast<int64_t>(NextRandom(&x) % span) - 2;
    int64_t b = static_cast<int64_t>(NextRandom(&x) % span) - 2;
    if (a > b) std::swap(a, b);
    if (NextRandom(&x) % 8 == 0) std::swap(a, b);  // empty (or one-key) row
    m.lo[r] = static_cast<int32_t>(a);
    m.hi[r] = static_cast<int32_t>(b);
  }
  return m;
}

// The mask's tensors and the KeyRange over them.
struct MaskTensors {
  Tensor lo, hi;
  explicit MaskTensors(const Dims& d, const Mask& m) {
    for (auto [dst, src] : {std::pair{&lo, &m.lo}, std::pair{&hi, &m.hi}}) {
      if (src->empty()) continue;
      *dst = *Tensor::Empty({d.b, d.t}, DType::kI32, Device::Cpu());
      std::copy(src->begin(), src->end(), dst->data<int32_t>());
    }
  }
  KeyRange range() const {
    return {lo.defined() ? &lo : nullptr, hi.defined() ? &hi : nullptr};
  }
};

// Materialises the [T, T] probabilities per head, in double (a row with no
// key: out 0, lse -inf).
Expected Reference(const Dims& d, const std::vector<double>& q,
                   const std::vector<double>& k, const std::vector<double>& v,
                   const std::vector<double>& dout, double scale,
                   const Mask& mask = {}) {
  Expected e;
  e.out.assign(d.b * d.h * d.t * d.hd, 0.0);
  e.lse.assign(d.b * d.h * d.t, 0.0);
  e.dq.assign(e.out.size(), 0.0);
  e.dk.assign(d.b * d.kv * d.t * d.hd, 0.0);
  e.dv.assign(e.dk.size(), 0.0);
  const int64_t rep = d.h / d.kv, hd = d.hd, t = d.t;
  for (int64_t bi = 0; bi < d.b; ++bi) {
    for (int64_t hi = 0; hi < d.h; ++hi) {
      const int64_t qh = (bi * d.h + hi) * t * hd;
      const int64_t kh = (bi * d.kv + hi / rep) * t * hd;
      for (int64_t i = 0; i < t; ++i) {
        const int64_t lo = mask.Lo(d, bi, i), end = mask.Hi(d, bi, i);
        const int64_t row = qh + i * hd;
        if (lo >= end) {
          e.lse[(bi * d.h + hi) * t + i] = -INFINITY;
          continue;
        }
        std::vector<double> s(t, 0.0);
        double max = -INFINITY;
        for (int64_t j = lo; j < end; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < hd; ++x) {
            dot += q[row + x] * k[kh + j * hd + x];
          }
          s[j] = scale * dot;
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (int64_t j = lo; j < end; ++j) sum += (s[j] = std::exp(s[j] - max));
        for (double& x : s) x /= sum;  // probabilities (0 outside the range)
        e.lse[(bi * d.h + hi) * t + i] = max + std::log(sum);
        for (int64_t j = lo; j < end; ++j) {
          for (int64_t x = 0; x < hd; ++x) {
            e.out[row + x] += s[j] * v[kh + j * hd + x];
          }
        }
        double delta = 0;
        for (int64_t x = 0; x < hd; ++x) {
          delta += dout[row + x] * e.out[row + x];
        }
        for (int64_t j = lo; j < end; ++j) {
          double dp = 0;
          for (int64_t x = 0; x < hd; ++x) {
            dp += dout[row + x] * v[kh + j * hd + x];
          }
          const double ds = s[j] * (dp - delta);
          for (int64_t x = 0; x < hd; ++x) {
            e.dq[row + x] += scale * ds * k[kh + j * hd + x];
            e.dk[kh + j * hd + x] += scale * ds * q[row + x];
            e.dv[kh + j * hd + x] += s[j] * dout[row + x];
          }
        }
      }
    }
  }
  return e;
}

struct Inputs {
  Tensor q, k, v, dout;
};

Inputs MakeInputs(const Dims& d, DType dtype, uint64_t seed) {
  return {RandomTensor({d.b, d.h, d.t, d.hd}, dtype, seed, -2.0f, 2.0f),
          RandomTensor({d.b, d.kv, d.t, d.hd}, dtype, seed + 1, -2.0f, 2.0f),
          RandomTensor({d.b, d.kv, d.t, d.hd}, dtype, seed + 2),
          RandomTensor({d.b, d.h, d.t, d.hd}, dtype, seed + 3)};
}

Tensor Empty(const Shape& shape, DType dtype) {
  return *Tensor::Empty(shape, dtype, Device::Cpu());
}

struct Results {
  Tensor out, lse, dq, dk, dv;
};

Results RunAttention(const Inputs& in, float scale, const KeyRange& keys = {}) {
  const Shape& qs = in.q.shape();
  const DType dt = in.q.dtype();
  Results r{Empty(qs, dt), Empty({qs[0], qs[1], qs[2]}, DType::kF32),
            Empty(qs, dt), Empty(in.k.shape(), dt), Empty(in.k.shape(), dt)};
  EXPECT_TRUE(
      CausalAttention(in.q, in.k, in.v, scale, &r.out, &r.lse, keys).ok());
  EXPECT_TRUE(CausalAttentionBackward(in.q, in.k, in.v, r.out, r.lse, in.dout,
                                      scale, &r.dq, &r.dk, &r.dv, keys)
                  .ok());
  return r;
}

// The same through the Highway kernels of cpu/attention.h directly (the
// backend's path for f16; bf16 and f32 take the blocked one).
Results RunSimdKernels(const Inputs& in, float scale, const Mask& mask) {
  const Shape& qs = in.q.shape();
  const Dims d{qs[0], qs[1], in.k.shape()[1], qs[2], qs[3]};
  const DType dt = in.q.dtype();
  const MaskTensors masks(d, mask);
  const int32_t* lo = mask.lo.empty() ? nullptr : masks.lo.data<int32_t>();
  const int32_t* hi = mask.hi.empty() ? nullptr : masks.hi.data<int32_t>();
  Results r{Empty(qs, dt), Empty({qs[0], qs[1], qs[2]}, DType::kF32),
            Empty(qs, dt), Empty(in.k.shape(), dt), Empty(in.k.shape(), dt)};
  cpu::CausalAttentionForward(dt, in.q.raw_data(), in.k.raw_data(),
                              in.v.raw_data(), d.b, d.h, d.kv, d.t, d.hd, scale,
                              r.out.raw_data(), r.lse.data<float>(), lo, hi);
  cpu::CausalAttentionBackward(
      dt, in.q.raw_data(), in.k.raw_data(), in.v.raw_data(), r.out.raw_data(),
      r.lse.data<float>(), in.dout.raw_data(), d.b, d.h, d.kv, d.t, d.hd, scale,
      r.dq.raw_data(), r.dk.raw_data(), r.dv.raw_data(), lo, hi);
  return r;
}

// (shape, dtype, mask)
class CausalAttentionTest
    : public ::testing::TestWithParam<std::tuple<Dims, DType, MaskKind>> {};

// Through the ops (the backend's path for the dtype) and through the
// Highway kernels directly.
TEST_P(CausalAttentionTest, MatchesTheDoubleReference) {
  const auto& [d, dtype, kind] = GetParam();
  const Inputs in = MakeInputs(d, dtype, 11);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  const Mask mask = MakeMask(d, kind, 3);
  const MaskTensors masks(d, mask);
  // dout is the reference's too, but the forward output it sees is the
  // kernel's own (D_i = dout_i . out_i): use the exact out for both.
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale, mask);
  // f32: accumulation over T keys and hd dims; 16-bit: one output rounding
  // plus the backward's use of the rounded forward output.
  const double tol = dtype == DType::kF32 ? 2e-5 : 4 * RelTol(dtype);
  for (bool simd : {false, true}) {
    SCOPED_TRACE(simd ? "Highway kernels" : "ops");
    const Results got = simd ? RunSimdKernels(in, scale, mask)
                             : RunAttention(in, scale, masks.range());
    EXPECT_TRUE(AllClose(Values(got.out), e.out, tol, tol)) << "out";
    EXPECT_TRUE(AllClose(Values(got.lse), e.lse, 1e-5, 1e-5)) << "lse";
    EXPECT_TRUE(AllClose(Values(got.dq), e.dq, tol, tol)) << "dq";
    EXPECT_TRUE(AllClose(Values(got.dk), e.dk, tol, tol)) << "dk";
    EXPECT_TRUE(AllClose(Values(got.dv), e.dv, tol, tol)) << "dv";
  }
}

// The blocked path (bf16, f32) with a work budget so small that every kv
// head is a group of its own (and 3 query blocks at T = 300): the same
// results as the double reference, and as one group; under every mask kind
// (the groups' kv heads map back to their batch rows' ranges).
class BlockedAttentionTest
    : public ::testing::TestWithParam<std::tuple<DType, MaskKind>> {};

void CheckKvHeadGroups(DType dtype, MaskKind kind) {
  const Dims d{2, 4, 2, 300, 16};
  const Inputs in = MakeInputs(d, dtype, 5);
  const float scale = 0.25f;
  const Mask mask = MakeMask(d, kind, 8);
  const MaskTensors masks(d, mask);
  const int32_t* lo = mask.lo.empty() ? nullptr : masks.lo.data<int32_t>();
  const int32_t* hi = mask.hi.empty() ? nullptr : masks.hi.data<int32_t>();
  const Results whole = RunAttention(in, scale, masks.range());
  Results grouped{Empty(in.q.shape(), dtype),
                  Empty({d.b, d.h, d.t}, DType::kF32),
                  Empty(in.q.shape(), dtype), Empty(in.k.shape(), dtype),
                  Empty(in.k.shape(), dtype)};
  ASSERT_TRUE(cpu::BlockedAttentionForward(
                  dtype, in.q.raw_data(), in.k.raw_data(), in.v.raw_data(), d.b,
                  d.h, d.kv, d.t, d.hd, scale, grouped.out.raw_data(),
                  grouped.lse.data<float>(), lo, hi, /*work_bytes=*/1)
                  .ok());
  ASSERT_TRUE(cpu::BlockedAttentionBackward(
                  dtype, in.q.raw_data(), in.k.raw_data(), in.v.raw_data(),
                  grouped.out.raw_data(), grouped.lse.data<float>(),
                  in.dout.raw_data(), d.b, d.h, d.kv, d.t, d.hd, scale,
                  grouped.dq.raw_data(), grouped.dk.raw_data(),
                  grouped.dv.raw_data(), lo, hi, /*work_bytes=*/1)
                  .ok());
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale, mask);
  const double tol = dtype == DType::kF32 ? 2e-5 : 4 * RelTol(dtype);
  EXPECT_TRUE(AllClose(Values(grouped.out), e.out, tol, tol)) << "out";
  EXPECT_TRUE(AllClose(Values(grouped.lse), e.lse, 1e-5, 1e-5)) << "lse";
  EXPECT_TRUE(AllClose(Values(grouped.dq), e.dq, tol, tol)) << "dq";
  EXPECT_TRUE(AllClose(Values(grouped.dk), e.dk, tol, tol)) << "dk";
  EXPECT_TRUE(AllClose(Values(grouped.dv), e.dv, tol, tol)) << "dv";
  // Per head the same matmuls and row passes: equal up to oneDNN's choice
  // of kernel for another batch count (one rounding of the dtype).
  const double same = dtype == DType::kF32 ? 1e-5 : 2 * RelTol(dtype);
  for (const auto& [a, b] :
       {std::pair{&grouped.out, &whole.out}, std::pair{&grouped.dq, &whole.dq},
        std::pair{&grouped.dk, &whole.dk}, std::pair{&grouped.dv, &whole.dv}}) {
    EXPECT_TRUE(AllClose(Values(*a), Values(*b), same, same));
  }
}

// bf16 under both of its paths (native and widened, whichever this CPU
// picks by itself).
TEST_P(BlockedAttentionTest, KvHeadGroupsGiveTheSameResults) {
  const auto& [dtype, kind] = GetParam();
  if (dtype != DType::kBF16) {
    CheckKvHeadGroups(dtype, kind);
    return;
  }
  for (const cpu::Bf16MatmulMode mode :
       {cpu::Bf16MatmulMode::kNative, cpu::Bf16MatmulMode::kWidened}) {
    SCOPED_TRACE(mode == cpu::Bf16MatmulMode::kNative ? "native" : "widened");
    cpu::SetBf16MatmulModeForTesting(&mode);
    CheckKvHeadGroups(dtype, kind);
  }
  cpu::SetBf16MatmulModeForTesting(nullptr);
}

TEST(BlockedAttentionTest, OtherDtypesAreRejected) {
  const Dims d{1, 1, 1, 4, 8};
  const Inputs in = MakeInputs(d, DType::kF16, 3);
  Tensor out = Empty(in.q.shape(), DType::kF16);
  Tensor lse = Empty({1, 1, 4}, DType::kF32);
  const absl::Status s = cpu::BlockedAttentionForward(
      DType::kF16, in.q.raw_data(), in.k.raw_data(), in.v.raw_data(), d.b, d.h,
      d.kv, d.t, d.hd, 1.0f, out.raw_data(), lse.data<float>());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("f16"), std::string::npos) << s;
}

// The op profile splits the blocked attention (bf16, f32) into its block
// matmuls (StridedMatmul, category matmul: per 128-row block two forward,
// five backward) and the rest (the attention's self time).
TEST(BlockedAttentionTest, ProfileShowsTheBlockMatmulsAsMatmul) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Dims d{1, 2, 2, 300, 16};  // three blocks of rows
    const Inputs in = MakeInputs(d, dtype, 7);
    OpProfile profile;
    {
      ScopedOpProfile scoped(&profile);
      RunAttention(in, 0.25f);
    }
    std::map<std::string, OpProfile::Row> rows;
    for (const OpProfile::Row& r : profile.Rows()) rows[r.name] = r;
    ASSERT_TRUE(rows.count("StridedMatmul"));
    EXPECT_EQ(rows["StridedMatmul"].category, "matmul");
    EXPECT_EQ(rows["StridedMatmul"].calls, 3 * (2 + 5));
    for (const char* op : {"CausalAttention", "CausalAttentionBackward"}) {
      ASSERT_TRUE(rows.count(op)) << op;
      EXPECT_EQ(rows[op].category, "attention") << op;
      EXPECT_LT(rows[op].self_ns, rows[op].total_ns) << op;
    }
  }
}

// The share of the elements of two bf16 tensors of one shape whose bits
// differ.
double DifferingShare(const Tensor& a, const Tensor& b) {
  const int64_t n = a.numel();
  int64_t differing = 0;
  for (int64_t i = 0; i < n; ++i) {
    differing += a.data<BFloat16>()[i].bits != b.data<BFloat16>()[i].bits;
  }
  return n == 0 ? 0.0 : static_cast<double>(differing) / n;
}

// bf16 where bf16 matmuls are widened (onednn_matmul.h) runs the block
// matmuls on f32 copies of a group's tensors, P and dS rounded to bf16
// values as the native path rounds them: both match the double reference,
// and they are the same products and roundings summed in another order, so
// all but a few elements come out the same bits (measured: at most 0.6%
// differ; left unrounded, P and dS move 33-48% of them).
class WidenedBf16AttentionTest : public ::testing::TestWithParam<MaskKind> {
 protected:
  void TearDown() override { cpu::SetBf16MatmulModeForTesting(nullptr); }
};

TEST_P(WidenedBf16AttentionTest, IsTheNativePathSummedInAnotherOrder) {
  const MaskKind kind = GetParam();
  for (const Dims& d : {Dims{2, 4, 2, 300, 16}, Dims{1, 3, 3, 129, 64}}) {
    SCOPED_TRACE(testing::Message() << "T " << d.t << " hd " << d.hd);
    const Inputs in = MakeInputs(d, DType::kBF16, 9);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
    const Mask mask = MakeMask(d, kind, 4);
    const MaskTensors masks(d, mask);
    Results got[2];
    const cpu::Bf16MatmulMode modes[2] = {cpu::Bf16MatmulMode::kNative,
                                          cpu::Bf16MatmulMode::kWidened};
    for (int i = 0; i < 2; ++i) {
      cpu::SetBf16MatmulModeForTesting(&modes[i]);
      got[i] = RunAttention(in, scale, masks.range());
    }
    cpu::SetBf16MatmulModeForTesting(nullptr);
    const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                                 Values(in.dout), scale, mask);
    const double tol = 4 * RelTol(DType::kBF16);
    for (const Results& r : got) {
      EXPECT_TRUE(AllClose(Values(r.out), e.out, tol, tol)) << "out";
      EXPECT_TRUE(AllClose(Values(r.lse), e.lse, 1e-5, 1e-5)) << "lse";
      EXPECT_TRUE(AllClose(Values(r.dq), e.dq, tol, tol)) << "dq";
      EXPECT_TRUE(AllClose(Values(r.dk), e.dk, tol, tol)) << "dk";
      EXPECT_TRUE(AllClose(Values(r.dv), e.dv, tol, tol)) << "dv";
    }
    EXPECT_TRUE(AllClose(Values(got[0].lse), Values(got[1].lse), 1e-6, 1e-6));
    for (const auto& [name, a, b] :
         {std::tuple{"out", &got[0].out, &got[1].out},
          std::tuple{"dq", &got[0].dq, &got[1].dq},
          std::tuple{"dk", &got[0].dk, &got[1].dk},
          std::tuple{"dv", &got[0].dv, &got[1].dv}}) {
      EXPECT_LE(DifferingShare(*a, *b), 0.02) << name;
    }
  }
}

// One kv head's widened work grows with T hd (f32 copies of its tensors
// beside the score buffers): past kBlockedAttentionWorkBytes the call runs
// native, as a forced widened mode then shows (the same bits as native).
TEST(WidenedBf16AttentionLimitTest, LongSequencesRunNative) {
  const cpu::Bf16MatmulMode widened = cpu::Bf16MatmulMode::kWidened;
  const cpu::Bf16MatmulMode native = cpu::Bf16MatmulMode::kNative;
  cpu::SetBf16MatmulModeForTesting(&widened);
  // hd 256, one head: 2048 bytes of scores per key (16 a score, 128 rows)
  // and 8 f32 tensors of T x 256: 10240 T bytes, over 64 MiB past T = 6553.
  EXPECT_TRUE(*cpu::BlockedAttentionWidensBf16(12, 12, 1024, 64));
  EXPECT_TRUE(*cpu::BlockedAttentionWidensBf16(1, 1, 6544, 256));
  EXPECT_FALSE(*cpu::BlockedAttentionWidensBf16(1, 1, 6576, 256));
  EXPECT_FALSE(*cpu::BlockedAttentionWidensBf16(4, 1, 6544, 256));
  EXPECT_EQ(cpu::BlockedAttentionWidensBf16(3, 2, 16, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  cpu::SetBf16MatmulModeForTesting(&native);
  EXPECT_FALSE(*cpu::BlockedAttentionWidensBf16(12, 12, 1024, 64));

  const Dims d{1, 1, 1, 6576, 256};
  const Inputs in = MakeInputs(d, DType::kBF16, 21);
  Tensor out[2], lse[2];
  for (int i = 0; i < 2; ++i) {
    cpu::SetBf16MatmulModeForTesting(i == 0 ? &native : &widened);
    out[i] = Empty(in.q.shape(), DType::kBF16);
    lse[i] = Empty({1, 1, d.t}, DType::kF32);
    ASSERT_TRUE(
        CausalAttention(in.q, in.k, in.v, 0.0625f, &out[i], &lse[i]).ok());
  }
  cpu::SetBf16MatmulModeForTesting(nullptr);
  EXPECT_EQ(DifferingShare(out[0], out[1]), 0.0);
  EXPECT_EQ(Values(lse[0]), Values(lse[1]));
}

INSTANTIATE_TEST_SUITE_P(Masks, WidenedBf16AttentionTest,
                         ::testing::Values(MaskKind::kCausal,
                                           MaskKind::kDocuments,
                                           MaskKind::kRanges));

INSTANTIATE_TEST_SUITE_P(
    Masks, BlockedAttentionTest,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF32),
                       ::testing::Values(MaskKind::kCausal,
                                         MaskKind::kDocuments,
                                         MaskKind::kRanges)));

// The backend's f32 path (blocked, through oneDNN) and the Highway kernels
// against the scalar row functions the CUDA kernels run.
TEST_P(CausalAttentionTest, MatchesTheScalarRowFunctions) {
  const auto& [d, dtype, kind] = GetParam();
  if (dtype != DType::kF32) GTEST_SKIP() << "f32 only (same math)";
  const Inputs in = MakeInputs(d, dtype, 29);
  const float scale = 0.3f;
  const Mask mask = MakeMask(d, kind, 4);
  const MaskTensors masks(d, mask);
  for (bool simd : {false, true}) {
    SCOPED_TRACE(simd ? "Highway kernels" : "ops");
    const Results got = simd ? RunSimdKernels(in, scale, mask)
                             : RunAttention(in, scale, masks.range());
    const float* q = in.q.data<float>();
    const float* k = in.k.data<float>();
    const float* v = in.v.data<float>();
    const float* dout = in.dout.data<float>();
    const float* out = got.out.data<float>();
    const float* lse = got.lse.data<float>();
    const int64_t rep = d.h / d.kv, hd = d.hd, t = d.t;
    std::vector<float> out_ref(d.b * d.h * t * hd), lse_ref(d.b * d.h * t),
        dq_ref(out_ref.size()), dk_ref(d.b * d.kv * t * hd, 0.0f),
        dv_ref(dk_ref.size(), 0.0f), acc(hd), acc2(hd);
    for (int64_t head = 0; head < d.b * d.h; ++head) {
      const int64_t kvh = (head / d.h) * d.kv + (head % d.h) / rep;
      for (int64_t i = 0; i < t; ++i) {
        const int64_t row = head * t + i;
        // A row's keys are a run [lo, hi): the row functions see them as a
        // sequence of their own.
        const int64_t lo = mask.Lo(d, head / d.h, i);
        const int64_t count =
            std::max<int64_t>(0, mask.Hi(d, head / d.h, i) - lo);
        const float* kf = k + (kvh * t + lo) * hd;
        const float* vf = v + (kvh * t + lo) * hd;
        kernels::CausalAttentionRow(q + row * hd, kf, vf, count, hd, scale,
                                    acc.data(), &out_ref[row * hd],
                                    &lse_ref[row]);
        const float delta =
            kernels::DotF32(dout + row * hd, out + row * hd, hd);
        kernels::CausalAttentionDqRow(q + row * hd, kf, vf, dout + row * hd,
                                      delta, lse[row], count, hd, scale,
                                      acc.data(), &dq_ref[row * hd]);
        for (int64_t j = lo; j < lo + count; ++j) {
          kernels::CausalAttentionDkDvTerm(
              q + row * hd, k + (kvh * t + j) * hd, v + (kvh * t + j) * hd,
              dout + row * hd, delta, lse[row], hd, scale,
              &dk_ref[(kvh * t + j) * hd], &dv_ref[(kvh * t + j) * hd]);
        }
      }
    }
    auto doubles = [](const std::vector<float>& f) {
      return std::vector<double>(f.begin(), f.end());
    };
    // Two f32 evaluations in different orders (tiles and FMA against one key
    // at a time): sums of up to T terms of size ~1, so an absolute 1e-5. lse
    // = max + log(sum) carries the rounding of the largest score (hd products
    // of size ~1): the Highway kernels sum a score as the row functions do,
    // oneDNN in its own order (1e-5 as against the double reference).
    const double lse_tol = simd ? 1e-6 : 1e-5;
    EXPECT_TRUE(AllClose(Values(got.out), doubles(out_ref), 1e-5, 1e-5));
    EXPECT_TRUE(AllClose(Values(got.lse), doubles(lse_ref), lse_tol, lse_tol));
    EXPECT_TRUE(AllClose(Values(got.dq), doubles(dq_ref), 1e-5, 1e-5));
    EXPECT_TRUE(AllClose(Values(got.dk), doubles(dk_ref), 1e-5, 1e-5));
    EXPECT_TRUE(AllClose(Values(got.dv), doubles(dv_ref), 1e-5, 1e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CausalAttentionTest,
    ::testing::Combine(
        ::testing::Values(Dims{1, 1, 1, 1, 8},      // one token
                          Dims{2, 4, 2, 37, 12},    // odd T and hd, GQA 2
                          Dims{1, 2, 1, 130, 64},   // 3 key tiles, tail, GQA
                          Dims{2, 3, 3, 64, 80},    // whole tiles, hd 80
                          Dims{1, 6, 2, 97, 16},    // GQA 3
                          Dims{2, 2, 1, 333, 16}),  // many documents
        ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
        ::testing::Values(MaskKind::kCausal, MaskKind::kDocuments,
                          MaskKind::kRanges)));

// d(sum(out * w))/dq, dk, dv against central differences in f32 (the loss
// is accumulated in double): causal, two documents ([0, 4) and [4, 9)), and
// arbitrary ranges (keys after the query, an empty row).
class CausalAttentionGradientTest : public ::testing::TestWithParam<MaskKind> {
};

TEST_P(CausalAttentionGradientTest, MatchesFiniteDifferences) {
  const Dims d{1, 2, 1, 9, 6};
  Inputs in = MakeInputs(d, DType::kF32, 5);
  const float scale = 0.5f;
  Mask mask;
  if (GetParam() == MaskKind::kDocuments) mask.lo = {0, 0, 0, 0, 4, 4, 4, 4, 4};
  if (GetParam() == MaskKind::kRanges) {
    mask.lo = {0, 3, 1, 5, 5, 0, 2, 8, 4};
    mask.hi = {9, 5, 2, 5, 9, 3, 7, 9, 6};  // row 3 has no key
  }
  const MaskTensors masks(d, mask);
  const KeyRange ks = masks.range();
  const Results got = RunAttention(in, scale, ks);
  const std::vector<double> w = Values(in.dout);
  auto loss = [&]() {
    Tensor out = Empty(in.q.shape(), DType::kF32);
    Tensor lse = Empty({d.b, d.h, d.t}, DType::kF32);
    EXPECT_TRUE(CausalAttention(in.q, in.k, in.v, scale, &out, &lse, ks).ok());
    const std::vector<double> o = Values(out);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * w[i];
    return l;
  };
  const float eps = 1e-2f;
  for (auto [input, grad] :
       {std::pair{&in.q, &got.dq}, std::pair{&in.k, &got.dk},
        std::pair{&in.v, &got.dv}}) {
    const std::vector<double> analytic = Values(*grad);
    float* x = input->data<float>();
    for (int64_t i = 0; i < input->numel(); ++i) {
      const float saved = x[i];
      x[i] = saved + eps;
      const double plus = loss();
      x[i] = saved - eps;
      const double minus = loss();
      x[i] = saved;
      EXPECT_NEAR(analytic[i], (plus - minus) / (2 * eps), 2e-3) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Masks, CausalAttentionGradientTest,
                         ::testing::Values(MaskKind::kCausal,
                                           MaskKind::kDocuments,
                                           MaskKind::kRanges));

// The attention of the same queries over two disjoint key ranges, merged
// (MergeAttention, both orders), equals the attention over their union;
// a side with no key leaves the other as it is.
TEST(MergeAttentionTest, PartsMergeIntoTheWhole) {
  const Dims d{2, 3, 3, 70, 16};
  const Inputs in = MakeInputs(d, DType::kF32, 61);
  const float scale = 0.25f;
  const Results whole = RunAttention(in, scale);  // causal: keys [0, i]
  Mask first, second;  // keys [0, i / 2) and [i / 2, i]
  for (int64_t bi = 0; bi < d.b; ++bi) {
    for (int64_t i = 0; i < d.t; ++i) {
      first.lo.push_back(0);
      first.hi.push_back(static_cast<int32_t>(i / 2));  // empty for i < 2
      second.lo.push_back(static_cast<int32_t>(i / 2));
      second.hi.push_back(static_cast<int32_t>(i + 1));
    }
  }
  const MaskTensors a_masks(d, first), b_masks(d, second);
  for (bool swap : {false, true}) {
    Results a = RunAttention(in, scale, a_masks.range());
    Results b = RunAttention(in, scale, b_masks.range());
    if (swap) std::swap(a, b);
    ASSERT_TRUE(MergeAttention(b.out, b.lse, &a.out, &a.lse).ok());
    EXPECT_TRUE(AllClose(Values(a.out), Values(whole.out), 1e-6, 1e-6));
    EXPECT_TRUE(AllClose(Values(a.lse), Values(whole.lse), 1e-6, 1e-6));
  }
  Tensor lse = Empty({d.b, d.h, d.t}, DType::kF32);
  const absl::Status s =
      MergeAttention(whole.out, lse, &lse, &lse);  // lse as out: wrong shape
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

// Context parallelism's ring attention, its math on one process: the
// sequence in 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r (the
// causal load balance); each rank's queries against every rank's keys and
// values in ring order, one CausalAttention call per step with the key
// ranges of the global positions (and of the documents), merged with
// MergeAttention; the backward per step with the merged out and lse, dq
// summed over the steps and each step's dk, dv summed into the keys'
// owner. Equal to the unsplit attention within 1e-6 (f32), forward and
// backward, at cp = 2, 3, 4, with and without document masks.
TEST(RingAttentionMathTest, EqualsTheUnsplitAttention) {
  for (int cp : {2, 3, 4}) {
    for (bool documents : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "cp " << cp << " documents " << documents);
      const int64_t chunk = 24;
      const Dims d{2, 4, 2, 2 * cp * chunk, 16};
      const Inputs in = MakeInputs(d, DType::kF32, 70 + cp);
      const float scale = 0.25f;
      const Mask doc_mask =
          MakeMask(d, documents ? MaskKind::kDocuments : MaskKind::kCausal, 9);
      const MaskTensors doc_tensors(d, doc_mask);
      const Results whole = RunAttention(in, scale, doc_tensors.range());
      // Each rank's global positions, ascending.
      std::vector<std::vector<int64_t>> held(cp);
      for (int r = 0; r < cp; ++r) {
        for (int64_t c : {int64_t{r}, int64_t{2 * cp - 1 - r}}) {
          for (int64_t i = 0; i < chunk; ++i) held[r].push_back(c * chunk + i);
        }
      }
      const int64_t local = 2 * chunk;
      const Dims ld{d.b, d.h, d.kv, local, d.hd};
      std::vector<Inputs> shard(cp);
      for (int r = 0; r < cp; ++r) {
        shard[r] = {GatherRows(in.q, held[r]), GatherRows(in.k, held[r]),
                    GatherRows(in.v, held[r]), GatherRows(in.dout, held[r])};
      }
      // The key ranges of rank r's queries over rank src's keys: global
      // keys [document start, position], as indices into src's positions.
      auto ranges = [&](int r, int src) {
        Mask m;
        const std::vector<int64_t>& keys = held[src];
        for (int64_t bi = 0; bi < d.b; ++bi) {
          for (int64_t i = 0; i < local; ++i) {
            const int64_t pos = held[r][i];
            const int64_t start = doc_mask.Lo(d, bi, pos);
            m.lo.push_back(static_cast<int32_t>(
                std::lower_bound(keys.begin(), keys.end(), start) -
                keys.begin()));
            m.hi.push_back(static_cast<int32_t>(
                std::upper_bound(keys.begin(), keys.end(), pos) -
                keys.begin()));
          }
        }
        return m;
      };
      std::vector<Results> got(cp);
      for (int r = 0; r < cp; ++r) {
        const Shape qs = shard[r].q.shape(), ks = shard[r].k.shape();
        got[r] = {Empty(qs, DType::kF32), Empty({d.b, d.h, local}, DType::kF32),
                  *Tensor::Zeros(qs, DType::kF32, Device::Cpu()),
                  Empty(ks, DType::kF32), Empty(ks, DType::kF32)};
      }
      for (int r = 0; r < cp; ++r) {
        for (int step = 0; step < cp; ++step) {
          const int src = (r - step + cp) % cp;
          const MaskTensors m(ld, ranges(r, src));
          Tensor out = Empty(shard[r].q.shape(), DType::kF32);
          Tensor lse = Empty({d.b, d.h, local}, DType::kF32);
          ASSERT_TRUE(CausalAttention(shard[r].q, shard[src].k, shard[src].v,
                                      scale, &out, &lse, m.range())
                          .ok());
          if (step == 0) {
            got[r].out = out;
            got[r].lse = lse;
          } else {
            ASSERT_TRUE(
                MergeAttention(out, lse, &got[r].out, &got[r].lse).ok());
          }
        }
      }
      // Backward: dk, dv of each rank's keys summed over every rank's
      // queries (f32 accumulators here, as the ring would pass them on).
      std::vector<std::vector<double>> dk(cp), dv(cp);
      for (int r = 0; r < cp; ++r) {
        dk[r].assign(shard[r].k.numel(), 0.0);
        dv[r].assign(shard[r].k.numel(), 0.0);
      }
      for (int r = 0; r < cp; ++r) {
        std::vector<double> dq(shard[r].q.numel(), 0.0);
        for (int step = 0; step < cp; ++step) {
          const int src = (r - step + cp) % cp;
          const MaskTensors m(ld, ranges(r, src));
          Tensor dq_part = Empty(shard[r].q.shape(), DType::kF32);
          Tensor dk_part = Empty(shard[src].k.shape(), DType::kF32);
          Tensor dv_part = Empty(shard[src].k.shape(), DType::kF32);
          ASSERT_TRUE(CausalAttentionBackward(
                          shard[r].q, shard[src].k, shard[src].v, got[r].out,
                          got[r].lse, shard[r].dout, scale, &dq_part, &dk_part,
                          &dv_part, m.range())
                          .ok());
          const std::vector<double> a = Values(dq_part), b = Values(dk_part),
                                    c = Values(dv_part);
          for (size_t e = 0; e < a.size(); ++e) dq[e] += a[e];
          for (size_t e = 0; e < b.size(); ++e) dk[src][e] += b[e];
          for (size_t e = 0; e < c.size(); ++e) dv[src][e] += c[e];
        }
        const std::vector<double> want = Values(GatherRows(whole.dq, held[r]));
        EXPECT_TRUE(AllClose(dq, want, 1e-6, 1e-6)) << "dq rank " << r;
        EXPECT_TRUE(AllClose(Values(got[r].out),
                             Values(GatherRows(whole.out, held[r])), 1e-6,
                             1e-6))
            << "out rank " << r;
      }
      for (int r = 0; r < cp; ++r) {
        EXPECT_TRUE(
            AllClose(dk[r], Values(GatherRows(whole.dk, held[r])), 1e-6, 1e-6))
            << "dk rank " << r;
        EXPECT_TRUE(
            AllClose(dv[r], Values(GatherRows(whole.dv, held[r])), 1e-6, 1e-6))
            << "dv rank " << r;
      }
    }
  }
}

// DocumentMask on i32 and i64 ids: documents begin at each end-of-text id
// (7 here) and at each row's start.
TEST(DocumentMaskTest, StartsAndPositionsOfPackedDocuments) {
  for (DType dtype : {DType::kI32, DType::kI64}) {
    const Tensor ids =
        *Tensor::FromInts({2, 6}, {7, 1, 2, 7, 3, 7, 4, 5, 7, 7, 6, 1}, dtype);
    Tensor starts = Empty({2, 6}, DType::kI32);
    Tensor positions = Empty({2, 6}, DType::kI32);
    ASSERT_TRUE(DocumentMask(ids, 7, &starts, &positions).ok());
    EXPECT_EQ(Values(starts),
              (std::vector<double>{0, 0, 0, 3, 3, 5, 0, 0, 2, 3, 3, 3}));
    EXPECT_EQ(Values(positions),
              (std::vector<double>{0, 1, 2, 0, 1, 0, 0, 1, 0, 0, 1, 2}));
  }
  const Tensor ids = *Tensor::FromInts({1, 3}, {1, 2, 3}, DType::kI32);
  Tensor starts = Empty({1, 4}, DType::kI32);
  Tensor positions = Empty({1, 3}, DType::kI32);
  const absl::Status s = DocumentMask(ids, 7, &starts, &positions);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("must be i32 shaped like ids"), std::string::npos)
      << s;
}

// Rope at explicit positions: each row rotated by its own position, as
// kernels::RopeRowForward does it, and back by the inverse.
TEST(RopePositionsTest, RotatesEachRowByItsPosition) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t b = 2, n = 3, t = 5, hd = 8;
    const std::vector<float> inv_freq =
        kernels::RopeInvFreqs(10000.0f, hd, kernels::RopeScaling());
    const Tensor x = RandomTensor({b, n, t, hd}, dtype, 17);
    const Tensor pos = *Tensor::FromInts(
        {b, t}, {0, 1, 0, 1, 2, 3, 4, 0, 1 - 7, 900}, DType::kI32);
    Tensor y = RandomTensor({b, n, t, hd}, dtype, 17);
    ASSERT_TRUE(Rope(&y, inv_freq, /*inverse=*/false, &pos).ok());
    const std::vector<double> xs = Values(x), ys = Values(y);
    const std::vector<double> ps = Values(pos);
    for (int64_t r = 0; r < b * n * t; ++r) {
      const int64_t bi = r / (n * t), ti = r % t;
      // Any position >= 0 (900: beyond T); a negative one counts as 0.
      const int64_t p =
          std::max<int64_t>(static_cast<int64_t>(ps[bi * t + ti]), 0);
      std::vector<float> in(xs.begin() + r * hd, xs.begin() + (r + 1) * hd),
          want(hd);
      kernels::RopeRowForward(in.data(), p, inv_freq.data(), hd, want.data());
      for (int64_t e = 0; e < hd; ++e) {
        EXPECT_NEAR(ys[r * hd + e], want[e], 4 * RelTol(dtype))
            << r << " " << e;
      }
    }
    ASSERT_TRUE(Rope(&y, inv_freq, /*inverse=*/true, &pos).ok());
    EXPECT_TRUE(AllClose(Values(y), xs, 4 * RelTol(dtype), 4 * RelTol(dtype)));
    const Tensor bad = *Tensor::FromInts(
        {b, t + 1}, std::vector<int64_t>(b * (t + 1), 0), DType::kI32);
    EXPECT_EQ(Rope(&y, inv_freq, false, &bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(CausalAttentionErrorsTest, SaysWhatIsWrong) {
  const Tensor q = RandomTensor({1, 3, 4, 8}, DType::kF32, 1);
  const Tensor k = RandomTensor({1, 2, 4, 8}, DType::kF32, 2);
  Tensor out = Empty({1, 3, 4, 8}, DType::kF32);
  Tensor lse = Empty({1, 3, 4}, DType::kF32);
  absl::Status s = CausalAttention(q, k, k, 1.0f, &out, &lse);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("kv heads (2) must divide the query heads (3)"),
            std::string::npos)
      << s;
  const Tensor k1 = RandomTensor({1, 1, 5, 8}, DType::kF32, 3);
  s = CausalAttention(q, k1, k1, 1.0f, &out, &lse);
  EXPECT_NE(s.message().find("same B, T and hd"), std::string::npos) << s;
  const Tensor k3 = RandomTensor({1, 3, 4, 8}, DType::kF32, 4);
  Tensor bad_lse = Empty({1, 3, 4}, DType::kBF16);
  s = CausalAttention(q, k3, k3, 1.0f, &out, &bad_lse);
  EXPECT_NE(s.message().find("lse must be f32 [B, H, T]"), std::string::npos)
      << s;
  const Tensor kb = RandomTensor({1, 3, 4, 8}, DType::kBF16, 5);
  s = CausalAttention(q, kb, kb, 1.0f, &out, &lse);
  EXPECT_NE(s.message().find("dtype mismatch"), std::string::npos) << s;
  const Tensor starts = *Tensor::FromInts({1, 4}, {0, 0, 0, 0}, DType::kI64);
  s = CausalAttention(q, k3, k3, 1.0f, &out, &lse, {nullptr, &starts});
  EXPECT_NE(s.message().find("keys.hi i64[1, 4]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("must be i32 [B, T] on the device of q"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace fsdpp
