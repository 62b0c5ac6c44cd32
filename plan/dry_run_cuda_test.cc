// The dry run against the same step run for real on a GPU: one rank over
// NCCL on cuda:0, the planner's GPU accounting (SimulatedBackend::kNccl: the
// scratch fsdpp's NCCL backend allocates, host memory counted apart) against
// the CUDA caching allocator's live tensors, phase by phase and per tag. The
// GPU presets' memory figures rest on this. Skips, visibly, without a GPU.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/gloo_backend.h"
#include "comm/nccl_backend.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "gtest/gtest.h"
#include "plan/dry_run.h"
#include "plan/dry_run_testing.h"

namespace fsdpp {
namespace plan {
namespace {

using testing_util::Case;
using testing_util::ExpectSameRun;
using testing_util::SmallCases;

// The small cases (host offload aside: RunStepOn keeps everything on one
// device) and a real size: GPT-2 124M, bf16 compute, 4 x 512 tokens.
std::vector<Case> Cases() {
  std::vector<Case> cases = SmallCases(/*host=*/false);
  recipe::Layout big;
  big.micro_batch = 4;
  big.seq_len = 512;
  big.param_dtype = DType::kBF16;
  cases.push_back({"gpt2_124m", big});
  return cases;
}

TEST(DryRunCudaTest, IsExactOnAGpu) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  RegisterCudaAllocators();
  for (const Case& c : Cases()) {
    const models::TransformerConfig config = *models::ConfigByName(c.model);
    const std::string what = absl::StrCat(c.model, " ", c.layout.ToString());
    SCOPED_TRACE(what);
    absl::StatusOr<DryRunResult> dry = DryRun(
        config, c.layout, 0, /*separate_host=*/true, SimulatedBackend::kNccl);
    ASSERT_TRUE(dry.ok()) << dry.status();
    // The trainer's arrangement: NCCL for the mesh, Gloo for host values.
    InMemoryStore store;
    absl::StatusOr<DryRunResult> real =
        RunStepOn(config, c.layout, 0, NcclGroupFactory(&store, 0),
                  Device::Cuda(0), GlooGroupFactory(&store));
    ASSERT_TRUE(real.ok()) << real.status();
    std::printf("%-12s %-70s planned %10.3f MiB, measured %10.3f MiB\n",
                c.model, c.layout.ToString().c_str(),
                dry->peak_bytes / 1048576.0, real->peak_bytes / 1048576.0);
    ExpectSameRun(*dry, *real);
  }
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
