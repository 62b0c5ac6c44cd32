// CausalAttention / CausalAttentionBackward (the fused, flash-style kernels)
// against a plain double-precision reference that forms the whole masked
// [T, T] probability matrix, against the scalar row functions of
// tensor/kernels/attention.h (the CUDA math), and against central finite
// differences; on odd sizes (T not a multiple of either tile, head dims not
// a multiple of the vector width, T = 1), grouped-query heads and every
// float dtype, with and without document masks; plus DocumentMask, Rope at
// a document's positions and the argument checks.
#include "tensor/kernels/attention.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/cpu/attention.h"
#include "tensor/kernels/rope.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using testing_util::AllClose;
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

// Document key starts [B, T] (empty: none): row i attends to keys
// starts[b T + i]..i.
using Starts = std::vector<int32_t>;

int64_t FirstKey(const Starts& starts, int64_t t, int64_t bi, int64_t i) {
  return starts.empty() ? 0 : starts[bi * t + i];
}

// Packed documents of random lengths (1 to 2.5 key tiles, so that some
// cross the CPU kernels' tiles and blocks and some are single tokens),
// a new one at each batch row's start.
Starts RandomStarts(const Dims& d, uint64_t seed) {
  Starts starts(d.b * d.t);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t bi = 0; bi < d.b; ++bi) {
    int64_t start = 0, left = 0;
    for (int64_t i = 0; i < d.t; ++i) {
      if (left == 0) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        left = 1 + static_cast<int64_t>((x >> 33) % 160);
        start = i;
      }
      --left;
      starts[bi * d.t + i] = static_cast<int32_t>(start);
    }
  }
  return starts;
}

Tensor StartsTensor(const Dims& d, const Starts& starts) {
  Tensor t = *Tensor::Empty({d.b, d.t}, DType::kI32, Device::Cpu());
  std::copy(starts.begin(), starts.end(), t.data<int32_t>());
  return t;
}

// Materialises the [T, T] probabilities per head, in double.
Expected Reference(const Dims& d, const std::vector<double>& q,
                   const std::vector<double>& k, const std::vector<double>& v,
                   const std::vector<double>& dout, double scale,
                   const Starts& starts = {}) {
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
        const int64_t first = FirstKey(starts, t, bi, i);
        std::vector<double> s(i + 1, 0.0);
        double max = -INFINITY;
        for (int64_t j = first; j <= i; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < hd; ++x) {
            dot += q[qh + i * hd + x] * k[kh + j * hd + x];
          }
          s[j] = scale * dot;
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (int64_t j = first; j <= i; ++j)
          sum += (s[j] = std::exp(s[j] - max));
        for (double& x : s) x /= sum;  // probabilities (0 before first)
        e.lse[(bi * d.h + hi) * t + i] = max + std::log(sum);
        const int64_t row = qh + i * hd;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t x = 0; x < hd; ++x) {
            e.out[row + x] += s[j] * v[kh + j * hd + x];
          }
        }
        double delta = 0;
        for (int64_t x = 0; x < hd; ++x)
          delta += dout[row + x] * e.out[row + x];
        for (int64_t j = 0; j <= i; ++j) {
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

Results RunAttention(const Inputs& in, float scale,
                     const Tensor* key_start = nullptr) {
  const Shape& qs = in.q.shape();
  const DType dt = in.q.dtype();
  Results r{Empty(qs, dt), Empty({qs[0], qs[1], qs[2]}, DType::kF32),
            Empty(qs, dt), Empty(in.k.shape(), dt), Empty(in.k.shape(), dt)};
  EXPECT_TRUE(
      CausalAttention(in.q, in.k, in.v, scale, &r.out, &r.lse, key_start).ok());
  EXPECT_TRUE(CausalAttentionBackward(in.q, in.k, in.v, r.out, r.lse, in.dout,
                                      scale, &r.dq, &r.dk, &r.dv, key_start)
                  .ok());
  return r;
}

// (shape, dtype, document masks)
class CausalAttentionTest
    : public ::testing::TestWithParam<std::tuple<Dims, DType, bool>> {};

TEST_P(CausalAttentionTest, MatchesTheDoubleReference) {
  const auto& [d, dtype, masked] = GetParam();
  const Inputs in = MakeInputs(d, dtype, 11);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  const Starts starts = masked ? RandomStarts(d, 3) : Starts();
  const Tensor key_start = StartsTensor(d, masked ? starts : Starts(d.b * d.t));
  const Results got = RunAttention(in, scale, masked ? &key_start : nullptr);
  // dout is the reference's too, but the forward output it sees is the
  // kernel's own (D_i = dout_i . out_i): use the exact out for both.
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale, starts);
  // f32: accumulation over T keys and hd dims; 16-bit: one output rounding
  // plus the backward's use of the rounded forward output.
  const double tol = dtype == DType::kF32 ? 2e-5 : 4 * RelTol(dtype);
  EXPECT_TRUE(AllClose(Values(got.out), e.out, tol, tol)) << "out";
  EXPECT_TRUE(AllClose(Values(got.lse), e.lse, 1e-5, 1e-5)) << "lse";
  EXPECT_TRUE(AllClose(Values(got.dq), e.dq, tol, tol)) << "dq";
  EXPECT_TRUE(AllClose(Values(got.dk), e.dk, tol, tol)) << "dk";
  EXPECT_TRUE(AllClose(Values(got.dv), e.dv, tol, tol)) << "dv";
}

