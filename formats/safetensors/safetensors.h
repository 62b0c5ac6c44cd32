// Reader and writer for the Hugging Face safetensors format.
//
// Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
// mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (plus an optional "__metadata__" string->string object), then the raw
// little-endian, row-major tensor bytes; the offsets are relative to the data
// buffer after the header and must tile it exactly.
//
// Design choices:
//  * The reader mmaps the file read-only and validates everything up front
//    (strict JSON, dtypes, shapes vs byte sizes, offsets tiling the data with
//    no gap, overlap or trailing byte), so accessors only copy bytes. Errors
//    name the file and the problem; nothing in the header is executed.
//  * Bytes() and LoadRows() read straight from the mapping, so a rank that
//    needs one dim-0 shard of a tensor touches only those pages.
//  * The reader accepts every whole-byte safetensors dtype (BOOL, F64, ...)
//    so foreign checkpoints open; tensors whose dtype fsdpp has no DType for
//    are readable only as Bytes().
//  * The writer copies raw bytes (CopyBytes, any device, bit-exact; never a
//    float conversion), lays tensors out by decreasing element size so each
//    one is naturally aligned, pads the header with spaces to a multiple of 8,
//    and replaces the file atomically (temp file, fsync, rename, fsync dir):
//    readers that already mapped the old file keep seeing it intact.
//
// Little-endian hosts only (x86-64, aarch64 Linux), which is static_asserted.
#ifndef FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_H_
#define FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "tensor/tensor.h"

namespace fsdpp {

class Json;

// The safetensors spelling of an fsdpp dtype: "F32", "BF16", "F16", "I32",
// "I64" or "U8".
const char* SafetensorsDTypeName(DType dtype);

// Writes `tensors` (in any order; names unique, non-empty, valid UTF-8 and not
// "__metadata__") and `metadata` (written as "__metadata__" when non-empty) to
// `path` as a safetensors file, atomically: a temporary file in the same
// directory is written, fsynced and renamed over `path`. Tensors may live on
// any non-meta device and have any of fsdpp's dtypes; their bytes are copied
// exactly. Errors: InvalidArgument for bad names or tensors, the errno's code
// (naming the path) for I/O failures. On error `path` is untouched (unless
// only the final fsync of the directory failed) and the temporary file
// ("<path>.tmp.<pid>.<n>") is removed; a crash may leave one behind.
absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Where one tensor sits in a safetensors file, as its header describes it.
struct SafetensorsTensorInfo {
  // The header's dtype string: "F32", "BF16", "BOOL", "F64", ...
  std::string dtype_name;
  // The matching fsdpp dtype; nullopt for dtypes fsdpp has none for (BOOL,
  // I8, I16, U16, U32, U64, F64, F8_E4M3, F8_E5M2), which only Bytes() reads.
  std::optional<DType> dtype;
  // Bytes per element of `dtype_name`.
  size_t element_size = 0;
  Shape shape;
  // The header's data_offsets: [begin, end) relative to the data buffer.
  uint64_t begin = 0;
  uint64_t end = 0;
};

// A validated, read-only safetensors file (memory-mapped) or buffer. All
// methods are const and thread-safe. The file must not be truncated or
// rewritten in place while open (WriteSafetensors replaces files by rename,
// which is safe).
class SafetensorsFile {
 public:
  // Headers longer than this are rejected ("oversized header").
  static constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

  // Maps `path` and validates it. Errors name `path`: DataLoss for truncated
  // files (shorter than 8 bytes, header length or tensor offsets past the end
  // of the file), InvalidArgument for everything else malformed (oversized
  // header, bad JSON with its byte position, bad entries, unknown dtypes,
  // shape/size mismatches, duplicate names, overlaps, gaps, trailing bytes,
  // headers beyond JsonLimits' defaults), the errno's code for I/O failures.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);

