// The CUDA AdamW and unscale kernels against the CPU loops, bit for bit,
// with the step's scale given or read on the device (AdamW::StepGuard).
//
// Both run kernels::AdamWElement / UnscaleElement (optim/kernels/adamw.h)
// with f32 multiplies, adds, one correctly rounded division and sqrt, and no
// FMA contraction on either side (-ffp-contract=off, nvcc --fmad=false), so
// the results must be identical, compute copies included. Needs a GPU: every
// test skips visibly without one; the target only builds under --config=cuda.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/cuda_runtime.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using P = Placement;
constexpr Device kGpu = Device::Cuda(0);

std::vector<uint32_t> Bits(const Tensor& t) {
  std::vector<float> f = *t.ToFloats();
  std::vector<uint32_t> bits(f.size());
  std::memcpy(bits.data(), f.data(), f.size() * sizeof(float));
  return bits;
}

Tensor On(const Tensor& cpu, Device device) {
  Tensor t = *Tensor::Empty(cpu.shape(), cpu.dtype(), device);
  CHECK_OK(Copy(cpu, &t));
  return t;
}

class AdamWCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RegisterCudaAllocators();
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(AdamWCudaTest, StepMatchesCpuBitwise) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    const std::vector<Shape> shapes = {{7, 5}, {5}, {300, 257}};
    const DType copy_dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
    struct Side {
      std::vector<DTensor> params, grads;
      std::vector<Tensor> copies;
    };
    Side sides[2];  // 0: cpu, 1: cuda:0.
    for (int s = 0; s < 2; ++s) {
      const Device device = s == 0 ? Device::Cpu() : kGpu;
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor p = testing_util::RandomTensor(shapes[i], DType::kF32, 10 + i);
        sides[s].params.push_back(*DTensor::FromLocal(
            On(p, device), &mesh, {P::Shard(0)}, shapes[i]));
        sides[s].grads.push_back(sides[s].params.back());  // Replaced below.
        sides[s].copies.push_back(
            *Tensor::Zeros(shapes[i], copy_dtypes[i], device));
      }
    }
    AdamWOptions o;
    o.weight_decay = 0.1;
    o.decay_filter = DecayMatricesOnly;
    std::vector<AdamW> opts;
    for (Side& side : sides) {
      std::vector<AdamWParam> list;
      for (size_t i = 0; i < shapes.size(); ++i) {
        list.push_back(
            {"p" + std::to_string(i), &side.params[i], &side.grads[i]});
      }
      opts.push_back(*AdamW::Create(std::move(list), o));
      for (size_t i = 0; i < shapes.size(); ++i) {
        ASSERT_TRUE(
            opts.back()
                .SetComputeCopy("p" + std::to_string(i), &side.copies[i])
                .ok());
      }
    }
    // Steps 4-6 read their scale from the guard's tensors on the params'
    // device: clipped, skipped (a NaN loss), not clipped.
    const float guard_values[3][2] = {
        {2.0f, 9.0f},
        {std::numeric_limits<float>::quiet_NaN(), 1.0f},
        {2.0f, 0.25f}};
    for (int t = 0; t < 7; ++t) {
      for (int s = 0; s < 2; ++s) {
        const Device device = s == 0 ? Device::Cpu() : kGpu;
        for (size_t i = 0; i < shapes.size(); ++i) {
          Tensor g = testing_util::RandomTensor(shapes[i], DType::kF32,
                                                100 + 10 * i + t);
          sides[s].grads[i] = *DTensor::FromLocal(On(g, device), &mesh,
                                                  {P::Shard(0)}, shapes[i]);
        }
        ASSERT_TRUE(opts[s].SetLr(1e-2 / (t + 1)).ok());
        if (t < 4) {
          absl::Status st = opts[s].Step();
          ASSERT_TRUE(st.ok()) << st;
          continue;
        }
        Tensor loss =
            On(*Tensor::FromFloats({1}, {guard_values[t - 4][0]}), device);
        Tensor norm_sq =
            On(*Tensor::FromFloats({1}, {guard_values[t - 4][1]}), device);
        AdamW::StepGuard guard;
        guard.loss = &loss;
        guard.norm_sq = &norm_sq;
        guard.max_norm = 1.0;
        const std::vector<uint32_t> before = Bits(sides[s].params[2].local());
        absl::Status st = opts[s].Step(guard);
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_EQ(Bits(sides[s].params[2].local()) == before, t == 5)
            << "step " << t << (s == 0 ? " cpu" : " cuda");
      }
    }
    OptimizerStateDict cpu_sd = *opts[0].StateDict();
    OptimizerStateDict gpu_sd = *opts[1].StateDict();
    for (size_t i = 0; i < shapes.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "param " << i);
      EXPECT_EQ(Bits(sides[1].params[i].local()),
                Bits(sides[0].params[i].local()));
      EXPECT_EQ(Bits(sides[1].copies[i]), Bits(sides[0].copies[i]));
      for (const char* kind : {".exp_avg", ".exp_avg_sq"}) {
        const std::string name = "p" + std::to_string(i) + kind;
        EXPECT_EQ(gpu_sd.tensors.at(name).local().device(), kGpu);
        EXPECT_EQ(Bits(gpu_sd.tensors.at(name).local()),
                  Bits(cpu_sd.tensors.at(name).local()));
      }
    }
  });
}

TEST_F(AdamWCudaTest, UnscaleMatchesCpuAndFindsInf) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    Tensor g =
        testing_util::RandomTensor({1000, 33}, DType::kF32, 3, -1e4f, 1e4f);
    DTensor cpu = *DTensor::FromLocal(On(g, Device::Cpu()), &mesh,
                                      {P::Shard(0)}, {1000, 33});
    DTensor gpu =
        *DTensor::FromLocal(On(g, kGpu), &mesh, {P::Shard(0)}, {1000, 33});
    LossScaler a = *LossScaler::Create({}), b = *LossScaler::Create({});
    EXPECT_TRUE(*a.UnscaleAndCheck({&cpu}));
    EXPECT_TRUE(*b.UnscaleAndCheck({&gpu}));
    EXPECT_EQ(Bits(gpu.local()), Bits(cpu.local()));

    std::vector<float> v = *g.ToFloats();
    v[12345] = std::numeric_limits<float>::infinity();
    gpu = *DTensor::FromLocal(On(*Tensor::FromFloats({1000, 33}, v), kGpu),
                              &mesh, {P::Shard(0)}, {1000, 33});
    EXPECT_FALSE(*b.UnscaleAndCheck({&gpu}));
  });
}

}  // namespace
}  // namespace fsdpp
