// Tests of TrainConfig loading, --set overrides and validation: every shipped
// config loads and validates at its intended world size, and every error
// message is checked word for word.
#include "trainer/config.h"

#include <dirent.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"
#include "trainer/default_config.h"

namespace fsdpp {
namespace trainer {
namespace {

template <typename T>
std::string Message(const absl::StatusOr<T>& value) {
  return std::string(value.status().message());
}

constexpr char kModels[] =
    "gpt2_debug, gpt2_124m, gpt2_350m, gpt2_774m, gpt2_1558m, llama_debug, "
    "llama_1b, smollm3_3b, llama3_8b, llama3_70b, moe_debug, olmoe_debug, "
    "olmoe_1b_7b";

// --- Shipped configs -------------------------------------------------------

struct Shipped {
  std::string name;
  int world_size;
  int dp_replicate;
  int dp_shard;
  int hpz_degree;
  int64_t seq_len;
  int64_t grad_accumulation_steps;
  std::string model = "";  // model.name when it is not `name`
};

const std::vector<Shipped>& ShippedConfigs() {
  static const auto* configs = new std::vector<Shipped>{
      {"default", 2, 1, 2, 1, 128, 1, "gpt2_debug"},
      {"finetune_default", 2, 1, 2, 1, 128, 1, "gpt2_debug"},
      {"lora_default", 2, 1, 2, 1, 128, 1, "gpt2_debug"},
      {"gpt2_debug", 2, 1, 2, 1, 128, 2},
      {"gpt2_124m", 8, 1, 8, 1, 1024, 4},
      {"gpt2_124m_gpu", 1, 1, 1, 1, 1024, 1, "gpt2_124m"},
      {"llama_debug", 4, 2, 2, 1, 128, 2},
      {"moe_debug", 2, 1, 2, 1, 128, 2},
      {"llama_1b", 8, 1, 8, 1, 2048, 8},
      {"smollm3_3b", 16, 2, 8, 1, 4096, 4},
      {"llama3_8b", 64, 1, 64, 8, 8192, 2},
  };
  return *configs;
}

TEST(ShippedConfigsTest, EachLoadsAndValidatesAtItsWorldSize) {
  for (const Shipped& shipped : ShippedConfigs()) {
    SCOPED_TRACE(shipped.name);
    auto config = LoadTrainConfig(
        absl::StrCat("trainer/configs/", shipped.name, ".textproto"));
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->model().name(),
              shipped.model.empty() ? shipped.name : shipped.model);
    auto resolved = ResolveTrainConfig(*config, shipped.world_size);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->layout.dp_replicate, shipped.dp_replicate);
    EXPECT_EQ(resolved->layout.dp_shard(), shipped.dp_shard);
    EXPECT_EQ(resolved->layout.hpz_degree, shipped.hpz_degree);
    EXPECT_EQ(resolved->layout.seq_len, shipped.seq_len);
    EXPECT_EQ(resolved->layout.grad_accumulation,
              shipped.grad_accumulation_steps);
    EXPECT_EQ(resolved->tokens_per_step,
              config->training().global_batch() * shipped.seq_len);
    // Each file states the world size it is meant for.
    auto text = ReadFileToString(
        absl::StrCat("trainer/configs/", shipped.name, ".textproto"));
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(absl::StrContains(
        *text, absl::StrCat("Intended world size: ", shipped.world_size)));
  }
}

TEST(ShippedConfigsTest, EveryFileInConfigsIsCovered) {
  std::set<std::string> files;
  DIR* directory = opendir("trainer/configs");
  ASSERT_NE(directory, nullptr);
  while (dirent* entry = readdir(directory)) {
    const std::string name = entry->d_name;
    if (absl::EndsWith(name, ".textproto")) files.insert(name);
  }
  closedir(directory);
  std::set<std::string> tested;
  for (const Shipped& shipped : ShippedConfigs()) {
    tested.insert(absl::StrCat(shipped.name, ".textproto"));
  }
  EXPECT_EQ(files, tested);
}

TEST(ShippedConfigsTest, Gpt2SmallPadsItsVocabulary) {
  auto config = LoadTrainConfig("trainer/configs/gpt2_124m.textproto");
  ASSERT_TRUE(config.ok());
  auto resolved = ResolveTrainConfig(*config, 8);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->model.padded_vocab_size(), 50304);
  EXPECT_EQ(resolved->layout.param_dtype, DType::kBF16);
  EXPECT_EQ(resolved->layout.reduce_dtype, DType::kF32);
  EXPECT_EQ(resolved->tokenizer_vocab_size, 50257);
}

// --- Text format -------------------------------------------------------------

TEST(ParseTrainConfigTest, ParsesTextFormat) {
  auto config = ParseTrainConfig(
      "# comment\n"
      "model { name: \"llama_debug\" context_length: 64 }\n"
      "training { steps: 5 lr: 0.01 mixed_precision { param_dtype: \"bf16\" "
      "} }\n",
      "inline");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model().context_length(), 64);
  EXPECT_EQ(config->training().steps(), 5);
  EXPECT_DOUBLE_EQ(config->training().lr(), 0.01);
  EXPECT_EQ(config->training().mixed_precision().param_dtype(), "bf16");
  EXPECT_EQ(config->training().global_batch(), 8);  // Default.
  EXPECT_EQ(config->parallelism().dp_shard(), -1);
}

