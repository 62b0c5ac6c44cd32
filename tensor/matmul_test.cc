// Matmul against a double-precision reference: every transpose combination,
// batched and broadcast weights, alpha/beta accumulation, odd sizes (1,
// primes), f32 and bf16 (f32 or bf16 output).
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using testing_util::AllClose;
using testing_util::RandomTensor;
using testing_util::Values;
using Vec = std::vector<double>;

// Reference with the same layout conventions as Matmul.
Vec MatmulRef(const Vec& a, const Vec& b, const Vec& c0, int64_t batch,
              int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool bcast,
              double alpha, double beta) {
  Vec c(batch * m * n);
  for (int64_t bt = 0; bt < batch; ++bt) {
    const double* pa = a.data() + bt * m * k;
    const double* pb = b.data() + (bcast ? 0 : bt * k * n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double av = ta ? pa[p * m + i] : pa[i * k + p];
          const double bv = tb ? pb[j * k + p] : pb[p * n + j];
          s += av * bv;
        }
        const int64_t o = bt * m * n + i * n + j;
        c[o] = alpha * s + (beta != 0 ? beta * c0[o] : 0.0);
      }
    }
  }
  return c;
}

struct Case {
  int64_t batch, m, n, k;
  bool bcast;
};

// One Matmul of random operands (seeds seed, + 1, + 2, + 3) against the
// double reference: a of `dtype`, c of `out_dtype`, with a bias of c's
// dtype ([n]) when `with_bias`.
::testing::AssertionResult MatchesReference(const Case& cs, DType dtype,
                                            DType out_dtype, bool ta, bool tb,
                                            float alpha, float beta,
                                            bool with_bias, double rtol,
                                            double atol, uint64_t seed) {
  Shape a_shape =
      ta ? Shape{cs.batch, cs.k, cs.m} : Shape{cs.batch, cs.m, cs.k};
  Shape b_shape = tb ? Shape{cs.n, cs.k} : Shape{cs.k, cs.n};
  if (!cs.bcast) b_shape.insert(b_shape.begin(), cs.batch);
  Tensor a = RandomTensor(a_shape, dtype, seed);
  Tensor b = RandomTensor(b_shape, dtype, seed + 1);
  Tensor c = RandomTensor({cs.batch, cs.m, cs.n}, out_dtype, seed + 2);
  Tensor bias = RandomTensor({cs.n}, out_dtype, seed + 3);
  const Vec c0 = Values(c);
  MatmulOptions options{ta, tb, alpha, beta};
  if (with_bias) options.bias = &bias;
  if (absl::Status s = Matmul(a, b, &c, options); !s.ok()) {
    return ::testing::AssertionFailure() << s;
  }
  Vec ref = MatmulRef(Values(a), Values(b), c0, cs.batch, cs.m, cs.n, cs.k, ta,
                      tb, cs.bcast, alpha, beta);
  if (with_bias) {
    const Vec bv = Values(bias);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += bv[i % cs.n];
  }
  return AllClose(Values(c), ref, rtol, atol);
}

// Tolerances against the double reference: f32 accumulation over k terms
// of magnitude <= 1; a bf16 or f16 c adds one rounding (2^-8, 2^-11
// relative), and a bias one more (`with_bias`).
struct Tolerance {
  double rtol, atol;
};
Tolerance TolFor(DType out_dtype, int64_t k, bool with_bias) {
  const double bias = with_bias ? 1 : 0;
  switch (out_dtype) {
    case DType::kBF16:
      return {1.0 / 128, 1e-5 * k + 1e-2 + 2e-2 * bias};
    case DType::kF16:
      return {1.0 / 1024, 1e-5 * k + 2e-3 + 2e-3 * bias};
    default:
      return {1e-5, 1e-5 * k + 1e-6 * bias};
  }
}

