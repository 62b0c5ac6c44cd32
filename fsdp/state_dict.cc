// Sharded and full state dicts; see state_dict.h.
#include "fsdp/state_dict.h"

#include <map>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "fsdp/fully_shard.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"

namespace fsdpp {
namespace fsdp {
namespace {

constexpr absl::Duration kTimeout = absl::Minutes(30);

// What a load expects under one name.
struct Expected {
  std::string name;
  Shape shape;
};

// What a load was given under one name.
struct Given {
  std::string name;
  Shape shape;
  DType dtype;
};

// The strict check shared by every load: exactly the expected names (no
// duplicates), equal shapes, float dtypes. One error listing every problem.
absl::Status CheckStrict(absl::string_view api,
                         const std::vector<Expected>& expected,
                         const std::vector<Given>& given) {
  std::map<std::string, const Expected*> want;
  for (const Expected& e : expected) want[e.name] = &e;
  std::set<std::string> seen;
  std::vector<std::string> unexpected, duplicate, problems;
  for (const Given& g : given) {
    if (!seen.insert(g.name).second) {
      duplicate.push_back(g.name);
      continue;
    }
    auto it = want.find(g.name);
    if (it == want.end()) {
      unexpected.push_back(g.name);
      continue;
    }
    if (g.shape != it->second->shape) {
      problems.push_back(
          absl::StrCat("'", g.name, "' has shape ", ShapeToString(g.shape),
                       " in the state dict but ",
                       ShapeToString(it->second->shape), " in the model"));
    }
    if (!IsFloatingPoint(g.dtype)) {
      problems.push_back(absl::StrCat("'", g.name, "' has dtype ",
                                      DTypeName(g.dtype),
                                      ", not a float dtype"));
    }
  }
  std::vector<std::string> missing;
  for (const Expected& e : expected) {
    if (seen.count(e.name) == 0) missing.push_back(e.name);
  }
  if (!missing.empty()) {
    problems.insert(
        problems.begin(),
        absl::StrCat("missing keys [", absl::StrJoin(missing, ", "), "]"));
  }
  if (!unexpected.empty()) {
    problems.push_back(absl::StrCat("unexpected keys [",
                                    absl::StrJoin(unexpected, ", "), "]"));
  }
  if (!duplicate.empty()) {
    problems.push_back(
        absl::StrCat("duplicate keys [", absl::StrJoin(duplicate, ", "), "]"));
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(api, ": ", absl::StrJoin(problems, "; ")));
}

// Mesh rank 0's `status` on every rank of `mesh`: code and message are
// broadcast (the message as one i32 per byte, in buffers on the group's
// device), so every rank fails alike.
absl::Status ShareVerdict(const absl::Status& status, DeviceMesh* mesh) {
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, mesh->FlatGroup());
  const bool root = mesh->rank() == 0;
  const std::string message = root ? std::string(status.message()) : "";
  FSDPP_ASSIGN_OR_RETURN(
      Tensor header,
      Tensor::FromInts({2},
                       {root ? static_cast<int64_t>(status.code()) : 0,
                        static_cast<int64_t>(message.size())},
                       DType::kI32, group->device()));
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group->Broadcast(AsBuffer(header), /*root=*/0));
  FSDPP_RETURN_IF_ERROR(work->Wait(kTimeout));
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> values, header.ToFloats());
  const int code = static_cast<int>(values[0]);
  const int64_t length = static_cast<int64_t>(values[1]);
  if (code == 0) return absl::OkStatus();
  std::string text = message;
  if (length > 0) {
    std::vector<int64_t> bytes(length, 0);
    for (size_t i = 0; i < message.size(); ++i) {
      bytes[i] = static_cast<unsigned char>(message[i]);
    }
    FSDPP_ASSIGN_OR_RETURN(
        Tensor chars,
        Tensor::FromInts({length}, bytes, DType::kI32, group->device()));
    FSDPP_ASSIGN_OR_RETURN(work, group->Broadcast(AsBuffer(chars), /*root=*/0));
    FSDPP_RETURN_IF_ERROR(work->Wait(kTimeout));
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> received, chars.ToFloats());
    text.clear();
    for (float c : received) text.push_back(static_cast<char>(c));
  }
  if (root) return status;
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(text, " (reported by rank 0)"));
}

