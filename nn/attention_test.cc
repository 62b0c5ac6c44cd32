// CausalSelfAttention against finite differences (dx and every parameter
// gradient, for MHA / GQA / MQA, fused and separate projections, RoPE and
// biases on and off, at odd sizes), against an independent triple-loop
// double-precision reference (its own RoPE and head grouping), and for
// causality, gradient accumulation, bf16, meta shapes and parameter names.
// The RoPE row kernels are checked on their own (values, inverse, norm).
#include "nn/attention.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tensor/kernels/rope.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using Vec = std::vector<double>;

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 5;

AttentionConfig Config(int64_t dim, int64_t heads, int64_t kv_heads, bool fused,
                       bool qkv_bias, bool out_bias, bool rope) {
  AttentionConfig c;
  c.dim = dim;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.max_seq_len = 8;
  c.fused_qkv = fused;
  c.qkv_bias = qkv_bias;
  c.out_bias = out_bias;
  c.rope = rope;
  c.rope_theta = 10000.0f;
  return c;
}

std::string Describe(const AttentionConfig& c) {
  return absl::StrCat("C=", c.dim, " H=", c.n_heads, " KV=", c.kv_heads(),
                      c.fused_qkv ? " fused" : " separate",
                      c.qkv_bias ? " qkv_bias" : "",
                      c.out_bias ? " out_bias" : "", c.rope ? " rope" : "",
                      c.qk_norm ? " qk_norm" : "",
                      c.fused_attention ? " fused core" : " unfused core");
}

// A module whose every parameter (biases too) is uniform in [-0.5, 0.5).
std::unique_ptr<CausalSelfAttention> MakeAttention(const AttentionConfig& c,
                                                   uint64_t seed) {
  absl::StatusOr<std::unique_ptr<CausalSelfAttention>> m =
      CausalSelfAttention::Create(c);
  CHECK_OK(m.status());
  uint64_t s = seed;
  for (auto& [name, p] : (*m)->NamedParameters()) {
    p->data = RandomTensor(p->shape, p->dtype, s++, -0.5f, 0.5f);
  }
  return *std::move(m);
}

Tensor Forward(Module& m, const Tensor& x) {
  absl::StatusOr<Tensor> y = m.Forward(x);
  CHECK_OK(y.status());
  return *std::move(y);
}

Tensor Backward(Module& m, const Tensor& dy) {
  absl::StatusOr<Tensor> dx = m.Backward(dy);
  CHECK_OK(dx.status());
  return *std::move(dx);
}

// L = sum(dy * y) in double.
double Loss(Module& m, const Tensor& x, const Vec& dy) {
  const Vec y = Values(Forward(m, x));
  double sum = 0.0;
  for (size_t i = 0; i < y.size(); ++i) sum += dy[i] * y[i];
  return sum;
}

// dL/dv[i] for every element of the f32 CPU tensor `v` (an input or a
// parameter of m), by central differences with step h.
Vec NumericGrad(Module& m, const Tensor& x, const Vec& dy, Tensor v) {
  constexpr float kStep = 1e-3f;
  float* data = v.data<float>();
  Vec g(v.numel());
  for (int64_t i = 0; i < v.numel(); ++i) {
    const float keep = data[i];
    data[i] = keep + kStep;
    const double up = Loss(m, x, dy);
    data[i] = keep - kStep;
    const double down = Loss(m, x, dy);
    data[i] = keep;
    g[i] = (up - down) / (2.0 * kStep);
  }
  return g;
}

// Elementwise relative 1e-3, with an absolute floor of 1e-3 of `scale`, the
// largest gradient element of the whole module: central differences of an
// f32 loss carry ~1e-4 absolute noise (f32 rounding of y over 2h), which
// dominates small elements and gradients that are zero exactly (a k bias
// shifts every score of a row equally, so softmax ignores it).
::testing::AssertionResult GradClose(const Vec& analytic, const Vec& numeric,
                                     double scale) {
  return AllClose(analytic, numeric, 1e-3, 1e-3 * scale);
}

