#include "models/pipeline.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace models {

absl::StatusOr<std::vector<PipelineStagePart>> BuildPipelineParts(
    const TransformerConfig& config, const TransformerOptions& options,
    const parallel::PipelineSchedule& schedule, int pp_rank,
    const std::vector<int>& cuts) {
  if (pp_rank < 0 || pp_rank >= schedule.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("BuildPipelineParts: pipeline rank ", pp_rank,
                     " outside 0 .. ", schedule.ranks - 1));
  }
  absl::StatusOr<std::vector<parallel::StageBlocks>> split =
      parallel::SplitStages(static_cast<int>(config.n_layers),
                            schedule.stages(), cuts);
  if (!split.ok()) {
    return Annotate(split.status(),
                    absl::StrCat("pipeline stages of ", config.name));
  }
  std::vector<PipelineStagePart> parts;
  for (int s = pp_rank; s < schedule.stages(); s += schedule.ranks) {
    const parallel::StageBlocks& b = (*split)[s];
    TransformerOptions o = options;
    o.first_block = b.first;
    o.num_blocks = b.count;
    o.embedding = b.embedding;
    o.head = b.head;
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Transformer> model,
                           Transformer::Create(config, o));
    parts.push_back({s, std::move(model)});
  }
  return parts;
}

PipelineStageModules StageModules(std::vector<PipelineStagePart>& parts,
                                  const Shape& hidden_shape,
                                  DType hidden_dtype) {
  PipelineStageModules out;
  for (PipelineStagePart& part : parts) {
    parallel::PipelineStageModule st;
    st.stage = part.stage;
    st.module = part.model.get();
    if (!part.model->has_embedding()) {
      st.input_shape = hidden_shape;
      st.input_dtype = hidden_dtype;
    }
    if (!part.model->has_head()) {
      st.output_shape = hidden_shape;
      st.output_dtype = hidden_dtype;
    } else {
      out.loss = part.model->mutable_loss();
    }
    out.stages.push_back(st);
  }
  return out;
}

std::string TiedWeightName(const TransformerConfig& config) {
  if (!config.tied_embeddings) return "";
  return config.family == ModelFamily::kGpt2 ? "wte.weight"
                                             : "tok_embeddings.weight";
}

std::string TiedCopyName(const Transformer& part) {
  if (part.has_embedding() || !part.has_head()) return "";
  return TiedWeightName(part.config());
}

bool CountsInNorm(const Transformer& part, const std::string& name) {
  return name != TiedCopyName(part);
}

}  // namespace models
}  // namespace fsdpp