TEST(MatmulTest, MatchesReference) {
  const Case cases[] = {{1, 1, 1, 1, false},      {1, 2, 3, 5, false},
                        {1, 7, 31, 13, false},    {1, 64, 64, 64, false},
                        {1, 127, 33, 257, false}, {3, 5, 7, 11, false},
                        {4, 17, 9, 23, true},     {2, 1, 129, 64, true}};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType out_dtype : {DType::kF32, dtype}) {
      for (const Case& cs : cases) {
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          for (auto [alpha, beta] : {std::pair<float, float>{1.0f, 0.0f},
                                     {0.5f, 1.0f},
                                     {-2.0f, 0.25f}}) {
            SCOPED_TRACE(testing::Message()
                         << DTypeName(dtype) << "->" << DTypeName(out_dtype)
                         << " batch=" << cs.batch << " m=" << cs.m
                         << " n=" << cs.n << " k=" << cs.k << " ta=" << ta
                         << " tb=" << tb << " bcast=" << cs.bcast
                         << " alpha=" << alpha << " beta=" << beta);
            const Tolerance tol = TolFor(out_dtype, cs.k, false);
            EXPECT_TRUE(MatchesReference(cs, dtype, out_dtype, ta, tb, alpha,
                                         beta, false, tol.rtol, tol.atol, 1));
          }
        }
      }
    }
  }
}

TEST(MatmulTest, LongInnerDimensionGoesInChunks) {
  // k >= 16384 and >= 8 max(m, n): the inner dim in chunks (an LM head's
  // dx), summed in f32 into c or into a buffer rounded into c once. An odd k
  // leaves a shorter last chunk.
  const Case cases[] = {{1, 5, 7, 16411, false}, {2, 3, 4, 20000, true}};
  for (const Case& cs : cases) {
    ASSERT_GT(cpu::OneDnnMatmulKChunk(cs.m, cs.n, cs.k), 0);
    ASSERT_LT(cpu::OneDnnMatmulKChunk(cs.m, cs.n, cs.k), cs.k);
  }
  EXPECT_EQ(cpu::OneDnnMatmulKChunk(1024, 768, 3072), 0);
  EXPECT_EQ(cpu::OneDnnMatmulKChunk(4096, 768, 16384), 0);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (DType out_dtype : {DType::kF32, dtype}) {
      for (const Case& cs : cases) {
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          for (auto [alpha, beta] :
               {std::pair<float, float>{1.0f, 0.0f}, {-2.0f, 0.25f}}) {
            SCOPED_TRACE(testing::Message()
                         << DTypeName(dtype) << "->" << DTypeName(out_dtype)
                         << " batch=" << cs.batch << " k=" << cs.k
                         << " ta=" << ta << " tb=" << tb << " alpha=" << alpha
                         << " beta=" << beta);
            // Sums of k products of magnitude <= 1 that mostly cancel: f32's
            // error grows like sqrt(k); bf16 c adds one rounding.
            const double rtol = out_dtype == DType::kBF16 ? 1.0 / 128 : 1e-5;
            EXPECT_TRUE(MatchesReference(cs, dtype, out_dtype, ta, tb, alpha,
                                         beta, false, rtol, 2e-3, 11));
          }
        }
      }
    }
  }
}

