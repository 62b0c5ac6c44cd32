// fully_shard: FSDP2-style sharding of a module tree, applied bottom-up.
//
// FullyShard(modules, options) makes one unit (param group) of the
// parameters of `modules` not already taken by an inner unit: each becomes a
// Shard(0) DTensor of fp32 master values on the mesh's shard axis (Replicate
// on the replicate axis of a 2-D mesh: HSDP), with an fp32 sharded gradient
// of the same layout. With tensor parallelism (FullyShardOptions::tp_axis)
// what a unit shards, gathers and reduces is each rank's tensor-parallel
// piece, over the shard axis only. The unit hooks its first module:
//   pre-forward   all-gather the unit (one flat buffer in param dtype, cast
//                 fused into the copy-in, dim-0 padding at the tail; the
//                 all-gather is in place: this rank's segment is written
//                 straight into its slot of the output), copy out the
//                 unsharded parameters, and prefetch the next unit;
//   post-forward  free the unsharded parameters (reshard_after_forward: true
//                 = ZeRO-3; false = keep them until backward: ZeRO-2; with
//                 hpz_degree N, keep only the 1/N piece of the gathered
//                 buffer that an all-gather within N ranks needs: ZeRO++ hpZ);
//   pre-backward  all-gather again if needed (hpZ: within the N-rank group,
//                 from the kept piece), prefetch the unit that runs backward
//                 next;
//   post-backward free the unsharded parameters, then one reduce-scatter of
//                 the unit's gradients in reduce dtype (average over the
//                 data-parallel ranks unless a divide factor is set).
// A reduce-scatter is finished (waited for, all-reduced across the replicate
// axis for HSDP, accumulated into the fp32 sharded gradients, its buffers
// freed) at the next unit's post-backward, just before that unit allocates
// its own, and the root unit (the last FullyShard, containing all others)
// finishes the last one at the end of backward.
//
// Memory (MemoryTag::kCommBuffers holds all-gather buffers, unsharded
// parameters, hpZ pieces and reduce-scatter buffers; every free point is
// deterministic, none waits for a destructor elsewhere):
//   * all-gather output: freed right after the copy-out to the parameters;
//   * unsharded parameters: freed at post-forward (ZeRO-3, not the root) and
//     always at post-backward;
//   * hpZ piece: made at the forward copy-out, consumed (freed) by the
//     backward all-gather, or replaced by the next forward's;
//   * reduce-scatter input and output: freed when the reduce-scatter is
//     finished (above).
// So with the recorded-order prefetching, ZeRO-3 holds at most: the root
// unit's unsharded parameters, the unsharded parameters and all-gather output
// of the unit running, the all-gather output of the one prefetched unit, and
// one reduce-scatter's buffers (plus the backend's own scratch).
//
// On a one-rank shard axis nothing moves between ranks, so a unit skips
// the copies a collective would need: computing in f32 (no offload) its
// parameters are views of the masters; in another dtype they are views of
// the cast copy-in (when each starts 64-byte aligned in it); each gradient
// is cast straight into its f32 shard instead of a reduce-scatter (unless
// there are replicas, offload, or a reduce dtype other than f32 and the
// gradient's own), and an f32 gradient the backward wrote whole (the first
// of a step; alone in its storage) becomes the shard itself, the old shard
// freed. The values are those of the collectives bit for bit.
//
// Offload (OffloadPolicy::offload_params): the fp32 masters and gradients
// live on the host whatever the compute device (the mesh's shard group's
// device: cpu for Gloo, cuda:N for NCCL), so an optimizer that runs where
// its parameters are (optim::AdamW) keeps its state and runs its update on
// the host too. The copy-in casts on the host into one host staging segment
// and moves it with one host-to-device copy into the all-gather slot; the
// reduced gradient shard comes back with one device-to-host copy and is
// accumulated on the host. Honest limits: the host memory comes from the
// process's host allocator (core has no page-locked allocator, so with CUDA
// these copies are synchronous copies from pageable memory), and on a
// CPU-only machine the host *is* the compute device: offloading then saves
// nothing and only adds the staging copies; it exists there so the branch
// is exercised and checked.
//
// Forward-only passes (evaluation, e.g. Transformer::Logits) need nothing
// special: when the root's next forward starts and the previous forward had
// no backward, every unit forgets that forward and frees what it kept for
// the backward (ZeRO-2 parameters, hpZ pieces), so evaluation between steps
// changes neither the numbers nor the memory of training.
//
// With SetRequiresGradientSync(false) a unit keeps its unsharded gradients
// across backwards with no communication; the first backward with sync on
// reduces the accumulated sum.
//
// Frozen parameters (Parameter::requires_grad false when FullyShard runs)
// are gathered like the others but have no gradient shard and no place in
// the reduce-scatter, whose segment holds the trainable parameters only; a
// unit with nothing to train issues no reduce-scatter at all (the layers
// compute no gradient for them; a frozen parameter that receives one is an
// error naming it).
//
// Collectives run on two comm streams per root (all-gather, reduce-scatter;
// worker threads for CPU groups, CUDA streams for GPU ones)
// and their buffers are held by the unit until the Work completes; the order
// units run in is recorded on the first forward and drives prefetching.
#ifndef FSDPP_FSDP_FULLY_SHARD_H_
#define FSDPP_FSDP_FULLY_SHARD_H_

