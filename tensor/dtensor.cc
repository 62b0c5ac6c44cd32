// DTensor construction, redistribution planning/execution and ops; see
// dtensor.h.
#include "tensor/dtensor.h"

#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

std::vector<int> MeshShape(const DeviceMesh& mesh) {
  std::vector<int> shape;
  for (const MeshAxis& a : mesh.axes()) shape.push_back(a.size);
  return shape;
}

absl::Status ValidatePlacements(const char* op, const DeviceMesh& mesh,
                                const Shape& shape,
                                const std::vector<Placement>& placements) {
  if (static_cast<int>(placements.size()) != mesh.ndim()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", placements.size(), " placements ",
                     PlacementsToString(placements), " for the ", mesh.ndim(),
                     "-d mesh ", mesh.ToString()));
  }
  for (const Placement& p : placements) {
    if (p.is_shard() &&
        (p.dim() < 0 || p.dim() >= static_cast<int>(shape.size()))) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", p.ToString(),
                                                     " is not a dim of shape ",
                                                     ShapeToString(shape)));
    }
  }
  return absl::OkStatus();
}

Shape Zeros(size_t n) { return Shape(n, 0); }

}  // namespace

// Plans and issues one redistribution; see the header comment of dtensor.h.
class DTensorPlanner {
 public:
  DTensorPlanner(const DTensor& src, std::vector<Placement> target)
      : src_(src),
        target_(std::move(target)),
        mesh_shape_(MeshShape(*src.mesh_)),
        coord_(src.mesh_->coordinate()),
        current_(src.placements_),
        cur_(src.local_),
        stream_(std::make_shared<CpuStream>("dtensor")) {}

  absl::StatusOr<std::shared_ptr<PendingDTensor>> Run() {
    const int n = src_.mesh_->ndim();
    // Axes that change, closed over inner axes sharding a dim they touch.
    std::set<int> change;
    for (int i = 0; i < n; ++i) {
      if (current_[i] != target_[i]) change.insert(i);
    }
    for (bool grew = true; grew;) {
      grew = false;
      for (int i : std::set<int>(change)) {
        for (const Placement& p : {current_[i], target_[i]}) {
          if (!p.is_shard()) continue;
          for (int j = i + 1; j < n; ++j) {
            if (current_[j].is_shard(p.dim()) && change.insert(j).second)
              grew = true;
          }
        }
      }
    }
    // Phase A, innermost axis first: to Replicate (or straight to target).
    for (int i = n - 1; i >= 0; --i) {
      if (!change.count(i)) continue;
      const Placement from = current_[i], to = target_[i];
      if (from.is_partial()) {
        if (to.is_shard() && DimUsedOnlyBy(i, to.dim())) {
          FSDPP_RETURN_IF_ERROR(ReduceScatter(i, to.dim()));
        } else {
          FSDPP_RETURN_IF_ERROR(AllReduce(i));
        }
      } else if (from.is_shard()) {
        if (to.is_shard() && DimUsedOnlyBy(i, from.dim()) &&
            DimUsedOnlyBy(i, to.dim())) {
          FSDPP_RETURN_IF_ERROR(AllToAll(i, from.dim(), to.dim()));
        } else {
          FSDPP_RETURN_IF_ERROR(AllGather(i));
        }
      }
    }
    // Phase B, outermost axis first: from Replicate to the target.
    for (int i = 0; i < n; ++i) {
      if (current_[i] == target_[i]) continue;
      if (target_[i].is_shard()) {
        FSDPP_RETURN_IF_ERROR(Slice(i, target_[i].dim()));
      } else if (target_[i].is_partial()) {
        FSDPP_RETURN_IF_ERROR(MakePartial(i, target_[i].reduce_op()));
      }
    }
    DTensor result(cur_, src_.mesh_, current_, src_.global_shape_);
    return std::make_shared<PendingDTensor>(std::move(result),
                                            stream_->Record(), stream_);
  }

