// A training step run on meta tensors: what one rank allocates, exactly,
// without allocating it.
//
// DryRun builds the model (no memory: meta parameters), applies its
// family's FSDP plan on a mesh of simulated process groups (which move no
// data and record every collective), initialises the sharded masters,
// creates AdamW and then runs two optimizer steps of the training loop the
// trainer runs (the first records the order FSDP prefetches in from then
// on, so the second is the steady state) -- zero the gradients, forward and
// backward per micro-batch (two of them: later ones repeat the second's
// allocations and collectives exactly, and are counted as copies of it),
// the AdamW step -- on meta tensors (the gradient norm, which reads values,
// is left out: n floats and one scalar all-reduce per axis). Every tensor the
// real step would allocate is made with the same shape, dtype and tag, in
// the same order and with the same lifetime; a MetaAccountant counts them.
// So the per-tag bytes (parameters, gradients, optimizer state, FSDP's
// buffers, activations) and the peak, with the phase where it happens, are
// those of the real run on that rank, for any model size, in milliseconds.
// The collectives come out too (kind, group, bytes), for the time model.
//
// What it cannot see: memory outside fsdpp's allocators (oneDNN scratch,
// thread stacks, the data pipeline's token buffers, the CUDA context) --
// the planner adds those as slack -- and allocator caching (reserved bytes
// above the live ones).
#ifndef FSDPP_PLAN_DRY_RUN_H_
#define FSDPP_PLAN_DRY_RUN_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/parallelize/tensor_parallel_plan.h"
#include "models/pipeline.h"
#include "models/transformer.h"
#include "parallel/pipeline_schedule.h"
#include "plan/simulated_group.h"

namespace fsdpp {
namespace plan {

// How the model is trained: the mesh and the sharding strategy, precision,
// activation memory options and the batch.
struct Strategy {
  int world = 1;
  // HSDP: replicas of a sharded model (world = replicate x shard x tp).
  int dp_replicate = 1;
  // Tensor parallelism: the family's plan (models/parallelize) on a "tp"
  // axis of this many ranks, innermost; FSDP shards each rank's pieces over
  // the shard axis. With sequence parallelism the norms and residual stream
  // are split over the sequence; with loss parallelism the loss runs on the
  // vocabulary-split logits.
  int tp = 1;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  // Pipeline parallelism: a "pp" axis of this many ranks, outermost; the
  // schedule ("1f1b", "gpipe", "interleaved" with pp_virtual_stages >= 2
  // stages per rank) over grad_accumulation micro-batches; the blocks cut
  // evenly or at pp_cuts. Each stage gets the tensor-parallel and FSDP
  // plans on the mesh without "pp".
  int pp = 1;
  std::string pp_schedule = "1f1b";
  int pp_virtual_stages = 1;
  std::vector<int> pp_cuts;
  // hpZ: the backward all-gather within groups of this many ranks (0 off).
  int hpz_degree = 0;
  // ZeRO-3 (true) or ZeRO-2 (false) for the blocks.
  bool reshard_after_forward = true;
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  // FSDP offload: masters, gradients and optimizer state in host memory.
  bool offload = false;
  bool activation_checkpointing = false;
  bool fused_attention = true;
  int64_t micro_batch = 1;
  int64_t seq_len = 0;  // 0: the model's context length
  int64_t grad_accumulation = 1;