TEST(ParseTrainConfigTest, UnknownFieldsWithLineAndColumn) {
  auto unknown_field = ParseTrainConfig(
      "model { name: \"gpt2_debug\" }\n"
      "training {\n"
      "  stepz: 100\n"
      "}\n",
      "run.textproto");
  EXPECT_EQ(unknown_field.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(unknown_field),
            "run.textproto:3:3: unknown field \"stepz\" in training (fields: "
            "steps, global_batch, micro_batch, seq_len, lr, warmup_steps, "
            "schedule, min_lr_ratio, weight_decay, grad_clip, "
            "mixed_precision, seed, activation_checkpointing, adam_beta1, "
            "adam_beta2, adam_eps, initial_loss_scale, "
            "loss_scale_growth_interval, cpu_caching_allocator, "
            "fused_attention, max_memory_gib, skip_memory_check, device, "
            "loss_chunk_tokens)");
  auto nested = ParseTrainConfig(
      "training { mixed_precision { param: \"bf16\" } }", "run.textproto");
  EXPECT_EQ(Message(nested),
            "run.textproto:1:30: unknown field \"param\" in "
            "training.mixed_precision (fields: param_dtype, reduce_dtype)");
  auto unknown_section =
      ParseTrainConfig("\n  optimizer { lr: 1 }", "run.textproto");
  EXPECT_EQ(Message(unknown_section),
            "run.textproto:2:3: unknown section \"optimizer\" (sections: "
            "model, parallelism, training, data, checkpoint, metrics, "
            "validation, comm)");
}

TEST(ParseTrainConfigTest, SyntaxAndTypeErrors) {
  EXPECT_EQ(Message(ParseTrainConfig("training { steps: \"ten\" }", "a")),
            "a:1:19: Expected integer, got: \"ten\"");
  EXPECT_EQ(Message(ParseTrainConfig("training {\n  steps: 10", "a")),
            "a:2:12: Expected identifier, got: end of input");
  EXPECT_EQ(
      Message(ParseTrainConfig("training { steps: 1 steps: 2 }", "a")),
      "a:1:21: Non-repeated field \"steps\" is specified multiple times.");
  // A tab counts as one column.
  EXPECT_EQ(Message(ParseTrainConfig("data {\n\t\tpath: \"x\" }", "a")),
            "a:2:3: unknown field \"path\" in data (fields: dataset, "
            "tokenizer, tokenizer_dir, validation_fraction, shuffle, "
            "document_masking)");
}

TEST(LoadTrainConfigTest, MissingFile) {
  auto config = LoadTrainConfig("trainer/configs/nope.textproto");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(config.status().message(),
            "cannot read config file \"trainer/configs/nope.textproto\": No "
            "such file or directory");
}

// --- Overrides ---------------------------------------------------------------

TEST(ApplyOverrideTest, SetsEveryScalarType) {
  TrainConfig config;
  ASSERT_TRUE(ApplyOverrides({"training.steps=100",                  // int64
                              "parallelism.dp_shard=-1",             // int32
                              "training.seed=18446744073709551615",  // uint64
                              "training.lr=2.5e-4",                  // double
                              "training.activation_checkpointing=true",
                              "checkpoint.async=0",         // bool
                              "model.name=llama_1b",        // string
                              "data.dataset=/tmp/a=b.bin",  // '=' in value
                              "training.mixed_precision.param_dtype=bf16"},
                             &config)
                  .ok());
  EXPECT_EQ(config.training().steps(), 100);
  EXPECT_EQ(config.parallelism().dp_shard(), -1);
  EXPECT_EQ(config.training().seed(), 18446744073709551615ull);
  EXPECT_DOUBLE_EQ(config.training().lr(), 2.5e-4);
  EXPECT_EQ(config.training().activation_checkpointing(), "true");
  EXPECT_TRUE(config.checkpoint().has_async());
  EXPECT_FALSE(config.checkpoint().async());
  EXPECT_EQ(config.model().name(), "llama_1b");
  EXPECT_EQ(config.data().dataset(), "/tmp/a=b.bin");
  EXPECT_EQ(config.training().mixed_precision().param_dtype(), "bf16");
}

TEST(ApplyOverrideTest, Errors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"training.steps",
       "--set \"training.steps\": expected SECTION.FIELD=VALUE"},
      {"optim.lr=1",
       "--set optim.lr=1: unknown section \"optim\" (sections: model, "
       "parallelism, training, data, checkpoint, metrics, validation, comm)"},
      {"=1",
       "--set =1: unknown section \"\" (sections: model, parallelism, "
       "training, data, checkpoint, metrics, validation, comm)"},
      {"data.path=x",
       "--set data.path=x: unknown field \"path\" in data (fields: dataset, "
       "tokenizer, tokenizer_dir, validation_fraction, shuffle, "
       "document_masking)"},
      {"training.mixed_precision.param=bf16",
       "--set training.mixed_precision.param=bf16: unknown field \"param\" in "
       "training.mixed_precision (fields: param_dtype, reduce_dtype)"},
      {"validation=3",
       "--set validation=3: validation is a section; set one of its fields: "
       "interval, batches"},
      {"training.steps.max=3",
       "--set training.steps.max=3: training.steps is a field, not a section"},
      {"training.steps=ten",
       "--set training.steps=ten: \"ten\" is not an int64"},
      {"training.steps=1.5",
       "--set training.steps=1.5: \"1.5\" is not an int64"},
      {"parallelism.dp_shard=99999999999",
       "--set parallelism.dp_shard=99999999999: \"99999999999\" is not an "
       "int32"},
      {"training.seed=-1", "--set training.seed=-1: \"-1\" is not a uint64"},
      {"training.lr=fast",
       "--set training.lr=fast: \"fast\" is not a finite number"},
      {"training.lr=nan",
       "--set training.lr=nan: \"nan\" is not a finite number"},
      {"data.shuffle=yes",
       "--set data.shuffle=yes: \"yes\" is not a bool (true or false)"},
  };
  for (const auto& [assignment, message] : cases) {
    TrainConfig config;
    const absl::Status status = ApplyOverride(assignment, &config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << assignment;
    EXPECT_EQ(status.message(), message);
  }
}

// --- Validation --------------------------------------------------------------

