// Every non-GEMM op against a plain double-precision reference, over odd and
// even sizes (1, primes, above the parallel threshold), in f32 and bf16 (f16
// for the elementwise ops). Every backward is checked against central finite
// differences of the double reference forward.
#include "tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using testing_util::AllClose;
using testing_util::RandomTensor;
using testing_util::RelTol;
using testing_util::Values;
using Vec = std::vector<double>;

Tensor EmptyLike(const Tensor& t) {
  return *Tensor::Empty(t.shape(), t.dtype(), t.device());
}

Tensor F32(const Shape& shape) {
  return *Tensor::Zeros(shape, DType::kF32, Device::Cpu());
}

// Gradient of scalar f at x by central differences (double precision).
Vec NumericGrad(const std::function<double(const Vec&)>& f, Vec x) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double h = 1e-6 * std::max(1.0, std::fabs(x[i]));
    const double keep = x[i];
    x[i] = keep + h;
    const double up = f(x);
    x[i] = keep - h;
    const double down = f(x);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// The same for functions whose rows are independent: row_loss(row, r) is
// the contribution of row r, so each perturbation re-evaluates one row.
Vec RowNumericGrad(const std::function<double(const Vec&, int64_t)>& row_loss,
                   const Vec& x, int64_t rows, int64_t cols) {
  Vec g(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    Vec row(x.begin() + r * cols, x.begin() + (r + 1) * cols);
    Vec gr = NumericGrad([&](const Vec& v) { return row_loss(v, r); }, row);
    std::copy(gr.begin(), gr.end(), g.begin() + r * cols);
  }
  return g;
}

// Row r of a [rows, cols] vector.
Vec Row(const Vec& v, int64_t r, int64_t cols) {
  return Vec(v.begin() + r * cols, v.begin() + (r + 1) * cols);
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double MaxAbs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Backward tolerance: f32 tight; 16-bit inputs/outputs loose, scaled to the
// largest gradient (cancellation in sums of rounded terms).
double BackwardAtol(DType dtype, const Vec& expected) {
  return dtype == DType::kF32 ? 1e-5 : 2e-2 * std::max(1e-3, MaxAbs(expected));
}
double BackwardRtol(DType dtype) { return dtype == DType::kF32 ? 1e-4 : 2e-2; }

// ------------------------------------------------------------ references

double GeluRef(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double SiluRef(double x) { return x / (1.0 + std::exp(-x)); }

Vec SoftmaxRef(const Vec& x, int64_t rows, int64_t n, bool causal, int64_t tq) {
  Vec y(x.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t valid = causal ? std::min(n, r % tq + (n - tq) + 1) : n;
    double mx = -INFINITY;
    for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, x[r * n + j]);
    double s = 0;
    for (int64_t j = 0; j < valid; ++j) s += std::exp(x[r * n + j] - mx);
    for (int64_t j = 0; j < valid; ++j)
      y[r * n + j] = std::exp(x[r * n + j] - mx) / s;
  }
  return y;
}

Vec LayerNormRef(const Vec& x, const Vec& w, const Vec* b, int64_t rows,
                 int64_t c, double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) mean += x[r * c + j];
    mean /= c;
    for (int64_t j = 0; j < c; ++j) var += std::pow(x[r * c + j] - mean, 2);
    var /= c;
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (int64_t j = 0; j < c; ++j) {
      y[r * c + j] = (x[r * c + j] - mean) * rstd * w[j] + (b ? (*b)[j] : 0.0);
    }
  }
  return y;
}

Vec RmsNormRef(const Vec& x, const Vec& w, int64_t rows, int64_t c,
               double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += x[r * c + j] * x[r * c + j];
    const double rstd = 1.0 / std::sqrt(ss / c + eps);
    for (int64_t j = 0; j < c; ++j) y[r * c + j] = x[r * c + j] * rstd * w[j];
  }
  return y;
}

Vec CrossEntropyRef(const Vec& logits, const std::vector<int64_t>& targets,
                    int64_t v, int64_t ignore) {
  Vec loss(targets.size(), 0.0);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == ignore) continue;
    double mx = -INFINITY;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, logits[i * v + j]);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(logits[i * v + j] - mx);
    loss[i] = std::log(s) + mx - logits[i * v + targets[i]];
  }
  return loss;
}

const DType kFloatTypes[] = {DType::kF32, DType::kBF16};
const int64_t kSizes[] = {1, 2, 7, 31, 64, 1000, 100003};

// ---------------------------------------------------------- elementwise

