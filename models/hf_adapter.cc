// Hugging Face name mapping and safetensors export / import; see
// hf_adapter.h.
#include "models/hf_adapter.h"

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"
#include "formats/safetensors/safetensors.h"
#include "models/lora.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace models {
namespace {

constexpr char kGpt2Prefix[] = "transformer.";

std::vector<HfNameEntry> Gpt2Mapping(const TransformerConfig& c) {
  const std::string p = kGpt2Prefix;
  std::vector<HfNameEntry> m;
  m.push_back({"wte.weight", p + "wte.weight", false, true});
  m.push_back({"wpe.weight", p + "wpe.weight", false, false});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string ours = absl::StrCat("h.", i, ".");
    const std::string hf = absl::StrCat(p, "h.", i, ".");
    // (our suffix, HF suffix, Conv1D weight).
    const std::vector<std::tuple<std::string, std::string, bool>> parts = {
        {"ln_1", "ln_1", false},
        {"attn.c_attn", "attn.c_attn", true},
        {"attn.c_proj", "attn.c_proj", true},
        {"ln_2", "ln_2", false},
        {"mlp.fc", "mlp.c_fc", true},
        {"mlp.proj", "mlp.c_proj", true},
    };
    for (const auto& [our_part, hf_part, conv1d] : parts) {
      m.push_back({ours + our_part + ".weight", hf + hf_part + ".weight",
                   conv1d, false});
      m.push_back(
          {ours + our_part + ".bias", hf + hf_part + ".bias", false, false});
    }
  }
  m.push_back({"ln_f.weight", p + "ln_f.weight", false, false});
  m.push_back({"ln_f.bias", p + "ln_f.bias", false, false});
  if (!c.tied_embeddings) {
    m.push_back({"lm_head.weight", "lm_head.weight", false, true});
  }
  return m;
}

std::vector<HfNameEntry> LlamaMapping(const TransformerConfig& c) {
  std::vector<HfNameEntry> m;
  m.push_back(
      {"tok_embeddings.weight", "model.embed_tokens.weight", false, true});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string ours = absl::StrCat("layers.", i, ".");
    const std::string hf = absl::StrCat("model.layers.", i, ".");
    m.push_back({ours + "attention_norm.weight", hf + "input_layernorm.weight",
                 false, false});
    for (const auto& [our_part, hf_part] :
         std::vector<std::pair<std::string, std::string>>{{"wq", "q_proj"},
                                                          {"wk", "k_proj"},
                                                          {"wv", "v_proj"},
                                                          {"wo", "o_proj"}}) {
      m.push_back({ours + "attention." + our_part + ".weight",
                   hf + "self_attn." + hf_part + ".weight", false, false});
      if (c.bias) {
        m.push_back({ours + "attention." + our_part + ".bias",
                     hf + "self_attn." + hf_part + ".bias", false, false});
      }
    }
    if (c.qk_norm) {
      for (const char* norm : {"q_norm", "k_norm"}) {
        m.push_back({absl::StrCat(ours, "attention.", norm, ".weight"),
                     absl::StrCat(hf, "self_attn.", norm, ".weight"), false,
                     false});
      }
    }
    m.push_back({ours + "ffn_norm.weight",
                 hf + "post_attention_layernorm.weight", false, false});
    if (c.UsesMoe(i)) {
      m.push_back({ours + "feed_forward.gate.weight", hf + "mlp.gate.weight",
                   false, false});
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
        for (int64_t e = 0; e < c.moe.num_experts; ++e) {
          m.push_back(
              {absl::StrCat(ours, "feed_forward.experts.", proj),
               absl::StrCat(hf, "mlp.experts.", e, ".", proj, ".weight"), false,
               false, e});
        }
      }
      continue;
    }
    for (const auto& [our_part, hf_part] :
         std::vector<std::pair<std::string, std::string>>{
             {"gate", "gate_proj"}, {"up", "up_proj"}, {"down", "down_proj"}}) {
      m.push_back({ours + "feed_forward." + our_part + ".weight",
                   hf + "mlp." + hf_part + ".weight", false, false});
    }
  }
  m.push_back({"norm.weight", "model.norm.weight", false, false});
  if (!c.tied_embeddings) {
    m.push_back({"output.weight", "lm_head.weight", false, true});
  }
  return m;
}

