// The one file library: POSIX helpers with every error an absl::Status
// naming the path (and the failing call or the file's role): whole-file
// reads, atomic replacement (config files, metrics), durable exclusive
// writes and scatter reads (checkpoints), directory fsync / listing /
// removal, and the rename that commits a checkpoint.
#ifndef FSDPP_FORMATS_FILE_UTIL_H_
#define FSDPP_FORMATS_FILE_UTIL_H_

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdpp {

// An owned file descriptor, closed on destruction.
class ScopedFd {
 public:
  // No descriptor.
  ScopedFd() = default;
  // Takes ownership of `fd`.
  explicit ScopedFd(int fd) : fd_(fd) {}
  // Closes the descriptor (errors ignored; use Close to see them).
  ~ScopedFd();
  // Movable, not copyable.
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  // The descriptor (-1 when none).
  int get() const { return fd_; }
  // True when a descriptor is owned.
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes now, reporting close()'s error (naming `path`).
  absl::Status Close(absl::string_view path);

 private:
  int fd_ = -1;
};

// Opens `path` read-only.
absl::StatusOr<ScopedFd> OpenForRead(const std::string& path);
// Creates `path` for writing; AlreadyExists if it exists.
absl::StatusOr<ScopedFd> CreateExclusive(const std::string& path);

// The contents of `path`. NotFound when it does not exist, FailedPrecondition
// when it is not a regular file, other errors as "cannot read <what> "path":
// <strerror>". `what` names the file's role in messages ("config file").
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what = "file");

// Writes `contents` to `path` atomically: to "<path>.tmp.<pid>", fsynced,
// then renamed over `path`, so a reader never sees a half-written file.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents,
                                 absl::string_view what = "file");

// True when `path` names an existing regular file (symlinks followed).
bool IsRegularFile(const std::string& path);

// True when `path` names an existing directory (symlinks followed).
bool IsDirectory(const std::string& path);
// Creates `path` (which must not exist), writes `contents`, fdatasyncs and
// closes it.
absl::Status WriteFileDurably(const std::string& path,
                              absl::string_view contents);

// Writes all of `data` at the descriptor's position (retrying short writes).
absl::Status WriteAll(int fd, const void* data, size_t size,
                      absl::string_view path);
// Reads into `iov` from byte `offset` until the buffers are full or the file
// ends; returns the bytes read (less than requested only at end of file).
absl::StatusOr<uint64_t> PreadFully(int fd, std::vector<iovec> iov,
                                    uint64_t offset, absl::string_view path);
// The file's size.
absl::StatusOr<uint64_t> FileSize(int fd, absl::string_view path);

// fsync() of a directory, making its entries (creates, renames) durable.
absl::Status SyncDir(const std::string& dir);
// mkdir -p.
absl::Status MakeDirs(const std::string& dir);
// rm -rf; OK when `path` does not exist.
absl::Status RemoveTree(const std::string& path);
// The names in `dir` (without "." and ".."), sorted.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir);
// True when `path` exists.
bool PathExists(const std::string& path);

// Renames directory `from` to `to` atomically. When `to` already exists it is
// swapped with `from` in one step (renameat2 RENAME_EXCHANGE), so `to` never
// disappears; *replaced is then true and the old `to` sits at `from`.
absl::Status RenameDir(const std::string& from, const std::string& to,
                       bool* replaced);

}  // namespace fsdpp

#endif  // FSDPP_FORMATS_FILE_UTIL_H_