TEST(OpsTest, ElementwiseMatchReference) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " n=" << n);
      Tensor a = RandomTensor({n}, dtype, 1, -3, 3);
      Tensor b = RandomTensor({n}, dtype, 2, -3, 3);
      Vec va = Values(a), vb = Values(b);
      Tensor out = EmptyLike(a);
      const double rtol = RelTol(dtype),
                   atol = dtype == DType::kF32 ? 1e-6 : 1e-3;

      Vec ref(n);
      ASSERT_TRUE(Add(a, b, &out).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = va[i] + vb[i];
      EXPECT_TRUE(AllClose(Values(out), ref, rtol, atol)) << "Add";

      ASSERT_TRUE(Mul(a, b, &out).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = va[i] * vb[i];
      EXPECT_TRUE(AllClose(Values(out), ref, rtol, atol)) << "Mul";

      ASSERT_TRUE(Scale(a, -0.37f, &out).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = -0.37 * va[i];
      EXPECT_TRUE(AllClose(Values(out), ref, rtol, atol)) << "Scale";

      Tensor y = RandomTensor({n}, dtype, 3);
      Vec vy = Values(y);
      ASSERT_TRUE(Axpy(0.5f, a, &y).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = vy[i] + 0.5 * va[i];
      EXPECT_TRUE(AllClose(Values(y), ref, rtol, atol)) << "Axpy";

      ASSERT_TRUE(Gelu(a, &out).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = GeluRef(va[i]);
      EXPECT_TRUE(AllClose(Values(out), ref, rtol, atol)) << "Gelu";

      ASSERT_TRUE(Silu(a, &out).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = SiluRef(va[i]);
      EXPECT_TRUE(AllClose(Values(out), ref, rtol, atol)) << "Silu";

      // In place (out aliases an input).
      Tensor c = RandomTensor({n}, dtype, 4);
      Vec vc = Values(c);
      ASSERT_TRUE(Add(c, c, &c).ok());
      for (int64_t i = 0; i < n; ++i) ref[i] = 2 * vc[i];
      EXPECT_TRUE(AllClose(Values(c), ref, rtol, atol)) << "Add in place";
    }
  }
}

TEST(OpsTest, ActivationBackwardsMatchFiniteDifferences) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t n : {1, 7, 64, 1000}) {
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " n=" << n);
      Tensor x = RandomTensor({n}, dtype, 5, -4, 4);
      Tensor dy = RandomTensor({n}, dtype, 6);
      Vec vx = Values(x), vdy = Values(dy);
      Tensor dx = EmptyLike(x);
      for (bool gelu : {true, false}) {
        auto f = [&](const Vec& xs) {
          double s = 0;
          for (int64_t i = 0; i < n; ++i) {
            s += vdy[i] * (gelu ? GeluRef(xs[i]) : SiluRef(xs[i]));
          }
          return s;
        };
        Vec ref = NumericGrad(f, vx);
        ASSERT_TRUE(
            (gelu ? GeluBackward(x, dy, &dx) : SiluBackward(x, dy, &dx)).ok());
        EXPECT_TRUE(AllClose(Values(dx), ref, BackwardRtol(dtype),
                             BackwardAtol(dtype, ref)))
            << (gelu ? "GeluBackward" : "SiluBackward");
      }
    }
  }
}

TEST(OpsTest, CopyCastsAndFills) {
  for (DType from : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType to : {DType::kF32, DType::kBF16, DType::kF16}) {
      Tensor a = RandomTensor({3, 37}, from, 7, -100, 100);
      Tensor b = *Tensor::Empty({111}, to, Device::Cpu());
      ASSERT_TRUE(Copy(a, &b).ok());
      // Expected: each value rounded (RNE) into the target format.
      std::vector<float> src = *a.ToFloats();
      Tensor expected = *Tensor::FromFloats({111}, src, to);
      EXPECT_EQ(Values(b), Values(expected))
          << DTypeName(from) << "->" << DTypeName(to);
    }
  }
  Tensor t = *Tensor::Empty({100001}, DType::kBF16, Device::Cpu());
  ASSERT_TRUE(Fill(&t, 0.1f).ok());
  for (double v : Values(t))
    ASSERT_EQ(v, BFloat16ToFloat(FloatToBFloat16(0.1f)));
  ASSERT_TRUE(Zero(&t).ok());
  for (double v : Values(t)) ASSERT_EQ(v, 0.0);
  Tensor ids = *Tensor::FromInts({3}, {1, 2, 3}, DType::kI64);
  Tensor ids2 = *Tensor::Empty({3}, DType::kI64, Device::Cpu());
  ASSERT_TRUE(Copy(ids, &ids2).ok());
  EXPECT_EQ(Values(ids2), (Vec{1, 2, 3}));
}

// ------------------------------------------------------------- reductions

TEST(OpsTest, ReductionsMatchReference) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " n=" << n);
      Tensor x = RandomTensor({n}, dtype, 8, -1, 2);
      Vec vx = Values(x);
      double sum = 0, ss = 0;
      for (double v : vx) {
        sum += v;
        ss += v * v;
      }
      Tensor out = F32({1});
      ASSERT_TRUE(Sum(x, &out).ok());
      EXPECT_NEAR(*Item(out), sum,
                  1e-6 * std::max(1.0, std::fabs(sum)) + 1e-6 * n);
      ASSERT_TRUE(SumOfSquares(x, &out).ok());
      EXPECT_NEAR(*Item(out), ss, 1e-6 * ss + 1e-7);
    }
  }
}

