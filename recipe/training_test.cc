// The build and the step on thread ranks over real Gloo: FSDP on two ranks
// and a two-stage pipeline each train gpt2_debug to the single rank's loss,
// the optimizer step applies (and clips) on finite gradients, evaluation
// averages over the world, the pipeline describes itself, and a layout that
// does not validate or a mesh of other axes is refused; frozen parameters
// stay and the rest trains alike on every layout. Every registered
// family has both plans.
#include "recipe/training.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/lora.h"
#include "optim/adamw.h"
#include "recipe/families.h"
#include "recipe/layout.h"
#include "recipe/step/step.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace recipe {
namespace {

constexpr int64_t kSeq = 16;

models::TransformerConfig Gpt2Debug() {
  return *models::ConfigByName("gpt2_debug");
}

// The same micro-batch m on every rank (data-parallel ranks would read
// different ones; these tests compare losses, not batches).
MicroBatchSource Source(int64_t rows, int64_t vocab) {
  return [rows, vocab](int64_t m) -> absl::StatusOr<MicroBatch> {
    std::vector<int64_t> ids, targets;
    for (int64_t i = 0; i < rows * kSeq; ++i) {
      ids.push_back((i * 7 + m * 13 + 1) % vocab);
      targets.push_back((i * 5 + m * 3 + 2) % vocab);
    }
    MicroBatch b;
    FSDPP_ASSIGN_OR_RETURN(b.ids, Tensor::FromInts({rows, kSeq}, ids));
    FSDPP_ASSIGN_OR_RETURN(b.targets, Tensor::FromInts({rows, kSeq}, targets));
    return b;
  };
}

Layout Base(int world) {
  Layout l;
  l.world = world;
  l.micro_batch = 2;
  l.seq_len = kSeq;
  l.grad_accumulation = 2;
  return l;
}

// Two steps of `layout`; rank 0's losses and the last step's norm.
struct Outcome {
  std::vector<double> losses;
  double grad_norm = 0;
  double eval = 0;
  std::vector<std::string> describe;
};

// A test's own look at a rank's training: after the build (`after_steps`
// false) and after the two steps.
using Look = std::function<void(Training& t, int rank, bool after_steps)>;

// A data-parallel rank's micro-batches (`data_rank` in [0,
// layout.data_parallel())).
using SourceFor =
    std::function<MicroBatchSource(const Layout& layout, int data_rank)>;

// `on_device`: BuildOptions::step_values_on_device (the values read after
// the two steps). `source_for`: each rank's data (its evaluation then runs
// grad_accumulation micro-batches: the step's); null: Source's, the same on
// every rank.
Outcome Train(const Layout& layout, bool on_device = false,
              const Look& look = nullptr,
              const SourceFor& source_for = nullptr) {
  Outcome out;
  testing_util::RunOnMesh(layout.MeshAxes(), [&](int rank, DeviceMesh& mesh) {
    BuildOptions options;
    options.seed = 5;
    options.adamw.lr = 1e-3;
    options.step_values_on_device = on_device;
    absl::StatusOr<std::unique_ptr<Training>> t =
        Training::Build(Gpt2Debug(), layout, &mesh, options);
    ASSERT_TRUE(t.ok()) << t.status();
    const bool deferred = on_device && layout.pp == 1;
    EXPECT_EQ((*t)->values_on_device(), deferred);
    MicroBatchSource source =
        Source(layout.micro_batch, Gpt2Debug().vocab_size);
    if (source_for) {
      absl::StatusOr<DeviceMesh*> data = mesh.SubMesh(layout.DataAxes());
      ASSERT_TRUE(data.ok()) << data.status();
      source = source_for(layout, layout.DataRank((*data)->rank()));
    }
    if (look) look(**t, rank, false);
    for (int step = 0; step < 2; ++step) {
      absl::StatusOr<StepLoss> loss = (*t)->ForwardBackward(source);
      ASSERT_TRUE(loss.ok()) << loss.status();
      OptimizerStepOptions o;
      o.lr = 1e-3;
      o.grad_clip = 0.5;
      absl::StatusOr<OptimizerStepResult> opt = (*t)->OptimizerStep(o);
      ASSERT_TRUE(opt.ok()) << opt.status();
      EXPECT_TRUE(opt->applied);
      EXPECT_FALSE(opt->skipped);
      EXPECT_EQ(opt->on_device, deferred);
      if (deferred) {
        EXPECT_TRUE(std::isnan(loss->loss));
        EXPECT_TRUE(std::isnan(opt->grad_norm));
        EXPECT_EQ((*t)->pending_steps(), step + 1);
        continue;
      }
      EXPECT_GT(opt->grad_norm, 0);
      if (rank == 0) {
        out.losses.push_back(loss->loss);
        out.grad_norm = opt->grad_norm;
      }
    }
    if (deferred) {
      absl::StatusOr<std::vector<Training::StepValues>> values =
          (*t)->ReadStepValues();
      ASSERT_TRUE(values.ok()) << values.status();
      ASSERT_EQ(values->size(), 2u);
      EXPECT_EQ((*t)->pending_steps(), 0);
      EXPECT_TRUE((*t)->ReadStepValues()->empty());
      for (const Training::StepValues& v : *values) {
        EXPECT_TRUE(v.applied());
        if (rank == 0) out.losses.push_back(v.loss);
      }
      if (rank == 0) out.grad_norm = values->back().grad_norm;
    }
    EXPECT_EQ((*t)->optimizer().step(), 2);
    if (look) look(**t, rank, true);
    absl::StatusOr<double> eval =
        (*t)->Evaluate(source_for ? layout.grad_accumulation : 2, source);
    ASSERT_TRUE(eval.ok()) << eval.status();
    absl::StatusOr<std::string> table = (*t)->ReportTable({1.0, 1.0, 64});
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->empty(), layout.pp == 1);
    if (rank == 0) {
      out.eval = *eval;
      out.describe = (*t)->Describe();
    }
  });
  return out;
}

