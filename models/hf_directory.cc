// Hugging Face model directories; see hf_directory.h.
#include "models/hf_directory.h"

#include <dirent.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/json_quote.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace models {
namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";
constexpr char kConfigName[] = "config.json";

const char* TorchDtype(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "float32";
  }
}

// Builds a JSON object text from (key, raw JSON value) pairs.
std::string JsonObject(
    const std::vector<std::pair<std::string, std::string>>& fields,
    const std::string& indent) {
  std::vector<std::string> lines;
  for (const auto& [key, value] : fields) {
    lines.push_back(absl::StrCat(indent, "  ", JsonQuote(key), ": ", value));
  }
  return absl::StrCat("{\n", absl::StrJoin(lines, ",\n"), "\n", indent, "}");
}

bool FloatEqual(double a, double b) {
  return std::fabs(a - b) <= 1e-6 * std::max(std::fabs(a), std::fabs(b));
}

// Collects config.json mismatches.
class ConfigChecker {
 public:
  explicit ConfigChecker(const Json& json) : json_(json) {}

  // The field's value as an integer (nullopt, noting why, if absent or not
  // one).
  void Int(const char* key, int64_t expected,
           std::optional<int64_t> dflt = {}) {
    const Json* v = json_.Find(key);
    int64_t got = 0;
    if (v == nullptr || v->is_null()) {
      if (!dflt.has_value()) {
        problems_.push_back(absl::StrCat(key, " is missing"));
        return;
      }
      got = *dflt;
    } else if (!v->is_int64()) {
      problems_.push_back(absl::StrCat(key, " is not an integer"));
      return;
    } else {
      got = v->int64_value();
    }
    if (got != expected) {
      problems_.push_back(
          absl::StrCat(key, " is ", got, ", the model has ", expected));
    }
  }
  void Float(const char* key, double expected, std::optional<double> dflt) {
    const Json* v = json_.Find(key);
    double got = 0;
    if (v == nullptr || v->is_null()) {
      if (!dflt.has_value()) {
        problems_.push_back(absl::StrCat(key, " is missing"));
        return;
      }
      got = *dflt;
    } else if (!v->is_number()) {
      problems_.push_back(absl::StrCat(key, " is not a number"));
      return;
    } else {
      got = v->number_value();
    }
    if (!FloatEqual(got, expected)) {
      problems_.push_back(
          absl::StrCat(key, " is ", got, ", the model has ", expected));
    }
  }
  void Bool(const char* key, bool expected, bool dflt) {
    const Json* v = json_.Find(key);
    bool got = dflt;
    if (v != nullptr && !v->is_null()) {
      if (!v->is_bool()) {
        problems_.push_back(absl::StrCat(key, " is not true or false"));
        return;
      }
      got = v->bool_value();
    }
    if (got != expected) {
      problems_.push_back(absl::StrCat(key, " is ", got ? "true" : "false",
                                       ", the model has ",
                                       expected ? "true" : "false"));
    }
  }
  // The field must be one of `allowed` (absent: `dflt`).
  void String(const char* key, const std::vector<std::string>& allowed,
              const std::string& dflt, const std::string& model_has) {
    const Json* v = json_.Find(key);
    std::string got = dflt;
    if (v != nullptr && !v->is_null()) {
      if (!v->is_string()) {
        problems_.push_back(absl::StrCat(key, " is not a string"));
        return;
      }
      got = v->string_value();
    }
    if (std::find(allowed.begin(), allowed.end(), got) == allowed.end()) {
      problems_.push_back(
          absl::StrCat(key, " is \"", got, "\", the model has ", model_has));
    }
  }
  void Problem(std::string what) { problems_.push_back(std::move(what)); }
  const Json& json() const { return json_; }

  absl::Status Finish(const std::string& where) const {
    if (problems_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        where, " does not match the model: ", absl::StrJoin(problems_, "; ")));
  }

 private:
  const Json& json_;
  std::vector<std::string> problems_;
};

