// Sharded import from a safetensors file: each rank copies only the slices
// it holds (LocalBox of each DTensor's placements) out of the memory-mapped
// file, so a rank of an N-way sharded model touches about 1/N of the pages.
//
// This is the reading counterpart of models/hf_adapter.h's full-state export
// (rank 0 writes Hugging Face-named tensors): the same file can be loaded
// into FSDP- or HSDP-sharded DTensors at any world size without gathering.
// Values are copied bit for bit: dtypes must match exactly (convert
// afterwards if needed). Boxes whose trailing dims are whole are copied as
// one contiguous run straight from the mapping; other boxes go through
// SafetensorsFile::LoadRows (just the rows involved) and CopyBox.
#ifndef FSDPP_CHECKPOINT_SAFETENSORS_SHARDED_H_
#define FSDPP_CHECKPOINT_SAFETENSORS_SHARDED_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/state_dict.h"

namespace fsdpp {

struct SafetensorsLoadOptions {
  // Strict: every state key has a tensor and every tensor a key; otherwise
  // both kinds of leftovers are only reported.
  bool strict = true;
  // The file's tensor name for a state key (e.g. our names -> Hugging Face
  // names); the key itself when unset.
  std::function<std::string(const std::string&)> name_for_key;
};

// Loads `path` into `state` in place: DTensors receive their LocalBox, plain
// tensors the whole tensor, byte values a 1-D U8 tensor's bytes. Every key is
// checked before anything is written. Errors name the file and the tensor:
// NotFound (missing tensors, strict), InvalidArgument (unexpected tensors,
// strict; shape or dtype mismatches naming both), Unimplemented (dtypes
// fsdpp lacks), and SafetensorsFile::Open's errors. LoadResult::bytes_read
// counts the bytes copied out of the file.
absl::StatusOr<LoadResult> LoadSafetensorsSharded(
    const std::string& path, StateDict* state,
    const SafetensorsLoadOptions& options = {});

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_SAFETENSORS_SHARDED_H_