// `r` trained to `one`'s losses, last gradient norm and evaluation.
void ExpectTrainsLike(const Outcome& r, const Outcome& one) {
  ASSERT_EQ(r.losses.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_NEAR(r.losses[s], one.losses[s], 1e-5 * one.losses[s]) << s;
  }
  EXPECT_NEAR(r.grad_norm, one.grad_norm, 1e-4 * one.grad_norm);
  EXPECT_NEAR(r.eval, one.eval, 1e-5 * one.eval);
}

// Document masks through a pipeline: pp 2 (1F1B and GPipe) trains to the
// single rank's losses with packed documents (the second stage takes each
// micro-batch's ids), which differ from the unmasked run's.
TEST(TrainingTest, PipelineStagesCarryDocumentMasks) {
  Layout base = Base(1);
  base.document_eot_id = 8;
  const Outcome one = Train(base);
  ASSERT_EQ(one.losses.size(), 2u);
  const Outcome unmasked = Train(Base(1));
  EXPECT_GT(std::fabs(unmasked.losses[0] - one.losses[0]), 1e-4);
  for (const char* schedule : {"1f1b", "gpipe"}) {
    SCOPED_TRACE(schedule);
    Layout pp = base;
    pp.world = 2;
    pp.pp = 2;
    pp.pp_schedule = schedule;
    ExpectTrainsLike(Train(pp), one);
  }
}

TEST(TrainingTest, LayoutsTrainToTheSingleRanksLosses) {
  const Outcome one = Train(Base(1));
  ASSERT_EQ(one.losses.size(), 2u);
  EXPECT_GT(one.losses[0], one.losses[1]);
  EXPECT_TRUE(one.describe.empty());
  Layout fsdp = Base(2);
  fsdp.micro_batch = 2;  // each rank its own copy of the same rows
  const Outcome two = Train(fsdp);
  Layout pipeline = Base(2);
  pipeline.pp = 2;
  const Outcome pp = Train(pipeline);
  for (const Outcome* r : {&two, &pp}) ExpectTrainsLike(*r, one);
  ASSERT_EQ(pp.describe.size(), 1u);
  EXPECT_TRUE(absl::StrContains(pp.describe[0], "pipeline: 1F1B over 2"))
      << pp.describe[0];
}

