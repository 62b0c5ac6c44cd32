// The FSDP plan the model families share: every transformer block one unit,
// then the root (embeddings, final norm, head, tied weights together) —
// fsdp::ShardBlocksThenRoot on a Transformer, after checking that the model
// belongs to the family whose plan was asked for. The per-family entry points
// (models/gpt2/parallelize.h, models/llama/parallelize.h) call it; a family
// whose plan differs gets its own code there.
#ifndef FSDPP_MODELS_PARALLELIZE_BLOCK_PLAN_H_
#define FSDPP_MODELS_PARALLELIZE_BLOCK_PLAN_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "models/config.h"
#include "models/transformer.h"

namespace fsdpp {
namespace models {

// Shards `model` block by block, then the root; the units in that order.
// InvalidArgument "`caller`: ..." for a null model or one of another family
// than `family`; FullyShard's errors (e.g. already sharded) annotated with
// `caller`.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyBlockPlan(
    Transformer* model, ModelFamily family, absl::string_view caller,
    const fsdp::FsdpPlanOptions& options);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_PARALLELIZE_BLOCK_PLAN_H_
