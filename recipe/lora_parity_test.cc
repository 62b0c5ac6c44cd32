// LoRA training against an independent float64 PyTorch reference
// (recipe/testdata/lora_reference.py: the adapters as a merged weight W +
// (alpha / r) B A under autograd, torch.optim.AdamW): gpt2_debug with r 4
// adapters on the attention's projections and the MLP's input, 5 AdamW
// steps through the recipe (FSDP at W = 1), every loss within 1e-6
// (relative). Skips without torch unless FSDPP_REQUIRE_TORCH is set.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "formats/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/lora.h"
#include "models/torch_reference.h"
#include "models/transformer.h"
#include "nn/linear.h"
#include "recipe/layout.h"
#include "recipe/training.h"

namespace fsdpp {
namespace recipe {
namespace {

constexpr int kSteps = 5;
constexpr int64_t kRows = 2, kSeq = 16;
constexpr uint64_t kSeed = 41;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

// Without dropout and with LoRA dropout 0.15 (the reference computes the
// keyed masks itself: Philox4x32-10 over (layer key; row key; column x
// features + feature)).
class LoraParityTest : public ::testing::TestWithParam<float> {};

TEST_P(LoraParityTest, TrainsLikeAFloat64PyTorchReference) {
  if (const auto missing = models::TorchMissing()) {
    if (models::RequireTorch()) FAIL() << *missing;
    GTEST_SKIP() << *missing;
  }
  const float dropout = GetParam();
  const std::string tag = dropout > 0 ? "_dropout" : "";
  const models::TransformerConfig config = *models::ConfigByName("gpt2_debug");
  Layout layout;
  layout.lora.dropout = dropout;
  layout.micro_batch = kRows;
  layout.seq_len = kSeq;
  layout.lora.rank = 4;
  layout.lora.alpha = 8;
  layout.lora.targets = {"c_attn", "attn.c_proj", "mlp.fc"};
  AdamWOptions adamw;
  adamw.lr = 2e-2;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.95;
  adamw.eps = 1e-8;
  adamw.weight_decay = 0.1;

  // The batches: 5 of [2, 16] token ids, each target the next id.
  std::vector<int64_t> ids(kSteps * kRows * kSeq), targets(ids.size());
  uint64_t s = 777;
  for (int64_t& id : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((s >> 33) % config.vocab_size);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    targets[i] = (ids[i] * 7 + 3) % config.vocab_size;
  }

  // The base and the adapters' initial values, as the recipe initialises
  // them (the same seed, bitwise at any layout), in HF module names.
  std::unique_ptr<models::Transformer> init =
      *models::Transformer::Create(config);
  ASSERT_TRUE(models::AddLoraAdapters(init.get(), layout.lora).ok());
  ASSERT_TRUE(init->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(init->InitWeights(kSeed).ok());
  absl::StatusOr<std::vector<models::HfNameEntry>> mapping =
      models::HfNameMapping(config);
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  std::map<std::string, std::string> hf_module;
  for (const models::HfNameEntry& e : *mapping) {
    hf_module[e.ours] = e.hf.substr(0, e.hf.size() - 7);  // ".weight"
  }
  std::vector<std::pair<std::string, Tensor>> adapters;
  std::map<std::string, std::string> metadata = {
      {"r", "4"},
      {"alpha", "8"},
      {"dropout", absl::StrFormat("%.9g", dropout)},
      {"lr", absl::StrFormat("%.17g", adamw.lr)},
      {"beta1", absl::StrFormat("%.17g", adamw.beta1)},
      {"beta2", absl::StrFormat("%.17g", adamw.beta2)},
      {"eps", absl::StrFormat("%.17g", adamw.eps)},
      {"weight_decay", absl::StrFormat("%.17g", adamw.weight_decay)},
      {"family", "gpt2"},
      {"n_layers", absl::StrCat(config.n_layers)},
      {"n_heads", absl::StrCat(config.n_heads)},
      {"n_kv_heads", absl::StrCat(config.kv_heads())},
      {"norm_eps", absl::StrFormat("%.9g", config.norm_eps)},
      {"rope_theta", "0"},
      {"tied", config.tied_embeddings ? "1" : "0"}};
  // Each adapted layer's dropout key (an identifier; the masks the
  // reference computes from it).
  for (auto& [name, m] : init->NamedModules()) {
    const auto* linear = dynamic_cast<const nn::Linear*>(m);
    if (linear == nullptr || linear->lora_a() == nullptr) continue;
    metadata[absl::StrCat("key:", hf_module.at(name + ".weight"))] =
        absl::StrCat(linear->lora_dropout_key());
  }
  for (const auto& [name, p] : init->NamedParameters()) {
    if (!models::IsLoraParameter(name)) continue;
    const size_t cut = name.rfind(".lora_");
    const std::string module = name.substr(0, cut);
    adapters.emplace_back(absl::StrCat(hf_module.at(module + ".weight"),
                                       name.substr(cut, name.size() - cut - 7)),
                          p->data);
  }
  const std::string base_path = TempPath("lora_base" + tag + ".safetensors");
  const std::string adapters_path =
      TempPath("lora_adapters" + tag + ".safetensors");
  const std::string batches_path =
      TempPath("lora_batches" + tag + ".safetensors");
  const std::string results_path =
      TempPath("lora_results" + tag + ".safetensors");
  // Each row's dropout key: its step and row.
  std::vector<int64_t> row_keys;
  for (int step = 0; step < kSteps; ++step) {
    for (int64_t r = 0; r < kRows; ++r) row_keys.push_back(1000 * step + r);
  }
  ASSERT_TRUE(models::ExportSafetensors(*init, base_path).ok());
  ASSERT_TRUE(WriteSafetensors(adapters_path, adapters, metadata).ok());
  ASSERT_TRUE(
      WriteSafetensors(
          batches_path,
          {{"ids", *Tensor::FromInts({kSteps, kRows, kSeq}, ids, DType::kI64)},
           {"targets",
            *Tensor::FromInts({kSteps, kRows, kSeq}, targets, DType::kI64)},
           {"row_keys",
            *Tensor::FromInts({kSteps, kRows}, row_keys, DType::kI64)}})
          .ok());

  std::vector<double> losses;
  testing_util::RunOnMesh(layout.MeshAxes(), [&](int, DeviceMesh& mesh) {
    BuildOptions options;
    options.seed = kSeed;
    options.adamw = adamw;
    absl::StatusOr<std::unique_ptr<Training>> t =
        Training::Build(config, layout, &mesh, options);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int step = 0; step < kSteps; ++step) {
      const MicroBatchSource source =
          [&](int64_t) -> absl::StatusOr<MicroBatch> {
        const auto at = ids.begin() + step * kRows * kSeq;
        const auto tat = targets.begin() + step * kRows * kSeq;
        MicroBatch b;
        for (int64_t r = 0; r < kRows; ++r) {
          b.row_keys.push_back(row_keys[step * kRows + r]);
        }
        FSDPP_ASSIGN_OR_RETURN(
            b.ids, Tensor::FromInts({kRows, kSeq}, std::vector<int64_t>(
                                                       at, at + kRows * kSeq)));
        FSDPP_ASSIGN_OR_RETURN(
            b.targets,
            Tensor::FromInts({kRows, kSeq},
                             std::vector<int64_t>(tat, tat + kRows * kSeq)));
        return b;
      };
      absl::StatusOr<StepLoss> loss = (*t)->ForwardBackward(source);
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses.push_back(loss->loss);
      OptimizerStepOptions o;
      o.lr = adamw.lr;
      ASSERT_TRUE((*t)->OptimizerStep(o).ok());
    }
  });
  ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps));
  // The adapters trained: the last batch's loss is no longer the base's
  // (B = 0 at the start: `init` computes the base model).
  const int64_t last = (kSteps - 1) * kRows * kSeq;
  absl::StatusOr<float> base_loss = init->EvalLoss(
      *Tensor::FromInts({kRows, kSeq},
                        std::vector<int64_t>(ids.begin() + last, ids.end())),
      *Tensor::FromInts(
          {kRows, kSeq},
          std::vector<int64_t>(targets.begin() + last, targets.end())));
  ASSERT_TRUE(base_loss.ok()) << base_loss.status();
  EXPECT_GT(std::fabs(losses[kSteps - 1] - *base_loss), 1e-4);
  // The losses as decimal text (fsdpp has no f64 tensors), exactly.
  std::vector<std::string> text;
  for (double l : losses) text.push_back(absl::StrFormat("%.17g", l));
  ASSERT_TRUE(WriteSafetensors(results_path,
                               {{"steps", *Tensor::FromFloats({1}, {kSteps})}},
                               {{"losses", absl::StrJoin(text, ",")}})
                  .ok());
  const auto [status, output] = models::RunCommand(absl::StrCat(
      "/usr/bin/python3 recipe/testdata/lora_reference.py '", base_path, "' '",
      adapters_path, "' '", batches_path, "' '", results_path, "'"));
  std::cout << output << std::flush;
  EXPECT_EQ(status, 0) << output;
}

INSTANTIATE_TEST_SUITE_P(Dropout, LoraParityTest,
                         ::testing::Values(0.0f, 0.15f));

}  // namespace
}  // namespace recipe
}  // namespace fsdpp
