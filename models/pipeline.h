// Pipeline parallelism for the model zoo's Transformer ([pp]): which stages
// a pipeline rank holds, the stage models themselves (Transformer parts with
// the whole model's names, so FSDP and tensor-parallel plans, checkpoints and
// the HF adapter see the usual names), the runner over them, and the tied
// embedding's two copies kept in step.
//
// A model of n blocks on P pipeline ranks with V stages per rank has S = P V
// stages: the blocks split into S contiguous runs (evenly, or at cut points;
// parallel::SplitStages), stage 0 with the embeddings, stage S - 1 with the
// final norm, the head and the loss; rank r holds stages r, r + P, ...
// (parallel::PipelineSchedule::RankOf).
//
// Tied embeddings (GPT-2, tied Llama configs): when the first and last
// stages are on different ranks, the last stage keeps its own copy of the
// token-embedding weight for its head (same name, same initial values);
// after each step's backward the two copies' gradients are added on both
// ranks (bitwise the same sum: a + b == b + a), so both copies take the
// same optimizer steps and stay equal (parallel::SumSharedGradients adds
// them). ClipGradNorm counts the weight once (CountsInNorm); a checkpoint
// holds the copies under one name.
#ifndef FSDPP_MODELS_PIPELINE_H_
#define FSDPP_MODELS_PIPELINE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/config.h"
#include "models/transformer.h"
#include "nn/loss.h"
#include "parallel/pipeline_runner.h"
#include "parallel/pipeline_schedule.h"

namespace fsdpp {
namespace models {

// One stage of this rank: its global index and its model (a Transformer
// part, built on the meta device).
struct PipelineStagePart {
  int stage = 0;
  std::unique_ptr<Transformer> model;
};

// The parts `schedule` gives pipeline rank `pp_rank`, with `options`
// (dtype, checkpointing, attention) for each, split at `cuts` (empty: even).
// InvalidArgument from SplitStages for a bad split (more stages than blocks,
// cuts out of order) naming the model.
absl::StatusOr<std::vector<PipelineStagePart>> BuildPipelineParts(
    const TransformerConfig& config, const TransformerOptions& options,
    const parallel::PipelineSchedule& schedule, int pp_rank,
    const std::vector<int>& cuts = {});

// What a parallel::PipelineRunner needs of `parts`: each part as a stage
// module, the hidden states between stages being `hidden_shape` (per
// micro-batch: [rows, T, C], or [rows, T / tp, C] under sequence
// parallelism) of `hidden_dtype`; and the last stage's loss (its model's,
// loss parallel included), null when this rank lacks that stage.
struct PipelineStageModules {
  std::vector<parallel::PipelineStageModule> stages;
  nn::LossFunction* loss = nullptr;
};
PipelineStageModules StageModules(std::vector<PipelineStagePart>& parts,
                                  const Shape& hidden_shape,
                                  DType hidden_dtype);

// The fully qualified name of the token-embedding weight of a tied model
// ("wte.weight", "tok_embeddings.weight"); empty for an untied one.
std::string TiedWeightName(const TransformerConfig& config);

// The fully qualified name of the token-embedding weight when `part` holds
// the last stage's copy of a tied weight (it has the head but not the
// embedding), else empty.
std::string TiedCopyName(const Transformer& part);

// Whether parameter `name` of `part` counts in the gradient norm (false for
// the tied weight's last-stage copy).
bool CountsInNorm(const Transformer& part, const std::string& name);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_PIPELINE_H_
