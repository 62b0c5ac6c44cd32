// fully_shard; see fully_shard.h.
#include "fsdp/fully_shard.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "core/trace.h"
#if defined(FSDPP_WITH_CUDA)
#include "core/cuda_runtime.h"
#endif
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"

namespace fsdpp {
namespace fsdp {
namespace {

constexpr absl::Duration kWaitTimeout = absl::Minutes(10);
// A one-rank unit's parameters are views of the gathered buffer when each
// starts on a boundary the allocators give whole tensors (64 bytes), so the
// kernels see the alignment they see otherwise; else all are copied out (a
// view would keep the whole buffer alive beside the copies).
constexpr size_t kInPlaceAlignment = 64;

std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
// Module -> the unit that hooks it; parameter -> the unit that owns it.
std::map<Module*, FsdpUnit*>& ModuleUnits() {
  static auto* m = new std::map<Module*, FsdpUnit*>;
  return *m;
}
std::map<Parameter*, FsdpUnit*>& ParamOwners() {
  static auto* m = new std::map<Parameter*, FsdpUnit*>;
  return *m;
}

using SplitView = FsdpSplitView;

SplitView MakeSplitView(const Parameter& p) {
  SplitView v;
  if (p.has_piece()) {
    v.view = p.piece.size;
    const std::vector<int> split = p.piece.SplitDims();
    if (p.piece.layout.size() != p.shape.size() && !split.empty()) {
      v.dim = split[0];
    }
  } else {
    v.view = p.shape.empty() ? Shape{1} : p.shape;
  }
  for (int d = 0; d < static_cast<int>(v.view.size()); ++d) {
    if (d < v.dim) v.outer *= v.view[d];
    if (d > v.dim) v.inner *= v.view[d];
  }
  v.rows = v.view[v.dim];
  return v;
}

// Elements of one rank's (padded) segment of a parameter.
int64_t PaddedElements(const SplitView& v, int world) {
  return v.outer * ChunkSize(v.rows, world) * v.inner;
}

// Writes (overwrite: after ZeroGradOnNextReduction) or adds `scale` times
// one parameter's reduced gradient `piece` (any float dtype) into its f32
// shard `grad`, the cast fused into the write.
absl::Status AddReducedGradient(Tensor piece, float scale, bool overwrite,
                                Tensor* grad) {
  if (overwrite) {
    if (piece.dtype() != DType::kF32 || scale == 1.0f) {
      FSDPP_RETURN_IF_ERROR(Copy(piece, grad));
      if (scale != 1.0f) FSDPP_RETURN_IF_ERROR(Scale(*grad, scale, grad));
      return absl::OkStatus();
    }
    return Scale(piece, scale, grad);
  }
  if (piece.dtype() != DType::kF32) {
    FSDPP_ASSIGN_OR_RETURN(
        Tensor f32, Tensor::Empty(piece.shape(), DType::kF32, piece.device(),
                                  MemoryTag::kCommBuffers));
    FSDPP_RETURN_IF_ERROR(Copy(piece, &f32));
    piece = f32;
  }
  return Axpy(scale, piece, grad);  // Accumulate into fp32.
}

// Whether a local reduction may make the unsharded gradient `grad` the
// shard itself instead of copying it into `shard` (flat, f32): an f32
// gradient of the shard's size on its device that alone holds its whole
// storage (no view of a larger buffer, nothing else referring to it). The
// same answer on a dry run's meta tensors (they have storages of their
// sizes), so the plan follows.
bool TakesGradientWhole(const Tensor& grad, const Tensor& shard) {
  return grad.dtype() == DType::kF32 && grad.device() == shard.device() &&
         grad.numel() == shard.numel() && grad.numel() > 0 &&
         grad.storage() != nullptr && grad.storage().use_count() == 1 &&
         grad.storage_offset() == 0 && grad.storage()->bytes() == grad.nbytes();
}

// Copies rows `range` of the split dim of `whole` (the view, flattened) to
// `compact` ([outer, range.length, inner] flattened), casting between
// dtypes.
absl::Status CopyRows(const SplitView& v, Range range, const Tensor& whole,
                      const Tensor& compact) {
  const int64_t run = range.length * v.inner;
  if (run == 0) return absl::OkStatus();
  for (int64_t o = 0; o < v.outer; ++o) {
    FSDPP_ASSIGN_OR_RETURN(
        Tensor w, whole.Narrow((o * v.rows + range.begin) * v.inner, run));
    FSDPP_ASSIGN_OR_RETURN(Tensor c, compact.Narrow(o * run, run));
    FSDPP_RETURN_IF_ERROR(Copy(w, &c));
  }
  return absl::OkStatus();
}

// True if `inner` is `outer` or one of its descendants.
bool IsWithin(Module* inner, Module* outer) {
  for (auto& [name, m] : outer->NamedModules()) {
    if (m == inner) return true;
  }
  return false;
}

}  // namespace

// State shared by all units of one root: comm streams, the recorded order,
// reductions in flight.
// A comm stream on `device`: a worker thread for the CPU (Gloo), a CUDA
// stream for a GPU (NCCL), so collectives overlap compute on either.
absl::StatusOr<std::unique_ptr<Stream>> MakeCommStream(Device device,
                                                       std::string name) {
  if (device.is_cuda()) {
#if defined(FSDPP_WITH_CUDA)
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<CudaStream> stream,
                           CudaStream::Create(device.index(), std::move(name)));
    return std::unique_ptr<Stream>(std::move(stream));
#else
    return absl::FailedPreconditionError(
        absl::StrCat("FullyShard: the mesh's groups are on ", device.ToString(),
                     " but fsdpp was built without CUDA (--config=cuda)"));
#endif
  }
  return std::unique_ptr<Stream>(std::make_unique<CpuStream>(std::move(name)));
}

struct FsdpUnit::Shared {
  // The all-gather and reduce-scatter streams of this family of units.
  std::unique_ptr<Stream> gather_stream, reduce_stream;
  std::vector<FsdpUnit*> order;      // forward order of the last iteration
  std::vector<FsdpUnit*> recording;  // being recorded
  bool in_backward = false;
  FsdpUnit* root = nullptr;
  struct PendingReduce {
    FsdpUnit* unit;
    std::shared_ptr<Work> work;
    Tensor input, output;           // held until the work completes
    std::vector<Tensor> gradients;  // a reduce-scatter's spans: likewise
  };
  std::vector<PendingReduce> pending;

