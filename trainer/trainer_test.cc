// End-to-end tests of the training loop with thread ranks over real Gloo:
// training makes progress and reports; resuming at the same world size
// repeats the uninterrupted run bitwise, at other world sizes within the
// data-parallel tolerance; a diverging run stops with a clear error and
// saves nothing after the last good step; the loop's parts, called one by
// one, repeat Run.
#include "trainer/trainer.h"

#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/reader.h"
#include "checkpoint/training/training_state.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/device.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "formats/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/transformer.h"
#include "trainer/config.h"

namespace fsdpp {
namespace trainer {
namespace {

// A small, fast run: gpt2_debug on the embedded corpus, 8 steps.
TrainConfig SmallConfig(const std::string& dir) {
  TrainConfig config;
  const std::vector<std::string> overrides = {
      "model.name=gpt2_debug",
      "training.steps=8",
      "training.global_batch=8",
      "training.micro_batch=2",
      "training.seq_len=32",
      "training.lr=3e-3",
      "training.warmup_steps=2",
      "data.dataset=embedded",
      "data.tokenizer=byte",
      "validation.interval=4",
      "validation.batches=2",
      "metrics.log_interval=1",
      "metrics.peak_tflops=1",
      "metrics.throughput_warmup_steps=1",
      "checkpoint.interval=4",
      "checkpoint.resume=true",
      "checkpoint.folder=" + dir + "/ckpt",
      "metrics.jsonl_path=" + dir + "/metrics.jsonl",
  };
  CHECK_OK(ApplyOverrides(overrides, &config));
  return config;
}

std::string TestDir(const std::string& name) {
  const std::string dir = absl::StrCat(std::getenv("TEST_TMPDIR"), "/", name);
  CHECK_OK(RemoveTree(dir));
  CHECK_OK(MakeDirs(dir));
  return dir;
}

// Trains this rank's share of `config` the way the binary does.
absl::StatusOr<TrainResult> CreateAndRun(const TrainConfig& config,
                                         const TrainerEnv& env) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                         Trainer::Create(config, env));
  return trainer->Run();
}

// Runs `body` on `world` thread ranks over one store (rank 0 prints); each
// rank's result.
std::vector<absl::StatusOr<TrainResult>> OnRanks(
    int world, int64_t stop_after_steps,
    const std::function<absl::StatusOr<TrainResult>(const TrainerEnv&)>& body) {
  InMemoryStore store;
  GlooOptions gloo;
  gloo.timeout = absl::Seconds(60);
  std::vector<absl::StatusOr<TrainResult>> results(
      world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      TrainerEnv env;
      env.rank = r;
      env.world_size = world;
      env.group_factory = GlooGroupFactory(&store, gloo);
      env.store = &store;
      env.out = r == 0 ? stdout : nullptr;
      env.stop_after_steps = stop_after_steps;
      results[r] = body(env);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// Runs `config` on `world` thread ranks; each rank's result.
std::vector<absl::StatusOr<TrainResult>> RunRanks(
    const TrainConfig& config, int world, int64_t stop_after_steps = 0) {
  return OnRanks(world, stop_after_steps, [&](const TrainerEnv& env) {
    return CreateAndRun(config, env);
  });
}

// With the overrides added to SmallConfig.
TrainConfig WithOverrides(TrainConfig config,
                          const std::vector<std::string>& overrides) {
  CHECK_OK(ApplyOverrides(overrides, &config));
  return config;
}

std::vector<double> Losses(const TrainResult& r) {
  std::vector<double> losses;
  for (const StepLog& s : r.steps) losses.push_back(s.loss);
  return losses;
}

TEST(TrainerTest, TrainsReportsAndCheckpoints) {
  const std::string dir = TestDir("trains");
  auto results = RunRanks(SmallConfig(dir), 2);
  for (auto& r : results) ASSERT_TRUE(r.ok()) << r.status();
  const TrainResult& r = *results[0];
  ASSERT_EQ(r.steps.size(), 8u);
  EXPECT_EQ(r.start_step, 0);
  EXPECT_EQ(r.end_step, 8);
  // Learning: the last loss is well below the first (ln 512 = 6.24 at init).
  EXPECT_GT(r.steps.front().loss, 5.5);
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss - 1.0);
  // Every rank logged the same (averaged) losses.
  EXPECT_EQ(Losses(*results[1]), Losses(r));
  EXPECT_GT(r.unigram_loss, 2.5);
  EXPECT_LT(r.unigram_loss, 3.5);
  ASSERT_EQ(r.validation.size(), 2u);
  EXPECT_EQ(r.validation[0].first, 4);
  EXPECT_EQ(r.validation[1].first, 8);
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_DOUBLE_EQ(r.tokens_per_s_per_rank, r.tokens_per_s / 2);
  EXPECT_EQ(r.peak_tflops_per_rank, 1.0);
  EXPECT_NEAR(r.mfu, r.tflops_per_rank, 1e-12);  // peak 1 TFLOP/s
  EXPECT_GE(r.exposed_comm_s_per_step, 0);
  // The warm-up schedule: step 1 at lr/2, step 2 at lr.
  EXPECT_DOUBLE_EQ(r.steps[0].lr, 1.5e-3);
  EXPECT_DOUBLE_EQ(r.steps[1].lr, 3e-3);
  EXPECT_EQ(r.last_checkpoint, dir + "/ckpt/step-8");
  auto checkpoints = ListCheckpoints(dir + "/ckpt");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 2u);
  EXPECT_EQ((*checkpoints)[0].first, 4);
  EXPECT_EQ((*checkpoints)[1].first, 8);
  // JSONL: header, 8 train lines, 2 validation lines, summary.
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  int run = 0, train = 0, val = 0, summary = 0;
  while (std::getline(in, line)) {
    run += absl::StartsWith(line, "{\"kind\":\"run\"");
    train += absl::StartsWith(line, "{\"kind\":\"train\"");
    val += absl::StartsWith(line, "{\"kind\":\"val\"");
    summary += absl::StartsWith(line, "{\"kind\":\"summary\"");
  }
  EXPECT_EQ(run, 1);
  EXPECT_EQ(train, 8);
  EXPECT_EQ(val, 2);
  EXPECT_EQ(summary, 1);
  // Running again resumes from step 8: nothing left to do.
  auto again = RunRanks(SmallConfig(dir), 2);
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->start_step, 8);
  EXPECT_TRUE(again[0]->steps.empty());
  EXPECT_EQ(again[0]->resumed_from, dir + "/ckpt/step-8");
}

