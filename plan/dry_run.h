// A training step run on meta tensors: what one rank allocates, exactly,
// without allocating it.
//
// DryRun builds and steps the run's recipe (recipe/training.h: the model or
// this rank's pipeline stages with the family's plans, sharded
// initialisation, AdamW; the step's micro-batches, the loss and
// gradient-norm collectives, the AdamW step) -- the trainer's own code --
// on meta tensors of the dry-run device, over a mesh of simulated process
// groups that move no data and record every collective. Two steps run (the
// first records the order FSDP prefetches in from then on, so the second is
// the steady state). Of a step's micro-batches only those whose allocations
// differ run: the first two (three with HSDP, whose last one all-reduces
// over the replicas); later ones repeat the second's allocations and
// collectives exactly and are counted as copies of it (recipe::StepObserver
// caps them). Every tensor the real step allocates is made with the same
// shape, dtype and tag, in the same order and with the same lifetime; a
// MetaAccountant counts them. So the per-tag bytes (parameters, gradients,
// optimizer state, FSDP's buffers, activations) and the peak, with the phase
// where it happens, are those of the real run on that rank, for any model
// size, in milliseconds. The collectives come out too (kind, group, bytes),
// for the time model.
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
#include "core/device.h"
#include "models/config.h"
#include "plan/simulated_group.h"
#include "recipe/layout.h"

namespace fsdpp {
namespace plan {

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

// The dry run of one step on rank `rank`. Thread-safe: dry runs in one
// process take turns (the dry-run devices' accounting is process-wide). With
// `separate_host` (a GPU: offloaded state lives in host memory) the host's
// bytes are counted apart (PhaseMemory::host); without it (the CPU, where host
// and device are one memory) together with the device's.
// `backend`: whose collectives' scratch is counted (Gloo on the CPU, NCCL
// on a GPU).
absl::StatusOr<DryRunResult> DryRun(
    const models::TransformerConfig& config, const recipe::Layout& layout,
    int rank = 0, bool separate_host = false,
    SimulatedBackend backend = SimulatedBackend::kGloo);

// The same step for real on `device`, its groups from `factory` (the test of
// the dry run's exactness). The phases' figures are those of `device`'s
// allocator (GetAllocator), which should start empty; no ops are recorded.
// `host_factory`, when set, makes the groups of the step's host values (its
// loss) as the trainer does on a GPU (NCCL groups take device buffers only).
absl::StatusOr<DryRunResult> RunStepOn(const models::TransformerConfig& config,
                                       const recipe::Layout& layout, int rank,
                                       ProcessGroupFactory factory,
                                       Device device,
                                       ProcessGroupFactory host_factory = {});

}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_DRY_RUN_H_
