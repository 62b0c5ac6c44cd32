// The run's layout; see layout.h.
#include "recipe/layout.h"

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "models/transformer.h"
#include "nn/linear.h"
#include "nn/module.h"
#include "parallel/pipeline_schedule.h"

namespace fsdpp {
namespace recipe {
namespace {

// ", AC", ", AC every:2", ", AC selective", or nothing.
std::string AcLabel(const nn::CheckpointPolicy& policy) {
  switch (policy.kind) {
    case nn::CheckpointPolicy::Kind::kNone:
      return "";
    case nn::CheckpointPolicy::Kind::kFull:
      return ", AC";
    case nn::CheckpointPolicy::Kind::kEvery:
    case nn::CheckpointPolicy::Kind::kSelective:
      return absl::StrCat(", AC ", policy.ToString());
  }
  return "";
}

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

absl::Status CheckDegrees(const Layout& l) {
  if (l.world < 1 || l.dp_replicate < 1 || l.tp < 1 || l.cp < 1 || l.pp < 1 ||
      l.pp_virtual_stages < 1) {
    return Invalid(absl::StrCat(
        "parallelism: the world size ", l.world, ", dp_replicate ",
        l.dp_replicate, ", tp ", l.tp, ", cp ", l.cp, ", pp ", l.pp,
        " and pp_virtual_stages ", l.pp_virtual_stages, " must be positive"));
  }
  const int64_t others =
      static_cast<int64_t>(l.pp) * l.dp_replicate * l.cp * l.tp;
  if (l.world % others != 0) {
    return Invalid(absl::StrCat(
        "parallelism: ", l.pp > 1 ? absl::StrCat("pp ", l.pp, " x ") : "",
        "dp_replicate ", l.dp_replicate,
        l.cp > 1 ? absl::StrCat(" x cp ", l.cp) : "", " x tp ", l.tp,
        " does not divide the world size ", l.world));
  }
  if (l.tp == 1 && l.sequence_parallel) {
    return Invalid(
        "parallelism.sequence_parallel needs parallelism.tp > 1 (it shards "
        "the tensor-parallel activations)");
  }
  if (l.tp == 1 && l.loss_parallel) {
    return Invalid(
        "parallelism.loss_parallel needs parallelism.tp > 1 (it computes the "
        "loss on vocabulary-split logits)");
  }
  if (l.hpz_degree < 1) {
    return Invalid(absl::StrCat("parallelism.hpz_degree must be >= 1 (1 = off)",
                                ", got ", l.hpz_degree));
  }
  if (l.hpz_degree > 1) {
    if (!l.reshard_after_forward) {
      return Invalid(absl::StrCat("parallelism.hpz_degree ", l.hpz_degree,
                                  " needs parallelism.reshard_after_forward: "
                                  "true"));
    }
    if (l.fsdp_shard() % l.hpz_degree != 0) {
      return Invalid(absl::StrCat(
          "parallelism.hpz_degree ", l.hpz_degree, " does not divide ",
          l.cp > 1 ? "dp_shard x cp " : "dp_shard ", l.fsdp_shard()));
    }
  }
  return absl::OkStatus();
}

// What tensor parallelism splits must divide by tp (the family's plan
// checks the same on the model itself).
absl::Status CheckTensorParallel(const Layout& l,
                                 const models::TransformerConfig& m) {
  const int tp = l.tp;
  if (tp == 1) return absl::OkStatus();
  const auto not_divisible = [&](absl::string_view what, int64_t n) {
    return Invalid(absl::StrCat("parallelism.tp ", tp, " does not divide ",
                                what, " (", n, ")"));
  };
  if (m.n_heads % tp != 0) return not_divisible("model.n_heads", m.n_heads);
  if (m.kv_heads() % tp != 0 && tp % m.kv_heads() != 0) {
    return Invalid(absl::StrCat("parallelism.tp ", tp,
                                " must divide model.n_kv_heads (", m.kv_heads(),
                                ") or be a multiple of it"));
  }
  if (m.ffn_hidden % tp != 0) {
    return not_divisible("model.ffn_hidden", m.ffn_hidden);
  }
  if (m.padded_vocab_size() % tp != 0) {
    return not_divisible(
        "the padded vocabulary (model.vocab_pad_multiple pads it)",
        m.padded_vocab_size());
  }
  if (l.sequence_parallel && l.seq(m) % tp != 0) {
    return not_divisible("training.seq_len with sequence_parallel", l.seq(m));
  }
  return absl::OkStatus();
}

// Context parallelism: a whole model per rank, the fused attention, the
// sequence in 2 cp equal chunks.
absl::Status CheckContextParallel(const Layout& l,
                                  const models::TransformerConfig& m) {
  if (l.cp_style != "ring" && l.cp_style != "alltoall") {
    return Invalid(absl::StrCat("parallelism.cp_style \"", l.cp_style,
                                "\" is not one of ring, alltoall"));
  }
  if (l.cp == 1) return absl::OkStatus();
  if (l.cp_style == "alltoall") {
    // The heads on a tp rank (a kv head shared by tp ranks counts once).
    const int64_t heads = m.n_heads / l.tp;
    const int64_t kv =
        m.kv_heads() % l.tp == 0 ? m.kv_heads() / l.tp : int64_t{1};
    if (heads % l.cp != 0 || kv % l.cp != 0) {
      return Invalid(absl::StrCat(
          "parallelism.cp_style alltoall splits each rank's heads over cp ",
          l.cp, ": ", heads, " query and ", kv,
          " key/value head(s) per tensor-parallel rank must both be "
          "divisible by it (use cp_style ring)"));
    }
  }
  if (!l.fused_attention) {
    return Invalid(absl::StrCat("parallelism.cp ", l.cp,
                                " needs training.fused_attention"));
  }
  const int64_t seq = l.seq(m);
  if (seq % (2 * l.cp) != 0) {
    return Invalid(
        absl::StrCat("parallelism.cp ", l.cp, ": training.seq_len ", seq,
                     " must be a multiple of 2 x cp = ", 2 * l.cp,
                     " (each rank holds two equal chunks of every sequence)"));
  }
  if (l.sequence_parallel && (seq / l.cp) % l.tp != 0) {
    return Invalid(absl::StrCat(
        "parallelism.cp ", l.cp, " with sequence_parallel: a cp rank's ",
        seq / l.cp, " tokens are not divisible by tp ", l.tp));
  }
  return absl::OkStatus();
}

absl::Status CheckBatch(const Layout& l, const models::TransformerConfig& m) {
  if (l.loss_chunk_tokens < -1) {
    return Invalid(
        absl::StrCat("training.loss_chunk_tokens must be -1 (auto), "
                     "0 (off) or > 0, got ",
                     l.loss_chunk_tokens));
  }
  if (l.document_eot_id >= 0 && !l.fused_attention) {
    return Invalid("data.document_masking needs training.fused_attention");
  }
  if (l.document_eot_id >= m.vocab_size) {
    return Invalid(absl::StrCat("data.document_masking: end-of-text id ",
                                l.document_eot_id, " is not below ", m.name,
                                "'s vocab_size ", m.vocab_size));
  }
  if (l.micro_batch < 1 || l.grad_accumulation < 1 || l.seq_len < 0) {
    return Invalid(absl::StrCat(
        "training: micro batch ", l.micro_batch, " and accumulation steps ",
        l.grad_accumulation, " must be >= 1 and seq_len ", l.seq_len, " >= 0"));
  }
  if (l.seq(m) > m.context_length) {
    return Invalid(absl::StrCat("training.seq_len ", l.seq(m),
                                " is longer than the context length ",
                                m.context_length, " of model ", m.name));
  }
  for (DType d : {l.param_dtype, l.reduce_dtype}) {
    if (!IsFloatingPoint(d)) {
      return Invalid(absl::StrCat("training.mixed_precision: ", DTypeName(d),
                                  " is not a floating-point dtype"));
    }
  }
  return absl::OkStatus();
}

// `model` on the meta device with the layout's LoRA adapters.
absl::StatusOr<std::unique_ptr<models::Transformer>> AdaptedModel(
    const Layout& l, const models::TransformerConfig& model) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> meta,
                         models::Transformer::Create(model));
  if (l.lora.enabled() || l.lora.rank != 0 || !l.lora.targets.empty()) {
    absl::StatusOr<std::vector<std::string>> adapted =
        models::AddLoraAdapters(meta.get(), l.lora);
    if (!adapted.ok()) return Invalid(adapted.status().message());
  }
  return meta;
}

absl::Status CheckZero1(const Layout& l) {
  if (l.reshard_after_backward) return absl::OkStatus();
  if (l.pp > 1) {
    return Invalid(absl::StrCat(
        "parallelism.reshard_after_backward=false (ZeRO-1) with "
        "parallelism.pp ",
        l.pp,
        " > 1 is not supported: the pipeline's stages sync their own "
        "gradients"));
  }
  if (l.hpz_degree > 1) {
    return Invalid(absl::StrCat(
        "parallelism.hpz_degree ", l.hpz_degree,
        " with reshard_after_backward=false (ZeRO-1): the parameters stay "
        "gathered, there is no backward all-gather for hpZ to shrink"));
  }
  return absl::OkStatus();
}

absl::Status CheckFreeze(const Layout& l,
                         const models::TransformerConfig& model) {
  const bool lora = l.lora.rank != 0 || !l.lora.targets.empty();
  if (l.freeze.empty() && !lora) return absl::OkStatus();
  // The names from the model itself, built on the meta device (no bytes).
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> meta,
                         AdaptedModel(l, model));
  const auto params = meta->NamedParameters();
  bool any_trainable = false;
  std::vector<bool> used(l.freeze.size(), false);
  for (const auto& [name, p] : params) {
    for (size_t i = 0; i < l.freeze.size(); ++i) {
      if (MatchesNamePattern(l.freeze[i], name)) used[i] = true;
    }
    any_trainable |= !l.Frozen(name);
  }
  for (size_t i = 0; i < l.freeze.size(); ++i) {
    if (used[i]) continue;
    return Invalid(absl::StrCat(
        "model.freeze pattern \"", l.freeze[i], "\" matches no parameter of ",
        model.name.empty() ? std::string("the model") : model.name,
        " (names look like \"", params.empty() ? "" : params.back().first,
        "\"; '*' matches any characters)"));
  }
  if (!any_trainable) {
    return Invalid(absl::StrCat("model.freeze (", absl::StrJoin(l.freeze, ", "),
                                ") freezes every parameter",
                                l.lora.enabled() ? " and adapter" : "",
                                ": nothing would train"));
  }
  return absl::OkStatus();
}