// model.init_from: a Hugging Face directory of a gpt2_debug model (written
// here) starts the run at W = 1, 2 and 3 with the same first-step loss, which
// is not the randomly initialised run's.
// Writes the named model, initialised with seed 5, as a Hugging Face
// directory `hf_dir` (shards of 100 KiB).
void WriteHfModel(const std::string& name, const std::string& hf_dir) {
  auto config = models::ConfigByName(name);
  ASSERT_TRUE(config.ok());
  auto model = models::Transformer::Create(*config);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE((*model)->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE((*model)->InitWeights(5).ok());
  auto tensors = models::ExportHfTensors(**model);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  models::HfWriteOptions options;
  options.max_shard_bytes = 100 << 10;
  ASSERT_TRUE(
      models::WriteHfDirectory(hf_dir, *config, *tensors, options).ok());
}

// The first-step loss of a run with `base` overrides (model.init_from among
// them) on each of `layouts` (world size, one more override), the runs'
// checkpoints off.
std::vector<double> FirstLosses(
    const std::string& name, const std::vector<std::string>& base,
    const std::vector<std::pair<int, std::string>>& layouts) {
  std::vector<double> first;
  for (const auto& [world, extra] : layouts) {
    const std::string what = absl::StrCat("W=", world, " ", extra);
    TrainConfig c = SmallConfig(TestDir(absl::StrCat(name, "_", first.size())));
    std::vector<std::string> o = base;
    o.insert(o.end(), {"training.steps=1", "training.warmup_steps=1",
                       "training.micro_batch=1", "checkpoint.interval=0",
                       "validation.interval=0", extra});
    CHECK_OK(ApplyOverrides(o, &c));
    std::vector<absl::StatusOr<TrainResult>> results = RunRanks(c, world);
    EXPECT_TRUE(results[0].ok()) << what << ": " << results[0].status();
    first.push_back(results[0].ok() ? Losses(*results[0])[0] : 0.0);
  }
  return first;
}

TEST(TrainerTest, InitFromHfDirectoryAtAnyWorldSize) {
  const std::string dir = TestDir("init_from");
  WriteHfModel("gpt2_debug", dir + "/hf");

  // W = 1, 2, 3, and pipelines (each stage reads its own tensors; the tied
  // embedding's copy on the last stage too): pp 2 and pp 2 x dp 2.
  const std::vector<double> first = FirstLosses(
      "init_from",
      {"model.init_from=hf:" + dir + "/hf", "training.global_batch=6"},
      {{1, "parallelism.pp=1"},
       {2, "parallelism.pp=1"},
       {3, "parallelism.pp=1"},
       {2, "parallelism.pp=2"},
       {4, "parallelism.pp=2"}});
  for (double f : first) EXPECT_NEAR(f, first[0], 2e-6 * first[0]);

  // LoRA on the imported base: the adapters start at B = 0, so the first
  // loss is the base's; the adapters come from the seed (no base has them).
  const std::string lora_dir = TestDir("init_from_lora");
  TrainConfig lora = SmallConfig(lora_dir);
  CHECK_OK(ApplyOverrides({"model.init_from=hf:" + dir + "/hf",
                           "training.steps=2", "training.warmup_steps=1",
                           "training.global_batch=6", "training.micro_batch=1",
                           "checkpoint.interval=0", "validation.interval=0",
                           "model.lora.rank=4", "model.lora.targets=c_attn,fc"},
                          &lora));
  CHECK_OK(
      ApplyOverrides({"checkpoint.interval=2", "training.lr=3e-2"}, &lora));
  std::vector<absl::StatusOr<TrainResult>> adapted = RunRanks(lora, 2);
  ASSERT_TRUE(adapted[0].ok()) << adapted[0].status();
  EXPECT_NEAR(Losses(*adapted[0])[0], first[0], 2e-6 * first[0]);

  // Its trained adapters, written as PEFT saves them (short target names),
  // start another LoRA run (model.lora.init_from) on the same base, at W = 2
  // and tp 2: its first loss is the one of the base with the adapters
  // merged (an HF directory of W + (alpha / r) B A), not the base's.
  const std::string trained = lora_dir + "/ckpt/step-2";
  const std::string adapter = dir + "/adapter", merged = dir + "/merged";
  {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(trained);
    ASSERT_TRUE(reader.ok()) << reader.status();
    auto config = models::ConfigByName("gpt2_debug");
    ASSERT_TRUE(config.ok());
    auto adapted = models::Transformer::Create(*config);
    ASSERT_TRUE(adapted.ok());
    models::LoraOptions lora_options;
    lora_options.rank = 4;
    lora_options.alpha = 16;
    lora_options.targets = {"c_attn", "fc"};
    ASSERT_TRUE(models::AddLoraAdapters(adapted->get(), lora_options).ok());
    ASSERT_TRUE((*adapted)->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE((*adapted)->InitWeights(5).ok());  // the base: seed 5
    auto mapping = models::HfNameMapping(*config);
    ASSERT_TRUE(mapping.ok());
    std::vector<std::pair<std::string, Tensor>> peft;
    for (const auto& [name, p] : (*adapted)->NamedParameters()) {
      if (!models::IsLoraParameter(name)) continue;
      absl::StatusOr<Tensor> value = (*reader)->ReadTensor("model/" + name);
      ASSERT_TRUE(value.ok()) << name << ": " << value.status();
      ASSERT_TRUE(Copy(*value, &p->data).ok());
      peft.emplace_back(*models::PeftAdapterName(*mapping, name), *value);
    }
    ASSERT_TRUE(MakeDirs(adapter).ok());
    ASSERT_TRUE(
        WriteSafetensors(adapter + "/adapter_model.safetensors", peft).ok());
    ASSERT_TRUE(WriteFileAtomically(
                    adapter + "/adapter_config.json",
                    R"({"peft_type": "LORA", "r": 4, "lora_alpha": 16, )"
                    R"("target_modules": ["c_attn", "c_fc"]})")
                    .ok());
    ASSERT_TRUE(models::MergeLoraAdapters(adapted->get()).ok());
    auto tensors = models::ExportHfTensors(**adapted);
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    models::HfWriteOptions options;
    options.max_shard_bytes = 100 << 10;
    ASSERT_TRUE(
        models::WriteHfDirectory(merged, *config, *tensors, options).ok());
  }
  const std::vector<std::string> one_step = {
      "training.steps=1",        "training.warmup_steps=1",
      "training.global_batch=6", "training.micro_batch=1",
      "checkpoint.interval=0",   "validation.interval=0"};
  TrainConfig from_merged =
      WithOverrides(SmallConfig(TestDir("init_from_merged")), one_step);
  CHECK_OK(ApplyOverrides({"model.init_from=hf:" + merged}, &from_merged));
  auto merged_run = RunRanks(from_merged, 2);
  ASSERT_TRUE(merged_run[0].ok()) << merged_run[0].status();
  const double merged_loss = Losses(*merged_run[0])[0];
  EXPECT_GT(std::fabs(merged_loss - first[0]), 1e-4);
  // One step of LoRA r 4 on the base from the adapter, with `change`.
  const auto from_adapter = [&](const std::string& change) {
    return WithOverrides(
        WithOverrides(SmallConfig(TestDir("init_from_adapter")), one_step),
        {"model.init_from=hf:" + dir + "/hf", "model.lora.rank=4",
         "model.lora.targets=c_attn,fc", "model.lora.init_from=" + adapter,
         change});
  };
  for (const std::string& layout :
       {std::string("parallelism.tp=1"), std::string("parallelism.tp=2")}) {
    auto run = RunRanks(from_adapter(layout), 2);
    ASSERT_TRUE(run[0].ok()) << layout << ": " << run[0].status();
    EXPECT_NEAR(Losses(*run[0])[0], merged_loss, 1e-5 * merged_loss) << layout;
  }
  // An adapter of another rank or other modules is refused, named.
  const std::vector<std::pair<std::string, std::string>> refusals = {
      {"model.lora.rank=8",
       "r 4, lora_alpha 16, but model.lora has rank 8, alpha 16"},
      {"model.lora.targets=c_attn",
       "mlp.c_fc.lora_A.weight adapts a module the model's LoRA targets do "
       "not"}};
  for (const auto& [change, message] : refusals) {
    auto refused = RunRanks(from_adapter(change), 1);
    EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kInvalidArgument)
        << change;
    EXPECT_THAT(std::string(refused[0].status().message()),
                ::testing::HasSubstr(message));
  }

  TrainConfig random = SmallConfig(TestDir("init_from_random"));
  CHECK_OK(ApplyOverrides({"training.steps=2", "training.warmup_steps=1",
                           "training.global_batch=6", "training.micro_batch=1",
                           "checkpoint.interval=0", "validation.interval=0"},
                          &random));
  std::vector<absl::StatusOr<TrainResult>> results = RunRanks(random, 1);
  ASSERT_TRUE(results[0].ok());
  EXPECT_GT(std::fabs(Losses(*results[0])[0] - first[0]), 1e-3);

  // A directory of another model is refused before training.
  TrainConfig other = SmallConfig(TestDir("init_from_other"));
  CHECK_OK(ApplyOverrides(
      {"model.init_from=hf:" + dir + "/hf", "model.name=llama_debug"}, &other));
  results = RunRanks(other, 1);
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(results[0].status().message()),
              ::testing::HasSubstr("config.json does not match the model"));
}

TEST(TrainerTest, ResumeAtTheSameWorldSizeIsBitwise) {
  const std::string straight = TestDir("straight"),
                    resumed = TestDir("resumed");
  auto full = RunRanks(SmallConfig(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  // Killed after step 5: the checkpoint of step 4 is the latest.
  auto first = RunRanks(SmallConfig(resumed), 2, /*stop_after_steps=*/5);
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  EXPECT_EQ(first[0]->end_step, 5);
  auto second = RunRanks(SmallConfig(resumed), 2);
  ASSERT_TRUE(second[0].ok()) << second[0].status();
  EXPECT_EQ(second[0]->start_step, 4);
  EXPECT_EQ(second[0]->resumed_from, resumed + "/ckpt/step-4");
  const std::vector<double> want = Losses(*full[0]);
  const std::vector<double> got = Losses(*second[0]);
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], want[4 + i]) << "step " << 5 + i;  // bitwise
  }
  // The step-5 of the interrupted run was the same step too.
  EXPECT_EQ(Losses(*first[0])[4], want[4]);
}

