// Rates; see rates.h.
#include "plan/rates.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/status.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace plan {

absl::StatusOr<double> MeasureMatmulFlops(DType dtype, int64_t n,
                                          absl::Duration budget) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MeasureMatmulFlops: the CPU matmul runs f32 and bf16, not ",
        DTypeName(dtype)));
  }
  if (n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MeasureMatmulFlops: n must be > 0, got ", n));
  }
  std::vector<float> ones(n * n, 0.5f);
  FSDPP_ASSIGN_OR_RETURN(Tensor a, Tensor::FromFloats({n, n}, ones, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor b, Tensor::FromFloats({n, n}, ones, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor c, Tensor::Empty({n, n}, dtype, Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(Matmul(a, b, &c));  // Warm-up (primitive creation).
  const double flops = 2.0 * n * n * n;
  double best = 0;
  const absl::Time start = absl::Now();
  int runs = 0;
  while (runs < 3 || absl::Now() - start < budget) {
    const absl::Time t0 = absl::Now();
    FSDPP_RETURN_IF_ERROR(Matmul(a, b, &c));
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (s > 0) best = std::max(best, flops / s);
    ++runs;
  }
  return best;
}

double GpuPeakFlops(const std::string& device_name, DType dtype) {
  // Dense (no sparsity) datasheet numbers, TFLOP/s: {bf16/f16, f32 (TF32
  // tensor cores are not used for f32 here: plain FP32)}.
  struct Entry {
    const char* fragment;
    double half, single;
  };
  // First match wins: longer names before their fragments ("GB200" before
  // "B200", "H100 PCIe" before "H100"). B200: HGX at 1000 W; GB200 at
  // 1200 W.
  static const Entry kTable[] = {
      {"GB200", 2500, 90},    {"B200", 2250, 80},  {"H200", 989, 67},
      {"H100 PCIe", 756, 51}, {"H100", 989, 67},   {"A100", 312, 19.5},
      {"L40S", 362, 91.6},    {"A10G", 70, 31.2},  {"L4", 121, 30.3},
      {"V100", 125, 15.7},    {"4090", 165, 82.6},
  };
  for (const Entry& e : kTable) {
    if (device_name.find(e.fragment) != std::string::npos) {
      return (dtype == DType::kF32 ? e.single : e.half) * 1e12;
    }
  }
  return 0;
}

absl::StatusOr<double> MeasureGlooBusBandwidth(int64_t bytes, int reps,
                                               bool shared_memory) {
  if (bytes < 2 * 4 || reps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MeasureGlooBusBandwidth: need bytes >= 8 and reps >= 1, got ", bytes,
        " and ", reps));
  }
  constexpr int kRanks = 2;
  const int64_t count = bytes / 4;  // f32 elements of the gathered output
  InMemoryStore store;
  GlooOptions options;
  options.timeout = absl::Minutes(1);
  options.shared_memory = shared_memory;
  std::vector<double> best(kRanks, 0.0);
  std::vector<absl::Status> status(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> absl::Status {
        FSDPP_ASSIGN_OR_RETURN(
            std::unique_ptr<GlooProcessGroup> group,
            GlooProcessGroup::Create(&store, r, kRanks, "bandwidth", options));
        std::vector<float> in(count / kRanks, 1.0f), out(count, 0.0f);
        const Buffer input{in.data(), static_cast<int64_t>(in.size()),
                           DType::kF32, Device::Cpu()};
        const Buffer output{out.data(), static_cast<int64_t>(out.size()),
                            DType::kF32, Device::Cpu()};
        CollectiveOptions blocking;
        blocking.async_op = false;
        for (int i = 0; i <= reps; ++i) {
          const absl::Time t0 = absl::Now();
          FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                                 group->AllGather(input, output, blocking));
          FSDPP_RETURN_IF_ERROR(work->Wait(absl::Minutes(1)));
          const double s = absl::ToDoubleSeconds(absl::Now() - t0);
          // busbw = algbw x (n - 1) / n; the first op is the warm-up.
          if (i > 0 && s > 0) {
            best[r] =
                std::max(best[r], output.nbytes() / s * (kRanks - 1) / kRanks);
          }
        }
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) FSDPP_RETURN_IF_ERROR(s);
  return std::min(best[0], best[1]);
}

}  // namespace plan
}  // namespace fsdpp
