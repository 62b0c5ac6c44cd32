// HF model directories: export -> import round trips bitwise (one file and
// sharded), an independent reader (testdata/hf_dir_check.py: the directory
// read by hand, hyperparameters from config.json, a float64 PyTorch model)
// sees the same tensors and the same loss, and every broken directory or
// mismatching config.json gets a clear error with nothing loaded.
#include "models/hf_directory.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "core/device.h"
#include "core/dtype.h"
#include "formats/file_util.h"
#include "formats/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/torch_reference.h"
#include "models/transformer.h"
#include "nn/module.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
  EXPECT_TRUE(RemoveTree(path).ok());
  return path;
}

std::unique_ptr<Transformer> Model(const std::string& name, uint64_t seed) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(name);
  EXPECT_TRUE(c.ok()) << c.status();
  absl::StatusOr<std::unique_ptr<Transformer>> m = Transformer::Create(*c);
  EXPECT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->ToEmpty(Device::Cpu()).ok());
  if (seed != 0) {
    EXPECT_TRUE((*m)->InitWeights(seed).ok());
  }
  return std::move(*m);
}

// Every parameter of `a` and `b` bitwise equal.
void ExpectSameParameters(const Transformer& a, const Transformer& b) {
  const auto pa = a.NamedParameters();
  const auto pb = b.NamedParameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    SCOPED_TRACE(pa[i].first);
    ASSERT_EQ(pa[i].first, pb[i].first);
    const Tensor& x = pa[i].second->data;
    const Tensor& y = pb[i].second->data;
    ASSERT_EQ(x.shape(), y.shape());
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_TRUE(testing_util::BitwiseEqual(x, y));
  }
}

// Exports `model` as `dir` with shards of at most `max_shard_bytes`.
std::vector<std::string> Export(const Transformer& model,
                                const std::string& dir,
                                uint64_t max_shard_bytes) {
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> tensors =
      ExportHfTensors(model);
  EXPECT_TRUE(tensors.ok()) << tensors.status();
  HfWriteOptions options;
  options.max_shard_bytes = max_shard_bytes;
  absl::StatusOr<std::vector<std::string>> files =
      WriteHfDirectory(dir, model.config(), *tensors, options);
  EXPECT_TRUE(files.ok()) << files.status();
  return files.ok() ? *files : std::vector<std::string>{};
}

class HfDirectoryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfDirectoryTest, ShardedRoundTripIsBitwise) {
  std::unique_ptr<Transformer> model = Model(GetParam(), 7);
  const std::string dir = TempDir(GetParam() + "_sharded");
  // About a third of the model per shard.
  const std::vector<std::string> files =
      Export(*model, dir, model->config().dim * model->config().dim * 4 * 3);
  ASSERT_GE(files.size(), 4u);
  EXPECT_EQ(files.front(), "config.json");
  EXPECT_EQ(files.back(), "model.safetensors.index.json");
  EXPECT_EQ(files[1], absl::StrFormat("model-00001-of-%05d.safetensors",
                                      files.size() - 2));

  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->files().size(), files.size() - 2);
  std::unique_ptr<Transformer> loaded = Model(GetParam(), 0);
  const absl::Status imported = ImportHfDirectory(**opened, loaded.get());
  ASSERT_TRUE(imported.ok()) << imported;
  ExpectSameParameters(*model, *loaded);
}

TEST_P(HfDirectoryTest, OneFileRoundTripIsBitwise) {
  std::unique_ptr<Transformer> model = Model(GetParam(), 8);
  const std::string dir = TempDir(GetParam() + "_single");
  // A trailing slash names the same folder.
  EXPECT_THAT(Export(*model, dir + "/", uint64_t{1} << 40),
              ElementsAre("config.json", "model.safetensors"));
  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<Transformer> loaded = Model(GetParam(), 0);
  ASSERT_TRUE(ImportHfDirectory(**opened, loaded.get()).ok());
  ExpectSameParameters(*model, *loaded);
}

TEST_P(HfDirectoryTest, IndependentReaderSeesTheSameModel) {
  const std::optional<std::string> missing = TorchMissing();
  if (missing.has_value()) {
    if (RequireTorch()) FAIL() << *missing << " [FSDPP_REQUIRE_TORCH is set]";
    GTEST_SKIP() << *missing;
  }
  std::unique_ptr<Transformer> model = Model(GetParam(), 9);
  const std::string dir = TempDir(GetParam() + "_checked");
  Export(*model, dir, model->config().dim * model->config().dim * 4 * 3);
  const std::string reference = dir + "_reference.safetensors";
  ASSERT_TRUE(ExportSafetensors(*model, reference).ok());

  const int64_t b = 2, t = 16;
  std::vector<int64_t> ids(b * t), targets(b * t);
  for (int64_t i = 0; i < b * t; ++i) {
    ids[i] = (i * 7919 + 13) % model->config().vocab_size;
  }
  for (int64_t i = 0; i < b * t; ++i) {
    targets[i] = i % t == t - 1 ? -100 : ids[i + 1];
  }
  const Tensor ids_t = *Tensor::FromInts({b, t}, ids, DType::kI64);
  const Tensor targets_t = *Tensor::FromInts({b, t}, targets, DType::kI64);
  const std::string batch = dir + "_batch.safetensors";
  ASSERT_TRUE(
      WriteSafetensors(batch, {{"ids", ids_t}, {"targets", targets_t}}).ok());
  absl::StatusOr<float> loss = model->ForwardLoss(ids_t, targets_t);
  ASSERT_TRUE(loss.ok()) << loss.status();

  const auto [status, output] = RunCommand(absl::StrFormat(
      "/usr/bin/python3 models/testdata/hf_dir_check.py '%s' '%s' '%s' %.9g",
      dir, reference, batch, *loss));
  std::cout << "=== " << GetParam() << " ===\n" << output << std::flush;
  EXPECT_EQ(status, 0) << output;
}

// A pipeline stage's part plans only its own tensors (the last stage of a
// tied model: its copy of the embedding too), while the directory must
// still hold the whole model's: one missing from another stage is refused.
TEST_P(HfDirectoryTest, APipelinePartPlansItsOwnTensors) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(GetParam());
  ASSERT_TRUE(c.ok());
  absl::StatusOr<std::unique_ptr<Transformer>> whole = Transformer::Create(*c);
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE((*whole)->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE((*whole)->InitWeights(3).ok());
  const std::string dir = TempDir(GetParam() + "_part");
  Export(**whole, dir, uint64_t{1} << 40);
  TransformerOptions last;
  last.first_block = 1;
  last.embedding = false;
  absl::StatusOr<std::unique_ptr<Transformer>> part =
      Transformer::Create(*c, last);
  ASSERT_TRUE(part.ok());
  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  absl::StatusOr<std::vector<HfImportItem>> items =
      PlanHfImport(**opened, **part);
  ASSERT_TRUE(items.ok()) << items.status();
  std::set<std::string> planned, held;
  for (const HfImportItem& item : *items) planned.insert(item.entry.ours);
  for (const auto& [name, p] : (*part)->NamedParameters()) held.insert(name);
  EXPECT_EQ(planned, held);
  EXPECT_LT(planned.size(), (*whole)->NamedParameters().size());

  // The directory without block 0's tensors: refused by the part too.
  auto tensors = ExportHfTensors(**whole);
  ASSERT_TRUE(tensors.ok());
  std::vector<std::pair<std::string, Tensor>> without;
  for (auto& [name, t] : *tensors) {
    if (absl::StrContains(name, ".0.")) continue;
    without.emplace_back(name, t);
  }
  const std::string cut = TempDir(GetParam() + "_part_cut");
  ASSERT_TRUE(WriteHfDirectory(cut, *c, without, {}).ok());
  opened = HfDirectory::Open(cut);
  ASSERT_TRUE(opened.ok()) << opened.status();
  items = PlanHfImport(**opened, **part);
  EXPECT_EQ(items.status().code(), absl::StatusCode::kNotFound)
      << items.status();
}

// Every box ReadHfBox reads equals that box of the model's own parameter:
// thirds of dim 0 (as FSDP over 3 ranks cuts them), a column window, rows
// of the padded vocabulary past the file's (zeros), empty boxes.
TEST_P(HfDirectoryTest, ReadHfBoxReadsExactlyTheBox) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(GetParam());
  ASSERT_TRUE(c.ok());
  c->vocab_size = 500;  // Padded to 512.
  c->vocab_pad_multiple = 64;
  absl::StatusOr<std::unique_ptr<Transformer>> made = Transformer::Create(*c);
  ASSERT_TRUE(made.ok());
  Transformer& model = **made;
  ASSERT_TRUE(model.ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(model.InitWeights(21).ok());
  const std::string dir = TempDir(GetParam() + "_boxes");
  Export(model, dir, uint64_t{1} << 40);
  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  absl::StatusOr<std::vector<HfImportItem>> items =
      PlanHfImport(**opened, model);
  ASSERT_TRUE(items.ok()) << items.status();
  std::map<std::string, Parameter*> params;
  for (const auto& [name, p] : model.NamedParameters()) params[name] = p;
  int boxes = 0;
  for (const HfImportItem& item : *items) {
    SCOPED_TRACE(item.entry.ours);
    Tensor full = params.at(item.entry.ours)->data;
    if (item.entry.expert >= 0) {  // one expert of a stacked parameter
      absl::StatusOr<Tensor> one = full.Narrow(item.entry.expert, 1);
      ASSERT_TRUE(one.ok());
      const Shape rest(full.shape().begin() + 1, full.shape().end());
      absl::StatusOr<Tensor> flat = one->Reshape(rest);
      ASSERT_TRUE(flat.ok());
      full = *flat;
    }
    const Shape shape = full.shape();
    std::vector<Box> cases;
    const int64_t third = (shape[0] + 2) / 3;
    for (int64_t r0 = 0; r0 < shape[0]; r0 += third) {
      Box b;
      b.offset = Shape(shape.size(), 0);
      b.shape = shape;
      b.offset[0] = r0;
      b.shape[0] = std::min(third, shape[0] - r0);
      cases.push_back(b);
    }
    Box empty = cases[0];
    empty.shape[0] = 0;
    cases.push_back(empty);
    if (shape.size() == 2) {
      Box window;
      window.offset = {shape[0] - 5, 3};
      window.shape = {5, shape[1] - 7};
      cases.push_back(window);
    }
    for (const Box& box : cases) {
      absl::StatusOr<Tensor> got = ReadHfBox(item, shape, box);
      ASSERT_TRUE(got.ok()) << got.status();
      absl::StatusOr<Tensor> want =
          Tensor::Empty(box.shape, full.dtype(), Device::Cpu());
      ASSERT_TRUE(want.ok());
      ASSERT_TRUE(
          CopyBox(full, box.offset, &*want, Shape(shape.size(), 0), box.shape)
              .ok());
      // The padded vocabulary's rows are not in the file: zeros.
      if (item.entry.vocab_rows) {
        const int64_t row_bytes = box.shape[1] * 4;
        for (int64_t r = 0; r < box.shape[0]; ++r) {
          if (box.offset[0] + r >= c->vocab_size) {
            std::memset(static_cast<char*>(want->raw_data()) + r * row_bytes, 0,
                        row_bytes);
          }
        }
      }
      ASSERT_EQ(got->shape(), want->shape());
      EXPECT_TRUE(testing_util::BitwiseEqual(*got, *want))
          << ShapeToString(box.shape) << "@" << ShapeToString(box.offset);
      ++boxes;
    }
  }
  EXPECT_GT(boxes, 50);
  // A box outside the parameter is refused.
  Box outside;
  outside.offset = {1};
  outside.shape = {64};
  EXPECT_THAT(ReadHfBox((*items)[0], {64}, outside).status().message(),
              HasSubstr("is outside [64]"));
}

INSTANTIATE_TEST_SUITE_P(Models, HfDirectoryTest,
                         ::testing::Values("gpt2_debug", "llama_debug",
                                           "olmoe_debug"));

// A sharded GPT-2 debug export to break in the error tests: its directory
// and its shard files (at least 3).
std::pair<std::string, std::vector<std::string>> ShardedExport(
    const std::string& name) {
  std::unique_ptr<Transformer> model = Model("gpt2_debug", 3);
  const std::string dir = TempDir(name);
  std::vector<std::string> files = Export(*model, dir, 64 * 64 * 4 * 3);
  EXPECT_GE(files.size(), 5u);
  // Without config.json and the index.
  return {dir, std::vector<std::string>(files.begin() + 1, files.end() - 1)};
}

std::string Read(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

void Write(const std::string& path, const std::string& text) {
  ASSERT_TRUE(WriteFileAtomically(path, text).ok());
}

TEST(HfDirectoryErrorsTest, ExportRefusesANonEmptyDestination) {
  std::unique_ptr<Transformer> model = Model("gpt2_debug", 3);
  const std::string dir = TempDir("occupied");
  ASSERT_TRUE(MakeDirs(dir).ok());
  Write(dir + "/notes.txt", "keep me");
  auto tensors = ExportHfTensors(*model);
  ASSERT_TRUE(tensors.ok());
  absl::StatusOr<std::vector<std::string>> files =
      WriteHfDirectory(dir, model->config(), *tensors);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(files.status().message(), HasSubstr("not empty"));
  EXPECT_EQ(Read(dir + "/notes.txt"), "keep me");
  EXPECT_FALSE(IsRegularFile(dir + "/config.json"));

  // Extra files may not take the directory's own names.
  HfWriteOptions options;
  options.extra_files = {{"config.json", "{}"}};
  files =
      WriteHfDirectory(TempDir("extra"), model->config(), *tensors, options);
  EXPECT_THAT(files.status().message(),
              HasSubstr("\"config.json\" is not a plain name of its own"));
}

TEST(HfDirectoryErrorsTest, BrokenDirectoriesAreNamed) {
  {
    const auto [dir, shards] = ShardedExport("missing_shard");
    ASSERT_EQ(std::remove((dir + "/" + shards[1]).c_str()), 0);
    absl::StatusOr<std::unique_ptr<HfDirectory>> opened =
        HfDirectory::Open(dir);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(opened.status().message(),
                HasSubstr(absl::StrCat("names shard file ", shards[1],
                                       ", which is missing")));
  }
  {
    const auto [dir, shards] = ShardedExport("truncated_shard");
    const std::string shard = dir + "/" + shards[2];
    const std::string bytes = Read(shard);
    Write(shard, bytes.substr(0, bytes.size() - 100));
    absl::StatusOr<std::unique_ptr<HfDirectory>> opened =
        HfDirectory::Open(dir);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(opened.status().message(), HasSubstr(shard));
  }
  {
    const auto [dir, shards] = ShardedExport("absent_tensor");
    const std::string index = dir + "/model.safetensors.index.json";
    Write(index,
          absl::StrReplaceAll(
              Read(index), {{"\"weight_map\": {",
                             absl::StrCat("\"weight_map\": {\n    "
                                          "\"transformer.h.9.ln_1.weight\": \"",
                                          shards[0], "\",")}}));
    absl::StatusOr<std::unique_ptr<HfDirectory>> opened =
        HfDirectory::Open(dir);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(opened.status().message(),
                HasSubstr(absl::StrCat(
                    "puts tensor \"transformer.h.9.ln_1.weight\" in ",
                    shards[0], ", which does not hold it")));
  }
  {
    const std::string dir = TempDir("empty_dir");
    ASSERT_TRUE(MakeDirs(dir).ok());
    EXPECT_THAT(HfDirectory::Open(dir).status().message(),
                HasSubstr("has neither model.safetensors.index.json nor "
                          "model.safetensors"));
  }
}

TEST(HfDirectoryErrorsTest, ConfigMismatchesAreListedAndNothingIsLoaded) {
  const std::string dir = ShardedExport("config_mismatch").first;
  const std::string config = dir + "/config.json";
  Write(config,
        absl::StrReplaceAll(Read(config),
                            {{"\"n_head\": 4", "\"n_head\": 8"},
                             {"\"vocab_size\": 512", "\"vocab_size\": 50257"},
                             {"\"tie_word_embeddings\": true",
                              "\"tie_word_embeddings\": false"}}));
  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<Transformer> target = Model("gpt2_debug", 5);
  std::unique_ptr<Transformer> before = Model("gpt2_debug", 5);
  const absl::Status s = ImportHfDirectory(**opened, target.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("config.json does not match the model"));
  EXPECT_THAT(s.message(), HasSubstr("vocab_size is 50257, the model has 512"));
  EXPECT_THAT(s.message(), HasSubstr("n_head is 8, the model has 4"));
  EXPECT_THAT(s.message(),
              HasSubstr("tie_word_embeddings is false, the model has true"));
  ExpectSameParameters(*before, *target);
}

TEST(HfDirectoryErrorsTest, LlamaConfigFieldsAreChecked) {
  absl::StatusOr<TransformerConfig> c = ConfigByName("llama_debug");
  ASSERT_TRUE(c.ok());
  absl::StatusOr<std::string> json = HfConfigJson(*c, DType::kBF16);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, HasSubstr("\"torch_dtype\": \"bfloat16\""));
  EXPECT_TRUE(CheckHfConfig(*json, *c, "config.json").ok());
  TransformerConfig other = *c;
  other.n_kv_heads = c->kv_heads() == 1 ? 2 : 1;
  other.rope_scaling.factor = 8.0f;
  other.rope_theta = 500000.0f;
  const absl::Status s = CheckHfConfig(*json, other, "config.json");
  EXPECT_THAT(s.message(), HasSubstr("num_key_value_heads is"));
  EXPECT_THAT(s.message(),
              HasSubstr("rope_scaling is null, the model has llama3 scaling"));
  EXPECT_THAT(s.message(), HasSubstr("rope_theta is 10000, the model has"));
  EXPECT_THAT(
      CheckHfConfig("{\"model_type\": \"gpt2\"}", *c, "c.json").message(),
      HasSubstr("model_type is \"gpt2\", the model has family llama"));
  EXPECT_THAT(CheckHfConfig("[1, 2", *c, "c.json").message(),
              HasSubstr("c.json: "));
}