// The HF architecture name of a config's family.
const char* ModelType(const TransformerConfig& c) {
  if (c.family == ModelFamily::kGpt2) return "gpt2";
  return c.moe.enabled() ? "olmoe" : "llama";
}

}  // namespace

absl::StatusOr<std::string> HfConfigJson(const TransformerConfig& c,
                                         DType dtype) {
  // The same layouts as the tensor names.
  FSDPP_RETURN_IF_ERROR(HfNameMapping(c).status());
  std::vector<std::pair<std::string, std::string>> f;
  if (c.family == ModelFamily::kGpt2) {
    f = {
        {"architectures", "[\"GPT2LMHeadModel\"]"},
        {"model_type", "\"gpt2\""},
        {"activation_function", "\"gelu_new\""},
        {"vocab_size", absl::StrCat(c.vocab_size)},
        {"n_positions", absl::StrCat(c.context_length)},
        {"n_ctx", absl::StrCat(c.context_length)},
        {"n_embd", absl::StrCat(c.dim)},
        {"n_layer", absl::StrCat(c.n_layers)},
        {"n_head", absl::StrCat(c.n_heads)},
        {"n_inner", absl::StrCat(c.ffn_hidden)},
        {"layer_norm_epsilon", JsonFloat(c.norm_eps)},
        {"tie_word_embeddings", c.tied_embeddings ? "true" : "false"},
        {"torch_dtype", JsonQuote(TorchDtype(dtype))},
    };
  } else {
    if (c.no_rope_every > 0) {
      return absl::UnimplementedError(absl::StrCat(
          "config '", c.name, "' leaves out RoPE on every ", c.no_rope_every,
          "th layer, which HF's LlamaForCausalLM cannot describe"));
    }
    std::string scaling = "null";
    if (c.rope_scaling.enabled()) {
      scaling = JsonObject(
          {{"rope_type", "\"llama3\""},
           {"factor", JsonFloat(c.rope_scaling.factor)},
           {"low_freq_factor", JsonFloat(c.rope_scaling.low_freq_factor)},
           {"high_freq_factor", JsonFloat(c.rope_scaling.high_freq_factor)},
           {"original_max_position_embeddings",
            absl::StrCat(
                static_cast<int64_t>(c.rope_scaling.original_context))}},
          "  ");
    }
    const bool olmoe = c.moe.enabled();
    f = {
        {"architectures",
         olmoe ? "[\"OlmoeForCausalLM\"]" : "[\"LlamaForCausalLM\"]"},
        {"model_type", JsonQuote(ModelType(c))},
        {"hidden_act", "\"silu\""},
        {"vocab_size", absl::StrCat(c.vocab_size)},
        {"max_position_embeddings", absl::StrCat(c.context_length)},
        {"hidden_size", absl::StrCat(c.dim)},
        // OLMoE's is each expert's width.
        {"intermediate_size",
         absl::StrCat(olmoe ? c.moe.hidden : c.ffn_hidden)},
        {"num_hidden_layers", absl::StrCat(c.n_layers)},
        {"num_attention_heads", absl::StrCat(c.n_heads)},
        {"num_key_value_heads", absl::StrCat(c.kv_heads())},
        {"head_dim", absl::StrCat(c.head_dim())},
        {"rms_norm_eps", JsonFloat(c.norm_eps)},
        {"rope_theta", JsonFloat(c.rope_theta)},
        {"rope_scaling", scaling},
        {"attention_bias", c.bias ? "true" : "false"},
        {"tie_word_embeddings", c.tied_embeddings ? "true" : "false"},
        {"torch_dtype", JsonQuote(TorchDtype(dtype))},
    };
    if (olmoe) {
      f.insert(f.end(),
               {{"num_experts", absl::StrCat(c.moe.num_experts)},
                {"num_experts_per_tok", absl::StrCat(c.moe.top_k)},
                {"norm_topk_prob", c.moe.normalize_top_k ? "true" : "false"},
                {"router_aux_loss_coef", JsonFloat(c.moe.aux_loss_coef)},
                {"output_router_logits", "false"},
                {"clip_qkv", "null"}});
    } else {
      f.push_back({"mlp_bias", "false"});
    }
  }
  return JsonObject(f, "") + "\n";
}