  // A step abandoned on an error may leave reductions in flight: their
  // buffers must outlive them.
  ~Shared() {
    for (PendingReduce& r : pending) r.work->Wait(kWaitTimeout).IgnoreError();
  }
};

FsdpUnit::~FsdpUnit() {
  // Likewise an all-gather (a prefetch) still writing into gather_out_.
  if (gather_work_ != nullptr) gather_work_->Wait(kWaitTimeout).IgnoreError();
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (Module* m : modules_) {
    auto it = ModuleUnits().find(m);
    if (it != ModuleUnits().end() && it->second == this)
      ModuleUnits().erase(it);
  }
  for (ShardedParameter& p : params_) {
    auto it = ParamOwners().find(p.parameter);
    if (it != ParamOwners().end() && it->second == this)
      ParamOwners().erase(it);
  }
}

FsdpUnit* UnitOf(Module* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = ModuleUnits().find(module);
  return it == ModuleUnits().end() ? nullptr : it->second;
}

absl::StatusOr<FsdpUnit*> FullyShard(std::vector<Module*> modules,
                                     const FullyShardOptions& options) {
  if (modules.empty())
    return absl::InvalidArgumentError("FullyShard: no modules");
  DeviceMesh* mesh = options.mesh;
  const int piece_axes =
      (options.tp_axis.empty() ? 0 : 1) + (options.ep_axis.empty() ? 0 : 1);
  if (mesh == nullptr || mesh->ndim() - piece_axes < 1 ||
      mesh->ndim() - piece_axes > 2) {
    return absl::InvalidArgumentError(
        "FullyShard: needs a 1-D (shard) or 2-D (replicate, shard) mesh, "
        "plus the tp and ep axes when tp_axis and ep_axis are set");
  }
  if (!options.tp_axis.empty())
    FSDPP_RETURN_IF_ERROR(mesh->AxisIndex(options.tp_axis).status());
  if (!options.ep_axis.empty()) {
    FSDPP_RETURN_IF_ERROR(mesh->AxisIndex(options.ep_axis).status());
    if (options.ep_axis == options.tp_axis) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FullyShard: ep_axis and tp_axis are both '", options.ep_axis, "'"));
    }
  }
  const std::string name =
      absl::StrCat(modules[0]->kind(), modules.size() > 1 ? "+..." : "");
  // (An empty unit is allowed: e.g. a root whose parameters all sit in
  // inner units still coordinates their reductions.)
  auto unit = std::shared_ptr<FsdpUnit>(new FsdpUnit);
  unit->name_ = name;
  unit->modules_ = modules;
  unit->options_ = options;
  FSDPP_RETURN_IF_ERROR(unit->InitGroups());
  FSDPP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> inner, unit->ClaimParameters());
  FSDPP_RETURN_IF_ERROR(unit->ShardParameters());
  FSDPP_RETURN_IF_ERROR(unit->HeadFamily(inner));
  unit->Register();

  FsdpUnit* raw = unit.get();
  for (size_t i = 0; i < modules.size(); ++i) {
    Module* m = modules[i];
    // The first module's hook owns the unit: it lives as long as the module.
    std::shared_ptr<FsdpUnit> keep = i == 0 ? unit : nullptr;
    m->AddPreForwardHook([raw, keep](Module&) { return raw->PreForward(); });
    m->AddPostForwardHook([raw](Module&) { return raw->PostForward(); });
    m->AddPreBackwardHook([raw](Module&) { return raw->PreBackward(); });
    m->AddPostBackwardHook([raw](Module&) { return raw->PostBackward(); });
  }
  return raw;
}

absl::Status FsdpUnit::InitGroups() {
  DeviceMesh* mesh = options_.mesh;
  std::vector<std::string> data_axes;  // [replicate,] shard
  for (const MeshAxis& a : mesh->axes()) {
    if (a.name != options_.tp_axis && a.name != options_.ep_axis) {
      data_axes.push_back(a.name);
    }
  }
  const std::string& shard_axis = data_axes.back();
  FSDPP_ASSIGN_OR_RETURN(shard_group_, mesh->Group(shard_axis));
  if (data_axes.size() == 2) {
    FSDPP_ASSIGN_OR_RETURN(replicate_group_, mesh->Group(data_axes[0]));
  }
  // The masters' mesh: with tensor parallelism the tp axis comes before the
  // shard axis, so a dim both split is split by tp first (each rank's
  // piece), then by FSDP (rows of that piece), in mesh-axis order.
  master_mesh_ = mesh;
  if (!options_.tp_axis.empty() || !options_.ep_axis.empty()) {
    std::vector<std::string> order;
    if (data_axes.size() == 2) order.push_back(data_axes[0]);
    if (!options_.ep_axis.empty()) order.push_back(options_.ep_axis);
    if (!options_.tp_axis.empty()) order.push_back(options_.tp_axis);
    order.push_back(data_axes.back());
    FSDPP_ASSIGN_OR_RETURN(master_mesh_, mesh->SubMesh(order));
  }
  world_ = shard_group_->size();
  rank_ = shard_group_->rank();
  compute_device_ = shard_group_->device();
  state_device_ = options_.offload_policy.offload_params
                      ? options_.offload_policy.host
                      : compute_device_;
  if (options_.hpz_degree < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FullyShard: hpz_degree must be >= 0, got ", options_.hpz_degree));
  }
  if (options_.hpz_degree > 1) {
    if (world_ % options_.hpz_degree != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("FullyShard: hpz_degree ", options_.hpz_degree,
                       " does not divide the size ", world_, " of shard axis '",
                       shard_axis, "'"));
    }
    // Without resharding after forward there is nothing to keep a piece of.
    if (options_.reshard_after_forward) {
      FSDPP_ASSIGN_OR_RETURN(hpz_group_,
                             mesh->Subgroup(shard_axis, options_.hpz_degree));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<FsdpUnit*>> FsdpUnit::ClaimParameters() {
  std::vector<FsdpUnit*> inner;
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (Module* m : modules_) {
    auto it = ModuleUnits().find(m);
    if (it != ModuleUnits().end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "FullyShard: module ", m->kind(), " is already sharded (unit '",
          it->second->name(), "')"));
    }
  }
  for (auto& [m, u] : ModuleUnits()) {
    for (Module* outer : modules_) {
      if (IsWithin(m, outer) &&
          std::find(inner.begin(), inner.end(), u) == inner.end()) {
        inner.push_back(u);
      }
    }
  }
  std::set<Parameter*> seen;
  for (Module* m : modules_) {
    for (auto& [fqn, p] : m->UsedParameters()) {
      if (!seen.insert(p).second) continue;
      auto owner = ParamOwners().find(p);
      if (owner != ParamOwners().end()) {
        if (std::find(inner.begin(), inner.end(), owner->second) ==
            inner.end()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "FullyShard: parameter '", fqn, "' of ", m->kind(),
              " is already in unit '", owner->second->name(),
              "', which is not inside this one: a parameter shared by two "
              "units (tied weights) must go into one unit — pass both "
              "modules to one FullyShard call"));
        }
        continue;  // Taken by an inner unit.
      }
      if (p->has_piece() && options_.tp_axis.empty() &&
          options_.ep_axis.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "FullyShard: parameter '", fqn, "' of ", m->kind(),
            " is a tensor-parallel piece: set FullyShardOptions::tp_axis to "
            "the mesh axis it was split over"));
      }
      ShardedParameter sp;
      sp.name = fqn;
      sp.parameter = p;
      sp.shape = p->shape;
      params_.push_back(std::move(sp));
    }
  }
  return inner;
}