// Context parallelism: cp 2, cp 4, cp 2 x dp_shard 2, cp 2 x tp 2 (with
// sequence parallelism) and HSDP 2 x cp 2 in the ring style, cp 2, cp 4 and
// cp 2 x dp_shard 2 in the all-to-all style, pp 2 x cp 2 in both, train to
// the single rank's losses,
// gradient norm and evaluation (the cp ranks read the same rows and each
// computes its chunks; FSDP averages over dp x cp), with and without
// document masks.
TEST(TrainingTest, ContextParallelLayoutsTrainToTheSingleRanksLosses) {
  for (int64_t eot : {int64_t{-1}, int64_t{8}}) {
    SCOPED_TRACE(::testing::Message() << "document_eot_id " << eot);
    Layout base = Base(1);
    base.document_eot_id = eot;
    const Outcome one = Train(base);
    ASSERT_EQ(one.losses.size(), 2u);
    std::vector<Layout> layouts;
    for (int cp : {2, 4}) {
      Layout l = base;
      l.world = cp;
      l.cp = cp;
      layouts.push_back(l);
    }
    Layout dp = base;
    dp.world = 4;
    dp.cp = 2;
    layouts.push_back(dp);
    Layout tp = dp;
    tp.tp = 2;
    tp.sequence_parallel = true;
    layouts.push_back(tp);
    Layout hsdp = dp;
    hsdp.dp_replicate = 2;
    layouts.push_back(hsdp);
    // The all-to-all style (gpt2_debug's 4 heads over cp 2 and 4).
    for (Layout l : {layouts[0], layouts[1], dp}) {
      l.cp_style = "alltoall";
      layouts.push_back(l);
    }
    // With pipeline parallelism: pp 2 x cp 2 in both styles (the second
    // stage takes each micro-batch's ids for its positions and masks).
    Layout pp = dp;
    pp.pp = 2;
    layouts.push_back(pp);
    pp.cp_style = "alltoall";
    layouts.push_back(pp);
    for (const Layout& l : layouts) {
      SCOPED_TRACE(l.ToString());
      ASSERT_TRUE(l.Validate(Gpt2Debug()).ok()) << l.Validate(Gpt2Debug());
      const Outcome r = Train(l);
      ExpectTrainsLike(r, one);
      ASSERT_EQ(r.describe.size(), l.pp > 1 ? 2u : 1u);
      EXPECT_TRUE(absl::StrContains(
          r.describe.back(),
          absl::StrCat("context parallel: each sequence over cp ", l.cp,
                       " ranks (",
                       l.cp_style == "ring" ? "ring attention"
                                            : "all-to-all attention over heads",
                       "; chunks of ", kSeq / (2 * l.cp), " tokens")))
          << r.describe.back();
    }
  }
}

// The step's values kept on the device (as on a GPU) and read after: the
// same losses and norms, to f32 rounding of the sums (the host path adds
// them in double); a pipeline reads them every step all the same.
TEST(TrainingTest, ValuesKeptOnTheDeviceAreTheStepsValues) {
  const Outcome one = Train(Base(1));
  Layout fsdp = Base(2);
  Layout pipeline = Base(2);
  pipeline.pp = 2;
  for (const Layout& layout : {Base(1), fsdp, pipeline}) {
    const Outcome on_device = Train(layout, /*on_device=*/true);
    ASSERT_EQ(on_device.losses.size(), 2u);
    for (int s = 0; s < 2; ++s) {
      EXPECT_NEAR(on_device.losses[s], one.losses[s], 1e-5 * one.losses[s])
          << layout.ToString() << " step " << s;
    }
    EXPECT_NEAR(on_device.grad_norm, one.grad_norm, 1e-4 * one.grad_norm)
        << layout.ToString();
  }
}