#include <cstdint>
#include <map>
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

// Dtypes of the communication and compute (the masters stay fp32).
struct MixedPrecisionPolicy {
  DType param_dtype = DType::kF32;   // all-gather and compute dtype
  DType reduce_dtype = DType::kF32;  // reduce-scatter dtype
};

// Where the sharded state lives (FSDP2's CPUOffloadPolicy); see the file
// comment for what it means on a CPU-only machine.
struct OffloadPolicy {
  // Keep the fp32 sharded masters and gradients (and hence the optimizer
  // state, allocated beside them) in host memory; they move to the compute
  // device only as the all-gather's input and back as the reduced shard.
  bool offload_params = false;
  // The host the state is offloaded to. A dry run (plan/) passes a stand-in
  // meta device, so that host bytes are counted apart from the device's.
  Device host = Device::Cpu();
};

// How FullyShard shards one unit.
struct FullyShardOptions {
  // 1-D mesh: the shard axis. 2-D mesh: {replicate, shard} (HSDP); the last
  // axis shards.
  DeviceMesh* mesh = nullptr;
  // Free the unsharded parameters after forward (ZeRO-3) or keep them for
  // backward (ZeRO-2).
  bool reshard_after_forward = true;
  // ZeRO++ hpZ: 0 or 1 = off; N > 1 (dividing the shard axis size) makes a
  // unit that reshards after forward keep this rank's 1/N piece of the
  // gathered unit — the piece for its position in its group of N consecutive
  // shard ranks (DeviceMesh::Subgroup) — so the backward all-gather runs
  // within those N ranks only. Costs (shard axis size / N) segments of param
  // dtype per unit between forward and backward. Units that keep their
  // parameters unsharded after forward (reshard_after_forward = false, and
  // the root unit) have nothing to regather and ignore it, so one set of
  // options serves a whole plan.
  int hpz_degree = 0;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  // Gradients are divided by this instead of averaged (0 = average over all
  // data-parallel ranks).
  float gradient_divide_factor = 0.0f;
  // FSDP + tensor parallelism: the mesh axis the model's parameters were
  // split over (parallel::ParallelizeModule; empty: none, and pieces are
  // refused). The mesh is then [shard, tp] or [replicate, shard, tp] (the
  // axes in any order; the other axes are the data-parallel ones as above).
  // Each rank shards its tensor-parallel piece: all-gathers run over the
  // shard axis only, and the masters are DTensors on the mesh [tp, shard]
  // ([replicate, tp, shard]) placed (the tp split, Shard) with the piece's
  // layout as global shape, so a dim split by both is split by tp first.
  std::string tp_axis;
  // FSDP of expert stacks under expert parallelism (parallel::ShardExperts):
  // the mesh axis their pieces' dim 0 (the experts) is split over; with
  // tp_axis as well, tp splits the piece's other split dim (the experts'
  // hidden). The masters' mesh is then [replicate,] ep, [tp,] shard.
  std::string ep_axis;
};

// One parameter under FSDP.
struct ShardedParameter {
  std::string name;      // fully qualified, from the unit's root module
  Parameter* parameter;  // the module's parameter (data = unsharded view)
  DTensor master;        // fp32 values, Shard(0) (+ Replicate for HSDP,
                         // + the tp split with tensor parallelism)
  DTensor grad;          // fp32, same layout; undefined when frozen
  Shape shape;           // the parameter's global shape
  // Parameter::requires_grad when the unit was made: false (frozen) gives
  // no gradient shard, no place in the reduce-scatter and (for the
  // optimizer's callers) no state. Set requires_grad before FullyShard.
  bool requires_grad = true;
};