// A valid base: gpt2_debug (vocab 512, context 128), sequences of 64, world 2
// by default, then `overrides`.
absl::Status ValidateWith(const std::vector<std::string>& overrides,
                          int world_size = 2) {
  TrainConfig config;
  config.mutable_model()->set_name("gpt2_debug");
  config.mutable_training()->set_seq_len(64);
  const absl::Status applied = ApplyOverrides(overrides, &config);
  if (!applied.ok()) return applied;
  return Validate(config, world_size);
}

TEST(ValidateTest, DerivedSizesFollowAnOverriddenBase) {
  // gpt2_debug is MHA with a 4 x dim MLP: both follow n_heads and dim.
  TrainConfig config;
  ASSERT_TRUE(ApplyOverrides(
                  {"model.name=gpt2_debug", "model.dim=192", "model.n_heads=6"},
                  &config)
                  .ok());
  auto resolved = ResolveTrainConfig(config, 2);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model.n_kv_heads, 6);
  EXPECT_EQ(resolved->model.ffn_hidden, 768);
  // Explicit values win; llama_debug is GQA (4 heads, 2 kv heads) with a
  // SwiGLU width that is not 4 x dim: nothing is derived.
  ASSERT_TRUE(ApplyOverrides({"model.ffn_hidden=100"}, &config).ok());
  EXPECT_EQ(ResolveTrainConfig(config, 2)->model.ffn_hidden, 100);
  TrainConfig llama;
  ASSERT_TRUE(ApplyOverrides({"model.name=llama_debug", "model.dim=128",
                              "model.n_heads=8"},
                             &llama)
                  .ok());
  resolved = ResolveTrainConfig(llama, 2);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model.n_kv_heads, 2);
  EXPECT_EQ(resolved->model.ffn_hidden, 192);
}

// parallelism.cp: the cp ranks read the same rows, so the data-parallel
// degree (and the micro batch it sets) leaves cp out; FSDP's shard axis
// holds dp_shard x cp ranks.
TEST(ValidateTest, ContextParallelResolution) {
  TrainConfig config;
  ASSERT_TRUE(ApplyOverrides({"model.name=llama_debug", "parallelism.cp=2",
                              "training.seq_len=64", "training.global_batch=8",
                              "training.micro_batch=2"},
                             &config)
                  .ok());
  auto resolved = ResolveTrainConfig(config, 4);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->layout.cp, 2);
  EXPECT_EQ(resolved->layout.dp_shard(), 2);
  EXPECT_EQ(resolved->layout.fsdp_shard(), 4);
  EXPECT_EQ(resolved->layout.data_parallel(), 2);
  EXPECT_EQ(resolved->layout.micro_batch, 2);
  EXPECT_EQ(resolved->layout.grad_accumulation, 2);
  EXPECT_EQ(resolved->tokens_per_step, 8 * 64);
}

TEST(ValidateTest, TheBaseIsValid) {
  EXPECT_TRUE(ValidateWith({}).ok()) << ValidateWith({});
}

TEST(ValidateTest, ResolvesDerivedValues) {
  TrainConfig config;
  ASSERT_TRUE(
      ApplyOverrides(
          {"model.name=llama_debug", "model.context_length=96",
           "model.n_layers=3", "model.dim=128", "model.n_heads=8",
           "model.n_kv_heads=4", "model.ffn_hidden=320", "model.vocab_size=300",
           "parallelism.dp_replicate=2", "parallelism.hpz_degree=0",
           "training.global_batch=24", "training.micro_batch=3"},
          &config)
          .ok());
  auto resolved = ResolveTrainConfig(config, 4);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model.context_length, 96);
  EXPECT_EQ(resolved->model.n_layers, 3);
  EXPECT_EQ(resolved->model.vocab_size, 300);
  EXPECT_EQ(resolved->model.dim, 128);
  EXPECT_EQ(resolved->model.n_heads, 8);
  EXPECT_EQ(resolved->model.kv_heads(), 4);
  EXPECT_EQ(resolved->model.ffn_hidden, 320);
  EXPECT_EQ(resolved->layout.dp_replicate, 2);
  EXPECT_EQ(resolved->layout.dp_shard(), 2);
  EXPECT_EQ(resolved->layout.hpz_degree, 1);
  EXPECT_EQ(resolved->layout.seq_len, 96);  // 0 = the context length.
  EXPECT_EQ(resolved->layout.micro_batch, 3);
  EXPECT_EQ(resolved->layout.grad_accumulation, 2);
  EXPECT_EQ(resolved->tokens_per_step, 24 * 96);
  EXPECT_EQ(resolved->layout.param_dtype, DType::kF32);
  EXPECT_EQ(resolved->tokenizer_vocab_size, 257);
}

struct ValidateCase {
  std::vector<std::string> overrides;
  int world_size;
  std::string message;
};

// Expects ValidateWith(overrides, world_size) to fail with exactly each
// case's message: NotFound for a missing file, InvalidArgument otherwise.
void ExpectValidateErrors(const std::vector<ValidateCase>& cases) {
  for (const ValidateCase& c : cases) {
    const absl::Status status = ValidateWith(c.overrides, c.world_size);
    EXPECT_FALSE(status.ok()) << c.message;
    EXPECT_EQ(std::string(status.message()), c.message);
    const absl::StatusCode expected_code =
        absl::StrContains(c.message, "does not exist")
            ? absl::StatusCode::kNotFound
            : absl::StatusCode::kInvalidArgument;
    EXPECT_EQ(status.code(), expected_code) << c.message;
  }
}