absl::Status CheckHfConfig(absl::string_view config_json,
                           const TransformerConfig& c,
                           const std::string& where) {
  absl::StatusOr<Json> parsed = ParseJson(config_json);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", parsed.status().message()));
  }
  if (!parsed->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not a JSON object"));
  }
  ConfigChecker check(*parsed);
  check.String("model_type", {ModelType(c)}, "",
               absl::StrCat("family ", ModelFamilyName(c.family), " (\"",
                            ModelType(c), "\")"));
  check.Int("vocab_size", c.vocab_size);
  if (c.family == ModelFamily::kGpt2) {
    check.Int("n_positions", c.context_length);
    check.Int("n_embd", c.dim);
    check.Int("n_layer", c.n_layers);
    check.Int("n_head", c.n_heads);
    check.Int("n_inner", c.ffn_hidden, 4 * c.dim);
    check.Float("layer_norm_epsilon", c.norm_eps, 1e-5);
    check.String("activation_function", {"gelu_new", "gelu_pytorch_tanh"},
                 "gelu_new", "GELU with the tanh approximation (\"gelu_new\")");
    check.Bool("tie_word_embeddings", c.tied_embeddings, true);
  } else {
    const bool olmoe = c.moe.enabled();
    check.Int("max_position_embeddings", c.context_length);
    check.Int("hidden_size", c.dim);
    check.Int("intermediate_size", olmoe ? c.moe.hidden : c.ffn_hidden);
    if (olmoe) {
      check.Int("num_experts", c.moe.num_experts);
      check.Int("num_experts_per_tok", c.moe.top_k);
      check.Bool("norm_topk_prob", c.moe.normalize_top_k, false);
      // The aux loss's weight is training's, not the weights': not checked.
      const Json* clip = parsed->Find("clip_qkv");
      if (clip != nullptr && !clip->is_null()) {
        check.Problem("clip_qkv is set; fsdpp does not clip q, k and v");
      }
    }
    check.Int("num_hidden_layers", c.n_layers);
    check.Int("num_attention_heads", c.n_heads);
    check.Int("num_key_value_heads", c.kv_heads(), c.n_heads);
    check.Int("head_dim", c.head_dim(), c.head_dim());
    check.Float("rms_norm_eps", c.norm_eps, 1e-6);
    check.Float("rope_theta", c.rope_theta, 10000.0);
    check.String("hidden_act", {"silu"}, "silu", "SiLU (\"silu\")");
    check.Bool("attention_bias", c.bias, false);
    if (!olmoe) check.Bool("mlp_bias", false, false);
    check.Bool("tie_word_embeddings", c.tied_embeddings, false);
    const Json* scaling = parsed->Find("rope_scaling");
    const bool has_scaling = scaling != nullptr && !scaling->is_null();
    if (has_scaling != c.rope_scaling.enabled()) {
      check.Problem(absl::StrCat(
          "rope_scaling is ", has_scaling ? "set" : "null", ", the model has ",
          c.rope_scaling.enabled() ? "llama3 scaling" : "none"));
    } else if (has_scaling) {
      if (!scaling->is_object()) {
        check.Problem("rope_scaling is not an object");
      } else {
        ConfigChecker s(*scaling);
        s.String("rope_type", {"llama3"}, "", "\"llama3\"");
        s.Float("factor", c.rope_scaling.factor, std::nullopt);
        s.Float("low_freq_factor", c.rope_scaling.low_freq_factor,
                std::nullopt);
        s.Float("high_freq_factor", c.rope_scaling.high_freq_factor,
                std::nullopt);
        s.Float("original_max_position_embeddings",
                c.rope_scaling.original_context, std::nullopt);
        const absl::Status sub = s.Finish("rope_scaling");
        if (!sub.ok()) check.Problem(std::string(sub.message()));
      }
    }
  }
  return check.Finish(where);
}