 private:
  // True when no axis other than `axis` shards `dim`, now or in the target.
  bool DimUsedOnlyBy(int axis, int dim) const {
    for (int j = 0; j < static_cast<int>(current_.size()); ++j) {
      if (j == axis) continue;
      if (current_[j].is_shard(dim) || target_[j].is_shard(dim)) return false;
    }
    return true;
  }

  Box BoxWith(int axis, const Placement& p) const {
    std::vector<Placement> placements = current_;
    placements[axis] = p;
    return LocalBox(src_.global_shape_, mesh_shape_, coord_, placements);
  }

  absl::StatusOr<Tensor> New(const Shape& shape, MemoryTag tag) const {
    return Tensor::Empty(shape, cur_.dtype(), cur_.device(), tag);
  }

  absl::StatusOr<ProcessGroup*> Group(int axis) const {
    return src_.mesh_->Group(src_.mesh_->axes()[axis].name);
  }

  // Orders later work on the helper stream after `work`, and keeps the
  // collective's buffers alive until then (comm sees raw pointers only).
  void AfterCollective(const std::shared_ptr<Work>& work,
                       std::vector<Tensor> buffers) {
    stream_->WaitEvent(work->event());
    stream_->Enqueue(
        [buffers = std::move(buffers)]() { return absl::OkStatus(); });
  }

  CollectiveOptions AfterPack() {
    CollectiveOptions o;
    o.after = stream_->Record();
    return o;
  }

  // Shard(d) -> Replicate on `axis`: padded all-gather, then unpad.
  absl::Status AllGather(int axis) {
    const int d = current_[axis].dim();
    const int w = mesh_shape_[axis];
    const Box parent = BoxWith(axis, Placement::Replicate());
    const int64_t length = parent.shape[d];
    const int64_t chunk = ChunkSize(length, w);
    const Shape local_shape = cur_.shape();
    Shape padded = local_shape;
    padded[d] = chunk;
    Shape gathered = padded;
    gathered.insert(gathered.begin(), w);
    FSDPP_ASSIGN_OR_RETURN(Tensor send, New(padded, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor recv, New(gathered, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(parent.shape, cur_.tag()));
    Tensor in = cur_;
    stream_->Enqueue([in, send, local_shape]() mutable {
      FSDPP_RETURN_IF_ERROR(Zero(&send));
      return CopyBox(in, Zeros(in.ndim()), &send, Zeros(in.ndim()),
                     local_shape);
    });
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, Group(axis));
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<Work> work,
        group->AllGather(AsBuffer(send), AsBuffer(recv), AfterPack()));
    AfterCollective(work, {send, recv});
    stream_->Enqueue([recv, out, padded, local_shape, d, w, length]() mutable {
      for (int r = 0; r < w; ++r) {
        const Range range = ChunkRange(length, w, r);
        FSDPP_ASSIGN_OR_RETURN(Tensor row, recv.Narrow(r, 1));
        FSDPP_ASSIGN_OR_RETURN(Tensor block, row.Reshape(padded));
        Shape box = local_shape;
        box[d] = range.length;
        Shape at = Zeros(local_shape.size());
        at[d] = range.begin;
        FSDPP_RETURN_IF_ERROR(
            CopyBox(block, Zeros(local_shape.size()), &out, at, box));
      }
      return absl::OkStatus();
    });
    cur_ = out;
    current_[axis] = Placement::Replicate();
    return absl::OkStatus();
  }