void CopyCheckpoint(const std::string& from, const std::string& to) {
  std::filesystem::create_directories(to);
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

// model.freeze: the checkpoints hold no frozen parameter (nor optimizer
// state for one) but record where their values come from; a resume at the
// same world size is bitwise and one at another within the parity
// tolerance; a resume with other frozen parameters is refused, saying
// what differs.
TEST(TrainerTest, FrozenParametersAreReferencedByCheckpointsAndResume) {
  const std::string straight = TestDir("frozen_straight"),
                    resumed = TestDir("frozen_resumed"),
                    other = TestDir("frozen_w1");
  const std::vector<std::string> freeze = {"model.freeze=wte.weight, h.0.*",
                                           "training.seed=7"};
  auto config = [&](const std::string& dir) {
    TrainConfig c = SmallConfig(dir);
    CHECK_OK(ApplyOverrides(freeze, &c));
    return c;
  };
  auto full = RunRanks(config(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  // Freezing changes the run (the same first loss: the same weights).
  TrainConfig unfrozen = SmallConfig(TestDir("frozen_none"));
  CHECK_OK(ApplyOverrides({"training.seed=7"}, &unfrozen));
  auto everything = RunRanks(unfrozen, 2);
  ASSERT_TRUE(everything[0].ok()) << everything[0].status();
  EXPECT_EQ(Losses(*everything[0])[0], Losses(*full[0])[0]);
  EXPECT_GT(std::fabs(Losses(*everything[0])[7] - Losses(*full[0])[7]), 1e-4);

  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(straight + "/ckpt/step-4");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto& entries = (*reader)->metadata().entries;
  EXPECT_EQ(entries.count("model/wte.weight"), 0u);
  EXPECT_EQ(entries.count("model/h.0.attn.c_attn.weight"), 0u);
  EXPECT_EQ(entries.count("optim/h.0.attn.c_attn.weight.exp_avg"), 0u);
  EXPECT_EQ(entries.count("model/h.1.attn.c_attn.weight"), 1u);
  EXPECT_EQ(entries.count("optim/h.1.attn.c_attn.weight.exp_avg"), 1u);
  absl::StatusOr<std::string> record = (*reader)->ReadBytes(kFrozenKey);
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_TRUE(absl::StartsWith(*record,
                               "source: seed 7\nfrozen: wte.weight\n"
                               "frozen: h.0.ln_1.weight\n"))
      << *record;

  auto first = RunRanks(config(resumed), 2, /*stop_after_steps=*/5);
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  auto second = RunRanks(config(resumed), 2);
  ASSERT_TRUE(second[0].ok()) << second[0].status();
  EXPECT_EQ(second[0]->start_step, 4);
  const std::vector<double> want = Losses(*full[0]);
  const std::vector<double> got = Losses(*second[0]);
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], want[4 + i]) << "step " << 5 + i;  // bitwise
  }
  // From W = 2's checkpoint on one rank.
  CopyCheckpoint(straight + "/ckpt/step-4", other + "/ckpt/step-4");
  auto one = RunRanks(config(other), 1);
  ASSERT_TRUE(one[0].ok()) << one[0].status();
  const std::vector<double> got1 = Losses(*one[0]);
  ASSERT_EQ(got1.size(), 4u);
  for (size_t i = 0; i < got1.size(); ++i) {
    EXPECT_NEAR(got1[i], want[4 + i], 1e-5 * want[4 + i]) << "step " << 5 + i;
  }

  // Other frozen parameters, another source, nothing frozen: refused.
  for (const std::vector<std::string>& change :
       std::vector<std::vector<std::string>>{{"model.freeze=wte.weight"},
                                             {"training.seed=8"},
                                             {"model.freeze="}}) {
    const std::string dir = TestDir("frozen_changed");
    CopyCheckpoint(straight + "/ckpt/step-4", dir + "/ckpt/step-4");
    TrainConfig c = config(dir);
    CHECK_OK(ApplyOverrides(change, &c));
    auto refused = RunRanks(c, 1);
    EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kFailedPrecondition)
        << change[0] << ": " << refused[0].status();
    EXPECT_THAT(std::string(refused[0].status().message()),
                ::testing::HasSubstr(
                    "its run freezes 13 parameter(s) (wte.weight, ...) whose "
                    "values come from seed 7"))
        << change[0];
  }
}

// model.lora: the checkpoints hold the adapters (and their state) and the
// LoRA record; a resume is bitwise, one with other adapters is refused.
TEST(TrainerTest, LoraRunsCheckpointTheAdaptersAndResume) {
  const std::string straight = TestDir("lora_straight"),
                    resumed = TestDir("lora_resumed");
  auto config = [&](const std::string& dir) {
    TrainConfig c = SmallConfig(dir);
    CHECK_OK(ApplyOverrides({"model.lora.rank=4", "model.lora.alpha=8",
                             "model.lora.targets=c_attn,attn.c_proj"},
                            &c));
    return c;
  };
  auto full = RunRanks(config(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  EXPECT_LT(want[7], want[0]);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(straight + "/ckpt/step-4");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto& entries = (*reader)->metadata().entries;
  EXPECT_EQ(entries.count("model/h.0.attn.c_attn.weight"), 0u);
  EXPECT_EQ(entries.count("model/h.0.attn.c_attn.lora_A.weight"), 1u);
  EXPECT_EQ(entries.count("optim/h.0.attn.c_attn.lora_B.weight.exp_avg"), 1u);
  EXPECT_EQ(*(*reader)->ReadBytes(models::kLoraKey),
            "{\"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"c_attn\", "
            "\"attn.c_proj\"]}");

  auto first = RunRanks(config(resumed), 2, /*stop_after_steps=*/5);
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  auto second = RunRanks(config(resumed), 2);
  ASSERT_TRUE(second[0].ok()) << second[0].status();
  EXPECT_EQ(second[0]->start_step, 4);
  const std::vector<double> got = Losses(*second[0]);
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], want[4 + i]) << "step " << 5 + i;  // bitwise
  }

  const std::string dir = TestDir("lora_changed");
  CopyCheckpoint(straight + "/ckpt/step-4", dir + "/ckpt/step-4");
  TrainConfig changed = config(dir);
  CHECK_OK(ApplyOverrides({"model.lora.alpha=16"}, &changed));
  auto refused = RunRanks(changed, 1);
  EXPECT_EQ(refused[0].status().code(), absl::StatusCode::kFailedPrecondition)
      << refused[0].status();
  EXPECT_THAT(std::string(refused[0].status().message()),
              ::testing::HasSubstr("resume with the same model.lora"));
}

TEST(TrainerTest, ResumeAtOtherWorldSizesMatchesWithinParityTolerance) {
  const std::string straight = TestDir("straight_w2");
  auto full = RunRanks(SmallConfig(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  for (int world : {1, 4}) {
    const std::string dir = TestDir(absl::StrCat("reshard_w", world));
    auto first = RunRanks(SmallConfig(dir), 2, /*stop_after_steps=*/4);
    ASSERT_TRUE(first[0].ok()) << first[0].status();
    // The same checkpoint loads onto `world` ranks (resharding load) and the
    // loader continues from the same global position.
    auto second = RunRanks(SmallConfig(dir), world);
    ASSERT_TRUE(second[0].ok()) << second[0].status();
    EXPECT_EQ(second[0]->start_step, 4);
    const std::vector<double> got = Losses(*second[0]);
    ASSERT_EQ(got.size(), 4u);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, std::fabs(got[i] - want[4 + i]) / want[4 + i]);
    }
    // f32 data-parallel parity of losses (models/training_parity_test.cc).
    EXPECT_LE(worst, 1e-5) << "W=" << world;
    std::cout << "resumed at W=" << world << ": max relative loss difference "
              << worst << std::endl;
  }
}

// max_i |got[i] - want[i]| / want[i].
double WorstRelative(const std::vector<double>& got,
                     const std::vector<double>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]) / want[i]);
  }
  return worst;
}

// A layout to resume on: the world size and its overrides.
struct ResumeLayout {
  int world;
  std::vector<std::string> overrides;
};

// For each of `layouts`: trains `base` + `first` on `first_world` ranks for
// 4 steps (stopping there, with a checkpoint at step 4), resumes it with
// `base` + the layout's overrides and expects steps 5-8 within 1e-5
// (relative) of `want` (the uninterrupted run's 8 losses).
void ExpectResumesOnLayouts(const std::string& name,
                            const std::vector<std::string>& base,
                            const std::vector<std::string>& first,
                            int first_world,
                            const std::vector<ResumeLayout>& layouts,
                            const std::vector<double>& want) {
  for (size_t k = 0; k < layouts.size(); ++k) {
    const ResumeLayout& l = layouts[k];
    const std::string what =
        absl::StrCat("W=", l.world, " ", absl::StrJoin(l.overrides, " "));
    const std::string dir = TestDir(absl::StrCat(name, "_", k));
    std::vector<std::string> a = base, b = base;
    a.insert(a.end(), first.begin(), first.end());
    b.insert(b.end(), l.overrides.begin(), l.overrides.end());
    auto stopped = RunRanks(WithOverrides(SmallConfig(dir), a), first_world,
                            /*stop_after_steps=*/4);
    ASSERT_TRUE(stopped[0].ok()) << stopped[0].status();
    auto resumed = RunRanks(WithOverrides(SmallConfig(dir), b), l.world);
    ASSERT_TRUE(resumed[0].ok()) << what << ": " << resumed[0].status();
    EXPECT_EQ(resumed[0]->start_step, 4) << what;
    const std::vector<double> got = Losses(*resumed[0]);
    ASSERT_EQ(got.size(), 4u) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[4 + i], 1e-5 * want[4 + i]) << what;
    }
  }
}

// Validation evaluates the same sequences at every layout (validation.batches
// global batches, dealt like training's): the losses of runs on 1, 2 and 4
// data-parallel ranks, with tensor and pipeline parallelism, agree within the
// training parity tolerance at both evaluations.
TEST(TrainerTest, ValidationSeesTheSameSequencesOnEveryLayout) {
  struct Layout {
    int world;
    std::vector<std::string> overrides;
  };
  std::vector<std::vector<std::pair<int64_t, double>>> got;
  for (const Layout& l : std::vector<Layout>{{2, {}},
                                             {1, {}},
                                             {4, {}},
                                             {4, {"parallelism.tp=2"}},
                                             {2, {"parallelism.pp=2"}}}) {
    const std::string what =
        absl::StrCat("W=", l.world, " ", absl::StrJoin(l.overrides, " "));
    auto run = RunRanks(
        WithOverrides(SmallConfig(TestDir(absl::StrCat("val_", got.size()))),
                      l.overrides),
        l.world);
    ASSERT_TRUE(run[0].ok()) << what << ": " << run[0].status();
    ASSERT_EQ(run[0]->validation.size(), 2u) << what;
    got.push_back(run[0]->validation);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got.back()[i].first, got[0][i].first) << what;
      EXPECT_NEAR(got.back()[i].second, got[0][i].second,
                  1e-5 * got[0][i].second)
          << what;
    }
  }
}

