// The dry run against the same step run for real: at world size 1 on the
// host (Gloo), every phase's live and peak bytes, per tag and in total, must
// be identical -- the dry run executes the real code on meta tensors, so
// any difference is a path that allocates differently on meta. Then what
// the dry run reports at other world sizes and strategies: the sharded
// state divided as FSDP divides it, and the collectives one step issues.
#include "plan/dry_run.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "gtest/gtest.h"
#include "plan/dry_run_testing.h"
#include "plan/planner.h"

namespace fsdpp {
namespace plan {
namespace {

using testing_util::Case;
using testing_util::ExpectSameRun;
using testing_util::SmallCases;

// The real step at world size 1 on a fresh host allocator.
absl::StatusOr<DryRunResult> RealStep(const models::TransformerConfig& config,
                                      const recipe::Layout& s) {
  CpuAllocator fresh;
  Allocator* previous = SetAllocator(&fresh);
  InMemoryStore store;
  absl::StatusOr<DryRunResult> r =
      RunStepOn(config, s, 0, GlooGroupFactory(&store), Device::Cpu());
  SetAllocator(previous);
  return r;
}

TEST(DryRunTest, IsExactAtWorldSizeOne) {
  for (const Case& c : SmallCases(/*host=*/true)) {
    const models::TransformerConfig config = *models::ConfigByName(c.model);
    const std::string what = absl::StrCat(c.model, " ", c.layout.ToString());
    SCOPED_TRACE(what);
    absl::StatusOr<DryRunResult> dry = DryRun(config, c.layout);
    ASSERT_TRUE(dry.ok()) << dry.status();
    absl::StatusOr<DryRunResult> real = RealStep(config, c.layout);
    ASSERT_TRUE(real.ok()) << real.status();
    ExpectSameRun(*dry, *real);
  }
}

// LoRA (r 8 on every linear layer of the blocks): the sharded gradients and
// AdamW's moments are the adapters' alone (GPT-2 124M and Llama debug at
// W = 2: half of the adapters' f32 bytes, twice that for the moments); the
// dry run equals the real step at W = 1, with and without LoRA dropout.
TEST(DryRunTest, LoraStateIsTheAdaptersAlone) {
  for (const char* name : {"gpt2_124m", "llama_debug"}) {
    SCOPED_TRACE(name);
    const models::TransformerConfig config = *models::ConfigByName(name);
    recipe::Layout s;
    s.world = 2;
    s.seq_len = 64;
    s.lora.rank = 8;
    s.lora.targets =
        config.family == models::ModelFamily::kGpt2
            ? std::vector<std::string>{"c_attn", "c_proj", "fc", "proj"}
            : std::vector<std::string>{"wq",   "wk", "wv",  "wo",
                                       "gate", "up", "down"};
    absl::StatusOr<recipe::Layout::ParameterCounts> counts =
        s.CountParameters(config);
    ASSERT_TRUE(counts.ok()) << counts.status();
    if (config.family == models::ModelFamily::kGpt2) {
      EXPECT_LT(counts->trainable * 100, counts->total);  // 0.77%
    }
    absl::StatusOr<DryRunResult> dry = DryRun(config, s);
    ASSERT_TRUE(dry.ok()) << dry.status();
    EXPECT_EQ(dry->grad_bytes, 4 * counts->trainable / 2);
    EXPECT_EQ(dry->optimizer_bytes, 2 * 4 * counts->trainable / 2);
    EXPECT_EQ(dry->model_params, counts->total);
  }
  const models::TransformerConfig debug = *models::ConfigByName("gpt2_debug");
  recipe::Layout one;
  one.seq_len = 32;
  one.lora.rank = 8;
  one.lora.targets = {"c_attn", "fc"};
  // Without and with dropout (each adapted layer keeps its dropped input
  // for A's gradient; the batch's keys and columns ride with its masks).
  for (float dropout : {0.0f, 0.1f}) {
    SCOPED_TRACE(absl::StrCat("dropout ", dropout));
    one.lora.dropout = dropout;
    absl::StatusOr<DryRunResult> dry = DryRun(debug, one);
    ASSERT_TRUE(dry.ok()) << dry.status();
    absl::StatusOr<DryRunResult> real = RealStep(debug, one);
    ASSERT_TRUE(real.ok()) << real.status();
    ExpectSameRun(*dry, *real);
  }
}

// Dry runs of `s` at each of `accumulations` micro-batches (a failure is
// reported and ends the list).
std::vector<DryRunResult> DryRunsAt(const models::TransformerConfig& config,
                                    recipe::Layout s,
                                    const std::vector<int64_t>& accumulations) {
  std::vector<DryRunResult> runs;
  for (int64_t accumulation : accumulations) {
    s.grad_accumulation = accumulation;
    absl::StatusOr<DryRunResult> r = DryRun(config, s);
    if (!r.ok()) {
      ADD_FAILURE() << accumulation << " micro-batches: " << r.status();
      break;
    }
    runs.push_back(*std::move(r));
  }
  return runs;
}

// Dry runs of k, k + 1 and k + 2 micro-batches: each further one adds the
// same (non-zero) collectives and tensors.
void ExpectEachMicroBatchAddsTheSame(const DryRunResult& k,
                                     const DryRunResult& k1,
                                     const DryRunResult& k2) {
  const int64_t ops_per_micro = k1.ops.size() - k.ops.size();
  EXPECT_GT(ops_per_micro, 0);
  EXPECT_EQ(static_cast<int64_t>(k2.ops.size() - k1.ops.size()), ops_per_micro);
  const int64_t tensors_per_micro = k1.step_allocations - k.step_allocations;
  EXPECT_GT(tensors_per_micro, 0);
  EXPECT_EQ(k2.step_allocations - k1.step_allocations, tensors_per_micro);
}

// Micro-batches past the second are counted, not run: the peak is the same
// at any accumulation, and each further micro-batch adds the same
// collectives and tensors.
TEST(DryRunTest, AccumulationCountsRepeatedMicroBatches) {
  const models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  recipe::Layout s;
  s.world = 2;
  s.micro_batch = 2;
  s.seq_len = 32;
  const std::vector<DryRunResult> runs = DryRunsAt(config, s, {2, 3, 4});
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[1].peak_bytes, runs[0].peak_bytes);
  EXPECT_EQ(runs[2].peak_bytes, runs[0].peak_bytes);
  ExpectEachMicroBatchAddsTheSame(runs[0], runs[1], runs[2]);
}

// The mesh axis of a simulated group's name: "train/shard@replicate=0" ->
// "shard" (the group of shard ranks at replicate coordinate 0).
std::string Axis(const std::string& group) {
  const std::string tail = group.substr(group.rfind('/') + 1);
  return tail.substr(0, tail.find('@'));
}

// HSDP on 2 x 2 ranks, 1 x 32 tokens per micro-batch.
recipe::Layout Hsdp2x2() {
  recipe::Layout s;
  s.world = 4;
  s.dp_replicate = 2;
  s.micro_batch = 1;
  s.seq_len = 32;
  return s;
}

// HSDP: the replicas all-reduce once per step whatever the accumulation
// (recipe/step's PlainStep): one all-reduce per unit on the replicate
// group at 1 to 5 micro-batches; each micro-batch past the third adds the
// same collectives and tensors (the middle one's), and the peak is the same
// from 2 on (the replicas' sum is held from the first micro-batch's
// reduction to the last's).
TEST(DryRunTest, HsdpAllReducesOncePerStep) {
  const models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  const recipe::Layout s = Hsdp2x2();
  const std::vector<DryRunResult> runs = DryRunsAt(config, s, {1, 2, 3, 4, 5});
  ASSERT_EQ(runs.size(), 5u);
  for (size_t i = 0; i < runs.size(); ++i) {
    int replica_all_reduces = 0;
    for (const SimulatedOp& op : runs[i].ops) {
      replica_all_reduces +=
          op.kind == "all_reduce" && Axis(op.group) == "replicate";
    }
    EXPECT_EQ(replica_all_reduces, config.n_layers + 1)
        << i + 1 << " micro-batches";
  }
  for (size_t i = 2; i < runs.size(); ++i) {
    EXPECT_EQ(runs[i].peak_bytes, runs[1].peak_bytes) << i + 1;
  }
  EXPECT_GT(runs[1].peak_bytes, runs[0].peak_bytes);
  ExpectEachMicroBatchAddsTheSame(runs[2], runs[3], runs[4]);
}

// The step's scalar collectives are the trainer's own calls, run by the
// recipe on the simulated groups: the loss averaged over the world, then
// the gradient norm's one scalar over the shard axis (the replicas already
// agree), each one f32.
TEST(DryRunTest, LogsTheTrainersLossAndNormCollectives) {
  const models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  const recipe::Layout s = Hsdp2x2();
  absl::StatusOr<DryRunResult> r = DryRun(config, s);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::string> scalars;
  for (const SimulatedOp& op : r->ops) {
    if (op.kind == "all_reduce" && op.in_bytes == 4) {
      scalars.push_back(absl::StrCat(Axis(op.group), " ", op.group_size));
    }
  }
  EXPECT_EQ(scalars, (std::vector<std::string>{"flat 4", "shard 2"}));
}

// Tensor parallelism (each family's plan on a tp axis, FSDP over the
// shard axis; per-process exactness is checked against the trainer in
// trainer/train_e2e_test.sh): the rank's pieces of the state, fewer
// activations, and tensor parallelism's collectives on the tp groups.
TEST(DryRunTest, TensorParallelPlansTheRanksPieces) {
  for (const char* model : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(model);
    const models::TransformerConfig config = *models::ConfigByName(model);
    recipe::Layout dp;
    dp.world = 2;
    dp.micro_batch = 2;
    dp.seq_len = 32;
    recipe::Layout tp = dp;
    tp.tp = 2;
    recipe::Layout sp = tp;
    sp.sequence_parallel = true;
    sp.loss_parallel = true;
    absl::StatusOr<DryRunResult> d = DryRun(config, dp);
    absl::StatusOr<DryRunResult> t = DryRun(config, tp);
    absl::StatusOr<DryRunResult> q = DryRun(config, sp);
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(q.ok()) << q.status();
    // FSDP 2 holds half of every parameter; tp 2 half of the split ones and
    // all of the replicated ones (norms, biases after a row-wise split).
    EXPECT_GE(t->rank_params, d->rank_params);
    EXPECT_LT(t->rank_params, t->model_params);
    EXPECT_GT(2 * t->rank_params, t->model_params);
    EXPECT_EQ(t->param_bytes, t->rank_params * 4);
    int tp_ops = 0;
    for (const SimulatedOp& op : t->ops) {
      tp_ops += absl::StrContains(op.group, "/tp");
    }
    EXPECT_GT(tp_ops, 2 * config.n_layers) << "one per block forward at least";
    // Sequence parallelism splits the norms' and residual stream's
    // activations: a lower peak than tensor parallelism alone.
    EXPECT_LT(q->peak_bytes, t->peak_bytes);
  }
  recipe::Layout bad;
  bad.world = 2;
  bad.sequence_parallel = true;
  EXPECT_EQ(DryRun(*models::ConfigByName("gpt2_debug"), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Expert parallelism: every rank's sharded state (fp32 masters, gradients,
// AdamW's moments) in the dry run is exactly the real step's, rank by rank
// (ep 2 on 2 ranks, ep 2 x efsdp 2 on 4, ep 2 x tp 2 on 4); the ranks'
// masters hold the whole model (tp's replicated norms and router more than
// once).
TEST(DryRunTest, ExpertParallelStateIsTheRealStepsOnEveryRank) {
  const models::TransformerConfig config = *models::ConfigByName("moe_debug");
  struct Shape3 {
    int world, ep, tp;
  };
  for (const Shape3 c : {Shape3{2, 2, 1}, Shape3{4, 2, 1}, Shape3{4, 2, 2}}) {
    recipe::Layout s;
    s.world = c.world;
    s.ep = c.ep;
    s.tp = c.tp;
    s.micro_batch = 2;
    s.seq_len = 32;
    const std::string what = s.ToString();
    SCOPED_TRACE(what);
    InMemoryStore store;
    std::vector<absl::StatusOr<DryRunResult>> real(
        c.world, absl::UnknownError("not run"));
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < c.world; ++rank) {
      ranks.emplace_back([&, rank] {
        real[rank] =
            RunStepOn(config, s, rank, GlooGroupFactory(&store), Device::Cpu());
      });
    }
    for (std::thread& t : ranks) t.join();
    int64_t total = 0, model = 0;
    for (int rank = 0; rank < c.world; ++rank) {
      ASSERT_TRUE(real[rank].ok()) << real[rank].status();
      absl::StatusOr<DryRunResult> dry = DryRun(config, s, rank);
      ASSERT_TRUE(dry.ok()) << dry.status();
      EXPECT_EQ(dry->rank_params, real[rank]->rank_params) << rank;
      EXPECT_EQ(dry->param_bytes, real[rank]->param_bytes) << rank;
      EXPECT_EQ(dry->grad_bytes, real[rank]->grad_bytes) << rank;
      EXPECT_EQ(dry->optimizer_bytes, real[rank]->optimizer_bytes) << rank;
      total += dry->rank_params;
      model = dry->model_params;
    }
    EXPECT_GE(total, model);
    if (c.tp == 1) {
      EXPECT_EQ(total, model);
    }
  }
}

// Pipeline parallelism: each pipeline rank plans its own stages; GPipe
// keeps every micro-batch's activations until its backwards, 1F1B at most
// one per stage in flight, so GPipe's peak is the higher; the stages'
// transfers are logged. MakePlan's kLargestRank is the largest stage's plan.
TEST(DryRunTest, PipelineRanksPlanTheirStages) {
  for (const char* model : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(model);
    const models::TransformerConfig config = *models::ConfigByName(model);
    recipe::Layout s;
    s.world = 2;
    s.pp = 2;
    s.micro_batch = 2;
    s.seq_len = 32;
    s.grad_accumulation = 4;
    recipe::Layout gpipe = s;
    gpipe.pp_schedule = "gpipe";
    int64_t largest = 0;
    for (int rank : {0, 1}) {
      absl::StatusOr<DryRunResult> f = DryRun(config, s, rank);
      absl::StatusOr<DryRunResult> g = DryRun(config, gpipe, rank);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_LT(f->rank_params, f->model_params);
      EXPECT_GT(f->pipeline_bubble, 0);
      EXPECT_GT(g->peak_bytes, f->peak_bytes) << "rank " << rank;
      int p2p = 0;
      for (const SimulatedOp& op : f->ops) p2p += op.kind == "p2p";
      EXPECT_GE(p2p, 2 * s.grad_accumulation) << "rank " << rank;
      largest = std::max(largest, f->peak_bytes);
    }
    DeviceSpec cpu = *DeviceByName("cpu", 2, /*calibrate=*/false);
    absl::StatusOr<Plan> plan = MakePlan(config, s, cpu);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->run.peak_bytes, largest);
  }
}

}  // namespace
}  // namespace plan
}  // namespace fsdpp
