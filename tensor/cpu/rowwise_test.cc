// The vectorised row-wise kernels against the scalar reference of
// tensor/kernels/rowwise.h on every Highway target this CPU supports: odd row
// lengths around the vector widths, unaligned starts, every float dtype.
// Row results are held to the reference within a tolerance (the kernels sum
// lane-wise and use ExpApprox, see rowwise.h); column sums (bias and norm
// weight gradients) and RoPE are compared bit for bit.
#include "tensor/cpu/rowwise.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "tensor/cpu/simd_testing.h"
#include "tensor/kernels/rope.h"
#include "tensor/kernels/rowwise.h"

namespace fsdpp {
namespace cpu {
namespace rowwise {
namespace {

using testing_util::Bits;
using testing_util::Buffer;
using testing_util::EachTarget;
using testing_util::kFloatTypes;

// Row lengths around 4, 8 and 16 lanes, and longer rows.
const int64_t kLengths[] = {1, 3, 8, 15, 16, 17, 33, 100, 769};

// Relative tolerance of one stored result: f32 for reordered sums over up to
// ~1000 elements, two units in the last place of the 16-bit types (the two
// paths may round a value that lies near a midpoint to different sides).
double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4e-6;
    case DType::kBF16:
      return 2.0 / 128;
    default:
      return 2.0 / 1024;
  }
}

std::vector<float> Random(int64_t n, uint32_t seed, float lo = -2.0f,
                          float hi = 2.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Calls fn(T()) with the storage type of `dtype`.
template <class Fn>
void WithType(DType dtype, Fn&& fn) {
  if (dtype == DType::kF32) {
    fn(float());
  } else if (dtype == DType::kBF16) {
    fn(BFloat16());
  } else {
    fn(Float16());
  }
}

template <typename T>
T* Typed(Buffer& b) {
  return static_cast<T*>(b.data());
}

// Every element of got within tolerance of want: |got - want| <= tol *
// (scale + |want|), scale being the magnitude of the row's results, plus two
// of f16's subnormal steps (2^-24 each, a fixed absolute unit) in f16.
void ExpectClose(Buffer& got, Buffer& want, int64_t n, double scale,
                 const std::string& where) {
  const double tol = Tolerance(got.dtype);
  for (int64_t i = 0; i < n; ++i) {
    const double g = got.Get(i), w = want.Get(i);
    const double floor = got.dtype == DType::kF16 ? std::ldexp(2.0, -24) : 0.0;
    ASSERT_LE(std::fabs(g - w), tol * (scale + std::fabs(w)) + floor)
        << where << " element " << i << ": got " << g << ", reference " << w;
  }
}

void ExpectBitwise(Buffer& got, Buffer& want, int64_t n,
                   const std::string& where) {
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(Bits(got, i), Bits(want, i))
        << where << " element " << i << ": got " << got.Get(i) << ", reference "
        << want.Get(i);
  }
}

std::string Where(int64_t target, DType dtype, int64_t rows, int64_t n,
                  int64_t offset) {
  return absl::StrCat(hwy::TargetName(target), " ", DTypeName(dtype),
                      " rows=", rows, " n=", n, " offset=", offset);
}

TEST(RowwiseTest, SoftmaxForwardAndBackwardMatchTheReference) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t n : kLengths) {
        // tq = n queries per head, keys = n + offset: the causal variants.
        for (int64_t causal : {-1, 0, 2}) {
          const int64_t tq = n, keys = causal < 0 ? n : n + causal;
          const int64_t rows = 2 * tq, offset = n % 2;
          const std::string where =
              absl::StrCat(Where(target, dtype, rows, keys, offset),
                           " causal_offset=", causal);
          Buffer x(dtype, Random(rows * keys, 1 + n, -6.0f, 6.0f), offset);
          Buffer dy(dtype, Random(rows * keys, 2 + n), 0);
          Buffer y(dtype, std::vector<float>(rows * keys), 1);
          Buffer want(dtype, std::vector<float>(rows * keys), 0);
          SoftmaxForward(dtype, x.data(), rows, keys, tq, causal, y.data());
          WithType(dtype, [&](auto t) {
            using T = decltype(t);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t valid =
                  causal < 0 ? keys : std::min(keys, r % tq + causal + 1);
              kernels::SoftmaxRowForward(Typed<T>(x) + r * keys, keys, valid,
                                         Typed<T>(want) + r * keys);
            }
          });
          ExpectClose(y, want, rows * keys, 0.0, where + " forward");
          // Masked entries are exactly zero.
          for (int64_t r = 0; causal >= 0 && r < rows; ++r) {
            for (int64_t j = std::min(keys, r % tq + causal + 1); j < keys;
                 ++j) {
              ASSERT_EQ(Bits(y, r * keys + j), 0u) << where;
            }
          }
          Buffer dx(dtype, std::vector<float>(rows * keys), 0);
          Buffer want_dx(dtype, std::vector<float>(rows * keys), 0);
          SoftmaxBackward(dtype, y.data(), dy.data(), rows, keys, dx.data());
          WithType(dtype, [&](auto t) {
            using T = decltype(t);
            for (int64_t r = 0; r < rows; ++r) {
              kernels::SoftmaxRowBackward(Typed<T>(y) + r * keys,
                                          Typed<T>(dy) + r * keys, keys,
                                          Typed<T>(want_dx) + r * keys);
            }
          });
          // dx = y (dy - dot): its scale is that of y |dy| ~ 2.
          ExpectClose(dx, want_dx, rows * keys, 2.0, where + " backward");
        }
      }
    }
  }
}