absl::Status FsdpUnit::ShardParameters() {
  // Shard each parameter: fp32 master and grad, Shard(0) on the shard axis
  // (Replicate on the replicate axis; the tensor-parallel split on the tp
  // axis).
  bool all_materialised = true;
  int64_t offset = 0;
  for (ShardedParameter& sp : params_) {
    Parameter* p = sp.parameter;
    const SplitView v = MakeSplitView(*p);
    const Range mine = ChunkRange(v.rows, world_, rank_);
    std::vector<Placement> placements;
    if (replicate_group_ != nullptr)
      placements.push_back(Placement::Replicate());
    Shape global = v.view;
    if (!options_.tp_axis.empty() || !options_.ep_axis.empty()) {
      // The ep axis splits the piece's dim 0, tp its (other) split dim.
      Placement ep = Placement::Replicate(), tp = Placement::Replicate();
      if (p->has_piece()) {
        global = p->piece.layout;
        std::vector<int> split = p->piece.SplitDims();
        if (!options_.ep_axis.empty() && !split.empty() && split[0] == 0) {
          ep = Placement::Shard(0);
          split.erase(split.begin());
        }
        if (!split.empty() && options_.tp_axis.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "FullyShard: parameter '", sp.name, "' is split on dim ",
              split[0], ", which the ep axis does not split (set tp_axis)"));
        }
        if (!split.empty()) tp = Placement::Shard(split[0]);
      }
      if (!options_.ep_axis.empty()) placements.push_back(ep);
      if (!options_.tp_axis.empty()) placements.push_back(tp);
    }
    placements.push_back(Placement::Shard(v.dim));
    Shape local_shape = v.view;
    local_shape[v.dim] = mine.length;
    FSDPP_ASSIGN_OR_RETURN(
        Tensor master, Tensor::Zeros(local_shape, DType::kF32, state_device_,
                                     MemoryTag::kParams));
    sp.requires_grad = p->requires_grad;
    Tensor grad;
    if (sp.requires_grad) {
      FSDPP_ASSIGN_OR_RETURN(
          grad, Tensor::Zeros(local_shape, DType::kF32, state_device_,
                              MemoryTag::kGrads));
    }
    if (p->data.is_meta()) {
      all_materialised = false;
    } else {
      // Materialised already: keep our rows (as f32), then drop the full copy.
      FSDPP_RETURN_IF_ERROR(
          CopyRows(v, mine, p->data.Flatten(), master.Flatten()));
    }
    FSDPP_ASSIGN_OR_RETURN(sp.master, DTensor::FromLocal(master, master_mesh_,
                                                         placements, global));
    if (sp.requires_grad) {
      FSDPP_ASSIGN_OR_RETURN(
          sp.grad, DTensor::FromLocal(grad, master_mesh_, placements, global));
    }
    offsets_.push_back(offset);
    offset += PaddedElements(v, world_);
    grad_offsets_.push_back(sp.requires_grad ? grad_segment_ : -1);
    if (sp.requires_grad) grad_segment_ += PaddedElements(v, world_);
    views_.push_back(v);
    // The module now computes in param dtype from unsharded views we install.
    p->dtype = options_.mp_policy.param_dtype;
    FSDPP_ASSIGN_OR_RETURN(
        p->data, Tensor::Empty(p->LocalShape(), p->dtype, Device::Meta()));
    p->grad = Tensor();
  }
  segment_ = offset;
  const size_t esize = DTypeSize(options_.mp_policy.param_dtype);
  gather_runs_ = world_ > 1 && hpz_group_ == nullptr && !offload_params() &&
                 shard_group_->AllGathersRuns();
  const DType param_dtype = options_.mp_policy.param_dtype;
  const DType reduce_dtype = options_.mp_policy.reduce_dtype;
  reduce_spans_ =
      world_ > 1 && replicate_group_ == nullptr && !offload_params() &&
      shard_group_->ReduceScattersSpans() &&
      (param_dtype == reduce_dtype ||
       (reduce_dtype == DType::kF32 && shard_group_->ReduceScatterWidens() &&
        (param_dtype == DType::kBF16 || param_dtype == DType::kF16)));
  if (reduce_spans_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad) {
        reduced_offsets_.push_back(-1);
        continue;
      }
      reduced_offsets_.push_back(reduced_elements_);
      reduced_elements_ += params_[i].grad.local().numel();
    }
  }
  if (gather_runs_) {
    const int64_t align = static_cast<int64_t>(kInPlaceAlignment / esize);
    layout_runs_.assign(world_, {});
    for (const SplitView& v : views_) {
      const int64_t start = layout_elements_;
      layout_offsets_.push_back(start);
      layout_elements_ +=
          (v.outer * v.rows * v.inner + align - 1) / align * align;
      for (int r = 0; r < world_; ++r) {
        const Range range = ChunkRange(v.rows, world_, r);
        if (range.length == 0) continue;
        for (int64_t o = 0; o < v.outer; ++o) {
          layout_runs_[r].push_back(
              {start + (o * v.rows + range.begin) * v.inner,
               range.length * v.inner});
        }
      }
    }
  }
  in_place_ = world_ == 1 &&
              std::all_of(offsets_.begin(), offsets_.end(), [&](int64_t o) {
                return o * esize % kInPlaceAlignment == 0;
              });
  alias_masters_ = world_ == 1 && !offload_params() &&
                   options_.mp_policy.param_dtype == DType::kF32;
  reduce_locally_ = world_ == 1 && replicate_group_ == nullptr &&
                    !offload_params() &&
                    (reduce_dtype == DType::kF32 ||
                     reduce_dtype == options_.mp_policy.param_dtype);
  initialized_ = all_materialised;
  return absl::OkStatus();
}