double MaxAbs(const Vec& v) {
  double m = 0.0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}

// OLMoE's attention: q / k norms over the whole projections.
AttentionConfig WithQkNorm(AttentionConfig c) {
  c.qk_norm = true;
  return c;
}

std::vector<AttentionConfig> GradientConfigs() {
  return {
      WithQkNorm(Config(16, 4, 2, false, false, false, true)),       // GQA
      WithQkNorm(Config(12, 3, 1, false, true, false, true)),        // MQA
      Config(12, 3, 0, /*fused=*/true, true, true, /*rope=*/false),  // GPT-2
      Config(12, 3, 3, true, false, false, true),
      Config(12, 3, 0, false, false, false, true),  // Llama MHA
      Config(12, 3, 0, false, true, true, false),
      Config(12, 4, 2, false, false, false, false),  // GQA, hd = 3
      Config(12, 4, 2, true, true, true, false),     // fused GQA
      Config(12, 6, 2, false, true, false, true),    // GQA rep 3, hd = 2
      Config(16, 4, 2, false, false, false, true),   // Llama GQA
      Config(12, 3, 1, false, false, true, true),    // MQA
  };
}

TEST(AttentionTest, GradientsMatchFiniteDifferences) {
  for (AttentionConfig c : GradientConfigs()) {
    for (bool fused_core : {true, false}) {
      c.fused_attention = fused_core;
      SCOPED_TRACE(Describe(c));
      std::unique_ptr<CausalSelfAttention> m = MakeAttention(c, 100);
      Tensor x = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 1);
      Tensor dy = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 2);
      const Vec vdy = Values(dy);
      Forward(*m, x);
      const Vec dx = Values(Backward(*m, dy));
      // (name, analytic, numeric) for x and every parameter.
      std::vector<std::tuple<std::string, Vec, Vec>> grads;
      grads.emplace_back("x", dx, NumericGrad(*m, x, vdy, x));
      for (auto& [name, p] : m->NamedParameters()) {
        ASSERT_TRUE(p->grad.defined()) << name;
        grads.emplace_back(name, Values(p->grad),
                           NumericGrad(*m, x, vdy, p->data));
      }
      double scale = 0.0;
      for (const auto& [name, analytic, numeric] : grads) {
        scale = std::max(scale, MaxAbs(numeric));
      }
      for (const auto& [name, analytic, numeric] : grads) {
        EXPECT_TRUE(GradClose(analytic, numeric, scale)) << name;
      }
    }
  }
}

// The fused core (the default) against the unfused reference path on the
// same weights and inputs: output, input gradient and every parameter
// gradient, f32 and bf16, including a sequence longer than one kernel tile.
TEST(AttentionTest, FusedCoreMatchesTheUnfusedPath) {
  for (AttentionConfig c : GradientConfigs()) {
    c.max_seq_len = 70;
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat(Describe(c), " ", DTypeName(dtype)));
      c.param_dtype = dtype;
      Tensor x = RandomTensor({kBatch, 70, c.dim}, dtype, 3);
      Tensor dy = RandomTensor({kBatch, 70, c.dim}, dtype, 4);
      std::map<std::string, Vec> grads[2];
      Vec y[2], dx[2];
      for (int fused = 0; fused < 2; ++fused) {
        c.fused_attention = fused == 1;
        std::unique_ptr<CausalSelfAttention> m = MakeAttention(c, 200);
        y[fused] = Values(Forward(*m, x));
        dx[fused] = Values(Backward(*m, dy));
        for (auto& [name, p] : m->NamedParameters()) {
          grads[fused][name] = Values(p->grad);
        }
      }
      // f32: both accumulate in f32 in different orders. bf16: the unfused
      // path rounds the probabilities and dS to bf16 for its matmuls, the
      // fused one keeps them in f32, so they differ by bf16 roundings.
      const double tol = dtype == DType::kF32 ? 2e-5 : 3e-2;
      EXPECT_TRUE(AllClose(y[1], y[0], tol, tol)) << "y";
      EXPECT_TRUE(AllClose(dx[1], dx[0], tol, tol)) << "dx";
      for (const auto& [name, g] : grads[0]) {
        EXPECT_TRUE(AllClose(grads[1][name], g, tol, tol)) << name;
      }
    }
  }
}

