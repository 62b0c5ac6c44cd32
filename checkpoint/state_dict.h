// StateDict: the named values a checkpoint saves and loads — DTensors
// (sharded parameters, optimizer m / v), plain tensors and small byte values
// (step count, RNG states, data-loader state, config).
//
// Values are held by handle: a Tensor or DTensor added here shares storage
// with the caller's, so Load writes into the caller's memory in place (the
// parameters FSDP already holds) and never reallocates a tensor. Byte values
// are copies; read them back with bytes() after a Load.
//
// Which ranks hold a value decides how it is saved: a DTensor's box is given
// by its placements (LocalBox), a plain tensor or byte value is the whole
// value on every rank that has the key. Equal boxes held by several ranks are
// saved once (see checkpoint.h), so replicated values must be equal on those
// ranks; per-rank state (e.g. each rank's RNG) needs per-rank keys such as
// "rng/rank3".
#ifndef FSDPP_CHECKPOINT_STATE_DICT_H_
#define FSDPP_CHECKPOINT_STATE_DICT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/dtensor.h"
#include "tensor/tensor.h"

namespace fsdpp {

class StateDict {
 public:
  // What a value is.
  enum class Kind { kDTensor, kTensor, kBytes };

  // One value; only the member of its kind is set.
  struct Item {
    Kind kind = Kind::kBytes;
    DTensor dtensor;
    Tensor tensor;
    std::string bytes;
  };

  // Add a value under `key` (non-empty, not yet present: InvalidArgument /
  // AlreadyExists otherwise). Tensors must be defined and not on the meta
  // device.
  absl::Status AddDTensor(const std::string& key, DTensor value);
  absl::Status AddTensor(const std::string& key, Tensor value);
  absl::Status AddBytes(const std::string& key, std::string value);

  // The value of `key`, or nullptr.
  const Item* Find(const std::string& key) const;
  Item* FindMutable(const std::string& key);
  // A byte value; NotFound, or InvalidArgument when `key` holds a tensor.
  absl::StatusOr<std::string> bytes(const std::string& key) const;
  // Replaces a byte value (what Load does); NotFound / InvalidArgument as
  // bytes().
  absl::Status SetBytes(const std::string& key, std::string value);

  // Every value, by key, and their number.
  const std::map<std::string, Item>& items() const { return items_; }
  size_t size() const { return items_.size(); }

 private:
  absl::Status Insert(const std::string& key, Item item);
  std::map<std::string, Item> items_;
};

// "dtensor", "tensor" or "bytes".
const char* StateKindName(StateDict::Kind kind);

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_STATE_DICT_H_
