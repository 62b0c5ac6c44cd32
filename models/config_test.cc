// Named configs, analytic parameter counts (against published model sizes
// and against the built models, including 124M / 1B ones built on the meta
// device with zero bytes) and FLOPs per token (ours vs the seed formula).
#include "models/config.h"

#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "core/allocator.h"
#include "core/device.h"
#include "gtest/gtest.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace {

TransformerConfig Named(const std::string& name) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(ConfigTest, EveryNamedConfigIsValidAndKnowsItsName) {
  ASSERT_EQ(ConfigNames().size(), 13u);
  for (const std::string& name : ConfigNames()) {
    const TransformerConfig c = Named(name);
    EXPECT_EQ(c.name, name);
    EXPECT_TRUE(ValidateConfig(c).ok()) << name << ": " << ValidateConfig(c);
  }
}

TEST(ConfigTest, ModelConfigJsonRoundTripsEveryField) {
  for (const std::string& name : ConfigNames()) {
    SCOPED_TRACE(name);
    absl::StatusOr<TransformerConfig> c = ConfigByName(name);
    ASSERT_TRUE(c.ok());
    c->vocab_pad_multiple = 64;
    c->init_std = 0.0125f;
    const std::string json = ModelConfigJson(*c);
    absl::StatusOr<TransformerConfig> back = ParseModelConfigJson(json, "x");
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
    EXPECT_EQ(ModelConfigJson(*back), json);
    EXPECT_EQ(back->name, c->name);
    EXPECT_EQ(back->family, c->family);
    EXPECT_EQ(back->norm_eps, c->norm_eps);
    EXPECT_EQ(back->rope_theta, c->rope_theta);
    EXPECT_EQ(back->rope_scaling.factor, c->rope_scaling.factor);
    EXPECT_EQ(back->rope_scaling.original_context,
              c->rope_scaling.original_context);
    EXPECT_EQ(back->no_rope_every, c->no_rope_every);
    EXPECT_EQ(back->tied_embeddings, c->tied_embeddings);
    EXPECT_EQ(back->init_std, c->init_std);
    EXPECT_EQ(back->padded_vocab_size(), c->padded_vocab_size());
    EXPECT_EQ(back->moe.num_experts, c->moe.num_experts);
    EXPECT_EQ(back->moe.normalize_top_k, c->moe.normalize_top_k);
  }
  // Every MoE field, off its default.
  TransformerConfig m = Named("moe_debug");
  m.moe.shared_hidden = 32;
  m.moe.first_layer = 1;
  m.moe.sigmoid = true;
  m.moe.aux_loss_coef = 0.0f;
  m.moe.normalize_top_k = false;
  m.moe.route_scale = 2.5f;
  m.moe.expert_bias = true;
  m.moe.bias_update_rate = 0.001f;
  absl::StatusOr<TransformerConfig> back =
      ParseModelConfigJson(ModelConfigJson(m), "x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ModelConfigJson(*back), ModelConfigJson(m));
  EXPECT_EQ(back->moe.shared_hidden, 32);
  EXPECT_EQ(back->moe.first_layer, 1);
  EXPECT_TRUE(back->moe.sigmoid);
  EXPECT_EQ(back->moe.route_scale, 2.5f);
  EXPECT_TRUE(back->moe.expert_bias);
  EXPECT_EQ(back->moe.bias_update_rate, 0.001f);
  // Written before the bias update existed: no "bias_update_rate", no
  // update.
  std::string old_json = ModelConfigJson(m);
  const size_t at = old_json.find(", \"bias_update_rate\"");
  ASSERT_NE(at, std::string::npos);
  old_json.erase(at, old_json.find('}', at) - at);
  absl::StatusOr<TransformerConfig> old = ParseModelConfigJson(old_json, "x");
  ASSERT_TRUE(old.ok()) << old.status() << " " << old_json;
  EXPECT_EQ(old->moe.bias_update_rate, 0.0f);
  // An update needs the bias it moves.
  m.moe.expert_bias = false;
  absl::Status refused = ValidateConfig(m);
  EXPECT_NE(std::string(refused.message())
                .find("moe.bias_update_rate must be >= 0, and > 0 only with "
                      "moe.expert_bias, got 0.001 without an expert bias"),
            std::string::npos)
      << refused;
}

// Checkpoints written before MoE models existed have no "moe": dense.
TEST(ConfigTest, ModelConfigJsonWithoutMoeIsDense) {
  const TransformerConfig c = Named("llama_debug");
  std::string json = ModelConfigJson(c);
  const size_t at = json.find(", \"moe\": ");
  ASSERT_NE(at, std::string::npos);
  json = json.substr(0, at) + "}";
  absl::StatusOr<TransformerConfig> back = ParseModelConfigJson(json, "old");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
  EXPECT_FALSE(back->moe.enabled());
  EXPECT_EQ(ModelConfigJson(*back), ModelConfigJson(c));
  std::string bad = ModelConfigJson(Named("moe_debug"));
  bad.replace(bad.find("\"softmax\""), 9, "\"cosine\"");
  EXPECT_TRUE(
      absl::StrContains(ParseModelConfigJson(bad, "x").status().message(),
                        "moe.scoring is not \"softmax\" or \"sigmoid\""));
}

TEST(ConfigTest, ParseModelConfigJsonSaysWhatIsWrong) {
  absl::StatusOr<TransformerConfig> c = ConfigByName("gpt2_debug");
  ASSERT_TRUE(c.ok());
  const std::string json = ModelConfigJson(*c);
  const auto error = [](const std::string& text) {
    return std::string(
        ParseModelConfigJson(text, "ckpt/train/model").status().message());
  };
  EXPECT_TRUE(
      absl::StartsWith(error("[1"), "ckpt/train/model: model config: "));
  std::string no_dim = json;
  no_dim.replace(no_dim.find("\"dim\""), 5, "\"dum\"");
  EXPECT_TRUE(absl::StrContains(error(no_dim), "no \"dim\"")) << error(no_dim);
  std::string bad_family = json;
  bad_family.replace(bad_family.find("gpt2\""), 5, "gpt9\"");
  EXPECT_TRUE(absl::StrContains(error(bad_family), "unknown family \"gpt9\""));
  std::string bad_heads = json;
  bad_heads.replace(bad_heads.find("\"n_heads\": 4"), 12, "\"n_heads\": 5");
  EXPECT_TRUE(absl::StrContains(error(bad_heads), "n_heads"))
      << error(bad_heads);
}

TEST(ConfigTest, UnknownNameListsTheKnownOnes) {
  absl::StatusOr<TransformerConfig> c = ConfigByName("gpt3");
  ASSERT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  const std::string message(c.status().message());
  EXPECT_TRUE(absl::StrContains(message, "unknown model config 'gpt3'"));
  for (const std::string& name : ConfigNames()) {
    EXPECT_TRUE(absl::StrContains(message, name)) << message;
  }
}

TEST(ConfigTest, ShapesOfTheNamedConfigs) {
  const TransformerConfig gpt2 = Named("gpt2_124m");
  EXPECT_EQ(gpt2.family, ModelFamily::kGpt2);
  EXPECT_EQ(gpt2.n_layers, 12);
  EXPECT_EQ(gpt2.dim, 768);
  EXPECT_EQ(gpt2.ffn_hidden, 3072);
  EXPECT_EQ(gpt2.padded_vocab_size(), 50257);
  EXPECT_EQ(Named("gpt2_1558m").head_dim(), 64);

  const TransformerConfig llama = Named("llama_1b");
  EXPECT_EQ(llama.family, ModelFamily::kLlama);
  EXPECT_EQ(llama.kv_heads(), 8);
  EXPECT_EQ(llama.head_dim(), 64);
  EXPECT_TRUE(llama.tied_embeddings);
  EXPECT_EQ(llama.rope_theta, 500000.0f);
  // Llama-3.2-1B's config.json: rope_scaling {factor 32, low_freq_factor 1,
  // high_freq_factor 4, original_max_position_embeddings 8192}.
  EXPECT_EQ(llama.rope_scaling.factor, 32.0f);
  EXPECT_EQ(llama.rope_scaling.low_freq_factor, 1.0f);
  EXPECT_EQ(llama.rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(llama.rope_scaling.original_context, 8192.0f);
  EXPECT_FALSE(Named("llama3_8b").tied_embeddings);
  // Llama-3-8B (not 3.1) and SmolLM3 use plain RoPE.
  EXPECT_FALSE(Named("llama3_8b").rope_scaling.enabled());
  EXPECT_FALSE(Named("smollm3_3b").rope_scaling.enabled());

  const TransformerConfig debug = Named("llama_debug");
  EXPECT_EQ(debug.kv_heads(), 2);
  EXPECT_EQ(debug.ffn_hidden, 192);
}

TEST(ConfigTest, SmolLm3DropsRopeInEveryFourthLayer) {
  const TransformerConfig c = Named("smollm3_3b");
  EXPECT_EQ(c.rope_theta, 5e6f);
  int without_rope = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    EXPECT_EQ(c.UsesRope(i), (i + 1) % 4 != 0) << "layer " << i;
    if (!c.UsesRope(i)) ++without_rope;
  }
  EXPECT_EQ(without_rope, 9);
  EXPECT_TRUE(Named("llama_1b").UsesRope(3));
  EXPECT_FALSE(Named("gpt2_124m").UsesRope(0));
}

TEST(ConfigTest, ValidateRejectsBadRopeScaling) {
  TransformerConfig c = Named("llama_1b");
  c.rope_scaling.high_freq_factor = 0.5f;
  EXPECT_EQ(ValidateConfig(c).message(),
            "TransformerConfig 'llama_1b' (llama): rope_scaling needs 0 < "
            "low_freq_factor < high_freq_factor");
  TransformerConfig gpt2 = Named("gpt2_debug");
  gpt2.rope_scaling.factor = 8.0f;
  EXPECT_EQ(ValidateConfig(gpt2).message(),
            "TransformerConfig 'gpt2_debug' (gpt2): rope_scaling needs rotary "
            "embeddings (the Llama family)");
}

TEST(ConfigTest, ValidateRejectsBadShapes) {
  TransformerConfig c = Named("llama_debug");
  c.n_kv_heads = 3;
  EXPECT_EQ(ValidateConfig(c).code(), absl::StatusCode::kInvalidArgument);
  c = Named("gpt2_debug");
  c.n_heads = 5;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(), "divide dim"));
  c = Named("gpt2_debug");
  c.bias = false;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(), "biases"));
  c = Named("gpt2_debug");
  c.vocab_pad_multiple = 0;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c = Named("gpt2_debug");
  c.dim = 0;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c = Named("gpt2_debug");
  c.moe = Named("moe_debug").moe;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(), "Llama family"));
  c = Named("moe_debug");
  c.moe.top_k = 9;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(),
                                "moe.top_k must be in [1, num_experts = 8]"));
  c = Named("moe_debug");
  c.moe.first_layer = 3;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(),
                                "moe.first_layer must be in [0, n_layers"));
  c = Named("moe_debug");
  c.moe.sigmoid = true;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(),
                                "moe.aux_loss_coef needs softmax"));
  c = Named("moe_debug");
  c.moe.hidden = 0;
  EXPECT_TRUE(absl::StrContains(ValidateConfig(c).message(), "moe.hidden"));
}

