// Named transformer configs, parameter counts and FLOPs; see config.h.
#include "models/config.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/json_quote.h"
#include "core/status.h"
#include "formats/json.h"

namespace fsdpp {
namespace models {
namespace {

TransformerConfig Gpt2(std::string name, int64_t n_layers, int64_t dim,
                       int64_t n_heads, int64_t vocab_size,
                       int64_t context_length) {
  TransformerConfig c;
  c.name = std::move(name);
  c.family = ModelFamily::kGpt2;
  c.vocab_size = vocab_size;
  c.context_length = context_length;
  c.dim = dim;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_heads;
  c.ffn_hidden = 4 * dim;
  c.norm_eps = 1e-5f;
  c.tied_embeddings = true;
  c.bias = true;
  c.activation = Activation::kGelu;
  return c;
}

TransformerConfig Llama(std::string name, int64_t n_layers, int64_t dim,
                        int64_t n_heads, int64_t n_kv_heads, int64_t ffn_hidden,
                        int64_t vocab_size, int64_t context_length,
                        float rope_theta, bool tied) {
  TransformerConfig c;
  c.name = std::move(name);
  c.family = ModelFamily::kLlama;
  c.vocab_size = vocab_size;
  c.context_length = context_length;
  c.dim = dim;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.ffn_hidden = ffn_hidden;
  c.norm_eps = 1e-5f;
  c.rope_theta = rope_theta;
  c.tied_embeddings = tied;
  c.bias = false;
  c.activation = Activation::kSwiGlu;
  return c;
}

// OLMoE: a Llama whose every feed-forward block is `experts` SwiGLU experts
// of width `hidden`, `top_k` of them per token with their raw softmax
// scores, aux loss 0.01, with q / k norms and an untied head.
TransformerConfig Olmoe(const std::string& name, int64_t layers, int64_t dim,
                        int64_t heads, int64_t kv_heads, int64_t vocab,
                        int64_t context, int64_t experts, int64_t top_k,
                        int64_t hidden) {
  TransformerConfig c = Llama(name, layers, dim, heads, kv_heads, hidden, vocab,
                              context, 10000.0f, /*tied=*/false);
  c.moe.num_experts = experts;
  c.moe.top_k = top_k;
  c.moe.hidden = hidden;
  c.moe.normalize_top_k = false;
  c.moe.aux_loss_coef = 0.01f;
  c.qk_norm = true;
  return c;
}

// The named configs, in ConfigNames() order.
std::vector<TransformerConfig> AllConfigs() {
  std::vector<TransformerConfig> configs = {
      Gpt2("gpt2_debug", 2, 64, 4, 512, 128),
      Gpt2("gpt2_124m", 12, 768, 12, 50257, 1024),
      Gpt2("gpt2_350m", 24, 1024, 16, 50257, 1024),
      Gpt2("gpt2_774m", 36, 1280, 20, 50257, 1024),
      Gpt2("gpt2_1558m", 48, 1600, 25, 50257, 1024),
      Llama("llama_debug", 2, 64, 4, 2, 192, 512, 128, 10000.0f,
            /*tied=*/true),
      Llama("llama_1b", 16, 2048, 32, 8, 8192, 128256, 131072, 500000.0f,
            /*tied=*/true),
      Llama("smollm3_3b", 36, 2048, 16, 4, 11008, 128256, 65536, 5e6f,
            /*tied=*/true),
      Llama("llama3_8b", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0f,
            /*tied=*/false),
      Llama("llama3_70b", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0f,
            /*tied=*/false),
  };
  TransformerConfig moe_debug =
      Llama("moe_debug", 2, 64, 4, 2, 192, 512, 128, 10000.0f, /*tied=*/true);
  moe_debug.moe.num_experts = 8;
  moe_debug.moe.top_k = 2;
  moe_debug.moe.hidden = 96;
  moe_debug.moe.aux_loss_coef = 0.01f;
  configs.push_back(moe_debug);
  // OLMoE's architecture (q / k norms, every layer a mixture of raw top-k
  // scores, an untied head): at debug size (what HF import and export of
  // experts are tested on) and OLMoE-1B-7B's.
  configs.push_back(Olmoe("olmoe_debug", 2, 64, 4, 2, 512, 128, 8, 2, 96));
  configs.push_back(
      Olmoe("olmoe_1b_7b", 16, 2048, 16, 16, 50304, 4096, 64, 8, 1024));
  for (TransformerConfig& c : configs) {
    if (c.name == "smollm3_3b") {
      c.norm_eps = 1e-6f;
      c.no_rope_every = 4;
    }
    if (c.name == "llama_1b") c.rope_scaling = {32.0f, 1.0f, 4.0f, 8192.0f};
  }
  return configs;
}

// Elements of one norm layer's parameters.
int64_t NormParameters(const TransformerConfig& c) {
  const bool layer_norm_bias = c.family == ModelFamily::kGpt2 && c.bias;
  return layer_norm_bias ? 2 * c.dim : c.dim;
}

// Weight elements of one layer's attention projections (no biases).
int64_t AttentionMatmulParameters(const TransformerConfig& c) {
  const int64_t q_width = c.n_heads * c.head_dim();
  const int64_t kv_width = c.kv_heads() * c.head_dim();
  return c.dim * (q_width + 2 * kv_width) + q_width * c.dim;
}

// Weight elements of one dense layer's MLP (no biases).
int64_t MlpMatmulParameters(const TransformerConfig& c) {
  const int64_t matrices = c.activation == Activation::kGelu ? 2 : 3;
  return matrices * c.dim * c.ffn_hidden;
}

// Weight elements of one mixture-of-experts layer's matmuls: the router,
// `experts` SwiGLU experts and the shared ones.
int64_t MoeMatmulParameters(const TransformerConfig& c, int64_t experts) {
  return c.moe.num_experts * c.dim + experts * 3 * c.dim * c.moe.hidden +
         3 * c.dim * c.moe.shared_hidden;
}

// Weight elements of the feed-forward matmuls of every layer, counting
// `active` experts of each mixture (num_experts: all of them).
int64_t FeedForwardMatmulParameters(const TransformerConfig& c,
                                    bool active_only) {
  int64_t n = 0;
  for (int64_t layer = 0; layer < c.n_layers; ++layer) {
    n += c.UsesMoe(layer)
             ? MoeMatmulParameters(
                   c, active_only ? c.moe.top_k : c.moe.num_experts)
             : MlpMatmulParameters(c);
  }
  return n;
}

}  // namespace

const char* ModelFamilyName(ModelFamily family) {
  switch (family) {
    case ModelFamily::kGpt2:
      return "gpt2";
    case ModelFamily::kLlama:
      return "llama";
  }
  return "unknown";
}

const char* ActivationName(Activation activation) {
  switch (activation) {
    case Activation::kGelu:
      return "gelu";
    case Activation::kSwiGlu:
      return "swiglu";
  }
  return "unknown";
}

std::string ModelConfigJson(const TransformerConfig& c) {
  const auto f = [](float v) { return JsonFloat(v); };
  return absl::StrCat(
      "{\"name\": ", JsonQuote(c.name), ", \"family\": \"",
      ModelFamilyName(c.family), "\", \"vocab_size\": ", c.vocab_size,
      ", \"vocab_pad_multiple\": ", c.vocab_pad_multiple,
      ", \"context_length\": ", c.context_length, ", \"dim\": ", c.dim,
      ", \"n_layers\": ", c.n_layers, ", \"n_heads\": ", c.n_heads,
      ", \"n_kv_heads\": ", c.n_kv_heads, ", \"ffn_hidden\": ", c.ffn_hidden,
      ", \"norm_eps\": ", f(c.norm_eps), ", \"rope_theta\": ", f(c.rope_theta),
      ", \"rope_scaling\": [", f(c.rope_scaling.factor), ", ",
      f(c.rope_scaling.low_freq_factor), ", ",
      f(c.rope_scaling.high_freq_factor), ", ",
      f(c.rope_scaling.original_context),
      "], \"no_rope_every\": ", c.no_rope_every,
      ", \"tied_embeddings\": ", c.tied_embeddings ? "true" : "false",
      ", \"qk_norm\": ", c.qk_norm ? "true" : "false",
      ", \"bias\": ", c.bias ? "true" : "false", ", \"activation\": \"",
      ActivationName(c.activation), "\", \"init_std\": ", f(c.init_std),
      ", \"moe\": {\"num_experts\": ", c.moe.num_experts,
      ", \"top_k\": ", c.moe.top_k, ", \"hidden\": ", c.moe.hidden,
      ", \"shared_hidden\": ", c.moe.shared_hidden,
      ", \"first_layer\": ", c.moe.first_layer, ", \"scoring\": \"",
      c.moe.sigmoid ? "sigmoid" : "softmax",
      "\", \"normalize_top_k\": ", c.moe.normalize_top_k ? "true" : "false",
      ", \"route_scale\": ", f(c.moe.route_scale),
      ", \"aux_loss_coef\": ", f(c.moe.aux_loss_coef),
      ", \"expert_bias\": ", c.moe.expert_bias ? "true" : "false",
      ", \"bias_update_rate\": ", f(c.moe.bias_update_rate), "}}");
}

absl::StatusOr<TransformerConfig> ParseModelConfigJson(
    absl::string_view json, const std::string& where) {
  const auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": model config: ", what));
  };
  absl::StatusOr<Json> parsed = ParseJson(json);
  if (!parsed.ok()) return bad(parsed.status().message());
  if (!parsed->is_object()) return bad("not a JSON object");
  const Json& o = *parsed;
  const auto field = [&](const char* key) -> absl::StatusOr<const Json*> {
    const Json* v = o.Find(key);
    if (v == nullptr) return bad(absl::StrCat("no \"", key, "\""));
    return v;
  };
  const auto integer = [&](const char* key, int64_t* out) -> absl::Status {
    FSDPP_ASSIGN_OR_RETURN(const Json* v, field(key));
    if (!v->is_int64()) return bad(absl::StrCat(key, " is not an integer"));
    *out = v->int64_value();
    return absl::OkStatus();
  };
  const auto number = [&](const Json& v, const std::string& key,
                          float* out) -> absl::Status {
    if (!v.is_number()) return bad(absl::StrCat(key, " is not a number"));
    *out = static_cast<float>(v.number_value());
    return absl::OkStatus();
  };
  const auto boolean = [&](const char* key, bool* out) -> absl::Status {
    FSDPP_ASSIGN_OR_RETURN(const Json* v, field(key));
    if (!v->is_bool()) return bad(absl::StrCat(key, " is not true or false"));
    *out = v->bool_value();
    return absl::OkStatus();
  };
  const auto text = [&](const char* key) -> absl::StatusOr<std::string> {
    FSDPP_ASSIGN_OR_RETURN(const Json* v, field(key));
    if (!v->is_string()) return bad(absl::StrCat(key, " is not a string"));
    return v->string_value();
  };
  TransformerConfig c;
  FSDPP_ASSIGN_OR_RETURN(c.name, text("name"));
  FSDPP_ASSIGN_OR_RETURN(const std::string family, text("family"));
  if (family == "gpt2") {
    c.family = ModelFamily::kGpt2;
  } else if (family == "llama") {
    c.family = ModelFamily::kLlama;
  } else {
    return bad(absl::StrCat("unknown family \"", family, "\""));
  }
  FSDPP_RETURN_IF_ERROR(integer("vocab_size", &c.vocab_size));
  FSDPP_RETURN_IF_ERROR(integer("vocab_pad_multiple", &c.vocab_pad_multiple));
  FSDPP_RETURN_IF_ERROR(integer("context_length", &c.context_length));
  FSDPP_RETURN_IF_ERROR(integer("dim", &c.dim));
  FSDPP_RETURN_IF_ERROR(integer("n_layers", &c.n_layers));
  FSDPP_RETURN_IF_ERROR(integer("n_heads", &c.n_heads));
  FSDPP_RETURN_IF_ERROR(integer("n_kv_heads", &c.n_kv_heads));
  FSDPP_RETURN_IF_ERROR(integer("ffn_hidden", &c.ffn_hidden));
  FSDPP_RETURN_IF_ERROR(integer("no_rope_every", &c.no_rope_every));
  FSDPP_ASSIGN_OR_RETURN(const Json* eps, field("norm_eps"));
  FSDPP_RETURN_IF_ERROR(number(*eps, "norm_eps", &c.norm_eps));
  FSDPP_ASSIGN_OR_RETURN(const Json* theta, field("rope_theta"));
  FSDPP_RETURN_IF_ERROR(number(*theta, "rope_theta", &c.rope_theta));
  FSDPP_ASSIGN_OR_RETURN(const Json* init_std, field("init_std"));
  FSDPP_RETURN_IF_ERROR(number(*init_std, "init_std", &c.init_std));
  FSDPP_ASSIGN_OR_RETURN(const Json* scaling, field("rope_scaling"));
  if (!scaling->is_array() || scaling->array_value().size() != 4) {
    return bad("rope_scaling is not an array of 4 numbers");
  }
  float* const parts[] = {
      &c.rope_scaling.factor, &c.rope_scaling.low_freq_factor,
      &c.rope_scaling.high_freq_factor, &c.rope_scaling.original_context};
  for (int i = 0; i < 4; ++i) {
    FSDPP_RETURN_IF_ERROR(number(scaling->array_value()[i],
                                 absl::StrCat("rope_scaling[", i, "]"),
                                 parts[i]));
  }
  FSDPP_RETURN_IF_ERROR(boolean("tied_embeddings", &c.tied_embeddings));
  FSDPP_RETURN_IF_ERROR(boolean("bias", &c.bias));
  // Written since q / k norms exist; absent: none.
  if (o.Find("qk_norm") != nullptr) {
    FSDPP_RETURN_IF_ERROR(boolean("qk_norm", &c.qk_norm));
  }
  FSDPP_ASSIGN_OR_RETURN(const std::string activation, text("activation"));
  if (activation == "gelu") {
    c.activation = Activation::kGelu;
  } else if (activation == "swiglu") {
    c.activation = Activation::kSwiGlu;
  } else {
    return bad(absl::StrCat("unknown activation \"", activation, "\""));
  }
  // Written since MoE models exist; a config without it is dense.
  if (const Json* moe = o.Find("moe"); moe != nullptr) {
    if (!moe->is_object()) return bad("moe is not a JSON object");
    const auto moe_field = [&](const char* key) -> absl::StatusOr<const Json*> {
      const Json* v = moe->Find(key);
      if (v == nullptr) return bad(absl::StrCat("no \"moe.", key, "\""));
      return v;
    };
    const std::pair<const char*, int64_t*> integers[] = {
        {"num_experts", &c.moe.num_experts},
        {"top_k", &c.moe.top_k},
        {"hidden", &c.moe.hidden},
        {"shared_hidden", &c.moe.shared_hidden},
        {"first_layer", &c.moe.first_layer}};
    for (const auto& [key, out] : integers) {
      FSDPP_ASSIGN_OR_RETURN(const Json* v, moe_field(key));
      if (!v->is_int64()) {
        return bad(absl::StrCat("moe.", key, " is not an integer"));
      }
      *out = v->int64_value();
    }
    const std::pair<const char*, bool*> booleans[] = {
        {"normalize_top_k", &c.moe.normalize_top_k},
        {"expert_bias", &c.moe.expert_bias}};
    for (const auto& [key, out] : booleans) {
      FSDPP_ASSIGN_OR_RETURN(const Json* v, moe_field(key));
      if (!v->is_bool()) {
        return bad(absl::StrCat("moe.", key, " is not true or false"));
      }
      *out = v->bool_value();
    }
    FSDPP_ASSIGN_OR_RETURN(const Json* route, moe_field("route_scale"));
    FSDPP_RETURN_IF_ERROR(
        number(*route, "moe.route_scale", &c.moe.route_scale));
    FSDPP_ASSIGN_OR_RETURN(const Json* aux, moe_field("aux_loss_coef"));
    FSDPP_RETURN_IF_ERROR(
        number(*aux, "moe.aux_loss_coef", &c.moe.aux_loss_coef));
    // Written since the bias update exists; absent: no update.
    if (const Json* rate = moe->Find("bias_update_rate"); rate != nullptr) {
      FSDPP_RETURN_IF_ERROR(
          number(*rate, "moe.bias_update_rate", &c.moe.bias_update_rate));
    }
    FSDPP_ASSIGN_OR_RETURN(const Json* scoring, moe_field("scoring"));
    if (!scoring->is_string() || (scoring->string_value() != "softmax" &&
                                  scoring->string_value() != "sigmoid")) {
      return bad("moe.scoring is not \"softmax\" or \"sigmoid\"");
    }
    c.moe.sigmoid = scoring->string_value() == "sigmoid";
  }
  const absl::Status valid = ValidateConfig(c);
  if (!valid.ok()) return bad(valid.message());
  return c;
}