// SFT data (the embedded chat set): the loss is the token mean
// over each step's global batch of answers, so runs on 1, 2 and 4
// data-parallel ranks, with one micro-batch or four, tensor and pipeline
// parallelism train to the same losses and validations (within the parity
// tolerance); a JSONL file trains the same way, and a bad line stops the
// run before it starts, named.
TEST(TrainerTest, SftTrainsAlikeOnEveryLayoutAndNamesBadLines) {
  struct Layout {
    int world;
    std::vector<std::string> overrides;
  };
  const std::vector<std::string> sft = {"data.dataset=embedded_chat"};
  std::vector<double> want;
  std::vector<std::pair<int64_t, double>> want_validation;
  for (const Layout& l : std::vector<Layout>{{2, {}},
                                             {1, {"training.micro_batch=8"}},
                                             {1, {}},
                                             {4, {"training.micro_batch=1"}},
                                             {4, {"parallelism.tp=2"}},
                                             {2, {"parallelism.pp=2"}}}) {
    const std::string what =
        absl::StrCat("W=", l.world, " ", absl::StrJoin(l.overrides, " "));
    std::vector<std::string> overrides = sft;
    overrides.insert(overrides.end(), l.overrides.begin(), l.overrides.end());
    auto run = RunRanks(
        WithOverrides(SmallConfig(TestDir(absl::StrCat("sft_", want.size()))),
                      overrides),
        l.world);
    ASSERT_TRUE(run[0].ok()) << what << ": " << run[0].status();
    const std::vector<double> got = Losses(*run[0]);
    ASSERT_EQ(got.size(), 8u) << what;
    ASSERT_EQ(run[0]->validation.size(), 2u) << what;
    if (want.empty()) {
      want = got;
      want_validation = run[0]->validation;
      EXPECT_LT(want[7], want[0]);
      continue;
    }
    EXPECT_LE(WorstRelative(got, want), 1e-5) << what;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(run[0]->validation[i].second, want_validation[i].second,
                  1e-5 * want_validation[i].second)
          << what;
    }
  }

  const std::string dir = TestDir("sft_jsonl");
  std::string jsonl;
  for (int i = 0; i < 60; ++i) {
    absl::StrAppend(&jsonl, "{\"prompt\": \"", i, " plus ", i % 7,
                    " is\", \"completion\": \" ", i + i % 7, ".\"}\n");
  }
  ASSERT_TRUE(WriteFileAtomically(dir + "/sums.jsonl", jsonl).ok());
  auto run =
      RunRanks(WithOverrides(SmallConfig(dir),
                             {"data.dataset=" + dir + "/sums.jsonl",
                              "training.seq_len=16", "validation.batches=1"}),
               2);
  ASSERT_TRUE(run[0].ok()) << run[0].status();
  EXPECT_TRUE(std::isfinite(Losses(*run[0]).back()));
  ASSERT_TRUE(WriteFileAtomically(dir + "/bad.jsonl",
                                  jsonl +
                                      "{\"messages\": [{\"role\": \"user\", "
                                      "\"content\": \"hi\"}]}\n")
                  .ok());
  auto bad = RunRanks(
      WithOverrides(SmallConfig(dir), {"data.dataset=" + dir + "/bad.jsonl"}),
      1);
  ASSERT_FALSE(bad[0].ok());
  EXPECT_THAT(std::string(bad[0].status().message()),
              ::testing::HasSubstr("bad.jsonl line 61: no assistant message"));
}