absl::Status CheckExpertParallel(const Layout& l,
                                 const models::TransformerConfig& m) {
  if (l.ep < 1) {
    return Invalid(absl::StrCat("parallelism.ep must be >= 1, got ", l.ep));
  }
  if (l.ep == 1) return absl::OkStatus();
  if (!m.moe.enabled()) {
    return Invalid(absl::StrCat("parallelism.ep ", l.ep, " needs a model ",
                                "with a mixture of experts (model.moe); ",
                                m.name, " is dense"));
  }
  if (l.cp > 1) {
    return Invalid(absl::StrCat("parallelism.ep ", l.ep,
                                " with cp > 1 is not supported yet (cp ", l.cp,
                                ")"));
  }
  if (l.dp_shard() % l.ep != 0) {
    return Invalid(absl::StrCat("parallelism.ep ", l.ep,
                                " does not divide dp_shard ", l.dp_shard(),
                                " (ep ranks are data-parallel ranks)"));
  }
  if (m.moe.num_experts % l.ep != 0) {
    return Invalid(absl::StrCat("parallelism.ep ", l.ep, " does not divide ",
                                m.name, "'s ", m.moe.num_experts, " experts"));
  }
  if (l.hpz_degree > 1) {
    return Invalid(absl::StrCat("parallelism.ep ", l.ep,
                                " with hpz_degree > 1 is not supported yet"));
  }
  return absl::OkStatus();
}