// A step whose gradient is not finite is skipped by AdamW itself (the
// parameters keep their bits) and read back as not applied; the order of
// the calls is checked.
TEST(TrainingTest, ValuesOnTheDeviceSkipANonFiniteStep) {
  testing_util::RunOnMesh({{"shard", 2}}, [](int, DeviceMesh& mesh) {
    BuildOptions options;
    options.seed = 5;
    options.step_values_on_device = true;
    absl::StatusOr<std::unique_ptr<Training>> t =
        Training::Build(Gpt2Debug(), Base(2), &mesh, options);
    ASSERT_TRUE(t.ok()) << t.status();
    OptimizerStepOptions o;
    o.lr = 1e-3;
    EXPECT_EQ((*t)->OptimizerStep(o).status().code(),
              absl::StatusCode::kFailedPrecondition);
    const MicroBatchSource source = Source(2, Gpt2Debug().vocab_size);
    ASSERT_TRUE((*t)->ForwardBackward(source).ok());
    EXPECT_EQ((*t)->ReadStepValues().status().code(),
              absl::StatusCode::kFailedPrecondition);
    // A NaN in one gradient of this rank: the norm is NaN on both.
    fsdp::ShardedParameter* p = (*t)->params().front();
    ASSERT_TRUE(Fill(p->grad.mutable_local(), std::nanf("")).ok());
    std::vector<std::vector<float>> before;
    for (fsdp::ShardedParameter* sp : (*t)->params()) {
      before.push_back(*sp->master.local().ToFloats());
    }
    ASSERT_TRUE((*t)->OptimizerStep(o).ok());
    for (size_t i = 0; i < before.size(); ++i) {
      const std::vector<float> after =
          *(*t)->params()[i]->master.local().ToFloats();
      ASSERT_EQ(after.size(), before[i].size());
      for (size_t j = 0; j < after.size(); ++j) {
        // NaN-safe bitwise equality.
        ASSERT_EQ(std::memcmp(&after[j], &before[i][j], sizeof(float)), 0)
            << (*t)->params()[i]->name << " element " << j;
      }
    }
    // The next step is fine again.
    ASSERT_TRUE((*t)->ForwardBackward(source).ok());
    ASSERT_TRUE((*t)->OptimizerStep(o).ok());
    absl::StatusOr<std::vector<Training::StepValues>> values =
        (*t)->ReadStepValues();
    ASSERT_TRUE(values.ok()) << values.status();
    ASSERT_EQ(values->size(), 2u);
    EXPECT_FALSE((*values)[0].applied());
    EXPECT_TRUE(std::isnan((*values)[0].grad_norm));
    EXPECT_TRUE(std::isfinite((*values)[0].loss));
    EXPECT_TRUE((*values)[1].applied());
  });
}

// For runs with frozen parameters (Layout::Frozen; LoRA's base too): each
// has no gradient and keeps its master through the steps, and only the
// trainable ones have AdamW state; a trainable one `must_change` names must
// change. The masters are compared per rank between the build and the end.
Look FrozenParametersStay(
    const std::function<bool(const std::string&)>& must_change) {
  return [must_change](Training& t, int rank, bool after_steps) {
    static std::mutex mu;
    static std::map<std::pair<int, std::string>, std::vector<double>> before;
    std::lock_guard<std::mutex> lock(mu);
    int frozen = 0, trainable = 0;
    for (fsdp::ShardedParameter* sp : t.params()) {
      const bool is_frozen = t.layout().Frozen(sp->name);
      EXPECT_EQ(sp->requires_grad, !is_frozen) << sp->name;
      (is_frozen ? frozen : trainable) += 1;
      if (is_frozen) {
        EXPECT_FALSE(sp->grad.local().defined()) << sp->name;
      }
      const std::vector<double> values =
          testing_util::Values(sp->master.local());
      const auto key = std::make_pair(rank, sp->name);
      if (!after_steps) {
        before[key] = values;
      } else if (is_frozen) {
        EXPECT_EQ(values, before.at(key)) << sp->name;
      } else if (must_change(sp->name) && !values.empty()) {
        EXPECT_NE(values, before.at(key)) << sp->name << " did not train";
      }
    }
    EXPECT_GT(frozen, 0);
    absl::StatusOr<OptimizerStateDict> state = t.optimizer().StateDict();
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->tensors.size(), 2u * trainable);
    for (const auto& [name, tensor] : state->tensors) {
      EXPECT_FALSE(t.layout().Frozen(name.substr(0, name.rfind('.')))) << name;
    }
  };
}

