// The FSDP plan of the GPT-2 family (TorchTitan's parallelize_gpt2 shape):
// each transformer block h.{i} is one unit; the root unit holds what is left
// — wte (tied to lm_head, so the tied weight lives in exactly one unit and
// its two gradients add up before the one reduce-scatter), wpe and ln_f —
// and is sharded last. The last block keeps its parameters after forward
// (backward needs them first), unless the options ask otherwise.
#ifndef FSDPP_MODELS_GPT2_PARALLELIZE_H_
#define FSDPP_MODELS_GPT2_PARALLELIZE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/parallelize/tensor_parallel_plan.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {
namespace gpt2 {

// Mesh, mixed precision and resharding of the plan (fsdp/auto_wrap.h).
using FsdpPlanOptions = fsdp::FsdpPlanOptions;

// Shards `model` (a GPT-2 family Transformer, on the meta device or
// materialised; materialise meta ones with fsdp::InitShardedWeights) as
// described above. Returns the units: blocks in order, then the root.
// InvalidArgument for a null or non-GPT-2 model; FullyShard's errors (e.g.
// already sharded) otherwise.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFsdp(
    Transformer* model, const FsdpPlanOptions& options);

// Tensor parallelism on the tp axis of `mesh` with the shared plan
// (models/parallelize/tensor_parallel_plan.h); apply it before FSDP and
// before materialising. InvalidArgument for a model of another family or
// sizes that do not divide (naming the module); the model is then unchanged.
using TensorParallelOptions = TensorParallelPlanOptions;
absl::Status ApplyTensorParallel(Transformer* model, DeviceMesh* mesh,
                                 const TensorParallelOptions& options = {});

}  // namespace gpt2
}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_GPT2_PARALLELIZE_H_