  // Partial -> Replicate on `axis`: all-reduce a copy.
  absl::Status AllReduce(int axis) {
    const ReduceOp op = current_[axis].reduce_op();
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(cur_.shape(), cur_.tag()));
    Tensor in = cur_;
    stream_->Enqueue([in, out]() {
      return CopyBytes(out.raw_data(), out.device(), in.raw_data(), in.device(),
                       in.nbytes());
    });
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, Group(axis));
    FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                           group->AllReduce(AsBuffer(out), op, AfterPack()));
    AfterCollective(work, {out});
    cur_ = out;
    current_[axis] = Placement::Replicate();
    return absl::OkStatus();
  }

  // Partial -> Shard(d) on `axis`: pad every rank's chunk to equal blocks,
  // reduce-scatter, unpad.
  absl::Status ReduceScatter(int axis, int d) {
    const ReduceOp op = current_[axis].reduce_op();
    const int w = mesh_shape_[axis], me = coord_[axis];
    const Shape full = cur_.shape();
    const int64_t length = full[d];
    const int64_t chunk = ChunkSize(length, w);
    Shape block = full;
    block[d] = chunk;
    Shape blocks = block;
    blocks.insert(blocks.begin(), w);
    const Range mine = ChunkRange(length, w, me);
    Shape out_shape = full;
    out_shape[d] = mine.length;
    FSDPP_ASSIGN_OR_RETURN(Tensor send, New(blocks, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor recv, New(block, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(out_shape, cur_.tag()));
    Tensor in = cur_;
    stream_->Enqueue([in, send, block, full, d, w, length]() mutable {
      FSDPP_RETURN_IF_ERROR(Zero(&send));
      for (int r = 0; r < w; ++r) {
        const Range range = ChunkRange(length, w, r);
        FSDPP_ASSIGN_OR_RETURN(Tensor row, send.Narrow(r, 1));
        FSDPP_ASSIGN_OR_RETURN(Tensor dst, row.Reshape(block));
        Shape box = full;
        box[d] = range.length;
        Shape at = Zeros(full.size());
        at[d] = range.begin;
        FSDPP_RETURN_IF_ERROR(CopyBox(in, at, &dst, Zeros(full.size()), box));
      }
      return absl::OkStatus();
    });
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, Group(axis));
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<Work> work,
        group->ReduceScatter(AsBuffer(send), AsBuffer(recv), op, AfterPack()));
    AfterCollective(work, {send, recv});
    stream_->Enqueue([recv, out, out_shape]() mutable {
      return CopyBox(recv, Zeros(out_shape.size()), &out,
                     Zeros(out_shape.size()), out_shape);
    });
    cur_ = out;
    current_[axis] = Placement::Shard(d);
    return absl::OkStatus();
  }

  // Shard(a) -> Shard(b) on `axis`: all-to-all of padded blocks.
  absl::Status AllToAll(int axis, int a, int b) {
    const int w = mesh_shape_[axis], me = coord_[axis];
    const Shape local_shape = cur_.shape();
    const int64_t length_a = BoxWith(axis, Placement::Replicate()).shape[a];
    const int64_t length_b = local_shape[b];
    Shape block = local_shape;
    block[a] = ChunkSize(length_a, w);
    block[b] = ChunkSize(length_b, w);
    Shape blocks = block;
    blocks.insert(blocks.begin(), w);
    const Range mine_b = ChunkRange(length_b, w, me);
    Shape out_shape = local_shape;
    out_shape[a] = length_a;
    out_shape[b] = mine_b.length;
    FSDPP_ASSIGN_OR_RETURN(Tensor send, New(blocks, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor recv, New(blocks, MemoryTag::kCommBuffers));
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(out_shape, cur_.tag()));
    Tensor in = cur_;
    const size_t nd = local_shape.size();
    stream_->Enqueue(
        [in, send, block, local_shape, b, w, length_b, nd]() mutable {
          FSDPP_RETURN_IF_ERROR(Zero(&send));
          for (int j = 0; j < w; ++j) {
            const Range rb = ChunkRange(length_b, w, j);
            FSDPP_ASSIGN_OR_RETURN(Tensor row, send.Narrow(j, 1));
            FSDPP_ASSIGN_OR_RETURN(Tensor dst, row.Reshape(block));
            Shape box = local_shape;
            box[b] = rb.length;
            Shape at = Zeros(nd);
            at[b] = rb.begin;
            FSDPP_RETURN_IF_ERROR(CopyBox(in, at, &dst, Zeros(nd), box));
          }
          return absl::OkStatus();
        });
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, Group(axis));
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<Work> work,
        group->AllToAll(AsBuffer(send), AsBuffer(recv), AfterPack()));
    AfterCollective(work, {send, recv});
    stream_->Enqueue(
        [recv, out, block, out_shape, a, w, length_a, nd]() mutable {
          for (int i = 0; i < w; ++i) {
            const Range ra = ChunkRange(length_a, w, i);
            FSDPP_ASSIGN_OR_RETURN(Tensor row, recv.Narrow(i, 1));
            FSDPP_ASSIGN_OR_RETURN(Tensor src, row.Reshape(block));
            Shape box = out_shape;
            box[a] = ra.length;
            Shape at = Zeros(nd);
            at[a] = ra.begin;
            FSDPP_RETURN_IF_ERROR(CopyBox(src, Zeros(nd), &out, at, box));
          }
          return absl::OkStatus();
        });
    cur_ = out;
    current_[axis] = Placement::Shard(b);
    return absl::OkStatus();
  }

  // Replicate -> Shard(d) on `axis`: keep this rank's chunk.
  absl::Status Slice(int axis, int d) {
    const Shape full = cur_.shape();
    const Range mine = ChunkRange(full[d], mesh_shape_[axis], coord_[axis]);
    Shape out_shape = full;
    out_shape[d] = mine.length;
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(out_shape, cur_.tag()));
    Tensor in = cur_;
    stream_->Enqueue([in, out, out_shape, d, mine]() mutable {
      Shape at = Zeros(out_shape.size());
      at[d] = mine.begin;
      return CopyBox(in, at, &out, Zeros(out_shape.size()), out_shape);
    });
    cur_ = out;
    current_[axis] = Placement::Shard(d);
    return absl::OkStatus();
  }

  // Replicate -> Partial(op) on `axis`: for sum, coordinate 0 keeps the value
  // and the others hold zero (exact); avg and max keep it everywhere.
  absl::Status MakePartial(int axis, ReduceOp op) {
    FSDPP_ASSIGN_OR_RETURN(Tensor out, New(cur_.shape(), cur_.tag()));
    Tensor in = cur_;
    const bool zero = op == ReduceOp::kSum && coord_[axis] != 0;
    stream_->Enqueue([in, out, zero]() mutable {
      if (zero) return Zero(&out);
      return CopyBytes(out.raw_data(), out.device(), in.raw_data(), in.device(),
                       in.nbytes());
    });
    cur_ = out;
    current_[axis] = Placement::Partial(op);
    return absl::OkStatus();
  }

  const DTensor& src_;
  const std::vector<Placement> target_;
  const std::vector<int> mesh_shape_;
  const std::vector<int> coord_;
  std::vector<Placement> current_;
  Tensor cur_;
  std::shared_ptr<CpuStream> stream_;
};