// `base` at one rank trains from the same weights as the run that trains
// everything (the same first loss) but not alike (the second differs), and
// every layout of `others` to its losses; `look` sees every run.
void ExpectFrozenRunsTrainAlike(const Layout& base, const Look& look,
                                const std::vector<Layout>& others) {
  const Outcome one = Train(base, false, look);
  ASSERT_EQ(one.losses.size(), 2u);
  const Outcome everything = Train(Base(1));
  EXPECT_EQ(everything.losses[0], one.losses[0]);
  EXPECT_GT(std::fabs(everything.losses[1] - one.losses[1]), 1e-5);
  for (const Layout& l : others) {
    SCOPED_TRACE(l.ToString());
    ExpectTrainsLike(Train(l, false, look), one);
  }
}

// Frozen parameters (Layout::freeze; here the tied embedding, the first
// block and every bias): no gradient, no AdamW state, no place in any
// reduce-scatter (the first block's unit issues none), masters unchanged by
// the steps; the rest trains to the same losses at W = 1, FSDP 2, tp 2 and
// pp 2, and differently from the run that trains everything.
TEST(TrainingTest, FrozenParametersStayAndTheRestTrainsAlikeOnEveryLayout) {
  const std::vector<std::string> freeze = {"wte.weight", "h.0.*", "*.bias"};
  const Look stay =
      FrozenParametersStay([](const std::string&) { return false; });
  const Look look = [&](Training& t, int rank, bool after_steps) {
    stay(t, rank, after_steps);
    if (!after_steps) return;
    for (fsdp::FsdpUnit* u : t.units()) {
      const bool all_frozen = u->gradient_segment_elements() == 0;
      const int64_t n = u->stats().reduce_scatters;
      EXPECT_EQ(n == 0, all_frozen) << u->name();
      EXPECT_EQ(u->stats().reduce_scatter_elements,
                n * u->gradient_segment_elements() * t.layout().fsdp_shard())
          << u->name();
    }
    if (t.layout().pp == 1) {
      EXPECT_EQ(t.units().front()->gradient_segment_elements(), 0)
          << t.units().front()->name() << " holds the first block";
    }
  };
  Layout base = Base(1);
  base.freeze = freeze;
  Layout fsdp = base;
  fsdp.world = 2;
  Layout tp = fsdp;
  tp.tp = 2;
  Layout pp = fsdp;
  pp.pp = 2;
  ExpectFrozenRunsTrainAlike(base, look, {fsdp, tp, pp});
}

// LoRA (r 4 on the attention's projections and the first block's MLP
// input): the adapters are the only trainable parameters (gradients, AdamW
// state) and start as PEFT's (B zero: the first loss is the base model's);
// FSDP 2 and 3, HSDP 2 x 1, pp 2, cp 2, tp 2 (alone, with FSDP and
// sequence / loss parallelism, with pp) train to the single rank's losses;
// the base's masters never change.
TEST(TrainingTest, LoraTrainsTheAdaptersAloneOnEveryLayout) {
  const Look look = FrozenParametersStay([](const std::string& name) {
    return absl::StrContains(name, "lora_B");
  });
  Layout base = Base(1);
  base.lora.rank = 4;
  base.lora.alpha = 8;
  base.lora.targets = {"c_attn", "attn.c_proj", "h.0.mlp.fc"};
  Layout fsdp = base;
  fsdp.world = 2;
  Layout hsdp = fsdp;
  hsdp.dp_replicate = 2;
  hsdp.micro_batch = 2;
  Layout pp = fsdp;
  pp.pp = 2;
  Layout cp = fsdp;
  cp.cp = 2;
  Layout three = base;
  three.world = 3;
  // Tensor parallelism: each adapter split as its base weight (B's rows
  // with a column-wise layer's, fused c_attn's per block; A's columns with
  // a row-wise layer's), the whole one's gradient all-reduced; with FSDP,
  // sequence and loss parallelism; and with pp.
  Layout tp = base;
  tp.world = 2;
  tp.tp = 2;
  Layout tp_dp = tp;
  tp_dp.world = 4;
  tp_dp.sequence_parallel = true;
  tp_dp.loss_parallel = true;
  Layout tp_pp = tp_dp;
  tp_pp.world = 4;
  tp_pp.pp = 2;
  ExpectFrozenRunsTrainAlike(base, look,
                             {fsdp, three, hsdp, pp, cp, tp, tp_dp, tp_pp});
}