// LayerNorm (with and without bias) and RMSNorm, forward and backward.
TEST(RowwiseTest, NormsMatchTheReferenceAndTheirColumnSumsBitForBit) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t c : kLengths) {
        for (bool rms : {false, true}) {
          for (bool with_bias : {false, true}) {
            if (rms && with_bias) continue;
            const int64_t rows = 37, offset = c % 3;
            const std::string where = absl::StrCat(
                Where(target, dtype, rows, c, offset),
                rms ? " RMSNorm" : " LayerNorm", with_bias ? " with bias" : "");
            // An offset mean, so the two-pass variance matters.
            Buffer x(dtype, Random(rows * c, 3 + c, 1.0f, 5.0f), offset);
            Buffer w(dtype, Random(c, 4 + c, 0.5f, 1.5f), 1);
            Buffer b(dtype, Random(c, 5 + c), 0);
            Buffer dy(dtype, Random(rows * c, 6 + c), 1);
            const void* bias = with_bias ? b.data() : nullptr;
            Buffer out(dtype, std::vector<float>(rows * c), 0);
            Buffer want(dtype, std::vector<float>(rows * c), 0);
            std::vector<float> mean(rows), rstd(rows), want_mean(rows),
                want_rstd(rows);
            Buffer dx(dtype, std::vector<float>(rows * c), 1);
            Buffer want_dx(dtype, std::vector<float>(rows * c), 0);
            // Gradients accumulate into non-zero values.
            Buffer dw(dtype, Random(c, 7 + c), 0);
            Buffer want_dw(dtype, Random(c, 7 + c), 1);
            Buffer db(dtype, Random(c, 8 + c), 1);
            Buffer want_db(dtype, Random(c, 8 + c), 0);
            if (rms) {
              RmsNormForward(dtype, x.data(), w.data(), 1e-5f, rows, c,
                             out.data(), rstd.data());
              RmsNormBackward(dtype, dy.data(), x.data(), w.data(), rstd.data(),
                              rows, c, dx.data(), dw.data());
            } else {
              LayerNormForward(dtype, x.data(), w.data(), bias, 1e-5f, rows, c,
                               out.data(), mean.data(), rstd.data());
              LayerNormBackward(dtype, dy.data(), x.data(), w.data(),
                                mean.data(), rstd.data(), rows, c, dx.data(),
                                dw.data(), with_bias ? db.data() : nullptr);
            }
            WithType(dtype, [&](auto t) {
              using T = decltype(t);
              const T* pb = with_bias ? Typed<T>(b) : nullptr;
              for (int64_t r = 0; r < rows; ++r) {
                const T* xr = Typed<T>(x) + r * c;
                const T* dyr = Typed<T>(dy) + r * c;
                if (rms) {
                  kernels::RmsNormRowForward(xr, Typed<T>(w), c, 1e-5f,
                                             Typed<T>(want) + r * c,
                                             &want_rstd[r]);
                  // The reference backward from the kernel's own rstd, so
                  // dx compares the backward alone.
                  kernels::RmsNormRowBackward(dyr, xr, Typed<T>(w), rstd[r], c,
                                              Typed<T>(want_dx) + r * c);
                } else {
                  kernels::LayerNormRowForward(xr, Typed<T>(w), pb, c, 1e-5f,
                                               Typed<T>(want) + r * c,
                                               &want_mean[r], &want_rstd[r]);
                  kernels::LayerNormRowBackward(dyr, xr, Typed<T>(w), mean[r],
                                                rstd[r], c,
                                                Typed<T>(want_dx) + r * c);
                }
              }
              for (int64_t j = 0; j < c; ++j) {
                if (rms) {
                  kernels::RmsNormColumnBackward(Typed<T>(dy), Typed<T>(x),
                                                 rstd.data(), rows, c, j,
                                                 Typed<T>(want_dw));
                } else {
                  kernels::LayerNormColumnBackward(
                      Typed<T>(dy), Typed<T>(x), mean.data(), rstd.data(), rows,
                      c, j, Typed<T>(want_dw),
                      with_bias ? Typed<T>(want_db) : nullptr);
                }
              }
            });
            // Normalised values are O(1), times weights ~1 plus bias ~2.
            ExpectClose(out, want, rows * c, 3.0, where + " forward");
            for (int64_t r = 0; r < rows; ++r) {
              ASSERT_NEAR(rstd[r], want_rstd[r], 4e-6 * want_rstd[r]) << where;
              if (!rms) {
                ASSERT_NEAR(mean[r], want_mean[r], 4e-6 * want_mean[r])
                    << where;
              }
            }
            // dx ~ rstd * |dy w|: rstd is ~1 for LayerNorm and ~1/3 for RMS.
            ExpectClose(dx, want_dx, rows * c, 3.0, where + " backward dx");
            ExpectBitwise(dw, want_dw, c, where + " dweight");
            if (with_bias) ExpectBitwise(db, want_db, c, where + " dbias");
          }
        }
      }
    }
  }
}