TEST(MatmulTest, ManyRowsOfATransposedBf16AGoInChunks) {
  // A transposed bf16 a with m >= 24576 and >= 8 max(n, k) (an LM head's
  // weight gradient): c's rows in chunks, each computed as at once; an odd
  // m leaves a shorter last chunk. With a bias too.
  const Case cases[] = {{1, 24593, 3, 5, false}, {2, 30001, 4, 7, true}};
  for (const Case& cs : cases) {
    ASSERT_GT(cpu::OneDnnMatmulMChunk(DType::kBF16, true, cs.m, cs.n, cs.k), 0);
    ASSERT_LT(cpu::OneDnnMatmulMChunk(DType::kBF16, true, cs.m, cs.n, cs.k),
              cs.m);
  }
  EXPECT_EQ(cpu::OneDnnMatmulMChunk(DType::kBF16, false, 50304, 768, 1024), 0);
  EXPECT_EQ(cpu::OneDnnMatmulMChunk(DType::kF32, true, 50304, 768, 1024), 0);
  EXPECT_EQ(cpu::OneDnnMatmulMChunk(DType::kBF16, true, 3072, 768, 1024), 0);
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    for (const Case& cs : cases) {
      for (bool tb : {false, true}) {
        for (int variant = 0; variant < 3; ++variant) {
          const float alpha = variant == 1 ? -2.0f : 1.0f;
          const float beta = variant == 1 ? 0.25f : 0.0f;
          SCOPED_TRACE(testing::Message()
                       << "->" << DTypeName(out_dtype) << " m=" << cs.m
                       << " tb=" << tb << " variant=" << variant);
          const double atol = out_dtype == DType::kBF16 ? 1e-2 : 1e-4;
          const double rtol = out_dtype == DType::kBF16 ? 1.0 / 128 : 1e-5;
          EXPECT_TRUE(MatchesReference(cs, DType::kBF16, out_dtype, true, tb,
                                       alpha, beta, variant == 2, rtol, atol,
                                       21));
        }
      }
    }
  }
}

TEST(MatmulTest, TwoDimensionalAndGpt2Shapes) {
  // A Linear layer at GPT-2 width, [B*T, C] @ W^T with W [4C, C], odd B*T.
  const int64_t rows = 67, c = 768, h = 3072;
  Tensor x = RandomTensor({rows, c}, DType::kF32, 4);
  Tensor w = RandomTensor({h, c}, DType::kF32, 5);
  Tensor y = *Tensor::Empty({rows, h}, DType::kF32, Device::Cpu());
  ASSERT_TRUE(Matmul(x, w, &y, {false, true}).ok());
  Vec ref = MatmulRef(Values(x), Values(w), {}, 1, rows, h, c, false, true,
                      false, 1, 0);
  EXPECT_TRUE(AllClose(Values(y), ref, 1e-5, 1e-4));
}

TEST(MatmulTest, PrimitivesAreCached) {
  Tensor a = RandomTensor({19, 23}, DType::kF32, 6);
  Tensor b = RandomTensor({23, 29}, DType::kF32, 7);
  Tensor c = *Tensor::Empty({19, 29}, DType::kF32, Device::Cpu());
  ASSERT_TRUE(Matmul(a, b, &c).ok());
  const int64_t size = cpu::OneDnnMatmulCacheSize();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Matmul(a, b, &c).ok());
  EXPECT_EQ(cpu::OneDnnMatmulCacheSize(), size);
  ASSERT_TRUE(Matmul(a, b, &c, {false, false, 1.0f, 1.0f}).ok());
  EXPECT_EQ(cpu::OneDnnMatmulCacheSize(), size + 1);
}

TEST(MatmulTest, ConcurrentThreadsGetCorrectResults) {
  // Ranks run as threads: primitives (and their scratchpads) must be safe to
  // execute concurrently. The shapes are a transformer's (weight gradients
  // with transpose_a, batched attention) so several distinct primitives with
  // scratchpads run at once.
  struct Shape5 {
    int64_t batch, m, k, n;
    bool ta, tb;
  };
  const Shape5 shapes[] = {{1, 64, 48, 192, true, false},
                           {8, 8, 16, 8, false, true},
                           {1, 96, 512, 64, false, false},
                           {4, 8, 8, 16, false, false}};
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failures, &shapes] {
      const Shape5& s = shapes[t % 4];
      Tensor a = RandomTensor(
          s.ta ? Shape{s.batch, s.k, s.m} : Shape{s.batch, s.m, s.k},
          DType::kF32, 10 + t);
      Tensor b = RandomTensor(
          s.tb ? Shape{s.batch, s.n, s.k} : Shape{s.batch, s.k, s.n},
          DType::kF32, 20 + t);
      Tensor c =
          *Tensor::Empty({s.batch, s.m, s.n}, DType::kF32, Device::Cpu());
      Vec ref = MatmulRef(Values(a), Values(b), {}, s.batch, s.m, s.n, s.k,
                          s.ta, s.tb, false, 1, 0);
      for (int i = 0; i < 200; ++i) {
        CHECK_OK(Matmul(a, b, &c, {s.ta, s.tb}));
        if (!AllClose(Values(c), ref, 1e-5, 1e-4)) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(8, 0));
}