absl::StatusOr<TransformerConfig> ConfigFromHfJson(absl::string_view text,
                                                   const std::string& name,
                                                   const std::string& where) {
  const auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
  };
  absl::StatusOr<Json> parsed = ParseJson(text);
  if (!parsed.ok()) return bad(parsed.status().message());
  if (!parsed->is_object()) return bad("not a JSON object");
  const Json& j = *parsed;
  const auto integer =
      [&](const char* key,
          std::optional<int64_t> dflt) -> absl::StatusOr<int64_t> {
    const Json* v = j.Find(key);
    if (v == nullptr || v->is_null()) {
      if (dflt.has_value()) return *dflt;
      return bad(absl::StrCat(key, " is missing"));
    }
    if (!v->is_int64()) return bad(absl::StrCat(key, " is not an integer"));
    return v->int64_value();
  };
  const auto number = [&](const char* key,
                          double dflt) -> absl::StatusOr<float> {
    const Json* v = j.Find(key);
    if (v == nullptr || v->is_null()) return static_cast<float>(dflt);
    if (!v->is_number()) return bad(absl::StrCat(key, " is not a number"));
    return static_cast<float>(v->number_value());
  };
  const auto boolean = [&](const char* key, bool dflt) -> absl::StatusOr<bool> {
    const Json* v = j.Find(key);
    if (v == nullptr || v->is_null()) return dflt;
    if (!v->is_bool()) return bad(absl::StrCat(key, " is not true or false"));
    return v->bool_value();
  };
  const Json* type = j.Find("model_type");
  if (type == nullptr || !type->is_string()) return bad("no model_type");
  TransformerConfig c;
  c.name = name;
  if (type->string_value() == "gpt2") {
    c.family = ModelFamily::kGpt2;
    FSDPP_ASSIGN_OR_RETURN(c.vocab_size, integer("vocab_size", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.context_length,
                           integer("n_positions", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.dim, integer("n_embd", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.n_layers, integer("n_layer", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.n_heads, integer("n_head", std::nullopt));
    c.n_kv_heads = c.n_heads;
    FSDPP_ASSIGN_OR_RETURN(c.ffn_hidden, integer("n_inner", 4 * c.dim));
    FSDPP_ASSIGN_OR_RETURN(c.norm_eps, number("layer_norm_epsilon", 1e-5));
    FSDPP_ASSIGN_OR_RETURN(c.tied_embeddings,
                           boolean("tie_word_embeddings", true));
    c.bias = true;
    c.activation = Activation::kGelu;
  } else if (type->string_value() == "llama" ||
             type->string_value() == "olmoe") {
    c.family = ModelFamily::kLlama;
    if (type->string_value() == "olmoe") {
      // OLMoE: q / k norms, every layer a softmax top-k mixture of
      // experts of intermediate_size each.
      c.qk_norm = true;
      FSDPP_ASSIGN_OR_RETURN(c.moe.num_experts,
                             integer("num_experts", std::nullopt));
      FSDPP_ASSIGN_OR_RETURN(c.moe.top_k,
                             integer("num_experts_per_tok", std::nullopt));
      FSDPP_ASSIGN_OR_RETURN(c.moe.hidden,
                             integer("intermediate_size", std::nullopt));
      FSDPP_ASSIGN_OR_RETURN(c.moe.normalize_top_k,
                             boolean("norm_topk_prob", false));
      FSDPP_ASSIGN_OR_RETURN(c.moe.aux_loss_coef,
                             number("router_aux_loss_coef", 0.01));
    }
    FSDPP_ASSIGN_OR_RETURN(c.vocab_size, integer("vocab_size", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.context_length,
                           integer("max_position_embeddings", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.dim, integer("hidden_size", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.n_layers,
                           integer("num_hidden_layers", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.n_heads,
                           integer("num_attention_heads", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.n_kv_heads,
                           integer("num_key_value_heads", c.n_heads));
    FSDPP_ASSIGN_OR_RETURN(c.ffn_hidden,
                           integer("intermediate_size", std::nullopt));
    FSDPP_ASSIGN_OR_RETURN(c.norm_eps, number("rms_norm_eps", 1e-6));
    FSDPP_ASSIGN_OR_RETURN(c.rope_theta, number("rope_theta", 10000.0));
    FSDPP_ASSIGN_OR_RETURN(c.tied_embeddings,
                           boolean("tie_word_embeddings", false));
    FSDPP_ASSIGN_OR_RETURN(c.bias, boolean("attention_bias", false));
    c.activation = Activation::kSwiGlu;
    const Json* scaling = j.Find("rope_scaling");
    if (scaling != nullptr && !scaling->is_null()) {
      if (!scaling->is_object()) return bad("rope_scaling is not an object");
      const Json* rope_type = scaling->Find("rope_type");
      if (rope_type == nullptr || !rope_type->is_string() ||
          rope_type->string_value() != "llama3") {
        return bad("rope_scaling: only rope_type \"llama3\" is modelled");
      }
      float* const fields[] = {
          &c.rope_scaling.factor, &c.rope_scaling.low_freq_factor,
          &c.rope_scaling.high_freq_factor, &c.rope_scaling.original_context};
      const char* const keys[] = {"factor", "low_freq_factor",
                                  "high_freq_factor",
                                  "original_max_position_embeddings"};
      for (int i = 0; i < 4; ++i) {
        const Json* v = scaling->Find(keys[i]);
        if (v == nullptr || !v->is_number()) {
          return bad(absl::StrCat("rope_scaling.", keys[i], " is missing"));
        }
        *fields[i] = static_cast<float>(v->number_value());
      }
    }
  } else {
    return bad(absl::StrCat("model_type \"", type->string_value(),
                            "\" is not gpt2, llama or olmoe"));
  }
  const absl::Status valid = ValidateConfig(c);
  if (!valid.ok()) return bad(valid.message());
  FSDPP_RETURN_IF_ERROR(CheckHfConfig(text, c, where));
  return c;
}

HfShardPlan PlanHfShards(
    const std::vector<std::pair<std::string, Shape>>& tensors, DType dtype,
    uint64_t max_shard_bytes) {
  std::vector<std::vector<std::string>> groups(1);
  uint64_t shard_bytes = 0;
  HfShardPlan plan;
  for (const auto& [name, shape] : tensors) {
    uint64_t bytes = DTypeSize(dtype);
    for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    if (!groups.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      groups.emplace_back();
      shard_bytes = 0;
    }
    groups.back().push_back(name);
    shard_bytes += bytes;
    plan.total_bytes += bytes;
  }
  for (size_t k = 0; k < groups.size(); ++k) {
    plan.files.emplace_back(
        groups.size() == 1 ? std::string(kSingleName)
                           : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                             k + 1, groups.size()),
        std::move(groups[k]));
  }
  return plan;
}

absl::StatusOr<std::vector<std::string>> WriteHfDirectory(
    const std::string& dir_arg, const TransformerConfig& config,
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const HfWriteOptions& options) {
  // "out/" names the folder "out" (the side folder goes beside it).
  std::string dir = dir_arg;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || dir == "/") {
    return absl::InvalidArgumentError(absl::StrCat("HF export: \"", dir_arg,
                                                   "\" is not a directory to "
                                                   "create"));
  }
  if (options.dtype != DType::kF32 && options.dtype != DType::kBF16 &&
      options.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("HF export: dtype ",
                                                   DTypeName(options.dtype),
                                                   " is not f32, bf16 or f16"));
  }
  if (options.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("HF export: max_shard_bytes is 0");
  }
  FSDPP_ASSIGN_OR_RETURN(const std::string config_json,
                         HfConfigJson(config, options.dtype));
  for (const auto& [name, contents] : options.extra_files) {
    if (name.empty() || absl::StrContains(name, "/") || name == "." ||
        name == ".." || name == kConfigName || name == kIndexName ||
        absl::EndsWith(name, ".safetensors")) {
      return absl::InvalidArgumentError(
          absl::StrCat("HF export: extra file name \"", name,
                       "\" is not a plain name of its own"));
    }
  }
  if (IsDirectory(dir)) {
    DIR* d = opendir(dir.c_str());
    bool empty = true;
    if (d != nullptr) {
      while (dirent* e = readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 &&
            std::strcmp(e->d_name, "..") != 0) {
          empty = false;
          break;
        }
      }
      closedir(d);
    }
    if (!empty) {
      return absl::AlreadyExistsError(absl::StrCat(
          "HF export: ", dir, " exists and is not empty (nothing written)"));
    }
  } else if (access(dir.c_str(), F_OK) == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("HF export: ", dir, " exists and is not a directory"));
  }

  // Converted to the file dtype, in order, cut into shards as planned.
  std::vector<std::pair<std::string, Shape>> shapes;
  std::map<std::string, Tensor> converted;
  for (const auto& [name, tensor] : tensors) {
    if (!IsFloatingPoint(tensor.dtype())) {
      return absl::InvalidArgumentError(
          absl::StrCat("HF export: ", name, " is ", DTypeName(tensor.dtype()),
                       ", not a float tensor"));
    }
    Tensor t = tensor;
    if (t.dtype() != options.dtype) {
      FSDPP_ASSIGN_OR_RETURN(
          Tensor c, Tensor::Empty(t.shape(), options.dtype, t.device()));
      FSDPP_RETURN_IF_ERROR(Copy(t, &c));
      t = std::move(c);
    }
    shapes.emplace_back(name, t.shape());
    if (!converted.emplace(name, std::move(t)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("HF export: tensor ", name, " is given twice"));
    }
  }
  const HfShardPlan plan =
      PlanHfShards(shapes, options.dtype, options.max_shard_bytes);
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards;
  for (const auto& [file, names] : plan.files) {
    shards.emplace_back();
    for (const std::string& name : names) {
      shards.back().emplace_back(name, converted.at(name));
    }
  }
  const uint64_t total = plan.total_bytes;

  const std::string tmp = absl::StrCat(dir, ".tmp-", getpid());
  FSDPP_RETURN_IF_ERROR(RemoveTree(tmp));
  FSDPP_RETURN_IF_ERROR(MakeDirs(tmp));
  const auto fail = [&](absl::Status status) {
    (void)RemoveTree(tmp);
    return status;
  };
  std::vector<std::string> files = {kConfigName};
  absl::Status s = WriteFileAtomically(absl::StrCat(tmp, "/", kConfigName),
                                       config_json, "config.json");
  if (!s.ok()) return fail(s);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (shards.size() == 1) {
    s = WriteSafetensors(absl::StrCat(tmp, "/", kSingleName), shards[0],
                         metadata);
    if (!s.ok()) return fail(s);
    files.push_back(kSingleName);
  } else {
    std::vector<std::pair<std::string, std::string>> weight_map;
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string& file = plan.files[k].first;
      s = WriteSafetensors(absl::StrCat(tmp, "/", file), shards[k], metadata);
      if (!s.ok()) return fail(s);
      files.push_back(file);
      for (const auto& [name, t] : shards[k]) {
        weight_map.emplace_back(name, JsonQuote(file));
      }
    }
    const std::string index = absl::StrCat(
        JsonObject({{"metadata",
                     JsonObject({{"total_size", absl::StrCat(total)}}, "  ")},
                    {"weight_map", JsonObject(weight_map, "  ")}},
                   ""),
        "\n");
    s = WriteFileAtomically(absl::StrCat(tmp, "/", kIndexName), index,
                            "safetensors index");
    if (!s.ok()) return fail(s);
    files.push_back(kIndexName);
  }
  for (const auto& [name, contents] : options.extra_files) {
    s = WriteFileAtomically(absl::StrCat(tmp, "/", name), contents, name);
    if (!s.ok()) return fail(s);
    files.push_back(name);
  }
  s = SyncDir(tmp);
  if (!s.ok()) return fail(s);
  // An empty destination is replaced; a non-empty one was refused above.
  if (IsDirectory(dir) && rmdir(dir.c_str()) != 0) {
    return fail(absl::InternalError(absl::StrCat(
        "HF export: cannot replace empty ", dir, ": ", std::strerror(errno))));
  }
  if (rename(tmp.c_str(), dir.c_str()) != 0) {
    return fail(absl::InternalError(absl::StrCat("HF export: cannot rename ",
                                                 tmp, " to ", dir, ": ",
                                                 std::strerror(errno))));
  }
  const size_t slash = dir.find_last_of('/');
  (void)SyncDir(slash == std::string::npos ? "." : dir.substr(0, slash + 1));
  return files;
}

absl::StatusOr<std::unique_ptr<HfDirectory>> HfDirectory::Open(
    const std::string& dir) {
  std::unique_ptr<HfDirectory> out(new HfDirectory());
  out->dir_ = dir;
  if (!IsDirectory(dir)) {
    return absl::NotFoundError(
        absl::StrCat("HF model directory ", dir, " does not exist"));
  }
  const std::string config_path = absl::StrCat(dir, "/", kConfigName);
  if (IsRegularFile(config_path)) {
    FSDPP_ASSIGN_OR_RETURN(out->config_json_,
                           ReadFileToString(config_path, "config.json"));
  }
  const std::string index_path = absl::StrCat(dir, "/", kIndexName);
  const std::string single_path = absl::StrCat(dir, "/", kSingleName);
  if (IsRegularFile(index_path)) {
    FSDPP_ASSIGN_OR_RETURN(const std::string text,
                           ReadFileToString(index_path, "safetensors index"));
    const auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", what));
    };
    absl::StatusOr<Json> index = ParseJson(text);
    if (!index.ok()) return bad(index.status().message());
    const Json* map = index->is_object() ? index->Find("weight_map") : nullptr;
    if (map == nullptr || !map->is_object()) {
      return bad("no \"weight_map\" object");
    }
    std::map<std::string, std::string> where;  // tensor -> file
    for (const auto& [tensor, file] : map->object_value()) {
      if (!file.is_string()) {
        return bad(
            absl::StrCat("weight_map[\"", tensor, "\"] is not a string"));
      }
      const std::string& name = file.string_value();
      if (name.empty() || absl::StrContains(name, "/") || name == "." ||
          name == "..") {
        return bad(absl::StrCat("weight_map[\"", tensor, "\"] = \"", name,
                                "\" is not a file name in the directory"));
      }
      if (!where.emplace(tensor, name).second) {
        return bad(absl::StrCat("tensor \"", tensor, "\" is listed twice"));
      }
    }
    for (const auto& [tensor, name] : where) {
      if (out->files_.count(name) != 0) continue;
      const std::string path = absl::StrCat(dir, "/", name);
      if (!IsRegularFile(path)) {
        return absl::NotFoundError(absl::StrCat(
            index_path, " names shard file ", name, ", which is missing"));
      }
      FSDPP_ASSIGN_OR_RETURN(out->files_[name], SafetensorsFile::Open(path));
    }
    for (const auto& [tensor, name] : where) {
      const SafetensorsFile* file = out->files_.at(name).get();
      if (!file->Contains(tensor)) {
        return bad(absl::StrCat("puts tensor \"", tensor, "\" in ", name,
                                ", which does not hold it"));
      }
      out->tensors_[tensor] = file;
    }
  } else if (IsRegularFile(single_path)) {
    FSDPP_ASSIGN_OR_RETURN(out->files_[kSingleName],
                           SafetensorsFile::Open(single_path));
    const SafetensorsFile* file = out->files_.at(kSingleName).get();
    for (const std::string& name : file->names()) out->tensors_[name] = file;
  } else {
    return absl::NotFoundError(absl::StrCat("HF model directory ", dir,
                                            " has neither ", kIndexName,
                                            " nor ", kSingleName));
  }
  return out;
}

const SafetensorsFile* HfDirectory::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<std::string> HfDirectory::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : tensors_) out.push_back(name);
  return out;
}