// Collectives a unit issued since FullyShard (for tests and debugging).
struct FsdpUnitStats {
  // All-gathers issued in forward / in backward, keyed by the number of ranks
  // of the group they ran on (hpZ's backward ones run on the N-rank group;
  // on one rank computing in f32, the unshards that view the masters).
  std::map<int, int64_t> forward_all_gathers;
  std::map<int, int64_t> backward_all_gathers;
  // Of those, the ones issued ahead of time by a unit's prefetch.
  int64_t prefetched_all_gathers = 0;
  // Gradient reductions: reduce-scatters, or on a one-rank shard axis
  // without replicas the local cast of each gradient into its shard.
  int64_t reduce_scatters = 0;
  // Elements each rank put into those reduce-scatters (segment x ranks per
  // reduce-scatter: the trainable parameters' padded rows, no frozen ones).
  int64_t reduce_scatter_elements = 0;
  // HSDP: all-reduces over the replicas (one per reduce-scatter, or one per
  // SetRequiresAllReduce(true) backward when it was off before).
  int64_t replica_all_reduces = 0;
};

class FsdpUnit;

// How FSDP splits one parameter over the shard ranks (internal to a unit):
// the tensor it gathers (the parameter, or this rank's tensor-parallel piece
// of it) viewed as `view`, split on `dim`; `outer` / `inner` count the
// elements before / after that dim. Dim 0 of the tensor itself, except for a
// piece that is a box of a view with other dims (GPT-2's c_attn [3, C / tp, C]
// of [3, C, C]): there the dim tensor parallelism splits, so that each rank's
// rows of each block stay one box of the view.
struct FsdpSplitView {
  Shape view;
  int dim = 0;
  int64_t outer = 1, rows = 1, inner = 1;
};

// Shards `modules` (their parameters not owned by inner units) as one unit.
// Errors: a module already sharded, a parameter shared with a unit that is
// neither inner nor this one (put tied modules in one call), a mesh that is
// not 1-D or 2-D (besides the tp axis), a tensor-parallel piece without
// tp_axis, an hpz_degree that is negative or does not divide the shard axis
// size. Parameters may be on the meta device (materialise with
// InitShardedWeights) or materialised (their values, or their tensor-parallel
// pieces, are sharded and the full copies freed).
absl::StatusOr<FsdpUnit*> FullyShard(std::vector<Module*> modules,
                                     const FullyShardOptions& options);

// Fills every sharded master of `root`'s units from its parameter's InitSpec,
// each rank only its box: bitwise equal to Module::InitWeights of the whole
// model with the same seed.
absl::Status InitShardedWeights(Module* root, uint64_t seed);

// The unit `module` heads, or nullptr.
FsdpUnit* UnitOf(Module* module);

// All sharded parameters of the units under `root` (root's unit last).
std::vector<ShardedParameter*> ShardedParameters(Module* root);

// One param group: its sharded parameters, hooks, collectives and buffers.
// Owned by the first module it hooks (lives as long as that module).
class FsdpUnit {
 public:
  // Unregisters the unit's modules and parameters.
  ~FsdpUnit();

  // All-gathers the parameters and installs the unsharded values (waits).
  absl::Status Unshard();
  // Frees the unsharded parameters (and an hpZ piece).
  absl::Status Reshard();
  // With false, backward keeps unsharded gradients locally (no comm).
  void SetRequiresGradientSync(bool sync) { requires_gradient_sync_ = sync; }
  // FSDP2's set_reshard_after_backward: with false, the unit keeps its
  // gathered parameters after its backward, until a backward with true
  // frees them. With reshard_after_forward false and gradient sync off
  // before the last micro-batch that is ZeRO-1's schedule: one all-gather
  // per unit and step, one reduce-scatter.
  void SetReshardAfterBackward(bool reshard) {
    reshard_after_backward_ = reshard;
  }
  // HSDP (FSDP2's set_requires_all_reduce): with false, backward still
  // reduce-scatters over the shard group but does not all-reduce over the
  // replicas; the reduced shards add up (in f32) in a buffer of the unit, a
  // sharded gradient's size, and the gradients are left as they are. The
  // next backward with true adds its shard to that sum and all-reduces it
  // once, so gradient accumulation crosses the replicas' (often cross-node)
  // links once per step instead of once per micro-batch. No effect without
  // a replicate axis, or while gradient sync is off.
  void SetRequiresAllReduce(bool all_reduce) {
    requires_all_reduce_ = all_reduce;
  }
  // Whether reduced shards wait in the replica buffer for an all-reduce.
  bool has_pending_replica_sum() const { return replica_sum_.defined(); }
  // A step's zero_grad for this unit, done lazily (as FSDP2 assigns a fresh
  // sharded gradient on the first reduction after zero_grad): the unit's
  // next reduction writes its sharded gradients instead of adding to them,
  // so they are neither zeroed nor read. FinishZeroGrad() after the step's
  // backward passes zeroes them if no reduction came (a unit that took no
  // part in the step).
  void ZeroGradOnNextReduction() { zero_on_next_reduction_ = true; }
  absl::Status FinishZeroGrad();
  // Units whose all-gather to issue when this unit starts forward (explicit
  // prefetching, in this order; once called, the recorded order no longer
  // decides for this unit, and an empty list prefetches nothing).
  void SetModulesToForwardPrefetch(std::vector<FsdpUnit*> units) {
    forward_prefetch_ = std::move(units);
    explicit_forward_prefetch_ = true;
  }
  // The same for the start of this unit's backward.
  void SetModulesToBackwardPrefetch(std::vector<FsdpUnit*> units) {
    backward_prefetch_ = std::move(units);
    explicit_backward_prefetch_ = true;
  }

