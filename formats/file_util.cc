// POSIX file helpers; see file_util.h.
#include "formats/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fsdpp {
namespace {

absl::Status Errno(int err, absl::string_view path, absl::string_view what) {
  return absl::ErrnoToStatus(err, absl::StrCat(path, ": ", what));
}

// "cannot <action> <what> "path": <strerror>", coded by errno.
absl::Status ErrnoError(int error, absl::string_view action,
                        absl::string_view what, const std::string& path) {
  const std::string message = absl::StrCat("cannot ", action, " ", what, " \"",
                                           path, "\": ", std::strerror(error));
  if (error == ENOENT) return absl::NotFoundError(message);
  if (error == EACCES || error == EPERM) {
    return absl::PermissionDeniedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

absl::Status ScopedFd::Close(absl::string_view path) {
  const int fd = release();
  if (fd >= 0 && ::close(fd) != 0) return Errno(errno, path, "close");
  return absl::OkStatus();
}

absl::StatusOr<ScopedFd> OpenForRead(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Errno(errno, path, "cannot open");
  return ScopedFd(fd);
}

absl::StatusOr<ScopedFd> CreateExclusive(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Errno(errno, path, "cannot create");
  return ScopedFd(fd);
}

absl::Status WriteFileDurably(const std::string& path,
                              absl::string_view contents) {
  FSDPP_ASSIGN_OR_RETURN(ScopedFd fd, CreateExclusive(path));
  FSDPP_RETURN_IF_ERROR(
      WriteAll(fd.get(), contents.data(), contents.size(), path));
  if (::fdatasync(fd.get()) != 0) return Errno(errno, path, "fdatasync");
  return fd.Close(path);
}

absl::Status WriteAll(int fd, const void* data, size_t size,
                      absl::string_view path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(errno, path, "write");
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PreadFully(int fd, std::vector<iovec> iov,
                                    uint64_t offset, absl::string_view path) {
  uint64_t total = 0;
  size_t first = 0;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    const int count =
        static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n =
        ::preadv(fd, &iov[first], count, static_cast<off_t>(offset + total));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(errno, path, absl::StrCat("read at byte ", offset + total));
    }
    if (n == 0) break;  // End of file.
    total += static_cast<uint64_t>(n);
    size_t left = static_cast<size_t>(n);
    while (left > 0) {
      const size_t take = std::min(left, iov[first].iov_len);
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      left -= take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
  return total;
}

absl::StatusOr<uint64_t> FileSize(int fd, absl::string_view path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return Errno(errno, path, "fstat");
  return static_cast<uint64_t>(st.st_size);
}

absl::Status SyncDir(const std::string& dir) {
  int fd;
  do {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Errno(errno, dir, "cannot open directory");
  ScopedFd owned(fd);
  // Some filesystems cannot sync directories (EINVAL); nothing to do there.
  if (::fsync(fd) != 0 && errno != EINVAL) return Errno(errno, dir, "fsync");
  return owned.Close(dir);
}

absl::Status MakeDirs(const std::string& dir) {
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    prefix = dir.substr(0, pos);
    if (prefix.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return Errno(errno, prefix, "cannot create directory");
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return Errno(errno, dir, "stat");
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": exists and is not a directory"));
  }
  return absl::OkStatus();
}

namespace {
int RemoveOne(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path) != 0 && errno != ENOENT ? -1 : 0;
}
}  // namespace

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return Errno(errno, path, "lstat");
  }
  if (::nftw(path.c_str(), RemoveOne, 32, FTW_DEPTH | FTW_PHYS) != 0) {
    return Errno(errno, path, "cannot remove");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return Errno(errno, dir, "cannot list");
  std::vector<std::string> names;
  errno = 0;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) return Errno(err, dir, "readdir");
  std::sort(names.begin(), names.end());
  return names;
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

absl::Status RenameDir(const std::string& from, const std::string& to,
                       bool* replaced) {
  *replaced = false;
  if (!PathExists(to)) {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return Errno(errno, to, absl::StrCat("cannot rename ", from, " to it"));
    }
    return absl::OkStatus();
  }
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(),
                  RENAME_EXCHANGE) != 0) {
    return Errno(errno, to,
                 absl::StrCat("exists and cannot be swapped with ", from));
  }
  *replaced = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "read", what, path);
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return ErrnoError(error, "read", what, path);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot read ", what, " \"", path, "\": not a regular file"));
  }
  std::string contents;
  contents.reserve(static_cast<size_t>(info.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      return ErrnoError(error, "read", what, path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents,
                                 absl::string_view what) {
  const std::string temporary = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd =
      ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, "write", what, path);
  size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n =
        ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      return ErrnoError(error, "write", what, path);
    }
    written += static_cast<size_t>(n);
  }
  const int sync_error = ::fsync(fd) == 0 ? 0 : errno;
  const int close_error = ::close(fd) == 0 ? 0 : errno;
  if (sync_error != 0 || close_error != 0) {
    ::unlink(temporary.c_str());
    return ErrnoError(sync_error != 0 ? sync_error : close_error, "write", what,
                      path);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    return ErrnoError(error, "write", what, path);
  }
  return absl::OkStatus();
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

bool IsDirectory(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

}  // namespace fsdpp
