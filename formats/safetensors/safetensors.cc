// Safetensors reader and writer; see safetensors.h. The header is parsed with
// formats/json.h into plain structs and every entry is validated before the
// file object is handed out, so the accessors below trust the offsets.
#include "formats/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <limits>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "formats/json.h"

namespace fsdpp {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this code copies it as is");

constexpr char kMetadataKey[] = "__metadata__";
// Host staging buffer for device -> file copies in WriteSafetensors.
constexpr size_t kStagingBytes = size_t{16} << 20;
// Longest tensor name quoted in full in error messages.
constexpr size_t kMaxQuotedName = 200;

// A safetensors dtype string, its element size and fsdpp's matching dtype.
struct SafetensorsDType {
  const char* name;
  size_t size;
  std::optional<DType> dtype;
};

constexpr SafetensorsDType kSafetensorsDTypes[] = {
    {"BOOL", 1, std::nullopt},    {"U8", 1, DType::kU8},
    {"I8", 1, std::nullopt},      {"F8_E5M2", 1, std::nullopt},
    {"F8_E4M3", 1, std::nullopt}, {"I16", 2, std::nullopt},
    {"U16", 2, std::nullopt},     {"F16", 2, DType::kF16},
    {"BF16", 2, DType::kBF16},    {"I32", 4, DType::kI32},
    {"U32", 4, std::nullopt},     {"F32", 4, DType::kF32},
    {"F64", 8, std::nullopt},     {"I64", 8, DType::kI64},
    {"U64", 8, std::nullopt},
};

const SafetensorsDType* LookupDType(absl::string_view name) {
  for (const SafetensorsDType& d : kSafetensorsDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

// A name as a JSON string for messages, cut (at a UTF-8 boundary) when long.
std::string Quote(absl::string_view name) {
  if (name.size() <= kMaxQuotedName) return JsonQuote(name);
  size_t cut = kMaxQuotedName;
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return absl::StrCat(JsonQuote(name.substr(0, cut)), "...");
}

std::string RangeString(uint64_t begin, uint64_t end) {
  return absl::StrCat("[", begin, ", ", end, ")");
}

int OpenRetry(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Writes a file under a temporary name next to `path` and renames it over
// `path` on Commit(); removes the temporary file unless committed.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path) : path_(std::move(path)) {}
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!tmp_.empty() && !committed_) ::unlink(tmp_.c_str());
  }

  absl::Status Create() {
    static std::atomic<uint64_t> counter{0};
    // O_EXCL plus a retry skips stale temporaries left by a crashed writer.
    for (int attempt = 0;; ++attempt) {
      tmp_ = absl::StrCat(path_, ".tmp.", ::getpid(), ".", counter++);
      fd_ = OpenRetry(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
      if (fd_ >= 0) return absl::OkStatus();
      if (errno != EEXIST || attempt >= 100) {
        const int err = errno;
        tmp_.clear();
        return absl::ErrnoToStatus(
            err, absl::StrCat(path_, ": cannot create a temporary file"));
      }
    }
  }

  absl::Status Write(const char* data, size_t bytes) {
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, data, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        return absl::ErrnoToStatus(errno, absl::StrCat(tmp_, ": write"));
      data += n;
      bytes -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Commit() {
    if (::fsync(fd_) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat(tmp_, ": fsync"));
    }
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0)
      return absl::ErrnoToStatus(errno, absl::StrCat(tmp_, ": close"));
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat(path_, ": cannot rename ", tmp_, " onto it"));
    }
    committed_ = true;
    // Make the rename itself durable.
    const std::string dir = DirName(path_);
    const int dir_fd = OpenRetry(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (dir_fd < 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat(dir, ": open directory"));
    }
    const int sync_rc = ::fsync(dir_fd);
    const int sync_errno = errno;
    ::close(dir_fd);
    // Some file systems cannot fsync directories (EINVAL); nothing to do then.
    if (sync_rc != 0 && sync_errno != EINVAL) {
      return absl::ErrnoToStatus(sync_errno,
                                 absl::StrCat(dir, ": fsync directory"));
    }
    return absl::OkStatus();
  }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

absl::Status WriteError(const std::string& path, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("WriteSafetensors ", path, ": ", problem));
}

