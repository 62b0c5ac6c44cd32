// Runs every op on cuda:0 and on the CPU with the same inputs and compares.
//
// The GPU kernels compute the CPU backend's math (tensor/kernels/*.h) with
// their own reduction order, so the two agree up to rounding: f32 to 1e-4,
// bf16 to 1e-2 (one storage rounding may differ), f16 to 2e-3, relative with
// an equal absolute floor for values near zero. Attention in bf16 / f16 runs
// on cuDNN, which rounds P and dS to the storage type before its matmuls:
// 2e-2 / 5e-3 of the largest value (AttentionTol). Without a GPU every test
// skips visibly in SetUp; the target only builds under --config=cuda.
#include "tensor/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "core/cuda_runtime.h"
#include "core/logging.h"
#include "gtest/gtest.h"
#include "tensor/cuda/cublaslt_matmul.h"
#include "tensor/cuda/cudnn_attention.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using testing_util::AllClose;
using testing_util::RandomTensor;
using testing_util::Values;

constexpr Device kGpu = Device::Cuda(0);

// Comparison tolerance (relative, and absolute near zero) per storage type.
double Tol(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 1e-2;
    case DType::kF16:
      return 2e-3;
    default:
      return 1e-4;
  }
}

// Attention's tolerance, relative and of the largest reference value: cuDNN's
// where it runs (bf16 / f16), else Tol.
double AttentionTol(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2e-2;
    case DType::kF16:
      return 5e-3;
    default:
      return 1e-4;
  }
}

// The same values on the CPU and on cuda:0.
struct Pair {
  Tensor cpu, gpu;
  const Tensor& on(bool gpu_side) const { return gpu_side ? gpu : cpu; }
  Tensor* ptr(bool gpu_side) { return gpu_side ? &gpu : &cpu; }
};

Tensor ToGpu(const Tensor& cpu) {
  absl::StatusOr<Tensor> t = Tensor::Empty(cpu.shape(), cpu.dtype(), kGpu);
  CHECK_OK(t.status());
  CHECK_OK(Copy(cpu, &*t));
  return *std::move(t);
}

Pair Random(const Shape& shape, DType dtype, uint64_t seed, float lo = -1.0f,
            float hi = 1.0f) {
  Tensor cpu = RandomTensor(shape, dtype, seed, lo, hi);
  Tensor gpu = ToGpu(cpu);
  return Pair{cpu, gpu};
}

Pair Zeros(const Shape& shape, DType dtype) {
  absl::StatusOr<Tensor> cpu = Tensor::Zeros(shape, dtype, Device::Cpu());
  absl::StatusOr<Tensor> gpu = Tensor::Zeros(shape, dtype, kGpu);
  CHECK_OK(cpu.status());
  CHECK_OK(gpu.status());
  return Pair{*cpu, *gpu};
}

Pair Ids(const Shape& shape, const std::vector<int64_t>& values, DType dtype) {
  absl::StatusOr<Tensor> cpu =
      Tensor::FromInts(shape, values, dtype, Device::Cpu());
  absl::StatusOr<Tensor> gpu = Tensor::FromInts(shape, values, dtype, kGpu);
  CHECK_OK(cpu.status());
  CHECK_OK(gpu.status());
  return Pair{*cpu, *gpu};
}

// Runs op(false) on the CPU tensors and op(true) on the GPU tensors.
::testing::AssertionResult Both(const std::function<absl::Status(bool)>& op) {
  for (bool gpu_side : {false, true}) {
    const absl::Status s = op(gpu_side);
    if (!s.ok()) {
      return ::testing::AssertionFailure()
             << (gpu_side ? "cuda:0: " : "cpu: ") << s;
    }
  }
  return ::testing::AssertionSuccess();
}

// The GPU result matches the CPU result.
::testing::AssertionResult Match(const Pair& p, double tol) {
  return AllClose(Values(p.gpu), Values(p.cpu), tol, tol);
}

// Within `tol` relative plus `tol` of the CPU result's largest magnitude.
::testing::AssertionResult MatchScaled(const Pair& p, double tol) {
  const std::vector<double> expected = Values(p.cpu);
  double max_abs = 1e-3;
  for (double x : expected) max_abs = std::max(max_abs, std::fabs(x));
  return AllClose(Values(p.gpu), expected, tol, tol * max_abs);
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RegisterCudaAllocators();
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

template <typename P>
class GpuTestWithParam : public GpuTest,
                         public ::testing::WithParamInterface<P> {};

// Float ops, parameterised by storage type.
using CudaOpsTest = GpuTestWithParam<DType>;

std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) {
  return DTypeName(info.param);
}

INSTANTIATE_TEST_SUITE_P(AllFloat, CudaOpsTest,
                         ::testing::Values(DType::kF32, DType::kBF16,
                                           DType::kF16),
                         DTypeParamName);

const int64_t kSizes[] = {1, 7, 1000, 100003};