TEST(ValidateTest, ModelErrorMessages) {
  ExpectValidateErrors({
      {{"model.name="},
       2,
       absl::StrCat("model.name is required (one of: ", kModels, ")")},
      {{"model.name=gpt3"},
       2,
       absl::StrCat(
           "model.name \"gpt3\" is not a known model (one of: ", kModels, ")")},
      {{"model.vocab_size=0"}, 2, "model.vocab_size must be positive, got 0"},
      {{"model.vocab_pad_multiple=-64"},
       2,
       "model.vocab_pad_multiple must be positive, got -64"},
      {{"model.context_length=0"},
       2,
       "model.context_length must be positive, got 0"},
      {{"model.n_layers=-1"}, 2, "model.n_layers must be positive, got -1"},
      {{"model.dim=0"}, 2, "model.dim must be positive, got 0"},
      {{"model.n_heads=0"}, 2, "model.n_heads must be positive, got 0"},
      {{"model.n_kv_heads=-2"}, 2, "model.n_kv_heads must be positive, got -2"},
      {{"model.ffn_hidden=0"}, 2, "model.ffn_hidden must be positive, got 0"},
      {{"model.n_heads=5"},
       2,
       "model: TransformerConfig 'gpt2_debug' (gpt2): n_heads 5 must divide "
       "dim 64"},
      {{"model.moe.top_k=2"},
       2,
       "model.moe overrides a mixture of experts, but gpt2_debug is dense"},
      {{"model.name=moe_debug", "model.moe.scoring=sparsemax"},
       2,
       "model.moe.scoring must be \"softmax\" or \"sigmoid\", got "
       "\"sparsemax\""},
      {{"model.name=moe_debug", "model.moe.top_k=0"},
       2,
       "model.moe.top_k must be positive, got 0"},
      {{"model.name=moe_debug", "model.moe.bias_update_rate=0.001"},
       2,
       "model: TransformerConfig 'moe_debug' (llama): moe.bias_update_rate "
       "must be >= 0, and > 0 only with moe.expert_bias, got 0.001 without an "
       "expert bias"},
  });
}

TEST(ValidateTest, ParallelismErrorMessages) {
  ExpectValidateErrors({
      {{}, 0, "world size must be positive, got 0"},
      {{"parallelism.dp_replicate=0"},
       2,
       "parallelism.dp_replicate must be positive, got 0"},
      {{"parallelism.dp_shard=0"},
       2,
       "parallelism.dp_shard must be positive or -1 (inferred), got 0"},
      {{"parallelism.dp_shard=-2"},
       2,
       "parallelism.dp_shard must be positive or -1 (inferred), got -2"},
      {{"parallelism.dp_replicate=4"},
       6,
       "parallelism: cannot infer dp_shard: the world size 6 is not divisible "
       "by dp_replicate 4 x tp 1"},
      {{"parallelism.dp_replicate=2", "parallelism.dp_shard=3"},
       4,
       "parallelism: dp_replicate 2 x dp_shard 3 x tp 1 = 6 ranks, but the "
       "world size is 4"},
      {{"parallelism.cp=0"}, 2, "parallelism.cp must be positive, got 0"},
      {{"parallelism.cp=3"},
       4,
       "parallelism: cannot infer dp_shard: the world size 4 is not divisible "
       "by dp_replicate 1 x cp 3 x tp 1"},
      {{"parallelism.cp=2", "parallelism.dp_shard=3"},
       4,
       "parallelism: dp_replicate 1 x dp_shard 3 x cp 2 x tp 1 = 6 ranks, "
       "but the world size is 4"},
      {{"parallelism.cp=2", "training.seq_len=30"},
       2,
       "parallelism.cp 2: training.seq_len 30 must be a multiple of 2 x cp = "
       "4 (each rank holds two equal chunks of every sequence)"},
      {{"parallelism.tp=0"}, 2, "parallelism.tp must be positive, got 0"},
      {{"parallelism.tp=4"},
       2,
       "parallelism: cannot infer dp_shard: the world size 2 is not divisible "
       "by dp_replicate 1 x tp 4"},
      {{"parallelism.sequence_parallel=true"},
       2,
       "parallelism.sequence_parallel needs parallelism.tp > 1 (it shards "
       "the tensor-parallel activations)"},
      {{"parallelism.tp=3"},
       3,
       "parallelism.tp 3 does not divide model.n_heads (4)"},
      {{"parallelism.tp=2", "model.ffn_hidden=255"},
       2,
       "parallelism.tp 2 does not divide model.ffn_hidden (255)"},
      {{"parallelism.tp=2", "model.vocab_size=511"},
       2,
       "parallelism.tp 2 does not divide the padded vocabulary "
       "(model.vocab_pad_multiple pads it) (511)"},
      {{"parallelism.tp=2", "parallelism.sequence_parallel=true",
        "training.seq_len=31"},
       2,
       "parallelism.tp 2 does not divide training.seq_len with "
       "sequence_parallel (31)"},
      {{"parallelism.hpz_degree=-1"},
       2,
       "parallelism.hpz_degree must be >= 0 (0 or 1 = off), got -1"},
      {{"parallelism.hpz_degree=2", "parallelism.reshard_after_forward=false"},
       2,
       "parallelism.hpz_degree 2 needs parallelism.reshard_after_forward: "
       "true"},
      {{"parallelism.hpz_degree=3", "training.global_batch=24"},
       8,
       "parallelism.hpz_degree 3 does not divide dp_shard 8"},
  });
}