  // The unit's sharded parameters.
  std::vector<ShardedParameter>& parameters() { return params_; }
  // The first module's kind ("TransformerBlock", "+..." for several).
  const std::string& name() const { return name_; }
  // True for the outermost unit of its family.
  bool is_root() const { return is_root_; }
  // Elements of one rank's all-gather segment (padded), per rank.
  int64_t segment_elements() const { return segment_; }
  // Elements of one rank's reduce-scatter segment: the trainable
  // parameters' padded rows (0 when all are frozen: no reduce-scatter).
  int64_t gradient_segment_elements() const { return grad_segment_; }
  // The device the unit all-gathers to and computes on (its shard group's).
  Device compute_device() const { return compute_device_; }
  // True when the masters and gradients live on the host (OffloadPolicy).
  bool offload_params() const { return options_.offload_policy.offload_params; }
  // The N-rank group of hpZ's backward all-gathers (nullptr when off).
  ProcessGroup* hpz_group() const { return hpz_group_; }
  // True from issuing this unit's all-gather until its copy-out.
  bool all_gather_in_flight() const { return gather_work_ != nullptr; }
  // Collectives issued so far.
  const FsdpUnitStats& stats() const { return stats_; }

 private:
  friend absl::StatusOr<FsdpUnit*> FullyShard(std::vector<Module*>,
                                              const FullyShardOptions&);
  friend absl::Status InitShardedWeights(Module*, uint64_t);
  struct Shared;
  FsdpUnit() = default;

  // FullyShard's steps, in this order, on a new unit whose name_, modules_
  // and options_ are set.
  //
  // Sets the shard (and replicate, hpZ) groups, ranks and devices from
  // options_.mesh; errors for a bad hpz_degree.
  absl::Status InitGroups();
  // Registry checks (no module already sharded, no parameter owned by a unit
  // outside this one); adds the parameters of modules_ that no inner unit
  // owns to params_ and returns the inner units.
  absl::StatusOr<std::vector<FsdpUnit*>> ClaimParameters();
  // Creates each parameter's fp32 master and grad shards (from its values if
  // materialised) and leaves the parameter on the meta device.
  absl::Status ShardParameters();
  // Makes this unit the root of `inner`, with new comm streams.
  absl::Status HeadFamily(const std::vector<FsdpUnit*>& inner);
  // Records this unit as the one hooking modules_ and owning params_.
  void Register();