// WriteSafetensors' argument checks: UTF-8 metadata; tensor names non-empty,
// not "__metadata__", valid UTF-8 and unique; tensors defined and not meta.
absl::Status CheckWriteInputs(
    const std::string& path,
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
      return WriteError(path, absl::StrCat("metadata entry ", Quote(key),
                                           " is not valid UTF-8"));
    }
  }
  std::set<absl::string_view> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    if (name.empty()) {
      return WriteError(path,
                        absl::StrCat("tensor #", i, " has an empty name"));
    }
    if (name == kMetadataKey) {
      return WriteError(path, "the tensor name \"__metadata__\" is reserved");
    }
    if (!IsValidUtf8(name)) {
      return WriteError(path, absl::StrCat("tensor name ", Quote(name),
                                           " is not valid UTF-8"));
    }
    if (!seen.insert(name).second) {
      return WriteError(path,
                        absl::StrCat("duplicate tensor name ", Quote(name)));
    }
    if (!tensor.defined()) {
      return WriteError(path,
                        absl::StrCat("tensor ", Quote(name), " is undefined"));
    }
    if (tensor.is_meta()) {
      return WriteError(path, absl::StrCat("tensor ", Quote(name),
                                           " is a meta tensor (no bytes)"));
    }
  }
  return absl::OkStatus();
}

// Where WriteSafetensors puts each tensor's bytes in the data buffer.
struct DataLayout {
  std::vector<size_t> order;    // Tensor indices in data order.
  std::vector<uint64_t> begin;  // Data offset of each tensor, by index.
  size_t largest = 0;           // Bytes of the largest tensor.
};

// Lays out the data buffer of `tensors`. Data order: decreasing element size
// (stable), so each tensor starts at a multiple of its element size; the data
// buffer itself starts at a multiple of 8 thanks to the header padding.
DataLayout LayOutData(
    const std::vector<std::pair<std::string, Tensor>>& tensors) {
  DataLayout layout;
  std::vector<size_t>& order = layout.order;
  order.resize(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].second.dtype()) >
           DTypeSize(tensors[b].second.dtype());
  });
  layout.begin.resize(tensors.size());
  uint64_t offset = 0;
  for (size_t i : order) {
    layout.begin[i] = offset;
    offset += tensors[i].second.nbytes();
    layout.largest = std::max(layout.largest, tensors[i].second.nbytes());
  }
  return layout;
}

// The JSON header of a safetensors file: "__metadata__" (when non-empty),
// then every tensor in the order of `tensors`, padded with spaces to a multiple
// of 8 bytes.
std::string HeaderJson(
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata,
    const DataLayout& layout) {
  std::string header = "{";
  if (!metadata.empty()) {
    absl::StrAppend(&header, JsonQuote(kMetadataKey), ":{");
    bool first = true;
    for (const auto& [key, value] : metadata) {
      absl::StrAppend(&header, first ? "" : ",", JsonQuote(key), ":",
                      JsonQuote(value));
      first = false;
    }
    absl::StrAppend(&header, "}", tensors.empty() ? "" : ",");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i].second;
    absl::StrAppend(&header, i == 0 ? "" : ",", JsonQuote(tensors[i].first),
                    ":{\"dtype\":\"", SafetensorsDTypeName(t.dtype()),
                    "\",\"shape\":[", absl::StrJoin(t.shape(), ","),
                    "],\"data_offsets\":[", layout.begin[i], ",",
                    layout.begin[i] + t.nbytes(), "]}");
  }
  header.push_back('}');
  header.append((8 - header.size() % 8) % 8, ' ');
  return header;
}

}  // namespace

const char* SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  FSDPP_RETURN_IF_ERROR(CheckWriteInputs(path, tensors, metadata));
  const DataLayout layout = LayOutData(tensors);
  const std::string header = HeaderJson(tensors, metadata, layout);

  char length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] =
        static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  }

  AtomicFileWriter writer(path);
  FSDPP_RETURN_IF_ERROR(writer.Create());
  FSDPP_RETURN_IF_ERROR(writer.Write(length, sizeof(length)));
  FSDPP_RETURN_IF_ERROR(writer.Write(header.data(), header.size()));
  // Every device goes through CopyBytes into a bounded host buffer: one code
  // path, exact bytes.
  std::vector<char> staging(std::min(layout.largest, kStagingBytes));
  for (size_t i : layout.order) {
    const Tensor& t = tensors[i].second;
    const char* src = static_cast<const char*>(t.raw_data());
    for (size_t done = 0; done < t.nbytes();) {
      const size_t n = std::min(staging.size(), t.nbytes() - done);
      absl::Status copied =
          CopyBytes(staging.data(), Device::Cpu(), src + done, t.device(), n);
      if (!copied.ok()) {
        return Annotate(copied,
                        absl::StrCat("WriteSafetensors ", path, ": tensor ",
                                     Quote(tensors[i].first)));
      }
      FSDPP_RETURN_IF_ERROR(writer.Write(staging.data(), n));
      done += n;
    }
  }
  return writer.Commit();
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  const int fd = OpenRetry(path.c_str(), O_RDONLY);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {  // mmap rejects empty mappings; Parse reports those.
    void* mapping = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot mmap"));
    }
    file->mapping_ = mapping;
    file->mapping_bytes_ = file->size_;
    file->data_ = static_cast<const char*>(mapping);
  }
  ::close(fd);  // The mapping keeps the file alive.
  FSDPP_RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    std::string contents, std::string name) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(name);
  file->buffer_ = std::move(contents);
  file->data_ = file->buffer_.data();
  file->size_ = file->buffer_.size();
  FSDPP_RETURN_IF_ERROR(file->Parse());
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

