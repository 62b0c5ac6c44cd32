// FileStore; see file_store.h. Every POSIX call retries on EINTR and turns
// errno into an absl::Status naming the path involved.
#include "comm/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status.h"

namespace fsdpp {
namespace {

constexpr absl::Duration kMinBackoff = absl::Milliseconds(1);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(50);
constexpr char kLockFileName[] = ".lock";

absl::Status ErrnoError(int err, absl::string_view what,
                        absl::string_view path) {
  return absl::ErrnoToStatus(
      err, absl::StrCat("file store: ", what, " '", path, "'"));
}

// Closes a file descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error (close can report deferred write errors).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

int OpenRetry(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Holds an exclusive flock() on the store's lock file. The file is opened per
// lock so threads of one process exclude each other too.
class DirLock {
 public:
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(
      const std::string& dir) {
    const std::string path = absl::StrCat(dir, "/", kLockFileName);
    const int fd = OpenRetry(path.c_str(), O_RDWR | O_CREAT, 0666);
    if (fd < 0) return ErrnoError(errno, "cannot open lock file", path);
    auto lock = std::unique_ptr<DirLock>(new DirLock(fd));
    int rc;
    do {
      rc = ::flock(fd, LOCK_EX);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return ErrnoError(errno, "cannot flock", path);
    return lock;
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  // Closing the descriptor releases the lock.
  ~DirLock() { ::close(fd_); }

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  int fd_;
};

// mkdir -p: creates `dir` and its missing parents.
absl::Status MakeDirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      return ErrnoError(errno, "cannot create directory", prefix);
    }
  }
  return absl::OkStatus();
}

bool IsPlainByte(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
}

std::vector<std::string> Missing(const std::vector<std::string>& keys,
                                 const std::vector<bool>& present) {
  std::vector<std::string> missing;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!present[i]) missing.push_back(keys[i]);
  }
  return missing;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Create(std::string dir) {
  if (dir.empty()) {
    return absl::InvalidArgumentError("file store: empty directory path");
  }
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  FSDPP_RETURN_IF_ERROR(MakeDirs(dir));
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return ErrnoError(errno, "cannot stat", dir);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("file store: '", dir, "' is not a directory"));
  }
  if (::access(dir.c_str(), R_OK | W_OK | X_OK) != 0) {
    return ErrnoError(errno, "directory is not usable", dir);
  }
  // Proves that files can be created and locked there.
  {
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<DirLock> lock,
                           DirLock::Acquire(dir));
  }
  return std::unique_ptr<FileStore>(new FileStore(std::move(dir)));
}

std::string FileStore::EncodeKey(absl::string_view key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string name = "k.";
  name.reserve(2 + key.size() * 3);
  for (const char ch : key) {
    const auto c = static_cast<unsigned char>(ch);
    if (IsPlainByte(c)) {
      name.push_back(ch);
    } else {
      name.push_back('%');
      name.push_back(kHex[c >> 4]);
      name.push_back(kHex[c & 0xF]);
    }
  }
  return name;
}

absl::StatusOr<std::string> FileStore::PathFor(absl::string_view key) const {
  std::string name = EncodeKey(key);
  if (name.size() > kMaxFileNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file store: key '", key, "' is too long (encoded file name has ",
        name.size(), " bytes, limit ", kMaxFileNameBytes, ")"));
  }
  return absl::StrCat(dir_, "/", name);
}

absl::Status FileStore::WriteAtomically(const std::string& path,
                                        absl::string_view value) const {
  static std::atomic<uint64_t> counter{0};
  // Dot-prefixed, so never mistaken for a key file ("k.*"). O_EXCL plus a
  // retry skips stale temporaries left by a crashed writer.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = absl::StrCat(dir_, "/.tmp.", ::getpid(), ".", counter++);
    fd = OpenRetry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0 && (errno != EEXIST || attempt >= 100)) {
      return ErrnoError(errno, "cannot create temporary file", tmp);
    }
  }
  FdCloser closer(fd);
  absl::Status status;
  size_t done = 0;
  while (status.ok() && done < value.size()) {
    const ssize_t n = ::write(fd, value.data() + done, value.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      status = ErrnoError(errno, "cannot write", tmp);
    } else {
      done += static_cast<size_t>(n);
    }
  }
  if (status.ok() && ::fsync(fd) != 0) {
    status = ErrnoError(errno, "cannot fsync", tmp);
  }
  if (closer.Close() != 0 && status.ok()) {
    status = ErrnoError(errno, "cannot close", tmp);
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = ErrnoError(errno, "cannot rename temporary file onto", path);
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  return status;
}