// The one mesh all of `meshes` are (rank-0 operations need a single
// "rank 0"); nullptr for an empty list.
absl::StatusOr<DeviceMesh*> CommonMesh(absl::string_view api,
                                       const std::vector<DeviceMesh*>& meshes) {
  DeviceMesh* mesh = meshes.empty() ? nullptr : meshes[0];
  for (DeviceMesh* m : meshes) {
    if (m == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(api, ": a tensor has no mesh"));
    }
    if (m != mesh) {
      return absl::InvalidArgumentError(
          absl::StrCat(api, ": tensors on different meshes (", mesh->ToString(),
                       ", ", m->ToString(), "): rank 0 would be ambiguous"));
    }
  }
  return mesh;
}

// The validation a load of full tensors starts with, on targets with
// `meshes` expecting `expected`. With `rank0_only`, mesh rank 0 checks `full`
// strictly and shares its verdict over the targets' one mesh (CommonMesh);
// otherwise every rank checks `full` itself. Fills `by_name` with the tensors
// of `full` by name and returns whether this rank reads them.
absl::StatusOr<bool> CheckFullState(
    absl::string_view api, const std::vector<DeviceMesh*>& meshes,
    const std::vector<Expected>& expected, const NamedTensors& full,
    bool rank0_only, std::map<std::string, const Tensor*>* by_name) {
  // Only a rank-0 load needs one "rank 0" (and one mesh to share its
  // verdict on).
  DeviceMesh* mesh = nullptr;
  if (rank0_only) {
    FSDPP_ASSIGN_OR_RETURN(mesh, CommonMesh(api, meshes));
  }
  std::vector<Given> given;
  for (const auto& [name, t] : full) {
    given.push_back({name, t.shape(), t.dtype()});
    (*by_name)[name] = &t;
  }
  const bool reads_state = !rank0_only || mesh == nullptr || mesh->rank() == 0;
  absl::Status verdict =
      reads_state ? CheckStrict(api, expected, given) : absl::OkStatus();
  if (rank0_only && mesh != nullptr) verdict = ShareVerdict(verdict, mesh);
  FSDPP_RETURN_IF_ERROR(verdict);
  return reads_state;
}

// Fills `local` (this rank's box `box` of a tensor of `global` shape, dtype
// of `local`) from `full`: with `broadcast`, mesh rank 0's tensor broadcast
// over `mesh` in a buffer on the group's device; else this rank's own.
// Allocates one full tensor transiently (none when `full` can serve as is).
absl::Status FillFromFull(const Tensor* full, const Shape& global,
                          const Box& box, DeviceMesh* mesh, bool broadcast,
                          Tensor* local) {
  Tensor whole;
  if (broadcast) {
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, mesh->FlatGroup());
    const bool root = mesh->rank() == 0;
    if (root && full->dtype() == local->dtype() &&
        full->device() == group->device()) {
      // A broadcast only reads the root's buffer: the caller's tensor serves.
      FSDPP_ASSIGN_OR_RETURN(whole, full->Reshape(global));
    } else {
      FSDPP_ASSIGN_OR_RETURN(
          whole, Tensor::Empty(global, local->dtype(), group->device(),
                               MemoryTag::kCommBuffers));
      if (root) {
        Tensor flat = whole.Flatten();
        FSDPP_RETURN_IF_ERROR(Copy(full->Flatten(), &flat));  // Converts dtype.
      }
    }
    FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                           group->Broadcast(AsBuffer(whole), /*root=*/0));
    FSDPP_RETURN_IF_ERROR(work->Wait(kTimeout));
  } else if (full->dtype() == local->dtype()) {
    FSDPP_ASSIGN_OR_RETURN(whole, full->Reshape(global));
  } else {
    FSDPP_ASSIGN_OR_RETURN(whole,
                           Tensor::Empty(global, local->dtype(), full->device(),
                                         MemoryTag::kCommBuffers));
    Tensor flat = whole.Flatten();
    FSDPP_RETURN_IF_ERROR(Copy(full->Flatten(), &flat));  // Converts dtype.
  }
  // CopyBox moves between devices.
  return CopyBox(whole, box.offset, local, Shape(box.shape.size(), 0),
                 box.shape);
}

