// The shared tensor-parallel plan; see tensor_parallel_plan.h.
#include "models/parallelize/tensor_parallel_plan.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/attention.h"
#include "nn/block.h"
#include "nn/embedding.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/moe.h"
#include "parallel/loss_parallel.h"

namespace fsdpp {
namespace models {
namespace {

using parallel::Layout;
using parallel::PlanEntry;
using Style = parallel::ParallelStyle;

absl::Status NotDivisible(const std::string& path, const std::string& what,
                          int64_t n, int tp) {
  return absl::InvalidArgumentError(
      absl::StrCat("tensor parallel plan: module '", path, "': ", what, " (", n,
                   ") is not divisible by the tp size ", tp));
}

}  // namespace

absl::StatusOr<std::vector<PlanEntry>> TensorParallelPlan(
    Transformer* model, int tp, const TensorParallelPlanOptions& options) {
  if (model == nullptr) {
    return absl::InvalidArgumentError("tensor parallel plan: null model");
  }
  if (tp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel plan: tp size ", tp, " must be >= 1"));
  }
  std::map<const Module*, std::string> path_of;
  for (auto& [path, m] : model->NamedModules()) path_of.emplace(m, path);
  const auto path = [&](const Module* m) { return path_of.at(m); };
  const Layout stream =
      options.sequence_parallel ? Layout::kShardSequence : Layout::kReplicate;
  std::vector<PlanEntry> plan;

  // A pipeline part may lack the embeddings or the head; a tied part with
  // the head keeps the embedding as its weight's holder, split like it.
  const int64_t vocab = model->config().padded_vocab_size();
  if (vocab % tp != 0) {
    return NotDivisible(
        path(model->token_embedding() != nullptr
                 ? static_cast<const Module*>(model->token_embedding())
                 : model->lm_head()),
        "the vocabulary rows (padded vocabulary size; pad it with "
        "vocab_pad_multiple)",
        vocab, tp);
  }
  if (nn::Embedding* tok = model->token_embedding(); tok != nullptr) {
    plan.push_back({path(tok), Style::Rowwise(Layout::kReplicate, stream)});
  }
  if (nn::Embedding* pos = model->position_embedding();
      pos != nullptr && options.sequence_parallel) {
    plan.push_back({path(pos), Style::PrepareOutput(Layout::kReplicate,
                                                    Layout::kShardSequence)});
  }
  for (TransformerBlock* block : model->blocks()) {
    for (Module* norm : {block->norm1(), block->norm2()}) {
      if (options.sequence_parallel) {
        plan.push_back({path(norm), Style::SequenceParallel()});
      }
    }
    auto* attn = dynamic_cast<nn::CausalSelfAttention*>(block->attn());
    if (attn == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor parallel plan: module '", path(block->attn()), "' is a ",
          block->attn()->kind(), ", not a CausalSelfAttention"));
    }
    const nn::AttentionConfig& ac = attn->config();
    const std::string a = path(attn);
    if (ac.qk_norm) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor parallel plan: module '", a,
          "': its q / k norms (qk_norm) normalise over every head, which "
          "tensor parallelism splits; not supported"));
    }
    const int64_t h = ac.n_heads, kv = ac.kv_heads();
    if (h % tp != 0) return NotDivisible(a, "n_heads", h, tp);
    const bool split_kv = kv % tp == 0;
    if (!split_kv && tp % kv != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor parallel plan: module '", a, "': n_kv_heads (", kv,
          ") must be divisible by the tp size ", tp,
          " or divide it (then each kv head is kept whole on the ranks whose "
          "query heads share it)"));
    }
    plan.push_back({a, Style::RegionInput(stream)});
    for (const auto& [name, child] : attn->children()) {
      const std::string p = a + "." + name;
      const bool out = name == "c_proj" || name == "wo";
      if (out) {
        plan.push_back({p, Style::Rowwise(Layout::kShardLast, stream)});
      } else if (ac.fused_qkv) {
        if (kv != h) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor parallel plan: module '", p,
              "': a fused q/k/v projection is split only with as many kv "
              "heads as query heads (n_heads ",
              h, ", n_kv_heads ", kv, ")"));
        }
        plan.push_back({p, Style::ColwiseInRegion(/*fused_blocks=*/3)});
      } else if (name == "wq" || split_kv) {
        plan.push_back({p, Style::ColwiseInRegion()});
      } else {
        plan.push_back({p, Style::ReplicatedInRegion()});
      }
    }
    Module* mlp = block->mlp();
    const std::string m = path(mlp);
    if (dynamic_cast<nn::MoE*>(mlp) != nullptr) {
      // Divisibility is checked by the style, which names the widths.
      plan.push_back({m, Style::MixtureOfExperts(stream)});
      continue;
    }
    plan.push_back({m, Style::RegionInput(stream)});
    if (auto* gelu = dynamic_cast<nn::Mlp*>(mlp)) {
      if (gelu->fc()->out_features() % tp != 0) {
        return NotDivisible(m, "the hidden width", gelu->fc()->out_features(),
                            tp);
      }
      plan.push_back({path(gelu->fc()), Style::ColwiseInRegion()});
      plan.push_back(
          {path(gelu->proj()), Style::Rowwise(Layout::kShardLast, stream)});
    } else if (auto* swiglu = dynamic_cast<nn::SwiGlu*>(mlp)) {
      if (swiglu->gate()->out_features() % tp != 0) {
        return NotDivisible(m, "the hidden width",
                            swiglu->gate()->out_features(), tp);
      }
      plan.push_back({path(swiglu->gate()), Style::ColwiseInRegion()});
      plan.push_back({path(swiglu->up()), Style::ColwiseInRegion()});
      plan.push_back(
          {path(swiglu->down()), Style::Rowwise(Layout::kShardLast, stream)});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallel plan: module '", m, "' is a ",
                       mlp->kind(), ", not an Mlp, SwiGlu or MoE"));
    }
  }
  if (!model->has_head()) return plan;
  if (options.sequence_parallel) {
    plan.push_back({path(model->final_norm()), Style::SequenceParallel()});
  }
  plan.push_back(
      {path(model->lm_head()),
       Style::Colwise(stream, options.loss_parallel ? Layout::kShardLast
                                                    : Layout::kReplicate)});
  return plan;
}

