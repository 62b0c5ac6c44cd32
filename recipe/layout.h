// The run's layout, resolved once: how a training run is spread over its
// ranks (the mesh's degrees and axis names), how FSDP shards and casts, the
// activation-memory options and the batch. torchtitan's ParallelDims plus
// the sharding strategy, and which parameters train, in one value: the
// trainer's config resolves into it (trainer/config.h), the planner searches
// over it (plan/planner.h), and the build (recipe/build.h) and the step read
// it; nothing else re-derives a degree, an axis name or a divisibility rule.
//
// The mesh is [pp,] [replicate,] shard [, tp], outermost first, each axis
// present when its degree is above 1 (shard always): a rank's coordinates
// follow from its global rank in that order, so pipeline rank q's ranks are
// [q x world / pp, (q + 1) x world / pp). Context parallelism lives inside
// the shard axis (torchtitan's dp_shard x cp, flattened): its cp groups are
// the runs of cp consecutive shard coordinates (DeviceMesh::Subgroup), so
// FSDP shards over dp_shard x cp without an axis of its own.
//
// Every option has one encoding: a degree of 1 is "off" (hpZ included).
// Validate names the trainer config's fields in its errors (the planner's
// command line reads the same configs), e.g. "parallelism.tp 3 does not
// divide model.n_heads (4)".
#ifndef FSDPP_RECIPE_LAYOUT_H_
#define FSDPP_RECIPE_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/lora.h"
#include "nn/checkpoint_wrapper.h"

namespace fsdpp {
namespace recipe {

// The mesh axes' names.
inline constexpr char kPipelineAxis[] = "pp";
inline constexpr char kReplicateAxis[] = "replicate";
inline constexpr char kShardAxis[] = "shard";
inline constexpr char kTensorAxis[] = "tp";
// The expert mesh's axes (ExpertMeshAxes): the shard axis as efsdp x ep.
inline constexpr char kExpertShardAxis[] = "efsdp";
inline constexpr char kExpertAxis[] = "ep";

struct Layout {
  // Ranks in all: pp x dp_replicate x dp_shard() x cp x tp.
  int world = 1;
  // HSDP: replicas of a sharded model, each sharded over dp_shard() ranks.
  int dp_replicate = 1;
  // Tensor parallelism (the family's plan, recipe/families.h) on the
  // innermost axis; FSDP shards each rank's pieces over the shard axis.
  // Sequence parallelism splits the norms and residual stream over the
  // sequence; loss parallelism computes the loss on vocabulary-split
  // logits. Both need tp > 1.
  int tp = 1;
  // Context parallelism: each sequence split over cp ranks (2 cp chunks,
  // rank i holding chunks i and 2 cp - 1 - i) with ring attention
  // (parallel/context_parallel.h); the cp ranks read the same batches.
  // Needs the fused attention; the sequence a multiple of 2 cp.
  // cp_style: "ring" (k and v passed round the cp ranks) or "alltoall"
  // (DeepSpeed-Ulysses: heads exchanged for rows; the query and key/value
  // heads on a rank must divide by cp).
  int cp = 1;
  std::string cp_style = "ring";
  // Expert parallelism (a mixture of experts, model.moe): each MoE layer's
  // experts split over ep ranks of the shard axis (runs of ep consecutive
  // shard coordinates, torchtitan's ep borrowed from dp_shard), tokens sent
  // to their experts' ranks and back by all-to-all (parallel/
  // expert_parallel.h). The experts' stacks are sharded by FSDP over the
  // dp_shard / ep ranks that hold the same experts (the expert mesh's efsdp
  // axis) and averaged over every data-parallel rank; everything else as
  // without. ep divides dp_shard and the experts; with tp, the tp plan's
  // split of every expert's hidden is kept; with pp, each stage's experts
  // on the expert mesh's stage axes; not with cp or hpZ yet.
  int ep = 1;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  // Pipeline parallelism on the outermost axis: the schedule ("gpipe",
  // "1f1b", "interleaved" with pp_virtual_stages >= 2 stages per rank) over
  // grad_accumulation micro-batches; the blocks cut evenly or at pp_cuts
  // (the first block of each stage after the first).
  int pp = 1;
  std::string pp_schedule = "1f1b";
  int pp_virtual_stages = 1;
  std::vector<int> pp_cuts;
  // hpZ: backward all-gathers within groups of this many shard ranks (1 off).
  int hpz_degree = 1;
  // ZeRO-3 (true) or ZeRO-2 (false) for the blocks.
  bool reshard_after_forward = true;
  // false: ZeRO-1 (FSDP2's set_reshard_after_backward(False) with gradient
  // sync on the last micro-batch only): the parameters gathered once per
  // step, the gradients reduce-scattered once. Not with pp > 1.
  bool reshard_after_backward = true;
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  // FSDP offload: masters, gradients and optimizer state in host memory.
  bool offload = false;
  nn::CheckpointPolicy activation_checkpointing;
  bool fused_attention = true;
  // models::TransformerOptions::loss_chunk_tokens (-1 auto, 0 off, > 0).
  int64_t loss_chunk_tokens = -1;
  // models::TransformerOptions::document_eot_id: document masking at this
  // end-of-text id (-1 off; needs the fused attention).
  int64_t document_eot_id = -1;
  // Parameters that do not train (model.freeze): glob patterns over the
  // fully qualified names (MatchesNamePattern). Frozen parameters get
  // no gradient, reduce-scatter or optimizer state; each pattern must match
  // a parameter and at least one must stay trainable.
  std::vector<std::string> freeze;
  // LoRA adapters (model.lora): on the matched linear layers, everything
  // else frozen (models/lora.h); under tp each adapter is split as its base
  // weight (parallel/tensor_parallel.h).
  models::LoraOptions lora;
  // One micro-batch: micro_batch sequences of seq_len tokens (0: the
  // model's context length); grad_accumulation of them per step and rank.
  int64_t micro_batch = 1;
  int64_t seq_len = 0;
  int64_t grad_accumulation = 1;