absl::StatusOr<DTensor> PendingDTensor::Wait(absl::Duration timeout) const {
  absl::Status s = done_->Wait(timeout);
  if (!s.ok()) return Annotate(s, "redistribute");
  return result_;
}

absl::StatusOr<DTensor> DTensor::FromLocal(Tensor local, DeviceMesh* mesh,
                                           std::vector<Placement> placements,
                                           Shape global_shape) {
  if (mesh == nullptr || !local.defined()) {
    return absl::InvalidArgumentError(
        "DTensor::FromLocal: needs a mesh and a local tensor");
  }
  const std::vector<int> mesh_shape = MeshShape(*mesh);
  if (global_shape.empty() && local.ndim() > 0) {
    global_shape = local.shape();
    for (size_t i = 0; i < placements.size() && i < mesh_shape.size(); ++i) {
      if (placements[i].is_shard() && placements[i].dim() >= 0 &&
          placements[i].dim() < local.ndim()) {
        global_shape[placements[i].dim()] *= mesh_shape[i];
      }
    }
  }
  FSDPP_RETURN_IF_ERROR(ValidatePlacements("DTensor::FromLocal", *mesh,
                                           global_shape, placements));
  if (static_cast<int>(global_shape.size()) != local.ndim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DTensor::FromLocal: global shape ", ShapeToString(global_shape),
        " and local ", local.ToString(), " differ in rank"));
  }
  const Box box =
      LocalBox(global_shape, mesh_shape, mesh->coordinate(), placements);
  if (box.shape != local.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DTensor::FromLocal: rank ", mesh->rank(), " of ", mesh->ToString(),
        " should hold ", ShapeToString(box.shape), " of ",
        ShapeToString(global_shape), " under ", PlacementsToString(placements),
        ", got ", local.ToString()));
  }
  return DTensor(std::move(local), mesh, std::move(placements),
                 std::move(global_shape));
}