  // Validates an in-memory copy of a file, exactly as Open does; `name` stands
  // for the path in errors.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(
      std::string contents, std::string name = "<buffer>");

  // Unmaps the file; spans from Bytes() die with it (loaded tensors do not).
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // The path (or buffer name) given when opening.
  const std::string& path() const { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  // Number of tensors.
  size_t size() const { return tensors_.size(); }
  // True when a tensor `name` exists.
  bool Contains(const std::string& name) const {
    return tensors_.count(name) != 0;
  }
  // The header entry of `name`; NotFound if there is none.
  absl::StatusOr<SafetensorsTensorInfo> Info(const std::string& name) const;
  // The "__metadata__" object (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

  // A new tensor on `device` (allocated under `tag`) holding a copy of
  // `name`'s bytes. On a meta device only shape and dtype are set.
  // NotFound for unknown names, Unimplemented for dtypes fsdpp lacks.
  absl::StatusOr<Tensor> Load(const std::string& name,
                              Device device = Device::Cpu(),
                              MemoryTag tag = MemoryTag::kOther) const;

  // Rows [row_begin, row_end) of dim 0 of `name` as a new tensor (shape
  // [row_end - row_begin, dims 1...]), copied straight from the mapping.
  // InvalidArgument for scalars, OutOfRange for rows outside [0, dim 0],
  // NotFound and Unimplemented as for Load.
  absl::StatusOr<Tensor> LoadRows(const std::string& name, int64_t row_begin,
                                  int64_t row_end,
                                  Device device = Device::Cpu(),
                                  MemoryTag tag = MemoryTag::kOther) const;

  // `name`'s raw little-endian bytes inside the mapping (valid while this
  // object lives); NotFound if there is no such tensor.
  absl::StatusOr<absl::Span<const char>> Bytes(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  // Validates data_[0, size_) and fills tensors_ and metadata_.
  absl::Status Parse();
  // Parse's steps below each return the first problem found as an Error().
  // Reads the "__metadata__" header entry into metadata_.
  absl::Status ParseMetadata(const Json& entry);
  // Reads and checks the header entry of tensor `name` (dtype, shape and
  // data_offsets, against each other and a data buffer of `data_bytes`).
  absl::StatusOr<SafetensorsTensorInfo> ParseTensorEntry(
      const std::string& name, const Json& entry, uint64_t data_bytes) const;
  // Appends the dims of an entry's "shape" to `shape`, checking that they
  // are non-negative int64s whose product fits; `what` prefixes messages.
  absl::Status ParseShape(const std::string& what, const Json& shape_json,
                          Shape* shape) const;
  // Reads an entry's "data_offsets" into info->begin and info->end and checks
  // them against the data buffer and info's shape and element size.
  absl::Status ParseDataOffsets(const std::string& what, const Json& offsets,
                                uint64_t data_bytes,
                                SafetensorsTensorInfo* info) const;
  // Checks that tensors_ tile [0, data_bytes): no overlap, gap or tail.
  absl::Status CheckTiling(uint64_t data_bytes) const;
  absl::StatusOr<const SafetensorsTensorInfo*> Find(
      const std::string& name) const;
  absl::Status Error(absl::StatusCode code, absl::string_view problem) const;
  // A new tensor of `shape` holding `bytes` bytes of `name` from `offset`.
  absl::StatusOr<Tensor> Copy(const std::string& name,
                              const SafetensorsTensorInfo& info, Shape shape,
                              uint64_t offset, uint64_t bytes, Device device,
                              MemoryTag tag) const;

  std::string path_;
  const char* data_ = nullptr;  // The whole file.
  size_t size_ = 0;
  size_t data_start_ = 0;    // 8 + header length.
  void* mapping_ = nullptr;  // mmap'ed region (Open), or null.
  size_t mapping_bytes_ = 0;
  std::string buffer_;  // The contents (FromBuffer).
  std::map<std::string, SafetensorsTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fsdpp

#endif  // FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_H_