absl::Status FsdpUnit::HeadFamily(const std::vector<FsdpUnit*>& inner) {
  // Family: this unit becomes the root of every unit inside it.
  shared_ = std::make_shared<FsdpUnit::Shared>();
  FSDPP_ASSIGN_OR_RETURN(shared_->gather_stream,
                         MakeCommStream(compute_device_, "fsdp:all_gather"));
  FSDPP_ASSIGN_OR_RETURN(
      shared_->reduce_stream,
      MakeCommStream(compute_device_, "fsdp:reduce_scatter"));
  is_root_ = true;
  shared_->root = this;
  for (FsdpUnit* u : inner) {
    u->is_root_ = false;
    u->shared_ = shared_;
  }
  return absl::OkStatus();
}

void FsdpUnit::Register() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (Module* m : modules_) ModuleUnits()[m] = this;
  for (ShardedParameter& sp : params_) ParamOwners()[sp.parameter] = this;
}

absl::Status InitShardedWeights(Module* root, uint64_t seed) {
  std::map<FsdpUnit*, bool> touched;
  for (auto& [fqn, p] : root->NamedParameters()) {
    FsdpUnit* unit = nullptr;
    {
      std::lock_guard<std::mutex> lock(RegistryMutex());
      auto it = ParamOwners().find(p);
      if (it != ParamOwners().end()) unit = it->second;
    }
    if (unit == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "InitShardedWeights: parameter '", fqn, "' is not in any FSDP unit"));
    }
    for (ShardedParameter& sp : unit->params_) {
      if (sp.parameter != p) continue;
      sp.name = fqn;
      const Box box = sp.master.local_box();
      Tensor local = *sp.master.mutable_local();
      FSDPP_RETURN_IF_ERROR(
          Annotate(InitBox(p->init, seed, InitStreamId(fqn), sp.master.shape(),
                           box.offset, box.shape, &local),
                   absl::StrCat("initialising the shard of '", fqn, "'")));
    }
    touched[unit] = true;
  }
  for (auto& [unit, ignored] : touched) unit->initialized_ = true;
  return absl::OkStatus();
}

std::vector<ShardedParameter*> ShardedParameters(Module* root) {
  std::vector<ShardedParameter*> out;
  for (auto& [fqn, p] : root->NamedParameters()) {
    FsdpUnit* unit = nullptr;
    {
      std::lock_guard<std::mutex> lock(RegistryMutex());
      auto it = ParamOwners().find(p);
      if (it != ParamOwners().end()) unit = it->second;
    }
    if (unit == nullptr) continue;
    for (ShardedParameter& sp : unit->parameters()) {
      if (sp.parameter == p) {
        sp.name = fqn;
        out.push_back(&sp);
      }
    }
  }
  return out;
}

absl::Status FsdpUnit::CheckInitialized() const {
  if (initialized_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("FSDP unit '", name_,
                   "': parameters are still on the meta device "
                   "(call fsdp::InitShardedWeights first)"));
}