// A bias is added to every row of every batch entry, in every dtype (f16's
// path through f32 copies included).
TEST(MatmulTest, BiasIsAddedToEveryRow) {
  const Case cases[] = {{1, 1, 1, 1, false},
                        {1, 7, 31, 13, false},
                        {3, 5, 33, 11, false},
                        {2, 17, 9, 64, true}};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType out_dtype : {DType::kF32, dtype}) {
      for (const Case& cs : cases) {
        for (bool tb : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << DTypeName(dtype) << "->" << DTypeName(out_dtype)
                       << " batch=" << cs.batch << " m=" << cs.m
                       << " n=" << cs.n << " k=" << cs.k << " tb=" << tb);
          Tensor a = RandomTensor({cs.batch, cs.m, cs.k}, dtype, 11);
          Shape b_shape = tb ? Shape{cs.n, cs.k} : Shape{cs.k, cs.n};
          if (!cs.bcast) b_shape.insert(b_shape.begin(), cs.batch);
          Tensor b = RandomTensor(b_shape, dtype, 12);
          Tensor bias = RandomTensor({cs.n}, out_dtype, 13, -3, 3);
          Tensor c = RandomTensor({cs.batch, cs.m, cs.n}, out_dtype, 14);
          MatmulOptions options;
          options.transpose_b = tb;
          options.bias = &bias;
          ASSERT_TRUE(Matmul(a, b, &c, options).ok());
          Vec ref = MatmulRef(Values(a), Values(b), {}, cs.batch, cs.m, cs.n,
                              cs.k, false, tb, cs.bcast, 1, 0);
          const Vec vb = Values(bias);
          for (size_t i = 0; i < ref.size(); ++i) ref[i] += vb[i % cs.n];
          const Tolerance tol = TolFor(out_dtype, cs.k, true);
          EXPECT_TRUE(AllClose(Values(c), ref, tol.rtol, tol.atol));
        }
      }
    }
  }
  // An empty inner dimension leaves just the bias.
  Tensor a = *Tensor::Empty({2, 0}, DType::kF32, Device::Cpu());
  Tensor b = *Tensor::Empty({0, 3}, DType::kF32, Device::Cpu());
  Tensor bias = *Tensor::FromFloats({3}, {1, 2, 3});
  Tensor c = *Tensor::FromFloats({2, 3}, {9, 9, 9, 9, 9, 9});
  MatmulOptions options;
  options.bias = &bias;
  ASSERT_TRUE(Matmul(a, b, &c, options).ok());
  EXPECT_EQ(Values(c), (Vec{1, 2, 3, 1, 2, 3}));
}