TEST(OpsTest, SumRowsAccumulate) {
  for (DType dtype : kFloatTypes) {
    for (int64_t rows : {1, 3, 64}) {
      for (int64_t cols : {1, 7, 129}) {
        Tensor x = RandomTensor({rows, cols}, dtype, 9);
        Tensor out = RandomTensor({cols}, DType::kF32, 10);
        Vec vx = Values(x), ref = Values(out);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < cols; ++j) ref[j] += vx[r * cols + j];
        }
        ASSERT_TRUE(SumRowsAccumulate(x, &out).ok());
        EXPECT_TRUE(AllClose(Values(out), ref, 1e-5, 1e-5))
            << DTypeName(dtype) << " " << rows << "x" << cols;
      }
    }
  }
}

// ---------------------------------------------------------------- softmax

TEST(OpsTest, SoftmaxForwardAndBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 1},
                           {3, 2},
                           {5, 7},
                           {4, 64},
                           {2, 127},
                           {40, 1000}}) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " " << rows
                                        << "x" << n << " causal=" << causal);
        // Causal: view as [rows / tq, tq, n] with tq = min(rows, n).
        const int64_t tq = std::min(rows, n);
        const int64_t groups = (rows + tq - 1) / tq;
        const int64_t total_rows = causal ? groups * tq : rows;
        Shape shape = causal ? Shape{groups, tq, n} : Shape{total_rows, n};
        Tensor x = RandomTensor(shape, dtype, 11, -5, 5);
        Tensor y = EmptyLike(x);
        ASSERT_TRUE(Softmax(x, &y, causal).ok());
        Vec vx = Values(x);
        Vec ref = SoftmaxRef(vx, total_rows, n, causal, tq);
        EXPECT_TRUE(AllClose(Values(y), ref, RelTol(dtype), 1e-6));

        Tensor dy = RandomTensor(shape, dtype, 12);
        Vec vdy = Values(dy);
        Tensor dx = EmptyLike(x);
        ASSERT_TRUE(SoftmaxBackward(y, dy, &dx).ok());
        Vec gref = RowNumericGrad(
            [&](const Vec& row, int64_t r) {
              // Row r alone, with its causal mask (keys <= r % tq + n - tq).
              const int64_t valid =
                  causal ? std::min(n, r % tq + (n - tq) + 1) : n;
              Vec head(row.begin(), row.begin() + valid);
              Vec y = SoftmaxRef(head, 1, valid, false, 1);
              return Dot(Vec(vdy.begin() + r * n, vdy.begin() + r * n + valid),
                         y);
            },
            vx, total_rows, n);
        EXPECT_TRUE(AllClose(Values(dx), gref, BackwardRtol(dtype),
                             BackwardAtol(dtype, gref)));
      }
    }
  }
}

// -------------------------------------------------------------- norms

TEST(OpsTest, LayerNormForwardAndBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [rows, c] : {std::pair<int64_t, int64_t>{1, 1},
                           {1, 2},
                           {3, 7},
                           {8, 64},
                           {5, 131},
                           {37, 768}}) {
      for (bool with_bias : {true, false}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " " << rows
                                        << "x" << c << " bias=" << with_bias);
        const double eps = 1e-5;
        Tensor x = RandomTensor({rows, c}, dtype, 13, -2, 3);
        Tensor w = RandomTensor({c}, dtype, 14, 0.5, 1.5);
        Tensor b = RandomTensor({c}, dtype, 15);
        Tensor out = EmptyLike(x), mean = F32({rows}), rstd = F32({rows});
        ASSERT_TRUE(
            LayerNorm(x, w, with_bias ? &b : nullptr, eps, &out, &mean, &rstd)
                .ok());
        Vec vx = Values(x), vw = Values(w), vb = Values(b);
        Vec ref = LayerNormRef(vx, vw, with_bias ? &vb : nullptr, rows, c, eps);
        EXPECT_TRUE(AllClose(Values(out), ref, RelTol(dtype),
                             dtype == DType::kF32 ? 1e-5 : 2e-2));
        if (c == 1) continue;  // Output is the bias alone; grads degenerate.

        Tensor dy = RandomTensor({rows, c}, dtype, 16);
        Vec vdy = Values(dy);
        Tensor dx = EmptyLike(x);
        Tensor dw = RandomTensor({c}, dtype, 17);  // Accumulates onto this.
        Tensor db = RandomTensor({c}, dtype, 18);
        Vec dw0 = Values(dw), db0 = Values(db);
        ASSERT_TRUE(LayerNormBackward(dy, x, w, mean, rstd, &dx, &dw,
                                      with_bias ? &db : nullptr)
                        .ok());
        Vec gx = RowNumericGrad(
            [&](const Vec& row, int64_t r) {
              return Dot(
                  Row(vdy, r, c),
                  LayerNormRef(row, vw, with_bias ? &vb : nullptr, 1, c, eps));
            },
            vx, rows, c);
        Vec gw = NumericGrad(
            [&](const Vec& ws) {
              return Dot(vdy, LayerNormRef(vx, ws, with_bias ? &vb : nullptr,
                                           rows, c, eps));
            },
            vw);
        for (int64_t j = 0; j < c; ++j) gw[j] += dw0[j];
        EXPECT_TRUE(AllClose(Values(dx), gx, BackwardRtol(dtype),
                             BackwardAtol(dtype, gx)))
            << "dx";
        EXPECT_TRUE(AllClose(Values(dw), gw, BackwardRtol(dtype),
                             BackwardAtol(dtype, gw)))
            << "dweight";
        if (with_bias) {
          Vec gb = NumericGrad(
              [&](const Vec& bs) {
                return Dot(vdy, LayerNormRef(vx, vw, &bs, rows, c, eps));
              },
              vb);
          for (int64_t j = 0; j < c; ++j) gb[j] += db0[j];
          EXPECT_TRUE(AllClose(Values(db), gb, BackwardRtol(dtype),
                               BackwardAtol(dtype, gb)))
              << "dbias";
        } else {
          EXPECT_EQ(Values(db), db0);  // Untouched.
        }
      }
    }
  }
}

