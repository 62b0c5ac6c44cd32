// File helpers over POSIX calls (errno turned into Status messages).
#include "trainer/data/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdpp {
namespace trainer {
namespace {

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

}  // namespace trainer
}  // namespace fsdpp