TEST(ConfigTest, PublishedParameterCounts) {
  TransformerConfig gpt2 = Named("gpt2_124m");
  EXPECT_EQ(NumParameters(gpt2), 124439808);
  gpt2.vocab_pad_multiple = 64;
  EXPECT_EQ(gpt2.padded_vocab_size(), 50304);
  EXPECT_EQ(NumParameters(gpt2), 124475904);
  EXPECT_EQ(NumParameters(Named("llama_1b")), 1235814400);
  EXPECT_EQ(NumParameters(Named("llama3_8b")), 8030261248);
  // Llama-3-70B as in its HF release (70.55 B).
  EXPECT_EQ(NumParameters(Named("llama3_70b")), 70553706496);
  // SmolLM3-3B (published as 3.08 B) and the debug models.
  EXPECT_EQ(NumParameters(Named("smollm3_3b")), 3075098624);
  EXPECT_EQ(NumParameters(Named("gpt2_debug")), 141056);
  EXPECT_EQ(NumParameters(Named("llama_debug")), 131392);
  // GPT-2 medium / large / XL as published by OpenAI (HF counts, tied).
  EXPECT_EQ(NumParameters(Named("gpt2_350m")), 354823168);
  EXPECT_EQ(NumParameters(Named("gpt2_774m")), 774030080);
  EXPECT_EQ(NumParameters(Named("gpt2_1558m")), 1557611200);
  // OLMoE-1B-7B: its HF release's 6919161856 (q and k norms included);
  // 1.28 B active (8 of 64 experts).
  EXPECT_EQ(NumParameters(Named("olmoe_1b_7b")), 6919161856);
  EXPECT_EQ(NumActiveParameters(Named("olmoe_1b_7b")), 1282017280);
  // olmoe_debug: moe_debug with an untied head (512 x 64) and q / k norms
  // (2 layers x (4 + 2) heads x 16).
  EXPECT_EQ(NumParameters(Named("olmoe_debug")), 353600 + 32768 + 192);
  EXPECT_EQ(NumActiveParameters(Named("olmoe_debug")), 132416 + 32768 + 192);
  // moe_debug: llama_debug's SwiGLU (3 x 64 x 192) becomes a router (8 x 64)
  // and 8 experts (3 x 64 x 96 each), two of them active.
  EXPECT_EQ(NumParameters(Named("moe_debug")),
            131392 + 2 * (8 * 64 + 8 * 3 * 64 * 96 - 3 * 64 * 192));
  EXPECT_EQ(NumActiveParameters(Named("moe_debug")), 131392 + 2 * 8 * 64);
  EXPECT_EQ(NumActiveParameters(Named("llama_debug")),
            NumParameters(Named("llama_debug")));
}