int64_t TransformerConfig::padded_vocab_size() const {
  if (vocab_pad_multiple <= 1) return vocab_size;
  return (vocab_size + vocab_pad_multiple - 1) / vocab_pad_multiple *
         vocab_pad_multiple;
}

bool TransformerConfig::UsesRope(int64_t layer) const {
  if (family != ModelFamily::kLlama) return false;
  return no_rope_every <= 0 || (layer + 1) % no_rope_every != 0;
}

absl::Status ValidateConfig(const TransformerConfig& c) {
  const auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("TransformerConfig '", c.name, "' (",
                     ModelFamilyName(c.family), "): ", why));
  };
  if (c.vocab_size <= 0 || c.context_length <= 0 || c.dim <= 0 ||
      c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads < 0 ||
      c.ffn_hidden <= 0) {
    return invalid(absl::StrCat(
        "sizes must be positive (vocab_size ", c.vocab_size,
        ", context_length ", c.context_length, ", dim ", c.dim, ", n_layers ",
        c.n_layers, ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads,
        ", ffn_hidden ", c.ffn_hidden, ")"));
  }
  if (c.vocab_pad_multiple < 1) {
    return invalid(absl::StrCat("vocab_pad_multiple must be >= 1, got ",
                                c.vocab_pad_multiple));
  }
  if (c.dim % c.n_heads != 0) {
    return invalid(
        absl::StrCat("n_heads ", c.n_heads, " must divide dim ", c.dim));
  }
  if (c.n_heads % c.kv_heads() != 0) {
    return invalid(absl::StrCat("n_kv_heads ", c.kv_heads(),
                                " must divide n_heads ", c.n_heads));
  }
  if (c.family == ModelFamily::kLlama && c.head_dim() % 2 != 0) {
    return invalid(
        absl::StrCat("RoPE needs an even head_dim, got ", c.head_dim()));
  }
  if (c.qk_norm && c.family != ModelFamily::kLlama) {
    return invalid("qk_norm needs the Llama family (separate q, k, v)");
  }
  if (!(c.norm_eps > 0.0f) || !(c.rope_theta > 0.0f) || !(c.init_std > 0.0f)) {
    return invalid("norm_eps, rope_theta and init_std must be positive");
  }
  if (const char* problem = kernels::RopeScalingProblem(c.rope_scaling)) {
    return invalid(problem);
  }
  if (c.rope_scaling.enabled() && c.family != ModelFamily::kLlama) {
    return invalid("rope_scaling needs rotary embeddings (the Llama family)");
  }
  if (c.activation == Activation::kGelu && !c.bias) {
    return invalid("the GELU MLP (nn::Mlp) always has biases: set bias = true");
  }
  const MoeConfig& m = c.moe;
  if (m.num_experts < 0) {
    return invalid(
        absl::StrCat("moe.num_experts must be >= 0, got ", m.num_experts));
  }
  if (m.enabled()) {
    if (c.family != ModelFamily::kLlama) {
      return invalid("a mixture of experts needs the Llama family (SwiGLU)");
    }
    if (m.top_k < 1 || m.top_k > m.num_experts) {
      return invalid(absl::StrCat("moe.top_k must be in [1, num_experts = ",
                                  m.num_experts, "], got ", m.top_k));
    }
    if (m.hidden < 1 || m.shared_hidden < 0) {
      return invalid(absl::StrCat(
          "moe.hidden must be >= 1 and moe.shared_hidden >= 0, got ", m.hidden,
          " and ", m.shared_hidden));
    }
    if (m.first_layer < 0 || m.first_layer > c.n_layers) {
      return invalid(absl::StrCat("moe.first_layer must be in [0, n_layers = ",
                                  c.n_layers, "], got ", m.first_layer));
    }
    if (!(m.route_scale > 0.0f) || !(m.aux_loss_coef >= 0.0f)) {
      return invalid(absl::StrCat(
          "moe.route_scale must be > 0 and moe.aux_loss_coef >= 0, got ",
          m.route_scale, " and ", m.aux_loss_coef));
    }
    if (!(m.bias_update_rate >= 0.0f) ||
        (m.bias_update_rate > 0.0f && !m.expert_bias)) {
      return invalid(absl::StrCat(
          "moe.bias_update_rate must be >= 0, and > 0 only with "
          "moe.expert_bias, got ",
          m.bias_update_rate, m.expert_bias ? "" : " without an expert bias"));
    }
    if (m.sigmoid && m.aux_loss_coef > 0.0f) {
      return invalid(
          "moe.aux_loss_coef needs softmax scores (sigmoid routers balance "
          "with the expert bias)");
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> ConfigNames() {
  std::vector<std::string> names;
  for (const TransformerConfig& c : AllConfigs()) names.push_back(c.name);
  return names;
}

absl::StatusOr<TransformerConfig> ConfigByName(const std::string& name) {
  for (TransformerConfig& c : AllConfigs()) {
    if (c.name == name) return std::move(c);
  }
  return absl::NotFoundError(
      absl::StrCat("unknown model config '", name,
                   "'; known configs: ", absl::StrJoin(ConfigNames(), ", ")));
}

int64_t NumParameters(const TransformerConfig& c) {
  const int64_t vocab = c.padded_vocab_size();
  int64_t n = vocab * c.dim;  // Token embedding.
  if (c.family == ModelFamily::kGpt2) n += c.context_length * c.dim;
  int64_t per_layer = 2 * NormParameters(c) + AttentionMatmulParameters(c);
  if (c.qk_norm) per_layer += (c.n_heads + c.kv_heads()) * c.head_dim();
  n += FeedForwardMatmulParameters(c, /*active_only=*/false);
  if (c.moe.expert_bias) {
    for (int64_t layer = 0; layer < c.n_layers; ++layer) {
      if (c.UsesMoe(layer)) n += c.moe.num_experts;
    }
  }
  if (c.bias) {
    per_layer += (c.n_heads + 2 * c.kv_heads()) * c.head_dim() + c.dim;
  }
  if (c.activation == Activation::kGelu) per_layer += c.ffn_hidden + c.dim;
  n += c.n_layers * per_layer;
  n += NormParameters(c);  // Final norm.
  if (!c.tied_embeddings) n += vocab * c.dim;
  return n;
}

int64_t NumActiveParameters(const TransformerConfig& c) {
  return NumParameters(c) -
         FeedForwardMatmulParameters(c, /*active_only=*/false) +
         FeedForwardMatmulParameters(c, /*active_only=*/true);
}

double FlopsPerToken(const TransformerConfig& c, int64_t seq_len) {
  const double matmul_parameters =
      static_cast<double>(c.n_layers) *
          static_cast<double>(AttentionMatmulParameters(c)) +
      static_cast<double>(FeedForwardMatmulParameters(c, true)) +
      static_cast<double>(c.padded_vocab_size()) * static_cast<double>(c.dim);
  const double attention = 12.0 * static_cast<double>(c.n_layers) *
                           static_cast<double>(seq_len) *
                           static_cast<double>(c.n_heads * c.head_dim());
  return 6.0 * matmul_parameters + attention;
}

double FlopsPerTokenSeedFormula(const TransformerConfig& c, int64_t seq_len) {
  const double factor = 6.0;
  const double hidden = static_cast<double>(c.dim);
  const double heads = static_cast<double>(c.n_heads);
  const double head_dim = static_cast<double>(c.head_dim());
  const double t = static_cast<double>(seq_len);
  const double qkv = factor * hidden * (heads * head_dim * 3.0);
  const double scores = factor * heads * t * head_dim;
  const double output = factor * heads * t * head_dim;
  const double out_proj = factor * heads * head_dim * hidden;
  const double mlp = factor * hidden * static_cast<double>(c.ffn_hidden) * 3.0;
  return (qkv + scores + output + out_proj + mlp) *
         static_cast<double>(c.n_layers);
}

}  // namespace models
}  // namespace fsdpp