absl::Status FsdpUnit::CopyIn(Tensor* slot) {
  OpSpan span("fsdp copy-in", "fsdp");
  const DType dtype = options_.mp_policy.param_dtype;
  const size_t esize = DTypeSize(dtype);
  // Offload: cast on the host into a host staging segment, then one
  // host-to-device copy (a host-to-host copy on a CPU-only run).
  Tensor stage = *slot;
  if (offload_params()) {
    FSDPP_ASSIGN_OR_RETURN(
        stage, Tensor::Empty({segment_}, dtype, options_.offload_policy.host,
                             MemoryTag::kCommBuffers));
  }
  char* base = static_cast<char*>(stage.raw_data());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& local = params_[i].master.local();
    const int64_t padded = PaddedElements(views_[i], world_);
    const int64_t n = local.numel();
    if (n > 0) {
      FSDPP_ASSIGN_OR_RETURN(Tensor dst, stage.Narrow(offsets_[i], n));
      FSDPP_RETURN_IF_ERROR(
          Copy(local.Flatten(), &dst));  // Cast fused into copy-in.
    }
    if (padded > n) {
      FSDPP_RETURN_IF_ERROR(ZeroBytes(base + (offsets_[i] + n) * esize,
                                      stage.device(), (padded - n) * esize));
    }
  }
  if (offload_params()) {
    FSDPP_RETURN_IF_ERROR(
        CopyBytes(slot->raw_data(), slot->device(), stage.raw_data(),
                  options_.offload_policy.host, segment_ * esize));
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::CopyInRuns() {
  OpSpan span("fsdp copy-in", "fsdp");
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor local = params_[i].master.local().Flatten();
    const SplitView& v = views_[i];
    const Range range = ChunkRange(v.rows, world_, rank_);
    const int64_t run = range.length * v.inner;
    if (run == 0) continue;
    for (int64_t o = 0; o < v.outer; ++o) {
      FSDPP_ASSIGN_OR_RETURN(Tensor src, local.Narrow(o * run, run));
      FSDPP_ASSIGN_OR_RETURN(
          Tensor dst,
          gather_out_.Narrow(
              layout_offsets_[i] + (o * v.rows + range.begin) * v.inner, run));
      FSDPP_RETURN_IF_ERROR(Copy(src, &dst));  // Cast fused into copy-in.
    }
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::BeginUnshard(bool prefetch) {
  if (unsharded_ || gather_work_ != nullptr) return absl::OkStatus();
  FSDPP_RETURN_IF_ERROR(CheckInitialized());
  if (alias_masters_) return absl::OkStatus();  // Nothing to start.
  const DType dtype = options_.mp_policy.param_dtype;
  const bool backward = shared_->in_backward;
  FSDPP_ASSIGN_OR_RETURN(
      gather_out_,
      Tensor::Empty({gather_runs_ ? layout_elements_ : segment_ * world_},
                    dtype, compute_device_, MemoryTag::kCommBuffers));
  CollectiveOptions o;
  o.stream = shared_->gather_stream.get();
  ProcessGroup* group = shard_group_;
  if (gather_runs_) {
    // Each rank's rows straight into their place in the parameters' layout.
    FSDPP_RETURN_IF_ERROR(CopyInRuns());
    FSDPP_ASSIGN_OR_RETURN(
        gather_work_,
        group->AllGatherRuns(AsBuffer(gather_out_), layout_runs_, o));
  } else if (backward && hpz_piece_.defined()) {
    // hpZ: each of the N ranks holds 1/N of the gathered buffer.
    group = hpz_group_;
    gather_in_ = std::move(hpz_piece_);
    hpz_piece_ = Tensor();
    FSDPP_ASSIGN_OR_RETURN(
        gather_work_,
        group->AllGather(AsBuffer(gather_in_), AsBuffer(gather_out_), o));
  } else {
    // In place: this rank's segment goes straight into its slot.
    FSDPP_ASSIGN_OR_RETURN(Tensor slot,
                           gather_out_.Narrow(rank_ * segment_, segment_));
    FSDPP_RETURN_IF_ERROR(CopyIn(&slot));
    FSDPP_ASSIGN_OR_RETURN(
        gather_work_,
        group->AllGather(AsBuffer(slot), AsBuffer(gather_out_), o));
  }
  ++(backward ? stats_.backward_all_gathers
              : stats_.forward_all_gathers)[group->size()];
  if (prefetch) ++stats_.prefetched_all_gathers;
  return absl::OkStatus();
}

absl::Status FsdpUnit::FinishUnshard() {
  if (unsharded_) return absl::OkStatus();
  if (alias_masters_) {
    // One rank computing in f32: the gather would copy the masters as they
    // are, so the parameters are views of the masters themselves.
    FSDPP_RETURN_IF_ERROR(CheckInitialized());
    for (ShardedParameter& sp : params_) {
      FSDPP_ASSIGN_OR_RETURN(
          sp.parameter->data,
          sp.master.local().Reshape(sp.parameter->LocalShape()));
    }
    ++(shared_->in_backward ? stats_.backward_all_gathers
                            : stats_.forward_all_gathers)[1];
    unsharded_ = true;
    return absl::OkStatus();
  }
  if (gather_work_ == nullptr) FSDPP_RETURN_IF_ERROR(BeginUnshard(false));
  {
    TraceSpan wait("wait all_gather", "comm_wait");
    FSDPP_RETURN_IF_ERROR(
        gather_work_->WaitForCompute(compute_device_, kWaitTimeout));
  }
  const bool from_piece = gather_in_.defined();
  gather_work_.reset();
  gather_in_ = Tensor();  // The consumed hpZ piece.
  const DType dtype = options_.mp_policy.param_dtype;
  const size_t esize = DTypeSize(dtype);
  if (hpz_group_ != nullptr && !from_piece && !is_root_ &&
      !shared_->in_backward) {
    // hpZ: keep the piece this rank contributes to the N-rank all-gather.
    const int64_t piece = segment_ * (world_ / hpz_group_->size());
    FSDPP_ASSIGN_OR_RETURN(
        Tensor mine, gather_out_.Narrow(hpz_group_->rank() * piece, piece));
    FSDPP_ASSIGN_OR_RETURN(hpz_piece_,
                           Tensor::Empty({piece}, dtype, compute_device_,
                                         MemoryTag::kCommBuffers));
    FSDPP_RETURN_IF_ERROR(Copy(mine, &hpz_piece_));
  }
  OpSpan span("fsdp copy-out", "fsdp");
  const char* gathered = static_cast<const char*>(gather_out_.raw_data());
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParameter& sp = params_[i];
    const SplitView& v = views_[i];
    if (in_place_ || gather_runs_) {
      // One rank, or a gather into runs: the gathered buffer already holds
      // the parameter in its own layout, so the parameter is a view of it
      // (no copy-out).
      FSDPP_ASSIGN_OR_RETURN(
          Tensor flat,
          gather_out_.Narrow(gather_runs_ ? layout_offsets_[i] : offsets_[i],
                             v.outer * v.rows * v.inner));
      FSDPP_ASSIGN_OR_RETURN(sp.parameter->data,
                             flat.Reshape(sp.parameter->LocalShape()));
      continue;
    }
    FSDPP_ASSIGN_OR_RETURN(
        Tensor full, Tensor::Empty(sp.parameter->LocalShape(), dtype,
                                   compute_device_, MemoryTag::kCommBuffers));
    char* dst = static_cast<char*>(full.raw_data());
    for (int r = 0; r < world_; ++r) {
      const Range range = ChunkRange(v.rows, world_, r);
      const int64_t run = range.length * v.inner;
      const char* src = gathered + (r * segment_ + offsets_[i]) * esize;
      for (int64_t o = 0; o < v.outer; ++o) {
        FSDPP_RETURN_IF_ERROR(
            CopyBytes(dst + ((o * v.rows + range.begin) * v.inner) * esize,
                      compute_device_, src + o * run * esize, compute_device_,
                      run * esize));
      }
    }
    sp.parameter->data = full;
  }
  gather_out_ = Tensor();
  unsharded_ = true;
  return absl::OkStatus();
}

absl::Status FsdpUnit::Unshard() {
  FSDPP_RETURN_IF_ERROR(BeginUnshard(false));
  return FinishUnshard();
}

absl::Status FsdpUnit::FreeUnsharded() {
  if (gather_work_ != nullptr) FSDPP_RETURN_IF_ERROR(FinishUnshard());
  for (ShardedParameter& sp : params_) {
    FSDPP_ASSIGN_OR_RETURN(sp.parameter->data,
                           Tensor::Empty(sp.parameter->LocalShape(),
                                         sp.parameter->dtype, Device::Meta()));
  }
  unsharded_ = false;
  return absl::OkStatus();
}

absl::Status FsdpUnit::Reshard() {
  FSDPP_RETURN_IF_ERROR(FreeUnsharded());
  hpz_piece_ = Tensor();
  return absl::OkStatus();
}

std::vector<FsdpUnit*> FsdpUnit::NextUnits(bool backward) {
  if (backward ? explicit_backward_prefetch_ : explicit_forward_prefetch_) {
    return backward ? backward_prefetch_ : forward_prefetch_;
  }
  const std::vector<FsdpUnit*>& order = shared_->order;
  auto it = std::find(order.begin(), order.end(), this);
  if (it == order.end()) return {};
  if (backward) {
    if (it == order.begin()) return {};
    return {*(it - 1)};
  }
  if (it + 1 == order.end()) return {};
  return {*(it + 1)};
}

absl::Status FsdpUnit::PreForward() {
  FSDPP_RETURN_IF_ERROR(CheckInitialized());
  if (shared_->in_backward) return FinishUnshard();  // Recomputation.
  if (is_root_) {
    // A root forward that ran before without a backward was forward-only
    // (evaluation, or an abandoned step): forget its hook counts and free
    // what it kept for the backward that never came.
    if (forward_modules_ > 0) FSDPP_RETURN_IF_ERROR(AbandonForward());
    shared_->recording.clear();
  }
  if (std::find(shared_->recording.begin(), shared_->recording.end(), this) ==
      shared_->recording.end()) {
    shared_->recording.push_back(this);
  }
  FSDPP_RETURN_IF_ERROR(FinishUnshard());
  for (FsdpUnit* next : NextUnits(/*backward=*/false)) {
    FSDPP_RETURN_IF_ERROR(next->BeginUnshard(/*prefetch=*/true));
  }
  ++forward_modules_;
  return absl::OkStatus();
}

absl::Status FsdpUnit::AbandonForward() {
  // The root too: an optimizer step may have changed the masters since.
  for (FsdpUnit* unit : shared_->order) {
    unit->forward_modules_ = unit->backward_modules_ = 0;
    if (unit != this) FSDPP_RETURN_IF_ERROR(unit->Reshard());
  }
  forward_modules_ = backward_modules_ = 0;
  return Reshard();
}

absl::Status FsdpUnit::PostForward() {
  if (shared_->in_backward) return absl::OkStatus();
  if (is_root_) shared_->order = shared_->recording;
  // Keeps an hpZ piece for the backward all-gather.
  if (options_.reshard_after_forward && !is_root_) return FreeUnsharded();
  return absl::OkStatus();
}

absl::Status FsdpUnit::PreBackward() {
  if (is_root_) shared_->in_backward = true;
  FSDPP_RETURN_IF_ERROR(FinishUnshard());
  for (FsdpUnit* next : NextUnits(/*backward=*/true)) {
    FSDPP_RETURN_IF_ERROR(next->BeginUnshard(/*prefetch=*/true));
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::PostBackward() {
  if (++backward_modules_ < forward_modules_) return absl::OkStatus();
  forward_modules_ = backward_modules_ = 0;
  // Free the unsharded parameters before the reduce-scatter allocates
  // (unless they stay for the step's next micro-batch: ZeRO-1).
  if (reshard_after_backward_) FSDPP_RETURN_IF_ERROR(Reshard());
  if (requires_gradient_sync_) {
    if (grad_segment_ > 0) {
      FSDPP_RETURN_IF_ERROR(ReduceGradients());
    } else {
      FSDPP_RETURN_IF_ERROR(CheckFrozenGradients());
    }
  }
  if (is_root_ || shared_->root == nullptr) {
    FSDPP_RETURN_IF_ERROR(FinishReductions());
    shared_->in_backward = false;
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::FinishZeroGrad() {
  if (!zero_on_next_reduction_) return absl::OkStatus();
  zero_on_next_reduction_ = false;
  for (ShardedParameter& sp : params_) {
    if (sp.requires_grad) FSDPP_RETURN_IF_ERROR(Zero(sp.grad.mutable_local()));
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::ReduceGradients() {
  // Finish the previous unit's reduce-scatter (issued during this unit's
  // backward, so normally done) and free its buffers before allocating: at
  // most one reduce-scatter's buffers are alive.
  FSDPP_RETURN_IF_ERROR(FinishReductions());
  if (reduce_locally_) return ReduceLocally();
  FSDPP_RETURN_IF_ERROR(CheckFrozenGradients());
  FSDPP_ASSIGN_OR_RETURN(const DType input_dtype, ReduceScatterInputDType());
  if (reduce_spans_) return ReduceGradientSpans(input_dtype);
  OpSpan span("fsdp reduce-scatter copy-in", "fsdp");
  const DType reduce_dtype = options_.mp_policy.reduce_dtype;
  // Every element is written once: the gradient's rows (cast fused), zeros
  // for the padding and for parameters unused this step.
  FSDPP_ASSIGN_OR_RETURN(
      Tensor input, Tensor::Empty({grad_segment_ * world_}, input_dtype,
                                  compute_device_, MemoryTag::kCommBuffers));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor output, Tensor::Empty({grad_segment_}, reduce_dtype,
                                   compute_device_, MemoryTag::kCommBuffers));
  char* input_base = static_cast<char*>(input.raw_data());
  const size_t esize = DTypeSize(input_dtype);
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParameter& sp = params_[i];
    if (!sp.requires_grad) continue;
    Parameter* p = sp.parameter;
    const bool used = p->grad.defined();  // else it contributes zeros
    const SplitView& v = views_[i];
    const int64_t padded = PaddedElements(v, world_);
    const Tensor flat = used ? p->grad.Flatten() : Tensor();
    for (int r = 0; r < world_; ++r) {
      const Range range = ChunkRange(v.rows, world_, r);
      const int64_t start = r * grad_segment_ + grad_offsets_[i];
      const int64_t rows = used ? v.outer * range.length * v.inner : 0;
      if (rows > 0) {
        FSDPP_ASSIGN_OR_RETURN(Tensor dst, input.Narrow(start, rows));
        FSDPP_RETURN_IF_ERROR(CopyRows(v, range, flat, dst));
      }
      if (padded > rows && input_base != nullptr) {
        FSDPP_RETURN_IF_ERROR(ZeroBytes(input_base + (start + rows) * esize,
                                        compute_device_,
                                        (padded - rows) * esize));
      }
    }
    p->grad = Tensor();  // Free the unsharded gradient.
  }
  const bool average = options_.gradient_divide_factor <= 0.0f;
  CollectiveOptions o;
  o.stream = shared_->reduce_stream.get();
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         shard_group_->ReduceScatter(
                             AsBuffer(input), AsBuffer(output),
                             average ? ReduceOp::kAvg : ReduceOp::kSum, o));
  shared_->pending.push_back({this, std::move(work), input, output, {}});
  ++stats_.reduce_scatters;
  stats_.reduce_scatter_elements += grad_segment_ * world_;
  return absl::OkStatus();
}

absl::Status FsdpUnit::ReduceGradientSpans(DType input_dtype) {
  // Rank q's chunk: each trainable parameter's rows of rank q, straight
  // from its gradient (zeros for a parameter unused this step).
  // (ReduceScatterInputDType checked that every gradient is input_dtype.)
  OpSpan span("fsdp reduce-scatter spans", "fsdp");
  std::vector<std::vector<BufferSpan>> spans(world_);
  const size_t esize = DTypeSize(input_dtype);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad) continue;
    const Tensor& grad = params_[i].parameter->grad;
    const char* data =
        grad.defined() ? static_cast<const char*>(grad.raw_data()) : nullptr;
    const SplitView& v = views_[i];
    for (int q = 0; q < world_; ++q) {
      const Range range = ChunkRange(v.rows, world_, q);
      const int64_t run = range.length * v.inner;
      if (run == 0) continue;
      for (int64_t o = 0; o < v.outer; ++o) {
        const int64_t first = (o * v.rows + range.begin) * v.inner;
        spans[q].push_back(
            {data == nullptr ? nullptr : data + first * esize, run});
      }
    }
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor output,
      Tensor::Empty({reduced_elements_}, options_.mp_policy.reduce_dtype,
                    compute_device_, MemoryTag::kCommBuffers));
  const bool average = options_.gradient_divide_factor <= 0.0f;
  CollectiveOptions o;
  o.stream = shared_->reduce_stream.get();
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         shard_group_->ReduceScatterSpans(
                             input_dtype, spans, AsBuffer(output),
                             average ? ReduceOp::kAvg : ReduceOp::kSum, o));
  // Issued: the op holds the gradients until it completes.
  std::vector<Tensor> held;
  for (ShardedParameter& sp : params_) {
    if (!sp.requires_grad || !sp.parameter->grad.defined()) continue;
    held.push_back(std::move(sp.parameter->grad));
    sp.parameter->grad = Tensor();
  }
  shared_->pending.push_back(
      {this, std::move(work), Tensor(), output, std::move(held)});
  ++stats_.reduce_scatters;
  stats_.reduce_scatter_elements += grad_segment_ * world_;
  return absl::OkStatus();
}

absl::StatusOr<DType> FsdpUnit::ReduceScatterInputDType() const {
  // bf16 / f16 gradients reduced in f32 go as they are when the group widens
  // them itself: the sums are the same f32 sums (the widening is exact),
  // with half the bytes copied in and sent. Decided from the policy, so
  // every rank hands the group the same dtype.
  const DType reduce_dtype = options_.mp_policy.reduce_dtype;
  const DType param_dtype = options_.mp_policy.param_dtype;
  const bool widened =
      reduce_dtype == DType::kF32 &&
      (param_dtype == DType::kBF16 || param_dtype == DType::kF16) &&
      shard_group_->ReduceScatterWidens();
  const DType dtype = widened ? param_dtype : reduce_dtype;
  // Handed over as they are (widened, or read in place as spans): every
  // gradient must already be in that dtype.
  if (widened || reduce_spans_) {
    for (const ShardedParameter& sp : params_) {
      const Tensor& grad = sp.parameter->grad;
      if (sp.requires_grad && grad.defined() && grad.dtype() != dtype) {
        return absl::InternalError(absl::StrCat(
            "FSDP unit '", name_, "': the gradient of '", sp.name, "' is ",
            DTypeName(grad.dtype()), ", not the reduce-scatter's input dtype ",
            DTypeName(dtype)));
      }
    }
  }
  return dtype;
}

absl::Status FsdpUnit::ReduceLocally() {
  // The reduce-scatter over one rank would cast each gradient into a buffer,
  // copy that buffer and copy it back out: each gradient goes straight into
  // its shard instead. The same bits: the reduction dtype is f32 or the
  // gradient's own, so the cast into it that this skips is exact.
  OpSpan span("fsdp local reduction", "fsdp");
  FSDPP_RETURN_IF_ERROR(CheckFrozenGradients());
  const bool average = options_.gradient_divide_factor <= 0.0f;
  const float scale = average ? 1.0f : 1.0f / options_.gradient_divide_factor;
  const bool overwrite = zero_on_next_reduction_;
  zero_on_next_reduction_ = false;
  for (ShardedParameter& sp : params_) {
    if (!sp.requires_grad) continue;
    Parameter* p = sp.parameter;
    Tensor grad = sp.grad.local().Flatten();
    if (!p->grad.defined()) {
      // Unused this step: the reduce-scatter's zeros.
      if (overwrite) FSDPP_RETURN_IF_ERROR(Zero(&grad));
      continue;
    }
    if (overwrite && TakesGradientWhole(p->grad, grad)) {
      // The shard becomes the gradient's own storage: no copy; the old
      // shard is freed.
      FSDPP_ASSIGN_OR_RETURN(*sp.grad.mutable_local(),
                             p->grad.Reshape(sp.grad.local().shape()));
      p->grad = Tensor();
      if (scale != 1.0f) {
        FSDPP_RETURN_IF_ERROR(
            Scale(sp.grad.local(), scale, sp.grad.mutable_local()));
      }
      continue;
    }
    if (grad.numel() > 0) {
      FSDPP_RETURN_IF_ERROR(
          AddReducedGradient(p->grad.Flatten(), scale, overwrite, &grad));
    }
    p->grad = Tensor();  // Free the unsharded gradient.
  }
  ++stats_.reduce_scatters;
  stats_.reduce_scatter_elements += grad_segment_;
  return absl::OkStatus();
}

absl::Status FsdpUnit::CheckFrozenGradients() {
  for (ShardedParameter& sp : params_) {
    if (sp.requires_grad || !sp.parameter->grad.defined()) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "FSDP unit '", name_, "': parameter '", sp.name,
        "' was frozen (requires_grad = false) when the unit was made, but "
        "its backward computed a gradient: set requires_grad before "
        "FullyShard"));
  }
  return absl::OkStatus();
}