TEST(RowwiseTest, CrossEntropyMatchesTheReferenceWithIgnoredRows) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  const int64_t kIgnore = -100;
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t v : {1, 7, 16, 17, 100, 5003}) {
        const int64_t n = 9, offset = v % 2;
        const std::string where = Where(target, dtype, n, v, offset);
        Buffer logits(dtype, Random(n * v, 9 + v, -8.0f, 8.0f), offset);
        std::vector<int64_t> targets(n);
        std::mt19937 rng(v);
        for (int64_t i = 0; i < n; ++i) {
          targets[i] = i % 4 == 3 ? kIgnore : static_cast<int64_t>(rng() % v);
        }
        targets[0] = v - 1;  // The last class, in the scalar tail.
        std::vector<float> dlosses = Random(n, 10 + v, 0.1f, 2.0f);
        std::vector<float> losses(n, -1.0f), lse(n, -1.0f);
        CrossEntropyForward(dtype, logits.data(), targets.data(), n, v, kIgnore,
                            losses.data(), lse.data());
        Buffer dlogits(dtype, std::vector<float>(n * v, 5.0f), 1);
        Buffer dlogits_lse(dtype, std::vector<float>(n * v, 5.0f), 1);
        Buffer want(dtype, std::vector<float>(n * v), 0);
        CrossEntropyBackward(dtype, logits.data(), targets.data(),
                             dlosses.data(), nullptr, n, v, kIgnore,
                             dlogits.data());
        // With the forward's log-sum-exp: one pass, the same gradient.
        CrossEntropyBackward(dtype, logits.data(), targets.data(),
                             dlosses.data(), lse.data(), n, v, kIgnore,
                             dlogits_lse.data());
        WithType(dtype, [&](auto t) {
          using T = decltype(t);
          for (int64_t i = 0; i < n; ++i) {
            const T* row = Typed<T>(logits) + i * v;
            const float ref =
                kernels::CrossEntropyRowForward(row, v, targets[i], kIgnore);
            // The loss is f32 from the same stored logits in every dtype.
            ASSERT_NEAR(losses[i], ref, 4e-6 * (1.0 + std::fabs(ref)))
                << where << " row " << i;
            if (targets[i] == kIgnore) {
              ASSERT_EQ(losses[i], 0.0f) << where;
              ASSERT_EQ(lse[i], 0.0f) << where;
            } else {
              double max = ToFloat(row[0]), sum = 0;
              for (int64_t j = 0; j < v; ++j) {
                max = std::max<double>(max, ToFloat(row[j]));
              }
              for (int64_t j = 0; j < v; ++j) {
                sum += std::exp(ToFloat(row[j]) - max);
              }
              const double want_lse = max + std::log(sum);
              ASSERT_NEAR(lse[i], want_lse, 4e-6 * (1.0 + std::fabs(want_lse)))
                  << where << " row " << i;
            }
            kernels::CrossEntropyRowBackward(row, v, targets[i], kIgnore,
                                             dlosses[i],
                                             Typed<T>(want) + i * v);
          }
        });
        // dlogits are probabilities times dloss <= 2.
        ExpectClose(dlogits, want, n * v, 2.0, where + " backward");
        ExpectClose(dlogits_lse, want, n * v, 2.0, where + " backward (lse)");
        for (int64_t i = 3; i < n; i += 4) {
          for (int64_t j = 0; j < v; ++j) {
            ASSERT_EQ(Bits(dlogits, i * v + j), 0u) << where << " ignored row";
            ASSERT_EQ(Bits(dlogits_lse, i * v + j), 0u)
                << where << " ignored row (lse)";
          }
        }
      }
    }
  }
}

