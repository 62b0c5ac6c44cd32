// The state crash_writer saves and crash_test verifies: six f32 [1024, 2048]
// tensors (8 MiB each) sharded Shard(0) over the writer's mesh, a step
// counter tensor and a byte value, all derived from the step number so any
// committed checkpoint can be checked bit for bit.
#ifndef FSDPP_CHECKPOINT_CRASH_STATE_H_
#define FSDPP_CHECKPOINT_CRASH_STATE_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/test_checkpoints.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace testing_util {
namespace crash_state {

inline constexpr int kTensors = 6;

inline std::string Key(int i) { return absl::StrCat("layers.", i, ".w"); }

// Tensor `i` of step `step`, whole.
inline Tensor Full(int i, int64_t step) {
  return testing_util::HashPattern({1024, 2048}, DType::kF32,
                                   static_cast<uint64_t>(step) * 100 + i);
}

// The byte value of step `step`.
inline std::string Bytes(int64_t step) {
  return absl::StrCat("step=", step, ";loader=", step * 31);
}

// The state of step `step`: DTensors on `mesh` (Shard(0)), or plain full
// tensors when `mesh` is null.
inline StateDict MakeState(DeviceMesh* mesh, int64_t step) {
  StateDict state;
  for (int i = 0; i < kTensors; ++i) {
    if (mesh != nullptr) {
      CHECK_OK(state.AddDTensor(
          Key(i), testing_util::MakeDTensor(Full(i, step), mesh,
                                            {Placement::Shard(0)})));
    } else {
      CHECK_OK(state.AddTensor(Key(i), Full(i, step)));
    }
  }
  CHECK_OK(
      state.AddTensor("count", *Tensor::FromInts({}, {step}, DType::kI64)));
  CHECK_OK(state.AddBytes("loader", Bytes(step)));
  return state;
}

}  // namespace crash_state
}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_CRASH_STATE_H_