// A host copy of `t` ([R, C], any dtype) transposed to [C, R].
absl::StatusOr<Tensor> Transpose2D(const Tensor& t) {
  if (t.ndim() != 2 || !t.device().is_cpu()) {
    return absl::InternalError(absl::StrCat(
        "Transpose2D needs a 2-D host tensor, got ", t.ToString()));
  }
  const int64_t rows = t.dim(0), cols = t.dim(1);
  FSDPP_ASSIGN_OR_RETURN(Tensor out,
                         Tensor::Empty({cols, rows}, t.dtype(), Device::Cpu()));
  const size_t e = DTypeSize(t.dtype());
  const char* src = static_cast<const char*>(t.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(dst + (c * rows + r) * e, src + (r * cols + c) * e, e);
    }
  }
  return out;
}

// A host copy of `t` (same dtype).
absl::StatusOr<Tensor> ToHost(const Tensor& t) {
  FSDPP_ASSIGN_OR_RETURN(Tensor out,
                         Tensor::Empty(t.shape(), t.dtype(), Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(Copy(t, &out));
  return out;
}

// Slice `e` of dim 0 of `t` [E, ...], without that dim (a view).
absl::StatusOr<Tensor> ExpertSlice(const Tensor& t, int64_t e) {
  FSDPP_ASSIGN_OR_RETURN(Tensor one, t.Narrow(e, 1));
  Shape rest(t.shape().begin() + 1, t.shape().end());
  return one.Reshape(std::move(rest));
}

std::map<std::string, Parameter*> ParameterMap(const Transformer& model) {
  std::map<std::string, Parameter*> out;
  for (const auto& [name, p] : model.NamedParameters()) out[name] = p;
  return out;
}

}  // namespace

namespace {
constexpr char kPeftPrefix[] = "base_model.model.";
}  // namespace

absl::StatusOr<std::string> PeftAdapterName(
    const std::vector<HfNameEntry>& mapping, const std::string& ours) {
  const size_t cut = ours.rfind(".lora_");
  if (cut == std::string::npos || !IsLoraParameter(ours)) {
    return absl::NotFoundError(
        absl::StrCat("PEFT: ", ours, " is not a LoRA adapter's tensor"));
  }
  const std::string base = ours.substr(0, cut) + ".weight";
  for (const HfNameEntry& e : mapping) {
    if (e.ours != base) continue;
    if (!absl::EndsWith(e.hf, ".weight")) break;
    return absl::StrCat(kPeftPrefix,
                        e.hf.substr(0, e.hf.size() - std::strlen(".weight")),
                        ours.substr(cut));
  }
  return absl::NotFoundError(absl::StrCat("PEFT: ", ours.substr(0, cut),
                                          " has no Hugging Face module name"));
}

std::string PeftAdapterModule(const std::string& peft_name) {
  if (!absl::StartsWith(peft_name, kPeftPrefix)) return "";
  for (const char* tail : {".lora_A.weight", ".lora_B.weight"}) {
    if (absl::EndsWith(peft_name, tail)) {
      return peft_name.substr(
          std::strlen(kPeftPrefix),
          peft_name.size() - std::strlen(kPeftPrefix) - std::strlen(tail));
    }
  }
  return "";
}

absl::StatusOr<std::vector<HfNameEntry>> HfNameMapping(
    const TransformerConfig& c) {
  FSDPP_RETURN_IF_ERROR(ValidateConfig(c));
  if (c.family == ModelFamily::kGpt2) {
    if (c.activation != Activation::kGelu || !c.bias ||
        c.kv_heads() != c.n_heads) {
      return absl::UnimplementedError(absl::StrCat(
          "HF GPT-2 has a GELU MLP, biases and no GQA; config '", c.name,
          "' has ", ActivationName(c.activation), ", bias ", c.bias,
          ", n_kv_heads ", c.kv_heads(), " of ", c.n_heads));
    }
    return Gpt2Mapping(c);
  }
  if (c.activation != Activation::kSwiGlu) {
    return absl::UnimplementedError(
        absl::StrCat("HF Llama has a SwiGLU MLP; config '", c.name, "' has ",
                     ActivationName(c.activation)));
  }
  if (c.moe.enabled()) {
    // OLMoE's architecture: q / k norms, softmax top-k (its norm_topk_prob
    // either way), every layer sparse, no shared experts or selection bias.
    std::vector<std::string> unlike;
    if (!c.qk_norm) unlike.push_back("no q / k norms");
    if (c.moe.sigmoid) unlike.push_back("sigmoid scores");
    if (c.moe.expert_bias) unlike.push_back("an expert bias");
    if (c.moe.shared_hidden > 0) unlike.push_back("shared experts");
    if (c.moe.route_scale != 1.0f) unlike.push_back("a route scale");
    if (c.moe.first_layer > 0) unlike.push_back("dense layers first");
    if (!unlike.empty()) {
      return absl::UnimplementedError(absl::StrCat(
          "config '", c.name,
          "': Hugging Face import and export of mixtures of experts use "
          "OLMoE's layout, and this mixture differs from it: ",
          absl::StrJoin(unlike, ", ")));
    }
  } else if (c.qk_norm) {
    return absl::UnimplementedError(absl::StrCat(
        "config '", c.name,
        "' has q / k norms without experts: HF's Llama has none (their "
        "Hugging Face layout here is OLMoE's)"));
  }
  return LlamaMapping(c);
}

Shape HfShape(const HfNameEntry& entry, const Shape& ours, int64_t vocab) {
  Shape shape = ours;
  if (entry.expert >= 0 && !shape.empty()) shape.erase(shape.begin());
  if (entry.vocab_rows) shape[0] = vocab;
  if (entry.transpose) std::swap(shape[0], shape[1]);
  return shape;
}

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> ExportHfTensors(
    const Transformer& model, HfExportSource source) {
  const TransformerConfig& c = model.config();
  FSDPP_ASSIGN_OR_RETURN(std::vector<HfNameEntry> mapping, HfNameMapping(c));
  const std::map<std::string, Parameter*> params = ParameterMap(model);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const HfNameEntry& entry : mapping) {
    const auto it = params.find(entry.ours);
    if (it == params.end()) {
      return absl::InternalError(absl::StrCat(
          "ExportHfTensors: model has no parameter '", entry.ours, "'"));
    }
    const Parameter* p = it->second;
    if (p->has_piece()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ExportHfTensors: ", entry.ours,
          " holds only a tensor-parallel piece (export from a checkpoint, "
          "which loads into any layout, or from an unsharded model)"));
    }
    Tensor t = source == HfExportSource::kValues ? p->data : p->grad;
    if (!t.defined() || t.is_meta()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ExportHfTensors: ", entry.ours,
          source == HfExportSource::kValues
              ? " is not materialised (call ToEmpty and InitWeights)"
              : " has no gradient (run a backward first)"));
    }
    if (entry.vocab_rows) {
      FSDPP_ASSIGN_OR_RETURN(t, t.Narrow(0, c.vocab_size));
    }
    if (entry.expert >= 0) {
      FSDPP_ASSIGN_OR_RETURN(t, ExpertSlice(t, entry.expert));
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor host, ToHost(t));
    if (entry.transpose) {
      FSDPP_ASSIGN_OR_RETURN(host, Transpose2D(host));
    }
    out.emplace_back(entry.hf, std::move(host));
  }
  return out;
}