TEST(ValidateTest, PipelineErrorMessages) {
  ExpectValidateErrors({
      {{"parallelism.pp=0"}, 2, "parallelism.pp must be positive, got 0"},
      {{"parallelism.pp=4"},
       2,
       "parallelism: cannot infer dp_shard: the world size 2 is not divisible "
       "by pp 4 x dp_replicate 1 x tp 1"},
      {{"parallelism.pp_schedule=gpipe"},
       2,
       "parallelism.pp_schedule, pp_microbatches, pp_virtual_stages and "
       "pp_cuts need parallelism.pp > 1"},
      {{"parallelism.pp=2", "parallelism.pp_schedule=zb"},
       2,
       "parallelism (pp 2, 8 micro-batches per step): pipeline schedule 'zb' "
       "is not one of gpipe, 1f1b, interleaved"},
      {{"parallelism.pp=2", "parallelism.pp_microbatches=1"},
       2,
       "parallelism (pp 2, 1 micro-batches per step): 1F1B: 1 micro-batches "
       "for 2 pipeline ranks; it needs at least one per rank"},
      {{"parallelism.pp=2", "parallelism.pp_microbatches=3"},
       2,
       "parallelism.pp_microbatches 3: training.global_batch 8 is not "
       "divisible by the data-parallel degree 1 x 3 micro-batches"},
      {{"parallelism.pp=2", "parallelism.pp_cuts=0"},
       2,
       "parallelism: splitting the 2 blocks of model gpt2_debug into pp 2 x "
       "pp_virtual_stages 1 stages at pp_cuts \"0\": SplitStages: cut point 0 "
       "(block 0) must be after 0 and before 2 so that every stage keeps at "
       "least one block"},
      {{"parallelism.pp=2", "parallelism.pp_cuts=a"},
       2,
       "parallelism.pp_cuts \"a\": \"a\" is not a block index"},
      {{"parallelism.pp=4", "training.global_batch=8"},
       4,
       "parallelism: splitting the 2 blocks of model gpt2_debug into pp 4 x "
       "pp_virtual_stages 1 stages: SplitStages: 2 blocks cannot fill 4 "
       "stages (each needs at least one block)"},
      {{"parallelism.pp=2", "parallelism.pp_schedule=interleaved",
        "parallelism.pp_virtual_stages=2", "model.n_layers=4",
        "parallelism.pp_microbatches=3", "training.global_batch=6"},
       2,
       "parallelism (pp 2, 3 micro-batches per step): Interleaved1F1B: 3 "
       "micro-batches must be a multiple of the 2 pipeline ranks (they go "
       "through each rank's stages in groups)"},
      {{"parallelism.pp=2", "training.mixed_precision.param_dtype=f16"},
       2,
       "parallelism.pp > 1 with training.mixed_precision.param_dtype f16: the "
       "loss scaler's overflow check does not span pipeline stages yet; use "
       "bf16"},
  });
}

// A micro batch larger than a data-parallel rank's rows is those rows (the
// shipped default config, micro batch 8 of 16, at 4 ranks), said in a note;
// one that fits is left alone.
TEST(ValidateTest, MicroBatchIsAtMostTheRowsPerRank) {
  TrainConfig config;
  ASSERT_TRUE(
      ApplyOverrides({"model.name=gpt2_debug", "training.global_batch=16",
                      "training.micro_batch=8"},
                     &config)
          .ok());
  auto resolved = ResolveTrainConfig(config, 4);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->layout.micro_batch, 4);
  EXPECT_EQ(resolved->layout.grad_accumulation, 1);
  EXPECT_EQ(resolved->notes,
            std::vector<std::string>{
                "micro batch 4: training.micro_batch 8 is more than the 4 rows "
                "of training.global_batch 16 per data-parallel rank (4)"});
  resolved = ResolveTrainConfig(config, 2);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->layout.micro_batch, 8);
  EXPECT_TRUE(resolved->notes.empty());
}

// pp_microbatches 0 takes the accumulation steps, raised to fill the
// pipeline when they are too few (the shipped default config at pp 2:
// micro batch 8 of 8 rows per data-parallel rank); a count that already
// fills it, an explicit count, and pp 1 are left alone.
TEST(ValidateTest, PipelineMicroBatchesFillThePipeline) {
  struct Case {
    std::vector<std::string> overrides;
    int world;
    int64_t micro_batch, microbatches;
    bool raised;
  };
  for (const Case& c : std::vector<Case>{
           {{"parallelism.pp=2", "training.global_batch=16",
             "training.micro_batch=8"},
            4,
            4,
            2,
            true},
           {{"parallelism.pp=4", "model.n_layers=4", "training.global_batch=6",
             "training.micro_batch=6"},
            4,
            1,
            6,
            true},  // 4 and 5 do not divide the 6 rows
           {{"parallelism.pp=2", "parallelism.pp_schedule=interleaved",
             "parallelism.pp_virtual_stages=2", "model.n_layers=4",
             "training.global_batch=8", "training.micro_batch=8"},
            2,
            4,
            2,
            true},
           {{"parallelism.pp=2", "parallelism.pp_schedule=interleaved",
             "parallelism.pp_virtual_stages=2", "model.n_layers=4",
             "training.global_batch=12", "training.micro_batch=4"},
            2,
            3,
            4,
            true},  // 3 accumulation steps: not a multiple of 2
           {{"parallelism.pp=2", "training.global_batch=16",
             "training.micro_batch=4"},
            4,
            4,
            2,
            false},
           {{"parallelism.pp=2", "parallelism.pp_microbatches=4",
             "training.global_batch=16", "training.micro_batch=8"},
            4,
            2,
            4,
            false},
           {{"training.global_batch=16", "training.micro_batch=8"},
            2,
            8,
            1,
            false},
       }) {
    SCOPED_TRACE(absl::StrJoin(c.overrides, " "));
    TrainConfig config;
    config.mutable_model()->set_name("gpt2_debug");
    config.mutable_training()->set_seq_len(64);
    config.mutable_data()->set_document_masking(false);  // no note of its own
    ASSERT_TRUE(ApplyOverrides(c.overrides, &config).ok());
    auto resolved = ResolveTrainConfig(config, c.world);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->layout.micro_batch, c.micro_batch);
    EXPECT_EQ(resolved->layout.grad_accumulation, c.microbatches);
    EXPECT_EQ(resolved->notes.size(), c.raised ? 1u : 0u)
        << absl::StrJoin(resolved->notes, "; ");
  }
}