absl::Status SafetensorsFile::Error(absl::StatusCode code,
                                    absl::string_view problem) const {
  return absl::Status(code, absl::StrCat(path_, ": ", problem));
}

absl::Status SafetensorsFile::Parse() {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kDataLoss = absl::StatusCode::kDataLoss;
  if (size_ < 8) {
    return Error(kDataLoss, absl::StrCat("file is ", size_,
                                         " bytes, shorter than the 8-byte "
                                         "header length"));
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<unsigned char>(data_[i]);
  }
  if (header_bytes > kMaxHeaderBytes) {
    return Error(kInvalid,
                 absl::StrCat("oversized header: ", header_bytes,
                              " bytes, the limit is ", kMaxHeaderBytes));
  }
  if (header_bytes > size_ - 8) {
    return Error(kDataLoss,
                 absl::StrCat("header length ", header_bytes, " exceeds the ",
                              size_ - 8, " bytes after it (truncated file?)"));
  }
  data_start_ = 8 + static_cast<size_t>(header_bytes);
  const uint64_t data_bytes = size_ - data_start_;

  absl::StatusOr<Json> header =
      ParseJson(absl::string_view(data_ + 8, header_bytes));
  if (!header.ok()) {
    return Error(kInvalid, absl::StrCat("malformed JSON header: ",
                                        header.status().message()));
  }
  if (!header->is_object()) {
    return Error(kInvalid, absl::StrCat("header is a JSON ",
                                        Json::TypeName(header->type()),
                                        ", not an object"));
  }

  bool seen_metadata = false;
  for (const auto& [name, entry] : header->object_value()) {
    if (name == kMetadataKey) {
      if (seen_metadata) return Error(kInvalid, "duplicate \"__metadata__\"");
      seen_metadata = true;
      FSDPP_RETURN_IF_ERROR(ParseMetadata(entry));
      continue;
    }
    if (name.empty()) return Error(kInvalid, "empty tensor name");
    if (tensors_.count(name) != 0) {
      return Error(kInvalid,
                   absl::StrCat("duplicate tensor name ", Quote(name)));
    }
    FSDPP_ASSIGN_OR_RETURN(SafetensorsTensorInfo info,
                           ParseTensorEntry(name, entry, data_bytes));
    tensors_.emplace(name, std::move(info));
  }
  return CheckTiling(data_bytes);
}