TEST(MatmulTest, BiasRejectsWrongShapesDtypesAndAccumulation) {
  Tensor a = RandomTensor({4, 5}, DType::kF32, 15);
  Tensor b = RandomTensor({5, 6}, DType::kF32, 16);
  Tensor c = *Tensor::Zeros({4, 6}, DType::kF32, Device::Cpu());
  Tensor short_bias = *Tensor::Zeros({5}, DType::kF32, Device::Cpu());
  Tensor bf16_bias = *Tensor::Zeros({6}, DType::kBF16, Device::Cpu());
  Tensor bias = *Tensor::Zeros({6}, DType::kF32, Device::Cpu());
  MatmulOptions options;
  options.bias = &short_bias;
  absl::Status s = Matmul(a, b, &c, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bias must be [6]"), std::string::npos) << s;
  options.bias = &bf16_bias;
  EXPECT_EQ(Matmul(a, b, &c, options).code(),
            absl::StatusCode::kInvalidArgument);
  options.bias = &bias;
  options.beta = 1.0f;
  s = Matmul(a, b, &c, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("alpha == 1 and beta == 0"), std::string::npos)
      << s;
}

// OneDnnStridedMatmul (the blocked attention's matmuls): a broadcast b, a
// transposed a read through swapped strides, padded row strides, alpha and
// beta, f32, bf16 and f16 (widened) operands with an f32 or own-dtype c,
// against plain loops in double.
TEST(MatmulTest, StridedMatmulMatchesLoops) {
  const int64_t batch = 3, m = 5, k = 7, n = 6, lda = 9, ldc = 8;
  for (auto [dtype, c_dtype] : {std::pair{DType::kF32, DType::kF32},
                                {DType::kBF16, DType::kF32},
                                {DType::kBF16, DType::kBF16},
                                {DType::kF16, DType::kF32},
                                {DType::kF16, DType::kF16}}) {
    // a stored transposed: a[bt][i][p] at bt * k * lda + p * lda + i.
    const Tensor a_store =
        testing_util::RandomTensor({batch * k * lda}, dtype, 1);
    const Tensor b = testing_util::RandomTensor({k * n}, dtype, 2);
    Tensor c = testing_util::RandomTensor({batch * m * ldc}, c_dtype, 3);
    const std::vector<double> av = testing_util::Values(a_store),
                              bv = testing_util::Values(b),
                              c0 = testing_util::Values(c);
    const float alpha = 0.5f, beta = 2.0f;  // exact in every dtype
    const cpu::StridedOperand a_op{
        a_store.raw_data(), {batch, m, k}, {k * lda, 1, lda}};
    const cpu::StridedOperand b_op{b.raw_data(), {1, k, n}, {0, n, 1}};
    const int64_t c_strides[3] = {m * ldc, ldc, 1};
    ASSERT_TRUE(cpu::OneDnnStridedMatmul(dtype, c_dtype, a_op, b_op,
                                         c.raw_data(), c_strides, alpha, beta)
                    .ok());
    const std::vector<double> got = testing_util::Values(c);
    for (int64_t bt = 0; bt < batch; ++bt) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const int64_t at = bt * m * ldc + i * ldc + j;
          if (j >= n) {  // padding: untouched
            EXPECT_EQ(got[at], c0[at]);
            continue;
          }
          double want = beta * c0[at];
          for (int64_t p = 0; p < k; ++p) {
            want += alpha *
                    static_cast<double>(av[bt * k * lda + p * lda + i]) *
                    bv[p * n + j];
          }
          // A c of 16 bits adds one rounding.
          const double tol = c_dtype == DType::kBF16  ? 1.0 / 128
                             : c_dtype == DType::kF16 ? 1.0 / 1024
                                                      : 1e-4;
          EXPECT_NEAR(got[at], want, tol * (1 + std::abs(want)))
              << DTypeName(dtype) << "->" << DTypeName(c_dtype) << " " << bt
              << "," << i << "," << j;
        }
      }
    }
  }
  const cpu::StridedOperand a{nullptr, {2, 3, 4}, {12, 4, 1}};
  const cpu::StridedOperand bad{nullptr, {2, 5, 4}, {20, 4, 1}};
  const int64_t c_strides[3] = {12, 4, 1};
  const absl::Status s = cpu::OneDnnStridedMatmul(
      DType::kF32, DType::kF32, a, bad, nullptr, c_strides, 1.0f, 0.0f);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("do not multiply"), std::string::npos) << s;
}

TEST(MatmulTest, EmptyInnerDimensionScalesC) {
  Tensor a = *Tensor::Empty({3, 0}, DType::kF32, Device::Cpu());
  Tensor b = *Tensor::Empty({0, 2}, DType::kF32, Device::Cpu());
  Tensor c = *Tensor::FromFloats({3, 2}, {1, 2, 3, 4, 5, 6});
  ASSERT_TRUE(Matmul(a, b, &c, {false, false, 1.0f, 0.5f}).ok());
  EXPECT_EQ(Values(c), (Vec{0.5, 1, 1.5, 2, 2.5, 3}));
  ASSERT_TRUE(Matmul(a, b, &c).ok());
  EXPECT_EQ(Values(c), Vec(6, 0.0));
}

