// Replicate: data parallelism without sharding (DDP, ZeRO-0), on the same
// module hook points as FullyShard, as the baseline FSDP is measured against.
//
// Every rank keeps the full parameters (materialised before Replicate, and by
// default made identical by a broadcast from rank 0) and the full gradients
// in Parameter::grad. Gradients are averaged over all ranks of the mesh in
// buckets, each one flat buffer in the reduce dtype:
//   * one bucket per `bucket_modules` entry, holding the parameters only that
//     module's subtree uses; its all-reduce is issued (asynchronously, on the
//     replicate comm stream) from the module's post-backward hook, so it
//     overlaps the backward of the modules before it, like DDP's buckets;
//   * the root bucket with everything else (tied weights such as wte/lm_head
//     included, since their gradient is complete only at the end), issued
//     from the root's post-backward hook, which then waits for every bucket
//     and writes the averages back into Parameter::grad.
// A module run several times per forward reduces after its last backward;
// forwards recomputed inside backward (activation checkpointing) don't count;
// a bucket whose module ran no backward is reduced with the root bucket.
// With SetRequiresGradientSync(false) backward communicates nothing and
// gradients accumulate locally; the next synced backward averages the sum.
//
// ReplicatedParameter gives each parameter and gradient as an all-Replicate
// DTensor sharing storage with Parameter::data / grad, so the same AdamW and
// ClipGradNorm code runs on replicated and sharded models. Gradients are
// allocated at Replicate(): zero them in place (Module::ZeroGrad() or
// optim's ZeroGrad), never set them to none, or the views go stale.
#ifndef FSDPP_FSDP_REPLICATE_H_
#define FSDPP_FSDP_REPLICATE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/stream.h"
#include "mesh/device_mesh.h"
#include "nn/module.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace fsdp {

struct ReplicateOptions {
  // Gradients are averaged over every rank of this mesh (all axes).
  DeviceMesh* mesh = nullptr;
  // Modules (strictly inside the root) whose parameters form one bucket
  // each, reduced as soon as the module's backward is done. Empty: one flat
  // bucket for the whole model, reduced at the end of backward.
  std::vector<Module*> bucket_modules;
  // dtype of the all-reduce (gradients are cast into and out of it).
  DType reduce_dtype = DType::kF32;
  // Broadcast rank 0's parameter values to every rank first (DDP does; off
  // when every rank initialised the same weights already).
  bool broadcast_parameters = true;
};

// One replicated parameter.
struct ReplicatedParameter {
  std::string name;      // fully qualified from the root
  Parameter* parameter;  // the module's parameter
  DTensor param;         // all-Replicate view of parameter->data
  DTensor grad;          // all-Replicate view of parameter->grad
};

// The replication state of one root module (lives as long as the root).
class ReplicatedModule {
 public:
  ~ReplicatedModule();

  // With false, backward keeps gradients local (no communication).
  void SetRequiresGradientSync(bool sync) { requires_gradient_sync_ = sync; }
  // Every parameter, in the root's NamedParameters order.
  std::vector<ReplicatedParameter>& parameters() { return params_; }
  // Parameter names per bucket, in reduction order (the root bucket last).
  std::vector<std::vector<std::string>> BucketNames() const;

 private:
  friend absl::StatusOr<ReplicatedModule*> Replicate(Module*,
                                                     const ReplicateOptions&);
  struct Bucket;
  struct Pending;
  ReplicatedModule() = default;

  // Replicate's steps after the argument checks, in this order:
  // Creates params_ (the replicated views of root_'s parameters, after
  // broadcasting their values if options_ say so) and returns them by
  // parameter.
  absl::StatusOr<std::map<Parameter*, ReplicatedParameter*>>
  ReplicateParameters();
  // Fills buckets_ (the root bucket last) and returns the bucket of each
  // bucket module.
  absl::StatusOr<std::vector<std::pair<Module*, Bucket*>>> MakeBuckets(
      const std::map<Parameter*, ReplicatedParameter*>& by_param);
  // Hooks the bucket modules and the root; the root's hooks own `state`.
  static ReplicatedModule* InstallHooks(
      std::shared_ptr<ReplicatedModule> state,
      const std::vector<std::pair<Module*, Bucket*>>& hooked);

  absl::Status PreForward(Bucket* bucket);
  absl::Status PostBackward(Bucket* bucket);
  absl::Status IssueReduce(Bucket* bucket);
  absl::Status FinishReductions();

  Module* root_ = nullptr;
  ReplicateOptions options_;
  ProcessGroup* group_ = nullptr;
  std::vector<ReplicatedParameter> params_;
  std::vector<std::unique_ptr<Bucket>> buckets_;  // root bucket last
  std::vector<Pending> pending_;
  std::unique_ptr<CpuStream> stream_;
  bool requires_gradient_sync_ = true;
  bool in_backward_ = false;
};

// Sets up data-parallel replication of `root`: checks that every parameter
// is materialised (not meta, i.e. not under FSDP), optionally broadcasts
// rank 0's values, allocates the gradients and hooks the buckets. Errors: no
// mesh, a meta parameter, a bucket module outside the root (or the root
// itself), a root replicated twice.
absl::StatusOr<ReplicatedModule*> Replicate(Module* root,
                                            const ReplicateOptions& options);

}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_FSDP_REPLICATE_H_