// The note says what was raised and how to choose; a pipeline that one row
// per data-parallel rank cannot fill is refused.
TEST(ValidateTest, PipelineMicroBatchesNoteAndRefusal) {
  TrainConfig config;
  ASSERT_TRUE(
      ApplyOverrides({"model.name=gpt2_debug", "training.global_batch=16",
                      "training.micro_batch=8", "parallelism.pp=2"},
                     &config)
          .ok());
  auto resolved = ResolveTrainConfig(config, 4);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->notes, (std::vector<std::string>{
                                 "pipeline micro-batches: 2 (micro batch 4), "
                                 "raised from the 1 accumulation step(s) of "
                                 "micro batch 8 to fill 2 pipeline ranks; set "
                                 "parallelism.pp_microbatches to choose"}));
  // One row per data-parallel rank cannot fill 2 pipeline ranks: refused.
  EXPECT_EQ(ValidateWith({"parallelism.pp=2", "training.global_batch=2",
                          "training.micro_batch=1"},
                         4)
                .message(),
            "parallelism (pp 2, 1 micro-batches per step): 1F1B: 1 "
            "micro-batches for 2 pipeline ranks; it needs at least one per "
            "rank");
}

// data.document_masking: on by default at the tokenizer's end-of-text id;
// where unsupported off with a note by default, an error when asked for.
TEST(ValidateTest, DocumentMaskingResolution) {
  struct Case {
    std::vector<std::string> overrides;
    int64_t eot;       // the layout's document_eot_id
    std::string note;  // the one note, or ""
    std::string error;
  };
  for (const Case& c : std::vector<Case>{
           {{}, 256, "", ""},
           {{"data.tokenizer=gpt2", "model.name=gpt2_124m"}, 50256, "", ""},
           {{"data.document_masking=false"}, -1, "", ""},
           {{"training.device=cuda"},
            -1,
            "data.document_masking off: on CUDA the masked attention runs on "
            "the reference kernel, not cuDNN (set it true to use it)",
            ""},
           {{"training.device=cuda", "data.document_masking=true"},
            256,
            "",
            ""},
           {{"training.fused_attention=false", "data.document_masking=true"},
            -1,
            "",
            "data.document_masking: it needs training.fused_attention (set it "
            "false)"},
           {{"training.fused_attention=false"},
            -1,
            "data.document_masking off: it needs training.fused_attention",
            ""},
       }) {
    SCOPED_TRACE(absl::StrJoin(c.overrides, " "));
    TrainConfig config;
    config.mutable_model()->set_name("gpt2_debug");
    ASSERT_TRUE(ApplyOverrides(c.overrides, &config).ok());
    auto resolved = ResolveTrainConfig(config, 2);
    if (!c.error.empty()) {
      EXPECT_EQ(resolved.status().message(), c.error);
      continue;
    }
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    EXPECT_EQ(resolved->layout.document_eot_id, c.eot);
    EXPECT_EQ(resolved->notes, c.note.empty()
                                   ? std::vector<std::string>()
                                   : std::vector<std::string>{c.note});
    EXPECT_EQ(absl::StrContains(resolved->layout.ToString(), "document masks"),
              c.eot >= 0);
  }
}

// Every trainer command line the README shows validates at its world size
// (--nproc_per_node, default 2, x the largest --nnodes): the embedded
// default config or --config, then each --set.
TEST(ReadmeCommandsTest, EveryTrainerCommandValidates) {
  absl::StatusOr<std::string> readme = ReadFileToString("README.md");
  ASSERT_TRUE(readme.ok()) << readme.status();
  int commands = 0;
  for (absl::string_view line : absl::StrSplit(*readme, '\n')) {
    const size_t at = line.find("bazel run //trainer:train");
    if (at == absl::string_view::npos) continue;
    line.remove_prefix(at);
    const size_t comment = line.find(" #");
    if (comment != absl::string_view::npos) line = line.substr(0, comment);
    SCOPED_TRACE(std::string(line));
    ++commands;
    std::string config_path;
    int nproc = 2, nnodes = 1;
    std::vector<std::string> sets;
    const std::vector<std::string> words =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    for (size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (absl::StartsWith(w, "--config=")) {
        config_path = w.substr(9);
      } else if (absl::StartsWith(w, "--nproc_per_node=")) {
        ASSERT_TRUE(absl::SimpleAtoi(w.substr(17), &nproc)) << w;
      } else if (absl::StartsWith(w, "--nnodes=")) {
        const std::vector<std::string> range = absl::StrSplit(w.substr(9), ':');
        ASSERT_TRUE(absl::SimpleAtoi(range.back(), &nnodes)) << w;
      } else if (w == "--set") {
        ASSERT_LT(i + 1, words.size()) << "--set without a value";
        sets.push_back(words[++i]);
      }
    }
    absl::StatusOr<TrainConfig> config =
        config_path.empty()
            ? ParseTrainConfig(DefaultConfigText(), "<embedded default>")
            : LoadTrainConfig(config_path);
    ASSERT_TRUE(config.ok()) << config.status();
    ASSERT_TRUE(ApplyOverrides(sets, &*config).ok());
    absl::StatusOr<ResolvedTrainConfig> resolved =
        ResolveTrainConfig(*config, nproc * nnodes);
    EXPECT_TRUE(resolved.ok()) << resolved.status();
  }
  EXPECT_GE(commands, 8) << "README's trainer commands not found";
}

TEST(ValidateTest, CommTimeoutBounds) {
  ExpectValidateErrors(
      {{{"comm.timeout_s=0.5"},
        2,
        "comm.timeout_s must be between 1 and 86400 seconds, got 0.5"},
       {{"comm.timeout_s=1e6"},
        2,
        "comm.timeout_s must be between 1 and 86400 seconds, got 1e+06"}});
  EXPECT_TRUE(ValidateWith({"comm.timeout_s=3"}).ok());
}