// The blocked bf16 path with a work budget so small that every kv head is a
// group of its own (and 3 query blocks at T = 300): the same results as the
// double reference, and as one group; with and without document masks (the
// groups' kv heads map back to their batch rows' masks).
class BlockedAttentionTest : public ::testing::TestWithParam<bool> {};

TEST_P(BlockedAttentionTest, KvHeadGroupsGiveTheSameResults) {
  const bool masked = GetParam();
  const Dims d{2, 4, 2, 300, 16};
  const Inputs in = MakeInputs(d, DType::kBF16, 5);
  const float scale = 0.25f;
  const Starts starts = masked ? RandomStarts(d, 8) : Starts();
  const Tensor key_start = StartsTensor(d, masked ? starts : Starts(d.b * d.t));
  const int32_t* ks = masked ? key_start.data<int32_t>() : nullptr;
  const Results whole = RunAttention(in, scale, masked ? &key_start : nullptr);
  Results grouped{
      Empty(in.q.shape(), DType::kBF16), Empty({d.b, d.h, d.t}, DType::kF32),
      Empty(in.q.shape(), DType::kBF16), Empty(in.k.shape(), DType::kBF16),
      Empty(in.k.shape(), DType::kBF16)};
  ASSERT_TRUE(cpu::BlockedAttentionForward(
                  in.q.raw_data(), in.k.raw_data(), in.v.raw_data(), d.b, d.h,
                  d.kv, d.t, d.hd, scale, grouped.out.raw_data(),
                  grouped.lse.data<float>(), ks, /*work_bytes=*/1)
                  .ok());
  ASSERT_TRUE(cpu::BlockedAttentionBackward(
                  in.q.raw_data(), in.k.raw_data(), in.v.raw_data(),
                  grouped.out.raw_data(), grouped.lse.data<float>(),
                  in.dout.raw_data(), d.b, d.h, d.kv, d.t, d.hd, scale,
                  grouped.dq.raw_data(), grouped.dk.raw_data(),
                  grouped.dv.raw_data(), ks, /*work_bytes=*/1)
                  .ok());
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale, starts);
  const double tol = 4 * RelTol(DType::kBF16);
  EXPECT_TRUE(AllClose(Values(grouped.out), e.out, tol, tol)) << "out";
  EXPECT_TRUE(AllClose(Values(grouped.lse), e.lse, 1e-5, 1e-5)) << "lse";
  EXPECT_TRUE(AllClose(Values(grouped.dq), e.dq, tol, tol)) << "dq";
  EXPECT_TRUE(AllClose(Values(grouped.dk), e.dk, tol, tol)) << "dk";
  EXPECT_TRUE(AllClose(Values(grouped.dv), e.dv, tol, tol)) << "dv";
  // Per head the same matmuls and row passes: equal up to oneDNN's choice
  // of kernel for another batch count (one bf16 rounding).
  for (const auto& [a, b] :
       {std::pair{&grouped.out, &whole.out}, std::pair{&grouped.dq, &whole.dq},
        std::pair{&grouped.dk, &whole.dk}, std::pair{&grouped.dv, &whole.dv}}) {
    EXPECT_TRUE(AllClose(Values(*a), Values(*b), 2 * RelTol(DType::kBF16),
                         2 * RelTol(DType::kBF16)));
  }
}

