// The tensor-parallel plan the model families share (torchtitan's Llama
// plan, applied to GPT-2's layers too): attention heads and MLP hidden
// features split across the tp ranks, Megatron style.
//
//   token embedding   row-wise: vocabulary-parallel table, output reduced
//                     (all-reduce, or reduce-scatter over the sequence)
//   position emb.     GPT-2: whole; with sequence parallelism its output is
//                     sliced to this rank's positions
//   each block        norms: sequence parallel (or whole); attention and MLP:
//                     region inputs (one all-gather / all-reduce each way);
//                     q, k, v (GPT-2: c_attn, its q, k and v rows split as
//                     three blocks) and fc / gate, up column-wise; wo / c_proj
//                     and proj / down row-wise; with fewer kv heads than
//                     ranks, wk and wv whole on every rank (each rank uses the
//                     kv head its query heads share)
//   final norm        sequence parallel (or whole)
//   LM head           column-wise, tied to the embedding's table split the
//                     same way; its logits stay vocabulary-sharded for loss
//                     parallel (parallel::LossParallel is installed as the
//                     model's loss) or are all-gathered
//
// Everything that must divide is checked first, and the error names the
// module and the sizes: query heads, kv heads (divisible by tp, or dividing
// it), the MLP hidden width and the (padded) vocabulary by the tp size.
#ifndef FSDPP_MODELS_PARALLELIZE_TENSOR_PARALLEL_PLAN_H_
#define FSDPP_MODELS_PARALLELIZE_TENSOR_PARALLEL_PLAN_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "parallel/tensor_parallel.h"

namespace fsdpp {
namespace models {

struct TensorParallelPlanOptions {
  // The mesh axis tensor parallelism splits over.
  std::string tp_axis = "tp";
  // Activations between the blocks sharded over the sequence (norms and
  // residual stream: memory / tp), instead of replicated.
  bool sequence_parallel = false;
  // Keep the logits vocabulary-sharded and compute the loss on them
  // (parallel::LossParallel); false gathers them for the ordinary loss.
  bool loss_parallel = true;
  // Limit of every collective.
  absl::Duration timeout = absl::Minutes(5);
};

// The plan for `model` (a Transformer of any family) on a tp axis of
// `tp_size` ranks, or InvalidArgument for what does not divide.
absl::StatusOr<std::vector<parallel::PlanEntry>> TensorParallelPlan(
    Transformer* model, int tp_size, const TensorParallelPlanOptions& options);

// Checks that `model` is of `family`, builds the plan for the tp axis of
// `mesh` and applies it (parallel::ParallelizeModule), then installs
// parallel::LossParallel when options.loss_parallel. Errors are prefixed with
// `caller`; on error the model is unchanged.
absl::Status ApplyTensorParallelPlan(Transformer* model, ModelFamily family,
                                     absl::string_view caller, DeviceMesh* mesh,
                                     const TensorParallelPlanOptions& options);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_PARALLELIZE_TENSOR_PARALLEL_PLAN_H_