// The analytic count equals the built model's, built on the meta device.
void ExpectBuiltCount(const TransformerConfig& c) {
  SCOPED_TRACE(c.name);
  const int64_t before = GetAllocator(Device::Cpu())->Stats().total_current;
  absl::StatusOr<std::unique_ptr<Transformer>> model = Transformer::Create(c);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->NumParameters(), NumParameters(c));
  EXPECT_EQ(GetAllocator(Device::Cpu())->Stats().total_current, before);
  for (const auto& [name, p] : (*model)->NamedParameters()) {
    ASSERT_TRUE(p->data.is_meta()) << name;
  }
}

TEST(ConfigTest, AnalyticCountEqualsBuiltModel) {
  for (const char* name :
       {"gpt2_debug", "llama_debug", "gpt2_124m", "llama_1b"}) {
    ExpectBuiltCount(Named(name));
  }
  TransformerConfig padded = Named("gpt2_124m");
  padded.vocab_pad_multiple = 64;
  ExpectBuiltCount(padded);
  // Non-canonical combinations count the same way.
  TransformerConfig gpt2_swiglu = Named("gpt2_debug");
  gpt2_swiglu.activation = Activation::kSwiGlu;
  gpt2_swiglu.n_kv_heads = 2;
  gpt2_swiglu.tied_embeddings = false;
  ExpectBuiltCount(gpt2_swiglu);
  TransformerConfig llama_biased = Named("llama_debug");
  llama_biased.bias = true;
  llama_biased.activation = Activation::kGelu;
  ExpectBuiltCount(llama_biased);
  ExpectBuiltCount(Named("moe_debug"));
  ExpectBuiltCount(Named("olmoe_1b_7b"));
  ExpectBuiltCount(Named("olmoe_debug"));
  TransformerConfig moe_all = Named("moe_debug");
  moe_all.n_layers = 3;
  moe_all.moe.first_layer = 1;  // one dense layer first
  moe_all.moe.shared_hidden = 48;
  moe_all.moe.sigmoid = true;
  moe_all.moe.aux_loss_coef = 0.0f;
  moe_all.moe.expert_bias = true;
  ExpectBuiltCount(moe_all);
}