  // Copy-in + issue the all-gather (`prefetch`: on another unit's behalf).
  absl::Status BeginUnshard(bool prefetch);
  absl::Status FinishUnshard();  // wait + copy-out (+ keep an hpZ piece)
  // ReduceGradients' reduce-scatter over spans of the gradients
  // (reduce_spans_).
  absl::Status ReduceGradientSpans(DType input_dtype);
  // Writes this rank's segment (local rows in param dtype, zero padding) into
  // `slot` on the compute device.
  absl::Status CopyIn(Tensor* slot);
  // The same into this rank's runs of gather_out_ (gather_runs_).
  absl::Status CopyInRuns();
  // Frees the unsharded parameters, keeping an hpZ piece.
  absl::Status FreeUnsharded();
  absl::Status ReduceGradients();
  // The dtype of the reduce-scatter's input: the gradients' own (bf16 / f16)
  // when they are reduced in f32 by a group that widens them
  // (ProcessGroup::ReduceScatterWidens), else the reduce dtype. Internal
  // error if the gradients go as they are (widened, or as spans) and one is
  // in another dtype.
  absl::StatusOr<DType> ReduceScatterInputDType() const;
  // ReduceGradients when reduce_locally_.
  absl::Status ReduceLocally();
  // FailedPrecondition naming a frozen parameter that has a gradient.
  absl::Status CheckFrozenGradients();
  absl::Status FinishReductions();
  absl::Status PreForward();
  // Root only: resets the units after a forward with no backward.
  absl::Status AbandonForward();
  absl::Status PostForward();
  absl::Status PreBackward();
  absl::Status PostBackward();
  absl::Status CheckInitialized() const;
  std::vector<FsdpUnit*> NextUnits(bool backward);

  std::string name_;
  std::vector<Module*> modules_;
  FullyShardOptions options_;
  std::vector<ShardedParameter> params_;
  // How each of params_ is split over the shard ranks (fully_shard.cc).
  std::vector<FsdpSplitView> views_;
  DeviceMesh* master_mesh_ = nullptr;  // the masters' DTensor mesh
  ProcessGroup* shard_group_ = nullptr;
  ProcessGroup* replicate_group_ = nullptr;  // HSDP only
  ProcessGroup* hpz_group_ = nullptr;        // hpZ only
  Device compute_device_ = Device::Cpu();
  Device state_device_ = Device::Cpu();  // masters and grads
  int world_ = 1, rank_ = 0;             // on the shard axis
  bool in_place_ = false;  // one rank: parameters are views of the gather
  // One rank, f32 compute, no offload: parameters are views of the masters
  // (nothing gathered, copied or cast).
  bool alias_masters_ = false;
  // One rank, no replicas, no offload, reduce dtype f32 or the param dtype:
  // gradients are cast into their shards (ReduceLocally).
  bool reduce_locally_ = false;
  std::vector<int64_t> offsets_;  // param start in a segment
  int64_t segment_ = 0;
  // Where the shard group gathers into runs (ProcessGroup::AllGathersRuns;
  // no hpZ, no offload): the parameters are gathered straight into their own
  // layout and are views of it (no copy-out). Each parameter's start in that
  // layout (kInPlaceAlignment-aligned), its elements, and each rank's runs.
  bool gather_runs_ = false;
  std::vector<int64_t> layout_offsets_;
  int64_t layout_elements_ = 0;
  std::vector<std::vector<BufferRun>> layout_runs_;  // by rank
  // The reduce-scatter's segment: each trainable parameter's start (-1 for
  // frozen ones) and the padded total.
  std::vector<int64_t> grad_offsets_;
  int64_t grad_segment_ = 0;
  // Where the shard group takes a reduce-scatter's input as spans
  // (ProcessGroup::ReduceScattersSpans; no replicas, no offload, gradients
  // in the input dtype): the gradients go to it as they are, held until it
  // completes (no copy-in). Each trainable parameter's start in this rank's
  // reduced chunk (no padding; -1 for frozen ones) and the chunk's size.
  bool reduce_spans_ = false;
  std::vector<int64_t> reduced_offsets_;
  int64_t reduced_elements_ = 0;
  bool initialized_ = false;
  bool is_root_ = false;
  bool requires_gradient_sync_ = true;
  bool reshard_after_backward_ = true;
  bool requires_all_reduce_ = true;
  bool zero_on_next_reduction_ = false;
  // HSDP with requires_all_reduce_ off: this replica's sum of reduced
  // shards ([segment_] f32) awaiting the all-reduce.
  Tensor replica_sum_;
  bool unsharded_ = false;
  int forward_modules_ = 0, backward_modules_ = 0;  // of this iteration
  std::shared_ptr<Shared> shared_;  // per-root state (order, streams, pending)
  // In-flight all-gather (gather_in_ is only set for hpZ's: the piece).
  std::shared_ptr<Work> gather_work_;
  Tensor gather_in_, gather_out_;
  // hpZ: this rank's piece of the gathered buffer, from forward to backward.
  Tensor hpz_piece_;
  FsdpUnitStats stats_;
  std::vector<FsdpUnit*> forward_prefetch_, backward_prefetch_;
  bool explicit_forward_prefetch_ = false, explicit_backward_prefetch_ = false;
};

}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_FSDP_FULLY_SHARD_H_