absl::Status ExportSafetensors(const Transformer& model,
                               const std::string& path) {
  FSDPP_ASSIGN_OR_RETURN(auto tensors, ExportHfTensors(model));
  return WriteSafetensors(path, tensors, {{"format", "pt"}});
}

namespace {

// One safetensors file as an HfTensorSource.
class SingleFileSource final : public HfTensorSource {
 public:
  explicit SingleFileSource(std::unique_ptr<SafetensorsFile> file)
      : file_(std::move(file)) {}
  const SafetensorsFile* Find(const std::string& name) const override {
    return file_->Contains(name) ? file_.get() : nullptr;
  }
  std::vector<std::string> names() const override { return file_->names(); }
  std::string where() const override { return file_->path(); }

 private:
  std::unique_ptr<SafetensorsFile> file_;
};

}  // namespace

absl::Status ImportSafetensors(const std::string& path, Transformer* model) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         SafetensorsFile::Open(path));
  return ImportHfTensors(SingleFileSource(std::move(file)), model);
}

absl::StatusOr<std::vector<HfImportItem>> PlanHfImport(
    const HfTensorSource& source, const Transformer& model) {
  const TransformerConfig& c = model.config();
  FSDPP_ASSIGN_OR_RETURN(std::vector<HfNameEntry> mapping, HfNameMapping(c));
  const std::map<std::string, Parameter*> params = ParameterMap(model);
  const bool gpt2 = c.family == ModelFamily::kGpt2;
  const auto error = [&](absl::Status status) {
    return Annotate(status, absl::StrCat("import from ", source.where()));
  };
  std::vector<HfImportItem> items;
  std::set<std::string> used;
  std::vector<std::string> missing;
  for (const HfNameEntry& entry : mapping) {
    std::string name = entry.hf;
    if (gpt2 && source.Find(name) == nullptr &&
        absl::StartsWith(name, kGpt2Prefix)) {
      name = name.substr(std::strlen(kGpt2Prefix));
    }
    const SafetensorsFile* file = source.Find(name);
    if (file == nullptr) {
      missing.push_back(entry.hf);
      continue;
    }
    used.insert(name);
    const auto held = params.find(entry.ours);
    if (held == params.end()) {
      if (model.is_whole()) {
        return absl::InternalError(absl::StrCat(
            "PlanHfImport: the model has no parameter ", entry.ours));
      }
      continue;  // Another pipeline stage's: present is all we check here.
    }
    const Parameter* p = held->second;
    FSDPP_ASSIGN_OR_RETURN(SafetensorsTensorInfo info, file->Info(name));
    const Shape expected = HfShape(entry, p->shape, c.vocab_size);
    if (info.shape != expected) {
      return error(absl::InvalidArgumentError(absl::StrCat(
          name, " has shape ", ShapeToString(info.shape), ", expected ",
          ShapeToString(expected), " for ", entry.ours)));
    }
    if (!info.dtype.has_value() || !IsFloatingPoint(*info.dtype)) {
      return error(absl::InvalidArgumentError(absl::StrCat(
          name, " has dtype ", info.dtype_name, ", expected a float dtype")));
    }
    items.push_back({entry, name, file});
  }
  if (!missing.empty()) {
    return error(absl::NotFoundError(
        absl::StrCat("missing tensors: ", absl::StrJoin(missing, ", "))));
  }
  std::vector<std::string> unknown;
  for (const std::string& name : source.names()) {
    if (used.count(name) != 0) continue;
    if (c.tied_embeddings && name == "lm_head.weight") continue;
    if (gpt2 && (absl::EndsWith(name, ".attn.bias") ||
                 absl::EndsWith(name, ".attn.masked_bias"))) {
      continue;
    }
    unknown.push_back(name);
  }
  if (!unknown.empty()) {
    return error(absl::InvalidArgumentError(
        absl::StrCat("unknown tensors: ", absl::StrJoin(unknown, ", "))));
  }
  return items;
}