// The config.json files the hub serves for GPT-2 (openai-community/gpt2)
// and Llama-3.2-1B (their architecture fields) match the zoo configs, and
// what HfConfigJson writes for those configs passes its own check; the
// name mappings cover every parameter of the meta-device models.
TEST(HfDirectoryHubTest, HubConfigsMatchTheZoo) {
  const std::string gpt2 = R"({
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1,
    "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024,
    "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": null,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": true,
    "summary_type": "cls_index", "summary_use_proj": true,
    "task_specific_params": {"text-generation": {"do_sample": true,
                                                 "max_length": 50}},
    "vocab_size": 50257})";
  const std::string llama = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                     "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192,
                     "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 128256})";
  const std::string olmoe = R"({
    "architectures": ["OlmoeForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "clip_qkv": null, "eos_token_id": 50279,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": false,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 16, "num_key_value_heads": 16,
    "output_router_logits": false, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 50304})";
  for (const auto& [name, json] :
       {std::pair<std::string, std::string>{"gpt2_124m", gpt2},
        std::pair<std::string, std::string>{"llama_1b", llama},
        std::pair<std::string, std::string>{"olmoe_1b_7b", olmoe}}) {
    SCOPED_TRACE(name);
    absl::StatusOr<TransformerConfig> c = ConfigByName(name);
    ASSERT_TRUE(c.ok());
    const absl::Status hub = CheckHfConfig(json, *c, name + "/config.json");
    EXPECT_TRUE(hub.ok()) << hub;
    absl::StatusOr<std::string> ours = HfConfigJson(*c, DType::kBF16);
    ASSERT_TRUE(ours.ok()) << ours.status();
    const absl::Status own = CheckHfConfig(*ours, *c, "ours");
    EXPECT_TRUE(own.ok()) << own << "\n" << *ours;
    // Every parameter of the (meta-device) model has an HF name.
    absl::StatusOr<std::unique_ptr<Transformer>> meta = Transformer::Create(*c);
    ASSERT_TRUE(meta.ok());
    absl::StatusOr<std::vector<HfNameEntry>> mapping = HfNameMapping(*c);
    ASSERT_TRUE(mapping.ok());
    std::set<std::string> named;
    int64_t experts = 0;
    for (const HfNameEntry& e : *mapping) {
      named.insert(e.ours);
      experts += e.expert >= 0;
    }
    EXPECT_EQ(named.size(), (*meta)->NamedParameters().size());
    // OLMoE: 16 layers x 3 stacks x 64 experts, one HF tensor each.
    EXPECT_EQ(experts, name == "olmoe_1b_7b" ? 16 * 3 * 64 : 0);
  }
  // config.json alone gives back the zoo configs.
  for (const auto& [name, json] :
       {std::pair<std::string, std::string>{"gpt2_124m", gpt2},
        std::pair<std::string, std::string>{"llama_1b", llama},
        std::pair<std::string, std::string>{"olmoe_1b_7b", olmoe}}) {
    absl::StatusOr<TransformerConfig> zoo = ConfigByName(name);
    absl::StatusOr<TransformerConfig> read =
        ConfigFromHfJson(json, name, "config.json");
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(ModelConfigJson(*read), ModelConfigJson(*zoo)) << name;
  }
  EXPECT_THAT(ConfigFromHfJson(R"({"model_type": "mistral"})", "x", "c.json")
                  .status()
                  .message(),
              HasSubstr("model_type \"mistral\" is not gpt2, llama or "
                        "olmoe"));
  EXPECT_THAT(
      ConfigFromHfJson(R"({"model_type": "gpt2", "n_embd": 8})", "x", "c.json")
          .status()
          .message(),
      HasSubstr("c.json: vocab_size is missing"));
  // One field off is named.
  absl::StatusOr<TransformerConfig> c = ConfigByName("gpt2_350m");
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(CheckHfConfig(gpt2, *c, "gpt2/config.json").message(),
              HasSubstr("n_embd is 768, the model has 1024"));
}