TEST(ConfigTest, FlopsPerTokenGpt2MatchesNanoGptFormula) {
  // nanoGPT's estimate_mfu: 6 N + 12 L H Q T with N = parameters minus
  // position embeddings (the tied head counted through wte).
  const TransformerConfig c = Named("gpt2_124m");
  const int64_t t = 1024;
  const double n_nanogpt = NumParameters(c) - c.context_length * c.dim;
  const double nanogpt = 6.0 * n_nanogpt + 12.0 * 12 * 12 * 64 * t;
  // Ours also leaves out norms and biases.
  const double norms_and_biases =
      12 * (4 * 768 + 3 * 768 + 768 + 3072 + 768) + 2 * 768;
  EXPECT_DOUBLE_EQ(FlopsPerToken(c, t), nanogpt - 6.0 * norms_and_biases);
}

TEST(ConfigTest, FlopsPerTokenLlama8B) {
  const TransformerConfig c = Named("llama3_8b");
  // 6 x (8.03e9 parameters - 525M embedding lookup - norms) + attention.
  const double matmul = 8030261248.0 - 128256.0 * 4096 - (2 * 32 + 1) * 4096;
  EXPECT_DOUBLE_EQ(FlopsPerToken(c, 8192),
                   6.0 * matmul + 12.0 * 32 * 8192 * 4096);
}

