#include "plan/planner.h"

#include <cstdio>

#include "gtest/gtest.h"

namespace fsdpp {
namespace plan {
namespace {

TEST(PlannerTest, Smoke) {
  DeviceSpec d = *DeviceByName("h100", 8, false);
  recipe::Layout s;
  s.world = 8;
  s.param_dtype = DType::kBF16;
  s.activation_checkpointing = nn::CheckpointPolicy::Full();
  s.micro_batch = 1;
  s.seq_len = 8192;
  absl::StatusOr<Plan> p = MakePlan(*models::ConfigByName("llama3_8b"), s, d);
  ASSERT_TRUE(p.ok()) << p.status();
  std::printf("%s\n", FormatPlan(*p).c_str());
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