absl::Status SafetensorsFile::ParseMetadata(const Json& entry) {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  if (!entry.is_object()) {
    return Error(kInvalid,
                 absl::StrCat("\"__metadata__\" is a JSON ",
                              Json::TypeName(entry.type()), ", not an object"));
  }
  for (const auto& [key, value] : entry.object_value()) {
    if (!value.is_string()) {
      return Error(
          kInvalid,
          absl::StrCat("\"__metadata__\" value of ", Quote(key), " is a JSON ",
                       Json::TypeName(value.type()), ", not a string"));
    }
    if (!metadata_.emplace(key, value.string_value()).second) {
      return Error(kInvalid,
                   absl::StrCat("duplicate \"__metadata__\" key ", Quote(key)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsTensorInfo> SafetensorsFile::ParseTensorEntry(
    const std::string& name, const Json& entry, uint64_t data_bytes) const {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  if (!entry.is_object()) {
    return Error(kInvalid,
                 absl::StrCat("entry ", Quote(name), " is a JSON ",
                              Json::TypeName(entry.type()), ", not an object"));
  }
  const std::string what = absl::StrCat("tensor ", Quote(name), ": ");
  const Json* dtype = nullptr;
  const Json* shape = nullptr;
  const Json* offsets = nullptr;
  for (const auto& [key, value] : entry.object_value()) {
    const Json** slot = key == "dtype"          ? &dtype
                        : key == "shape"        ? &shape
                        : key == "data_offsets" ? &offsets
                                                : nullptr;
    if (slot == nullptr) {
      return Error(kInvalid, absl::StrCat(what, "unexpected key ", Quote(key)));
    }
    if (*slot != nullptr) {
      return Error(kInvalid, absl::StrCat(what, "duplicate key ", Quote(key)));
    }
    *slot = &value;
  }
  for (const auto& [key, value] :
       {std::make_pair("dtype", dtype), std::make_pair("shape", shape),
        std::make_pair("data_offsets", offsets)}) {
    if (value == nullptr) {
      return Error(kInvalid, absl::StrCat(what, "missing \"", key, "\""));
    }
  }

  SafetensorsTensorInfo info;
  if (!dtype->is_string()) {
    return Error(kInvalid,
                 absl::StrCat(what, "\"dtype\" is a JSON ",
                              Json::TypeName(dtype->type()), ", not a string"));
  }
  const SafetensorsDType* known = LookupDType(dtype->string_value());
  if (known == nullptr) {
    return Error(kInvalid, absl::StrCat(what, "unknown dtype ",
                                        Quote(dtype->string_value())));
  }
  info.dtype_name = known->name;
  info.dtype = known->dtype;
  info.element_size = known->size;

  FSDPP_RETURN_IF_ERROR(ParseShape(what, *shape, &info.shape));
  FSDPP_RETURN_IF_ERROR(ParseDataOffsets(what, *offsets, data_bytes, &info));
  return info;
}

absl::Status SafetensorsFile::ParseShape(const std::string& what,
                                         const Json& shape_json,
                                         Shape* shape) const {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  if (!shape_json.is_array()) {
    return Error(kInvalid, absl::StrCat(what, "\"shape\" is a JSON ",
                                        Json::TypeName(shape_json.type()),
                                        ", not an array"));
  }
  // The product of the non-zero dims must fit in int64, so that no partial
  // product of the shape overflows either.
  uint64_t nonzero_product = 1;
  bool too_many = false;
  constexpr uint64_t kInt64Max = std::numeric_limits<int64_t>::max();
  for (const Json& dim : shape_json.array_value()) {
    if (dim.is_int64() && dim.int64_value() < 0) {
      return Error(kInvalid, absl::StrCat(what, "negative dim ",
                                          dim.int64_value(), " in shape"));
    }
    if (!dim.is_uint64() || dim.uint64_value() > kInt64Max) {
      return Error(kInvalid,
                   absl::StrCat(what, "shape dims must be integers in [0, ",
                                kInt64Max, "]"));
    }
    const uint64_t d = dim.uint64_value();
    shape->push_back(static_cast<int64_t>(d));
    if (d != 0) {
      if (nonzero_product > kInt64Max / d) too_many = true;
      nonzero_product *= too_many ? 1 : d;
    }
  }
  if (too_many) {
    return Error(kInvalid, absl::StrCat(what, "shape ", ShapeToString(*shape),
                                        " has too many elements"));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsFile::ParseDataOffsets(
    const std::string& what, const Json& offsets, uint64_t data_bytes,
    SafetensorsTensorInfo* info) const {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kDataLoss = absl::StatusCode::kDataLoss;
  if (!offsets.is_array() || offsets.array_value().size() != 2 ||
      !offsets.array_value()[0].is_uint64() ||
      !offsets.array_value()[1].is_uint64()) {
    return Error(kInvalid, absl::StrCat(what,
                                        "\"data_offsets\" must be [begin, end] "
                                        "with non-negative integers"));
  }
  info->begin = offsets.array_value()[0].uint64_value();
  info->end = offsets.array_value()[1].uint64_value();
  const std::string offsets_text =
      absl::StrCat("data_offsets [", info->begin, ", ", info->end, "]");
  if (info->begin > info->end) {
    return Error(kInvalid,
                 absl::StrCat(what, offsets_text, " have begin > end"));
  }
  if (info->end > data_bytes) {
    return Error(kDataLoss,
                 absl::StrCat(what, offsets_text,
                              " are out of range: the data buffer is ",
                              data_bytes, " bytes (truncated file?)"));
  }
  // NumElements cannot overflow (ParseShape checked); numel * element_size
  // can, so compare by division first.
  const uint64_t numel = static_cast<uint64_t>(NumElements(info->shape));
  if (numel > (info->end - info->begin) / info->element_size ||
      numel * info->element_size != info->end - info->begin) {
    const bool fits =
        numel <= std::numeric_limits<uint64_t>::max() / info->element_size;
    return Error(kInvalid,
                 absl::StrCat(what, "shape ", ShapeToString(info->shape),
                              " of ", info->dtype_name, " needs ",
                              fits ? absl::StrCat(numel * info->element_size)
                                   : std::string("more than 2^64"),
                              " bytes, but ", offsets_text, " hold ",
                              info->end - info->begin));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsFile::CheckTiling(uint64_t data_bytes) const {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  // The tensors must tile [0, data_bytes) exactly.
  std::vector<std::tuple<uint64_t, uint64_t, const std::string*>> spans;
  spans.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) {
    spans.emplace_back(info.begin, info.end, &name);
  }
  // By (begin, end); ties keep the map's name order, so messages are stable.
  std::stable_sort(spans.begin(), spans.end(),
                   [](const auto& a, const auto& b) {
                     return std::tie(std::get<0>(a), std::get<1>(a)) <
                            std::tie(std::get<0>(b), std::get<1>(b));
                   });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  uint64_t previous_begin = 0;
  for (const auto& [begin, end, name] : spans) {
    if (begin < cursor) {
      return Error(kInvalid, absl::StrCat("tensors ", Quote(*previous), " ",
                                          RangeString(previous_begin, cursor),
                                          " and ", Quote(*name), " ",
                                          RangeString(begin, end), " overlap"));
    }
    if (begin > cursor) {
      return Error(kInvalid, absl::StrCat("bytes ", RangeString(cursor, begin),
                                          " of the data buffer belong to no "
                                          "tensor (gap before ",
                                          Quote(*name), ")"));
    }
    cursor = end;
    previous = name;
    previous_begin = begin;
  }
  if (cursor != data_bytes) {
    return Error(
        kInvalid,
        absl::StrCat(data_bytes - cursor,
                     " trailing bytes after the last tensor (the "
                     "data buffer is ",
                     data_bytes, " bytes, tensors end at ", cursor, ")"));
  }
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsFile::Find(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return Error(absl::StatusCode::kNotFound,
                 absl::StrCat("no tensor named ", Quote(name)));
  }
  return &it->second;
}

absl::StatusOr<SafetensorsTensorInfo> SafetensorsFile::Info(
    const std::string& name) const {
  FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, Find(name));
  return *info;
}

absl::StatusOr<absl::Span<const char>> SafetensorsFile::Bytes(
    const std::string& name) const {
  FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, Find(name));
  return absl::Span<const char>(data_ + data_start_ + info->begin,
                                info->end - info->begin);
}

absl::StatusOr<Tensor> SafetensorsFile::Load(const std::string& name,
                                             Device device,
                                             MemoryTag tag) const {
  FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, Find(name));
  return Copy(name, *info, info->shape, 0, info->end - info->begin, device,
              tag);
}

absl::StatusOr<Tensor> SafetensorsFile::LoadRows(const std::string& name,
                                                 int64_t row_begin,
                                                 int64_t row_end, Device device,
                                                 MemoryTag tag) const {
  FSDPP_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, Find(name));
  const std::string call = absl::StrCat("LoadRows(", Quote(name), ", ",
                                        row_begin, ", ", row_end, "): ");
  if (info->shape.empty()) {
    return Error(absl::StatusCode::kInvalidArgument,
                 absl::StrCat(call, "tensor is a scalar"));
  }
  const int64_t rows = info->shape[0];
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    return Error(absl::StatusCode::kOutOfRange,
                 absl::StrCat(call, "rows out of range for shape ",
                              ShapeToString(info->shape)));
  }
  const uint64_t row_bytes = rows == 0 ? 0 : (info->end - info->begin) / rows;
  Shape shape = info->shape;
  shape[0] = row_end - row_begin;
  return Copy(name, *info, std::move(shape), row_bytes * row_begin,
              row_bytes * (row_end - row_begin), device, tag);
}

absl::StatusOr<Tensor> SafetensorsFile::Copy(const std::string& name,
                                             const SafetensorsTensorInfo& info,
                                             Shape shape, uint64_t offset,
                                             uint64_t bytes, Device device,
                                             MemoryTag tag) const {
  if (!info.dtype.has_value()) {
    return Error(
        absl::StatusCode::kUnimplemented,
        absl::StrCat("tensor ", Quote(name), " has dtype ", info.dtype_name,
                     ", which fsdpp has no DType for; read it with "
                     "Bytes()"));
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor tensor, Tensor::Empty(std::move(shape), *info.dtype, device, tag));
  if (device.is_meta()) return tensor;
  FSDPP_RETURN_IF_ERROR(
      Annotate(CopyBytes(tensor.raw_data(), device,
                         data_ + data_start_ + info.begin + offset,
                         Device::Cpu(), bytes),
               absl::StrCat(path_, ": loading tensor ", Quote(name))));
  return tensor;
}

}  // namespace fsdpp