TEST(ConfigTest, FlopsPerTokenSmolLm3BothFormulas) {
  const TransformerConfig c = Named("smollm3_3b");
  const int64_t t = 8192;
  const double ours = FlopsPerToken(c, t);
  const double seed = FlopsPerTokenSeedFormula(c, t);
  std::printf(
      "smollm3_3b at seq_len %lld: FlopsPerToken %.4f GFLOP/token "
      "(6 N_matmul %.4f + attention %.4f), seed formula %.4f GFLOP/token\n",
      static_cast<long long>(t), ours / 1e9, 6.0 * 3074949120.0 / 1e9,
      12.0 * 36 * t * 2048 / 1e9, seed / 1e9);
  // N_matmul = 36 x (q 2048^2 + k, v 2 x 2048 x 512 + o 2048^2
  //            + 3 x 2048 x 11008) + head 128256 x 2048.
  EXPECT_DOUBLE_EQ(ours, 6.0 * 3074949120.0 + 12.0 * 36 * t * 2048);
  EXPECT_DOUBLE_EQ(ours, 25697452032.0);
  // Seed: 6 x (2048 x 6144 + 2 x 16 x 8192 x 128 + 2048^2 + 3 x 2048 x 11008)
  // x 36: it counts full-width k and v (no GQA) and no LM head.
  EXPECT_DOUBLE_EQ(seed, 25480396800.0);
  // The two differ by the LM head minus the GQA overcount of k and v.
  EXPECT_DOUBLE_EQ(ours - seed,
                   6.0 * (128256.0 * 2048 - 36.0 * 2 * 2048 * (2048 - 512)));
}

// A mixture of experts costs its active weights: the router and top_k
// experts per layer, as many FLOPs as a dense model of that width.
TEST(ConfigTest, FlopsPerTokenCountsActiveExperts) {
  const TransformerConfig moe = Named("moe_debug");
  const TransformerConfig dense = Named("llama_debug");
  EXPECT_DOUBLE_EQ(FlopsPerToken(moe, 128) - FlopsPerToken(dense, 128),
                   6.0 * 2 * 8 * 64);
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
