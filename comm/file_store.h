// FileStore: a Store kept as one file per key in a directory that every rank
// sees (a shared or local filesystem).
//
// Design: a key's file name is "k." followed by the percent-encoded key
// (bytes outside [A-Za-z0-9_.-] become "%XX"), so keys with '/', ':' or any
// other byte map to one flat, reversible, collision-free name. Values are
// written to a dot-prefixed temporary file in the same directory, fsync'ed and
// renamed over the key file, so readers see either the old or the new value,
// never a partial one; readers therefore take no lock. Writers (Set, Add,
// Delete) serialize on flock() of "<dir>/.lock", opened afresh for every call
// so the lock also excludes other threads of this process (flock locks belong
// to the open file description). Get and Wait poll with exponential backoff
// (1 ms .. 50 ms).
#ifndef FSDPP_COMM_FILE_STORE_H_
#define FSDPP_COMM_FILE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {

class FileStore final : public Store {
 public:
  // Opens (creating it and its parents if missing) the store directory `dir`.
  // Fails with FailedPrecondition / PermissionDenied naming `dir` if it is not
  // a directory or files cannot be created in it.
  static absl::StatusOr<std::unique_ptr<FileStore>> Create(std::string dir);

  // Longest accepted encoded file name; longer keys give InvalidArgument.
  static constexpr size_t kMaxFileNameBytes = 250;

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::Status Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

  // The store directory.
  const std::string& dir() const { return dir_; }

  // The file name (within dir()) that holds `key`: "k." + percent-encoding.
  static std::string EncodeKey(absl::string_view key);

 private:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}

  // Full path of the file holding `key`; InvalidArgument if it is too long.
  absl::StatusOr<std::string> PathFor(absl::string_view key) const;
  // Atomically replaces `path` with `value` (temp file + fsync + rename).
  absl::Status WriteAtomically(const std::string& path,
                               absl::string_view value) const;
  // Reads `path`; NotFound if it does not exist.
  absl::StatusOr<std::string> ReadFile(const std::string& path) const;
  // Whether `path` exists.
  absl::StatusOr<bool> Exists(const std::string& path) const;

  std::string dir_;
};

}  // namespace fsdpp

#endif  // FSDPP_COMM_FILE_STORE_H_