// A host copy of `t` that shares no storage with it.
absl::StatusOr<Tensor> HostCopy(const Tensor& t) {
  FSDPP_ASSIGN_OR_RETURN(
      Tensor out,
      Tensor::Empty(t.shape(), t.dtype(), Device::Cpu(), MemoryTag::kOther));
  FSDPP_RETURN_IF_ERROR(Copy(t, &out));
  return out;
}

// Every parameter of `root` with its sharded state (masters), or an error
// naming the first parameter in no unit.
absl::StatusOr<std::vector<ShardedParameter*>> AllSharded(absl::string_view api,
                                                          Module* root) {
  if (root == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(api, ": null module"));
  }
  std::vector<ShardedParameter*> sharded = ShardedParameters(root);
  std::set<Parameter*> covered;
  for (ShardedParameter* sp : sharded) covered.insert(sp->parameter);
  for (auto& [fqn, p] : root->NamedParameters()) {
    if (covered.count(p) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          api, ": parameter '", fqn,
          "' is in no FSDP unit (apply FullyShard to the root first)"));
    }
  }
  return sharded;
}

}  // namespace

absl::StatusOr<NamedDTensors> ShardedStateDict(Module* root) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<ShardedParameter*> sharded,
                         AllSharded("ShardedStateDict", root));
  NamedDTensors out;
  for (ShardedParameter* sp : sharded) out.emplace_back(sp->name, sp->master);
  return out;
}

absl::Status LoadShardedStateDict(Module* root, const NamedDTensors& state) {
  constexpr absl::string_view kApi = "LoadShardedStateDict";
  FSDPP_ASSIGN_OR_RETURN(std::vector<ShardedParameter*> sharded,
                         AllSharded(kApi, root));
  std::vector<Expected> expected;
  std::map<std::string, ShardedParameter*> by_name;
  for (ShardedParameter* sp : sharded) {
    expected.push_back({sp->name, sp->master.shape()});
    by_name[sp->name] = sp;
  }
  std::vector<Given> given;
  for (const auto& [name, t] : state) {
    given.push_back({name, t.shape(), t.dtype()});
  }
  FSDPP_RETURN_IF_ERROR(CheckStrict(kApi, expected, given));
  for (const auto& [name, t] : state) {
    DeviceMesh* want = by_name.at(name)->master.mesh();
    if (t.mesh() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          kApi, ": '", name, "' is on ",
          t.mesh() != nullptr ? t.mesh()->ToString() : "no mesh",
          " but the model's master is on ", want->ToString(),
          " (load through a full state dict or a checkpoint to reshard "
          "across meshes)"));
    }
  }
  // Lay every tensor out like its master (may communicate), then write.
  std::vector<std::pair<ShardedParameter*, DTensor>> writes;
  for (const auto& [name, t] : state) {
    ShardedParameter* sp = by_name.at(name);
    DTensor laid_out = t;
    if (t.placements() != sp->master.placements()) {
      FSDPP_ASSIGN_OR_RETURN(laid_out, t.Redistribute(sp->master.placements()));
    }
    writes.emplace_back(sp, std::move(laid_out));
  }
  for (auto& [sp, src] : writes) {
    Tensor* dst = sp->master.mutable_local();
    if (src.local().SharesStorageWith(*dst) &&
        src.local().storage_offset() == dst->storage_offset()) {
      continue;  // Loading the masters' own views: nothing to copy.
    }
    FSDPP_RETURN_IF_ERROR(Copy(src.local(), dst));
  }
  return absl::OkStatus();
}

absl::StatusOr<NamedTensors> GatherFullTensors(const NamedDTensors& sharded,
                                               bool rank0_only) {
  NamedTensors out;
  for (const auto& [name, t] : sharded) {
    if (t.mesh() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GatherFullTensors: '", name, "' is an undefined DTensor"));
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor full, t.FullTensor(kTimeout));
    if (rank0_only && t.mesh()->rank() != 0) continue;
    if (full.SharesStorageWith(t.local()) || !full.device().is_cpu()) {
      FSDPP_ASSIGN_OR_RETURN(full, HostCopy(full));
    }
    out.emplace_back(name, std::move(full));
  }
  return out;
}