// ------------------------------------------- independent double reference

// y for x [B, T, C] computed with plain loops in double from the module's
// parameter values: projections, HF rotate_half RoPE, kv head g = h / rep.
Vec ReferenceForward(const AttentionConfig& c, CausalSelfAttention& m,
                     const Vec& x, int64_t batch, int64_t seq) {
  const int64_t dim = c.dim, h_n = c.n_heads, kv_n = c.kv_heads(),
                hd = c.head_dim(), rep = h_n / kv_n;
  std::map<std::string, Vec> p;
  for (auto& [name, param] : m.NamedParameters()) p[name] = Values(param->data);
  // Linear: out[r, o] = sum_i in[r, i] w[row0 + o, i] + bias[row0 + o].
  auto linear = [&](const Vec& in, int64_t rows, int64_t in_f,
                    const std::string& mod, int64_t row0, int64_t out_f) {
    const Vec& w = p[mod + ".weight"];
    const bool has_bias = p.count(mod + ".bias") > 0;
    Vec out(rows * out_f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out_f; ++o) {
        double s = has_bias ? p[mod + ".bias"][row0 + o] : 0.0;
        for (int64_t i = 0; i < in_f; ++i) {
          s += in[r * in_f + i] * w[(row0 + o) * in_f + i];
        }
        out[r * out_f + o] = s;
      }
    }
    return out;
  };
  const int64_t rows = batch * seq;
  Vec q, k, v;  // [B, T, heads, hd]
  if (c.fused_qkv) {
    q = linear(x, rows, dim, "c_attn", 0, h_n * hd);
    k = linear(x, rows, dim, "c_attn", h_n * hd, kv_n * hd);
    v = linear(x, rows, dim, "c_attn", (h_n + kv_n) * hd, kv_n * hd);
  } else {
    q = linear(x, rows, dim, "wq", 0, h_n * hd);
    k = linear(x, rows, dim, "wk", 0, kv_n * hd);
    v = linear(x, rows, dim, "wv", 0, kv_n * hd);
  }
  // qk_norm: each row of the whole projection scaled by 1 / rms (+ eps).
  auto rms_norm = [&](Vec& t, int64_t width, const std::string& mod) {
    if (!c.qk_norm) return;
    const Vec& w = p[mod + ".weight"];
    for (int64_t r = 0; r < rows; ++r) {
      double sq = 0.0;
      for (int64_t i = 0; i < width; ++i)
        sq += t[r * width + i] * t[r * width + i];
      const double inv = 1.0 / std::sqrt(sq / width + c.qk_norm_eps);
      for (int64_t i = 0; i < width; ++i) t[r * width + i] *= inv * w[i];
    }
  };
  rms_norm(q, h_n * hd, "q_norm");
  rms_norm(k, kv_n * hd, "k_norm");
  auto rope = [&](Vec& t, int64_t heads) {
    if (!c.rope) return;
    const int64_t half = hd / 2;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t s = 0; s < seq; ++s) {
        for (int64_t h = 0; h < heads; ++h) {
          double* row = &t[((b * seq + s) * heads + h) * hd];
          for (int64_t i = 0; i < half; ++i) {
            const double angle =
                s * std::pow(static_cast<double>(c.rope_theta),
                             -2.0 * i / static_cast<double>(hd));
            const double a = row[i], bb = row[i + half];
            row[i] = a * std::cos(angle) - bb * std::sin(angle);
            row[i + half] = bb * std::cos(angle) + a * std::sin(angle);
          }
        }
      }
    }
  };
  rope(q, h_n);
  rope(k, kv_n);
  Vec merged(rows * h_n * hd, 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < h_n; ++h) {
      const int64_t g = h / rep;
      for (int64_t tq = 0; tq < seq; ++tq) {
        Vec score(tq + 1);
        double max = -INFINITY;
        for (int64_t tk = 0; tk <= tq; ++tk) {
          double s = 0.0;
          for (int64_t d = 0; d < hd; ++d) {
            s += q[((b * seq + tq) * h_n + h) * hd + d] *
                 k[((b * seq + tk) * kv_n + g) * hd + d];
          }
          score[tk] = s / std::sqrt(static_cast<double>(hd));
          max = std::max(max, score[tk]);
        }
        double z = 0.0;
        for (double& s : score) z += (s = std::exp(s - max));
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0.0;
          for (int64_t tk = 0; tk <= tq; ++tk) {
            o += score[tk] / z * v[((b * seq + tk) * kv_n + g) * hd + d];
          }
          merged[((b * seq + tq) * h_n + h) * hd + d] = o;
        }
      }
    }
  }
  return linear(merged, rows, h_n * hd, c.fused_qkv ? "c_proj" : "wo", 0, dim);
}