// ZeRO-1 (reshard_after_backward false): over 4 micro-batches each unit
// all-gathers once per step (none in backward) and reduce-scatters once;
// the losses are ZeRO-3's within 1e-6, at W = 2 and with HSDP.
// LoRA dropout (p 0.2): the masks follow the samples, tokens and features,
// so FSDP 2 and 3, HSDP, tp 2 (features split), cp 2 (columns split), pp 2
// and activation checkpointing (full and selective: the replays drop the
// same) train to the single rank's losses; and the dropout is there (the
// second step's loss differs from p 0's).
TEST(TrainingTest, LoraDropoutDropsTheSameOnEveryLayout) {
  const Look look = FrozenParametersStay([](const std::string& name) {
    return absl::StrContains(name, "lora_B");
  });
  Layout base = Base(1);
  base.lora.rank = 4;
  base.lora.alpha = 8;
  base.lora.dropout = 0.2f;
  base.lora.targets = {"c_attn", "attn.c_proj", "mlp.fc"};
  Layout none = base;
  none.lora.dropout = 0;
  const Outcome undropped = Train(none);
  const Outcome one = Train(base, false, look);
  ASSERT_EQ(one.losses.size(), 2u);
  EXPECT_EQ(one.losses[0], undropped.losses[0]);  // B = 0: no adapter yet
  EXPECT_GT(std::fabs(one.losses[1] - undropped.losses[1]), 1e-6);
  std::vector<Layout> layouts;
  Layout fsdp = base;
  fsdp.world = 2;
  layouts.push_back(fsdp);
  Layout three = base;
  three.world = 3;
  layouts.push_back(three);
  Layout hsdp = fsdp;
  hsdp.world = 4;
  hsdp.dp_replicate = 2;
  layouts.push_back(hsdp);
  Layout tp = fsdp;
  tp.tp = 2;
  tp.sequence_parallel = true;
  layouts.push_back(tp);
  Layout cp = fsdp;
  cp.cp = 2;
  layouts.push_back(cp);
  Layout pp = fsdp;
  pp.pp = 2;
  layouts.push_back(pp);
  Layout full = fsdp;
  full.activation_checkpointing = nn::CheckpointPolicy::Full();
  layouts.push_back(full);
  Layout selective = fsdp;
  selective.activation_checkpointing = nn::CheckpointPolicy::Selective();
  layouts.push_back(selective);
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.ToString());
    ExpectTrainsLike(Train(l, false, look), one);
  }
}

TEST(TrainingTest, Zero1GathersOncePerStepAndTrainsLikeZero3) {
  const Look look = [&](Training& t, int, bool after_steps) {
    if (!after_steps) return;
    for (fsdp::FsdpUnit* u : t.units()) {
      int64_t forward = 0, backward = 0;
      for (const auto& [ranks, n] : u->stats().forward_all_gathers) {
        forward += n;
      }
      for (const auto& [ranks, n] : u->stats().backward_all_gathers) {
        backward += n;
      }
      EXPECT_EQ(forward, 2) << u->name();
      EXPECT_EQ(backward, 0) << u->name();
      EXPECT_EQ(u->stats().reduce_scatters, 2) << u->name();
    }
  };
  for (int replicas : {1, 2}) {
    Layout zero3 = Base(2 * replicas);
    zero3.dp_replicate = replicas;
    zero3.grad_accumulation = 4;
    zero3.micro_batch = 1;
    Layout zero1 = zero3;
    zero1.reshard_after_backward = false;
    EXPECT_NE(zero1.ToString().find("ZeRO-1"), std::string::npos);
    const Outcome three = Train(zero3);
    const Outcome one = Train(zero1, false, look);
    ASSERT_EQ(one.losses.size(), 2u);
    for (int s = 0; s < 2; ++s) {
      EXPECT_NEAR(one.losses[s], three.losses[s], 1e-6 * three.losses[s]);
    }
    EXPECT_NEAR(one.grad_norm, three.grad_norm, 1e-5 * three.grad_norm);
  }
}