absl::Status FsdpUnit::FinishReductions() {
  OpSpan span("fsdp reduce-scatter epilogue", "fsdp");
  std::vector<Shared::PendingReduce> pending = std::move(shared_->pending);
  shared_->pending.clear();
  for (Shared::PendingReduce& r : pending) {
    {
      TraceSpan wait("wait reduce_scatter", "comm_wait");
      FSDPP_RETURN_IF_ERROR(
          r.work->WaitForCompute(r.output.device(), kWaitTimeout));
    }
    r.input = Tensor();
    r.gradients.clear();
    FsdpUnit* unit = r.unit;
    const bool average = unit->options_.gradient_divide_factor <= 0.0f;
    if (unit->replicate_group_ != nullptr) {
      // SetRequiresAllReduce: the shard joins this replica's sum (f32), to
      // be all-reduced with a later backward's.
      const bool defer = !unit->requires_all_reduce_;
      Tensor& sum = unit->replica_sum_;
      if (defer || sum.defined()) {
        Tensor shard = r.output;
        if (shard.dtype() != DType::kF32) {
          FSDPP_ASSIGN_OR_RETURN(
              shard, Tensor::Empty(shard.shape(), DType::kF32, shard.device(),
                                   MemoryTag::kGrads));
          FSDPP_RETURN_IF_ERROR(Copy(r.output, &shard));
        }
        if (!sum.defined()) {
          if (shard.dtype() == r.output.dtype()) {
            FSDPP_ASSIGN_OR_RETURN(
                sum, Tensor::Empty(shard.shape(), DType::kF32, shard.device(),
                                   MemoryTag::kGrads));
            FSDPP_RETURN_IF_ERROR(Copy(shard, &sum));
          } else {
            sum = shard;
          }
        } else {
          FSDPP_RETURN_IF_ERROR(Add(sum, shard, &sum));
        }
        if (defer) {
          r.output = Tensor();  // Free it now, as the all-reduced ones are.
          continue;
        }
        FSDPP_RETURN_IF_ERROR(Copy(sum, &r.output));  // rounded once, if at all
        sum = Tensor();
      }
      FSDPP_ASSIGN_OR_RETURN(
          std::shared_ptr<Work> ar,
          unit->replicate_group_->AllReduce(
              AsBuffer(r.output), average ? ReduceOp::kAvg : ReduceOp::kSum));
      ++unit->stats_.replica_all_reduces;
      TraceSpan wait("wait all_reduce (replicas)", "comm_wait");
      FSDPP_RETURN_IF_ERROR(
          ar->WaitForCompute(r.output.device(), kWaitTimeout));
    }
    Tensor reduced = std::move(r.output);
    r.output = Tensor();
    if (unit->offload_params()) {
      // One device-to-host copy of the reduced shard; accumulate on the host.
      const Device host_device = unit->options_.offload_policy.host;
      FSDPP_ASSIGN_OR_RETURN(
          Tensor host, Tensor::Empty(reduced.shape(), reduced.dtype(),
                                     host_device, MemoryTag::kCommBuffers));
      FSDPP_RETURN_IF_ERROR(CopyBytes(host.raw_data(), host_device,
                                      reduced.raw_data(), reduced.device(),
                                      reduced.nbytes()));
      reduced = host;
    }
    const float scale =
        average ? 1.0f : 1.0f / unit->options_.gradient_divide_factor;
    // After ZeroGradOnNextReduction: write (cast and scale) instead of
    // zero + accumulate.
    const bool overwrite = unit->zero_on_next_reduction_;
    unit->zero_on_next_reduction_ = false;
    for (size_t i = 0; i < unit->params_.size(); ++i) {
      if (!unit->params_[i].requires_grad) continue;
      Tensor grad = unit->params_[i].grad.local().Flatten();
      if (grad.numel() == 0) continue;
      FSDPP_ASSIGN_OR_RETURN(
          Tensor piece,
          reduced.Narrow(unit->reduce_spans_ ? unit->reduced_offsets_[i]
                                             : unit->grad_offsets_[i],
                         grad.numel()));
      FSDPP_RETURN_IF_ERROR(AddReducedGradient(piece, scale, overwrite, &grad));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp
}  // namespace fsdpp
