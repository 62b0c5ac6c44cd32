// The GPT-2 FSDP plan: one unit per block plus the root (wte, wpe, ln_f and
// the tied head), the last block kept after forward, and parity with the
// unsharded model on W = 2 (SGD, thread ranks over real Gloo); the checks are
// the ones every family's plan passes (models/testing/plan_checks.h).
#include "models/gpt2/parallelize.h"

#include "gtest/gtest.h"
#include "models/testing/plan_checks.h"

namespace fsdpp {
namespace models {
namespace gpt2 {
namespace {

testing_util::PlanExpectation Gpt2Plan() {
  testing_util::PlanExpectation e;
  e.plan = ApplyFsdp;
  e.config = "gpt2_debug";
  e.block_parameters = 12;
  e.root_parameters = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"};
  e.other_family_config = "llama_debug";
  e.other_family_name = "llama";
  return e;
}

TEST(Gpt2PlanTest, UnitsAreTheBlocksThenTheRoot) {
  testing_util::ExpectBlocksThenRoot(Gpt2Plan());
}

TEST(Gpt2PlanTest, ParityOnTwoRanks) {
  testing_util::ExpectParityOnTwoRanks(Gpt2Plan());
}

TEST(Gpt2PlanTest, RejectsOtherFamilies) {
  testing_util::ExpectRejectsOtherFamilies(Gpt2Plan());
}

absl::Status TensorParallelWith(Transformer* model, DeviceMesh* mesh,
                                bool sequence_parallel, bool loss_parallel) {
  TensorParallelOptions options;
  options.sequence_parallel = sequence_parallel;
  options.loss_parallel = loss_parallel;
  return ApplyTensorParallel(model, mesh, options);
}

TEST(Gpt2PlanTest, TensorParallelParity) {
  testing_util::ExpectTensorParallelParity("gpt2_debug", TensorParallelWith);
}

TEST(Gpt2PlanTest, TensorParallelRefusesWhatDoesNotDivide) {
  testing_util::ExpectTensorParallelRefusals("gpt2_debug", "llama_debug",
                                             TensorParallelWith);
}

}  // namespace
}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp
