// Tests of the ckpt tool: inspect's listing (keys, kinds, dtypes, shapes,
// chunk layout, files, totals) and --verify on intact and corrupted
// checkpoints, the checkpoint -> safetensors -> checkpoint round trip (bit
// for bit, byte values included), and the real `ckpt` binary's command line
// (found at tools/ckpt/ckpt relative to the runfiles working directory).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/metadata.h"
#include "checkpoint/test_checkpoints.h"
#include "checkpoint/training/training_state.h"
#include "comm/store.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "formats/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/torch_reference.h"
#include "models/transformer.h"
#include "tools/ckpt/ckpt_lib.h"

namespace fsdpp {
namespace ckpt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::BitPattern;
using testing_util::BitwiseEqual;
using testing_util::FreshDir;
using testing_util::MakeDTensor;
using testing_util::ZerosLike;

const Tensor& W() {
  static const Tensor t = BitPattern({7, 5}, DType::kF32, 1);
  return t;
}
const Tensor& B() {
  static const Tensor t = BitPattern({6}, DType::kBF16, 2);
  return t;
}

// A checkpoint saved by two ranks: w sharded, b replicated, a byte value.
std::string SaveSharded(const std::string& name) {
  const std::string root = FreshDir(name);
  InMemoryStore store;
  testing_util::RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    CHECK_OK(
        state.AddDTensor("w", MakeDTensor(W(), &mesh, {Placement::Shard(0)})));
    CHECK_OK(state.AddTensor("b", B()));
    CHECK_OK(state.AddBytes("step", std::string("\x07\x00", 2)));
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    CHECK_OK(Save(state, root, 12, options).status());
  });
  return root + "/step-12";
}

TEST(CkptTest, InspectListsLayoutAndVerifies) {
  const std::string dir = SaveSharded("inspect");
  std::ostringstream out;
  ASSERT_TRUE(Inspect(dir, /*verify=*/true, out).ok());
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("step 12, saved by 2 rank(s)"));
  EXPECT_THAT(text, HasSubstr("3 keys, 4 chunks, 154 bytes in 2 file(s)"));
  EXPECT_THAT(text, HasSubstr("w  tensor f32[7, 5]  140 bytes, 2 chunk(s)"));
  EXPECT_THAT(text, HasSubstr("[0, 0]+[4, 5] -> rank-0.data @0 +80"));
  EXPECT_THAT(text, HasSubstr("[4, 0]+[3, 5] -> rank-1.data"));
  EXPECT_THAT(text, HasSubstr("b  tensor bf16[6]"));
  EXPECT_THAT(text, HasSubstr("step  bytes u8[2]"));
  EXPECT_THAT(
      text,
      HasSubstr(
          "verify: OK (4 chunks, 154 bytes checked, every float finite)"));

  // A flipped byte is found by --verify, naming the key.
  const CheckpointMetadata m = *ReadMetadata(dir);
  const ChunkMetadata& chunk = m.entries.at("w").chunks[1];
  const std::string file = absl::StrCat(dir, "/", m.files[chunk.file]);
  std::string bytes = *ReadFileToString(file);
  bytes[chunk.byte_offset + 3] ^= 1;
  ASSERT_TRUE(RemoveTree(file).ok());
  ASSERT_TRUE(WriteFileDurably(file, bytes).ok());
  std::ostringstream damaged;
  EXPECT_TRUE(Inspect(dir, /*verify=*/false, damaged).ok());
  const absl::Status status = Inspect(dir, /*verify=*/true, damaged);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("key 'w'"));
  EXPECT_THAT(damaged.str(), HasSubstr("verify: FAILED"));
}

// --verify reads every float too: intact bytes holding inf or NaN are
// reported by key and count, and the command fails.
TEST(CkptTest, VerifyReportsNonFiniteValues) {
  const std::string root = FreshDir("non_finite");
  std::vector<float> v(8, 1.0f);
  v[2] = std::numeric_limits<float>::infinity();
  v[5] = std::numeric_limits<float>::quiet_NaN();
  StateDict state;
  ASSERT_TRUE(
      state.AddTensor("optim/w.exp_avg_sq", *Tensor::FromFloats({8}, v)).ok());
  ASSERT_TRUE(
      state.AddTensor("model/w", *Tensor::FromFloats({2}, {1, 2})).ok());
  ASSERT_TRUE(Save(state, root, 7).ok());
  std::ostringstream out;
  const absl::Status status = Inspect(root + "/step-7", /*verify=*/true, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(out.str(),
              HasSubstr("non-finite: optim/w.exp_avg_sq: 2 value(s) are inf "
                        "or NaN"));
  EXPECT_THAT(out.str(), Not(HasSubstr("non-finite: model/w")));
  EXPECT_THAT(out.str(), HasSubstr("verify: FAILED: 1 key(s) hold inf or NaN"));
}

TEST(CkptTest, ConvertsToSafetensorsAndBack) {
  const std::string dir = SaveSharded("convert");
  const std::string st = FreshDir("convert_out") + "/model.safetensors";
  ASSERT_TRUE(ConvertToSafetensors(dir, st).ok());
  auto file = SafetensorsFile::Open(st);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(BitwiseEqual(*(*file)->Load("w"), W()));
  EXPECT_TRUE(BitwiseEqual(*(*file)->Load("b"), B()));
  EXPECT_EQ((*file)->metadata().at("fsdpp.step"), "12");
  EXPECT_EQ((*file)->metadata().at("fsdpp.bytes"), R"(["step"])");

  const std::string root = FreshDir("convert_back");
  absl::StatusOr<std::string> back = ConvertFromSafetensors(st, root);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, root + "/step-12");
  StateDict state;
  ASSERT_TRUE(state.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
  ASSERT_TRUE(state.AddTensor("b", ZerosLike({6}, DType::kBF16)).ok());
  ASSERT_TRUE(state.AddBytes("step", "").ok());
  ASSERT_TRUE(Load(&state, *back).ok());
  EXPECT_TRUE(BitwiseEqual(state.Find("w")->tensor, W()));
  EXPECT_TRUE(BitwiseEqual(state.Find("b")->tensor, B()));
  EXPECT_EQ(*state.bytes("step"), std::string("\x07\x00", 2));
}

// Runs the real binary; returns (exit code, stdout + stderr).
std::pair<int, std::string> RunCkpt(const std::string& args) {
  FILE* p =
      ::popen(absl::StrCat("tools/ckpt/ckpt ", args, " 2>&1").c_str(), "r");
  CHECK(p != nullptr);
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), p)) > 0)
    output.append(buffer, n);
  const int status = ::pclose(p);
  return {WEXITSTATUS(status), output};
}

TEST(CkptTest, CommandLine) {
  const std::string dir = SaveSharded("cli");
  auto [code, out] = RunCkpt(absl::StrCat("inspect --verify ", dir));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("verify: OK"));

  const std::string st = FreshDir("cli_out") + "/m.safetensors";
  std::tie(code, out) = RunCkpt(absl::StrCat("convert ", dir, " ", st));
  EXPECT_EQ(code, 0) << out;
  const std::string root = FreshDir("cli_back");
  std::tie(code, out) =
      RunCkpt(absl::StrCat("convert ", st, " ", root, " --step=3"));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(root + "/step-3"));

  std::tie(code, out) = RunCkpt(absl::StrCat("inspect ", root, "/step-99"));
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, HasSubstr("metadata.pb"));
  std::tie(code, out) = RunCkpt("frobnicate");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("usage: ckpt inspect"));
  // Flags: --help lists each with its default; a flag of the other command,
  // an unknown flag and a bad value are usage errors.
  std::tie(code, out) = RunCkpt("--help");
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("--verify (default: false)"));
  EXPECT_THAT(out, HasSubstr("--step (default: -1)"));
  std::tie(code, out) = RunCkpt(absl::StrCat("inspect --step=3 ", dir));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("--step applies to convert"));
  std::tie(code, out) = RunCkpt(absl::StrCat("inspect --verfiy ", dir));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("unknown flag --verfiy"));
  std::tie(code, out) = RunCkpt(absl::StrCat("convert ", st, " x --step=x"));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("bad value \"x\" for --step"));
}

// A gpt2_debug model's parameters saved by two ranks (sharded on dim 0),
// with (or, as older checkpoints, without) the model config record.
// `frozen`: the parameters left out, referenced as the trainer does.
std::string SaveModel(const std::string& name, const models::Transformer& m,
                      bool record_config, const std::string& train_config = "",
                      const FrozenRecord& frozen = {},
                      const std::string& lora_json = "") {
  const std::string root = FreshDir(name);
  InMemoryStore store;
  testing_util::RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    StateDict state;
    if (!frozen.empty()) {
      CHECK_OK(state.AddBytes(kFrozenKey, frozen.ToString()));
    }
    if (!lora_json.empty()) {
      CHECK_OK(state.AddBytes(models::kLoraKey, lora_json));
    }
    for (const auto& [pname, p] : m.NamedParameters()) {
      if (std::find(frozen.names.begin(), frozen.names.end(), pname) !=
          frozen.names.end()) {
        continue;
      }
      CHECK_OK(
          state.AddDTensor("model/" + pname,
                           MakeDTensor(p->data, &mesh, {Placement::Shard(0)})));
    }
    if (record_config) {
      CHECK_OK(state.AddBytes(models::kModelConfigKey,
                              models::ModelConfigJson(m.config())));
    }
    if (!train_config.empty()) {
      CHECK_OK(state.AddBytes("train/config", train_config));
    }
    SaveOptions options;
    options.mesh = &mesh;
    options.store = &store;
    CHECK_OK(Save(state, root, 5, options).status());
  });
  return root + "/step-5";
}

std::unique_ptr<models::Transformer> DebugModel(uint64_t seed) {
  absl::StatusOr<models::TransformerConfig> c =
      models::ConfigByName("gpt2_debug");
  CHECK_OK(c.status());
  absl::StatusOr<std::unique_ptr<models::Transformer>> m =
      models::Transformer::Create(*c);
  CHECK_OK(m.status());
  CHECK_OK((*m)->ToEmpty(Device::Cpu()));
  if (seed != 0) CHECK_OK((*m)->InitWeights(seed));
  return std::move(*m);
}

TEST(CkptTest, ExportsAShardedCheckpointAsAnHfDirectory) {
  std::unique_ptr<models::Transformer> model = DebugModel(11);
  const std::string dir = SaveModel("export_src", *model, true);
  const std::string out = FreshDir("export_out") + "/hf";
  HfExportOptions options;
  options.max_shard_bytes = 200 << 10;
  absl::StatusOr<std::vector<std::string>> files = ExportHf(dir, out, options);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(files->back(), "model.safetensors.index.json");

  absl::StatusOr<std::unique_ptr<models::HfDirectory>> opened =
      models::HfDirectory::Open(out);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<models::Transformer> loaded = DebugModel(0);
  ASSERT_TRUE(models::ImportHfDirectory(**opened, loaded.get()).ok());
  const auto a = model->NamedParameters();
  const auto b = loaded->NamedParameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(BitwiseEqual(a[i].second->data, b[i].second->data))
        << a[i].first;
  }

  // Through the binary, in bf16.
  const std::string out16 = FreshDir("export_cli") + "/hf16";
  auto [code, text] = RunCkpt(absl::StrCat("export ", dir, " ", out16,
                                           " --format=hf "
                                           "--dtype=bf16"));
  EXPECT_EQ(code, 0) << text;
  EXPECT_THAT(text, HasSubstr("config.json, model.safetensors"));
  absl::StatusOr<std::string> config = ReadFileToString(out16 + "/config.json");
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(*config, HasSubstr("\"torch_dtype\": \"bfloat16\""));
  std::tie(code, text) =
      RunCkpt(absl::StrCat("export ", dir, " ", out16, " --format=hf"));
  EXPECT_EQ(code, 1);
  EXPECT_THAT(text, HasSubstr("exists and is not empty"));
  std::tie(code, text) = RunCkpt(absl::StrCat("export ", dir, " x"));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("export needs --format=hf"));
  std::tie(code, text) =
      RunCkpt(absl::StrCat("export ", dir, " x --format=hf --dtype=i32"));
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("--dtype=i32 is not f32, bf16 or f16"));
}

// A run that used the GPT-2 tokenizer exports its BPE files as HF's
// vocab.json and merges.txt (found through its train/config, or given).
// A checkpoint that references its frozen parameters (the trainer's with
// model.freeze) exports them from the recorded source: the seed's
// initialisation or the base model's directory (or --base_model's, when
// that moved), bitwise; the others from the checkpoint.
TEST(CkptTest, ExportTakesFrozenParametersFromTheirSource) {
  std::unique_ptr<models::Transformer> trained = DebugModel(11);
  std::unique_ptr<models::Transformer> base = DebugModel(3);
  FrozenRecord frozen;
  frozen.names = {"wte.weight", "h.0.attn.c_attn.weight", "h.1.ln_2.bias"};
  // What the export must hold: the base's frozen values, the rest trained.
  auto expect_exported = [&](const std::string& out) {
    absl::StatusOr<std::unique_ptr<models::HfDirectory>> opened =
        models::HfDirectory::Open(out);
    ASSERT_TRUE(opened.ok()) << opened.status();
    std::unique_ptr<models::Transformer> loaded = DebugModel(0);
    ASSERT_TRUE(models::ImportHfDirectory(**opened, loaded.get()).ok());
    const auto want_base = base->NamedParameters();
    const auto want_trained = trained->NamedParameters();
    const auto got = loaded->NamedParameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const bool is_frozen = std::find(frozen.names.begin(), frozen.names.end(),
                                       got[i].first) != frozen.names.end();
      const Tensor& want =
          (is_frozen ? want_base : want_trained)[i].second->data;
      EXPECT_TRUE(BitwiseEqual(want, got[i].second->data)) << got[i].first;
    }
  };
  frozen.source = "seed 3";
  const std::string seeded =
      SaveModel("export_frozen_seed", *trained, true, "", frozen);
  ASSERT_TRUE(ReadMetadata(seeded)->entries.count("model/wte.weight") == 0);
  const std::string out = FreshDir("export_frozen_seed_out") + "/hf";
  absl::StatusOr<std::vector<std::string>> files =
      ExportHf(seeded, out, HfExportOptions());
  ASSERT_TRUE(files.ok()) << files.status();
  expect_exported(out);

  // From a base model's directory, recorded; then moved.
  const std::string hf = FreshDir("export_frozen_base") + "/hf";
  ASSERT_TRUE(models::WriteHfDirectory(hf, base->config(),
                                       *models::ExportHfTensors(*base), {})
                  .ok());
  frozen.source = "hf:" + hf;
  const std::string based =
      SaveModel("export_frozen_hf", *trained, true, "", frozen);
  const std::string out_hf = FreshDir("export_frozen_hf_out") + "/hf";
  files = ExportHf(based, out_hf, HfExportOptions());
  ASSERT_TRUE(files.ok()) << files.status();
  expect_exported(out_hf);

  frozen.source = "hf:/nonexistent/base";
  const std::string moved =
      SaveModel("export_frozen_moved", *trained, true, "", frozen);
  const absl::Status missing =
      ExportHf(moved, FreshDir("export_frozen_moved_out") + "/hf",
               HfExportOptions())
          .status();
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.message()),
              HasSubstr("its frozen parameters (train/frozen)"));
  EXPECT_THAT(std::string(missing.message()), HasSubstr("/nonexistent/base"));
  const std::string out_moved = FreshDir("export_frozen_moved_ok") + "/hf";
  auto [code, text] = RunCkpt(absl::StrCat(
      "export ", moved, " ", out_moved, " --format=hf --base_model=hf:", hf));
  ASSERT_EQ(code, 0) << text;
  expect_exported(out_moved);
}

// A LoRA run's checkpoint (its adapters and their record; the base
// referenced to its seed): --format=hf merges the adapters into the base
// (the merged model's loss is the adapted one's within 1e-6), --format=peft
// writes them alone in PEFT's names and adapter_config.json.
TEST(CkptTest, ExportsALoraRunMergedOrAsAPeftAdapter) {
  const models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  models::LoraOptions lora;
  lora.rank = 2;
  lora.alpha = 6;
  lora.targets = {"c_attn", "mlp.fc"};
  std::unique_ptr<models::Transformer> adapted =
      *models::Transformer::Create(config);
  ASSERT_TRUE(models::AddLoraAdapters(adapted.get(), lora).ok());
  ASSERT_TRUE(adapted->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(adapted->InitWeights(5).ok());
  FrozenRecord frozen;
  frozen.source = "seed 5";
  for (const auto& [name, p] : adapted->NamedParameters()) {
    if (!models::IsLoraParameter(name)) {
      frozen.names.push_back(name);
      continue;
    }
    // Trained adapters: B no longer zero.
    std::vector<float> v(p->data.numel());
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = 0.01f * static_cast<float>((i * 7 + name.size()) % 13) - 0.06f;
    }
    ASSERT_TRUE(Copy(*Tensor::FromFloats(p->data.shape(), v), &p->data).ok());
  }
  const std::string dir = SaveModel("export_lora", *adapted, true, "", frozen,
                                    models::LoraJson(lora));
  ASSERT_EQ(ReadMetadata(dir)->entries.count("model/h.0.attn.c_attn.weight"),
            0u);

  // Merged: the plain model from the export computes the adapted loss.
  const std::string merged = FreshDir("export_lora_merged") + "/hf";
  absl::StatusOr<std::vector<std::string>> files =
      ExportHf(dir, merged, HfExportOptions());
  ASSERT_TRUE(files.ok()) << files.status();
  std::unique_ptr<models::Transformer> plain = DebugModel(0);
  ASSERT_TRUE(models::ImportHfDirectory(**models::HfDirectory::Open(merged),
                                        plain.get())
                  .ok());
  std::vector<int64_t> ids, targets;
  for (int i = 0; i < 2 * 16; ++i) {
    ids.push_back((i * 37 + 5) % config.vocab_size);
    targets.push_back((i * 11 + 3) % config.vocab_size);
  }
  const Tensor x = *Tensor::FromInts({2, 16}, ids);
  const Tensor y = *Tensor::FromInts({2, 16}, targets);
  const float want = *adapted->EvalLoss(x, y);
  const float got = *plain->EvalLoss(x, y);
  std::unique_ptr<models::Transformer> base = DebugModel(5);
  const float base_loss = *base->EvalLoss(x, y);
  EXPECT_NEAR(got, want, 1e-6 * want);
  EXPECT_GT(std::fabs(base_loss - want), 1e-4);  // the adapters matter

  // PEFT: the adapters alone, under PEFT's names, bitwise.
  const std::string out = FreshDir("export_lora_peft") + "/adapter";
  auto [code, text] =
      RunCkpt(absl::StrCat("export ", dir, " ", out, " --format=peft"));
  ASSERT_EQ(code, 0) << text;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> st =
      SafetensorsFile::Open(out + "/adapter_model.safetensors");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ((*st)->size(), 2u * (config.n_layers * 2));
  for (const auto& [name, p] : adapted->NamedParameters()) {
    if (!models::IsLoraParameter(name)) continue;
    std::string hf = absl::StrCat("base_model.model.transformer.", name);
    hf = absl::StrReplaceAll(hf, {{".mlp.fc.", ".mlp.c_fc."}});
    absl::StatusOr<Tensor> t = (*st)->Load(hf);
    ASSERT_TRUE(t.ok()) << hf << ": " << t.status();
    EXPECT_TRUE(BitwiseEqual(*t, p->data)) << hf;
  }
  const std::string adapter_config =
      *ReadFileToString(out + "/adapter_config.json");
  absl::StatusOr<Json> json = ParseJson(adapter_config);
  ASSERT_TRUE(json.ok()) << adapter_config;
  EXPECT_EQ(json->Find("peft_type")->string_value(), "LORA");
  EXPECT_EQ(json->Find("r")->int64_value(), 2);
  EXPECT_EQ(json->Find("lora_alpha")->number_value(), 6.0);
  EXPECT_TRUE(json->Find("fan_in_fan_out")->bool_value());
  const Json::Array& modules = json->Find("target_modules")->array_value();
  ASSERT_EQ(modules.size(), 4u);
  EXPECT_EQ(modules[0].string_value(), "transformer.h.0.attn.c_attn");
  EXPECT_EQ(modules[1].string_value(), "transformer.h.0.mlp.c_fc");

  // An independent reader (float64 PyTorch, PEFT's merge rule from the
  // PEFT export and the base's HF directory): the merged export's loss is
  // base + adapter's within 1e-6, and fsdpp's within 1e-5.
  const std::optional<std::string> missing = models::TorchMissing();
  if (missing.has_value() && models::RequireTorch()) {
    ADD_FAILURE() << *missing << " [FSDPP_REQUIRE_TORCH is set]";
  } else if (missing.has_value()) {
    std::cout << "independent PEFT check skipped: " << *missing << "\n";
  } else {
    const std::string base_hf = FreshDir("export_lora_base") + "/hf";
    ASSERT_TRUE(ExportHf(SaveModel("export_lora_base_ckpt", *base, true),
                         base_hf, HfExportOptions())
                    .ok());
    const std::string batch = FreshDir("export_lora_batch") + "/b.safetensors";
    ASSERT_TRUE(
        WriteSafetensors(
            batch,
            {{"ids", *Tensor::FromInts({2, 16}, ids, DType::kI64)},
             {"targets", *Tensor::FromInts({2, 16}, targets, DType::kI64)}})
            .ok());
    const auto [status, output] = models::RunCommand(absl::StrFormat(
        "/usr/bin/python3 tools/ckpt/testdata/peft_check.py '%s' '%s' '%s' "
        "'%s' %.9g",
        base_hf, merged, out, batch, want));
    std::cout << output << std::flush;
    EXPECT_EQ(status, 0) << output;
  }

  // A checkpoint without adapters has no PEFT export.
  std::tie(code, text) = RunCkpt(
      absl::StrCat("export ", SaveModel("export_plain", *base, true), " ",
                   FreshDir("export_plain_peft"), "/a --format=peft"));
  EXPECT_EQ(code, 1) << text;
  EXPECT_THAT(text, HasSubstr("is not a LoRA run's checkpoint"));
}

TEST(CkptTest, ExportIncludesTheGpt2TokenizerFiles) {
  const std::string bpe = FreshDir("bpe");
  ASSERT_TRUE(WriteFileAtomically(bpe + "/encoder.json", "{\"!\": 0}").ok());
  ASSERT_TRUE(
      WriteFileAtomically(bpe + "/vocab.bpe", "#version: 0.2\nh e\n").ok());
  std::unique_ptr<models::Transformer> model = DebugModel(13);
  const std::string dir = SaveModel(
      "export_bpe", *model, true,
      "model {\n  name: \"gpt2_debug\"\n}\ndata {\n  tokenizer: \"gpt2\"\n"
      "  tokenizer_dir: \"" +
          bpe + "\"\n}\n");
  const std::string out = FreshDir("export_bpe_out") + "/hf";
  absl::StatusOr<std::vector<std::string>> files =
      ExportHf(dir, out, HfExportOptions());
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ::testing::Contains("vocab.json"));
  EXPECT_THAT(*files, ::testing::Contains("merges.txt"));
  EXPECT_EQ(*ReadFileToString(out + "/vocab.json"), "{\"!\": 0}");
  EXPECT_EQ(*ReadFileToString(out + "/merges.txt"), "#version: 0.2\nh e\n");

  // A byte-tokenizer run has none; a missing directory is an error.
  const std::string bytes = SaveModel("export_bytes", *model, true,
                                      "data {\n  tokenizer: \"byte\"\n}\n");
  files =
      ExportHf(bytes, FreshDir("export_bytes_out") + "/hf", HfExportOptions());
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ::testing::Not(::testing::Contains("vocab.json")));
  HfExportOptions given;
  given.tokenizer_dir = bpe + "/nowhere";
  files = ExportHf(bytes, FreshDir("export_missing_out") + "/hf", given);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("encoder.json"));
}

// export -> import -> export: the imported checkpoint holds the same
// values (bitwise), with the model read from config.json or named.
TEST(CkptTest, ImportsAnHfDirectoryAsACheckpoint) {
  std::unique_ptr<models::Transformer> model = DebugModel(14);
  const std::string src = SaveModel("import_src", *model, true);
  const std::string hf = FreshDir("import_hf") + "/hf";
  HfExportOptions options;
  options.max_shard_bytes = 200 << 10;
  ASSERT_TRUE(ExportHf(src, hf, options).ok());
  for (const std::string& name : {std::string(), std::string("gpt2_debug")}) {
    SCOPED_TRACE(name);
    const std::string root = FreshDir("import_root" + name);
    absl::StatusOr<std::string> saved = ImportHf(hf, root, name, 7);
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(*saved, root + "/step-7");
    const std::string again = FreshDir("import_again" + name) + "/hf";
    ASSERT_TRUE(ExportHf(*saved, again, options).ok());
    absl::StatusOr<std::unique_ptr<models::HfDirectory>> opened =
        models::HfDirectory::Open(again);
    ASSERT_TRUE(opened.ok());
    std::unique_ptr<models::Transformer> loaded = DebugModel(0);
    ASSERT_TRUE(models::ImportHfDirectory(**opened, loaded.get()).ok());
    const auto a = model->NamedParameters();
    const auto b = loaded->NamedParameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(a[i].second->data, b[i].second->data))
          << a[i].first;
    }
  }
  // The wrong zoo model is named by its first mismatch.
  absl::StatusOr<std::string> wrong =
      ImportHf(hf, FreshDir("import_wrong"), "llama_debug", 0);
  EXPECT_THAT(wrong.status().message(),
              HasSubstr("model_type is \"gpt2\", the model has family llama"));
  auto [code, text] = RunCkpt(
      absl::StrCat("import ", hf, " ", FreshDir("import_cli"), " --step=3"));
  EXPECT_EQ(code, 0) << text;
  EXPECT_THAT(text, HasSubstr("/step-3"));
}

TEST(CkptTest, ExportOfACheckpointWithoutItsModelNeedsTheName) {
  std::unique_ptr<models::Transformer> model = DebugModel(12);
  const std::string dir = SaveModel("export_old", *model, false);
  HfExportOptions options;
  absl::StatusOr<std::vector<std::string>> files =
      ExportHf(dir, FreshDir("export_old_out") + "/a", options);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("pass --model=NAME"));
  options.model = "gpt2_debug";
  files = ExportHf(dir, FreshDir("export_old_out2") + "/b", options);
  EXPECT_TRUE(files.ok()) << files.status();
  // The wrong model: its parameters are not in the checkpoint.
  options.model = "llama_debug";
  files = ExportHf(dir, FreshDir("export_old_out3") + "/c", options);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(),
              HasSubstr("lacks the model's parameters"));

  const std::string recorded = SaveModel("export_new", *model, true);
  files = ExportHf(recorded, FreshDir("export_new_out") + "/d", options);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(files.status().message(),
              HasSubstr("--model applies only to checkpoints without it"));
}

}  // namespace
}  // namespace ckpt
}  // namespace fsdpp
