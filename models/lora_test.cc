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

}  // namespace
}  // namespace models
}  // namespace fsdpp