absl::StatusOr<NamedTensors> FullStateDict(Module* root, bool rank0_only) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<ShardedParameter*> sharded,
                         AllSharded("FullStateDict", root));
  NamedDTensors masters;
  for (ShardedParameter* sp : sharded)
    masters.emplace_back(sp->name, sp->master);
  FSDPP_ASSIGN_OR_RETURN(NamedTensors out,
                         GatherFullTensors(masters, rank0_only));
  // Masters of scalar parameters are [1]: give back the parameter's shape.
  std::map<std::string, const Shape*> shapes;
  for (ShardedParameter* sp : sharded) shapes[sp->name] = &sp->shape;
  for (auto& [name, t] : out) {
    FSDPP_ASSIGN_OR_RETURN(t, t.Reshape(*shapes.at(name)));
  }
  return out;
}

absl::StatusOr<NamedDTensors> DistributeFullTensors(const NamedTensors& full,
                                                    const NamedDTensors& like,
                                                    bool rank0_only) {
  constexpr absl::string_view kApi = "DistributeFullTensors";
  std::vector<DeviceMesh*> meshes;
  std::vector<Expected> expected;
  for (const auto& [name, t] : like) {
    meshes.push_back(t.mesh());
    expected.push_back({name, t.shape()});
  }
  std::map<std::string, const Tensor*> by_name;
  FSDPP_ASSIGN_OR_RETURN(
      const bool reads_state,
      CheckFullState(kApi, meshes, expected, full, rank0_only, &by_name));
  NamedDTensors out;
  for (const auto& [name, t] : like) {
    const Box box = t.local_box();
    FSDPP_ASSIGN_OR_RETURN(
        Tensor local, Tensor::Empty(box.shape, t.dtype(), t.local().device(),
                                    t.local().tag()));
    const Tensor* source = reads_state ? by_name.at(name) : nullptr;
    FSDPP_RETURN_IF_ERROR(
        FillFromFull(source, t.shape(), box, t.mesh(), rank0_only, &local));
    FSDPP_ASSIGN_OR_RETURN(
        DTensor d,
        DTensor::FromLocal(local, t.mesh(), t.placements(), t.shape()));
    out.emplace_back(name, std::move(d));
  }
  return out;
}

absl::Status LoadFullStateDict(Module* root, const NamedTensors& state,
                               bool rank0_only) {
  constexpr absl::string_view kApi = "LoadFullStateDict";
  FSDPP_ASSIGN_OR_RETURN(std::vector<ShardedParameter*> sharded,
                         AllSharded(kApi, root));
  std::vector<DeviceMesh*> meshes;
  std::vector<Expected> expected;
  for (ShardedParameter* sp : sharded) {
    meshes.push_back(sp->master.mesh());
    expected.push_back({sp->name, sp->shape});
  }
  std::map<std::string, const Tensor*> by_name;
  FSDPP_ASSIGN_OR_RETURN(
      const bool reads_state,
      CheckFullState(kApi, meshes, expected, state, rank0_only, &by_name));
  // One parameter at a time straight into its master: one transient full
  // tensor, never a second sharded copy of the model.
  for (ShardedParameter* sp : sharded) {
    const Tensor* source = reads_state ? by_name.at(sp->name) : nullptr;
    Tensor* master = sp->master.mutable_local();
    FSDPP_RETURN_IF_ERROR(FillFromFull(source, sp->master.shape(),
                                       sp->master.local_box(),
                                       sp->master.mesh(), rank0_only, master));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> BroadcastFromRank0(int64_t value, DeviceMesh* mesh) {
  if (mesh == nullptr) {
    return absl::InvalidArgumentError("BroadcastFromRank0: null mesh");
  }
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, mesh->FlatGroup());
  FSDPP_ASSIGN_OR_RETURN(
      Tensor buffer,
      Tensor::FromInts({1}, {value}, DType::kI64, group->device()));
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group->Broadcast(AsBuffer(buffer), /*root=*/0));
  FSDPP_RETURN_IF_ERROR(work->Wait(kTimeout));
  FSDPP_ASSIGN_OR_RETURN(Tensor host,
                         Tensor::Empty({1}, DType::kI64, Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(Copy(buffer, &host));
  return host.data<int64_t>()[0];
}

}  // namespace fsdp
}  // namespace fsdpp
