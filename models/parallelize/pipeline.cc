#include "models/parallelize/pipeline.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/allocator.h"
#include "core/status.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace models {

absl::StatusOr<parallel::PipelineSchedule> MakePipelineSchedule(
    const std::string& name, int ranks, int virtual_stages, int microbatches) {
  if (name == "interleaved") {
    if (virtual_stages < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline schedule 'interleaved' needs pp_virtual_stages >= 2, got ",
          virtual_stages));
    }
    return parallel::Interleaved1F1BSchedule(ranks, virtual_stages,
                                             microbatches);
  }
  if (name != "gpipe" && name != "1f1b") {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline schedule '", name,
                     "' is not one of gpipe, 1f1b, interleaved"));
  }
  if (virtual_stages != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline schedule '", name,
                     "' runs one stage per rank; pp_virtual_stages is ",
                     virtual_stages, " (use 'interleaved')"));
  }
  return name == "gpipe" ? parallel::GPipeSchedule(ranks, microbatches)
                         : parallel::OneFOneBSchedule(ranks, microbatches);
}

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
    ASSIGN_OR_RETURN(std::unique_ptr<Transformer> model,
                     Transformer::Create(config, o));
    parts.push_back({s, std::move(model)});
  }
  return parts;
}

absl::StatusOr<std::unique_ptr<parallel::PipelineRunner>> MakePipelineRunner(
    ProcessGroup* pipeline, const parallel::PipelineSchedule& schedule,
    std::vector<PipelineStagePart>& parts, const Shape& hidden_shape,
    DType hidden_dtype, parallel::PipelineRunnerOptions options) {
  std::vector<parallel::PipelineStageModule> stages;
  nn::LossFunction* loss = nullptr;
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
      loss = part.model->mutable_loss();
    }
    stages.push_back(st);
  }
  return parallel::PipelineRunner::Create(pipeline, schedule, std::move(stages),
                                          loss, std::move(options));
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

absl::Status SumTiedGradients(ProcessGroup* pipeline,
                              const parallel::PipelineSchedule& schedule,
                              Tensor* first, Tensor* last,
                              absl::Duration timeout) {
  if (first == nullptr && last == nullptr) return absl::OkStatus();
  if (first != nullptr && last != nullptr) {
    RETURN_IF_ERROR(Add(*first, *last, first));
    return Copy(*first, last);
  }
  if (pipeline == nullptr) {
    return absl::InvalidArgumentError("SumTiedGradients: no pipeline group");
  }
  Tensor* mine = first != nullptr ? first : last;
  const int peer = first != nullptr ? schedule.RankOf(schedule.stages() - 1)
                                    : schedule.RankOf(0);
  if (peer == pipeline->rank()) {
    return absl::InvalidArgumentError(
        "SumTiedGradients: this rank holds the first and the last stage but "
        "only one copy of the tied weight's gradient was given");
  }
  ASSIGN_OR_RETURN(Tensor theirs,
                   Tensor::Empty(mine->shape(), mine->dtype(), mine->device(),
                                 MemoryTag::kGrads));
  CollectiveOptions o;
  o.timeout = timeout;
  ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      pipeline->BatchP2P({P2POp::Send({mine->raw_data(), mine->numel(),
                                       mine->dtype(), mine->device()},
                                      peer, P2POp::kMaxP2PTag),
                          P2POp::Recv({theirs.raw_data(), theirs.numel(),
                                       theirs.dtype(), theirs.device()},
                                      peer, P2POp::kMaxP2PTag)},
                         o));
  RETURN_IF_ERROR(Annotate(work->Wait(timeout + absl::Minutes(1)),
                           "summing the tied embedding's gradient copies"));
  return Add(*mine, theirs, mine);
}

}  // namespace models
}  // namespace fsdpp