TEST(ValidateTest, ResumeRequiredNeedsResume) {
  ExpectValidateErrors(
      {{{"checkpoint.resume=false", "checkpoint.resume_required=true"},
        2,
        "checkpoint.resume_required needs checkpoint.resume: "
        "true"}});
}

TEST(ValidateTest, TrainingErrorMessages) {
  ExpectValidateErrors({
      {{"training.steps=0"}, 2, "training.steps must be positive, got 0"},
      {{"model.init_from=/models/gpt2"},
       2,
       "model.init_from \"/models/gpt2\" is not hf:PATH (a Hugging Face "
       "model directory)"},
      {{"model.init_from=hf:"},
       2,
       "model.init_from \"hf:\" is not hf:PATH (a Hugging Face model "
       "directory)"},
      {{"model.freeze=wte.weight, nope.*"},
       2,
       "model.freeze pattern \"nope.*\" matches no parameter of gpt2_debug "
       "(names look like \"ln_f.bias\"; '*' matches any characters)"},
      {{"model.freeze=*"},
       2,
       "model.freeze (*) freezes every parameter: nothing would train"},
      {{"model.lora.rank=8", "model.lora.targets=c_attn,wq"},
       2,
       "model.lora.targets \"wq\" matches no linear layer of the model"},
      {{"model.lora.rank=8", "model.lora.targets=c_attn",
        "model.lora.dropout=1"},
       2,
       "model.lora.dropout must be in [0, 1), got 1"},
      {{"model.lora.rank=8", "model.lora.targets=c_attn",
        "model.lora.dropout=0.05", "training.device=cuda"},
       2,
       "model.lora.dropout > 0 on CUDA: the keyed dropout (nn/dropout.h) "
       "runs on the CPU only for now; set it 0 there"},
      {{"model.name=moe_debug", "parallelism.ep=3"},
       2,
       "parallelism.ep 3 does not divide dp_shard 2 (ep ranks are "
       "data-parallel ranks)"},
      {{"model.lora.rank=8", "model.lora.targets=c_attn",
        "model.lora.init_from=/nonexistent/adapter"},
       2,
       "model.lora.init_from \"/nonexistent/adapter\" is not a directory "
       "(a PEFT adapter's)"},
      {{"model.lora.init_from=/tmp"},
       2,
       "model.lora.init_from needs model.lora.rank >= 1"},
      {{"training.global_batch=-8"},
       2,
       "training.global_batch must be positive, got -8"},
      {{"training.micro_batch=0"},
       2,
       "training.micro_batch must be positive, got 0"},
      {{"training.global_batch=30", "training.micro_batch=2"},
       4,
       "training.global_batch 30 is not divisible by the data-parallel degree "
       "4 x micro_batch 2 = 8"},
      {{"training.seq_len=-5"},
       2,
       "training.seq_len must be positive (or 0 for the model's context "
       "length), got -5"},
      {{"training.seq_len=256"},
       2,
       "training.seq_len 256 is longer than the context length 128 of model "
       "gpt2_debug"},
      {{"training.seq_len=256", "model.context_length=200"},
       2,
       "training.seq_len 256 is longer than the context length 200 of model "
       "gpt2_debug"},
      {{"training.lr=0"},
       2,
       "training.lr must be a positive finite number, got 0"},
      {{"training.warmup_steps=-1"},
       2,
       "training.warmup_steps must be >= 0, got -1"},
      {{"training.warmup_steps=200", "training.steps=100"},
       2,
       "training.warmup_steps 200 is more than training.steps 100"},
      {{"training.schedule=exponential"},
       2,
       "training.schedule \"exponential\" is not one of: cosine, linear, "
       "constant"},
      {{"training.device=gpu"},
       2,
       "training.device \"gpu\" is not one of: cpu, cuda"},
      {{"training.activation_checkpointing=every:0"},
       2,
       "training.activation_checkpointing: activation checkpointing "
       "\"every:0\" must be \"none\", \"full\", \"every:N\" (N >= 1) or "
       "\"selective\""},
      {{"training.min_lr_ratio=1.5"},
       2,
       "training.min_lr_ratio must be in [0, 1], got 1.5"},
      {{"training.weight_decay=-0.1"},
       2,
       "training.weight_decay must be >= 0, got -0.1"},
      {{"training.grad_clip=-1"},
       2,
       "training.grad_clip must be >= 0 (0 = off), got -1"},
      {{"training.adam_beta1=1"},
       2,
       "training.adam_beta1 must be in [0, 1), got 1"},
      {{"training.adam_beta2=-0.5"},
       2,
       "training.adam_beta2 must be in [0, 1), got -0.5"},
      {{"training.adam_eps=0"}, 2, "training.adam_eps must be positive, got 0"},
      {{"training.mixed_precision.param_dtype=int8"},
       2,
       "training.mixed_precision.param_dtype \"int8\" is not one of: f32, "
       "bf16, f16"},
      {{"training.mixed_precision.reduce_dtype=i32"},
       2,
       "training.mixed_precision.reduce_dtype \"i32\" is not one of: f32, "
       "bf16, f16"},
      {{"training.initial_loss_scale=0"},
       2,
       "training.initial_loss_scale must be positive, got 0"},
      {{"training.loss_scale_growth_interval=0"},
       2,
       "training.loss_scale_growth_interval must be positive, got 0"},
  });
}