// The bf16 mode's choice: the variable first, then the CPU.
TEST(MatmulTest, Bf16ModeFollowsTheVariableThenTheCpu) {
  std::string why;
  using Mode = cpu::Bf16MatmulMode;
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("native", false, false, true, &why),
            Mode::kNative);
  EXPECT_NE(why.find("FSDPP_CPU_BF16_MATMUL=native"), std::string::npos);
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("widen", true, true, false, &why),
            Mode::kWidened);
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("", true, true, true, &why), Mode::kNative);
  EXPECT_NE(why.find("AMX"), std::string::npos) << why;
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("auto", false, true, false, &why),
            Mode::kNative);
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("", false, true, true, &why),
            Mode::kWidened);
  EXPECT_NE(why.find("Intel CPU without AMX"), std::string::npos) << why;
  EXPECT_EQ(*cpu::Bf16MatmulModeFor("", false, false, false, &why),
            Mode::kWidened);
  const auto bad = cpu::Bf16MatmulModeFor("fast", false, true, false, &why);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("FSDPP_CPU_BF16_MATMUL='fast'"),
            std::string::npos)
      << bad.status();
  // This process's own: matmul_test runs under each setting
  // (matmul_native_test, matmul_widened_test).
  const char* env = std::getenv("FSDPP_CPU_BF16_MATMUL");
  if (env != nullptr && std::string(env) == "widen") {
    EXPECT_EQ(*cpu::OneDnnBf16MatmulMode(), Mode::kWidened);
  } else if (env != nullptr && std::string(env) == "native") {
    EXPECT_EQ(*cpu::OneDnnBf16MatmulMode(), Mode::kNative);
  }
  EXPECT_FALSE(cpu::OneDnnBf16MatmulModeDescription().empty());
  ::testing::Test::RecordProperty("bf16_matmul",
                                  cpu::OneDnnBf16MatmulModeDescription());
}

// Widened operands in blocks: a 4 KiB budget splits c into several blocks
// of rows and of columns (and b's columns are widened again per block of
// rows; a 16-bit c's f32 block may take 16 KiB); every transpose, batched and
// broadcast b, alpha and beta, a bias, bf16 and f16 operands with an f32 or
// own-dtype c, against the reference.
TEST(MatmulTest, WidenedBlocksMatchReference) {
  const cpu::Bf16MatmulMode widened = cpu::Bf16MatmulMode::kWidened;
  cpu::SetBf16MatmulModeForTesting(&widened);
  cpu::SetWidenedBlockBytesForTesting(4096);
  // (The last but one: a short inner dim, so a 16-bit c's f32 block,
  // bounded by 4 times the budget, is what splits the rows.)
  const Case cases[] = {{1, 37, 200, 50, false},
                        {3, 9, 70, 31, false},
                        {2, 23, 130, 64, true},
                        {1, 40, 300, 2, false},
                        {1, 1, 1, 1, false}};
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (DType out_dtype : {DType::kF32, dtype}) {
      for (const Case& cs : cases) {
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          for (int variant = 0; variant < 3; ++variant) {
            const float alpha = variant == 1 ? -2.0f : 1.0f;
            const float beta = variant == 1 ? 0.25f : 0.0f;
            SCOPED_TRACE(testing::Message()
                         << DTypeName(dtype) << "->" << DTypeName(out_dtype)
                         << " batch=" << cs.batch << " m=" << cs.m
                         << " n=" << cs.n << " k=" << cs.k << " ta=" << ta
                         << " tb=" << tb << " variant=" << variant);
            const Tolerance tol = TolFor(out_dtype, cs.k, variant == 2);
            EXPECT_TRUE(MatchesReference(cs, dtype, out_dtype, ta, tb, alpha,
                                         beta, variant == 2, tol.rtol, tol.atol,
                                         31));
          }
        }
      }
    }
  }
  cpu::SetWidenedBlockBytesForTesting(0);
  cpu::SetBf16MatmulModeForTesting(nullptr);
}

