// State dicts of a FullyShard'ed model: sharded (FSDP2's default, no
// communication) and full (gathered to rank 0 / scattered from rank 0), as
// ordered (fully qualified name, tensor) lists.
//
//   ShardedStateDict      the fp32 sharded masters as DTensors (views: they
//                         share storage with the masters), no communication.
//   LoadShardedStateDict  copies DTensors into the masters, redistributing
//                         any that are laid out differently (same mesh).
//   FullStateDict         every parameter gathered into a full CPU tensor,
//                         on rank 0 only (FSDP1's FULL_STATE_DICT with
//                         rank0_only + offload_to_cpu) or on every rank.
//   LoadFullStateDict     rank 0's full tensors broadcast one at a time; each
//                         rank keeps only its rows of each (or, with
//                         rank0_only = false, every rank passes the full
//                         tensors and slices locally, no communication).
//
// All of them run between training steps (no forward or backward in
// flight); the full ones and redistributing loads are collectives that every
// rank of the masters' mesh calls in the same order.
//
// Loads are strict: the names must be exactly the model's and the global
// shapes must match; every problem is reported in one error naming the keys
// (and both shapes for a mismatch), and nothing is written unless all checks
// pass. For a rank-0 full load only rank 0 sees the tensors, so it checks and
// broadcasts the verdict (code and message): every rank returns the same
// error instead of hanging in a broadcast rank 0 never issues.
//
// The generic halves (GatherFullTensors, DistributeFullTensors) work on any
// (name, DTensor) list, which is how optimizer state goes full: fsdp sits
// below optim in the layering, so it does not know AdamW, but AdamW's
// StateDict() tensors are DTensors with the params' layout:
//
//   OptimizerStateDict sd = *adamw.StateDict();          // sharded, no comm
//   NamedDTensors layout(sd.tensors.begin(), sd.tensors.end());
//   NamedTensors full = *GatherFullTensors(layout);      // rank 0: full
//   ...
//   NamedDTensors back = *DistributeFullTensors(full, layout);
//   sd.tensors = {back.begin(), back.end()};
//   sd.scalars["step"] = *BroadcastFromRank0(step, mesh);
//   adamw.LoadStateDict(sd);
#ifndef FSDPP_FSDP_STATE_DICT_H_
#define FSDPP_FSDP_STATE_DICT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mesh/device_mesh.h"
#include "nn/module.h"
#include "tensor/dtensor.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace fsdp {

// (fully qualified name, sharded tensor), in the model's parameter order.
using NamedDTensors = std::vector<std::pair<std::string, DTensor>>;
// (fully qualified name, full tensor), in the model's parameter order.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// The fp32 sharded master of every parameter of `root` (NamedParameters
// order and names; a tied parameter once). The DTensors share storage with
// the masters: read them before the next optimizer step, or copy. No
// communication. FailedPrecondition if a parameter is in no FSDP unit.
absl::StatusOr<NamedDTensors> ShardedStateDict(Module* root);

// Copies `state` into the sharded masters of `root`. Strict: exactly the
// names of ShardedStateDict(root), each with the master's global shape, a
// float dtype (converted to f32) and the master's mesh; other placements are
// redistributed (a collective: every rank must call this with the same
// names). All checks run before anything is written.
absl::Status LoadShardedStateDict(Module* root, const NamedDTensors& state);

// Every parameter of `root` as a full f32 CPU tensor of the parameter's
// shape. With `rank0_only`, mesh rank 0 gets the list and the other ranks an
// empty one (every rank must call it: the gathers are collectives).
absl::StatusOr<NamedTensors> FullStateDict(Module* root,
                                           bool rank0_only = true);

// Loads full tensors into the sharded masters of `root`; each rank keeps only
// its shard. With `rank0_only`, only mesh rank 0's `state` is read (other
// ranks pass anything, e.g. an empty list) and each tensor is broadcast from
// it; otherwise every rank passes the same full tensors and no communication
// happens. Strict like LoadShardedStateDict (float dtypes are converted).
absl::Status LoadFullStateDict(Module* root, const NamedTensors& state,
                               bool rank0_only = true);

// The full tensor of every DTensor of `sharded` (on CPU, its dtype), in
// order; with `rank0_only` only rank 0 of each tensor's mesh gets the list.
// A collective over each tensor's mesh.
absl::StatusOr<NamedTensors> GatherFullTensors(const NamedDTensors& sharded,
                                               bool rank0_only = true);

// New DTensors with the names, meshes, placements, global shapes and dtypes
// of `like`, filled from the full tensors `full` (broadcast from mesh rank 0
// of each tensor's mesh with `rank0_only`; else every rank's own `full`).
// Strict on names and shapes like LoadFullStateDict; `like`'s tensors are
// only read for their layout.
absl::StatusOr<NamedDTensors> DistributeFullTensors(const NamedTensors& full,
                                                    const NamedDTensors& like,
                                                    bool rank0_only = true);

// Mesh rank 0's `value` on every rank of `mesh` (for scalars that travel
// with a full state dict, such as an optimizer's step).
absl::StatusOr<int64_t> BroadcastFromRank0(int64_t value, DeviceMesh* mesh);

}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_FSDP_STATE_DICT_H_