// Loss parallel's per-slice statistics and backward against the scalar
// rows of tensor/kernels/rowwise.h.
TEST(RowwiseTest, CrossEntropyShardsMatchTheReference) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t v : {1, 7, 17, 100, 5003}) {
        const int64_t n = 6, offset = v % 2;
        const std::string where = Where(target, dtype, n, v, offset);
        Buffer logits(dtype, Random(n * v, 19 + v, -8.0f, 8.0f), offset);
        // Here, elsewhere (-1), ignored, and the slice's last column.
        const std::vector<int64_t> local = {0, -1, v - 1, -1, v / 2, v - 1};
        const bool ignored[] = {false, false, false, true, false, false};
        std::vector<float> mx(n), se(n), tl(n);
        CrossEntropyShardStats(dtype, logits.data(), local.data(), ignored, n,
                               v, mx.data(), se.data(), tl.data());
        std::vector<float> dlosses = Random(n, 20 + v, 0.1f, 2.0f);
        // The whole row's statistics: this slice's, widened a little.
        std::vector<float> gmax(n), gsum(n);
        for (int64_t i = 0; i < n; ++i) {
          gmax[i] = mx[i] + 0.5f;
          gsum[i] = se[i] * std::exp(-0.5f) + 3.0f;
        }
        Buffer dlogits(dtype, std::vector<float>(n * v, 5.0f), 1);
        Buffer want(dtype, std::vector<float>(n * v), 0);
        CrossEntropyShardBackward(dtype, logits.data(), local.data(), ignored,
                                  gmax.data(), gsum.data(), dlosses.data(), n,
                                  v, dlogits.data());
        WithType(dtype, [&](auto t) {
          using T = decltype(t);
          for (int64_t i = 0; i < n; ++i) {
            const T* row = Typed<T>(logits) + i * v;
            if (ignored[i]) {
              ASSERT_EQ(mx[i], 0.0f) << where;
              ASSERT_EQ(se[i], 0.0f) << where;
              ASSERT_EQ(tl[i], 0.0f) << where;
              continue;
            }
            float rmx, rse, rtl;
            kernels::CrossEntropyShardRowStats(row, v, local[i], &rmx, &rse,
                                               &rtl);
            ASSERT_EQ(mx[i], rmx) << where << " row " << i;
            // Lane-wise against sequential f32 sums of up to 5003 terms.
            ASSERT_NEAR(se[i], rse, 2e-5 * rse) << where << " row " << i;
            ASSERT_EQ(tl[i], rtl) << where << " row " << i;
            kernels::CrossEntropyShardRowBackward(row, v, local[i], gmax[i],
                                                  gsum[i], dlosses[i],
                                                  Typed<T>(want) + i * v);
          }
          for (int64_t j = 0; j < v; ++j) want.Set(3 * v + j, 0.0f);
        });
        ExpectClose(dlogits, want, n * v, 2.0, where + " backward");
      }
    }
  }
}