std::vector<std::string> HfDirectory::files() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : files_) out.push_back(name);
  return out;
}

absl::StatusOr<Tensor> ReadHfBox(const HfImportItem& item, const Shape& ours,
                                 const Box& box, MemoryTag tag) {
  const auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(item.file->path(), ": ", item.name, " (", item.entry.ours,
                     "): ", what));
  };
  if (ours.empty() || ours.size() > 2 || box.offset.size() != ours.size() ||
      box.shape.size() != ours.size()) {
    return bad(absl::StrCat("cannot read box ", ShapeToString(box.shape), "@",
                            ShapeToString(box.offset), " of a ",
                            ShapeToString(ours), " parameter"));
  }
  for (size_t d = 0; d < ours.size(); ++d) {
    if (box.offset[d] < 0 || box.shape[d] < 0 ||
        box.offset[d] + box.shape[d] > ours[d]) {
      return bad(absl::StrCat("box ", ShapeToString(box.shape), "@",
                              ShapeToString(box.offset), " is outside ",
                              ShapeToString(ours)));
    }
  }
  FSDPP_ASSIGN_OR_RETURN(SafetensorsTensorInfo info,
                         item.file->Info(item.name));
  if (!info.dtype.has_value()) return bad("dtype fsdpp has none for");
  FSDPP_ASSIGN_OR_RETURN(absl::Span<const char> bytes,
                         item.file->Bytes(item.name));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor out, Tensor::Empty(box.shape, *info.dtype, Device::Cpu(), tag));
  char* dst = static_cast<char*>(out.raw_data());
  const size_t es = info.element_size;
  if (ours.size() == 1) {
    // Vocabulary rows are 2-D; a 1-D parameter is the file's tensor.
    if (box.shape[0] > 0) {
      std::memcpy(dst, bytes.data() + box.offset[0] * es, box.shape[0] * es);
    }
    return out;
  }
  const int64_t rows = box.shape[0];
  const int64_t cols = box.shape[1];
  if (rows == 0 || cols == 0) return out;  // Empty (and null storage).
  if (!item.entry.transpose) {
    // File [file_rows, C] (file_rows < R: the unpadded vocabulary).
    const int64_t file_rows = info.shape[0];
    const int64_t width = info.shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      char* row = dst + r * cols * es;
      const int64_t src = box.offset[0] + r;
      if (src >= file_rows) {
        std::memset(row, 0, cols * es);
        continue;
      }
      std::memcpy(row, bytes.data() + (src * width + box.offset[1]) * es,
                  cols * es);
    }
    return out;
  }
  // Ours [R, C] is the file's [C, R] transposed: out[i][j] =
  // file[offset1 + j][offset0 + i]; each file row j gives one run of `rows`
  // elements, scattered down column j.
  const int64_t width = info.shape[1];  // R
  for (int64_t j = 0; j < cols; ++j) {
    const char* run =
        bytes.data() + ((box.offset[1] + j) * width + box.offset[0]) * es;
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + (i * cols + j) * es, run + i * es, es);
    }
  }
  return out;
}

absl::StatusOr<std::string> HfDirectory::RequireConfigJson() const {
  if (config_json_.empty()) {
    return absl::NotFoundError(
        absl::StrCat("HF model directory ", dir_, " has no config.json"));
  }
  return config_json_;
}

absl::Status HfDirectory::CheckConfig(const TransformerConfig& config) const {
  FSDPP_ASSIGN_OR_RETURN(const std::string json, RequireConfigJson());
  return CheckHfConfig(json, config, absl::StrCat(dir_, "/config.json"));
}

absl::Status ImportHfDirectory(const HfDirectory& dir, Transformer* model) {
  FSDPP_RETURN_IF_ERROR(dir.CheckConfig(model->config()));
  return ImportHfTensors(dir, model);
}

}  // namespace models
}  // namespace fsdpp