absl::StatusOr<DTensor> DTensor::Distribute(const Tensor& full,
                                            DeviceMesh* mesh,
                                            std::vector<Placement> placements,
                                            Source source, int source_rank) {
  if (mesh == nullptr || !full.defined()) {
    return absl::InvalidArgumentError(
        "DTensor::Distribute: needs a mesh and a tensor");
  }
  FSDPP_RETURN_IF_ERROR(ValidatePlacements("DTensor::Distribute", *mesh,
                                           full.shape(), placements));
  for (const Placement& p : placements) {
    if (p.is_partial()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DTensor::Distribute: cannot distribute to ",
          PlacementsToString(placements),
          " (distribute as Replicate, then Redistribute to Partial)"));
    }
  }
  Tensor whole = full;
  if (source == Source::kBroadcast) {
    if (source_rank < 0 || source_rank >= mesh->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("DTensor::Distribute: source rank ", source_rank,
                       " is not in ", mesh->ToString()));
    }
    FSDPP_ASSIGN_OR_RETURN(
        whole, Tensor::Empty(full.shape(), full.dtype(), full.device(),
                             MemoryTag::kCommBuffers));
    if (mesh->rank() == source_rank) {
      FSDPP_RETURN_IF_ERROR(CopyBytes(whole.raw_data(), whole.device(),
                                      full.raw_data(), full.device(),
                                      full.nbytes()));
    }
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * flat, mesh->FlatGroup());
    FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                           flat->Broadcast(AsBuffer(whole), source_rank));
    FSDPP_RETURN_IF_ERROR(work->Wait());
  }
  const Box box =
      LocalBox(full.shape(), MeshShape(*mesh), mesh->coordinate(), placements);
  FSDPP_ASSIGN_OR_RETURN(
      Tensor local,
      Tensor::Empty(box.shape, full.dtype(), full.device(), full.tag()));
  FSDPP_RETURN_IF_ERROR(
      CopyBox(whole, box.offset, &local, Zeros(box.shape.size()), box.shape));
  return DTensor(std::move(local), mesh, std::move(placements), full.shape());
}

Box DTensor::local_box() const {
  return LocalBox(global_shape_, MeshShape(*mesh_), mesh_->coordinate(),
                  placements_);
}

std::string DTensor::ToString() const {
  return absl::StrCat(
      "DTensor(", DTypeName(local_.dtype()), ShapeToString(global_shape_), " ",
      PlacementsToString(placements_), " local ", local_.ToString(), ")");
}

absl::StatusOr<std::shared_ptr<PendingDTensor>> DTensor::RedistributeAsync(
    const std::vector<Placement>& placements) const {
  if (mesh_ == nullptr)
    return absl::InvalidArgumentError("Redistribute: undefined DTensor");
  FSDPP_RETURN_IF_ERROR(
      ValidatePlacements("Redistribute", *mesh_, global_shape_, placements));
  DTensorPlanner planner(*this, placements);
  return planner.Run();
}

absl::StatusOr<DTensor> DTensor::Redistribute(
    const std::vector<Placement>& placements, absl::Duration timeout) const {
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<PendingDTensor> pending,
                         RedistributeAsync(placements));
  return pending->Wait(timeout);
}