TEST(RowwiseTest, CrossEntropyOfANanLogitIsNan) {
  const std::vector<float> row = {1.0f, std::numeric_limits<float>::quiet_NaN(),
                                  2.0f};
  for (int64_t v : {3}) {
    const int64_t target = 0;
    float loss = 0.0f;
    CrossEntropyForward(DType::kF32, row.data(), &target, 1, v, -100, &loss,
                        nullptr);
    EXPECT_TRUE(std::isnan(loss));
  }
  std::vector<float> wide(40, 0.5f);
  wide[21] = std::numeric_limits<float>::quiet_NaN();
  const int64_t target = 2;
  float loss = 0.0f;
  float lse = 0.0f;
  CrossEntropyForward(DType::kF32, wide.data(), &target, 1, 40, -100, &loss,
                      &lse);
  EXPECT_TRUE(std::isnan(loss));
  EXPECT_TRUE(std::isnan(lse));
}

TEST(RowwiseTest, SumRowsAccumulateMatchesTheScalarLoopBitForBit) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType x_dtype : kFloatTypes) {
      for (DType out_dtype : kFloatTypes) {
        for (int64_t cols : kLengths) {
          const int64_t rows = 29, offset = cols % 2;
          const std::string where =
              absl::StrCat(Where(target, x_dtype, rows, cols, offset), " into ",
                           DTypeName(out_dtype));
          Buffer x(x_dtype, Random(rows * cols, 11 + cols), offset);
          Buffer out(out_dtype, Random(cols, 12 + cols), 1);
          Buffer want(out_dtype, Random(cols, 12 + cols), 0);
          SumRowsAccumulate(x_dtype, x.data(), rows, cols, out_dtype,
                            out.data());
          for (int64_t j = 0; j < cols; ++j) {
            float acc = 0.0f;
            for (int64_t r = 0; r < rows; ++r) acc += x.Get(r * cols + j);
            want.Set(j, want.Get(j) + acc);
          }
          ExpectBitwise(out, want, cols, where);
        }
      }
    }
  }
}

TEST(RowwiseTest, RopeMatchesTheReferenceRowsBitForBit) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t hd : {2, 6, 16, 34, 64, 128}) {
        for (bool inverse : {false, true}) {
          const int64_t seq_len = 7, rows = 3 * seq_len, offset = hd % 3;
          const std::string where =
              absl::StrCat(Where(target, dtype, rows, hd, offset),
                           inverse ? " inverse" : " forward");
          const std::vector<float> inv_freq =
              kernels::RopeInvFreqs(10000.0f, hd, kernels::RopeScaling());
          const std::vector<float> values = Random(rows * hd, 16 + hd);
          Buffer got(dtype, values, offset);
          Buffer want(dtype, values, 0);
          Rope(dtype, got.data(), rows, seq_len, hd, inv_freq.data(), inverse);
          WithType(dtype, [&](auto t) {
            using T = decltype(t);
            for (int64_t r = 0; r < rows; ++r) {
              T* row = Typed<T>(want) + r * hd;
              if (inverse) {
                kernels::RopeRowBackward(row, r % seq_len, inv_freq.data(), hd,
                                         row);
              } else {
                kernels::RopeRowForward(row, r % seq_len, inv_freq.data(), hd,
                                        row);
              }
            }
          });
          ExpectBitwise(got, want, rows * hd, where);
        }
      }
    }
  }
}