TEST(OpsTest, RmsNormForwardAndBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [rows, c] : {std::pair<int64_t, int64_t>{1, 1},
                           {2, 2},
                           {3, 7},
                           {8, 64},
                           {5, 131},
                           {19, 576}}) {
      SCOPED_TRACE(testing::Message()
                   << DTypeName(dtype) << " " << rows << "x" << c);
      const double eps = 1e-6;
      Tensor x = RandomTensor({rows, c}, dtype, 19, -2, 2);
      Tensor w = RandomTensor({c}, dtype, 20, 0.5, 1.5);
      Tensor out = EmptyLike(x), rstd = F32({rows});
      ASSERT_TRUE(RmsNorm(x, w, eps, &out, &rstd).ok());
      Vec vx = Values(x), vw = Values(w);
      EXPECT_TRUE(AllClose(Values(out), RmsNormRef(vx, vw, rows, c, eps),
                           RelTol(dtype), dtype == DType::kF32 ? 1e-5 : 2e-2));
      Tensor dy = RandomTensor({rows, c}, dtype, 21);
      Vec vdy = Values(dy);
      Tensor dx = EmptyLike(x), dw = *Tensor::Zeros({c}, dtype, Device::Cpu());
      ASSERT_TRUE(RmsNormBackward(dy, x, w, rstd, &dx, &dw).ok());
      Vec gx = RowNumericGrad(
          [&](const Vec& row, int64_t r) {
            return Dot(Row(vdy, r, c), RmsNormRef(row, vw, 1, c, eps));
          },
          vx, rows, c);
      Vec gw = NumericGrad(
          [&](const Vec& ws) {
            return Dot(vdy, RmsNormRef(vx, ws, rows, c, eps));
          },
          vw);
      EXPECT_TRUE(AllClose(Values(dx), gx, BackwardRtol(dtype),
                           BackwardAtol(dtype, gx)))
          << "dx";
      EXPECT_TRUE(AllClose(Values(dw), gw, BackwardRtol(dtype),
                           BackwardAtol(dtype, gw)))
          << "dweight";
    }
  }
}

// ------------------------------------------------------------ head layouts

// Element values of a float, i32 or i64 tensor, as double.
Vec AnyValues(const Tensor& t) {
  if (t.dtype() == DType::kI64) {
    const int64_t* p = t.data<int64_t>();
    return Vec(p, p + t.numel());
  }
  if (t.dtype() != DType::kI32) return Values(t);
  const int32_t* p = t.data<int32_t>();
  return Vec(p, p + t.numel());
}

TEST(OpsTest, SplitAndMergeHeadsMoveEachHeadAndLeaveTheOthers) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
    const int64_t b = 2, t = 3, heads = 5, hd = 4, first = 1, n = 3;
    SCOPED_TRACE(DTypeName(dtype));
    // Distinct small integers: exact in every dtype.
    std::vector<int64_t> ints(b * t * heads * hd);
    for (size_t i = 0; i < ints.size(); ++i) ints[i] = i + 1;
    const std::vector<float> floats(ints.begin(), ints.end());
    Tensor wide = dtype == DType::kI32
                      ? *Tensor::FromInts({b, t, heads, hd}, ints, DType::kI32)
                      : *Tensor::FromFloats({b, t, heads, hd}, floats, dtype);
    Tensor narrow = *Tensor::Empty({b, n, t, hd}, dtype, Device::Cpu());
    ASSERT_TRUE(SplitHeads(wide, first, &narrow).ok());
    const Vec vw = AnyValues(wide), vn = AnyValues(narrow);
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t h = 0; h < n; ++h) {
        for (int64_t i = 0; i < t; ++i) {
          for (int64_t j = 0; j < hd; ++j) {
            ASSERT_EQ(vn[((bi * n + h) * t + i) * hd + j],
                      vw[((bi * t + i) * heads + first + h) * hd + j]);
          }
        }
      }
    }
    // Back into a zeroed wide tensor: heads [first, first + n) return, the
    // others stay zero.
    Tensor back = *Tensor::Zeros(wide.shape(), dtype, Device::Cpu());
    ASSERT_TRUE(MergeHeads(narrow, first, &back).ok());
    const Vec vb = AnyValues(back);
    for (int64_t e = 0; e < b * t * heads * hd; ++e) {
      const int64_t h = (e / hd) % heads;
      ASSERT_EQ(vb[e], h >= first && h < first + n ? vw[e] : 0.0) << e;
    }
  }
}

