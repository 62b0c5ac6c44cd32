// Replicate (DDP); see replicate.h.
#include "fsdp/replicate.h"

#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/trace.h"
#include "fsdp/auto_wrap.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace fsdp {
namespace {

constexpr absl::Duration kWaitTimeout = absl::Minutes(10);

// Roots already replicated (a second Replicate would double the hooks).
std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::set<Module*>& ReplicatedRoots() {
  static auto* roots = new std::set<Module*>;
  return *roots;
}

// Replicate's argument checks: a root and a mesh, a float reduce dtype,
// materialised parameters, bucket modules strictly inside the root.
absl::Status CheckReplicateArguments(Module* root,
                                     const ReplicateOptions& options) {
  if (root == nullptr)
    return absl::InvalidArgumentError("Replicate: null root");
  if (options.mesh == nullptr) {
    return absl::InvalidArgumentError("Replicate: needs a mesh");
  }
  if (!IsFloatingPoint(options.reduce_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Replicate: reduce dtype must be a float dtype, got ",
                     DTypeName(options.reduce_dtype)));
  }
  for (auto& [fqn, p] : root->NamedParameters()) {
    if (p->data.is_meta() || !p->data.defined()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Replicate: parameter '", fqn,
          "' is not materialised (meta): call ToEmpty and InitWeights first; "
          "a module under FullyShard cannot also be replicated"));
    }
  }
  std::set<Module*> in_tree;
  for (auto& [name, m] : root->NamedModules()) in_tree.insert(m);
  for (Module* b : options.bucket_modules) {
    if (b == root || in_tree.count(b) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Replicate: bucket module ", b == nullptr ? "null" : b->kind(),
          b == root ? " is the root (whose parameters form the last bucket)"
                    : " is not inside the root"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// The parameters reduced together, and when.
struct ReplicatedModule::Bucket {
  std::vector<ReplicatedParameter*> params;
  int64_t elements = 0;
  int forward_calls = 0, backward_calls = 0;  // of this iteration
  bool issued = false;  // Reduced in this backward already.
};

// An all-reduce in flight and the buffer it works on.
struct ReplicatedModule::Pending {
  Bucket* bucket;
  std::shared_ptr<Work> work;
  Tensor buffer;
};

ReplicatedModule::~ReplicatedModule() {
  // Buffers must outlive their collectives.
  for (Pending& p : pending_) p.work->Wait(kWaitTimeout).IgnoreError();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  ReplicatedRoots().erase(root_);
}

std::vector<std::vector<std::string>> ReplicatedModule::BucketNames() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& bucket : buckets_) {
    std::vector<std::string> names;
    for (const ReplicatedParameter* p : bucket->params)
      names.push_back(p->name);
    out.push_back(std::move(names));
  }
  return out;
}

absl::Status ReplicatedModule::PreForward(Bucket* bucket) {
  if (in_backward_) return absl::OkStatus();  // Recomputation.
  ++bucket->forward_calls;
  return absl::OkStatus();
}

absl::Status ReplicatedModule::PostBackward(Bucket* bucket) {
  if (++bucket->backward_calls < bucket->forward_calls) {
    return absl::OkStatus();
  }
  bucket->forward_calls = bucket->backward_calls = 0;
  if (!requires_gradient_sync_) return absl::OkStatus();
  return IssueReduce(bucket);
}

absl::Status ReplicatedModule::IssueReduce(Bucket* bucket) {
  bucket->issued = true;
  if (bucket->elements == 0) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(
      Tensor buffer, Tensor::Zeros({bucket->elements}, options_.reduce_dtype,
                                   group_->device(), MemoryTag::kCommBuffers));
  int64_t offset = 0;
  for (ReplicatedParameter* p : bucket->params) {
    if (!p->parameter->grad.SharesStorageWith(p->grad.local())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Replicate: the gradient of '", p->name,
          "' was replaced or dropped (zero gradients in place, e.g. "
          "ZeroGrad() without set_to_none)"));
    }
    const Tensor grad = p->parameter->grad.Flatten();
    FSDPP_ASSIGN_OR_RETURN(Tensor slice, buffer.Narrow(offset, grad.numel()));
    FSDPP_RETURN_IF_ERROR(Copy(grad, &slice));  // Cast fused into the packing.
    offset += grad.numel();
  }
  CollectiveOptions o;
  o.stream = stream_.get();
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group_->AllReduce(AsBuffer(buffer), ReduceOp::kAvg, o));
  pending_.push_back({bucket, std::move(work), std::move(buffer)});
  return absl::OkStatus();
}

absl::Status ReplicatedModule::FinishReductions() {
  std::vector<Pending> pending = std::move(pending_);
  pending_.clear();
  absl::Status first = absl::OkStatus();
  for (Pending& r : pending) {
    absl::Status s;
    {
      TraceSpan wait("wait all_reduce (gradients)", "comm_wait");
      s = r.work->Wait(kWaitTimeout);
    }
    if (!s.ok()) {
      if (first.ok()) first = s;
      continue;
    }
    int64_t offset = 0;
    for (ReplicatedParameter* p : r.bucket->params) {
      Tensor grad = p->parameter->grad.Flatten();
      FSDPP_ASSIGN_OR_RETURN(Tensor slice,
                             r.buffer.Narrow(offset, grad.numel()));
      FSDPP_RETURN_IF_ERROR(Copy(slice, &grad));
      offset += grad.numel();
    }
  }
  return first;
}