absl::Status CheckPipeline(const Layout& l,
                           const models::TransformerConfig& m) {
  if (l.pp == 1) {
    if (l.pp_virtual_stages != 1 || !l.pp_cuts.empty()) {
      return Invalid(
          "parallelism.pp_virtual_stages and pp_cuts need parallelism.pp > 1");
    }
    return absl::OkStatus();
  }
  if (l.param_dtype == DType::kF16) {
    return Invalid(
        "parallelism.pp > 1 with training.mixed_precision.param_dtype f16: "
        "the loss scaler's overflow check does not span pipeline stages yet; "
        "use bf16");
  }
  const int micro = static_cast<int>(l.grad_accumulation);
  absl::StatusOr<parallel::PipelineSchedule> schedule =
      parallel::MakePipelineSchedule(l.pp_schedule, l.pp, l.pp_virtual_stages,
                                     micro);
  if (!schedule.ok()) {
    return Invalid(absl::StrCat(
        "parallelism (pp ", l.pp, ", ", micro,
        " micro-batches per step): ", schedule.status().message()));
  }
  absl::StatusOr<std::vector<parallel::StageBlocks>> split =
      parallel::SplitStages(static_cast<int>(m.n_layers), schedule->stages(),
                            l.pp_cuts);
  if (!split.ok()) {
    return Invalid(absl::StrCat(
        "parallelism: splitting the ", m.n_layers, " blocks of model ", m.name,
        " into pp ", l.pp, " x pp_virtual_stages ", l.pp_virtual_stages,
        " stages",
        l.pp_cuts.empty() ? ""
                          : absl::StrCat(" at pp_cuts \"",
                                         absl::StrJoin(l.pp_cuts, ","), "\""),
        ": ", split.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<MeshAxis> Layout::MeshAxes() const {
  std::vector<MeshAxis> axes;
  if (pp > 1) axes.push_back({kPipelineAxis, pp});
  if (dp_replicate > 1) axes.push_back({kReplicateAxis, dp_replicate});
  axes.push_back({kShardAxis, fsdp_shard()});
  if (tp > 1) axes.push_back({kTensorAxis, tp});
  return axes;
}

std::vector<MeshAxis> Layout::ExpertMeshAxes() const {
  std::vector<MeshAxis> axes;
  if (pp > 1) axes.push_back({kPipelineAxis, pp});
  if (dp_replicate > 1) axes.push_back({kReplicateAxis, dp_replicate});
  axes.push_back({kExpertShardAxis, fsdp_shard() / ep});
  axes.push_back({kExpertAxis, ep});
  if (tp > 1) axes.push_back({kTensorAxis, tp});
  return axes;
}

std::vector<std::string> Layout::DataAxes() const {
  std::vector<std::string> axes;
  if (dp_replicate > 1) axes.push_back(kReplicateAxis);
  axes.push_back(kShardAxis);
  return axes;
}

std::vector<std::string> Layout::StageAxes() const {
  std::vector<std::string> axes = DataAxes();
  if (tp > 1) axes.push_back(kTensorAxis);
  return axes;
}

absl::Status Layout::Validate(const models::TransformerConfig& model) const {
  FSDPP_RETURN_IF_ERROR(CheckDegrees(*this));
  FSDPP_RETURN_IF_ERROR(CheckBatch(*this, model));
  FSDPP_RETURN_IF_ERROR(CheckTensorParallel(*this, model));
  FSDPP_RETURN_IF_ERROR(CheckContextParallel(*this, model));
  FSDPP_RETURN_IF_ERROR(CheckFreeze(*this, model));
  FSDPP_RETURN_IF_ERROR(CheckZero1(*this));
  FSDPP_RETURN_IF_ERROR(CheckExpertParallel(*this, model));
  return CheckPipeline(*this, model);
}

bool Layout::Frozen(const std::string& name) const {
  if (lora.enabled() && !models::IsLoraParameter(name)) return true;
  for (const std::string& pattern : freeze) {
    if (MatchesNamePattern(pattern, name)) return true;
  }
  return false;
}

absl::StatusOr<Layout::ParameterCounts> Layout::CountParameters(
    const models::TransformerConfig& model) const {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> meta,
                         AdaptedModel(*this, model));
  ParameterCounts counts;
  std::map<const Parameter*, std::string> names;
  for (const auto& [name, p] : meta->NamedParameters()) names[p] = name;
  for (const auto& [name, m] : meta->NamedModules()) {
    const auto* linear = dynamic_cast<const nn::Linear*>(m);
    if (linear == nullptr) continue;
    const Parameter* w = linear->weight();
    const std::string& weight = names.at(w);
    const int64_t n = NumElements(w->shape);
    if (models::IsLoraParameter(weight)) {
      counts.adapter_matmul += n;
    } else if (Frozen(weight)) {
      counts.frozen_matmul += n;
    }
  }
  for (const auto& [name, p] : meta->NamedParameters()) {
    const int64_t n = NumElements(p->shape);
    counts.total += n;
    if (Frozen(name)) {
      counts.frozen_names.push_back(name);
    } else {
      counts.trainable += n;
    }
  }
  return counts;
}

absl::StatusOr<double> Layout::FlopsPerToken(
    const models::TransformerConfig& model) const {
  const double base = models::FlopsPerToken(model, seq(model));
  if (freeze.empty() && !lora.enabled()) return base;
  FSDPP_ASSIGN_OR_RETURN(const ParameterCounts counts, CountParameters(model));
  return base - 2.0 * static_cast<double>(counts.frozen_matmul) +
         6.0 * static_cast<double>(counts.adapter_matmul);
}

std::string Layout::ToString() const {
  std::string mesh = absl::StrCat("W=", world);
  if (dp_replicate > 1) {
    absl::StrAppend(&mesh, " (", dp_replicate, " x ", fsdp_shard(), " HSDP)");
  }
  if (ep > 1) absl::StrAppend(&mesh, " (EP ", ep, ")");
  if (cp > 1) {
    absl::StrAppend(&mesh, " x CP ", cp,
                    cp_style == "ring" ? "" : " all-to-all");
  }
  if (tp > 1) {
    absl::StrAppend(&mesh, " x TP ", tp, sequence_parallel ? " + SP" : "",
                    loss_parallel ? " + loss parallel" : "");
  }
  if (pp > 1) {
    absl::StrAppend(&mesh, " x PP ", pp, " ", pp_schedule,
                    pp_virtual_stages > 1
                        ? absl::StrCat(" (", pp_virtual_stages, " stages/rank)")
                        : std::string());
  }
  return absl::StrFormat(
      "%s, %s%s, %s/%s%s%s, %s attention%s%s%s, batch %d x %d x %d", mesh,
      !reshard_after_backward ? "ZeRO-1"
      : reshard_after_forward ? "ZeRO-3"
                              : "ZeRO-2",
      hpz_degree > 1 ? absl::StrCat(" hpZ ", hpz_degree) : std::string(),
      DTypeName(param_dtype), DTypeName(reduce_dtype),
      AcLabel(activation_checkpointing), offload ? ", offload" : "",
      fused_attention ? "fused" : "unfused",
      loss_chunk_tokens == -1 ? std::string()
      : loss_chunk_tokens == 0
          ? std::string(", unfused loss head")
          : absl::StrCat(", loss head in ", loss_chunk_tokens, "-token chunks"),
      document_eot_id >= 0 ? ", document masks" : "",
      lora.enabled()   ? absl::StrCat(", LoRA r ", lora.rank)
      : freeze.empty() ? std::string()
                       : std::string(", frozen parameters"),
      micro_batch, seq_len, grad_accumulation);
}

}  // namespace recipe
}  // namespace fsdpp