INSTANTIATE_TEST_SUITE_P(Masks, BlockedAttentionTest, ::testing::Bool());

// The SIMD kernels against the scalar row functions the CUDA kernels run.
TEST_P(CausalAttentionTest, MatchesTheScalarRowFunctions) {
  const auto& [d, dtype, masked] = GetParam();
  if (dtype != DType::kF32) GTEST_SKIP() << "f32 only (same math)";
  const Inputs in = MakeInputs(d, dtype, 29);
  const float scale = 0.3f;
  const Starts starts = masked ? RandomStarts(d, 4) : Starts();
  const Tensor key_start = StartsTensor(d, masked ? starts : Starts(d.b * d.t));
  const Results got = RunAttention(in, scale, masked ? &key_start : nullptr);
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
      // A document's keys are a run [first, i]: the row functions see them
      // as a sequence of their own.
      const int64_t first = FirstKey(starts, t, head / d.h, i);
      const float* kf = k + (kvh * t + first) * hd;
      const float* vf = v + (kvh * t + first) * hd;
      kernels::CausalAttentionRow(q + row * hd, kf, vf, i + 1 - first, hd,
                                  scale, acc.data(), &out_ref[row * hd],
                                  &lse_ref[row]);
      const float delta = kernels::DotF32(dout + row * hd, out + row * hd, hd);
      kernels::CausalAttentionDqRow(q + row * hd, kf, vf, dout + row * hd,
                                    delta, lse[row], i + 1 - first, hd, scale,
                                    acc.data(), &dq_ref[row * hd]);
      for (int64_t j = first; j <= i; ++j) {
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
  // at a time): sums of up to T terms of size ~1, so an absolute 1e-5.
  EXPECT_TRUE(AllClose(Values(got.out), doubles(out_ref), 1e-5, 1e-5));
  EXPECT_TRUE(AllClose(Values(got.lse), doubles(lse_ref), 1e-6, 1e-6));
  EXPECT_TRUE(AllClose(Values(got.dq), doubles(dq_ref), 1e-5, 1e-5));
  EXPECT_TRUE(AllClose(Values(got.dk), doubles(dk_ref), 1e-5, 1e-5));
  EXPECT_TRUE(AllClose(Values(got.dv), doubles(dv_ref), 1e-5, 1e-5));
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
        ::testing::Bool()));

// d(sum(out * w))/dq, dk, dv against central differences in f32 (the loss
// is accumulated in double), without and with a document mask (documents
// [0, 4) and [4, 9)).
class CausalAttentionGradientTest : public ::testing::TestWithParam<bool> {};

TEST_P(CausalAttentionGradientTest, MatchesFiniteDifferences) {
  const Dims d{1, 2, 1, 9, 6};
  Inputs in = MakeInputs(d, DType::kF32, 5);
  const float scale = 0.5f;
  const Tensor key_start = StartsTensor(d, {0, 0, 0, 0, 4, 4, 4, 4, 4});
  const Tensor* ks = GetParam() ? &key_start : nullptr;
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

INSTANTIATE_TEST_SUITE_P(Masks, CausalAttentionGradientTest, ::testing::Bool());

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
    const Tensor pos =
        *Tensor::FromInts({b, t}, {0, 1, 0, 1, 2, 3, 4, 0, 1, 9}, DType::kI32);
    Tensor y = RandomTensor({b, n, t, hd}, dtype, 17);
    ASSERT_TRUE(Rope(&y, inv_freq, /*inverse=*/false, &pos).ok());
    const std::vector<double> xs = Values(x), ys = Values(y);
    const std::vector<double> ps = Values(pos);
    for (int64_t r = 0; r < b * n * t; ++r) {
      const int64_t bi = r / (n * t), ti = r % t;
      // Positions are clamped to [0, T): 9 is 4.
      const int64_t p =
          std::min<int64_t>(static_cast<int64_t>(ps[bi * t + ti]), t - 1);
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
  s = CausalAttention(q, k3, k3, 1.0f, &out, &lse, &starts);
  EXPECT_NE(s.message().find("key_start i64[1, 4]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("must be i32 [B, T] on the device of q"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace fsdpp