TEST(ValidateTest, DataErrorMessages) {
  const std::string missing =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/missing.bin");
  ExpectValidateErrors({
      {{"data.dataset="},
       2,
       "data.dataset is required (\"embedded\" or a file path)"},
      {{"data.tokenizer=sentencepiece"},
       2,
       "data.tokenizer \"sentencepiece\" is not one of: byte, gpt2"},
      {{"data.tokenizer=gpt2"},
       2,
       "data.tokenizer gpt2 produces 50257 token ids but model gpt2_debug has "
       "vocab_size 512"},
      {{"data.tokenizer=byte", "model.vocab_size=256"},
       2,
       "data.tokenizer byte produces 257 token ids but model gpt2_debug has "
       "vocab_size 256"},
      {{absl::StrCat("data.dataset=", missing)},
       2,
       absl::StrCat("data.dataset file \"", missing, "\" does not exist")},
      {{absl::StrCat("data.dataset=", std::getenv("TEST_TMPDIR"))},
       2,
       absl::StrCat("data.dataset \"", std::getenv("TEST_TMPDIR"),
                    "\" is a directory, not a file")},
      {{"data.validation_fraction=1"},
       2,
       "data.validation_fraction must be in [0, 1), got 1"},
  });
}

TEST(ValidateTest, CheckpointErrorMessages) {
  ExpectValidateErrors({
      {{"checkpoint.interval=-1"},
       2,
       "checkpoint.interval must be >= 0 (0 = never), got -1"},
      {{"checkpoint.keep_latest_k=-2"},
       2,
       "checkpoint.keep_latest_k must be >= 0 (0 = keep all), got -2"},
      {{"checkpoint.folder="},
       2,
       "checkpoint.folder is required when checkpoint.interval > 0 or "
       "checkpoint.resume is true"},
  });
}

TEST(ValidateTest, MetricsErrorMessages) {
  ExpectValidateErrors({
      {{"metrics.log_interval=0"},
       2,
       "metrics.log_interval must be positive, got 0"},
      {{"metrics.trace_start_step=-3"},
       2,
       "metrics.trace_start_step must be >= 0, got -3"},
      {{"metrics.trace_steps=-1"},
       2,
       "metrics.trace_steps must be >= 0 (0 = no trace), got -1"},
      {{"metrics.trace_steps=2", "metrics.trace_path="},
       2,
       "metrics.trace_path is required when metrics.trace_steps > 0"},
      {{"metrics.peak_tflops=-1"},
       2,
       "metrics.peak_tflops must be >= 0 (0 = measure or look up), got -1"},
      {{"metrics.throughput_warmup_steps=-2"},
       2,
       "metrics.throughput_warmup_steps must be >= 0, got -2"},
  });
}

TEST(ValidateTest, ValidationErrorMessages) {
  ExpectValidateErrors({
      {{"validation.interval=-10"},
       2,
       "validation.interval must be >= 0 (0 = never), got -10"},
      {{"validation.interval=10", "validation.batches=0"},
       2,
       "validation.batches must be positive, got 0"},
      {{"validation.interval=100", "data.validation_fraction=0"},
       2,
       "validation.interval 100 needs data.validation_fraction > 0"},
  });
}

TEST(ValidateTest, ExistingDataFilesPass) {
  const std::string path =
      absl::StrCat(std::getenv("TEST_TMPDIR"), "/tokens.bin");
  ASSERT_TRUE(WriteFileAtomically(path, "x").ok());
  EXPECT_TRUE(ValidateWith({absl::StrCat("data.dataset=", path)}).ok());
  // Checkpointing off and no resume: no folder needed.
  EXPECT_TRUE(
      ValidateWith({"checkpoint.folder=", "checkpoint.resume=false"}).ok());
}

// --- Paths and printing ------------------------------------------------------

TEST(MakePathsAbsoluteTest, AnchorsRelativePaths) {
  TrainConfig config;
  ASSERT_TRUE(
      ApplyOverrides(
          {"data.dataset=data/train.bin", "data.tokenizer_dir=/opt/gpt2",
           "metrics.jsonl_path=m.jsonl", "model.init_from=hf:hub/gpt2"},
          &config)
          .ok());
  MakePathsAbsolute("/home/me/run", &config);
  EXPECT_EQ(config.model().init_from(), "hf:/home/me/run/hub/gpt2");
  EXPECT_EQ(config.data().dataset(), "/home/me/run/data/train.bin");
  EXPECT_EQ(config.data().tokenizer_dir(), "/opt/gpt2");
  EXPECT_EQ(config.checkpoint().folder(), "/home/me/run/checkpoints");
  EXPECT_EQ(config.metrics().jsonl_path(), "/home/me/run/m.jsonl");
  EXPECT_EQ(config.metrics().trace_path(), "/home/me/run/trace.json");
  TrainConfig embedded;
  MakePathsAbsolute("/x", &embedded);
  EXPECT_EQ(embedded.data().dataset(), "embedded");
  EXPECT_FALSE(embedded.metrics().has_jsonl_path());
  EXPECT_FALSE(embedded.model().has_init_from());
}

TEST(InvocationDirectoryTest, PrefersBazelsWorkingDirectory) {
  setenv("BUILD_WORKING_DIRECTORY", "/where/bazel/ran", 1);
  EXPECT_EQ(InvocationDirectory(), "/where/bazel/ran");
  unsetenv("BUILD_WORKING_DIRECTORY");
  EXPECT_FALSE(InvocationDirectory().empty());
  EXPECT_NE(InvocationDirectory(), "/where/bazel/ran");
}

TEST(FormatTrainConfigTest, ShowsEffectiveValues) {
  TrainConfig config;
  config.mutable_model()->set_name("gpt2_debug");
  const std::string text = FormatTrainConfig(config);
  EXPECT_TRUE(absl::StrContains(text, "name: \"gpt2_debug\"")) << text;
  EXPECT_TRUE(absl::StrContains(text, "steps: 1000")) << text;
  EXPECT_TRUE(absl::StrContains(text, "dp_shard: -1")) << text;
  EXPECT_TRUE(absl::StrContains(text, "schedule: \"cosine\"")) << text;
  // It parses back to the same values.
  auto parsed = ParseTrainConfig(text, "printed");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(FormatTrainConfig(*parsed), text);
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
