// CausalAttention / CausalAttentionBackward (the fused, flash-style kernels)
// against a plain double-precision reference that forms the whole masked
// [T, T] probability matrix, against the scalar row functions of
// tensor/kernels/attention.h (the CUDA math), and against central finite
// differences; on odd sizes (T not a multiple of either tile, head dims not
// a multiple of the vector width, T = 1), grouped-query heads and every
// float dtype; plus the argument checks.
#include "tensor/kernels/attention.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/cpu/attention.h"
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

// Materialises the [T, T] probabilities per head, in double.
Expected Reference(const Dims& d, const std::vector<double>& q,
                   const std::vector<double>& k, const std::vector<double>& v,
                   const std::vector<double>& dout, double scale) {
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
        std::vector<double> s(i + 1);
        double max = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < hd; ++x) {
            dot += q[qh + i * hd + x] * k[kh + j * hd + x];
          }
          s[j] = scale * dot;
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - max));
        for (double& x : s) x /= sum;  // probabilities
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

Results RunAttention(const Inputs& in, float scale) {
  const Shape& qs = in.q.shape();
  const DType dt = in.q.dtype();
  Results r{Empty(qs, dt), Empty({qs[0], qs[1], qs[2]}, DType::kF32),
            Empty(qs, dt), Empty(in.k.shape(), dt), Empty(in.k.shape(), dt)};
  EXPECT_TRUE(CausalAttention(in.q, in.k, in.v, scale, &r.out, &r.lse).ok());
  EXPECT_TRUE(CausalAttentionBackward(in.q, in.k, in.v, r.out, r.lse, in.dout,
                                      scale, &r.dq, &r.dk, &r.dv)
                  .ok());
  return r;
}

class CausalAttentionTest
    : public ::testing::TestWithParam<std::tuple<Dims, DType>> {};

TEST_P(CausalAttentionTest, MatchesTheDoubleReference) {
  const auto& [d, dtype] = GetParam();
  const Inputs in = MakeInputs(d, dtype, 11);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  const Results got = RunAttention(in, scale);
  // dout is the reference's too, but the forward output it sees is the
  // kernel's own (D_i = dout_i . out_i): use the exact out for both.
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale);
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
// double reference, and as one group.
TEST(BlockedAttentionTest, KvHeadGroupsGiveTheSameResults) {
  const Dims d{2, 4, 2, 300, 16};
  const Inputs in = MakeInputs(d, DType::kBF16, 5);
  const float scale = 0.25f;
  const Results whole = RunAttention(in, scale);
  Results grouped{
      Empty(in.q.shape(), DType::kBF16), Empty({d.b, d.h, d.t}, DType::kF32),
      Empty(in.q.shape(), DType::kBF16), Empty(in.k.shape(), DType::kBF16),
      Empty(in.k.shape(), DType::kBF16)};
  ASSERT_TRUE(cpu::BlockedAttentionForward(
                  in.q.raw_data(), in.k.raw_data(), in.v.raw_data(), d.b, d.h,
                  d.kv, d.t, d.hd, scale, grouped.out.raw_data(),
                  grouped.lse.data<float>(), /*work_bytes=*/1)
                  .ok());
  ASSERT_TRUE(cpu::BlockedAttentionBackward(
                  in.q.raw_data(), in.k.raw_data(), in.v.raw_data(),
                  grouped.out.raw_data(), grouped.lse.data<float>(),
                  in.dout.raw_data(), d.b, d.h, d.kv, d.t, d.hd, scale,
                  grouped.dq.raw_data(), grouped.dk.raw_data(),
                  grouped.dv.raw_data(), /*work_bytes=*/1)
                  .ok());
  const Expected e = Reference(d, Values(in.q), Values(in.k), Values(in.v),
                               Values(in.dout), scale);
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

// The SIMD kernels against the scalar row functions the CUDA kernels run.
TEST_P(CausalAttentionTest, MatchesTheScalarRowFunctions) {
  const auto& [d, dtype] = GetParam();
  if (dtype != DType::kF32) GTEST_SKIP() << "f32 only (same math)";
  const Inputs in = MakeInputs(d, dtype, 29);
  const float scale = 0.3f;
  const Results got = RunAttention(in, scale);
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
      kernels::CausalAttentionRow(
          q + row * hd, k + kvh * t * hd, v + kvh * t * hd, i + 1, hd, scale,
          acc.data(), &out_ref[row * hd], &lse_ref[row]);
      const float delta = kernels::DotF32(dout + row * hd, out + row * hd, hd);
      kernels::CausalAttentionDqRow(
          q + row * hd, k + kvh * t * hd, v + kvh * t * hd, dout + row * hd,
          delta, lse[row], i + 1, hd, scale, acc.data(), &dq_ref[row * hd]);
      for (int64_t j = 0; j <= i; ++j) {
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
        ::testing::Values(Dims{1, 1, 1, 1, 8},     // one token
                          Dims{2, 4, 2, 37, 12},   // odd T and hd, GQA 2
                          Dims{1, 2, 1, 130, 64},  // 3 key tiles, tail, GQA
                          Dims{2, 3, 3, 64, 80},   // whole tiles, hd 80
                          Dims{1, 6, 2, 97, 16}),  // GQA 3
        ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)));

// d(sum(out * w))/dq, dk, dv against central differences in f32 (the loss
// is accumulated in double).
TEST(CausalAttentionGradientTest, MatchesFiniteDifferences) {
  const Dims d{1, 2, 1, 9, 6};
  Inputs in = MakeInputs(d, DType::kF32, 5);
  const float scale = 0.5f;
  const Results got = RunAttention(in, scale);
  const std::vector<double> w = Values(in.dout);
  auto loss = [&]() {
    Tensor out = Empty(in.q.shape(), DType::kF32);
    Tensor lse = Empty({d.b, d.h, d.t}, DType::kF32);
    EXPECT_TRUE(CausalAttention(in.q, in.k, in.v, scale, &out, &lse).ok());
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
}

}  // namespace
}  // namespace fsdpp