TEST(MatmulTest, F32RowMajorBWithRowsOf4KiBIsStaged) {
  // b's rows 1024 or 2048 floats long, >= 512 rows of c, k >= 256: b is
  // copied at a wider leading dimension, in column blocks; at a 1 MiB
  // budget the second case's b goes in two blocks of 1024 columns, each
  // padded, the first's in two of 512. A transposed b, other widths and
  // small problems are not staged.
  EXPECT_TRUE(cpu::OneDnnMatmulStagesB(DType::kF32, false, 1024, 3072, 768));
  EXPECT_FALSE(cpu::OneDnnMatmulStagesB(DType::kF32, true, 1024, 3072, 768));
  EXPECT_FALSE(cpu::OneDnnMatmulStagesB(DType::kF32, false, 1024, 768, 3072));
  EXPECT_FALSE(cpu::OneDnnMatmulStagesB(DType::kF32, false, 511, 3072, 768));
  EXPECT_FALSE(cpu::OneDnnMatmulStagesB(DType::kF32, false, 1024, 3072, 255));
  EXPECT_FALSE(cpu::OneDnnMatmulStagesB(DType::kBF16, false, 1024, 3072, 768));
  // (budget, case, transpose_a, variant: 0 plain, 1 alpha and beta, 2 bias)
  struct Run {
    int64_t budget;
    Case cs;
    bool ta;
    int variant;
  };
  const Case one = {1, 512, 1024, 300, false}, two = {2, 256, 2048, 256, true};
  const Run runs[] = {{0, one, false, 0},      {0, one, false, 1},
                      {0, one, false, 2},      {0, one, true, 0},
                      {0, one, true, 1},       {0, one, true, 2},
                      {1 << 20, one, true, 1}, {1 << 20, two, false, 2},
                      {1 << 20, two, true, 1}};
  for (const Case& cs : {one, two}) {
    ASSERT_TRUE(cpu::OneDnnMatmulStagesB(DType::kF32, false, cs.batch * cs.m,
                                         cs.n, cs.k));
  }
  for (const Run& run : runs) {
    const Case& cs = run.cs;
    cpu::SetWidenedBlockBytesForTesting(run.budget);
    const float alpha = run.variant == 1 ? -2.0f : 1.0f;
    const float beta = run.variant == 1 ? 0.25f : 0.0f;
    SCOPED_TRACE(testing::Message()
                 << "budget=" << run.budget << " batch=" << cs.batch << " n="
                 << cs.n << " ta=" << run.ta << " variant=" << run.variant);
    const Tolerance tol = TolFor(DType::kF32, cs.k, run.variant == 2);
    EXPECT_TRUE(MatchesReference(cs, DType::kF32, DType::kF32, run.ta, false,
                                 alpha, beta, run.variant == 2, tol.rtol,
                                 tol.atol, 51));
  }
  cpu::SetWidenedBlockBytesForTesting(0);
}

// Native and widened bf16 agree to f32 rounding (both sum exact products
// in f32, in different orders).
TEST(MatmulTest, NativeAndWidenedBf16Agree) {
  const Tensor a = RandomTensor({64, 96}, DType::kBF16, 41);
  const Tensor b = RandomTensor({80, 96}, DType::kBF16, 42);
  Tensor c[2];
  const cpu::Bf16MatmulMode modes[2] = {cpu::Bf16MatmulMode::kNative,
                                        cpu::Bf16MatmulMode::kWidened};
  for (int i = 0; i < 2; ++i) {
    cpu::SetBf16MatmulModeForTesting(&modes[i]);
    c[i] = *Tensor::Empty({64, 80}, DType::kF32, Device::Cpu());
    ASSERT_TRUE(Matmul(a, b, &c[i], {false, true}).ok());
  }
  cpu::SetBf16MatmulModeForTesting(nullptr);
  EXPECT_TRUE(AllClose(Values(c[0]), Values(c[1]), 1e-5, 1e-5));
}

}  // namespace
}  // namespace fsdpp