TEST_P(CudaOpsTest, UnaryOps) {
  const DType dtype = GetParam();
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Pair x = Random({n}, dtype, 1, -3, 3);
    Pair out = Zeros({n}, dtype);
    ASSERT_TRUE(
        Both([&](bool g) { return Scale(x.on(g), 0.37f, out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "Scale";
    ASSERT_TRUE(Both([&](bool g) { return Gelu(x.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "Gelu";
    ASSERT_TRUE(Both([&](bool g) { return Silu(x.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "Silu";
  }
}

TEST_P(CudaOpsTest, BinaryOps) {
  const DType dtype = GetParam();
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Pair a = Random({n}, dtype, 2, -3, 3);
    Pair b = Random({n}, dtype, 3);
    Pair out = Zeros({n}, dtype);
    ASSERT_TRUE(
        Both([&](bool g) { return Add(a.on(g), b.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "Add";
    ASSERT_TRUE(
        Both([&](bool g) { return Mul(a.on(g), b.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "Mul";
    ASSERT_TRUE(Both(
        [&](bool g) { return GeluBackward(a.on(g), b.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "GeluBackward";
    ASSERT_TRUE(Both(
        [&](bool g) { return SiluBackward(a.on(g), b.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "SiluBackward";
    ASSERT_TRUE(Both([&](bool g) { return Axpy(-1.5f, b.on(g), a.ptr(g)); }));
    EXPECT_TRUE(Match(a, Tol(dtype))) << "Axpy";
  }
}

TEST_P(CudaOpsTest, FillAndCopy) {
  const DType dtype = GetParam();
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Pair t = Zeros({n}, dtype);
    ASSERT_TRUE(Both([&](bool g) { return Fill(t.ptr(g), 0.3f); }));
    EXPECT_TRUE(Match(t, 0.0)) << "Fill";
    // Large values exercise rounding, tiny ones f16 subnormals; both stay
    // finite in every type (AllClose rejects inf - inf).
    for (float range : {60000.0f, 1e-4f}) {
      Pair x = Random({n}, dtype, 4, -range, range);
      for (DType to : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(::testing::Message()
                     << "to " << DTypeName(to) << " range " << range);
        Pair y = Zeros({n}, to);
        ASSERT_TRUE(Both([&](bool g) { return Copy(x.on(g), y.ptr(g)); }));
        EXPECT_TRUE(Match(y, 0.0)) << "Copy";
        // Across devices with a cast: staged, then converted on cuda:0.
        Tensor z = *Tensor::Zeros({n}, to, kGpu);
        ASSERT_TRUE(Copy(x.cpu, &z).ok());
        EXPECT_TRUE(AllClose(Values(z), Values(y.cpu), 0.0, 0.0))
            << "cpu -> cuda:0 Copy";
      }
    }
  }
}

TEST_P(CudaOpsTest, OverlappingCopy) {
  const DType dtype = GetParam();
  const int64_t n = 1001;
  Pair buf = Random({n + 3}, dtype, 5);
  for (bool forward : {false, true}) {
    ASSERT_TRUE(Both([&](bool g) -> absl::Status {
      const Tensor& t = buf.on(g);
      absl::StatusOr<Tensor> lo = t.Narrow(0, n);
      absl::StatusOr<Tensor> hi = t.Narrow(3, n);
      if (!lo.ok()) return lo.status();
      if (!hi.ok()) return hi.status();
      return forward ? Copy(*lo, &*hi) : Copy(*hi, &*lo);
    }));
    EXPECT_TRUE(Match(buf, 0.0)) << (forward ? "forward" : "backward");
  }
}

TEST_P(CudaOpsTest, Reductions) {
  const DType dtype = GetParam();
  for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{100003},
                    int64_t{300007}}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Pair x = Random({n}, dtype, 6, -1, 2);
    Pair out = Zeros({1}, DType::kF32);
    ASSERT_TRUE(Both([&](bool g) { return Sum(x.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, 1e-5)) << "Sum";
    const std::vector<double> first = Values(out.gpu);
    ASSERT_TRUE(Sum(x.gpu, &out.gpu).ok());
    EXPECT_EQ(Values(out.gpu), first) << "Sum is not reproducible";
    ASSERT_TRUE(
        Both([&](bool g) { return SumOfSquares(x.on(g), out.ptr(g)); }));
    EXPECT_TRUE(Match(out, 1e-5)) << "SumOfSquares";
  }
}

TEST_P(CudaOpsTest, SumRowsAccumulate) {
  const DType dtype = GetParam();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1},
                            {37, 53},
                            {1000, 3},
                            {5, 4099},
                            {2049, 768}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    Pair x = Random({rows, cols}, dtype, 7);
    for (DType out_dtype : {DType::kF32, dtype}) {
      Pair out = Random({cols}, out_dtype, 8);
      ASSERT_TRUE(
          Both([&](bool g) { return SumRowsAccumulate(x.on(g), out.ptr(g)); }));
      EXPECT_TRUE(Match(out, Tol(out_dtype))) << DTypeName(out_dtype);
    }
  }
}

TEST_P(CudaOpsTest, Softmax) {
  const DType dtype = GetParam();
  for (bool causal : {false, true}) {
    for (const Shape& shape :
         {Shape{1, 1}, Shape{3, 5, 17}, Shape{2, 7, 11}, Shape{4, 300}}) {
      SCOPED_TRACE(::testing::Message()
                   << ShapeToString(shape) << " causal=" << causal);
      Pair x = Random(shape, dtype, 9, -4, 4);
      Pair y = Zeros(shape, dtype);
      ASSERT_TRUE(
          Both([&](bool g) { return Softmax(x.on(g), y.ptr(g), causal); }));
      EXPECT_TRUE(Match(y, Tol(dtype))) << "Softmax";
      Pair dy = Random(shape, dtype, 10);
      Pair dx = Zeros(shape, dtype);
      // Both sides differentiate the CPU's y, so only the backward differs.
      y.gpu = ToGpu(y.cpu);
      ASSERT_TRUE(Both([&](bool g) {
        return SoftmaxBackward(y.on(g), dy.on(g), dx.ptr(g));
      }));
      EXPECT_TRUE(Match(dx, Tol(dtype))) << "SoftmaxBackward";
    }
  }
}

TEST_P(CudaOpsTest, CausalAttention) {
  const DType dtype = GetParam();
  // [B, H, T, hd] queries against [B, KV, T, hd] keys and values: MHA, GQA,
  // one token, a T over the CPU kernel's tiles. In bf16 / f16 cuDNN runs
  // the forward where hd is a multiple of 8 and the backward also needs
  // T > 1: the calls it ran are counted below.
  const int64_t cudnn_calls = gpu::CudnnAttention::ForDevice(0)->calls();
  int64_t expected_cudnn_calls = 0;
  for (const auto& [b, h, kv, t, hd] :
       {std::tuple{1, 1, 1, 1, 8}, std::tuple{2, 4, 2, 37, 12},
        std::tuple{1, 2, 1, 130, 64}, std::tuple{2, 3, 3, 256, 64}}) {
    SCOPED_TRACE(::testing::Message()
                 << b << "x" << h << "/" << kv << "x" << t << "x" << hd);
    const Shape qs{b, h, t, hd}, ks{b, kv, t, hd};
    Pair q = Random(qs, dtype, 21, -2, 2), k = Random(ks, dtype, 22, -2, 2),
         v = Random(ks, dtype, 23);
    Pair out = Zeros(qs, dtype), lse = Zeros({b, h, t}, DType::kF32);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    ASSERT_TRUE(Both([&](bool g) {
      return CausalAttention(q.on(g), k.on(g), v.on(g), scale, out.ptr(g),
                             lse.ptr(g));
    }));
    const double tol = AttentionTol(dtype);
    EXPECT_TRUE(MatchScaled(out, tol)) << "out";
    EXPECT_TRUE(Match(lse, dtype == DType::kF32 ? 1e-4 : 1e-3)) << "lse";
    // Both sides differentiate the CPU's forward, so only the backward
    // differs.
    out.gpu = ToGpu(out.cpu);
    lse.gpu = ToGpu(lse.cpu);
    Pair dout = Random(qs, dtype, 24);
    Pair dq = Zeros(qs, dtype), dk = Zeros(ks, dtype), dv = Zeros(ks, dtype);
    ASSERT_TRUE(Both([&](bool g) {
      return CausalAttentionBackward(q.on(g), k.on(g), v.on(g), out.on(g),
                                     lse.on(g), dout.on(g), scale, dq.ptr(g),
                                     dk.ptr(g), dv.ptr(g));
    }));
    EXPECT_TRUE(MatchScaled(dq, tol)) << "dq";
    EXPECT_TRUE(MatchScaled(dk, tol)) << "dk";
    EXPECT_TRUE(MatchScaled(dv, tol)) << "dv";
    // Reruns are bit-identical (cuDNN's deterministic backward).
    const std::vector<double> first_dk = Values(dk.gpu);
    ASSERT_TRUE(CausalAttentionBackward(q.gpu, k.gpu, v.gpu, out.gpu, lse.gpu,
                                        dout.gpu, scale, &dq.gpu, &dk.gpu,
                                        &dv.gpu)
                    .ok());
    EXPECT_EQ(Values(dk.gpu), first_dk) << "dk rerun";
    if (dtype != DType::kF32 && hd % 8 == 0) {
      expected_cudnn_calls += t > 1 ? 3 : 1;  // forward, 2 backward if T > 1
    }
  }
  EXPECT_EQ(gpu::CudnnAttention::ForDevice(0)->calls() - cudnn_calls,
            expected_cudnn_calls)
      << "attention calls run on cuDNN";
}

// Document masks (packed documents from DocumentMask on the device, against
// the CPU's): attention forward and backward on the reference kernel (cuDNN
// is not called with masks) and RoPE at the documents' positions, both
// matching the CPU backend.
TEST_P(CudaOpsTest, DocumentMasks) {
  const DType dtype = GetParam();
  const int64_t cudnn_calls = gpu::CudnnAttention::ForDevice(0)->calls();
  const int64_t b = 2, h = 4, kv = 2, t = 150, hd = 64, eot = 7;
  std::vector<int64_t> ids_host(b * t, 1);
  for (int64_t i : {0, 40, 41, 97, 149}) ids_host[i] = eot;  // row 0
  for (int64_t i : {3, 64, 65, 66}) ids_host[t + i] = eot;   // row 1
  const Pair ids = Ids({b, t}, ids_host, DType::kI64);
  Pair starts = Zeros({b, t}, DType::kI32),
       positions = Zeros({b, t}, DType::kI32);
  ASSERT_TRUE(Both([&](bool g) {
    return DocumentMask(ids.on(g), eot, starts.ptr(g), positions.ptr(g));
  }));
  EXPECT_EQ(Values(starts.gpu), Values(starts.cpu));
  EXPECT_EQ(Values(positions.gpu), Values(positions.cpu));
  // A context-parallel rank's two chunks of the ids (CopyColumns).
  Pair local = Zeros({b, 60}, DType::kI64);
  ASSERT_TRUE(Both([&](bool g) {
    const absl::Status first = CopyColumns(ids.on(g), 30, 30, local.ptr(g), 0);
    if (!first.ok()) return first;
    return CopyColumns(ids.on(g), 90, 30, local.ptr(g), 30);
  }));
  EXPECT_EQ(Values(local.gpu), Values(local.cpu));

  const Shape qs{b, h, t, hd}, ks{b, kv, t, hd};
  Pair q = Random(qs, dtype, 41, -2, 2), k = Random(ks, dtype, 42, -2, 2),
       v = Random(ks, dtype, 43);
  Pair out = Zeros(qs, dtype), lse = Zeros({b, h, t}, DType::kF32);
  const float scale = 0.125f;
  ASSERT_TRUE(Both([&](bool g) {
    return CausalAttention(q.on(g), k.on(g), v.on(g), scale, out.ptr(g),
                           lse.ptr(g), KeyRange{&starts.on(g)});
  }));
  const double tol = AttentionTol(dtype);
  EXPECT_TRUE(MatchScaled(out, tol)) << "out";
  EXPECT_TRUE(Match(lse, dtype == DType::kF32 ? 1e-4 : 1e-3)) << "lse";
  out.gpu = ToGpu(out.cpu);
  lse.gpu = ToGpu(lse.cpu);
  Pair dout = Random(qs, dtype, 44);
  Pair dq = Zeros(qs, dtype), dk = Zeros(ks, dtype), dv = Zeros(ks, dtype);
  ASSERT_TRUE(Both([&](bool g) {
    return CausalAttentionBackward(
        q.on(g), k.on(g), v.on(g), out.on(g), lse.on(g), dout.on(g), scale,
        dq.ptr(g), dk.ptr(g), dv.ptr(g), KeyRange{&starts.on(g)});
  }));
  EXPECT_TRUE(MatchScaled(dq, tol)) << "dq";
  EXPECT_TRUE(MatchScaled(dk, tol)) << "dk";
  EXPECT_TRUE(MatchScaled(dv, tol)) << "dv";
  EXPECT_EQ(gpu::CudnnAttention::ForDevice(0)->calls(), cudnn_calls);

  std::vector<float> inv_freq(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) {
    inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
  }
  for (bool inverse : {false, true}) {
    Pair x = Random(qs, dtype, 45 + inverse, -2, 2);
    ASSERT_TRUE(Both([&](bool g) {
      return Rope(x.ptr(g), inv_freq, inverse, &positions.on(g));
    }));
    EXPECT_TRUE(Match(x, Tol(dtype))) << (inverse ? "inverse" : "forward");
  }
}

// Arbitrary key ranges (keys after the query, empty rows; context
// parallelism's blocks) on the reference kernels, and MergeAttention, both
// against the CPU backend.
TEST_P(CudaOpsTest, KeyRangesAndMerge) {
  const DType dtype = GetParam();
  const int64_t b = 2, h = 2, kv = 1, t = 90, hd = 32;
  std::vector<int64_t> lo_host(b * t), hi_host(b * t);
  uint64_t x = 5;
  for (int64_t r = 0; r < b * t; ++r) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t a = static_cast<int64_t>((x >> 33) % (t + 4)) - 2;
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t c = static_cast<int64_t>((x >> 33) % (t + 4)) - 2;
    lo_host[r] = r % 9 == 0 ? std::max(a, c) : std::min(a, c);  // some empty
    hi_host[r] = r % 9 == 0 ? std::min(a, c) : std::max(a, c);
  }
  const Pair lo = Ids({b, t}, lo_host, DType::kI32);
  const Pair hi = Ids({b, t}, hi_host, DType::kI32);
  const Shape qs{b, h, t, hd}, ks{b, kv, t, hd};
  Pair q = Random(qs, dtype, 51, -2, 2), k = Random(ks, dtype, 52, -2, 2),
       v = Random(ks, dtype, 53);
  Pair out = Zeros(qs, dtype), lse = Zeros({b, h, t}, DType::kF32);
  ASSERT_TRUE(Both([&](bool g) {
    return CausalAttention(q.on(g), k.on(g), v.on(g), 0.2f, out.ptr(g),
                           lse.ptr(g), KeyRange{&lo.on(g), &hi.on(g)});
  }));
  const double tol = AttentionTol(dtype);
  EXPECT_TRUE(MatchScaled(out, tol)) << "out";
  EXPECT_EQ(Values(lse.gpu).size(), Values(lse.cpu).size());
  EXPECT_TRUE(Match(lse, dtype == DType::kF32 ? 1e-4 : 1e-3)) << "lse";
  out.gpu = ToGpu(out.cpu);
  lse.gpu = ToGpu(lse.cpu);
  Pair dout = Random(qs, dtype, 54);
  Pair dq = Zeros(qs, dtype), dk = Zeros(ks, dtype), dv = Zeros(ks, dtype);
  ASSERT_TRUE(Both([&](bool g) {
    return CausalAttentionBackward(
        q.on(g), k.on(g), v.on(g), out.on(g), lse.on(g), dout.on(g), 0.2f,
        dq.ptr(g), dk.ptr(g), dv.ptr(g), KeyRange{&lo.on(g), &hi.on(g)});
  }));
  EXPECT_TRUE(MatchScaled(dq, tol)) << "dq";
  EXPECT_TRUE(MatchScaled(dk, tol)) << "dk";
  EXPECT_TRUE(MatchScaled(dv, tol)) << "dv";
  // Merge a second attention (causal) into the ranged one.
  Pair out2 = Zeros(qs, dtype), lse2 = Zeros({b, h, t}, DType::kF32);
  ASSERT_TRUE(Both([&](bool g) {
    return CausalAttention(q.on(g), k.on(g), v.on(g), 0.2f, out2.ptr(g),
                           lse2.ptr(g));
  }));
  out2.gpu = ToGpu(out2.cpu);
  lse2.gpu = ToGpu(lse2.cpu);
  ASSERT_TRUE(Both([&](bool g) {
    return MergeAttention(out2.on(g), lse2.on(g), out.ptr(g), lse.ptr(g));
  }));
  EXPECT_TRUE(MatchScaled(out, tol)) << "merged out";
  EXPECT_TRUE(Match(lse, 1e-5)) << "merged lse";
}

TEST_P(CudaOpsTest, Rope) {
  const DType dtype = GetParam();
  for (const Shape& shape : {Shape{1, 1, 1, 2}, Shape{2, 3, 17, 64}}) {
    SCOPED_TRACE(ShapeToString(shape));
    const int64_t hd = shape.back();
    std::vector<float> inv_freq(hd / 2);
    for (int64_t i = 0; i < hd / 2; ++i) {
      inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
    }
    for (bool inverse : {false, true}) {
      Pair x = Random(shape, dtype, 31 + inverse, -2, 2);
      ASSERT_TRUE(
          Both([&](bool g) { return Rope(x.ptr(g), inv_freq, inverse); }));
      EXPECT_TRUE(Match(x, Tol(dtype))) << (inverse ? "inverse" : "forward");
    }
  }
}

TEST_P(CudaOpsTest, SplitAndMergeHeads) {
  const DType dtype = GetParam();
  const int64_t b = 2, t = 5, heads = 6, hd = 8, first = 2, n = 3;
  Pair wide = Random({b, t, heads, hd}, dtype, 33);
  Pair narrow = Zeros({b, n, t, hd}, dtype);
  ASSERT_TRUE(Both(
      [&](bool g) { return SplitHeads(wide.on(g), first, narrow.ptr(g)); }));
  EXPECT_TRUE(Match(narrow, 0.0)) << "split";
  Pair back = Zeros({b, t, heads, hd}, dtype);
  ASSERT_TRUE(Both(
      [&](bool g) { return MergeHeads(narrow.on(g), first, back.ptr(g)); }));
  EXPECT_TRUE(Match(back, 0.0)) << "merge";
}

TEST_P(CudaOpsTest, LayerNorm) {
  const DType dtype = GetParam();
  for (bool with_bias : {false, true}) {
    for (const Shape& shape :
         {Shape{1, 1}, Shape{2, 9, 33}, Shape{300, 7}, Shape{2, 517, 768}}) {
      SCOPED_TRACE(::testing::Message()
                   << ShapeToString(shape) << " bias=" << with_bias);
      const int64_t c = shape.back(), rows = NumElements(shape) / c;
      Pair x = Random(shape, dtype, 11, -2, 3);
      Pair w = Random({c}, dtype, 12, 0.5, 1.5);
      Pair b = Random({c}, dtype, 13);
      Pair out = Zeros(shape, dtype);
      Pair mean = Zeros({rows}, DType::kF32);
      Pair rstd = Zeros({rows}, DType::kF32);
      ASSERT_TRUE(Both([&](bool g) {
        return LayerNorm(x.on(g), w.on(g), with_bias ? &b.on(g) : nullptr,
                         1e-5f, out.ptr(g), mean.ptr(g), rstd.ptr(g));
      }));
      EXPECT_TRUE(Match(out, Tol(dtype))) << "out";
      EXPECT_TRUE(Match(mean, Tol(dtype))) << "mean";
      EXPECT_TRUE(Match(rstd, Tol(dtype))) << "rstd";

      mean.gpu = ToGpu(mean.cpu);
      rstd.gpu = ToGpu(rstd.cpu);
      Pair dy = Random(shape, dtype, 14);
      Pair dx = Zeros(shape, dtype);
      Pair dw = Random({c}, dtype, 15);  // Accumulated into.
      Pair db = Random({c}, dtype, 16);
      ASSERT_TRUE(Both([&](bool g) {
        return LayerNormBackward(dy.on(g), x.on(g), w.on(g), mean.on(g),
                                 rstd.on(g), dx.ptr(g), dw.ptr(g),
                                 with_bias ? db.ptr(g) : nullptr);
      }));
      EXPECT_TRUE(Match(dx, Tol(dtype))) << "dx";
      EXPECT_TRUE(Match(dw, Tol(dtype))) << "dweight";
      EXPECT_TRUE(Match(db, Tol(dtype))) << "dbias";
      // The two-stage column sums rerun bit for bit.
      Pair dw2 = Random({c}, dtype, 15);
      ASSERT_TRUE(LayerNormBackward(dy.gpu, x.gpu, w.gpu, mean.gpu, rstd.gpu,
                                    &dx.gpu, &dw2.gpu, nullptr)
                      .ok());
      EXPECT_EQ(Values(dw2.gpu), Values(dw.gpu)) << "dweight rerun";
    }
  }
}

TEST_P(CudaOpsTest, RmsNorm) {
  const DType dtype = GetParam();
  for (const Shape& shape :
       {Shape{1, 1}, Shape{2, 9, 33}, Shape{300, 7}, Shape{1030, 768}}) {
    SCOPED_TRACE(ShapeToString(shape));
    const int64_t c = shape.back(), rows = NumElements(shape) / c;
    Pair x = Random(shape, dtype, 17, -2, 3);
    Pair w = Random({c}, dtype, 18, 0.5, 1.5);
    Pair out = Zeros(shape, dtype);
    Pair rstd = Zeros({rows}, DType::kF32);
    ASSERT_TRUE(Both([&](bool g) {
      return RmsNorm(x.on(g), w.on(g), 1e-6f, out.ptr(g), rstd.ptr(g));
    }));
    EXPECT_TRUE(Match(out, Tol(dtype))) << "out";
    EXPECT_TRUE(Match(rstd, Tol(dtype))) << "rstd";

    rstd.gpu = ToGpu(rstd.cpu);
    Pair dy = Random(shape, dtype, 19);
    Pair dx = Zeros(shape, dtype);
    Pair dw = Random({c}, dtype, 20);
    ASSERT_TRUE(Both([&](bool g) {
      return RmsNormBackward(dy.on(g), x.on(g), w.on(g), rstd.on(g), dx.ptr(g),
                             dw.ptr(g));
    }));
    EXPECT_TRUE(Match(dx, Tol(dtype))) << "dx";
    EXPECT_TRUE(Match(dw, Tol(dtype))) << "dweight";
  }
}

TEST_P(CudaOpsTest, Embedding) {
  const DType dtype = GetParam();
  const int64_t v = 11, c = 19, n = 23;
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (i * 5 + 2) % v;  // Repeats.
  for (DType id_dtype : {DType::kI32, DType::kI64}) {
    SCOPED_TRACE(DTypeName(id_dtype));
    Pair pids = Ids({1, n}, ids, id_dtype);
    Pair table = Random({v, c}, dtype, 21);
    Pair out = Zeros({1, n, c}, dtype);
    ASSERT_TRUE(Both([&](bool g) {
      return Embedding(pids.on(g), table.on(g), out.ptr(g));
    }));
    EXPECT_TRUE(Match(out, 0.0)) << "Embedding";
    Pair dout = Random({1, n, c}, dtype, 22);
    Pair dtable = Random({v, c}, dtype, 23);  // Accumulated into.
    ASSERT_TRUE(Both([&](bool g) {
      return EmbeddingBackward(pids.on(g), dout.on(g), dtable.ptr(g));
    }));
    EXPECT_TRUE(Match(dtable, Tol(dtype))) << "EmbeddingBackward";
    // A vocabulary-parallel piece: rows [4, 9) of the table.
    const EmbeddingRows rows{4, v};
    Pair piece = Random({5, c}, dtype, 24);
    ASSERT_TRUE(Both([&](bool g) {
      return Embedding(pids.on(g), piece.on(g), out.ptr(g), rows);
    }));
    EXPECT_TRUE(Match(out, 0.0)) << "Embedding of a piece";
    ASSERT_TRUE(Both([&](bool g) {
      return EmbeddingBackward(pids.on(g), dout.on(g), piece.ptr(g), rows);
    }));
    EXPECT_TRUE(Match(piece, Tol(dtype))) << "EmbeddingBackward of a piece";
  }
}

// GPT-2's shapes: many ids, most repeated many times. The GPU adds each id's
// rows in position order with the CPU's rounding, so the result is the
// CPU's bit for bit.
TEST_P(CudaOpsTest, EmbeddingBackwardManyRepeats) {
  const DType dtype = GetParam();
  const int64_t v = 50257, c = 768, n = 2048;
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = i % 3 == 0 ? (i * 7919) % v : (i % 17) * 13;  // hot ids repeat
  }
  for (DType id_dtype : {DType::kI32, DType::kI64}) {
    SCOPED_TRACE(DTypeName(id_dtype));
    Pair pids = Ids({2, n / 2}, ids, id_dtype);
    Pair dout = Random({2, n / 2, c}, dtype, 27);
    Pair dtable = Random({v, c}, dtype, 28);
    ASSERT_TRUE(Both([&](bool g) {
      return EmbeddingBackward(pids.on(g), dout.on(g), dtable.ptr(g));
    }));
    EXPECT_TRUE(Match(dtable, 0.0)) << "EmbeddingBackward";
  }
}

TEST_P(CudaOpsTest, CrossEntropy) {
  const DType dtype = GetParam();
  const int64_t kIgnore = -100;
  for (auto [n, v] : {std::pair<int64_t, int64_t>{1, 1},
                      {3, 7},
                      {24, 29},
                      {4, 1031},
                      {6, 50257}}) {
    SCOPED_TRACE(::testing::Message() << n << "x" << v);
    std::vector<int64_t> targets(n);
    for (int64_t i = 0; i < n; ++i) targets[i] = (i * 7 + 3) % v;
    if (n > 2) targets[1] = kIgnore;
    for (DType id_dtype : {DType::kI32, DType::kI64}) {
      Pair t = Ids({n}, targets, id_dtype);
      Pair logits = Random({n, v}, dtype, 24, -4, 4);
      Pair losses = Zeros({n}, DType::kF32);
      ASSERT_TRUE(Both([&](bool g) {
        return CrossEntropy(logits.on(g), t.on(g), kIgnore, losses.ptr(g));
      }));
      EXPECT_TRUE(Match(losses, Tol(dtype))) << "CrossEntropy";
      Pair dlosses = Random({n}, DType::kF32, 25, 0.1, 1.0);
      Pair dlogits = Zeros({n, v}, dtype);
      ASSERT_TRUE(Both([&](bool g) {
        return CrossEntropyBackward(logits.on(g), t.on(g), kIgnore,
                                    dlosses.on(g), dlogits.ptr(g));
      }));
      EXPECT_TRUE(Match(dlogits, Tol(dtype))) << "CrossEntropyBackward";
    }
  }
}

TEST_P(CudaOpsTest, CrossEntropyShards) {
  const DType dtype = GetParam();
  const int64_t n = 5, v = 301, offset = 100, vocab = 1000, kIgnore = -100;
  Pair logits = Random({n, v}, dtype, 41, -6, 6);
  Pair targets = Ids({n}, {100, 400, kIgnore, 250, 999}, DType::kI64);
  Pair mx = Zeros({n}, DType::kF32), se = Zeros({n}, DType::kF32),
       tl = Zeros({n}, DType::kF32);
  ASSERT_TRUE(Both([&](bool g) {
    return CrossEntropyShardStats(logits.on(g), targets.on(g), offset, vocab,
                                  kIgnore, mx.ptr(g), se.ptr(g), tl.ptr(g));
  }));
  EXPECT_TRUE(Match(mx, 1e-6)) << "max";
  EXPECT_TRUE(Match(se, 1e-4)) << "sumexp";
  EXPECT_TRUE(Match(tl, 1e-6)) << "target logit";
  // The backward from the CPU's statistics on both sides.
  se.cpu = *Tensor::FromFloats({n}, {9, 8, 7, 6, 5});
  se.gpu = ToGpu(se.cpu);
  Pair dlosses = Random({n}, DType::kF32, 42, 0.1, 1.0);
  Pair dlogits = Zeros({n, v}, dtype);
  ASSERT_TRUE(Both([&](bool g) {
    return CrossEntropyShardBackward(logits.on(g), targets.on(g), offset, vocab,
                                     kIgnore, mx.on(g), se.on(g), dlosses.on(g),
                                     dlogits.ptr(g));
  }));
  EXPECT_TRUE(Match(dlogits, Tol(dtype))) << "dlogits";
}

TEST_P(CudaOpsTest, EmptyTensors) {
  const DType dtype = GetParam();
  Pair x = Zeros({0, 5}, dtype);
  Pair y = Zeros({0, 5}, dtype);
  ASSERT_TRUE(Both([&](bool g) { return Gelu(x.on(g), y.ptr(g)); }));
  ASSERT_TRUE(Both([&](bool g) { return Softmax(x.on(g), y.ptr(g)); }));
  Pair out = Random({1}, DType::kF32, 26);
  ASSERT_TRUE(Both([&](bool g) { return Sum(x.on(g), out.ptr(g)); }));
  EXPECT_EQ(Values(out.gpu), std::vector<double>{0.0});
}

// ------------------------------------------------------------------ matmul

struct MatmulCase {
  DType ab_dtype;
  DType c_dtype;
};

using CudaMatmulTest = GpuTestWithParam<MatmulCase>;

INSTANTIATE_TEST_SUITE_P(
    Dtypes, CudaMatmulTest,
    ::testing::Values(MatmulCase{DType::kF32, DType::kF32},
                      MatmulCase{DType::kBF16, DType::kBF16},
                      MatmulCase{DType::kBF16, DType::kF32}),
    [](const ::testing::TestParamInfo<MatmulCase>& info) {
      return std::string(DTypeName(info.param.ab_dtype)) + "_to_" +
             DTypeName(info.param.c_dtype);
    });

// Operand shapes of op(a) [batch.., m, k] @ op(b) [(batch..), k, n].
Shape AShape(const Shape& batch, int64_t m, int64_t k, bool ta) {
  Shape s = batch;
  s.push_back(ta ? k : m);
  s.push_back(ta ? m : k);
  return s;
}

Shape BShape(const Shape& batch, int64_t k, int64_t n, bool tb) {
  Shape s = batch;
  s.push_back(tb ? n : k);
  s.push_back(tb ? k : n);
  return s;
}

TEST_P(CudaMatmulTest, MatchesCpu) {
  const MatmulCase p = GetParam();
  struct Dims {
    Shape batch;
    bool broadcast_b;
    int64_t m, n, k;
  };
  const Dims dims[] = {{{}, false, 1, 1, 1},
                       {{}, false, 17, 33, 65},
                       {{3}, false, 5, 7, 9},
                       {{2, 3}, true, 8, 16, 32},
                       {{4}, true, 13, 3, 129}};
  for (const Dims& d : dims) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (auto [alpha, beta] :
             {std::pair<float, float>{1.0f, 0.0f}, {0.5f, 1.0f}}) {
          SCOPED_TRACE(::testing::Message()
                       << "batch " << ShapeToString(d.batch) << " bcast "
                       << d.broadcast_b << " m" << d.m << " n" << d.n << " k"
                       << d.k << " ta" << ta << " tb" << tb << " alpha "
                       << alpha << " beta " << beta);
          Pair a = Random(AShape(d.batch, d.m, d.k, ta), p.ab_dtype, 27);
          Pair b =
              Random(BShape(d.broadcast_b ? Shape{} : d.batch, d.k, d.n, tb),
                     p.ab_dtype, 28);
          Shape c_shape = d.batch;
          c_shape.push_back(d.m);
          c_shape.push_back(d.n);
          Pair c = Random(c_shape, p.c_dtype, 29);
          MatmulOptions options;
          options.transpose_a = ta;
          options.transpose_b = tb;
          options.alpha = alpha;
          options.beta = beta;
          ASSERT_TRUE(Both([&](bool g) {
            return Matmul(a.on(g), b.on(g), c.ptr(g), options);
          }));
          EXPECT_TRUE(Match(c, Tol(p.c_dtype)));
        }
      }
    }
  }
}

TEST_P(CudaMatmulTest, Bias) {
  const MatmulCase p = GetParam();
  for (const Shape& batch : {Shape{}, Shape{3}}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "batch " << ShapeToString(batch) << " tb" << tb);
      const int64_t m = 9, n = 33, k = 17;
      Pair a = Random(AShape(batch, m, k, false), p.ab_dtype, 30);
      Pair b = Random(BShape(Shape{}, k, n, tb), p.ab_dtype, 31);
      Pair bias = Random({n}, p.c_dtype, 32, -3, 3);
      Shape c_shape = batch;
      c_shape.push_back(m);
      c_shape.push_back(n);
      Pair c = Random(c_shape, p.c_dtype, 33);
      ASSERT_TRUE(Both([&](bool g) {
        MatmulOptions options;
        options.transpose_b = tb;
        options.bias = &bias.on(g);
        return Matmul(a.on(g), b.on(g), c.ptr(g), options);
      }));
      EXPECT_TRUE(Match(c, Tol(p.c_dtype)));
    }
  }
}

TEST_P(CudaMatmulTest, UnalignedViews) {
  const MatmulCase p = GetParam();
  const int64_t m = 9, n = 5, k = 3;
  // Row 1 onwards of each buffer: 3- or 5-element offsets, so the pointers
  // are only element-aligned.
  Pair a_buf = Random({m + 1, k}, p.ab_dtype, 30);
  Pair b_buf = Random({k + 1, n}, p.ab_dtype, 31);
  Pair c_buf = Random({m + 1, n}, p.c_dtype, 32);
  MatmulOptions options;
  options.beta = 1.0f;
  ASSERT_TRUE(Both([&](bool g) -> absl::Status {
    absl::StatusOr<Tensor> a = a_buf.on(g).Narrow(1, m);
    absl::StatusOr<Tensor> b = b_buf.on(g).Narrow(1, k);
    absl::StatusOr<Tensor> c = c_buf.on(g).Narrow(1, m);
    if (!a.ok() || !b.ok() || !c.ok()) {
      return absl::InternalError("Narrow failed");
    }
    return Matmul(*a, *b, &*c, options);
  }));
  EXPECT_TRUE(Match(c_buf, Tol(p.c_dtype)));
}

TEST_P(CudaMatmulTest, AlgorithmIsCachedPerShape) {
  const MatmulCase p = GetParam();
  Pair a = Random({6, 10}, p.ab_dtype, 33);
  Pair b = Random({10, 14}, p.ab_dtype, 34);
  Pair c = Zeros({6, 14}, p.c_dtype);
  ASSERT_TRUE(Matmul(a.gpu, b.gpu, &c.gpu).ok());
  const int64_t cached = gpu::CublasLtMatmulCacheSize();
  ASSERT_TRUE(Matmul(a.gpu, b.gpu, &c.gpu).ok());
  EXPECT_EQ(gpu::CublasLtMatmulCacheSize(), cached);
}

// ------------------------------------------------------------------ errors

using CudaBackendTest = GpuTest;

TEST_F(CudaBackendTest, OutOfRangeIdsGiveTheCpuMessage) {
  const int64_t v = 5, c = 3;
  Pair table = Random({v, c}, DType::kF32, 35);
  Pair out = Zeros({3, c}, DType::kF32);
  Pair bad = Ids({3}, {0, v, 1}, DType::kI64);
  std::vector<absl::Status> results;
  for (bool g : {false, true}) {
    results.push_back(Embedding(bad.on(g), table.on(g), out.ptr(g)));
  }
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[1], results[0]);
  EXPECT_EQ(results[1].message(),
            "Embedding: id 5 at position 1 is outside [0, 5)");

  Pair negative = Ids({3}, {0, 1, -2}, DType::kI32);
  Pair dtable = Zeros({v, c}, DType::kF32);
  results.clear();
  for (bool g : {false, true}) {
    results.push_back(
        EmbeddingBackward(negative.on(g), out.on(g), dtable.ptr(g)));
  }
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[1], results[0]);

  Pair logits = Random({3, v}, DType::kF32, 36);
  Pair losses = Zeros({3}, DType::kF32);
  results.clear();
  for (bool g : {false, true}) {
    results.push_back(
        CrossEntropy(logits.on(g), bad.on(g), -100, losses.ptr(g)));
  }
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[1], results[0]);
  Pair dlogits = Zeros({3, v}, DType::kF32);
  results.clear();
  for (bool g : {false, true}) {
    results.push_back(CrossEntropyBackward(logits.on(g), bad.on(g), -100,
                                           losses.on(g), dlogits.ptr(g)));
  }
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(results[1], results[0]);
}

TEST_F(CudaBackendTest, OneBackendPerDeviceAcrossThreads) {
  std::vector<Backend*> seen(8, nullptr);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&seen, i] { seen[i] = gpu::CudaBackend(0); });
  }
  for (std::thread& t : threads) t.join();
  for (Backend* b : seen) {
    EXPECT_NE(b, nullptr);
    EXPECT_EQ(b, seen[0]);
  }
}

}  // namespace
}  // namespace fsdpp