absl::StatusOr<ReplicatedModule*> Replicate(Module* root,
                                            const ReplicateOptions& options) {
  FSDPP_RETURN_IF_ERROR(CheckReplicateArguments(root, options));
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (!ReplicatedRoots().insert(root).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("Replicate: ", root->kind(), " is already replicated"));
    }
  }

  auto state = std::shared_ptr<ReplicatedModule>(new ReplicatedModule);
  state->root_ = root;
  state->options_ = options;
  DeviceMesh* mesh = options.mesh;
  if (mesh->ndim() == 1) {
    FSDPP_ASSIGN_OR_RETURN(state->group_, mesh->Group(mesh->axes()[0].name));
  } else {
    FSDPP_ASSIGN_OR_RETURN(state->group_, mesh->FlatGroup());
  }
  state->stream_ = std::make_unique<CpuStream>("replicate:all_reduce");
  FSDPP_ASSIGN_OR_RETURN(auto by_param, state->ReplicateParameters());
  FSDPP_ASSIGN_OR_RETURN(auto hooked, state->MakeBuckets(by_param));
  return ReplicatedModule::InstallHooks(std::move(state), hooked);
}

absl::StatusOr<std::map<Parameter*, ReplicatedParameter*>>
ReplicatedModule::ReplicateParameters() {
  DeviceMesh* mesh = options_.mesh;
  const std::vector<Placement> replicated(mesh->ndim(), Placement::Replicate());
  std::map<Parameter*, ReplicatedParameter*> by_param;
  const auto named = root_->NamedParameters();
  params_.reserve(named.size());
  for (auto& [fqn, p] : named) {
    if (p->has_piece()) {
      return absl::UnimplementedError(
          absl::StrCat("Replicate: parameter '", fqn,
                       "' is a tensor-parallel piece; data parallelism over a "
                       "tensor-parallel model is not available yet"));
    }
  }
  for (auto& [fqn, p] : named) {
    if (options_.broadcast_parameters) {
      FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                             group_->Broadcast(AsBuffer(p->data), /*root=*/0));
      FSDPP_RETURN_IF_ERROR(
          Annotate(work->Wait(kWaitTimeout),
                   absl::StrCat("Replicate: broadcasting '", fqn, "'")));
    }
    FSDPP_RETURN_IF_ERROR(p->EnsureGrad());
    ReplicatedParameter rp;
    rp.name = fqn;
    rp.parameter = p;
    FSDPP_ASSIGN_OR_RETURN(
        rp.param, DTensor::FromLocal(p->data, mesh, replicated, p->shape));
    FSDPP_ASSIGN_OR_RETURN(
        rp.grad, DTensor::FromLocal(p->grad, mesh, replicated, p->shape));
    params_.push_back(std::move(rp));
    by_param[p] = &params_.back();
  }
  return by_param;
}

absl::StatusOr<std::vector<std::pair<Module*, ReplicatedModule::Bucket*>>>
ReplicatedModule::MakeBuckets(
    const std::map<Parameter*, ReplicatedParameter*>& by_param) {
  // Buckets: each bucket module takes the parameters only it uses (not yet
  // taken), the root bucket the rest.
  std::set<Parameter*> taken;
  std::vector<std::pair<Module*, Bucket*>> hooked;
  for (Module* b : options_.bucket_modules) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<Parameter*> exclusive,
                           ExclusiveParameters(root_, b));
    auto bucket = std::make_unique<Bucket>();
    for (Parameter* p : exclusive) {
      if (!p->requires_grad || !taken.insert(p).second) continue;
      bucket->params.push_back(by_param.at(p));
      bucket->elements += NumElements(p->shape);
    }
    hooked.emplace_back(b, bucket.get());
    buckets_.push_back(std::move(bucket));
  }
  auto root_bucket = std::make_unique<Bucket>();
  for (ReplicatedParameter& rp : params_) {
    Parameter* p = rp.parameter;
    if (!p->requires_grad || !taken.insert(p).second) continue;
    root_bucket->params.push_back(&rp);
    root_bucket->elements += NumElements(p->shape);
  }
  buckets_.push_back(std::move(root_bucket));
  return hooked;
}

ReplicatedModule* ReplicatedModule::InstallHooks(
    std::shared_ptr<ReplicatedModule> state,
    const std::vector<std::pair<Module*, Bucket*>>& hooked) {
  ReplicatedModule* raw = state.get();
  for (auto& [module, bucket] : hooked) {
    ReplicatedModule::Bucket* b = bucket;
    module->AddPreForwardHook([raw, b](Module&) { return raw->PreForward(b); });
    module->AddPostBackwardHook(
        [raw, b](Module&) { return raw->PostBackward(b); });
  }
  // The root's hooks own the state: it lives as long as the root.
  raw->root_->AddPreForwardHook([raw, state](Module&) {
    if (!raw->in_backward_) {
      // A new iteration: forwards without a backward (evaluation) are over.
      for (auto& b : raw->buckets_) b->forward_calls = b->backward_calls = 0;
    }
    return absl::OkStatus();
  });
  raw->root_->AddPreBackwardHook([raw](Module&) {
    raw->in_backward_ = true;
    return absl::OkStatus();
  });
  raw->root_->AddPostBackwardHook([raw](Module&) {
    raw->in_backward_ = false;
    if (!raw->requires_gradient_sync_) return absl::OkStatus();
    // The root bucket, and any bucket whose module ran no backward this time
    // (every rank must reduce every bucket, in the same order).
    for (auto& b : raw->buckets_) {
      if (!b->issued) FSDPP_RETURN_IF_ERROR(raw->IssueReduce(b.get()));
    }
    for (auto& b : raw->buckets_) b->issued = false;
    return raw->FinishReductions();
  });
  return raw;
}

}  // namespace fsdp
}  // namespace fsdpp
