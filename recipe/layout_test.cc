// The layout: its mesh axes and their names, the pipeline ranks' ranges,
// ToString, and every rule Validate enforces, each refusal naming the field.
#include "recipe/layout.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "models/config.h"

namespace fsdpp {
namespace recipe {
namespace {

models::TransformerConfig Gpt2Debug() {
  return *models::ConfigByName("gpt2_debug");
}

std::vector<std::string> Names(const std::vector<MeshAxis>& axes) {
  std::vector<std::string> names;
  for (const MeshAxis& a : axes) {
    names.push_back(absl::StrCat(a.name, "=", a.size));
  }
  return names;
}

TEST(LayoutTest, MeshAxesOutermostFirst) {
  Layout l;
  l.world = 16;
  EXPECT_EQ(Names(l.MeshAxes()), (std::vector<std::string>{"shard=16"}));
  l.pp = 2;
  l.dp_replicate = 2;
  l.tp = 2;
  EXPECT_EQ(l.dp_shard(), 2);
  EXPECT_EQ(l.data_parallel(), 4);
  EXPECT_EQ(
      Names(l.MeshAxes()),
      (std::vector<std::string>{"pp=2", "replicate=2", "shard=2", "tp=2"}));
  EXPECT_EQ(l.DataAxes(), (std::vector<std::string>{"replicate", "shard"}));
  EXPECT_EQ(l.StageAxes(),
            (std::vector<std::string>{"replicate", "shard", "tp"}));
  EXPECT_EQ(l.PipelineRankOf(7), 0);
  EXPECT_EQ(l.PipelineRankOf(8), 1);
  EXPECT_EQ(l.FirstRankOfPipelineRank(1), 8);
}

// Context parallelism lives inside the shard axis: FSDP shards over
// dp_shard x cp, and the cp ranks of one sequence share a data rank.
TEST(LayoutTest, ContextParallelInsideTheShardAxis) {
  Layout l;
  l.world = 16;
  l.dp_replicate = 2;
  l.cp = 2;
  l.tp = 2;
  EXPECT_EQ(l.dp_shard(), 2);
  EXPECT_EQ(l.fsdp_shard(), 4);
  EXPECT_EQ(l.data_parallel(), 4);
  EXPECT_EQ(Names(l.MeshAxes()),
            (std::vector<std::string>{"replicate=2", "shard=4", "tp=2"}));
  // Data-axes ranks 0..7 (replicate x shard): pairs share a data rank.
  EXPECT_EQ(l.DataRank(0), 0);
  EXPECT_EQ(l.DataRank(1), 0);
  EXPECT_EQ(l.DataRank(2), 1);
  EXPECT_EQ(l.DataRank(7), 3);
  l.seq_len = 64;
  EXPECT_TRUE(l.Validate(Gpt2Debug()).ok()) << l.Validate(Gpt2Debug());
  EXPECT_EQ(l.ToString(),
            "W=16 (2 x 4 HSDP) x CP 2 x TP 2, ZeRO-3, f32/f32, fused "
            "attention, batch 1 x 64 x 1");
}

TEST(LayoutTest, ExpertParallelInsideTheShardAxis) {
  const models::TransformerConfig moe = *models::ConfigByName("moe_debug");
  Layout l;
  l.world = 8;
  l.dp_replicate = 2;
  l.ep = 2;
  EXPECT_EQ(Names(l.MeshAxes()),
            (std::vector<std::string>{"replicate=2", "shard=4"}));
  EXPECT_EQ(Names(l.ExpertMeshAxes()),
            (std::vector<std::string>{"replicate=2", "efsdp=2", "ep=2"}));
  EXPECT_TRUE(l.Validate(moe).ok()) << l.Validate(moe);
  EXPECT_EQ(l.ToString(),
            "W=8 (2 x 4 HSDP) (EP 2), ZeRO-3, f32/f32, fused attention, batch "
            "1 x 0 x 1");
  const auto refused = [&](Layout bad, const models::TransformerConfig& m) {
    return std::string(bad.Validate(m).message());
  };
  EXPECT_EQ(refused(l, Gpt2Debug()),
            "parallelism.ep 2 needs a model with a mixture of experts "
            "(model.moe); gpt2_debug is dense");
  Layout odd = l;
  odd.ep = 3;
  EXPECT_EQ(refused(odd, moe),
            "parallelism.ep 3 does not divide dp_shard 4 "
            "(ep ranks are data-parallel ranks)");
  Layout many = l;
  many.world = 32;
  many.ep = 16;
  EXPECT_EQ(refused(many, moe),
            "parallelism.ep 16 does not divide moe_debug's 8 experts");
  Layout with_tp = l;
  with_tp.world = 16;
  with_tp.tp = 2;
  EXPECT_TRUE(with_tp.Validate(moe).ok()) << with_tp.Validate(moe);
  EXPECT_EQ(
      Names(with_tp.ExpertMeshAxes()),
      (std::vector<std::string>{"replicate=2", "efsdp=2", "ep=2", "tp=2"}));
  Layout with_pp = l;
  with_pp.world = 16;
  with_pp.pp = 2;
  with_pp.grad_accumulation = 2;
  EXPECT_TRUE(with_pp.Validate(moe).ok()) << with_pp.Validate(moe).message();
  EXPECT_EQ(
      Names(with_pp.ExpertMeshAxes()),
      (std::vector<std::string>{"pp=2", "replicate=2", "efsdp=2", "ep=2"}));
  Layout with_cp = l;
  with_cp.world = 16;
  with_cp.cp = 2;
  EXPECT_EQ(refused(with_cp, moe),
            "parallelism.ep 2 with cp > 1 is not supported yet (cp 2)");
  Layout zero = l;
  zero.ep = 0;
  EXPECT_EQ(refused(zero, moe), "parallelism.ep must be >= 1, got 0");
}

TEST(LayoutTest, SequenceLength) {
  const models::TransformerConfig m = Gpt2Debug();
  Layout l;
  EXPECT_EQ(l.seq(m), m.context_length);
  l.seq_len = 32;
  EXPECT_EQ(l.seq(m), 32);
}

TEST(LayoutTest, ToStringSaysEverything) {
  Layout l;
  l.world = 8;
  l.dp_replicate = 2;
  l.tp = 2;
  l.sequence_parallel = true;
  l.loss_parallel = true;
  l.hpz_degree = 2;
  l.param_dtype = DType::kBF16;
  l.activation_checkpointing = nn::CheckpointPolicy::Full();
  l.micro_batch = 2;
  l.seq_len = 256;
  l.grad_accumulation = 3;
  EXPECT_EQ(l.ToString(),
            "W=8 (2 x 2 HSDP) x TP 2 + SP + loss parallel, ZeRO-3 hpZ 2, "
            "bf16/f32, AC, fused attention, batch 2 x 256 x 3");
  // The loss head's setting when it is not the automatic one.
  l.loss_chunk_tokens = 0;
  EXPECT_NE(l.ToString().find("fused attention, unfused loss head, batch"),
            std::string::npos)
      << l.ToString();
  l.loss_chunk_tokens = 512;
  EXPECT_NE(l.ToString().find(", loss head in 512-token chunks, batch"),
            std::string::npos)
      << l.ToString();
  l.freeze = {"wte.weight"};
  EXPECT_NE(l.ToString().find("chunks, frozen parameters, batch"),
            std::string::npos)
      << l.ToString();
  l.lora.rank = 8;
  EXPECT_NE(l.ToString().find("chunks, LoRA r 8, batch"), std::string::npos)
      << l.ToString();
}

TEST(LayoutTest, ValidAndDefaultLayoutsPass) {
  Layout l;
  EXPECT_TRUE(l.Validate(Gpt2Debug()).ok());
  l.world = 8;
  l.pp = 2;
  l.tp = 2;
  l.grad_accumulation = 4;
  l.seq_len = 32;
  EXPECT_TRUE(l.Validate(Gpt2Debug()).ok()) << l.Validate(Gpt2Debug());
}

// A change to the default layout and the refusal it gets.
struct Refusal {
  std::function<void(Layout*)> change;
  std::string message;
};

std::vector<Refusal> Refusals() {
  return {
      {[](Layout* l) { l->world = 0; }, "must be positive"},
      {[](Layout* l) {
         l->world = 3;
         l->tp = 2;
       },
       "parallelism: dp_replicate 1 x tp 2 does not divide the world size 3"},
      {[](Layout* l) { l->sequence_parallel = true; },
       "parallelism.sequence_parallel needs parallelism.tp > 1"},
      {[](Layout* l) { l->loss_parallel = true; },
       "parallelism.loss_parallel needs parallelism.tp > 1"},
      {[](Layout* l) {
         l->world = 4;
         l->hpz_degree = 3;
       },
       "parallelism.hpz_degree 3 does not divide dp_shard 4"},
      {[](Layout* l) {
         l->world = 4;
         l->hpz_degree = 2;
         l->reshard_after_forward = false;
       },
       "parallelism.hpz_degree 2 needs parallelism.reshard_after_forward"},
      {[](Layout* l) { l->hpz_degree = 0; },
       "parallelism.hpz_degree must be >= 1"},
      {[](Layout* l) { l->loss_chunk_tokens = -2; },
       "training.loss_chunk_tokens must be -1 (auto), 0 (off) or > 0, got -2"},
      {[](Layout* l) {
         l->world = 3;
         l->tp = 3;
       },
       "parallelism.tp 3 does not divide model.n_heads (4)"},
      {[](Layout* l) {
         l->world = 2;
         l->tp = 2;
         l->sequence_parallel = true;
         l->seq_len = 31;
       },
       "parallelism.tp 2 does not divide training.seq_len with "
       "sequence_parallel (31)"},
      {[](Layout* l) { l->seq_len = 100000; },
       "training.seq_len 100000 is longer than the context length"},
      {[](Layout* l) { l->micro_batch = 0; }, "must be >= 1"},
      {[](Layout* l) { l->param_dtype = DType::kI32; },
       "is not a floating-point dtype"},
      {[](Layout* l) {
         l->world = 2;
         l->pp = 2;
         l->pp_schedule = "zb";
         l->grad_accumulation = 2;
       },
       "parallelism (pp 2, 2 micro-batches per step): pipeline schedule 'zb' "
       "is not one of gpipe, 1f1b, interleaved"},
      {[](Layout* l) {
         l->world = 4;
         l->pp = 4;
         l->grad_accumulation = 4;
       },
       "parallelism: splitting the 2 blocks of model gpt2_debug into pp 4 x "
       "pp_virtual_stages 1 stages: SplitStages"},
      {[](Layout* l) {
         l->world = 2;
         l->pp = 2;
         l->grad_accumulation = 2;
         l->param_dtype = DType::kF16;
       },
       "parallelism.pp > 1 with training.mixed_precision.param_dtype f16"},
      {[](Layout* l) {
         l->world = 4;
         l->cp = 3;
       },
       "parallelism: dp_replicate 1 x cp 3 x tp 1 does not divide the world "
       "size 4"},
      {[](Layout* l) { l->cp = 0; }, "cp 0"},
      {[](Layout* l) { l->cp_style = "zigzag"; },
       "parallelism.cp_style \"zigzag\" is not one of ring, alltoall"},
      {[](Layout* l) {
         l->world = 8;
         l->cp = 4;
         l->tp = 2;
         l->seq_len = 32;
         l->cp_style = "alltoall";
       },
       "parallelism.cp_style alltoall splits each rank's heads over cp 4: 2 "
       "query and 2 key/value head(s) per tensor-parallel rank must both be "
       "divisible by it (use cp_style ring)"},
      {[](Layout* l) {
         l->world = 2;
         l->cp = 2;
         l->seq_len = 30;
       },
       "parallelism.cp 2: training.seq_len 30 must be a multiple of 2 x cp "
       "= 4"},
      {[](Layout* l) {
         l->world = 2;
         l->cp = 2;
         l->fused_attention = false;
       },
       "parallelism.cp 2 needs training.fused_attention"},
      {[](Layout* l) {
         l->world = 8;
         l->cp = 2;
         l->tp = 4;
         l->sequence_parallel = true;
         l->seq_len = 12;
       },
       "parallelism.cp 2 with sequence_parallel: a cp rank's 6 tokens are "
       "not divisible by tp 4"},
      {[](Layout* l) {
         l->world = 2;
         l->pp = 2;
         l->reshard_after_backward = false;
       },
       "parallelism.reshard_after_backward=false (ZeRO-1) with "
       "parallelism.pp 2 > 1 is not supported"},
      {[](Layout* l) {
         l->world = 2;
         l->hpz_degree = 2;
         l->reshard_after_backward = false;
       },
       "parallelism.hpz_degree 2 with reshard_after_backward=false (ZeRO-1)"},
      {[](Layout* l) { l->pp_cuts = {1}; },
       "parallelism.pp_virtual_stages and pp_cuts need parallelism.pp > 1"},
      {[](Layout* l) {
         l->freeze = {"h.*.attn.*", "tok_embeddings.*"};
       },
       "model.freeze pattern \"tok_embeddings.*\" matches no parameter of "
       "gpt2_debug (names look like"},
      {[](Layout* l) {
         l->freeze = {"h.*", "*"};
       },
       "model.freeze (h.*, *) freezes every parameter: nothing would train"},
      {[](Layout* l) {
         l->lora.rank = 4;
         l->lora.targets = {"c_attn", "wq"};
       },
       "model.lora.targets \"wq\" matches no linear layer of the model"},
      {[](Layout* l) { l->lora.targets = {"c_attn"}; },
       "model.lora: rank 0 with 1 target(s); LoRA needs rank >= 1"},
  };
}

// Frozen parameters: the patterns' matches, and the counts the trainer's
// header prints (the model's own total; trainable = total - frozen).
TEST(LayoutTest, FreezePatternsAndParameterCounts) {
  Layout l;
  absl::StatusOr<Layout::ParameterCounts> all = l.CountParameters(Gpt2Debug());
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->total, models::NumParameters(Gpt2Debug()));
  EXPECT_EQ(all->trainable, all->total);
  EXPECT_TRUE(all->frozen_names.empty());
  l.freeze = {"wte.weight", "h.*.ln_?.*"};
  EXPECT_TRUE(l.Validate(Gpt2Debug()).ok());
  EXPECT_TRUE(l.Frozen("wte.weight"));
  EXPECT_TRUE(l.Frozen("h.3.ln_2.bias"));
  EXPECT_FALSE(l.Frozen("h.3.attn.c_attn.bias"));
  absl::StatusOr<Layout::ParameterCounts> some = l.CountParameters(Gpt2Debug());
  ASSERT_TRUE(some.ok()) << some.status();
  const models::TransformerConfig c = Gpt2Debug();
  // The (padded) embedding table and two LayerNorms (weight, bias) a block.
  const int64_t frozen =
      c.padded_vocab_size() * c.dim + c.n_layers * 2 * 2 * c.dim;
  EXPECT_EQ(some->total, all->total);
  EXPECT_EQ(some->trainable, all->total - frozen);
  EXPECT_EQ(some->frozen_names.size(), 1u + 4u * c.n_layers);
  EXPECT_EQ(some->frozen_names.front(), "wte.weight");
}

// LoRA: the adapters count as parameters and are all that trains.
TEST(LayoutTest, LoraAdaptersAreTheTrainableParameters) {
  Layout l;
  l.lora.rank = 4;
  l.lora.targets = {"c_attn", "h.1.mlp.fc"};
  const absl::Status valid = l.Validate(Gpt2Debug());
  ASSERT_TRUE(valid.ok()) << valid;
  EXPECT_TRUE(l.Frozen("h.0.attn.c_attn.weight"));
  EXPECT_FALSE(l.Frozen("h.0.attn.c_attn.lora_A.weight"));
  absl::StatusOr<Layout::ParameterCounts> counts =
      l.CountParameters(Gpt2Debug());
  ASSERT_TRUE(counts.ok()) << counts.status();
  const models::TransformerConfig c = Gpt2Debug();
  const int64_t c_attn = 4 * c.dim + 3 * c.dim * 4;  // A [4, C], B [3C, 4]
  const int64_t c_fc = 4 * c.dim + c.ffn_hidden * 4;
  EXPECT_EQ(counts->trainable, c.n_layers * c_attn + c_fc);
  EXPECT_EQ(counts->total, models::NumParameters(c) + counts->trainable);
  // FLOPs: every base matmul weight (the blocks' four, the tied head) is
  // frozen (no weight gradient: -2 each), the adapters train (+6 each).
  const int64_t base_matmul =
      c.n_layers * (4 * c.dim * c.dim + 2 * c.dim * c.ffn_hidden) +
      c.padded_vocab_size() * c.dim;
  EXPECT_EQ(counts->frozen_matmul, base_matmul);
  EXPECT_EQ(counts->adapter_matmul, counts->trainable);
  l.seq_len = 64;
  absl::StatusOr<double> flops = l.FlopsPerToken(c);
  ASSERT_TRUE(flops.ok()) << flops.status();
  EXPECT_DOUBLE_EQ(*flops, models::FlopsPerToken(c, 64) - 2.0 * base_matmul +
                               6.0 * counts->trainable);
  Layout plain;
  plain.seq_len = 64;
  EXPECT_DOUBLE_EQ(*plain.FlopsPerToken(c), models::FlopsPerToken(c, 64));
}

TEST(LayoutTest, ValidateNamesTheField) {
  for (const Refusal& c : Refusals()) {
    Layout l;
    c.change(&l);
    const absl::Status s = l.Validate(Gpt2Debug());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_TRUE(absl::StrContains(s.message(), c.message))
        << s << "\nwanted: " << c.message;
  }
}

}  // namespace
}  // namespace recipe
}  // namespace fsdpp
