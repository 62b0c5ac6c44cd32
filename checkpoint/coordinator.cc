// Store and collective coordinators; see coordinator.h.
#include "checkpoint/coordinator.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace {

class LocalCoordinator final : public Coordinator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::StatusOr<std::vector<std::string>> Gather(const std::string&,
                                                  std::string value) override {
    std::vector<std::string> all;
    all.push_back(std::move(value));
    return all;
  }
  absl::StatusOr<std::string> Broadcast(const std::string&,
                                        std::string value) override {
    return value;
  }
};

class StoreCoordinator final : public Coordinator {
 public:
  StoreCoordinator(Store* store, std::string prefix, int64_t session, int rank,
                   int size, absl::Duration timeout,
                   std::vector<std::string> broadcast_tags)
      : store_(store),
        prefix_(std::move(prefix)),
        session_(session),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        broadcast_tags_(std::move(broadcast_tags)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::StatusOr<std::vector<std::string>> Gather(const std::string& tag,
                                                  std::string value) override {
    const std::string base = Key(session_, tag);
    if (rank_ != 0) {
      FSDPP_RETURN_IF_ERROR(store_->Set(absl::StrCat(base, "/", rank_), value));
      return std::vector<std::string>();
    }
    std::vector<std::string> keys;
    for (int r = 1; r < size_; ++r) keys.push_back(absl::StrCat(base, "/", r));
    absl::Status waited = store_->Wait(keys, timeout_);
    if (!waited.ok()) {
      return Annotate(waited,
                      absl::StrCat("checkpoint: waiting for the other ranks' '",
                                   tag, "' messages"));
    }
    std::vector<std::string> all(size_);
    all[0] = std::move(value);
    for (int r = 1; r < size_; ++r) {
      FSDPP_ASSIGN_OR_RETURN(all[r], store_->Get(keys[r - 1], timeout_));
      FSDPP_RETURN_IF_ERROR(store_->Delete(keys[r - 1]));
    }
    if (!cleaned_previous_) {
      // Every rank has entered this session, so all are done reading the
      // previous session's broadcasts.
      cleaned_previous_ = true;
      for (const std::string& t : broadcast_tags_) {
        FSDPP_RETURN_IF_ERROR(store_->Delete(Key(session_ - 1, t) + "/all"));
      }
    }
    return all;
  }

  absl::StatusOr<std::string> Broadcast(const std::string& tag,
                                        std::string value) override {
    const std::string key = Key(session_, tag) + "/all";
    if (rank_ == 0) {
      FSDPP_RETURN_IF_ERROR(store_->Set(key, value));
      return value;
    }
    absl::StatusOr<std::string> got = store_->Get(key, timeout_);
    if (!got.ok()) {
      return Annotate(
          got.status(),
          absl::StrCat("checkpoint: waiting for rank 0's '", tag, "' message"));
    }
    return got;
  }

 private:
  std::string Key(int64_t session, const std::string& tag) const {
    return absl::StrCat(prefix_, "/", session, "/", tag);
  }

  Store* store_;
  std::string prefix_;
  int64_t session_;
  int rank_;
  int size_;
  absl::Duration timeout_;
  std::vector<std::string> broadcast_tags_;
  bool cleaned_previous_ = false;
};

class CollectiveCoordinator final : public Coordinator {
 public:
  CollectiveCoordinator(ProcessGroup* group, absl::Duration timeout)
      : group_(group), timeout_(timeout) {}

  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }

  absl::StatusOr<std::vector<std::string>> Gather(const std::string&,
                                                  std::string value) override {
    const int n = size();
    int64_t length = static_cast<int64_t>(value.size());
    std::vector<int64_t> lengths(n);
    FSDPP_RETURN_IF_ERROR(Run(group_->AllGather(
        Buffer{&length, 1, DType::kI64, Device::Cpu()},
        Buffer{lengths.data(), n, DType::kI64, Device::Cpu()})));
    int64_t longest = 0;
    for (int64_t l : lengths) longest = std::max(longest, l);
    value.resize(longest);
    std::string all(static_cast<size_t>(longest) * n, '\0');
    FSDPP_RETURN_IF_ERROR(Run(group_->AllGather(
        Buffer{value.data(), longest, DType::kU8, Device::Cpu()},
        Buffer{all.data(), longest * n, DType::kU8, Device::Cpu()})));
    std::vector<std::string> out;
    if (rank() != 0) return out;
    for (int r = 0; r < n; ++r)
      out.push_back(all.substr(r * longest, lengths[r]));
    return out;
  }

  absl::StatusOr<std::string> Broadcast(const std::string&,
                                        std::string value) override {
    int64_t length = static_cast<int64_t>(value.size());
    FSDPP_RETURN_IF_ERROR(Run(
        group_->Broadcast(Buffer{&length, 1, DType::kI64, Device::Cpu()}, 0)));
    value.resize(length);
    FSDPP_RETURN_IF_ERROR(Run(group_->Broadcast(
        Buffer{value.data(), length, DType::kU8, Device::Cpu()}, 0)));
    return value;
  }

 private:
  absl::Status Run(absl::StatusOr<std::shared_ptr<Work>> work) {
    if (!work.ok()) return work.status();
    return (*work)->Wait(timeout_);
  }

  ProcessGroup* group_;
  absl::Duration timeout_;
};

}  // namespace

std::unique_ptr<Coordinator> MakeLocalCoordinator() {
  return std::make_unique<LocalCoordinator>();
}

absl::StatusOr<std::unique_ptr<Coordinator>> MakeStoreCoordinator(
    Store* store, const std::string& prefix, int rank, int size,
    absl::Duration timeout, std::vector<std::string> broadcast_tags) {
  if (store == nullptr || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("MakeStoreCoordinator: needs a store and 0 <= rank (",
                     rank, ") < size (", size, ")"));
  }
  FSDPP_ASSIGN_OR_RETURN(
      const int64_t session,
      store->Add(absl::StrCat(prefix, "/session/", rank), 1));
  return std::unique_ptr<Coordinator>(new StoreCoordinator(
      store, prefix, session, rank, size, timeout, std::move(broadcast_tags)));
}

absl::StatusOr<std::unique_ptr<Coordinator>> MakeCollectiveCoordinator(
    DeviceMesh* mesh, absl::Duration timeout) {
  if (mesh == nullptr) {
    return absl::InvalidArgumentError("MakeCollectiveCoordinator: no mesh");
  }
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group, mesh->FlatGroup());
  return std::unique_ptr<Coordinator>(
      new CollectiveCoordinator(group, timeout));
}

std::string PackStrings(const std::vector<std::string>& values) {
  std::string out;
  for (const std::string& v : values) {
    const uint64_t n = v.size();
    char header[8];
    std::memcpy(header, &n, 8);
    out.append(header, 8);
    out.append(v);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> UnpackStrings(
    const std::string& packed) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < packed.size()) {
    if (packed.size() - pos < 8) {
      return absl::DataLossError("UnpackStrings: truncated length");
    }
    uint64_t n;
    std::memcpy(&n, packed.data() + pos, 8);
    pos += 8;
    if (n > packed.size() - pos) {
      return absl::DataLossError("UnpackStrings: truncated value");
    }
    out.push_back(packed.substr(pos, n));
    pos += n;
  }
  return out;
}

}  // namespace fsdpp