TEST(AttentionTest, ForwardMatchesDoubleReference) {
  AttentionConfig llama = Config(16, 4, 2, false, false, false, true);
  llama.rope_theta = 500000.0f;
  llama.max_seq_len = 7;
  for (const AttentionConfig& c :
       {Config(12, 3, 0, true, true, true, false), llama,
        Config(12, 6, 2, false, true, true, true), WithQkNorm(llama)}) {
    SCOPED_TRACE(Describe(c));
    std::unique_ptr<CausalSelfAttention> m = MakeAttention(c, 7);
    for (int64_t seq : {int64_t{1}, kSeq, c.max_seq_len}) {
      Tensor x = RandomTensor({3, seq, c.dim}, DType::kF32, 3);
      EXPECT_TRUE(AllClose(Values(Forward(*m, x)),
                           ReferenceForward(c, *m, Values(x), 3, seq), 1e-5,
                           1e-5))
          << "T=" << seq;
    }
  }
}

// ------------------------------------------------------------- properties

TEST(AttentionTest, IsCausal) {
  for (const AttentionConfig& c :
       {Config(12, 3, 0, true, true, true, false),
        Config(16, 4, 2, false, false, false, true)}) {
    SCOPED_TRACE(Describe(c));
    std::unique_ptr<CausalSelfAttention> m = MakeAttention(c, 11);
    Tensor x = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 4);
    const Vec y = Values(Forward(*m, x));
    for (int64_t t0 = 0; t0 < kSeq; ++t0) {
      Tensor x2 = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 5);
      ASSERT_TRUE(Copy(x, &x2).ok());
      float* data = x2.data<float>();
      for (int64_t b = 0; b < kBatch; ++b) {
        for (int64_t j = 0; j < c.dim; ++j) {
          data[(b * kSeq + t0) * c.dim + j] += 0.75f;
        }
      }
      const Vec y2 = Values(Forward(*m, x2));
      for (int64_t b = 0; b < kBatch; ++b) {
        for (int64_t t = 0; t < kSeq; ++t) {
          double diff = 0.0;
          for (int64_t j = 0; j < c.dim; ++j) {
            const int64_t i = (b * kSeq + t) * c.dim + j;
            diff = std::max(diff, std::fabs(y2[i] - y[i]));
          }
          if (t < t0) {
            EXPECT_EQ(diff, 0.0) << "y at t=" << t << " moved with x at " << t0;
          } else {
            EXPECT_GT(diff, 1e-4) << "y at t=" << t << " ignores x at " << t0;
          }
        }
      }
    }
  }
}

