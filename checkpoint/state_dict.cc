// StateDict; see state_dict.h.
#include "checkpoint/state_dict.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdpp {

const char* StateKindName(StateDict::Kind kind) {
  switch (kind) {
    case StateDict::Kind::kDTensor:
      return "dtensor";
    case StateDict::Kind::kTensor:
      return "tensor";
    case StateDict::Kind::kBytes:
      return "bytes";
  }
  return "?";
}

absl::Status StateDict::Insert(const std::string& key, Item item) {
  if (key.empty()) {
    return absl::InvalidArgumentError("StateDict: empty key");
  }
  if (!items_.emplace(key, std::move(item)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("StateDict: key '", key, "' added twice"));
  }
  return absl::OkStatus();
}

absl::Status StateDict::AddDTensor(const std::string& key, DTensor value) {
  if (value.mesh() == nullptr || !value.local().defined() ||
      value.local().is_meta()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StateDict: DTensor '", key, "' must be materialised (not meta)"));
  }
  Item item;
  item.kind = Kind::kDTensor;
  item.dtensor = std::move(value);
  return Insert(key, std::move(item));
}

absl::Status StateDict::AddTensor(const std::string& key, Tensor value) {
  if (!value.defined() || value.is_meta()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StateDict: tensor '", key, "' must be materialised (not meta)"));
  }
  Item item;
  item.kind = Kind::kTensor;
  item.tensor = std::move(value);
  return Insert(key, std::move(item));
}

absl::Status StateDict::AddBytes(const std::string& key, std::string value) {
  Item item;
  item.kind = Kind::kBytes;
  item.bytes = std::move(value);
  return Insert(key, std::move(item));
}

const StateDict::Item* StateDict::Find(const std::string& key) const {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

StateDict::Item* StateDict::FindMutable(const std::string& key) {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::string> StateDict::bytes(const std::string& key) const {
  const Item* item = Find(key);
  if (item == nullptr) {
    return absl::NotFoundError(absl::StrCat("StateDict: no key '", key, "'"));
  }
  if (item->kind != Kind::kBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StateDict: key '", key, "' holds a ", StateKindName(item->kind)));
  }
  return item->bytes;
}

absl::Status StateDict::SetBytes(const std::string& key, std::string value) {
  Item* item = FindMutable(key);
  if (item == nullptr) {
    return absl::NotFoundError(absl::StrCat("StateDict: no key '", key, "'"));
  }
  if (item->kind != Kind::kBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StateDict: key '", key, "' holds a ", StateKindName(item->kind)));
  }
  item->bytes = std::move(value);
  return absl::OkStatus();
}

}  // namespace fsdpp