absl::StatusOr<Tensor> DTensor::FullTensor(absl::Duration timeout) const {
  if (mesh_ == nullptr)
    return absl::InvalidArgumentError("FullTensor: undefined DTensor");
  FSDPP_ASSIGN_OR_RETURN(
      DTensor full, Redistribute(std::vector<Placement>(mesh_->ndim(),
                                                        Placement::Replicate()),
                                 timeout));
  return full.local_;
}

// ------------------------------------------------------------------- ops

namespace {

absl::Status SameLayout(const char* op, const DTensor& a, const DTensor& b) {
  if (a.mesh() != b.mesh() || a.placements() != b.placements() ||
      a.shape() != b.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": operands differ in layout: ", a.ToString(), " vs ",
                     b.ToString()));
  }
  return absl::OkStatus();
}

absl::Status Unsupported(const char* op, const DTensor& x,
                         absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(op, " is not supported for placements ",
                   PlacementsToString(x.placements()), ": ", why));
}

}  // namespace

absl::Status Add(const DTensor& a, const DTensor& b, DTensor* out) {
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Add", a, b));
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Add", a, *out));
  for (const Placement& p : a.placements()) {
    if (p.is_partial() && p.reduce_op() == ReduceOp::kMax) {
      return Unsupported("DTensor Add", a, "max(a) + max(b) is not max(a + b)");
    }
  }
  return Add(a.local(), b.local(), out->mutable_local());
}

absl::Status Mul(const DTensor& a, const DTensor& b, DTensor* out) {
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Mul", a, b));
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Mul", a, *out));
  for (const Placement& p : a.placements()) {
    if (p.is_partial()) {
      return Unsupported("DTensor Mul", a,
                         "a product of pending sums is not elementwise");
    }
  }
  return Mul(a.local(), b.local(), out->mutable_local());
}

absl::Status Scale(const DTensor& x, float alpha, DTensor* out) {
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Scale", x, *out));
  for (const Placement& p : x.placements()) {
    if (p.is_partial() && p.reduce_op() == ReduceOp::kMax && alpha < 0) {
      return Unsupported("DTensor Scale", x,
                         "a negative scale does not commute with max");
    }
  }
  return Scale(x.local(), alpha, out->mutable_local());
}

absl::Status Copy(const DTensor& src, DTensor* dst) {
  FSDPP_RETURN_IF_ERROR(SameLayout("DTensor Copy", src, *dst));
  return Copy(src.local(), dst->mutable_local());
}

absl::StatusOr<double> SumOfSquares(const DTensor& x) {
  if (x.mesh() == nullptr)
    return absl::InvalidArgumentError("SumOfSquares: undefined DTensor");
  DTensor reduced = x;
  std::vector<Placement> no_partial = x.placements();
  bool any_partial = false;
  for (Placement& p : no_partial) {
    if (p.is_partial()) {
      p = Placement::Replicate();
      any_partial = true;
    }
  }
  if (any_partial) {
    FSDPP_ASSIGN_OR_RETURN(reduced, x.Redistribute(no_partial));
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor partial, Tensor::Zeros({1}, DType::kF32, reduced.local().device(),
                                    MemoryTag::kOther));
  FSDPP_RETURN_IF_ERROR(SumOfSquares(reduced.local(), &partial));
  for (int i = 0; i < x.mesh()->ndim(); ++i) {
    if (!no_partial[i].is_shard()) continue;  // Replicate axes hold copies.
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group,
                           x.mesh()->Group(x.mesh()->axes()[i].name));
    FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                           group->AllReduce(AsBuffer(partial), ReduceOp::kSum));
    FSDPP_RETURN_IF_ERROR(work->Wait());
  }
  FSDPP_ASSIGN_OR_RETURN(float total, Item(partial));
  return static_cast<double>(total);
}

absl::StatusOr<double> Norm(const DTensor& x) {
  FSDPP_ASSIGN_OR_RETURN(double ss, SumOfSquares(x));
  return std::sqrt(ss);
}

}  // namespace fsdpp
