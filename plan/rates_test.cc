#include "plan/rates.h"

#include "gtest/gtest.h"

namespace fsdpp {
namespace plan {
namespace {

TEST(RatesTest, MatmulFlopsArePositiveAndBadInputFails) {
  absl::StatusOr<double> f =
      MeasureMatmulFlops(DType::kF32, 128, absl::Milliseconds(20));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_GT(*f, 1e8);  // Any CPU of this century does 0.1 GFLOP/s.
  EXPECT_EQ(MeasureMatmulFlops(DType::kF16, 128, absl::Milliseconds(1))
                .status()
                .message(),
            "MeasureMatmulFlops: the CPU matmul runs f32 and bf16, not f16");
  EXPECT_FALSE(MeasureMatmulFlops(DType::kF32, 0, absl::Milliseconds(1)).ok());
}

TEST(RatesTest, GpuPeaksFromTheTable) {
  EXPECT_EQ(GpuPeakFlops("NVIDIA H100 80GB HBM3", DType::kBF16), 989e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA H100 PCIe", DType::kBF16), 756e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA A100-SXM4-40GB", DType::kF32), 19.5e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA H200", DType::kBF16), 989e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA B200", DType::kBF16), 2250e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA GB200", DType::kF32), 90e12);
  EXPECT_EQ(GpuPeakFlops("NVIDIA L4", DType::kBF16), 121e12);
  EXPECT_EQ(GpuPeakFlops("Some CPU", DType::kBF16), 0);
}

TEST(RatesTest, GlooBandwidthIsPositiveAndBadInputFails) {
  for (bool shared_memory : {false, true}) {
    absl::StatusOr<double> bw =
        MeasureGlooBusBandwidth(1 << 20, 2, shared_memory);
    ASSERT_TRUE(bw.ok()) << bw.status();
    EXPECT_GT(*bw, 1e6) << shared_memory;  // Either moves more than 1 MB/s.
  }
  EXPECT_FALSE(MeasureGlooBusBandwidth(4).ok());
  EXPECT_FALSE(MeasureGlooBusBandwidth(1 << 20, 0).ok());
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