// SFT-like data: eight rows of kSeq tokens per step, each with a prefix of
// its targets masked (-100: a prompt), of lengths 0 to the whole row, so
// the rows count 16, 13, 0, 7, 15, 4, 11 and 1 targets (67 in all). Global
// row g goes to data-parallel rank g % D, micro-batch g / (rows x D), as
// the loader deals them. `weighted`: the micro-batches carry the step's
// count (MicroBatch::step_loss_tokens), so the loss is the token mean over
// the eight rows.
constexpr int64_t kMaskedRows = 8;
constexpr int64_t kMaskedPrefix[kMaskedRows] = {0, 3, 16, 9, 1, 12, 5, 15};

SourceFor MaskedRows(bool weighted) {
  return [weighted](const Layout& layout, int data_rank) -> MicroBatchSource {
    const int64_t rows = layout.micro_batch;
    const int64_t ranks = layout.data_parallel();
    const int64_t vocab = Gpt2Debug().vocab_size;
    return [=](int64_t m) -> absl::StatusOr<MicroBatch> {
      std::vector<int64_t> ids, targets;
      int64_t total = 0;
      for (int64_t g = 0; g < kMaskedRows; ++g)
        total += kSeq - kMaskedPrefix[g];
      for (int64_t b = 0; b < rows; ++b) {
        const int64_t g = (m * rows + b) * ranks + data_rank;
        if (g >= kMaskedRows) {
          return absl::InternalError(absl::StrCat("row ", g, " of 8"));
        }
        for (int64_t i = 0; i < kSeq; ++i) {
          ids.push_back((g * 11 + i * 7 + 1) % vocab);
          targets.push_back(i < kMaskedPrefix[g] ? -100
                                                 : (g * 5 + i * 3 + 2) % vocab);
        }
      }
      MicroBatch batch;
      FSDPP_ASSIGN_OR_RETURN(batch.ids, Tensor::FromInts({rows, kSeq}, ids));
      FSDPP_ASSIGN_OR_RETURN(batch.targets,
                             Tensor::FromInts({rows, kSeq}, targets));
      batch.step_loss_tokens = weighted ? total : -1;
      return batch;
    };
  };
}

// The loss over a global batch's counted targets: micro-batches and ranks
// whose counts differ (a row all prompt among them) train as the whole
// batch in one micro-batch does -- FSDP on 2 and 4 ranks, HSDP, cp 2 (ring
// and all-to-all, with dp), tp 2 with loss parallel, pp 2 -- while the
// per-micro-batch means that the count replaces do not.
TEST(TrainingTest, MaskedTargetsWeighByTheirCountOverTheGlobalBatch) {
  Layout one = Base(1);
  one.micro_batch = kMaskedRows;
  one.grad_accumulation = 1;
  const Outcome whole = Train(one, false, nullptr, MaskedRows(true));
  ASSERT_EQ(whole.losses.size(), 2u);
  // One micro-batch: its own count is the step's.
  const Outcome whole_unweighted =
      Train(one, false, nullptr, MaskedRows(false));
  EXPECT_EQ(whole_unweighted.losses, whole.losses);

  Layout accumulate = one;
  accumulate.micro_batch = 2;
  accumulate.grad_accumulation = 4;
  // Means of micro-batches weighted equally: another loss (the pitfall).
  const Outcome means = Train(accumulate, false, nullptr, MaskedRows(false));
  ASSERT_EQ(means.losses.size(), 2u);
  EXPECT_GT(std::abs(means.losses[0] - whole.losses[0]), 1e-3);

  std::vector<Layout> layouts = {accumulate};
  Layout fsdp = accumulate;
  fsdp.world = 2;
  fsdp.grad_accumulation = 2;
  layouts.push_back(fsdp);
  Layout four = fsdp;
  four.world = 4;
  four.micro_batch = 1;
  layouts.push_back(four);
  Layout hsdp = four;
  hsdp.dp_replicate = 2;
  layouts.push_back(hsdp);
  Layout cp = accumulate;
  cp.world = 2;
  cp.cp = 2;
  layouts.push_back(cp);
  cp.cp_style = "alltoall";
  layouts.push_back(cp);
  Layout cp_dp = fsdp;
  cp_dp.world = 4;
  cp_dp.cp = 2;
  layouts.push_back(cp_dp);
  Layout tp = accumulate;
  tp.world = 2;
  tp.tp = 2;
  tp.sequence_parallel = true;
  tp.loss_parallel = true;
  layouts.push_back(tp);
  Layout pp = accumulate;
  pp.world = 2;
  pp.pp = 2;
  layouts.push_back(pp);
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.ToString());
    ASSERT_TRUE(l.Validate(Gpt2Debug()).ok()) << l.Validate(Gpt2Debug());
    const Outcome r = Train(l, false, nullptr, MaskedRows(true));
    ExpectTrainsLike(r, whole);
  }
}

