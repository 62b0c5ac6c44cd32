// Numerical parity of the C++ Transformer with an independent PyTorch model.
//
// For gpt2_debug, llama_debug, a SmolLM3-style llama_debug (no RoPE in
// every 2nd layer) and llama_debug with Llama 3's RoPE scaling: builds the
// model, InitWeights(seed), exports the weights in Hugging Face names
// (ExportSafetensors) and a batch (ids, targets with some -100, B = 2, T = 16,
// hyperparameters in its metadata), runs forward + backward in f32, writes the
// loss, the logits and every gradient (HF names, "grad." prefix) to a third
// file and runs testdata/parity.py, which recomputes everything in float64 with
// autograd and fails when any max relative error exceeds 1e-4. Its table is
// printed into the test log.
//
// Without PyTorch (/usr/bin/python3 -c "import torch" failing) the test is
// skipped with instructions, unless FSDPP_REQUIRE_TORCH is set in the test
// environment (bazel test --test_env=FSDPP_REQUIRE_TORCH=1), where it fails.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/device.h"
#include "core/dtype.h"
#include "formats/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/torch_reference.h"
#include "models/transformer.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {
namespace {

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 16;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

// The batch: ids and targets (the next token, with a few ignored).
std::pair<Tensor, Tensor> Batch(int64_t vocab) {
  std::vector<int64_t> ids(kBatch * kSeq), targets(kBatch * kSeq);
  uint64_t s = 12345;
  for (int64_t& id : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    const bool last = i % kSeq == kSeq - 1;
    targets[i] = last || i % 7 == 3 ? -100 : ids[i + 1];
  }
  return {*Tensor::FromInts({kBatch, kSeq}, ids, DType::kI64),
          *Tensor::FromInts({kBatch, kSeq}, targets, DType::kI64)};
}

std::map<std::string, std::string> Hyperparameters(const TransformerConfig& c) {
  std::vector<std::string> rope_layers;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    rope_layers.push_back(c.UsesRope(i) ? "1" : "0");
  }
  std::map<std::string, std::string> hp = {
      {"family", ModelFamilyName(c.family)},
      {"n_layers", absl::StrCat(c.n_layers)},
      {"n_heads", absl::StrCat(c.n_heads)},
      {"n_kv_heads", absl::StrCat(c.kv_heads())},
      {"norm_eps", absl::StrFormat("%.9g", c.norm_eps)},
      {"rope_theta", absl::StrFormat("%.9g", c.rope_theta)},
      {"rope_layers", absl::StrJoin(rope_layers, ",")},
      {"tied", c.tied_embeddings ? "1" : "0"}};
  if (c.rope_scaling.enabled()) {
    const kernels::RopeScaling& s = c.rope_scaling;
    hp["rope_scaling"] =
        absl::StrFormat("%.9g,%.9g,%.9g,%.9g", s.factor, s.low_freq_factor,
                        s.high_freq_factor, s.original_context);
  }
  return hp;
}

void CheckParity(const TransformerConfig& c) {
  SCOPED_TRACE(c.name);
  absl::StatusOr<std::unique_ptr<Transformer>> created = Transformer::Create(c);
  ASSERT_TRUE(created.ok()) << created.status();
  Transformer& model = **created;
  ASSERT_TRUE(model.ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(model.InitWeights(2024).ok());

  const std::string weights = TempPath(c.name + "_weights.safetensors");
  const std::string batch = TempPath(c.name + "_batch.safetensors");
  const std::string results = TempPath(c.name + "_results.safetensors");
  ASSERT_TRUE(ExportSafetensors(model, weights).ok());
  const auto [ids, targets] = Batch(c.vocab_size);
  ASSERT_TRUE(WriteSafetensors(batch, {{"ids", ids}, {"targets", targets}},
                               Hyperparameters(c))
                  .ok());

  absl::StatusOr<Tensor> logits = model.Logits(ids);
  ASSERT_TRUE(logits.ok()) << logits.status();
  absl::StatusOr<float> loss = model.ForwardLoss(ids, targets);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const absl::Status backward = model.Backward();
  ASSERT_TRUE(backward.ok()) << backward;

  std::vector<std::pair<std::string, Tensor>> out = {
      {"loss", *Tensor::FromFloats({}, {*loss})}, {"logits", *logits}};
  absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> grads =
      ExportHfTensors(model, HfExportSource::kGradients);
  ASSERT_TRUE(grads.ok()) << grads.status();
  for (auto& [name, g] : *grads) out.emplace_back("grad." + name, g);
  ASSERT_TRUE(WriteSafetensors(results, out).ok());

  const auto [status, output] =
      RunCommand(absl::StrCat("/usr/bin/python3 models/testdata/parity.py '",
                              weights, "' '", batch, "' '", results, "'"));
  std::cout << "=== " << c.name << " ===\n" << output << std::flush;
  EXPECT_EQ(status, 0) << output;
}

// Skips every test (or, with FSDPP_REQUIRE_TORCH set, fails it) when
// /usr/bin/python3 cannot import torch.
class ParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::optional<std::string> missing = TorchMissing();
    if (!missing.has_value()) return;
    if (RequireTorch()) FAIL() << *missing << " [FSDPP_REQUIRE_TORCH is set]";
    GTEST_SKIP() << *missing;
  }
};

TEST_F(ParityTest, Gpt2Debug) { CheckParity(*ConfigByName("gpt2_debug")); }

TEST_F(ParityTest, LlamaDebug) { CheckParity(*ConfigByName("llama_debug")); }

TEST_F(ParityTest, LlamaDebugWithNoRopeLayersAndUntiedHead) {
  TransformerConfig c = *ConfigByName("llama_debug");
  c.name = "llama_debug_nope_untied";
  c.no_rope_every = 2;
  c.tied_embeddings = false;
  CheckParity(c);
}

// Llama 3.1's "llama3" RoPE scaling with Llama-3.2-1B's factors but an
// original context of 64 positions, so that at head_dim 16 (theta 10000)
// the three bands all occur: pair 0 kept (wavelength 6.3 < 16), pairs 1 and
// 2 interpolated (19.9 and 62.8), pairs 3-7 slowed 32x (199 and up) —
// enough to change every logit by far more than the tolerance.
TEST_F(ParityTest, LlamaDebugWithLlama3RopeScaling) {
  TransformerConfig c = *ConfigByName("llama_debug");
  c.name = "llama_debug_rope_scaling";
  c.rope_scaling = {32.0f, 1.0f, 4.0f, 64.0f};
  CheckParity(c);
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