// Tensor parallelism: 2 data-parallel x 2 tensor-parallel ranks (with and
// without sequence parallelism) train like the 2-rank data-parallel run, and
// a checkpoint saved at (dp 2, tp 2) resumes at (4, 1), (1, 4), (1, 1),
// (2, 1), (1, 2) and HSDP 2 x FSDP 1 x TP 2 with the uninterrupted run's
// losses.
TEST(TrainerTest, TensorParallelLayoutsTrainAndResumeAcrossLayouts) {
  const std::string straight = TestDir("straight_dp2");
  auto full = RunRanks(SmallConfig(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  for (bool sp : {false, true}) {
    const std::string dir = TestDir(absl::StrCat("tp2_sp", sp));
    auto run = RunRanks(
        WithOverrides(
            SmallConfig(dir),
            {"parallelism.tp=2", absl::StrCat("parallelism.sequence_parallel=",
                                              sp ? "true" : "false")}),
        4);
    ASSERT_TRUE(run[0].ok()) << run[0].status();
    ASSERT_EQ(Losses(*run[0]).size(), want.size());
    EXPECT_LE(WorstRelative(Losses(*run[0]), want), 1e-5) << "sp " << sp;
  }
  ExpectResumesOnLayouts(
      "from_tp2", {}, {"parallelism.tp=2"}, 4,
      {{4, {"training.micro_batch=1"}},
       {4, {"parallelism.tp=4"}},
       {1, {}},
       {2, {}},
       {2, {"parallelism.tp=2"}},
       {4, {"parallelism.dp_replicate=2", "parallelism.tp=2"}}},
      want);
}

// Context parallelism on Llama (RoPE at the global positions): cp 4, cp 2 x
// dp 2, cp 2 x tp 2, cp 2 x pp 2 and the all-to-all style at cp 2 train like
// one rank
// (the same global batch), and a
// checkpoint saved at cp 4 resumes at cp 2 and on one rank with the
// uninterrupted run's losses.
TEST(TrainerTest, ContextParallelLayoutsTrainAndResumeAcrossLayouts) {
  const std::vector<std::string> llama = {"model.name=llama_debug"};
  auto full =
      RunRanks(WithOverrides(SmallConfig(TestDir("straight_llama")), llama), 1);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  ASSERT_EQ(want.size(), 8u);
  for (const ResumeLayout& l : std::vector<ResumeLayout>{
           {4, {"parallelism.cp=4"}},
           {4, {"parallelism.cp=2"}},
           {4, {"parallelism.cp=2", "parallelism.tp=2"}},
           {2, {"parallelism.cp=2", "parallelism.cp_style=alltoall"}},
           {4, {"parallelism.cp=2", "parallelism.pp=2"}}}) {
    const std::string what =
        absl::StrCat("W=", l.world, " ", absl::StrJoin(l.overrides, " "));
    std::vector<std::string> o = llama;
    o.insert(o.end(), l.overrides.begin(), l.overrides.end());
    auto run =
        RunRanks(WithOverrides(SmallConfig(TestDir(absl::StrCat(
                                   "cp_", l.world, "_", l.overrides.size()))),
                               o),
                 l.world);
    ASSERT_TRUE(run[0].ok()) << what << ": " << run[0].status();
    ASSERT_EQ(Losses(*run[0]).size(), want.size()) << what;
    EXPECT_LE(WorstRelative(Losses(*run[0]), want), 1e-5) << what;
  }
  ExpectResumesOnLayouts("from_cp4", llama, {"parallelism.cp=4"}, 4,
                         {{2, {"parallelism.cp=2"}}, {1, {}}}, want);
}

// Pipeline parallelism: pp 2 x dp 2 (1F1B, the tied embedding on both end
// stages) trains like the 2-rank data-parallel run; pp 2 with GPipe and 4
// micro-batches too (dp 1, 1-rank run); a checkpoint saved at (pp 2, dp 2)
// resumes at pp 1 on 4 and 1 ranks and at pp 2 x dp 1 with the
// uninterrupted run's losses; validation runs through the pipeline.
TEST(TrainerTest, PipelineLayoutsTrainAndResumeAcrossLayouts) {
  const std::string straight = TestDir("straight_pp_dp2");
  auto full = RunRanks(SmallConfig(straight), 2);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  {
    const std::string dir = TestDir("pp2_dp2");
    auto run =
        RunRanks(WithOverrides(SmallConfig(dir), {"parallelism.pp=2"}), 4);
    for (int r = 0; r < 4; ++r) ASSERT_TRUE(run[r].ok()) << run[r].status();
    ASSERT_EQ(Losses(*run[0]).size(), want.size());
    EXPECT_LE(WorstRelative(Losses(*run[0]), want), 1e-5);
    ASSERT_EQ(run[0]->validation.size(), full[0]->validation.size());
    EXPECT_NEAR(run[0]->validation.back().second,
                full[0]->validation.back().second,
                1e-5 * full[0]->validation.back().second);
    EXPECT_GT(run[0]->pipeline_peak_held_bytes, 0);
    EXPECT_NEAR(run[0]->pipeline_bubble_schedule, 1.0 / 3, 1e-9);
  }
  {
    const std::string one = TestDir("straight_mb4");
    auto ref = RunRanks(
        WithOverrides(SmallConfig(one), {"training.micro_batch=2"}), 1);
    ASSERT_TRUE(ref[0].ok()) << ref[0].status();
    const std::string dir = TestDir("pp2_gpipe");
    auto run = RunRanks(
        WithOverrides(SmallConfig(dir),
                      {"parallelism.pp=2", "parallelism.pp_schedule=gpipe",
                       "parallelism.pp_microbatches=4"}),
        2);
    ASSERT_TRUE(run[0].ok()) << run[0].status();
    EXPECT_LE(WorstRelative(Losses(*run[0]), Losses(*ref[0])), 1e-5);
  }
  ExpectResumesOnLayouts(
      "from_pp2", {}, {"parallelism.pp=2"}, 4,
      {{4, {"training.micro_batch=1"}}, {1, {}}, {2, {"parallelism.pp=2"}}},
      want);
}

// A mixture of experts (moe_debug: 8 experts, top-2, aux loss 0.01) trains
// alike at W = 1, 2 and 4 and on 2 pipeline stages (the aux loss is each
// sequence's, so it does not depend on the split), resumes across them, and
// logs its aux loss and the tokens each expert received: every one of a
// step's tokens twice (top-2) in each of the 2 layers.
TEST(TrainerTest, MixtureOfExpertsTrainsAlikeOnEveryLayoutAndLogsItsExperts) {
  const std::vector<std::string> moe = {"model.name=moe_debug"};
  const std::string straight = TestDir("moe_w2");
  auto full = RunRanks(WithOverrides(SmallConfig(straight), moe), 2);
  for (auto& r : full) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<double> want = Losses(*full[0]);
  EXPECT_LT(want.back(), want.front() - 0.5);
  const int64_t tokens_per_step = 8 * 32;
  for (const StepLog& s : full[0]->steps) {
    ASSERT_EQ(s.expert_tokens.size(), 8u);
    int64_t sum = 0;
    for (int64_t n : s.expert_tokens) sum += n;
    EXPECT_EQ(sum, tokens_per_step * 2 * 2) << "step " << s.step;
    EXPECT_GT(s.aux_loss, 0.0);
    EXPECT_LT(s.aux_loss, 0.2);  // 2 layers x 0.01 x E x sum f P ~ 0.02
  }
  // Both ranks logged the same (summed) counts.
  EXPECT_EQ(full[1]->steps.back().expert_tokens,
            full[0]->steps.back().expert_tokens);
  std::ifstream in(straight + "/metrics.jsonl");
  std::string line;
  int with_experts = 0;
  while (std::getline(in, line)) {
    with_experts += absl::StrContains(line, "\"expert_tokens\":[") &&
                    absl::StrContains(line, "\"aux_loss\":");
  }
  EXPECT_EQ(with_experts, 8);
  for (const auto& [world, overrides] :
       std::vector<std::pair<int, std::vector<std::string>>>{
           {1, {}},
           {4, {"training.micro_batch=1"}},
           {2, {"parallelism.pp=2"}}}) {
    std::vector<std::string> o = moe;
    o.insert(o.end(), overrides.begin(), overrides.end());
    const std::string dir =
        TestDir(absl::StrCat("moe_w", world, "_", overrides.size()));
    auto run = RunRanks(WithOverrides(SmallConfig(dir), o), world);
    ASSERT_TRUE(run[0].ok()) << run[0].status();
    EXPECT_LE(WorstRelative(Losses(*run[0]), want), 1e-5)
        << "W=" << world << " " << absl::StrJoin(overrides, " ");
  }
  ExpectResumesOnLayouts("moe_from_w2", moe, {}, 2,
                         {{1, {}}, {4, {"training.micro_batch=1"}}}, want);
}

// One expert-parallel layout of a run: world size, ep, tp and pp.
struct EpLayout {
  int world, ep, tp, pp;
};

// Runs `base` on each of `layouts` and expects the losses of `ref` within
// 1e-5 and its last step's expert loads (without a pipeline: a stage
// counts its own layers' loads).
void ExpectEpLayoutsTrainAlike(const std::string& name,
                               const std::vector<std::string>& base,
                               const std::vector<EpLayout>& layouts,
                               const TrainResult& ref) {
  for (const EpLayout& c : layouts) {
    std::vector<std::string> o = base;
    o.push_back(absl::StrCat("parallelism.ep=", c.ep));
    o.push_back(absl::StrCat("parallelism.tp=", c.tp));
    o.push_back(absl::StrCat("parallelism.pp=", c.pp));
    const std::string what =
        absl::StrCat("W=", c.world, " ep=", c.ep, " tp=", c.tp, " pp=", c.pp);
    auto run = RunRanks(
        WithOverrides(
            SmallConfig(TestDir(absl::StrCat(name, "_ep", c.ep, "_tp", c.tp,
                                             "_pp", c.pp, "_w", c.world))),
            o),
        c.world);
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(run[r].ok()) << what << ": " << run[r].status();
    }
    EXPECT_LE(WorstRelative(Losses(*run[0]), Losses(ref)), 1e-5) << what;
    if (c.pp == 1) {
      EXPECT_EQ(run[0]->steps.back().expert_tokens,
                ref.steps.back().expert_tokens)
          << what;
    }
  }
}

// Expert parallelism: moe_debug's 8 experts split over ep = 2 and 4 ranks
// of the shard axis, alone, with tp 2 (every expert's hidden split too) and
// on 2 pipeline stages, and tp 2 without ep, train as on one rank (the same
// tokens reach the same experts), and checkpoints reshard across ep and tp
// sizes (the experts' stacks are saved as boxes of the whole).
TEST(TrainerTest, ExpertParallelLayoutsTrainAlikeAndResumeAcrossEpSizes) {
  const std::vector<std::string> moe = {"model.name=moe_debug"};
  const std::string one = TestDir("moe_ep_w1");
  auto ref = RunRanks(WithOverrides(SmallConfig(one), moe), 1);
  ASSERT_TRUE(ref[0].ok()) << ref[0].status();
  const std::vector<double> want = Losses(*ref[0]);
  ExpectEpLayoutsTrainAlike("moe", moe,
                            {{2, 2, 1, 1},
                             {4, 2, 1, 1},
                             {4, 4, 1, 1},
                             {4, 2, 2, 1},
                             {2, 1, 2, 1},
                             {4, 2, 1, 2}},
                            *ref[0]);
  ExpectResumesOnLayouts("moe_ep_resume", moe, {"parallelism.ep=2"}, 2,
                         {{4, {"parallelism.ep=4"}},
                          {1, {}},
                          {4, {"parallelism.ep=2", "parallelism.tp=2"}},
                          {2, {"parallelism.tp=2"}},
                          {4, {"parallelism.ep=2", "parallelism.pp=2"}}},
                         want);
}

// OLMoE's Hugging Face layout (olmoe_debug: one HF tensor per expert):
// model.init_from starts the run on one rank, FSDP 2 and ep 2 on 2 and 4
// ranks with the same first-step loss, not the random initialisation's.
TEST(TrainerTest, MixtureOfExpertsInitFromHfAtAnyEp) {
  const std::string dir = TestDir("olmoe_init_from");
  WriteHfModel("olmoe_debug", dir + "/hf");
  const std::vector<std::string> base = {"model.name=olmoe_debug",
                                         "training.global_batch=4"};
  std::vector<std::string> from_hf = base;
  from_hf.push_back("model.init_from=hf:" + dir + "/hf");
  const std::vector<double> first = FirstLosses("olmoe_init_from", from_hf,
                                                {{1, "parallelism.ep=1"},
                                                 {2, "parallelism.ep=1"},
                                                 {2, "parallelism.ep=2"},
                                                 {4, "parallelism.ep=2"}});
  for (double f : first) EXPECT_NEAR(f, first[0], 2e-6 * first[0]);
  const std::vector<double> random =
      FirstLosses("olmoe_random", base, {{1, "parallelism.ep=1"}});
  EXPECT_GT(std::fabs(random[0] - first[0]), 1e-3);
}

// DeepSeek-V3's auxiliary-loss-free balancing (sigmoid router, expert bias
// moved after every step by the loads of every data-parallel rank): the
// same losses on one rank, FSDP 2, ep 2 and ep 2 x tp 2 (the biases move
// alike everywhere), different from the same router without the update
// (the bias moves the routing), and a checkpoint (which holds the biases)
// resumes on other layouts with the uninterrupted run's losses.
TEST(TrainerTest, AuxLossFreeBalancingMovesTheBiasAlikeOnEveryLayout) {
  const std::vector<std::string> moe = {
      "model.name=moe_debug", "model.moe.scoring=sigmoid",
      "model.moe.aux_loss_coef=0", "model.moe.expert_bias=true",
      "model.moe.bias_update_rate=0.01"};
  auto ref = RunRanks(WithOverrides(SmallConfig(TestDir("bias_w1")), moe), 1);
  ASSERT_TRUE(ref[0].ok()) << ref[0].status();
  const std::vector<double> want = Losses(*ref[0]);
  std::vector<std::string> still = moe;
  still.back() = "model.moe.bias_update_rate=0";
  auto fixed =
      RunRanks(WithOverrides(SmallConfig(TestDir("bias_fixed")), still), 1);
  ASSERT_TRUE(fixed[0].ok()) << fixed[0].status();
  EXPECT_NE(fixed[0]->steps.back().expert_tokens,
            ref[0]->steps.back().expert_tokens);
  EXPECT_GT(WorstRelative(Losses(*fixed[0]), want), 1e-5);
  ExpectEpLayoutsTrainAlike(
      "bias", moe, {{2, 1, 1, 1}, {2, 2, 1, 1}, {4, 2, 2, 1}}, *ref[0]);
  ExpectResumesOnLayouts("bias_resume", moe, {"parallelism.ep=2"}, 2,
                         {{1, {}}, {4, {"parallelism.tp=2"}}}, want);
}

// Pipeline checkpoints across cut points and depths: a 4-block GPT-2 saved
// at pp 2 cut at block 1 (stage 1 holds blocks 1-3) resumes at pp 2 cut at
// block 3, at pp 4, at pp 2 with HSDP inside the stages (dp_replicate 2),
// and at pp 1, each with the uninterrupted run's losses.
TEST(TrainerTest, PipelineCheckpointsLoadAtOtherCutsAndDepths) {
  const std::vector<std::string> deeper = {"model.n_layers=4"};
  const std::string straight = TestDir("straight_4blocks");
  auto full = RunRanks(WithOverrides(SmallConfig(straight), deeper), 1);
  ASSERT_TRUE(full[0].ok()) << full[0].status();
  const std::vector<double> want = Losses(*full[0]);
  ExpectResumesOnLayouts("from_pp2_cut1", deeper,
                         {"parallelism.pp=2", "parallelism.pp_cuts=1"}, 2,
                         {{2, {"parallelism.pp=2", "parallelism.pp_cuts=3"}},
                          {4, {"parallelism.pp=4"}},
                          {4,
                           {"parallelism.pp=2", "parallelism.dp_replicate=2",
                            "training.micro_batch=1"}},
                          {1, {}}},
                         want);
}

// A failed asynchronous save (its files fail to write as on a full disk:
// RLIMIT_FSIZE makes writes past 64 KiB fail with EFBIG) stops the run on
// every rank at the same step with an error naming the save's step, instead
// of training on without checkpoints; the checkpoint before it stays the
// latest committed one.
TEST(TrainerTest, FailedAsyncSaveStopsTheRunOnEveryRank) {
  const std::string dir = TestDir("async_fail");
  const TrainConfig config = WithOverrides(
      SmallConfig(dir), {"checkpoint.async=true", "checkpoint.interval=2",
                         "training.steps=40", "validation.interval=0"});
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit original;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &original), 0);
  std::vector<int64_t> stopped_at(2, -1);
  auto results =
      OnRanks(2, 0, [&](const TrainerEnv& env) -> absl::StatusOr<TrainResult> {
        FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                               Trainer::Create(config, env));
        while (!trainer->done()) {
          absl::Status s = trainer->TrainStep();
          if (s.ok()) s = trainer->LogStep();
          if (s.ok() && trainer->step() == 4 && env.rank == 0) {
            // Step 2's checkpoint committed, then the disk "fills up".
            const absl::Time deadline = absl::Now() + absl::Seconds(30);
            while (ListCheckpoints(dir + "/ckpt")->empty() &&
                   absl::Now() < deadline) {
              absl::SleepFor(absl::Milliseconds(5));
            }
            struct rlimit small = original;
            small.rlim_cur = 64 << 10;
            if (setrlimit(RLIMIT_FSIZE, &small) != 0) {
              return absl::InternalError("setrlimit failed");
            }
          }
          if (s.ok()) s = trainer->MaybeSave();
          if (!s.ok()) {
            stopped_at[env.rank] = trainer->step();
            return s;
          }
        }
        return trainer->result();
      });
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &original), 0);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r << " trained on";
    EXPECT_NE(results[r].status().message().find(
                  "asynchronous checkpoint of step 4 failed"),
              std::string::npos)
        << results[r].status();
  }
  std::cout << "stopped after step " << stopped_at[0] << ": "
            << results[0].status() << std::endl;
  EXPECT_EQ(stopped_at[0], stopped_at[1]);
  EXPECT_GE(stopped_at[0], 4);
  EXPECT_LT(stopped_at[0], 40);
  EXPECT_EQ(*LatestCheckpoint(dir + "/ckpt"), dir + "/ckpt/step-2");
}