absl::Status ApplyTensorParallelPlan(Transformer* model, ModelFamily family,
                                     absl::string_view caller, DeviceMesh* mesh,
                                     const TensorParallelPlanOptions& options) {
  if (model == nullptr || mesh == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(caller, ": null model or mesh"));
  }
  if (model->config().family != family) {
    return absl::InvalidArgumentError(
        absl::StrCat(caller, ": model '", model->config().name, "' is a ",
                     ModelFamilyName(model->config().family),
                     " model (use that family's plan)"));
  }
  absl::StatusOr<int> tp = mesh->AxisSize(options.tp_axis);
  if (!tp.ok()) return Annotate(tp.status(), caller);
  absl::StatusOr<std::vector<PlanEntry>> plan =
      TensorParallelPlan(model, *tp, options);
  if (!plan.ok()) return Annotate(plan.status(), caller);
  parallel::TensorParallelOptions tp_options;
  tp_options.tp_axis = options.tp_axis;
  tp_options.timeout = options.timeout;
  FSDPP_RETURN_IF_ERROR(Annotate(
      parallel::ParallelizeModule(model, mesh, *plan, tp_options), caller));
  if (options.loss_parallel) {
    model->set_loss(std::make_unique<parallel::LossParallel>(
        mesh, options.tp_axis, model->loss().ignore_index(), options.timeout));
  }
  return absl::OkStatus();
}

}  // namespace models
}  // namespace fsdpp