TEST(OpsTest, CopyColumnsMovesOneRangePerRowAndLeavesTheRest) {
  for (DType dtype : {DType::kI32, DType::kI64, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int64_t rows = 3, s = 7, d = 5;
    std::vector<int64_t> ints(rows * s);
    for (size_t i = 0; i < ints.size(); ++i) ints[i] = i + 1;
    const std::vector<float> floats(ints.begin(), ints.end());
    Tensor src = IsFloatingPoint(dtype)
                     ? *Tensor::FromFloats({rows, s}, floats, dtype)
                     : *Tensor::FromInts({rows, s}, ints, dtype);
    Tensor dst = *Tensor::Zeros({rows, d}, dtype, Device::Cpu());
    ASSERT_TRUE(CopyColumns(src, 4, 3, &dst, 1).ok());
    const Vec vs = AnyValues(src), vd = AnyValues(dst);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < d; ++j) {
        ASSERT_EQ(vd[r * d + j], j >= 1 && j < 4 ? vs[r * s + 3 + j] : 0.0)
            << r << "," << j;
      }
    }
  }
}

TEST(OpsTest, CopyColumnsRejectsRangesOutsideTheRowsAndMismatches) {
  Tensor src = *Tensor::Zeros({2, 6}, DType::kI32, Device::Cpu());
  Tensor dst = *Tensor::Zeros({2, 4}, DType::kI32, Device::Cpu());
  const absl::Status range = CopyColumns(src, 4, 3, &dst, 0);
  EXPECT_EQ(range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(range.message().find("columns [4, 7) into [0, 3) are out of range"),
            std::string::npos)
      << range;
  EXPECT_EQ(CopyColumns(src, 0, 3, &dst, 2).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor rows3 = *Tensor::Zeros({3, 4}, DType::kI32, Device::Cpu());
  EXPECT_EQ(CopyColumns(src, 0, 2, &rows3, 0).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor i64 = *Tensor::Zeros({2, 4}, DType::kI64, Device::Cpu());
  EXPECT_EQ(CopyColumns(src, 0, 2, &i64, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(OpsTest, SplitHeadsRejectsMismatchedShapesAndHeadsOutOfRange) {
  Tensor wide = *Tensor::Zeros({2, 3, 4, 8}, DType::kF32, Device::Cpu());
  Tensor narrow = *Tensor::Zeros({2, 2, 3, 8}, DType::kF32, Device::Cpu());
  const absl::Status range = SplitHeads(wide, 3, &narrow);
  EXPECT_EQ(range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(range.message().find("heads [3, 5) are outside the 4"),
            std::string::npos)
      << range;
  Tensor bad_t = *Tensor::Zeros({2, 2, 5, 8}, DType::kF32, Device::Cpu());
  EXPECT_EQ(SplitHeads(wide, 0, &bad_t).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor bf16 = *Tensor::Zeros({2, 2, 3, 8}, DType::kBF16, Device::Cpu());
  EXPECT_EQ(MergeHeads(bf16, 0, &wide).code(),
            absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------- RoPE

TEST(OpsTest, RopeRotatesPairsByPositionAndItsInverseUndoesIt) {
  for (DType dtype : kFloatTypes) {
    for (int64_t hd : {2, 6, 64, 66}) {
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " hd=" << hd);
      const int64_t b = 2, n = 3, t = 5, half = hd / 2;
      std::vector<float> inv_freq(half);
      for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
      }
      Tensor x = RandomTensor({b, n, t, hd}, dtype, 40, -2, 2);
      const Vec vx = Values(x);
      Tensor y = *Tensor::Empty(x.shape(), dtype, Device::Cpu());
      ASSERT_TRUE(Copy(x, &y).ok());
      ASSERT_TRUE(Rope(&y, inv_freq, /*inverse=*/false).ok());
      Vec want(vx.size());
      for (int64_t r = 0; r < b * n * t; ++r) {
        const double p = r % t;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = p * inv_freq[i];
          const double a = vx[r * hd + i], c = vx[r * hd + i + half];
          want[r * hd + i] = a * std::cos(angle) - c * std::sin(angle);
          want[r * hd + i + half] = c * std::cos(angle) + a * std::sin(angle);
        }
      }
      EXPECT_TRUE(AllClose(Values(y), want, RelTol(dtype),
                           dtype == DType::kF32 ? 1e-5 : 3e-2));
      ASSERT_TRUE(Rope(&y, inv_freq, /*inverse=*/true).ok());
      EXPECT_TRUE(AllClose(Values(y), vx, RelTol(dtype),
                           dtype == DType::kF32 ? 1e-5 : 6e-2));
    }
  }
}

TEST(OpsTest, RopeRejectsOddHeadDimsWrongFrequencyCountsAndIntegers) {
  Tensor odd = *Tensor::Zeros({2, 3, 5}, DType::kF32, Device::Cpu());
  const absl::Status s1 = Rope(&odd, {1.0f, 1.0f}, false);
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s1.message().find("even head dim"), std::string::npos) << s1;
  Tensor x = *Tensor::Zeros({2, 3, 8}, DType::kF32, Device::Cpu());
  const absl::Status s2 = Rope(&x, {1.0f, 1.0f}, false);
  EXPECT_EQ(s2.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s2.message().find("2 frequencies for head dim 8"),
            std::string::npos)
      << s2;
  Tensor ints = *Tensor::Zeros({2, 4}, DType::kI32, Device::Cpu());
  EXPECT_EQ(Rope(&ints, {1.0f, 1.0f}, false).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------- embedding

TEST(OpsTest, EmbeddingGatherAndScatterAdd) {
  for (DType dtype : kFloatTypes) {
    for (DType id_type : {DType::kI32, DType::kI64}) {
      const int64_t v = 11, c = 37;
      std::vector<int64_t> id_values = {3, 0, 10, 3, 3, 7, 0};  // Repeats.
      const int64_t n = id_values.size();
      Tensor ids = *Tensor::FromInts({n}, id_values, id_type);
      Tensor table = RandomTensor({v, c}, dtype, 22);
      Tensor out = *Tensor::Empty({n, c}, dtype, Device::Cpu());
      ASSERT_TRUE(Embedding(ids, table, &out).ok());
      Vec vt = Values(table), vo = Values(out);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < c; ++j) {
          ASSERT_EQ(vo[i * c + j], vt[id_values[i] * c + j]);
        }
      }
      Tensor dout = RandomTensor({n, c}, dtype, 23);
      Tensor dtable = RandomTensor({v, c}, dtype, 24);
      Vec ref = Values(dtable), vd = Values(dout);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < c; ++j)
          ref[id_values[i] * c + j] += vd[i * c + j];
      }
      ASSERT_TRUE(EmbeddingBackward(ids, dout, &dtable).ok());
      EXPECT_TRUE(AllClose(Values(dtable), ref, RelTol(dtype) * 2,
                           dtype == DType::kF32 ? 1e-6 : 2e-2));
    }
  }
}

// A vocabulary-parallel table: each piece looks up only its rows (zeros for
// the others) and scatters only into them, so the pieces' outputs add up to
// the whole table's, and their gradients are the whole gradient's rows.
TEST(OpsTest, EmbeddingRowsOfAShardedTable) {
  for (DType dtype : kFloatTypes) {
    const int64_t v = 11, c = 9;
    const std::vector<int64_t> id_values = {3, 0, 10, 3, 7, 5, 0};
    const int64_t n = id_values.size();
    Tensor ids = *Tensor::FromInts({n}, id_values, DType::kI64);
    Tensor table = RandomTensor({v, c}, dtype, 31);
    Tensor dout = RandomTensor({n, c}, dtype, 32);
    Tensor full = *Tensor::Empty({n, c}, dtype, Device::Cpu());
    ASSERT_TRUE(Embedding(ids, table, &full).ok());
    Tensor dfull = *Tensor::Zeros({v, c}, dtype, Device::Cpu());
    ASSERT_TRUE(EmbeddingBackward(ids, dout, &dfull).ok());
    Vec sum(n * c, 0.0), vfull = Values(full), vdfull = Values(dfull);
    for (auto [begin, rows] :
         {std::pair<int64_t, int64_t>{0, 4}, {4, 4}, {8, 3}}) {
      Tensor piece = *table.Narrow(begin, rows);
      Tensor out = *Tensor::Empty({n, c}, dtype, Device::Cpu());
      ASSERT_TRUE(Embedding(ids, piece, &out, {begin, v}).ok());
      Vec vo = Values(out);
      for (int64_t i = 0; i < n; ++i) {
        const bool mine = id_values[i] >= begin && id_values[i] < begin + rows;
        for (int64_t j = 0; j < c; ++j) {
          if (!mine) {
            ASSERT_EQ(vo[i * c + j], 0.0);
          }
          sum[i * c + j] += vo[i * c + j];
        }
      }
      Tensor dpiece = *Tensor::Zeros({rows, c}, dtype, Device::Cpu());
      ASSERT_TRUE(EmbeddingBackward(ids, dout, &dpiece, {begin, v}).ok());
      const Vec vd = Values(dpiece);
      EXPECT_EQ(vd, Vec(vdfull.begin() + begin * c,
                        vdfull.begin() + (begin + rows) * c));
    }
    EXPECT_EQ(sum, vfull);
    // Ids are checked against the whole vocabulary, and the piece must fit.
    Tensor piece = *table.Narrow(4, 4);
    Tensor out = *Tensor::Empty({n, c}, dtype, Device::Cpu());
    EXPECT_EQ(Embedding(ids, piece, &out, {4, 10}).code(),
              absl::StatusCode::kInvalidArgument);  // id 10 >= vocab 10
    EXPECT_EQ(Embedding(ids, piece, &out, {8, 11}).code(),
              absl::StatusCode::kInvalidArgument);  // rows 8..12 > 11
  }
}

// ------------------------------------------------------ cross-entropy

TEST(OpsTest, CrossEntropyForwardAndBackward) {
  const int64_t kIgnore = -100;
  for (DType dtype : kFloatTypes) {
    for (auto [n, v] : {std::pair<int64_t, int64_t>{1, 1},
                        {1, 2},
                        {3, 7},
                        {6, 64},
                        {4, 1031}}) {
      SCOPED_TRACE(testing::Message()
                   << DTypeName(dtype) << " " << n << "x" << v);
      Tensor logits = RandomTensor({n, v}, dtype, 25, -4, 4);
      std::vector<int64_t> tv(n);
      for (int64_t i = 0; i < n; ++i) tv[i] = (i * 7 + 3) % v;
      if (n > 2) tv[1] = kIgnore;
      Tensor targets = *Tensor::FromInts({n}, tv, DType::kI32);
      Tensor losses = F32({n});
      ASSERT_TRUE(CrossEntropy(logits, targets, kIgnore, &losses).ok());
      Vec vl = Values(logits);
      Vec ref = CrossEntropyRef(vl, tv, v, kIgnore);
      EXPECT_TRUE(AllClose(Values(losses), ref,
                           dtype == DType::kF32 ? 1e-5 : 1e-3, 1e-5));

      Tensor dlosses = RandomTensor({n}, DType::kF32, 26, 0.1, 1.0);
      Vec vdl = Values(dlosses);
      Tensor dlogits = EmptyLike(logits);
      ASSERT_TRUE(
          CrossEntropyBackward(logits, targets, kIgnore, dlosses, &dlogits)
              .ok());
      Vec g = RowNumericGrad(
          [&](const Vec& row, int64_t r) {
            return vdl[r] * CrossEntropyRef(row, {tv[r]}, v, kIgnore)[0];
          },
          vl, n, v);
      EXPECT_TRUE(AllClose(Values(dlogits), g, BackwardRtol(dtype),
                           BackwardAtol(dtype, g)));

      // With the rows' log-sum-exp from the forward (0 where ignored): the
      // same losses, and the backward's one pass gives the same gradient, in
      // place too.
      Tensor lse = F32({n});
      Tensor losses2 = F32({n});
      ASSERT_TRUE(CrossEntropy(logits, targets, kIgnore, &losses2, &lse).ok());
      EXPECT_EQ(Values(losses2), Values(losses));
      const Vec vlse = Values(lse);
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        if (tv[i] != kIgnore) {
          double max = vl[i * v];
          for (int64_t j = 0; j < v; ++j) max = std::max(max, vl[i * v + j]);
          double sum = 0;
          for (int64_t j = 0; j < v; ++j) sum += std::exp(vl[i * v + j] - max);
          want = max + std::log(sum);
        }
        EXPECT_NEAR(vlse[i], want, 1e-5 * (1 + std::fabs(want))) << i;
      }
      Tensor dlogits_lse = EmptyLike(logits);
      ASSERT_TRUE(Copy(logits, &dlogits_lse).ok());
      ASSERT_TRUE(CrossEntropyBackward(dlogits_lse, targets, kIgnore, dlosses,
                                       &dlogits_lse, &lse)
                      .ok());
      EXPECT_TRUE(AllClose(Values(dlogits_lse), g, BackwardRtol(dtype),
                           BackwardAtol(dtype, g)));
      // One rounding of the dtype apart from the two-pass form.
      EXPECT_TRUE(AllClose(Values(dlogits_lse), Values(dlogits),
                           dtype == DType::kF32 ? 1e-5 : 2 * RelTol(dtype),
                           1e-6));
    }
  }
}

// Loss parallel: the vocabulary split into uneven slices; each slice's
// statistics, combined as parallel/ combines them across ranks, give the
// full row's loss, and each slice's backward is its columns of the full
// backward.
TEST(OpsTest, CrossEntropyShardsCombineToTheFullLoss) {
  const int64_t kIgnore = -100, n = 7, v = 37;
  const std::vector<std::pair<int64_t, int64_t>> slices = {
      {0, 10}, {10, 25}, {25, 37}};
  for (DType dtype : kFloatTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    Tensor logits = RandomTensor({n, v}, dtype, 41, -6, 6);
    // Targets in every slice, on its edges, and one ignored row.
    const std::vector<int64_t> tv = {0, 9, 10, kIgnore, 24, 25, 36};
    Tensor targets = *Tensor::FromInts({n}, tv, DType::kI64);
    Tensor losses = F32({n});
    ASSERT_TRUE(CrossEntropy(logits, targets, kIgnore, &losses).ok());
    Tensor dlosses = RandomTensor({n}, DType::kF32, 42, 0.1, 1.0);
    Tensor full_grad = EmptyLike(logits);
    ASSERT_TRUE(
        CrossEntropyBackward(logits, targets, kIgnore, dlosses, &full_grad)
            .ok());
    const Vec vl = Values(logits), vg = Values(full_grad);
    std::vector<Vec> maxes, sums, tlogits;
    std::vector<Tensor> parts;
    for (auto [begin, end] : slices) {
      const int64_t w = end - begin;
      std::vector<float> part_values(n * w);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < w; ++j) {
          part_values[i * w + j] = static_cast<float>(vl[i * v + begin + j]);
        }
      }
      Tensor part = *Tensor::FromFloats({n, w}, part_values, dtype);
      Tensor mx = F32({n}), se = F32({n}), tl = F32({n});
      ASSERT_TRUE(CrossEntropyShardStats(part, targets, begin, v, kIgnore, &mx,
                                         &se, &tl)
                      .ok());
      maxes.push_back(Values(mx));
      sums.push_back(Values(se));
      tlogits.push_back(Values(tl));
      parts.push_back(part);
    }
    // Combine: M = max of maxes, S = sum of sumexp * exp(max - M).
    std::vector<float> gmax(n), gsum(n);
    Vec combined(n);
    for (int64_t i = 0; i < n; ++i) {
      double m = -INFINITY, sum = 0, t = 0;
      for (size_t s = 0; s < slices.size(); ++s) m = std::max(m, maxes[s][i]);
      for (size_t s = 0; s < slices.size(); ++s) {
        sum += sums[s][i] * std::exp(maxes[s][i] - m);
        t += tlogits[s][i];
      }
      gmax[i] = static_cast<float>(m);
      gsum[i] = static_cast<float>(sum);
      combined[i] = tv[i] == kIgnore ? 0.0 : std::log(sum) + m - t;
      if (tv[i] == kIgnore) {
        for (size_t s = 0; s < slices.size(); ++s) {
          EXPECT_EQ(maxes[s][i], 0.0);
          EXPECT_EQ(sums[s][i], 0.0);
          EXPECT_EQ(tlogits[s][i], 0.0);
        }
      }
    }
    EXPECT_TRUE(AllClose(combined, Values(losses), 2e-6, 2e-6));
    Tensor max_t = *Tensor::FromFloats({n}, gmax);
    Tensor sum_t = *Tensor::FromFloats({n}, gsum);
    for (size_t s = 0; s < slices.size(); ++s) {
      const auto [begin, end] = slices[s];
      const int64_t w = end - begin;
      Tensor dpart = EmptyLike(parts[s]);
      ASSERT_TRUE(CrossEntropyShardBackward(parts[s], targets, begin, v,
                                            kIgnore, max_t, sum_t, dlosses,
                                            &dpart)
                      .ok());
      Vec want(n * w);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < w; ++j) want[i * w + j] = vg[i * v + begin + j];
      }
      EXPECT_TRUE(AllClose(Values(dpart), want, RelTol(dtype),
                           dtype == DType::kF32 ? 1e-6 : 1e-2))
          << "slice " << begin;
    }
  }
}