  int dp_shard() const { return world / (dp_replicate * tp * pp); }
  int64_t seq(const models::TransformerConfig& c) const {
    return seq_len > 0 ? seq_len : c.context_length;
  }
  // "W=4 (2 x 2 HSDP), ZeRO-3, bf16/f32, AC, fused, 2 x 256 x 1".
  std::string ToString() const;
};

// One phase of the step: the live bytes per tag at its end and the peak
// (total and per tag) within it.
struct PhaseMemory {
  // "setup", "step 1 forward 1", "step 1 backward 1", ..., "step 2
  // optimizer".
  std::string name;
  MemoryStats stats;
  MemoryStats host;  // host memory counted apart (empty otherwise)
};

struct DryRunResult {
  // Live bytes once the model, its masters and AdamW's state exist.
  MemoryStats after_setup;
  MemoryStats host_after_setup;  // with the host counted apart
  int64_t host_peak_bytes = 0;
  std::vector<PhaseMemory> phases;
  // The step's peak of live bytes and the phase it falls in.
  int64_t peak_bytes = 0;
  std::string peak_phase;
  // The sharded state of this rank, exactly: fp32 masters, fp32 gradients,
  // AdamW's two moments.
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  // Elements of the whole model, and of the sharded masters on this rank.
  int64_t model_params = 0, rank_params = 0;
  // Tensors the second (steady-state) step allocates: about one per op, for
  // the time model's per-op overhead.
  int64_t step_allocations = 0;
  // Wall time of the second step (meaningful for RunStepOn only).
  double step_seconds = 0;
  // The second (steady-state) step's collectives, in issue order.
  std::vector<SimulatedOp> ops;
  // Pipeline parallelism: the schedule's idle fraction with a backward
  // twice a forward (parallel::Simulate), 0 without.
  double pipeline_bubble = 0;
};

// The model family's tensor-parallel plan (models/<family>/parallelize.h
// ApplyTensorParallel) on `mesh`'s options.tp_axis: what the trainer and the
// dry run apply, before the FSDP plan.
absl::Status ApplyFamilyTensorParallelPlan(
    models::Transformer* model, DeviceMesh* mesh,
    const models::TensorParallelPlanOptions& options);

// What the trainer builds from a strategy, shared with the dry run so that
// the two cannot drift apart: the mesh's axes ([pp,] [replicate,] shard
// [, tp], named so); the model options; the FSDP plan options on `mesh`
// (offloaded state in `host`'s memory); the tensor-parallel plan options on
// the "tp" axis.
std::vector<MeshAxis> MeshAxesFor(const Strategy& strategy);
models::TransformerOptions ModelOptionsFor(const Strategy& strategy);
fsdp::FsdpPlanOptions FsdpOptionsFor(const Strategy& strategy, DeviceMesh* mesh,
                                     Device host = Device::Cpu());
models::TensorParallelPlanOptions TensorParallelOptionsFor(
    const Strategy& strategy);
// A pipeline stage's mesh: `mesh` without its "pp" axis.
absl::StatusOr<DeviceMesh*> StageMesh(DeviceMesh* mesh);

// One pipeline rank's stages as the trainer builds them: the parts
// `schedule` gives `pp_rank` (models::BuildPipelineParts, cut at `cuts`),
// each with the tensor-parallel plan (`tp_plan`, null for none) and the FSDP
// plan (`fsdp_plan`, its mesh the mesh without "pp") applied and its sharded
// weights initialised from `seed`.
struct PipelineStages {
  std::vector<models::PipelineStagePart> parts;
  std::map<int, std::vector<fsdp::FsdpUnit*>> units_by_stage;
  std::vector<fsdp::FsdpUnit*> units;  // every stage's, in stage order
  std::vector<fsdp::ShardedParameter*> params;
  // Per parameter: whether the gradient norm counts it (a tied weight's
  // copy on a second stage does not).
  std::vector<bool> counts_in_norm;
  // The tied weight's gradient on the rank's first and last stage when it
  // has two copies here (else null): parallel::SumSharedGradients adds them.
  Tensor* tied_first = nullptr;
  Tensor* tied_last = nullptr;
};
absl::StatusOr<PipelineStages> BuildPipelineStages(
    const models::TransformerConfig& config,
    const models::TransformerOptions& options,
    const parallel::PipelineSchedule& schedule, int pp_rank,
    const std::vector<int>& cuts, const fsdp::FsdpPlanOptions& fsdp_plan,
    const models::TensorParallelPlanOptions* tp_plan, uint64_t seed);

// The model family's FSDP plan (models/<family>/parallelize.h ApplyFsdp):
// what the trainer and the dry run apply. The units, root last.
absl::StatusOr<std::vector<fsdp::FsdpUnit*>> ApplyFamilyFsdpPlan(
    models::Transformer* model, const fsdp::FsdpPlanOptions& options);

// Checks `strategy` against `config` (divisibility of the mesh, the batch,
// dtypes): the same refusals the trainer gives, as InvalidArgument naming
// the field.
absl::Status CheckStrategy(const models::TransformerConfig& config,
                           const Strategy& strategy);

// The dry run of one step on rank `rank`. Thread-safe: dry runs in one
// process take turns (the dry-run devices' accounting is process-wide). With
// `separate_host` (a GPU: offloaded state lives in host memory) the host's
// bytes are counted apart (PhaseMemory::host); without it (the CPU, where host
// and device are one memory) together with the device's.
// `backend`: whose collectives' scratch is counted (Gloo on the CPU, NCCL
// on a GPU).
absl::StatusOr<DryRunResult> DryRun(
    const models::TransformerConfig& config, const Strategy& strategy,
    int rank = 0, bool separate_host = false,
    SimulatedBackend backend = SimulatedBackend::kGloo);

// The same step for real on `device`, its groups from `factory` (the test of
// the dry run's exactness). The phases' figures are those of `device`'s
// allocator (GetAllocator), which should start empty; no ops are recorded.
absl::StatusOr<DryRunResult> RunStepOn(const models::TransformerConfig& config,
                                       const Strategy& strategy, int rank,
                                       ProcessGroupFactory factory,
                                       Device device);

}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_DRY_RUN_H_