// A row whose targets are all masked adds nothing: the batch with it trains
// exactly as the batch without it (loss, gradient norm, evaluation).
TEST(TrainingTest, AMaskedRowAddsNothingToLossOrGradients) {
  Layout two = Base(1);
  two.micro_batch = 2;
  two.grad_accumulation = 1;
  const auto rows = [](bool with_masked_row) -> SourceFor {
    return [with_masked_row](const Layout&, int) -> MicroBatchSource {
      return [with_masked_row](int64_t) -> absl::StatusOr<MicroBatch> {
        std::vector<int64_t> ids, targets;
        for (int64_t i = 0; i < kSeq; ++i) {
          ids.push_back((i * 7 + 1) % 64);
          targets.push_back(i < 5 ? -100 : (i * 3 + 2) % 64);
        }
        if (with_masked_row) {
          for (int64_t i = 0; i < kSeq; ++i) {
            ids.push_back((i * 13 + 5) % 64);
            targets.push_back(-100);
          }
        }
        const int64_t n = with_masked_row ? 2 : 1;
        MicroBatch batch;
        FSDPP_ASSIGN_OR_RETURN(batch.ids, Tensor::FromInts({n, kSeq}, ids));
        FSDPP_ASSIGN_OR_RETURN(batch.targets,
                               Tensor::FromInts({n, kSeq}, targets));
        return batch;
      };
    };
  };
  Layout one = two;
  one.micro_batch = 1;
  const Outcome with = Train(two, false, nullptr, rows(true));
  const Outcome without = Train(one, false, nullptr, rows(false));
  ASSERT_EQ(with.losses.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_NEAR(with.losses[s], without.losses[s], 1e-6 * without.losses[s]);
  }
  EXPECT_NEAR(with.grad_norm, without.grad_norm, 1e-5 * without.grad_norm);
  EXPECT_NEAR(with.eval, without.eval, 1e-6 * without.eval);
}

TEST(TrainingTest, RefusesBadLayoutsAndOtherMeshes) {
  testing_util::RunOnMesh({{"shard", 2}}, [](int, DeviceMesh& mesh) {
    Layout bad = Base(2);
    bad.tp = 3;
    EXPECT_EQ(Training::Build(Gpt2Debug(), bad, &mesh, {}).status().code(),
              absl::StatusCode::kInvalidArgument);
    Layout four = Base(4);
    absl::Status s = Training::Build(Gpt2Debug(), four, &mesh, {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(s.message(), "is not the layout's")) << s;
  });
}

TEST(FamiliesTest, EveryFamilyHasBothPlans) {
  for (models::ModelFamily family :
       {models::ModelFamily::kGpt2, models::ModelFamily::kLlama}) {
    absl::StatusOr<const FamilyPlans*> plans = PlansFor(family);
    ASSERT_TRUE(plans.ok()) << plans.status();
    EXPECT_EQ((*plans)->name, models::ModelFamilyName(family));
    EXPECT_TRUE((*plans)->apply_fsdp);
    EXPECT_TRUE((*plans)->apply_tensor_parallel);
  }
  EXPECT_EQ(AllFamilyPlans().size(), 2u);
  EXPECT_EQ(PlansFor(static_cast<models::ModelFamily>(99)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace recipe
}  // namespace fsdpp