  // The data-parallel shard degree: world / (pp x dp_replicate x cp x tp).
  int dp_shard() const { return world / (pp * dp_replicate * cp * tp); }
  // The shard axis: FSDP's shard degree, dp_shard() x cp.
  int fsdp_shard() const { return dp_shard() * cp; }
  // Data-parallel ranks (the ranks that read different batches).
  int data_parallel() const { return dp_replicate * dp_shard(); }
  // The data-parallel rank of the rank at `data_axes_rank` in the mesh over
  // DataAxes() (the cp ranks of one sequence share it).
  int DataRank(int data_axes_rank) const { return data_axes_rank / cp; }
  // The sequence length for `model` (seq_len, or its context length).
  int64_t seq(const models::TransformerConfig& model) const {
    return seq_len > 0 ? seq_len : model.context_length;
  }

  // Whether the parameter named `name` is frozen (matches a freeze
  // pattern, or is not an adapter's under LoRA).
  bool Frozen(const std::string& name) const;
  // The parameters of `model` as this layout trains it (with its LoRA
  // adapters): all of them and the ones that train.
  struct ParameterCounts {
    int64_t total = 0;
    int64_t trainable = 0;
    std::vector<std::string> frozen_names;  // in the model's order
    // Weights of linear layers (the LM head included) that are frozen, and
    // LoRA's adapters' (all of them trainable).
    int64_t frozen_matmul = 0;
    int64_t adapter_matmul = 0;
  };
  absl::StatusOr<ParameterCounts> CountParameters(
      const models::TransformerConfig& model) const;
  // Training FLOPs per token of `model` as this layout trains it, at
  // seq(model): models::FlopsPerToken less 2 per frozen matmul weight (no
  // weight gradient: forward 2 + input gradient 2 of the 6), plus 6 per
  // adapter weight. What MFU and the planner's compute time count.
  absl::StatusOr<double> FlopsPerToken(
      const models::TransformerConfig& model) const;

  // The mesh's axes, outermost first.
  std::vector<MeshAxis> MeshAxes() const;
  // With ep > 1: the same ranks as [replicate,] efsdp, ep (DeviceMesh::
  // Reshape of the mesh; the shard coordinate is efsdp x ep + the ep
  // coordinate).
  std::vector<MeshAxis> ExpertMeshAxes() const;
  // The names of the data-parallel axes (replicate, shard: the ranks that
  // read different batches, but for the cp ranks within shard; see
  // DataRank), which the others (tp, pp) split the model's work within.
  std::vector<std::string> DataAxes() const;
  // The axes of one pipeline stage's mesh (all but pp).
  std::vector<std::string> StageAxes() const;
  // Pipeline rank of global rank `rank`, and the first global rank of
  // pipeline rank `q`.
  int PipelineRankOf(int rank) const { return rank / (world / pp); }
  int FirstRankOfPipelineRank(int q) const { return q * (world / pp); }

  // Checks every rule the layout must satisfy for `model`: degrees that
  // multiply to the world, hpZ within the shard group (and with ZeRO-3),
  // tensor parallelism dividing the heads, MLP width and vocabulary (and
  // the sequence with sequence parallelism), a valid pipeline schedule and
  // split of the blocks, batch sizes, the sequence within the context,
  // floating-point dtypes, context parallelism's sequence split, freeze
  // patterns that match no parameter or every one.
  // InvalidArgument naming the config field.
  absl::Status Validate(const models::TransformerConfig& model) const;

  // "W=4 (2 x 2 HSDP), ZeRO-3, bf16/f32, AC, fused attention, batch 2 x 256
  // x 1".
  std::string ToString() const;
};

}  // namespace recipe
}  // namespace fsdpp

#endif  // FSDPP_RECIPE_LAYOUT_H_