absl::StatusOr<std::string> FileStore::ReadFile(const std::string& path) const {
  const int fd = OpenRetry(path.c_str(), O_RDONLY);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    return ErrnoError(errno, "cannot open", path);
  }
  FdCloser closer(fd);
  std::string data;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "cannot read", path);
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  return data;
}

absl::StatusOr<bool> FileStore::Exists(const std::string& path) const {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  return ErrnoError(errno, "cannot stat", path);
}

absl::Status FileStore::Set(absl::string_view key, absl::string_view value) {
  FSDPP_ASSIGN_OR_RETURN(const std::string path, PathFor(key));
  // Under the lock so that a concurrent Add cannot overwrite this value with
  // one computed from the previous value.
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<DirLock> lock, DirLock::Acquire(dir_));
  return WriteAtomically(path, value);
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key,
                                           absl::Duration timeout) {
  FSDPP_ASSIGN_OR_RETURN(const std::string path, PathFor(key));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = kMinBackoff;
  for (;;) {
    absl::StatusOr<std::string> value = ReadFile(path);
    if (value.ok() || !absl::IsNotFound(value.status())) return value;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return MissingKeysError(absl::StrCat("file store get in '", dir_, "'"),
                              {std::string(key)}, timeout);
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

absl::StatusOr<int64_t> FileStore::Add(absl::string_view key, int64_t delta) {
  FSDPP_ASSIGN_OR_RETURN(const std::string path, PathFor(key));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<DirLock> lock, DirLock::Acquire(dir_));
  int64_t value = 0;
  absl::StatusOr<std::string> current = ReadFile(path);
  if (current.ok()) {
    FSDPP_ASSIGN_OR_RETURN(value, ParseCounter(key, *current));
  } else if (!absl::IsNotFound(current.status())) {
    return current.status();
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return absl::OutOfRangeError(absl::StrCat(
        "file store: adding ", delta, " to key '", key, "' overflows int64"));
  }
  FSDPP_RETURN_IF_ERROR(WriteAtomically(path, absl::StrCat(value)));
  return value;
}

absl::StatusOr<bool> FileStore::Check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) {
    FSDPP_ASSIGN_OR_RETURN(const std::string path, PathFor(key));
    FSDPP_ASSIGN_OR_RETURN(const bool exists, Exists(path));
    if (!exists) return false;
  }
  return true;
}

absl::Status FileStore::Delete(absl::string_view key) {
  FSDPP_ASSIGN_OR_RETURN(const std::string path, PathFor(key));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<DirLock> lock, DirLock::Acquire(dir_));
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoError(errno, "cannot delete", path);
  }
  return absl::OkStatus();
}

absl::Status FileStore::Wait(const std::vector<std::string>& keys,
                             absl::Duration timeout) {
  std::vector<std::string> paths;
  paths.reserve(keys.size());
  for (const std::string& key : keys) {
    FSDPP_ASSIGN_OR_RETURN(std::string path, PathFor(key));
    paths.push_back(std::move(path));
  }
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = kMinBackoff;
  std::vector<bool> present(keys.size(), false);
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < paths.size(); ++i) {
      FSDPP_ASSIGN_OR_RETURN(const bool exists, Exists(paths[i]));
      present[i] = exists;
      all = all && exists;
    }
    if (all) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return MissingKeysError(absl::StrCat("file store wait in '", dir_, "'"),
                              Missing(keys, present), timeout);
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace fsdpp