// What resuming found is said: a newer step directory without committed
// metadata is named and skipped; no checkpoint at all says "starting from
// step 0", or fails with checkpoint.resume_required.
TEST(TrainerTest, ResumeSaysWhatItFoundAndCanBeRequired) {
  const std::string dir = TestDir("resume_notes");
  const TrainConfig config = SmallConfig(dir);
  // One rank, the header into a file.
  auto header = [&](const TrainConfig& c) -> absl::StatusOr<std::string> {
    const std::string path = dir + "/out.txt";
    std::FILE* out = std::fopen(path.c_str(), "w");
    if (out == nullptr) return absl::InternalError("fopen");
    InMemoryStore store;
    TrainerEnv env;
    env.group_factory = GlooGroupFactory(&store);
    env.out = out;
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(c, env);
    std::fclose(out);
    if (!trainer.ok()) return trainer.status();
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  absl::StatusOr<std::string> fresh = header(config);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->find("resume: no committed checkpoint in " + dir +
                        "/ckpt; starting from step 0"),
            std::string::npos)
      << *fresh;
  TrainConfig required = config;
  required.mutable_checkpoint()->set_resume_required(true);
  absl::Status refused = header(required).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("holds no committed checkpoint"),
            std::string::npos)
      << refused;

  auto first = RunRanks(config, 1, /*stop_after_steps=*/5);  // saves step 4
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  ASSERT_TRUE(MakeDirs(dir + "/ckpt/step-8").ok());  // no metadata
  absl::StatusOr<std::string> resumed = header(required);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_NE(resumed->find("resume: skipped " + dir +
                          "/ckpt/step-8: no committed metadata"),
            std::string::npos)
      << *resumed;
  EXPECT_NE(resumed->find("resumed from " + dir + "/ckpt/step-4"),
            std::string::npos)
      << *resumed;
}

TEST(TrainerTest, DivergenceStopsBeforeTheStepAndSavesNothingAfter) {
  const std::string dir = TestDir("diverge");
  TrainConfig config = SmallConfig(dir);
  CHECK_OK(ApplyOverrides(
      {"training.lr=1e4", "training.grad_clip=0", "training.warmup_steps=0",
       "training.steps=30", "checkpoint.interval=1", "validation.interval=0"},
      &config));
  auto results = RunRanks(config, 2);
  ASSERT_FALSE(results[0].ok());
  const std::string message(results[0].status().message());
  EXPECT_TRUE(absl::StrContains(message, "stopping before the optimizer step"))
      << results[0].status();
  // Both ranks stop at the same step with the same error.
  EXPECT_EQ(results[1].status(), results[0].status());
  // The checkpoints are the steps before the bad one.
  int bad_step = 0;
  ASSERT_TRUE(sscanf(message.c_str(), "step %d", &bad_step) == 1) << message;
  auto latest = LatestCheckpoint(dir + "/ckpt");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, absl::StrCat(dir, "/ckpt/step-", bad_step - 1));
}

// On the device (TrainerEnv::step_values_on_device): the same run as the
// host-values one, each step's loss and norm read at logged steps, saves
// and the end; bitwise the same on every rank.
TEST(TrainerTest, StepValuesOnTheDeviceGiveTheSameRun) {
  const std::string host_dir = TestDir("values_host"),
                    device_dir = TestDir("values_device");
  TrainConfig host_config = SmallConfig(host_dir);
  TrainConfig device_config = SmallConfig(device_dir);
  for (TrainConfig* c : {&host_config, &device_config}) {
    CHECK_OK(
        ApplyOverrides({"metrics.log_interval=3", "checkpoint.interval=5"}, c));
  }
  auto host = RunRanks(host_config, 2);
  ASSERT_TRUE(host[0].ok()) << host[0].status();
  auto device =
      OnRanks(2, 0, [&](const TrainerEnv& env) -> absl::StatusOr<TrainResult> {
        TrainerEnv on_device = env;
        on_device.step_values_on_device = true;
        return CreateAndRun(device_config, on_device);
      });
  for (auto& r : device) ASSERT_TRUE(r.ok()) << r.status();
  const TrainResult& a = *host[0];
  const TrainResult& b = *device[0];
  ASSERT_EQ(b.steps.size(), a.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    // f32 sums on the device, double ones on the host.
    EXPECT_NEAR(b.steps[i].loss, a.steps[i].loss, 1e-5 * a.steps[i].loss)
        << "step " << i + 1;
    EXPECT_NEAR(b.steps[i].grad_norm, a.steps[i].grad_norm,
                1e-4 * a.steps[i].grad_norm)
        << "step " << i + 1;
    EXPECT_EQ(b.steps[i].lr, a.steps[i].lr) << "step " << i + 1;
  }
  EXPECT_EQ(Losses(*device[1]), Losses(b));
  EXPECT_EQ(b.last_checkpoint, device_dir + "/ckpt/step-8");
  ASSERT_EQ(b.validation.size(), a.validation.size());
  // The JSONL has the logged steps (1, 3, 6, 8) with their values.
  std::ifstream jsonl(device_dir + "/metrics.jsonl");
  std::string line;
  std::vector<int64_t> logged;
  while (std::getline(jsonl, line)) {
    if (!absl::StrContains(line, "\"kind\":\"train\"")) continue;
    int64_t step = 0;
    ASSERT_EQ(sscanf(line.c_str() + line.find("\"step\":") + 7, "%ld", &step),
              1)
        << line;
    logged.push_back(step);
    EXPECT_FALSE(absl::StrContains(line, "\"loss\":null")) << line;
  }
  EXPECT_EQ(logged, (std::vector<int64_t>{1, 3, 6, 8}));
}

// On the device a diverging step is found when its values are read: AdamW
// skipped it there, the run stops naming it, and no checkpoint holds it or
// a later step.
TEST(TrainerTest, StepValuesOnTheDeviceStopAtTheFirstNonFiniteStep) {
  const std::string dir = TestDir("diverge_on_device");
  TrainConfig config = SmallConfig(dir);
  CHECK_OK(ApplyOverrides(
      {"training.lr=1e4", "training.grad_clip=0", "training.warmup_steps=0",
       "training.steps=30", "checkpoint.interval=4", "metrics.log_interval=3",
       "validation.interval=0"},
      &config));
  auto results =
      OnRanks(2, 0, [&](const TrainerEnv& env) -> absl::StatusOr<TrainResult> {
        TrainerEnv on_device = env;
        on_device.step_values_on_device = true;
        return CreateAndRun(config, on_device);
      });
  ASSERT_FALSE(results[0].ok());
  const std::string message(results[0].status().message());
  EXPECT_TRUE(absl::StrContains(message,
                                "the optimizer skipped the step on the device"))
      << results[0].status();
  EXPECT_EQ(results[1].status(), results[0].status());
  int bad_step = 0;
  ASSERT_TRUE(sscanf(message.c_str(), "step %d", &bad_step) == 1) << message;
  auto latest = LatestCheckpoint(dir + "/ckpt");
  if (bad_step <= 4) {
    EXPECT_FALSE(latest.ok()) << *latest;
  } else {
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest,
              absl::StrCat(dir, "/ckpt/step-", (bad_step - 1) / 4 * 4));
  }
}

