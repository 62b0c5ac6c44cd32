// LoRA adapters on a model: which layers PEFT-style targets pick (whole
// names, dot-separated tails, globs), that everything else is frozen, and
// the refusals (a target matching nothing, a tied layer, rank < 1).
#include "models/lora.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/transformer.h"
#include "nn/embedding.h"
#include "nn/linear.h"
#include "nn/sequential.h"

namespace fsdpp {
namespace models {
namespace {

std::unique_ptr<Transformer> Gpt2Debug() {
  return *Transformer::Create(*ConfigByName("gpt2_debug"));
}

TEST(LoraTest, TargetsPickLinearLayersAndFreezeTheRest) {
  std::unique_ptr<Transformer> model = Gpt2Debug();
  LoraOptions options;
  options.rank = 2;
  options.targets = {"c_attn", "mlp.proj", "h.1.attn.c_pro?"};
  absl::StatusOr<std::vector<std::string>> adapted =
      AddLoraAdapters(model.get(), options);
  ASSERT_TRUE(adapted.ok()) << adapted.status();
  EXPECT_EQ(*adapted, (std::vector<std::string>{
                          "h.0.attn.c_attn", "h.0.mlp.proj", "h.1.attn.c_attn",
                          "h.1.attn.c_proj", "h.1.mlp.proj"}));
  int trainable = 0;
  for (const auto& [name, p] : model->NamedParameters()) {
    EXPECT_EQ(p->requires_grad, IsLoraParameter(name)) << name;
    trainable += p->requires_grad;
  }
  EXPECT_EQ(trainable, 10);
  EXPECT_TRUE(IsLoraParameter("h.0.attn.c_attn.lora_A.weight"));
  EXPECT_FALSE(IsLoraParameter("h.0.attn.c_attn.weight"));
  EXPECT_FALSE(IsLoraParameter("h.0.attn.lora_Ax.weight"));
}

TEST(LoraTest, Refusals) {
  LoraOptions options;
  options.rank = 2;
  options.targets = {"c_attn", "wq"};
  absl::Status s = AddLoraAdapters(Gpt2Debug().get(), options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "\"wq\" matches no linear layer of the model"))
      << s;
  // A part of a model (a pipeline stage) may miss a target.
  EXPECT_TRUE(
      AddLoraAdapters(Gpt2Debug().get(), options, /*every_target=*/false).ok());
  options.rank = 0;
  s = AddLoraAdapters(Gpt2Debug().get(), options).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "LoRA needs rank >= 1")) << s;

  // A tied head (a Linear sharing the embedding's table).
  nn::Sequential tied;
  auto* embedding = tied.Append(std::make_unique<nn::Embedding>(7, 4));
  tied.Append(std::make_unique<nn::Linear>(embedding->weight()));
  options.rank = 2;
  options.targets = {"1"};
  s = AddLoraAdapters(&tied, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "shares its weight (tied)")) << s;
}

// The checkpoint record: PEFT's spelling, lora_dropout only when set (an
// old record without it reads as 0), and each adapted layer's dropout key
// its name's (the same in another model of the same names: a pipeline
// part).
TEST(LoraTest, RecordAndDropoutKeys) {
  LoraOptions options;
  options.rank = 4;
  options.alpha = 8;
  options.targets = {"c_attn", "fc"};
  EXPECT_EQ(LoraJson(options),
            "{\"r\": 4, \"lora_alpha\": 8, \"target_modules\": "
            "[\"c_attn\", \"fc\"]}");
  options.dropout = 0.05f;
  const std::string json = LoraJson(options);
  EXPECT_EQ(json,
            "{\"r\": 4, \"lora_alpha\": 8, \"lora_dropout\": 0.05, "
            "\"target_modules\": [\"c_attn\", \"fc\"]}");
  absl::StatusOr<LoraOptions> back = ParseLoraJson(json, "ckpt");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dropout, 0.05f);
  EXPECT_EQ(back->targets, options.targets);
  EXPECT_EQ(ParseLoraJson("{\"r\": 4, \"lora_alpha\": 8, \"lora_dropout\": "
                          "1.5, \"target_modules\": [\"fc\"]}",
                          "ckpt")
                .status()
                .code(),
            absl::StatusCode::kDataLoss);

  std::unique_ptr<Transformer> a = Gpt2Debug(), b = Gpt2Debug();
  ASSERT_TRUE(AddLoraAdapters(a.get(), options).ok());
  ASSERT_TRUE(AddLoraAdapters(b.get(), options).ok());
  std::vector<uint64_t> keys;
  for (auto& [name, m] : a->NamedModules()) {
    const auto* linear = dynamic_cast<const nn::Linear*>(m);
    if (linear == nullptr || linear->lora_a() == nullptr) continue;
    EXPECT_EQ(linear->lora_dropout(), 0.05f);
    keys.push_back(linear->lora_dropout_key());
  }
  ASSERT_EQ(keys.size(), 4u);
  EXPECT_NE(keys[0], keys[1]);
  size_t i = 0;
  for (auto& [name, m] : b->NamedModules()) {
    const auto* linear = dynamic_cast<const nn::Linear*>(m);
    if (linear == nullptr || linear->lora_a() == nullptr) continue;
    EXPECT_EQ(linear->lora_dropout_key(), keys[i++]) << name;
  }
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