absl::Status ImportHfTensors(const HfTensorSource& source, Transformer* model) {
  const TransformerConfig& c = model->config();
  const std::map<std::string, Parameter*> params = ParameterMap(*model);
  const auto error = [&](absl::Status status) {
    return Annotate(status, absl::StrCat("import from ", source.where()));
  };
  // Everything is checked before the first parameter is written.
  FSDPP_ASSIGN_OR_RETURN(std::vector<HfImportItem> items,
                         PlanHfImport(source, *model));
  for (const HfImportItem& item : items) {
    const Parameter* p = params.at(item.entry.ours);
    if (p->has_piece()) {
      return error(absl::FailedPreconditionError(
          absl::StrCat(item.entry.ours,
                       " holds only a tensor-parallel piece (import into an "
                       "unsharded model and save a checkpoint, which loads "
                       "into any layout)")));
    }
    if (!p->data.defined() || p->data.is_meta()) {
      return error(absl::FailedPreconditionError(absl::StrCat(
          item.entry.ours, " is not materialised (call ToEmpty first)")));
    }
  }
  for (const HfImportItem& item : items) {
    const HfNameEntry& entry = item.entry;
    const std::string& name = item.name;
    const SafetensorsFile* file = item.file;
    Parameter* p = params.at(entry.ours);
    FSDPP_ASSIGN_OR_RETURN(Tensor host, file->Load(name));
    if (entry.transpose) {
      FSDPP_ASSIGN_OR_RETURN(host, Transpose2D(host));
    }
    Tensor dst = p->data;
    if (entry.expert >= 0) {
      FSDPP_ASSIGN_OR_RETURN(dst, ExpertSlice(p->data, entry.expert));
    }
    if (entry.vocab_rows && c.padded_vocab_size() != c.vocab_size) {
      FSDPP_ASSIGN_OR_RETURN(
          Tensor padding,
          p->data.Narrow(c.vocab_size, c.padded_vocab_size() - c.vocab_size));
      FSDPP_RETURN_IF_ERROR(error(Zero(&padding)));
      FSDPP_ASSIGN_OR_RETURN(dst, p->data.Narrow(0, c.vocab_size));
    }
    FSDPP_RETURN_IF_ERROR(error(Copy(host, &dst)));
  }
  return absl::OkStatus();
}

}  // namespace models
}  // namespace fsdpp