// checkpoint.resume=false: a restarted job resumes its own latest
// checkpoint and never another run's (train/job); the checkpoints say whose
// they are.
TEST(TrainerTest, RestartedJobsResumeTheirOwnCheckpointsOnly) {
  const std::string dir = TestDir("restarts");
  TrainConfig config = SmallConfig(dir);
  CHECK_OK(ApplyOverrides({"checkpoint.resume=false"}, &config));
  const auto run = [&](const std::string& job, bool restarted,
                       int64_t stop_after) {
    return OnRanks(2, stop_after,
                   [&](const TrainerEnv& env) -> absl::StatusOr<TrainResult> {
                     TrainerEnv e = env;
                     e.job_id = job + (env.rank == 0 ? "" : "-ignored");
                     e.restarted = restarted;
                     return CreateAndRun(config, e);
                   });
  };
  // Job a saves step 4 and "dies" after step 5.
  auto a = run("job-a", false, 5);
  ASSERT_TRUE(a[0].ok()) << a[0].status();
  EXPECT_EQ(a[0]->start_step, 0);
  auto reader = CheckpointReader::Open(dir + "/ckpt/step-4");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(*(*reader)->ReadBytes("train/job"), "job-a");  // rank 0's
  // A restart of another job does not adopt it: step 0 again.
  auto b = run("job-b", true, 1);
  ASSERT_TRUE(b[0].ok()) << b[0].status();
  EXPECT_EQ(b[0]->start_step, 0);
  EXPECT_TRUE(b[0]->resumed_from.empty());
  // Job a restarted resumes its step 4 and trains to the end.
  auto again = run("job-a", true, 0);
  for (auto& r : again) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(again[0]->start_step, 4);
  EXPECT_EQ(again[0]->resumed_from, dir + "/ckpt/step-4");
  EXPECT_EQ(again[0]->end_step, 8);
  // A fresh job (not restarted) starts over whatever the folder holds.
  auto fresh = run("job-c", false, 1);
  ASSERT_TRUE(fresh[0].ok()) << fresh[0].status();
  EXPECT_EQ(fresh[0]->start_step, 0);
}

// A checkpoint holding a NaN (here in an AdamW moment, written by a tool
// that does not check) is refused at resume, naming the key and the
// checkpoint to fall back to; nothing is trained or saved from it.
TEST(TrainerTest, ResumeRefusesANonFiniteCheckpoint) {
  const std::string dir = TestDir("nan_moment");
  TrainConfig config = SmallConfig(dir);
  CHECK_OK(ApplyOverrides({"checkpoint.interval=1"}, &config));
  auto first = RunRanks(config, 2, /*stop_after_steps=*/3);
  ASSERT_TRUE(first[0].ok()) << first[0].status();
  // step-3 copied to step-4 with one moment element NaN.
  auto reader = CheckpointReader::Open(dir + "/ckpt/step-3");
  ASSERT_TRUE(reader.ok()) << reader.status();
  StateDict copy;
  std::string poisoned;
  for (const auto& [key, entry] : (*reader)->metadata().entries) {
    if (entry.kind == EntryKind::kBytes) {
      CHECK_OK(copy.AddBytes(key, *(*reader)->ReadBytes(key)));
      continue;
    }
    Tensor t = *(*reader)->ReadTensor(key);
    if (poisoned.empty() && absl::EndsWith(key, ".exp_avg")) {
      static_cast<float*>(t.raw_data())[0] = std::nanf("");
      poisoned = key;
    }
    CHECK_OK(copy.AddTensor(key, t));
  }
  ASSERT_FALSE(poisoned.empty());
  ASSERT_TRUE(Save(copy, dir + "/ckpt", 4).ok());
  auto resumed = RunRanks(config, 2);
  ASSERT_FALSE(resumed[0].ok());
  const absl::Status& s = resumed[0].status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "'" + poisoned + "'")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "non-finite")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(),
                                absl::StrCat("move ", dir,
                                             "/ckpt/step-4 aside to resume "
                                             "from ",
                                             dir, "/ckpt/step-3")))
      << s;
  EXPECT_EQ(*LatestCheckpoint(dir + "/ckpt"), dir + "/ckpt/step-4");
}

TEST(TrainerTest, Fp16WithLossScalerTracksF32) {
  auto f32 = RunRanks(SmallConfig(TestDir("f32")), 2);
  ASSERT_TRUE(f32[0].ok()) << f32[0].status();
  TrainConfig config = SmallConfig(TestDir("f16"));
  CHECK_OK(ApplyOverrides({"training.mixed_precision.param_dtype=f16",
                           "training.mixed_precision.reduce_dtype=f32",
                           "training.initial_loss_scale=1024"},
                          &config));
  auto f16 = RunRanks(config, 2);
  ASSERT_TRUE(f16[0].ok()) << f16[0].status();
  ASSERT_EQ(f16[0]->steps.size(), f32[0]->steps.size());
  double worst = 0;
  for (size_t i = 0; i < f16[0]->steps.size(); ++i) {
    const StepLog& s = f16[0]->steps[i];
    EXPECT_FALSE(s.skipped) << "step " << s.step;
    EXPECT_EQ(s.loss_scale, 1024) << "step " << s.step;
    worst = std::max(worst, std::fabs(s.loss - f32[0]->steps[i].loss));
  }
  // The bf16 bound of the FSDP parity tests; f16 has 3 more mantissa bits.
  EXPECT_LE(worst, 2e-2);
  std::cout << "f16 vs f32: max |loss difference| " << worst << std::endl;
}

TEST(TrainerTest, Fp16OverflowSkipsStepsAndLowersTheScale) {
  TrainConfig config = SmallConfig(TestDir("f16_overflow"));
  // 2^40 times any gradient of magnitude > 2^-24 overflows f16 (max 65504).
  CHECK_OK(ApplyOverrides(
      {"training.mixed_precision.param_dtype=f16",
       "training.initial_loss_scale=1099511627776", "training.steps=40",
       "checkpoint.interval=0", "validation.interval=0"},
      &config));
  auto results = RunRanks(config, 2);
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  const std::vector<StepLog>& steps = results[0]->steps;
  ASSERT_EQ(steps.size(), 40u);
  ASSERT_TRUE(steps[0].skipped);
  EXPECT_EQ(steps[0].loss_scale, 1099511627776.0);
  size_t first_taken = 0;
  while (first_taken < steps.size() && steps[first_taken].skipped) {
    // Each overflow halves the scale for the next step.
    if (first_taken + 1 < steps.size()) {
      EXPECT_EQ(steps[first_taken + 1].loss_scale,
                steps[first_taken].loss_scale / 2);
    }
    ++first_taken;
  }
  ASSERT_LT(first_taken, steps.size()) << "every step overflowed";
  EXPECT_GT(first_taken, 3u);
  // Skipped steps did not advance the schedule: the first step taken gets
  // the first warm-up rate, lr / 2.
  EXPECT_DOUBLE_EQ(steps[first_taken].lr, 1.5e-3);
  EXPECT_TRUE(std::isfinite(steps[first_taken].grad_norm));
  EXPECT_TRUE(std::isnan(steps[0].grad_norm));
  // Both ranks made the same decisions.
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(results[1]->steps[i].skipped, steps[i].skipped) << i;
  }
}

TEST(TrainerTest, ProgressStyles) {
  // kStatusLines: every step a "\r" status line, log_interval steps plain.
  TrainConfig config = SmallConfig(TestDir("progress"));
  CHECK_OK(ApplyOverrides({"metrics.log_interval=4", "checkpoint.interval=0",
                           "validation.interval=0", "training.steps=5"},
                          &config));
  for (auto style :
       {TrainerEnv::Progress::kStatusLines, TrainerEnv::Progress::kLines}) {
    const std::string path =
        absl::StrCat(std::getenv("TEST_TMPDIR"), "/progress.txt");
    std::FILE* out = std::fopen(path.c_str(), "w");
    ASSERT_NE(out, nullptr);
    InMemoryStore store;
    TrainerEnv env;
    env.group_factory = GlooGroupFactory(&store);
    env.out = out;
    env.progress = style;
    CHECK_OK(RemoveTree(config.checkpoint().folder()));
    ASSERT_TRUE(CreateAndRun(config, env).ok());
    std::fclose(out);
    std::ifstream in(path);
    std::string line;
    int status = 0, plain = 0;
    while (std::getline(in, line)) {
      if (absl::StartsWith(line, "\rstep ")) ++status;
      if (absl::StartsWith(line, "step ")) ++plain;
    }
    // Steps 1 (first), 4 (interval) and 5 (last) are plain lines.
    EXPECT_EQ(plain, 3);
    EXPECT_EQ(status, style == TrainerEnv::Progress::kStatusLines ? 2 : 0);
  }
}

std::vector<double> Lrs(const TrainResult& r) {
  std::vector<double> lrs;
  for (const StepLog& s : r.steps) lrs.push_back(s.lr);
  return lrs;
}

