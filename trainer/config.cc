// TrainConfig parsing (text format with positioned errors), --set overrides
// through protobuf reflection, and validation; see config.h.
#include "trainer/config.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "nn/checkpoint_wrapper.h"
#include "trainer/data/tokenizers.h"

namespace fsdpp {
namespace trainer {
namespace {

namespace pb = ::google::protobuf;

// "a, b, c": the field names of `message`, in declaration order.
std::string FieldNames(const pb::Descriptor* message) {
  std::vector<std::string> names;
  for (int i = 0; i < message->field_count(); ++i) {
    names.push_back(message->field(i)->name());
  }
  return absl::StrJoin(names, ", ");
}

// Full message name -> dotted section path ("" for TrainConfig itself).
const std::map<std::string, std::string>& SectionPaths() {
  static const auto* paths = [] {
    auto* result = new std::map<std::string, std::string>();
    std::vector<std::pair<const pb::Descriptor*, std::string>> pending = {
        {TrainConfig::descriptor(), ""}};
    while (!pending.empty()) {
      auto [message, path] = pending.back();
      pending.pop_back();
      result->emplace(message->full_name(), path);
      for (int i = 0; i < message->field_count(); ++i) {
        const pb::FieldDescriptor* field = message->field(i);
        if (field->message_type() != nullptr) {
          pending.emplace_back(field->message_type(),
                               path.empty()
                                   ? field->name()
                                   : absl::StrCat(path, ".", field->name()));
        }
      }
    }
    return result;
  }();
  return *paths;
}

// The field name a protobuf text-format error is about ("" if none):
//   Message type "T" has no field named "F".
//   Non-repeated field "F" is specified multiple times.
std::string FieldInError(const std::string& message, std::string* type) {
  constexpr absl::string_view kUnknownPrefix = "Message type \"";
  constexpr absl::string_view kUnknownMiddle = "\" has no field named \"";
  constexpr absl::string_view kRepeatedPrefix = "Non-repeated field \"";
  size_t name_begin;
  if (absl::StartsWith(message, kUnknownPrefix)) {
    const size_t middle = message.find(std::string(kUnknownMiddle));
    if (middle == std::string::npos) return "";
    *type =
        message.substr(kUnknownPrefix.size(), middle - kUnknownPrefix.size());
    name_begin = middle + kUnknownMiddle.size();
  } else if (absl::StartsWith(message, kRepeatedPrefix)) {
    name_begin = kRepeatedPrefix.size();
  } else {
    return "";
  }
  const size_t name_end = message.find('"', name_begin);
  if (name_end == std::string::npos) return "";
  return message.substr(name_begin, name_end - name_begin);
}

// Rewrites protobuf's unknown-field message into one naming the section and
// its fields; other messages pass through (an error at the end of the text
// says so).
std::string DescribeTextFormatError(const std::string& message,
                                    const std::string& type,
                                    const std::string& name) {
  const auto section = SectionPaths().find(type);
  const pb::Descriptor* descriptor =
      pb::DescriptorPool::generated_pool()->FindMessageTypeByName(type);
  if (name.empty() || section == SectionPaths().end() ||
      descriptor == nullptr) {
    if (absl::EndsWith(message, "got: ")) {
      return absl::StrCat(message, "end of input");
    }
    return message;
  }
  if (section->second.empty()) {
    return absl::StrCat("unknown section \"", name,
                        "\" (sections: ", FieldNames(descriptor), ")");
  }
  return absl::StrCat("unknown field \"", name, "\" in ", section->second,
                      " (fields: ", FieldNames(descriptor), ")");
}

// Collects the text-format parser's errors as "SOURCE:LINE:COLUMN: message"
// (1-based; the column counts bytes). protobuf reports errors about a field
// name at the token after it; those are moved back to the name itself.
class ErrorCollector : public pb::io::ErrorCollector {
 public:
  ErrorCollector(absl::string_view source, absl::string_view text)
      : source_(source), lines_(absl::StrSplit(text, '\n')) {}