// The layout of the real-size models, planned on the meta device: every
// HF tensor once, total bytes = the analytic parameter count x dtype size
// (GPT-2 124M's unpadded vocabulary, Llama-3.2-1B's tied head once), one
// file under 5 GB (as the hub's model.safetensors), shards in order below.
TEST(HfDirectoryHubTest, ShardPlansOfTheRealSizes) {
  for (const auto& [name, dtype] :
       {std::pair<std::string, DType>{"gpt2_124m", DType::kF32},
        std::pair<std::string, DType>{"llama_1b", DType::kBF16}}) {
    SCOPED_TRACE(name);
    absl::StatusOr<TransformerConfig> c = ConfigByName(name);
    ASSERT_TRUE(c.ok());
    absl::StatusOr<std::unique_ptr<Transformer>> meta = Transformer::Create(*c);
    ASSERT_TRUE(meta.ok());
    std::map<std::string, Shape> ours;
    for (const auto& [pname, p] : (*meta)->NamedParameters()) {
      ours[pname] = p->shape;
    }
    absl::StatusOr<std::vector<HfNameEntry>> mapping = HfNameMapping(*c);
    ASSERT_TRUE(mapping.ok());
    std::vector<std::pair<std::string, Shape>> shapes;
    for (const HfNameEntry& e : *mapping) {
      shapes.emplace_back(e.hf, HfShape(e, ours.at(e.ours), c->vocab_size));
    }
    const uint64_t expected =
        static_cast<uint64_t>(NumParameters(*c)) * DTypeSize(dtype);
    HfShardPlan one = PlanHfShards(shapes, dtype, uint64_t{5} << 30);
    ASSERT_EQ(one.files.size(), 1u);
    EXPECT_EQ(one.files[0].first, "model.safetensors");
    EXPECT_EQ(one.files[0].second.size(), shapes.size());
    EXPECT_EQ(one.total_bytes, expected);
    HfShardPlan cut = PlanHfShards(shapes, dtype, expected / 3 + 1);
    ASSERT_GE(cut.files.size(), 3u);
    std::set<std::string> seen;
    for (size_t k = 0; k < cut.files.size(); ++k) {
      EXPECT_EQ(cut.files[k].first,
                absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1,
                                cut.files.size()));
      for (const std::string& t : cut.files[k].second) {
        EXPECT_TRUE(seen.insert(t).second) << t;
      }
    }
    EXPECT_EQ(seen.size(), shapes.size());
    EXPECT_EQ(cut.total_bytes, expected);
  }
}

TEST(HfDirectoryErrorsTest, MissingTensorLeavesTheModelUntouched) {
  // A one-file export without one tensor: the import refuses before
  // writing any parameter.
  std::unique_ptr<Transformer> model = Model("gpt2_debug", 3);
  auto tensors = ExportHfTensors(*model);
  ASSERT_TRUE(tensors.ok());
  tensors->erase(tensors->begin() + 3);
  const std::string dir = TempDir("missing_tensor");
  ASSERT_TRUE(WriteHfDirectory(dir, model->config(), *tensors).ok());
  absl::StatusOr<std::unique_ptr<HfDirectory>> opened = HfDirectory::Open(dir);
  ASSERT_TRUE(opened.ok());
  std::unique_ptr<Transformer> target = Model("gpt2_debug", 5);
  std::unique_ptr<Transformer> before = Model("gpt2_debug", 5);
  const absl::Status s = ImportHfDirectory(**opened, target.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("missing tensors: "));
  ExpectSameParameters(*before, *target);
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