// The loop's parts called one by one, in Run's order, give Run's run
// bitwise; the parts refuse what makes no sense (logging before a step,
// stepping past the end) and do nothing when nothing is due.
TEST(TrainerTest, StepByStepMatchesRunBitwise) {
  const std::string whole = TestDir("whole"), parts = TestDir("parts");
  auto want = RunRanks(SmallConfig(whole), 2);
  ASSERT_TRUE(want[0].ok()) << want[0].status();
  auto got =
      OnRanks(2, 0, [&](const TrainerEnv& env) -> absl::StatusOr<TrainResult> {
        FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                               Trainer::Create(SmallConfig(parts), env));
        EXPECT_EQ(trainer->step(), 0);
        EXPECT_EQ(trainer->LogStep().code(),
                  absl::StatusCode::kFailedPrecondition);
        EXPECT_FALSE(trainer->ValidationDue());
        FSDPP_RETURN_IF_ERROR(trainer->MaybeSave());  // Nothing to save yet.
        EXPECT_TRUE(trainer->result().last_checkpoint.empty());
        for (int64_t step = 1; step <= 8; ++step) {
          EXPECT_FALSE(trainer->done());
          FSDPP_RETURN_IF_ERROR(trainer->TrainStep());
          EXPECT_EQ(trainer->step(), step);
          EXPECT_EQ(trainer->result().steps.size(), static_cast<size_t>(step));
          FSDPP_RETURN_IF_ERROR(trainer->LogStep());
          EXPECT_EQ(trainer->ValidationDue(), step % 4 == 0) << step;
          if (trainer->ValidationDue())
            FSDPP_RETURN_IF_ERROR(trainer->Validate());
          FSDPP_RETURN_IF_ERROR(trainer->MaybeSave());
          EXPECT_EQ(
              trainer->result().last_checkpoint,
              step < 4 ? "" : absl::StrCat(parts, "/ckpt/step-", step / 4 * 4))
              << step;
          FSDPP_RETURN_IF_ERROR(trainer->MaybeWriteTrace());
        }
        EXPECT_TRUE(trainer->done());
        EXPECT_EQ(trainer->TrainStep().code(),
                  absl::StatusCode::kFailedPrecondition);
        FSDPP_RETURN_IF_ERROR(trainer->Summarize());
        return trainer->result();
      });
  for (auto& r : got) ASSERT_TRUE(r.ok()) << r.status();
  const TrainResult& a = *want[0];
  const TrainResult& b = *got[0];
  EXPECT_EQ(b.start_step, a.start_step);
  EXPECT_EQ(b.end_step, a.end_step);
  ASSERT_EQ(Losses(b).size(), 8u);
  EXPECT_EQ(Losses(b), Losses(a));  // bitwise
  EXPECT_EQ(Losses(*got[1]), Losses(b));
  EXPECT_EQ(Lrs(b), Lrs(a));
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(b.steps[i].grad_norm, a.steps[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_EQ(b.validation, a.validation);  // bitwise
  EXPECT_EQ(b.unigram_loss, a.unigram_loss);
  EXPECT_EQ(b.peak_tflops_per_rank, a.peak_tflops_per_rank);
  EXPECT_GT(b.tokens_per_s, 0);
  EXPECT_NEAR(b.mfu, b.tflops_per_rank, 1e-12);  // peak 1 TFLOP/s
  auto checkpoints = ListCheckpoints(parts + "/ckpt");
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  ASSERT_EQ(checkpoints->size(), 2u);
  EXPECT_EQ((*checkpoints)[0].first, 4);
  EXPECT_EQ((*checkpoints)[1].first, 8);
  // The step-by-step run's checkpoint resumes like Run's: nothing left.
  auto again = RunRanks(SmallConfig(parts), 2);
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->start_step, 8);
  EXPECT_TRUE(again[0]->steps.empty());
}

// metrics.profile_steps: rank 0's op table over steps 2-3 (after the one
// warm-up step), as "profile" records whose self times add up to
// the profiled steps' time; the losses are those of an unprofiled run.
TEST(TrainerTest, ProfileStepsLogsAnOpTableThatCoversTheStep) {
  const std::string dir = TestDir("profile");
  TrainConfig config = SmallConfig(dir);
  CHECK_OK(ApplyOverrides(
      {"checkpoint.interval=0", "checkpoint.resume=false",
       "validation.interval=0", "training.steps=5", "metrics.profile_steps=2"},
      &config));
  auto profiled = RunRanks(config, 2);
  for (auto& r : profiled) ASSERT_TRUE(r.ok()) << r.status();
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  double share = 0, matmul_calls = 0, matmul_share = 0;
  int rows = 0, steps_field = 0;
  bool comm_wait = false, fsdp = false;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "{\"kind\":\"profile\"")) continue;
    ++rows;
    auto field = [&](absl::string_view key) {
      const size_t at = line.find(absl::StrCat("\"", key, "\":"));
      EXPECT_NE(at, std::string::npos) << key << " in " << line;
      return std::atof(line.c_str() + at + key.size() + 3);
    };
    share += field("share_of_step");
    steps_field = static_cast<int>(field("steps"));
    if (absl::StrContains(line, "\"op\":\"Matmul\"")) {
      matmul_calls = field("calls_per_step");
      matmul_share = field("share_of_step");
    }
    comm_wait |= absl::StrContains(line, "\"category\":\"comm_wait\"");
    fsdp |= absl::StrContains(line, "\"op\":\"fsdp copy-in\"");
  }
  EXPECT_GT(rows, 10);
  EXPECT_EQ(steps_field, 2);
  // gpt2_debug (fused attention): per micro-batch (2 a step per rank) 2
  // blocks x 4 linears + the head forward, twice that backward.
  EXPECT_EQ(matmul_calls, 2 * 3 * (2 * 4 + 1));
  EXPECT_GT(matmul_share, 0.0);
  EXPECT_TRUE(comm_wait);
  EXPECT_TRUE(fsdp);
  // The spans cover the step: the rest is the step's bookkeeping between
  // TrainStep's clock and its outermost span.
  EXPECT_GT(share, 0.95);
  EXPECT_LE(share, 1.0 + 1e-9);
  config.mutable_metrics()->set_profile_steps(0);
  config.mutable_metrics()->set_jsonl_path("");
  auto plain = RunRanks(config, 2);
  ASSERT_TRUE(plain[0].ok()) << plain[0].status();
  EXPECT_EQ(Losses(*plain[0]), Losses(*profiled[0]));
}

TEST(TrainerTest, InvalidConfigFailsBeforeAnythingRuns) {
  TrainConfig config = SmallConfig(TestDir("invalid"));
  CHECK_OK(ApplyOverrides({"training.global_batch=7"}, &config));
  auto results = RunRanks(config, 2);
  ASSERT_FALSE(results[0].ok());
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StrContains(results[0].status().message(), "training.global_batch"))
      << results[0].status();
}

// training.device must be the rank's device: a "cuda" run given the CPU
// (the tests' thread ranks) is refused before anything is built.
// A mixture of experts routes on the host: on CUDA the trainer refuses it
// before anything runs (the planner still plans it for a GPU).
TEST(TrainerTest, MixtureOfExpertsOnCudaIsRefusedBeforeAnythingRuns) {
  const std::string dir = TestDir("moe_cuda");
  TrainConfig config = WithOverrides(
      SmallConfig(dir), {"model.name=moe_debug", "training.device=cuda"});
  TrainerEnv env;
  env.world_size = 1;
  const absl::Status status = Trainer::Create(config, env).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "runs on the CPU only"))
      << status;
  EXPECT_FALSE(PathExists(dir + "/metrics.jsonl"));
}

TEST(TrainerTest, TheConfigsDeviceMustBeTheRanks) {
  TrainConfig config = SmallConfig(TestDir("device"));
  CHECK_OK(ApplyOverrides({"training.device=cuda"}, &config));
  auto results = RunRanks(config, 1);
  ASSERT_FALSE(results[0].ok());
  EXPECT_EQ(results[0].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(results[0].status().message(),
                                "training.device is cuda but this rank was "
                                "given cpu"))
      << results[0].status();
}

// The plan before anything is allocated or written: a run over its memory
// budget fails on every rank naming the largest part and what would fit;
// training.skip_memory_check runs it anyway, and the header says so.
TEST(TrainerTest, OverBudgetRunIsRefusedBeforeAnythingIsWritten) {
  const std::string dir = TestDir("over_budget");
  TrainConfig config = SmallConfig(dir);
  // gpt2_debug at 2 ranks needs a few MiB; 1 MiB is not enough (the
  // budget covers the 256 MiB of process overhead too, so any small
  // budget is over).
  CHECK_OK(ApplyOverrides({"training.max_memory_gib=0.001"}, &config));
  auto results = RunRanks(config, 2);
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
    const std::string message(r.status().message());
    EXPECT_TRUE(absl::StrContains(message, "does not fit")) << message;
    EXPECT_TRUE(absl::StrContains(message, "the largest part is")) << message;
    EXPECT_TRUE(absl::StrContains(message, "training.skip_memory_check"))
        << message;
  }
  EXPECT_FALSE(PathExists(dir + "/ckpt"));
  EXPECT_FALSE(PathExists(dir + "/metrics.jsonl"));

  CHECK_OK(ApplyOverrides({"training.skip_memory_check=true",
                           "training.steps=2", "checkpoint.interval=0"},
                          &config));
  testing::internal::CaptureStdout();
  results = RunRanks(config, 2);
  const std::string out = testing::internal::GetCapturedStdout();
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(absl::StrContains(out, "DOES NOT FIT, running anyway")) << out;
  // The measured peak is printed next to the planned one.
  EXPECT_TRUE(absl::StrContains(out, "planned ")) << out;
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