TEST(RowwiseTest, SumF64MatchesADoubleLoop) {
  EachTarget each;
  ASSERT_FALSE(each.targets().empty());
  for (int64_t target : each.targets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (DType dtype : kFloatTypes) {
      for (int64_t n : {0, 1, 7, 16, 17, 100, 4099}) {
        for (bool squares : {false, true}) {
          Buffer x(dtype, Random(n, 17 + n), n % 2);
          double want = 0.0;
          for (int64_t i = 0; i < n; ++i) {
            const double v = x.Get(i);
            want += squares ? v * v : v;
          }
          // Both in double from the same f32 values: only the order differs.
          EXPECT_NEAR(SumF64(dtype, x.data(), n, squares), want,
                      1e-12 * (1.0 + std::fabs(want)) * n)
              << Where(target, dtype, 1, n, n % 2)
              << (squares ? " squares" : " sum");
        }
      }
    }
  }
}

// Large enough to run on the OpenMP pool: the split by columns and by rows
// must give the single-threaded result.
TEST(RowwiseTest, ParallelRunsMatchTheReference) {
  const int64_t rows = 300, c = 768;
  Buffer x(DType::kF32, Random(rows * c, 13), 0);
  Buffer w(DType::kF32, Random(c, 14, 0.5f, 1.5f), 0);
  Buffer dy(DType::kF32, Random(rows * c, 15), 0);
  Buffer out(DType::kF32, std::vector<float>(rows * c), 0);
  Buffer dx(DType::kF32, std::vector<float>(rows * c), 0);
  Buffer dw(DType::kF32, std::vector<float>(c, 0.0f), 0);
  Buffer want_dw(DType::kF32, std::vector<float>(c, 0.0f), 0);
  std::vector<float> mean(rows), rstd(rows);
  LayerNormForward(DType::kF32, x.data(), w.data(), nullptr, 1e-5f, rows, c,
                   out.data(), mean.data(), rstd.data());
  LayerNormBackward(DType::kF32, dy.data(), x.data(), w.data(), mean.data(),
                    rstd.data(), rows, c, dx.data(), dw.data(), nullptr);
  for (int64_t j = 0; j < c; ++j) {
    kernels::LayerNormColumnBackward(
        Typed<float>(dy), Typed<float>(x), mean.data(), rstd.data(), rows, c, j,
        Typed<float>(want_dw), static_cast<float*>(nullptr));
  }
  ExpectBitwise(dw, want_dw, c, "parallel LayerNorm dweight");
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> want(c), want_dx(c);
    float m, s;
    kernels::LayerNormRowForward(Typed<float>(x) + r * c, Typed<float>(w),
                                 static_cast<const float*>(nullptr), c, 1e-5f,
                                 want.data(), &m, &s);
    kernels::LayerNormRowBackward(Typed<float>(dy) + r * c,
                                  Typed<float>(x) + r * c, Typed<float>(w),
                                  mean[r], rstd[r], c, want_dx.data());
    for (int64_t j = 0; j < c; ++j) {
      ASSERT_NEAR(out.Get(r * c + j), want[j],
                  4e-6 * (3.0 + std::fabs(want[j])));
      ASSERT_NEAR(dx.Get(r * c + j), want_dx[j],
                  4e-6 * (3.0 + std::fabs(want_dx[j])));
    }
  }
}

}  // namespace
}  // namespace rowwise
}  // namespace cpu
}  // namespace fsdpp
