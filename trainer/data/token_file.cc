// llm.c token shards: mmap-based reader with header validation, atomic
// writer.
#include "trainer/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "formats/file_util.h"

namespace fsdpp {
namespace trainer {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token files are little-endian; big-endian hosts unsupported");

absl::Status FormatError(const std::string& path, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("token file \"", path, "\": ", problem));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenFile>> TokenFile::Open(
    const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    const std::string message = absl::StrCat("cannot open token file \"", path,
                                             "\": ", std::strerror(error));
    return error == ENOENT ? absl::NotFoundError(message)
                           : absl::InternalError(message);
  }
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return FormatError(path, "not a regular file");
  }
  const size_t file_bytes = static_cast<size_t>(info.st_size);
  if (file_bytes < kTokenFileHeaderBytes) {
    ::close(fd);
    return FormatError(path,
                       absl::StrCat(file_bytes, " bytes is shorter than the ",
                                    kTokenFileHeaderBytes, "-byte header"));
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd);  // The mapping keeps the file alive.
  if (mapping == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map token file \"", path,
                                            "\": ", std::strerror(map_error)));
  }
  std::unique_ptr<TokenFile> file(new TokenFile());
  file->path_ = path;
  file->mapping_ = mapping;
  file->mapping_bytes_ = file_bytes;

  int32_t header[3];
  std::memcpy(header, mapping, sizeof(header));
  if (header[0] != kTokenFileMagic) {
    return FormatError(
        path, absl::StrCat("bad magic ", header[0], " (expected ",
                           kTokenFileMagic, ", llm.c's uint16 token shard)"));
  }
  if (header[1] != kTokenFileVersion) {
    return FormatError(
        path, absl::StrCat("unsupported version ", header[1], " (expected ",
                           kTokenFileVersion, ")"));
  }
  if (header[2] < 0) {
    return FormatError(path, absl::StrCat("negative token count ", header[2]));
  }
  const size_t count = static_cast<size_t>(header[2]);
  const size_t expected_bytes =
      kTokenFileHeaderBytes + count * sizeof(uint16_t);
  if (file_bytes != expected_bytes) {
    return FormatError(
        path,
        absl::StrCat("the header says ", count, " tokens (", expected_bytes,
                     " bytes) but the file has ", file_bytes, " bytes",
                     file_bytes < expected_bytes ? " (truncated)"
                                                 : " (trailing bytes)"));
  }
  file->tokens_ = absl::MakeConstSpan(
      reinterpret_cast<const uint16_t*>(static_cast<const char*>(mapping) +
                                        kTokenFileHeaderBytes),
      count);
  return file;
}

TokenFile::~TokenFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

absl::Status WriteTokenFile(const std::string& path,
                            absl::Span<const int32_t> tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file \"", path, "\": ", tokens.size(),
                     " tokens do not fit the int32 count of the header"));
  }
  std::string contents(kTokenFileHeaderBytes + tokens.size() * 2, '\0');
  const int32_t header[3] = {kTokenFileMagic, kTokenFileVersion,
                             static_cast<int32_t>(tokens.size())};
  std::memcpy(contents.data(), header, sizeof(header));
  char* out = contents.data() + kTokenFileHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file \"", path, "\": token ", tokens[i],
                       " at position ", i, " does not fit in uint16"));
    }
    const uint16_t value = static_cast<uint16_t>(tokens[i]);
    std::memcpy(out + 2 * i, &value, sizeof(value));
  }
  return WriteFileAtomically(path, contents, "token file");
}

}  // namespace trainer
}  // namespace fsdpp
