// fully_shard: FSDP2-style sharding of a module tree, applied bottom-up.
//
// FullyShard(modules, options) makes one unit (param group) of the
// parameters of `modules` not already taken by an inner unit: each becomes a
// Shard(0) DTensor of fp32 master values on the mesh's shard axis (Replicate
// on the replicate axis of a 2-D mesh: HSDP), with an fp32 sharded gradient
// of the same layout. The unit hooks its first module:
//   pre-forward   all-gather the unit (one flat buffer in param dtype, cast
//                 fused into the copy-in, dim-0 padding at the tail), copy out
//                 the unsharded parameters, and prefetch the next unit;
//   post-forward  free the unsharded parameters (reshard_after_forward: true
//                 = ZeRO-3; false = keep them until backward: ZeRO-2);
//   pre-backward  all-gather again if needed, prefetch the unit that runs
//                 backward next;
//   post-backward one reduce-scatter of the unit's gradients in reduce dtype
//                 (average over the data-parallel ranks unless a divide
//                 factor is set), then free the unsharded params and grads.
// The root unit (the last FullyShard, containing all others) waits for every
// reduce-scatter at the end of backward, all-reduces across the replicate
// axis (HSDP) and accumulates into the fp32 sharded gradients.
//
// With SetRequiresGradientSync(false) a unit keeps its unsharded gradients
// across backwards with no communication; the first backward with sync on
// reduces the accumulated sum.
//
// Collectives run on two comm streams per mesh (all-gather, reduce-scatter)
// and their buffers are held by the unit until the Work completes; the order
// units run in is recorded on the first forward and drives prefetching.
#ifndef FSDPP_FSDP_FULLY_SHARD_H_
#define FSDPP_FSDP_FULLY_SHARD_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "mesh/device_mesh.h"
#include "nn/module.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace fsdp {

struct MixedPrecisionPolicy {
  DType param_dtype = DType::kF32;   // all-gather and compute dtype
  DType reduce_dtype = DType::kF32;  // reduce-scatter dtype
};

struct FullyShardOptions {
  // 1-D mesh: the shard axis. 2-D mesh: {replicate, shard} (HSDP); the last
  // axis shards.
  DeviceMesh* mesh = nullptr;
  // Free the unsharded parameters after forward (ZeRO-3) or keep them for
  // backward (ZeRO-2).
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
  // Gradients are divided by this instead of averaged (0 = average over all
  // data-parallel ranks).
  float gradient_divide_factor = 0.0f;
};

// One parameter under FSDP.
struct ShardedParameter {
  std::string name;      // fully qualified, from the unit's root module
  Parameter* parameter;  // the module's parameter (data = unsharded view)
  DTensor master;        // fp32 values, Shard(0) (+ Replicate for HSDP)
  DTensor grad;          // fp32, same layout
  Shape shape;           // global shape
};

class FsdpUnit;

// Shards `modules` (their parameters not owned by inner units) as one unit.
// Errors: a module already sharded, a parameter shared with a unit that is
// neither inner nor this one (put tied modules in one call), an empty unit,
// a mesh that is not 1-D or 2-D. Parameters may be on the meta device
// (materialise with InitShardedWeights) or materialised (their values are
// sharded and the full copies freed).
absl::StatusOr<FsdpUnit*> FullyShard(std::vector<Module*> modules,
                                     const FullyShardOptions& options);

// Fills every sharded master of `root`'s units from its parameter's InitSpec,
// each rank only its rows: bitwise equal to Module::InitWeights of the whole
// model with the same seed.
absl::Status InitShardedWeights(Module* root, uint64_t seed);

// The unit `module` heads, or nullptr.
FsdpUnit* UnitOf(Module* module);

// All sharded parameters of the units under `root` (root's unit last).
std::vector<ShardedParameter*> ShardedParameters(Module* root);

class FsdpUnit {
 public:
  ~FsdpUnit();

  // All-gathers the parameters and installs the unsharded values (waits).
  absl::Status Unshard();
  // Frees the unsharded parameters.
  absl::Status Reshard();
  // With false, backward keeps unsharded gradients locally (no comm).
  void SetRequiresGradientSync(bool sync) { requires_gradient_sync_ = sync; }
  // Units whose all-gather to issue when this unit starts forward / backward
  // (explicit prefetching; empty = the recorded order decides).
  void SetModulesToForwardPrefetch(std::vector<FsdpUnit*> units) {
    forward_prefetch_ = std::move(units);
    explicit_forward_prefetch_ = true;
  }
  void SetModulesToBackwardPrefetch(std::vector<FsdpUnit*> units) {
    backward_prefetch_ = std::move(units);
    explicit_backward_prefetch_ = true;
  }

  std::vector<ShardedParameter>& parameters() { return params_; }
  const std::string& name() const { return name_; }
  bool is_root() const { return is_root_; }
  // Elements of one rank's all-gather segment (padded), per rank.
  int64_t segment_elements() const { return segment_; }

 private:
  friend absl::StatusOr<FsdpUnit*> FullyShard(std::vector<Module*>,
                                              const FullyShardOptions&);
  friend absl::Status InitShardedWeights(Module*, uint64_t);
  struct Shared;
  FsdpUnit() = default;

  absl::Status BeginUnshard();   // copy-in + issue the all-gather
  absl::Status FinishUnshard();  // wait + copy-out
  absl::Status ReduceGradients();
  absl::Status FinishReductions();
  absl::Status PreForward();
  absl::Status PostForward();
  absl::Status PreBackward();
  absl::Status PostBackward();
  absl::Status CheckInitialized() const;
  std::vector<FsdpUnit*> NextUnits(bool backward);

  std::string name_;
  std::vector<Module*> modules_;
  FullyShardOptions options_;
  std::vector<ShardedParameter> params_;
  ProcessGroup* shard_group_ = nullptr;
  ProcessGroup* replicate_group_ = nullptr;  // HSDP only
  int world_ = 1, rank_ = 0;                 // on the shard axis
  std::vector<int64_t> offsets_;             // param start in a segment
  int64_t segment_ = 0;
  bool initialized_ = false;
  bool is_root_ = false;
  bool requires_gradient_sync_ = true;
  bool unsharded_ = false;
  int forward_modules_ = 0, backward_modules_ = 0;  // of this iteration
  std::shared_ptr<Shared> shared_;  // per-root state (order, streams, pending)
  // In-flight all-gather.
  std::shared_ptr<Work> gather_work_;
  Tensor gather_in_, gather_out_;
  std::vector<FsdpUnit*> forward_prefetch_, backward_prefetch_;
  bool explicit_forward_prefetch_ = false, explicit_backward_prefetch_ = false;
};

}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_FSDP_FULLY_SHARD_H_