  void AddError(int line, pb::io::ColumnNumber column,
                const std::string& message) override {
    std::string type;
    const std::string name = FieldInError(message, &type);
    size_t byte = 0;
    if (line >= 0 && static_cast<size_t>(line) < lines_.size()) {
      const absl::string_view text = lines_[line];
      // protobuf's column advances a tab to the next multiple of 8.
      for (int at = 0; byte < text.size() && at < column; ++byte) {
        at = text[byte] == '\t' ? (at / 8 + 1) * 8 : at + 1;
      }
      size_t end = byte;
      while (end > 0 && (text[end - 1] == ' ' || text[end - 1] == '\t')) {
        --end;
      }
      if (!name.empty() && end >= name.size() &&
          text.substr(end - name.size(), name.size()) == name) {
        byte = end - name.size();
      }
    } else {
      byte = static_cast<size_t>(column);
    }
    errors_.push_back(
        absl::StrCat(source_, ":", line + 1, ":", byte + 1, ": ",
                     DescribeTextFormatError(message, type, name)));
  }

  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::string source_;
  std::vector<absl::string_view> lines_;
  std::vector<std::string> errors_;
};

// --- Overrides -------------------------------------------------------------

absl::Status OverrideError(absl::string_view assignment,
                           absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("--set ", assignment, ": ", problem));
}

bool ParseBool(absl::string_view text, bool* value) {
  if (text == "true" || text == "1") {
    *value = true;
    return true;
  }
  if (text == "false" || text == "0") {
    *value = false;
    return true;
  }
  return false;
}

absl::Status SetScalar(absl::string_view assignment,
                       const pb::FieldDescriptor* field,
                       absl::string_view value, pb::Message* message) {
  const pb::Reflection* reflection = message->GetReflection();
  const auto bad_value = [&](absl::string_view expected) {
    return OverrideError(assignment,
                         absl::StrCat("\"", value, "\" is not ", expected));
  };
  switch (field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32: {
      int32_t parsed;
      if (!absl::SimpleAtoi(value, &parsed)) return bad_value("an int32");
      reflection->SetInt32(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_INT64: {
      int64_t parsed;
      if (!absl::SimpleAtoi(value, &parsed)) return bad_value("an int64");
      reflection->SetInt64(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_UINT32: {
      uint32_t parsed;
      if (!absl::SimpleAtoi(value, &parsed)) return bad_value("a uint32");
      reflection->SetUInt32(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t parsed;
      if (!absl::SimpleAtoi(value, &parsed)) return bad_value("a uint64");
      reflection->SetUInt64(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
    case pb::FieldDescriptor::CPPTYPE_FLOAT: {
      double parsed;
      if (!absl::SimpleAtod(value, &parsed) || !std::isfinite(parsed)) {
        return bad_value("a finite number");
      }
      if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_DOUBLE) {
        reflection->SetDouble(message, field, parsed);
      } else {
        reflection->SetFloat(message, field, static_cast<float>(parsed));
      }
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_BOOL: {
      bool parsed;
      if (!ParseBool(value, &parsed))
        return bad_value("a bool (true or false)");
      reflection->SetBool(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_STRING:
      reflection->SetString(message, field, std::string(value));
      return absl::OkStatus();
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      const pb::EnumValueDescriptor* parsed =
          field->enum_type()->FindValueByName(std::string(value));
      if (parsed == nullptr) {
        return bad_value(absl::StrCat("a ", field->enum_type()->name()));
      }
      reflection->SetEnum(message, field, parsed);
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return OverrideError(assignment, "unsupported field type");
}

// --- Validation helpers ----------------------------------------------------

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

absl::Status CheckPositive(absl::string_view path, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return Invalid(absl::StrCat(path, " must be positive, got ", value));
}

absl::Status CheckNonNegative(absl::string_view path, int64_t value,
                              absl::string_view note = "") {
  if (value >= 0) return absl::OkStatus();
  return Invalid(absl::StrCat(path, " must be >= 0", note, ", got ", value));
}

absl::StatusOr<DType> FloatDType(absl::string_view path,
                                 const std::string& name) {
  absl::StatusOr<DType> dtype = ParseDType(name);
  if (!dtype.ok() || !IsFloatingPoint(*dtype)) {
    return Invalid(
        absl::StrCat(path, " \"", name, "\" is not one of: f32, bf16, f16"));
  }
  return *dtype;
}

absl::Status ResolveModel(const ModelConfig& config,
                          models::TransformerConfig* model) {
  const std::string known = absl::StrJoin(models::ConfigNames(), ", ");
  if (config.name().empty()) {
    return Invalid(
        absl::StrCat("model.name is required (one of: ", known, ")"));
  }
  absl::StatusOr<models::TransformerConfig> named =
      models::ConfigByName(config.name());
  if (!named.ok()) {
    return Invalid(absl::StrCat("model.name \"", config.name(),
                                "\" is not a known model (one of: ", known,
                                ")"));
  }
  *model = *std::move(named);
  if (config.has_init_from() && (!absl::StartsWith(config.init_from(), "hf:") ||
                                 config.init_from().size() == 3)) {
    return Invalid(absl::StrCat("model.init_from \"", config.init_from(),
                                "\" is not hf:PATH (a Hugging Face model "
                                "directory)"));
  }
  // Derived sizes follow their base when only the base is overridden: an
  // MHA config (n_kv_heads == n_heads) stays MHA, and a GPT-2-style MLP
  // (ffn_hidden == 4 x dim) stays 4 x dim.
  const bool mha = model->n_kv_heads == model->n_heads;
  const bool ffn_4x = model->ffn_hidden == 4 * model->dim;
  struct Override {
    bool present;
    int64_t value;
    const char* path;
    int64_t* target;
  };
  const Override overrides[] = {
      {config.has_vocab_size(), config.vocab_size(), "model.vocab_size",
       &model->vocab_size},
      {config.has_vocab_pad_multiple(), config.vocab_pad_multiple(),
       "model.vocab_pad_multiple", &model->vocab_pad_multiple},
      {config.has_context_length(), config.context_length(),
       "model.context_length", &model->context_length},
      {config.has_n_layers(), config.n_layers(), "model.n_layers",
       &model->n_layers},
      {config.has_dim(), config.dim(), "model.dim", &model->dim},
      {config.has_n_heads(), config.n_heads(), "model.n_heads",
       &model->n_heads},
      {config.has_n_kv_heads(), config.n_kv_heads(), "model.n_kv_heads",
       &model->n_kv_heads},
      {config.has_ffn_hidden(), config.ffn_hidden(), "model.ffn_hidden",
       &model->ffn_hidden},
  };
  for (const Override& override_value : overrides) {
    if (!override_value.present) continue;
    FSDPP_RETURN_IF_ERROR(
        CheckPositive(override_value.path, override_value.value));
    *override_value.target = override_value.value;
  }
  if (mha && config.has_n_heads() && !config.has_n_kv_heads()) {
    model->n_kv_heads = model->n_heads;
  }
  if (ffn_4x && config.has_dim() && !config.has_ffn_hidden()) {
    model->ffn_hidden = 4 * model->dim;
  }
  if (config.has_moe()) {
    const MoeOverrides& moe = config.moe();
    if (!model->moe.enabled()) {
      return Invalid(
          absl::StrCat("model.moe overrides a mixture of experts, "
                       "but ",
                       model->name, " is dense"));
    }
    if (moe.has_scoring()) {
      if (moe.scoring() != "softmax" && moe.scoring() != "sigmoid") {
        return Invalid(
            absl::StrCat("model.moe.scoring must be \"softmax\" or "
                         "\"sigmoid\", got \"",
                         moe.scoring(), "\""));
      }
      model->moe.sigmoid = moe.scoring() == "sigmoid";
    }
    if (moe.has_num_experts()) {
      FSDPP_RETURN_IF_ERROR(
          CheckPositive("model.moe.num_experts", moe.num_experts()));
      model->moe.num_experts = moe.num_experts();
    }
    if (moe.has_top_k()) {
      FSDPP_RETURN_IF_ERROR(CheckPositive("model.moe.top_k", moe.top_k()));
      model->moe.top_k = moe.top_k();
    }
    if (moe.has_aux_loss_coef()) model->moe.aux_loss_coef = moe.aux_loss_coef();
    if (moe.has_expert_bias()) model->moe.expert_bias = moe.expert_bias();
    if (moe.has_bias_update_rate()) {
      model->moe.bias_update_rate = moe.bias_update_rate();
    }
  }
  const absl::Status valid = models::ValidateConfig(*model);
  if (!valid.ok()) return Invalid(absl::StrCat("model: ", valid.message()));
  return absl::OkStatus();
}

// The degrees (dp_shard inferred when -1) and the sharding options, into
// the layout; the rules between them are the layout's (recipe::Layout::
// Validate, once everything is resolved).
absl::Status ResolveParallelism(const ParallelismConfig& config, int world_size,
                                ResolvedTrainConfig* out) {
  FSDPP_RETURN_IF_ERROR(
      CheckPositive("parallelism.dp_replicate", config.dp_replicate()));
  const int replicate = config.dp_replicate();
  FSDPP_RETURN_IF_ERROR(CheckPositive("parallelism.tp", config.tp()));
  const int tp = config.tp();
  FSDPP_RETURN_IF_ERROR(CheckPositive("parallelism.pp", config.pp()));
  const int pp = config.pp();
  FSDPP_RETURN_IF_ERROR(CheckPositive("parallelism.cp", config.cp()));
  const int cp = config.cp();
  int shard = config.dp_shard();
  if (shard == 0 || shard < -1) {
    return Invalid(absl::StrCat(
        "parallelism.dp_shard must be positive or -1 (inferred), got ", shard));
  }
  const int64_t others = static_cast<int64_t>(replicate) * tp * pp * cp;
  const std::string pp_text = pp > 1 ? absl::StrCat("pp ", pp, " x ") : "";
  const std::string cp_text = cp > 1 ? absl::StrCat(" x cp ", cp) : "";
  if (shard == -1 && world_size % others != 0) {
    return Invalid(
        absl::StrCat("parallelism: cannot infer dp_shard: the world size ",
                     world_size, " is not divisible by ", pp_text,
                     "dp_replicate ", replicate, cp_text, " x tp ", tp));
  }
  if (shard != -1 && others * shard != world_size) {
    return Invalid(absl::StrCat("parallelism: ", pp_text, "dp_replicate ",
                                replicate, " x dp_shard ", shard, cp_text,
                                " x tp ", tp, " = ", others * shard,
                                " ranks, but the world size is ", world_size));
  }
  FSDPP_RETURN_IF_ERROR(CheckNonNegative(
      "parallelism.hpz_degree", config.hpz_degree(), " (0 or 1 = off)"));
  recipe::Layout& layout = out->layout;
  layout.world = world_size;
  layout.dp_replicate = replicate;
  layout.tp = tp;
  layout.cp = cp;
  layout.cp_style = config.cp_style();
  FSDPP_RETURN_IF_ERROR(CheckPositive("parallelism.ep", config.ep()));
  layout.ep = config.ep();
  layout.pp = pp;
  // Sequence parallelism needs a tp axis (the layout refuses it without);
  // loss parallelism, on by default, takes effect only on one.
  layout.sequence_parallel = config.sequence_parallel();
  layout.loss_parallel = tp > 1 && config.loss_parallel();
  layout.hpz_degree = std::max(1, config.hpz_degree());
  layout.reshard_after_forward = config.reshard_after_forward();
  layout.reshard_after_backward = config.reshard_after_backward();
  layout.offload = config.offload();
  return absl::OkStatus();
}

// Pipeline parallelism: the micro-batch count (pp_microbatches sets the
// micro batch), the schedule and the cut points, each error naming the
// field; whether the schedule and the split work is the layout's rule.
absl::Status ResolvePipeline(const ParallelismConfig& config,
                             const TrainingConfig& training,
                             ResolvedTrainConfig* out) {
  recipe::Layout& layout = out->layout;
  const bool defaults =
      config.pp_schedule() == "1f1b" && config.pp_microbatches() == 0 &&
      config.pp_virtual_stages() == 1 && config.pp_cuts().empty();
  if (layout.pp == 1) {
    if (!defaults) {
      return Invalid(
          "parallelism.pp_schedule, pp_microbatches, pp_virtual_stages and "
          "pp_cuts need parallelism.pp > 1");
    }
    return absl::OkStatus();
  }
  FSDPP_RETURN_IF_ERROR(CheckNonNegative("parallelism.pp_microbatches",
                                         config.pp_microbatches(),
                                         " (0 = the accumulation steps)"));
  FSDPP_RETURN_IF_ERROR(CheckPositive("parallelism.pp_virtual_stages",
                                      config.pp_virtual_stages()));
  const int64_t dp = layout.data_parallel();
  if (config.pp_microbatches() > 0) {
    const int64_t per_step = dp * config.pp_microbatches();
    if (training.global_batch() % per_step != 0) {
      return Invalid(
          absl::StrCat("parallelism.pp_microbatches ", config.pp_microbatches(),
                       ": training.global_batch ", training.global_batch(),
                       " is not divisible by the data-parallel degree ", dp,
                       " x ", config.pp_microbatches(), " micro-batches"));
    }
    layout.micro_batch = training.global_batch() / per_step;
    layout.grad_accumulation = config.pp_microbatches();
  } else {
    // Derived from the accumulation steps: a pipeline with fewer
    // micro-batches than ranks leaves ranks idle (1F1B refuses it), so
    // too few are raised to the smallest count that fills the pipeline
    // (at least pp; a multiple of pp for interleaved) and divides the
    // data-parallel rank's rows; the micro batch shrinks to match.
    const bool interleaved = config.pp_schedule() == "interleaved";
    const int64_t m = layout.grad_accumulation;
    const int64_t rows = training.global_batch() / dp;
    if (m < layout.pp || (interleaved && m % layout.pp != 0)) {
      for (int64_t n = std::max<int64_t>(m, layout.pp); n <= rows; ++n) {
        if (rows % n != 0 || (interleaved && n % layout.pp != 0)) continue;
        out->notes.push_back(absl::StrCat(
            "pipeline micro-batches: ", n, " (micro batch ", rows / n,
            "), raised from the ", m, " accumulation step(s) of micro batch ",
            layout.micro_batch, " to fill ", layout.pp,
            " pipeline ranks; set parallelism.pp_microbatches to choose"));
        layout.micro_batch = rows / n;
        layout.grad_accumulation = n;
        break;
      }
    }
  }
  std::vector<int> cuts;
  for (absl::string_view piece :
       absl::StrSplit(config.pp_cuts(), ',', absl::SkipWhitespace())) {
    int cut = 0;
    if (!absl::SimpleAtoi(piece, &cut)) {
      return Invalid(absl::StrCat("parallelism.pp_cuts \"", config.pp_cuts(),
                                  "\": \"", piece, "\" is not a block index"));
    }
    cuts.push_back(cut);
  }
  layout.pp_schedule = config.pp_schedule();
  layout.pp_virtual_stages = config.pp_virtual_stages();
  layout.pp_cuts = std::move(cuts);
  return absl::OkStatus();
}

absl::Status CheckUnitInterval(absl::string_view path, double value,
                               bool include_one) {
  const bool ok = value >= 0.0 && (include_one ? value <= 1.0 : value < 1.0);
  if (ok) return absl::OkStatus();
  return Invalid(absl::StrCat(path, " must be in [0, 1",
                              include_one ? "]" : ")", ", got ", value));
}

// The optimizer's, schedule's and loss scaler's fields of `config`.
absl::Status CheckOptimizerFields(const TrainingConfig& config) {
  if (!(config.lr() > 0.0 && std::isfinite(config.lr()))) {
    return Invalid(absl::StrCat(
        "training.lr must be a positive finite number, got ", config.lr()));
  }
  FSDPP_RETURN_IF_ERROR(
      CheckNonNegative("training.warmup_steps", config.warmup_steps()));
  if (config.warmup_steps() > config.steps()) {
    return Invalid(absl::StrCat("training.warmup_steps ", config.warmup_steps(),
                                " is more than training.steps ",
                                config.steps()));
  }
  if (config.schedule() != "cosine" && config.schedule() != "linear" &&
      config.schedule() != "constant") {
    return Invalid(absl::StrCat("training.schedule \"", config.schedule(),
                                "\" is not one of: cosine, linear, constant"));
  }
  FSDPP_RETURN_IF_ERROR(
      CheckUnitInterval("training.min_lr_ratio", config.min_lr_ratio(), true));
  if (!(config.weight_decay() >= 0.0 && std::isfinite(config.weight_decay()))) {
    return Invalid(absl::StrCat("training.weight_decay must be >= 0, got ",
                                config.weight_decay()));
  }
  if (!(config.grad_clip() >= 0.0 && std::isfinite(config.grad_clip()))) {
    return Invalid(absl::StrCat(
        "training.grad_clip must be >= 0 (0 = off), got ", config.grad_clip()));
  }
  FSDPP_RETURN_IF_ERROR(
      CheckUnitInterval("training.adam_beta1", config.adam_beta1(), false));
  FSDPP_RETURN_IF_ERROR(
      CheckUnitInterval("training.adam_beta2", config.adam_beta2(), false));
  if (!(config.adam_eps() > 0.0 && std::isfinite(config.adam_eps()))) {
    return Invalid(absl::StrCat("training.adam_eps must be positive, got ",
                                config.adam_eps()));
  }
  if (!(config.initial_loss_scale() > 0.0 &&
        std::isfinite(config.initial_loss_scale()))) {
    return Invalid(
        absl::StrCat("training.initial_loss_scale must be positive, got ",
                     config.initial_loss_scale()));
  }
  FSDPP_RETURN_IF_ERROR(CheckPositive("training.loss_scale_growth_interval",
                                      config.loss_scale_growth_interval()));
  return absl::OkStatus();
}

// The batch (micro batch, accumulation, sequence), precision and memory
// options into the layout; the optimizer's and schedule's fields checked.
absl::Status ResolveTraining(const TrainingConfig& config,
                             ResolvedTrainConfig* out) {
  FSDPP_RETURN_IF_ERROR(CheckPositive("training.steps", config.steps()));
  FSDPP_RETURN_IF_ERROR(
      CheckPositive("training.global_batch", config.global_batch()));
  FSDPP_RETURN_IF_ERROR(
      CheckPositive("training.micro_batch", config.micro_batch()));
  recipe::Layout& layout = out->layout;
  const int64_t dp_degree = layout.data_parallel();
  // The micro batch is a memory knob, the global batch the math: a micro
  // batch larger than a data-parallel rank's rows is that many rows (the
  // same config runs at any world size whose dp degree divides the batch).
  int64_t micro_batch = config.micro_batch();
  if (config.global_batch() % dp_degree == 0 &&
      micro_batch > config.global_batch() / dp_degree) {
    micro_batch = config.global_batch() / dp_degree;
    out->notes.push_back(
        absl::StrCat("micro batch ", micro_batch, ": training.micro_batch ",
                     config.micro_batch(), " is more than the ", micro_batch,
                     " rows of training.global_batch ", config.global_batch(),
                     " per data-parallel rank (", dp_degree, ")"));
  }
  const int64_t per_pass = dp_degree * micro_batch;
  if (config.global_batch() % per_pass != 0) {
    return Invalid(absl::StrCat(
        "training.global_batch ", config.global_batch(),
        " is not divisible by the data-parallel degree ", dp_degree,
        " x micro_batch ", micro_batch, " = ", per_pass));
  }
  if (config.seq_len() < 0) {
    return Invalid(absl::StrCat(
        "training.seq_len must be positive (or 0 for the model's context "
        "length), got ",
        config.seq_len()));
  }
  FSDPP_RETURN_IF_ERROR(CheckOptimizerFields(config));
  if (config.device() != "cpu" && config.device() != "cuda") {
    return Invalid(absl::StrCat("training.device \"", config.device(),
                                "\" is not one of: cpu, cuda"));
  }
  FSDPP_ASSIGN_OR_RETURN(layout.param_dtype,
                         FloatDType("training.mixed_precision.param_dtype",
                                    config.mixed_precision().param_dtype()));
  FSDPP_ASSIGN_OR_RETURN(layout.reduce_dtype,
                         FloatDType("training.mixed_precision.reduce_dtype",
                                    config.mixed_precision().reduce_dtype()));
  layout.seq_len =
      config.seq_len() == 0 ? out->model.context_length : config.seq_len();
  layout.micro_batch = micro_batch;
  layout.grad_accumulation = config.global_batch() / per_pass;
  absl::StatusOr<nn::CheckpointPolicy> ac =
      nn::CheckpointPolicy::Parse(config.activation_checkpointing());
  if (!ac.ok()) {
    return Invalid(absl::StrCat("training.activation_checkpointing: ",
                                ac.status().message()));
  }
  layout.activation_checkpointing = *ac;
  layout.fused_attention = config.fused_attention();
  layout.loss_chunk_tokens = config.loss_chunk_tokens();
  out->tokens_per_step = config.global_batch() * layout.seq_len;
  return absl::OkStatus();
}

absl::Status ResolveData(const DataConfig& config, ResolvedTrainConfig* out) {
  if (config.dataset().empty()) {
    return Invalid("data.dataset is required (\"embedded\" or a file path)");
  }
  const absl::StatusOr<int32_t> vocab = TokenizerVocabSize(config.tokenizer());
  if (!vocab.ok()) {
    return Invalid(absl::StrCat(
        "data.tokenizer \"", config.tokenizer(),
        "\" is not one of: ", absl::StrJoin(TokenizerNames(), ", ")));
  }
  if (*vocab > out->model.vocab_size) {
    return Invalid(absl::StrCat("data.tokenizer ", config.tokenizer(),
                                " produces ", *vocab, " token ids but model ",
                                out->model.name, " has vocab_size ",
                                out->model.vocab_size));
  }
  if (!IsEmbeddedDataset(config.dataset()) &&
      !IsRegularFile(config.dataset())) {
    if (IsDirectory(config.dataset())) {
      return Invalid(absl::StrCat("data.dataset \"", config.dataset(),
                                  "\" is a directory, not a file"));
    }
    return absl::NotFoundError(absl::StrCat(
        "data.dataset file \"", config.dataset(), "\" does not exist"));
  }
  FSDPP_RETURN_IF_ERROR(CheckUnitInterval("data.validation_fraction",
                                          config.validation_fraction(), false));
  out->tokenizer_vocab_size = *vocab;
  return absl::OkStatus();
}

// data.document_masking: on at the tokenizer's end-of-text id where the run
// supports it; where not, an error when the config asks for it explicitly,
// else off with a note saying why. On CUDA it is off unless asked for: the
// masked attention runs there on the reference kernel, not cuDNN.
absl::Status ResolveDocumentMasking(const TrainConfig& config,
                                    ResolvedTrainConfig* out) {
  if (!config.data().document_masking()) return absl::OkStatus();
  std::string unsupported;
  if (config.training().device() == "cuda" &&
      !config.data().has_document_masking()) {
    out->notes.push_back(
        "data.document_masking off: on CUDA the masked attention runs on the "
        "reference kernel, not cuDNN (set it true to use it)");
    return absl::OkStatus();
  }
  if (!out->layout.fused_attention) {
    unsupported = "it needs training.fused_attention";
  }
  if (!unsupported.empty()) {
    if (config.data().has_document_masking()) {
      return Invalid(absl::StrCat("data.document_masking: ", unsupported,
                                  " (set it false)"));
    }
    out->notes.push_back(
        absl::StrCat("data.document_masking off: ", unsupported));
    return absl::OkStatus();
  }
  FSDPP_ASSIGN_OR_RETURN(const int32_t eot,
                         TokenizerEotId(config.data().tokenizer()));
  out->layout.document_eot_id = eot;
  return out->layout.Validate(out->model);
}

absl::Status CheckCheckpoint(const CheckpointConfig& config) {
  FSDPP_RETURN_IF_ERROR(CheckNonNegative("checkpoint.interval",
                                         config.interval(), " (0 = never)"));
  FSDPP_RETURN_IF_ERROR(CheckNonNegative(
      "checkpoint.keep_latest_k", config.keep_latest_k(), " (0 = keep all)"));
  if (config.folder().empty() && (config.interval() > 0 || config.resume())) {
    return Invalid(
        "checkpoint.folder is required when checkpoint.interval > 0 or "
        "checkpoint.resume is true");
  }
  if (config.resume_required() && !config.resume()) {
    return Invalid("checkpoint.resume_required needs checkpoint.resume: true");
  }
  return absl::OkStatus();
}

absl::Status CheckMetrics(const MetricsConfig& config) {
  FSDPP_RETURN_IF_ERROR(
      CheckPositive("metrics.log_interval", config.log_interval()));
  FSDPP_RETURN_IF_ERROR(
      CheckNonNegative("metrics.trace_start_step", config.trace_start_step()));
  FSDPP_RETURN_IF_ERROR(CheckNonNegative(
      "metrics.trace_steps", config.trace_steps(), " (0 = no trace)"));
  if (config.trace_steps() > 0 && config.trace_path().empty()) {
    return Invalid(
        "metrics.trace_path is required when metrics.trace_steps > 0");
  }
  if (!std::isfinite(config.peak_tflops()) || config.peak_tflops() < 0) {
    return Invalid(absl::StrCat(
        "metrics.peak_tflops must be >= 0 (0 = measure or look up), got ",
        config.peak_tflops()));
  }
  FSDPP_RETURN_IF_ERROR(CheckNonNegative("metrics.throughput_warmup_steps",
                                         config.throughput_warmup_steps()));
  FSDPP_RETURN_IF_ERROR(CheckNonNegative(
      "metrics.profile_steps", config.profile_steps(), " (0 = no profile)"));
  return absl::OkStatus();
}

absl::Status CheckValidation(const ValidationConfig& config,
                             const DataConfig& data) {
  FSDPP_RETURN_IF_ERROR(CheckNonNegative("validation.interval",
                                         config.interval(), " (0 = never)"));
  if (config.interval() > 0) {
    FSDPP_RETURN_IF_ERROR(
        CheckPositive("validation.batches", config.batches()));
    if (data.validation_fraction() == 0.0) {
      return Invalid(absl::StrCat("validation.interval ", config.interval(),
                                  " needs data.validation_fraction > 0"));
    }
  }
  return absl::OkStatus();
}

// Sets every unset field to its default, recursively, so printing shows the
// effective values.
void FillDefaults(pb::Message* message) {
  const pb::Descriptor* descriptor = message->GetDescriptor();
  const pb::Reflection* reflection = message->GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) continue;
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        FillDefaults(reflection->MutableMessage(message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(message, field,
                             reflection->GetInt32(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(message, field,
                             reflection->GetInt64(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        reflection->SetUInt32(message, field,
                              reflection->GetUInt32(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, field,
                              reflection->GetUInt64(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        reflection->SetDouble(message, field,
                              reflection->GetDouble(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        reflection->SetFloat(message, field,
                             reflection->GetFloat(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(message, field,
                            reflection->GetBool(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field,
                              reflection->GetString(*message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        reflection->SetEnum(message, field,
                            reflection->GetEnum(*message, field));
        break;
    }
  }
}

void Anchor(const std::string& base, std::string* path) {
  if (path->empty() || absl::StartsWith(*path, "/")) return;
  *path = absl::StrCat(base, "/", *path);
}

}  // namespace

absl::StatusOr<TrainConfig> ParseTrainConfig(absl::string_view text,
                                             absl::string_view source) {
  const std::string contents(text);
  ErrorCollector errors(source, contents);
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  TrainConfig config;
  if (!parser.ParseFromString(contents, &config)) {
    if (errors.errors().empty()) {
      return Invalid(absl::StrCat(source, ": cannot parse the config"));
    }
    return Invalid(absl::StrJoin(errors.errors(), "\n"));
  }
  return config;
}

absl::StatusOr<TrainConfig> LoadTrainConfig(const std::string& path) {
  FSDPP_ASSIGN_OR_RETURN(std::string text,
                         ReadFileToString(path, "config file"));
  return ParseTrainConfig(text, path);
}

absl::Status ApplyOverride(absl::string_view assignment, TrainConfig* config) {
  const size_t equals = assignment.find('=');
  if (equals == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--set \"", assignment, "\": expected SECTION.FIELD=VALUE"));
  }
  const absl::string_view path = assignment.substr(0, equals);
  const absl::string_view value = assignment.substr(equals + 1);
  const std::vector<absl::string_view> names = absl::StrSplit(path, '.');
  pb::Message* message = config;
  std::string prefix;  // The dotted path walked so far.
  for (size_t i = 0; i < names.size(); ++i) {
    const pb::Descriptor* descriptor = message->GetDescriptor();
    const pb::FieldDescriptor* field =
        descriptor->FindFieldByName(std::string(names[i]));
    if (field == nullptr) {
      if (prefix.empty()) {
        return OverrideError(
            assignment,
            absl::StrCat("unknown section \"", names[i],
                         "\" (sections: ", FieldNames(descriptor), ")"));
      }
      return OverrideError(
          assignment,
          absl::StrCat("unknown field \"", names[i], "\" in ", prefix,
                       " (fields: ", FieldNames(descriptor), ")"));
    }
    prefix = prefix.empty() ? std::string(names[i])
                            : absl::StrCat(prefix, ".", names[i]);
    const bool last = i + 1 == names.size();
    if (field->is_repeated()) {
      return OverrideError(assignment, absl::StrCat(prefix,
                                                    " is a list; --set cannot "
                                                    "set it"));
    }
    if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (last) {
        return OverrideError(
            assignment,
            absl::StrCat(prefix, " is a section; set one of its fields: ",
                         FieldNames(field->message_type())));
      }
      message = message->GetReflection()->MutableMessage(message, field);
      continue;
    }
    if (!last) {
      return OverrideError(assignment,
                           absl::StrCat(prefix, " is a field, not a section"));
    }
    return SetScalar(assignment, field, value, message);
  }
  return OverrideError(assignment, "empty path");
}

absl::Status ApplyOverrides(absl::Span<const std::string> assignments,
                            TrainConfig* config) {
  for (const std::string& assignment : assignments) {
    FSDPP_RETURN_IF_ERROR(ApplyOverride(assignment, config));
  }
  return absl::OkStatus();
}

absl::StatusOr<ResolvedTrainConfig> ResolveTrainConfig(
    const TrainConfig& config, int world_size) {
  if (world_size < 1) {
    return Invalid(
        absl::StrCat("world size must be positive, got ", world_size));
  }
  ResolvedTrainConfig resolved;
  FSDPP_RETURN_IF_ERROR(ResolveModel(config.model(), &resolved.model));
  FSDPP_RETURN_IF_ERROR(
      ResolveParallelism(config.parallelism(), world_size, &resolved));
  FSDPP_RETURN_IF_ERROR(ResolveTraining(config.training(), &resolved));
  FSDPP_RETURN_IF_ERROR(
      ResolvePipeline(config.parallelism(), config.training(), &resolved));
  for (absl::string_view pattern :
       absl::StrSplit(config.model().freeze(), ',', absl::SkipWhitespace())) {
    resolved.layout.freeze.emplace_back(absl::StripAsciiWhitespace(pattern));
  }
  const LoraConfig& lora = config.model().lora();
  if (!(lora.dropout() >= 0 && lora.dropout() < 1)) {
    return Invalid(absl::StrCat("model.lora.dropout must be in [0, 1), got ",
                                lora.dropout()));
  }
  if (lora.dropout() > 0 && config.training().device() == "cuda") {
    return Invalid(
        "model.lora.dropout > 0 on CUDA: the keyed dropout (nn/dropout.h) "
        "runs on the CPU only for now; set it 0 there");
  }
  if (lora.has_init_from()) {
    if (lora.rank() < 1) {
      return Invalid("model.lora.init_from needs model.lora.rank >= 1");
    }
    if (!IsDirectory(lora.init_from())) {
      return Invalid(absl::StrCat("model.lora.init_from \"", lora.init_from(),
                                  "\" is not a directory (a PEFT adapter's)"));
    }
  }
  if (!std::isfinite(lora.alpha()) || lora.alpha() <= 0) {
    return Invalid(
        absl::StrCat("model.lora.alpha must be positive, got ", lora.alpha()));
  }
  resolved.layout.lora.rank = lora.rank();
  resolved.layout.lora.alpha = lora.alpha();
  resolved.layout.lora.dropout = lora.dropout();
  for (absl::string_view target :
       absl::StrSplit(lora.targets(), ',', absl::SkipWhitespace())) {
    resolved.layout.lora.targets.emplace_back(
        absl::StripAsciiWhitespace(target));
  }
  FSDPP_RETURN_IF_ERROR(resolved.layout.Validate(resolved.model));
  FSDPP_RETURN_IF_ERROR(ResolveData(config.data(), &resolved));
  FSDPP_RETURN_IF_ERROR(ResolveDocumentMasking(config, &resolved));
  FSDPP_RETURN_IF_ERROR(CheckCheckpoint(config.checkpoint()));
  FSDPP_RETURN_IF_ERROR(CheckMetrics(config.metrics()));
  FSDPP_RETURN_IF_ERROR(CheckValidation(config.validation(), config.data()));
  const double max_memory = config.training().max_memory_gib();
  if (!std::isfinite(max_memory) || max_memory < 0) {
    return Invalid(absl::StrCat(
        "training.max_memory_gib must be >= 0 (0 = this machine's memory "
        "shared by the node's ranks), got ",
        max_memory));
  }
  const double timeout_s = config.comm().timeout_s();
  if (!(timeout_s >= 1.0 && timeout_s <= 86400.0)) {
    return Invalid(absl::StrCat(
        "comm.timeout_s must be between 1 and 86400 seconds, got ", timeout_s));
  }
  resolved.comm_timeout = absl::Seconds(timeout_s);
  return resolved;
}

absl::Status Validate(const TrainConfig& config, int world_size) {
  return ResolveTrainConfig(config, world_size).status();
}

void MakePathsAbsolute(const std::string& base_directory, TrainConfig* config) {
  DataConfig* data = config->mutable_data();
  if (!IsEmbeddedDataset(data->dataset())) {
    Anchor(base_directory, data->mutable_dataset());
  }
  if (data->has_tokenizer_dir()) {
    Anchor(base_directory, data->mutable_tokenizer_dir());
  }
  ModelConfig* model = config->mutable_model();
  if (absl::StartsWith(model->init_from(), "hf:")) {
    std::string path = model->init_from().substr(3);
    Anchor(base_directory, &path);
    model->set_init_from("hf:" + path);
  }
  if (model->lora().has_init_from()) {
    Anchor(base_directory, model->mutable_lora()->mutable_init_from());
  }
  CheckpointConfig* checkpoint = config->mutable_checkpoint();
  std::string folder = checkpoint->folder();  // May be the default.
  Anchor(base_directory, &folder);
  checkpoint->set_folder(folder);
  MetricsConfig* metrics = config->mutable_metrics();
  if (metrics->has_jsonl_path()) {
    Anchor(base_directory, metrics->mutable_jsonl_path());
  }
  std::string trace = metrics->trace_path();
  Anchor(base_directory, &trace);
  metrics->set_trace_path(trace);
}

std::string InvocationDirectory() {
  const char* bazel = std::getenv("BUILD_WORKING_DIRECTORY");
  if (bazel != nullptr && bazel[0] != '\0') return bazel;
  char buffer[4096];
  if (::getcwd(buffer, sizeof(buffer)) != nullptr) return buffer;
  return ".";
}

std::string FormatTrainConfig(const TrainConfig& config) {
  TrainConfig effective = config;
  FillDefaults(&effective);
  std::string text;
  pb::TextFormat::PrintToString(effective, &text);
  return text;
}

}  // namespace trainer
}  // namespace fsdpp