TEST(OpsTest, CrossEntropyShardsRejectSlicesOutsideTheVocabularyAndBadTargets) {
  Tensor logits = RandomTensor({2, 5}, DType::kF32, 43);
  Tensor mx = F32({2}), se = F32({2}), tl = F32({2});
  Tensor targets = *Tensor::FromInts({2}, {1, 7}, DType::kI32);
  absl::Status s =
      CrossEntropyShardStats(logits, targets, 6, 10, -100, &mx, &se, &tl);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[6, 11) is outside the vocabulary of 10"),
            std::string::npos)
      << s;
  Tensor far = *Tensor::FromInts({2}, {1, 10}, DType::kI32);
  s = CrossEntropyShardStats(logits, far, 5, 10, -100, &mx, &se, &tl);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("id 10 at position 1"), std::string::npos) << s;
  Tensor short_max = F32({1});
  EXPECT_EQ(CrossEntropyShardBackward(logits, targets, 5, 10, -100, short_max,
                                      se, se, &logits)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------- meta

TEST(OpsTest, MetaTensorsValidateAndDoNothing) {
  Tensor x = *Tensor::Empty({4, 8}, DType::kF32, Device::Meta());
  Tensor w = *Tensor::Empty({8}, DType::kF32, Device::Meta());
  Tensor out = *Tensor::Empty({4, 8}, DType::kF32, Device::Meta());
  Tensor stats = *Tensor::Empty({4}, DType::kF32, Device::Meta());
  EXPECT_TRUE(RmsNorm(x, w, 1e-5f, &out, &stats).ok());
  Tensor wt = *Tensor::Empty({16, 8}, DType::kF32, Device::Meta());
  Tensor y = *Tensor::Empty({4, 16}, DType::kF32, Device::Meta());
  EXPECT_TRUE(Matmul(x, wt, &y, MatmulOptions{false, true}).ok());
  Tensor bad = *Tensor::Empty({4, 15}, DType::kF32, Device::Meta());
  EXPECT_FALSE(Matmul(x, wt, &bad, MatmulOptions{false, true}).ok());
}

}  // namespace
}  // namespace fsdpp