TEST(AttentionTest, GradientsAccumulateAcrossBackwardCalls) {
  const AttentionConfig c = Config(12, 4, 2, true, true, true, false);
  std::unique_ptr<CausalSelfAttention> m = MakeAttention(c, 21);
  Tensor x = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 6);
  Tensor dy = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 7);
  Forward(*m, x);
  const Vec dx1 = Values(Backward(*m, dy));
  std::map<std::string, Vec> once;
  for (auto& [name, p] : m->NamedParameters()) once[name] = Values(p->grad);

  // Saved activations are released: a second Backward needs a new Forward.
  EXPECT_EQ(m->Backward(dy).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Forward(*m, x);
  EXPECT_TRUE(AllClose(Values(Backward(*m, dy)), dx1, 0, 0));
  for (auto& [name, p] : m->NamedParameters()) {
    Vec twice = once[name];
    for (double& g : twice) g *= 2.0;
    EXPECT_TRUE(AllClose(Values(p->grad), twice, 1e-6, 1e-7)) << name;
  }
  ASSERT_TRUE(m->ZeroGrad().ok());
  for (auto& [name, p] : m->NamedParameters()) {
    EXPECT_TRUE(AllClose(Values(p->grad), Vec(p->grad.numel(), 0.0), 0, 0));
  }

  // ReleaseSavedTensors frees what Forward saved (here and in the children).
  Forward(*m, x);
  m->ReleaseSavedTensors();
  EXPECT_EQ(m->Backward(dy).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// ||a - b|| / ||b||.
double RelativeError(const Vec& a, const Vec& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

TEST(AttentionTest, Bf16TracksF32) {
  for (const AttentionConfig& c :
       {Config(12, 3, 0, true, true, true, false),
        Config(16, 4, 2, false, false, false, true)}) {
    SCOPED_TRACE(Describe(c));
    std::unique_ptr<CausalSelfAttention> m32 = MakeAttention(c, 31);
    AttentionConfig c16 = c;
    c16.param_dtype = DType::kBF16;
    absl::StatusOr<std::unique_ptr<CausalSelfAttention>> m16 =
        CausalSelfAttention::Create(c16);
    ASSERT_TRUE(m16.ok()) << m16.status();
    ASSERT_TRUE((*m16)->ToEmpty(Device::Cpu()).ok());
    auto p32 = m32->NamedParameters();
    auto p16 = (*m16)->NamedParameters();
    ASSERT_EQ(p32.size(), p16.size());
    for (size_t i = 0; i < p32.size(); ++i) {
      ASSERT_EQ(p32[i].first, p16[i].first);
      ASSERT_TRUE(Copy(p32[i].second->data, &p16[i].second->data).ok());
    }
    Tensor x32 = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 8);
    Tensor x16 = *Tensor::Empty(x32.shape(), DType::kBF16, Device::Cpu());
    ASSERT_TRUE(Copy(x32, &x16).ok());
    Tensor dy32 = RandomTensor({kBatch, kSeq, c.dim}, DType::kF32, 9);
    Tensor dy16 = *Tensor::Empty(dy32.shape(), DType::kBF16, Device::Cpu());
    ASSERT_TRUE(Copy(dy32, &dy16).ok());

    const Vec y32 = Values(Forward(*m32, x32));
    Tensor y16 = Forward(**m16, x16);
    EXPECT_EQ(y16.dtype(), DType::kBF16);
    EXPECT_TRUE(AllClose(Values(y16), y32, 2e-2, 2e-2 * MaxAbs(y32)));
    EXPECT_LT(RelativeError(Values(y16), y32), 1e-2);

    // Backward in bf16 too (loose: bf16 storage of every intermediate).
    const Vec dx32 = Values(Backward(*m32, dy32));
    Tensor dx16 = Backward(**m16, dy16);
    EXPECT_EQ(dx16.dtype(), DType::kBF16);
    EXPECT_LT(RelativeError(Values(dx16), dx32), 3e-2);
    for (size_t i = 0; i < p32.size(); ++i) {
      EXPECT_LT(RelativeError(Values(p16[i].second->grad),
                              Values(p32[i].second->grad)),
                3e-2)
          << p32[i].first;
    }

    // f32 weights with bf16 activations (mixed precision): the projections
    // cast the weights; gradients stay f32.
    std::vector<Vec> grads32;
    for (auto& [name, p] : p32) grads32.push_back(Values(p->grad));
    ASSERT_TRUE(m32->ZeroGrad().ok());
    Tensor y_mixed = Forward(*m32, x16);
    EXPECT_EQ(y_mixed.dtype(), DType::kBF16);
    EXPECT_LT(RelativeError(Values(y_mixed), y32), 1e-2);
    Tensor dx_mixed = Backward(*m32, dy16);
    EXPECT_EQ(dx_mixed.dtype(), DType::kBF16);
    EXPECT_LT(RelativeError(Values(dx_mixed), dx32), 3e-2);
    for (size_t i = 0; i < p32.size(); ++i) {
      EXPECT_EQ(p32[i].second->grad.dtype(), DType::kF32);
      EXPECT_LT(RelativeError(Values(p32[i].second->grad), grads32[i]), 3e-2)
          << p32[i].first;
    }
  }
}

TEST(AttentionTest, ParameterNamesAndShapes) {
  std::unique_ptr<CausalSelfAttention> gpt2 =
      *CausalSelfAttention::Create(AttentionConfig::Gpt2(12, 3, 8));
  std::vector<std::pair<std::string, Shape>> expected = {
      {"c_attn.weight", {36, 12}},
      {"c_attn.bias", {36}},
      {"c_proj.weight", {12, 12}},
      {"c_proj.bias", {12}}};
  std::vector<std::pair<std::string, Shape>> actual;
  for (auto& [name, p] : gpt2->NamedParameters("attn")) {
    actual.emplace_back(name, p->shape);
  }
  for (auto& [name, shape] : expected) name = "attn." + name;
  EXPECT_EQ(actual, expected);

  std::unique_ptr<CausalSelfAttention> llama =
      *CausalSelfAttention::Create(AttentionConfig::Llama(16, 4, 2, 8));
  EXPECT_TRUE(llama->config().rope);
  EXPECT_EQ(llama->config().rope_theta, 500000.0f);
  expected = {{"wq.weight", {16, 16}},
              {"wk.weight", {8, 16}},
              {"wv.weight", {8, 16}},
              {"wo.weight", {16, 16}}};
  actual.clear();
  for (auto& [name, p] : llama->NamedParameters()) {
    actual.emplace_back(name, p->shape);
  }
  EXPECT_EQ(actual, expected);

  AttentionConfig olmoe = AttentionConfig::Llama(16, 4, 2, 8);
  olmoe.qk_norm = true;
  std::unique_ptr<CausalSelfAttention> normed =
      *CausalSelfAttention::Create(olmoe);
  expected.push_back({"q_norm.weight", {16}});
  expected.push_back({"k_norm.weight", {8}});
  actual.clear();
  for (auto& [name, p] : normed->NamedParameters()) {
    actual.emplace_back(name, p->shape);
  }
  EXPECT_EQ(actual, expected);
}

TEST(AttentionTest, RejectsBadConfigsAndInputs) {
  const AttentionConfig good = Config(12, 4, 2, false, false, false, false);
  std::vector<AttentionConfig> bad(8, good);
  bad[6] = WithQkNorm(Config(12, 4, 2, /*fused=*/true, false, false, false));
  bad[7] = WithQkNorm(good);
  bad[7].qk_norm_eps = 0.0f;
  bad[0].dim = 0;
  bad[1].n_heads = 5;     // does not divide 12
  bad[2].n_kv_heads = 3;  // does not divide 4
  bad[3].rope = true;     // head_dim 3 is odd
  bad[4].max_seq_len = 0;
  bad[5].param_dtype = DType::kI32;
  for (const AttentionConfig& c : bad) {
    EXPECT_EQ(CausalSelfAttention::Create(c).status().code(),
              absl::StatusCode::kInvalidArgument)
        << Describe(c);
  }
  std::unique_ptr<CausalSelfAttention> m = MakeAttention(good, 1);
  for (const Shape& shape :
       {Shape{2, 9, 12}, Shape{2, 5, 11}, Shape{10, 12}, Shape{2, 0, 12}}) {
    Tensor x = RandomTensor(shape, DType::kF32, 1);
    EXPECT_EQ(m->Forward(x).status().code(), absl::StatusCode::kInvalidArgument)
        << ShapeToString(shape);
  }
  EXPECT_EQ(
      m->Backward(RandomTensor({2, 5, 12}, DType::kF32, 1)).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST(AttentionTest, RunsOnMetaForShapes) {
  std::unique_ptr<CausalSelfAttention> m =
      *CausalSelfAttention::Create(AttentionConfig::Llama(16, 4, 2, 8));
  Tensor x = *Tensor::Empty({2, 7, 16}, DType::kBF16, Device::Meta());
  absl::StatusOr<Tensor> y = m->Forward(x);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(y->is_meta());
  EXPECT_EQ(y->shape(), x.shape());
  EXPECT_EQ(y->dtype(), DType::kBF16);
  absl::StatusOr<Tensor> dx = m->Backward(*y);
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_TRUE(dx->is_meta());
  EXPECT_EQ(dx->shape(), x.shape());
}

// ------------------------------------------------------------ RoPE kernel

TEST(RopeKernelTest, RotatesHalvesByPositionTimesInverseFrequency) {
  constexpr int64_t kHeadDim = 8;
  const std::vector<float> inv_freq =
      kernels::RopeInvFreqs(10000.0f, kHeadDim, {});
  std::vector<float> x(kHeadDim), y(kHeadDim);
  for (int64_t i = 0; i < kHeadDim; ++i) x[i] = 0.1f * (i + 1) - 0.3f;
  for (int64_t position : {0, 1, 7, 1000}) {
    kernels::RopeRowForward(x.data(), position, inv_freq.data(), kHeadDim,
                            y.data());
    for (int64_t i = 0; i < kHeadDim / 2; ++i) {
      const double angle = position * std::pow(10000.0, -2.0 * i / kHeadDim);
      const double a = x[i], b = x[i + kHeadDim / 2];
      EXPECT_NEAR(y[i], a * std::cos(angle) - b * std::sin(angle), 2e-5);
      EXPECT_NEAR(y[i + kHeadDim / 2],
                  b * std::cos(angle) + a * std::sin(angle), 2e-5);
    }
  }
  // Position 0 is the identity.
  kernels::RopeRowForward(x.data(), 0, inv_freq.data(), kHeadDim, y.data());
  EXPECT_EQ(x, y);
}

TEST(RopeKernelTest, BackwardIsTheInverseRotation) {
  constexpr int64_t kHeadDim = 6;
  std::vector<float> x = {0.3f, -1.2f, 0.7f, 2.0f, -0.4f, 0.9f};
  for (float theta : {10000.0f, 500000.0f}) {
    const std::vector<float> inv_freq =
        kernels::RopeInvFreqs(theta, kHeadDim, {});
    for (int64_t position : {1, 3, 4095}) {
      std::vector<float> y(kHeadDim), back(kHeadDim);
      kernels::RopeRowForward(x.data(), position, inv_freq.data(), kHeadDim,
                              y.data());
      kernels::RopeRowBackward(y.data(), position, inv_freq.data(), kHeadDim,
                               back.data());
      double norm_x = 0.0, norm_y = 0.0;
      for (int64_t i = 0; i < kHeadDim; ++i) {
        EXPECT_NEAR(back[i], x[i], 1e-6);
        norm_x += x[i] * x[i];
        norm_y += y[i] * y[i];
      }
      EXPECT_NEAR(norm_y, norm_x, 1e-5);
      // In place (y aliases x), both directions, in bf16 storage too.
      std::vector<BFloat16> row(kHeadDim);
      for (int64_t i = 0; i < kHeadDim; ++i) row[i] = FromFloat<BFloat16>(x[i]);
      kernels::RopeRowForward(row.data(), position, inv_freq.data(), kHeadDim,
                              row.data());
      kernels::RopeRowBackward(row.data(), position, inv_freq.data(), kHeadDim,
                               row.data());
      for (int64_t i = 0; i < kHeadDim; ++i) {
        EXPECT_NEAR(ToFloat(row[i]), x[i], 2e-2 * std::fabs(x[i]) + 1e-2);
      }
    }
  }
}

// Llama-3.2-1B's scaling (head_dim 64, theta 500000, factor 32, low 1, high
// 4, original 8192) against the band rule in double precision: every pair
// falls in one of the three bands, and each band occurs.
TEST(RopeKernelTest, Llama3ScalingSlowsLongWavelengthsAndBlendsTheMiddle) {
  constexpr int64_t kHeadDim = 64;
  constexpr double kTheta = 500000.0;
  const kernels::RopeScaling scaling = {32.0f, 1.0f, 4.0f, 8192.0f};
  const std::vector<float> scaled =
      kernels::RopeInvFreqs(kTheta, kHeadDim, scaling);
  const std::vector<float> plain = kernels::RopeInvFreqs(kTheta, kHeadDim, {});
  int kept = 0, slowed = 0, blended = 0;
  for (int64_t i = 0; i < kHeadDim / 2; ++i) {
    const double f = std::pow(kTheta, -2.0 * i / kHeadDim);
    const double wavelength = 2.0 * M_PI / f;
    double want;
    if (wavelength < 8192.0 / 4.0) {
      want = f;
      ++kept;
      EXPECT_EQ(scaled[i], plain[i]) << "pair " << i;
    } else if (wavelength > 8192.0 / 1.0) {
      want = f / 32.0;
      ++slowed;
    } else {
      // Linear in 1 / wavelength between f / 32 (at 8192) and f (at 2048).
      const double s = (8192.0 / wavelength - 1.0) / (4.0 - 1.0);
      EXPECT_GT(s, 0.0);
      EXPECT_LT(s, 1.0);
      want = (1.0 - s) * f / 32.0 + s * f;
      ++blended;
    }
    EXPECT_NEAR(scaled[i], want, 2e-6 * want) << "pair " << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(slowed, 0);
  EXPECT_GT(blended, 0);
  // Disabled (factor 0) is the plain table theta^(-2i / head_dim).
  for (int64_t i = 0; i < kHeadDim / 2; ++i) {
    const double f = std::pow(kTheta, -2.0 * i / kHeadDim);
    EXPECT_NEAR(plain[i], f, 3e-7 * f) << "pair " << i;
  }
}

TEST(AttentionConfigTest, BadRopeScalingIsRejected) {
  AttentionConfig c = AttentionConfig::Llama(64, 4, 2, 16);
  c.rope_scaling.factor = 0.5f;
  EXPECT_EQ(CausalSelfAttention::Create(c).status().message(),
            "CausalSelfAttention: rope_scaling.factor must be >= 1 (dim 64, "
            "n_heads 4, n_kv_heads 2, max_seq_len 16)");
  c.rope_scaling.factor = 8.0f;
  c.rope_scaling.low_freq_factor = 4.0f;
  c.rope_scaling.high_freq_factor = 4.0f;
  EXPECT_EQ(
      CausalSelfAttention::Create(c).status().message(),
      "CausalSelfAttention: rope_scaling needs 0 < low_freq_factor < "
      "high_freq_factor (dim 64, n_heads 4, n_kv_heads 2, max_seq_len 16)");
  c.rope_scaling.low_freq_factor = 1.0f;
  c.rope_scaling.original_context = 0.0f;
  EXPECT_EQ(CausalSelfAttention::Create(c).status().message(),
            "CausalSelfAttention: rope_scaling.original_context must be "
            "positive (dim 64, n_heads 4, n_kv_heads 2, max_seq_len 16)");
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
