// The checkpoint metadata: what a checkpoint directory holds and where, as
// validated C++ structs, and its file format (metadata.proto).
//
// A checkpoint directory holds data files (raw chunk bytes, one or more per
// saving rank) and `metadata.pb`, which maps every fully qualified name to
// its kind (tensor or byte value), dtype, global shape and chunks: boxes of
// the global tensor, each stored as one byte range of one data file with a
// CRC-32C of the range and of every `block_bytes` piece of it.
//
// ParseMetadata faces untrusted bytes (it is fuzzed: metadata_fuzz.cc). It
// checks the envelope (magic, version, body CRC) before parsing the body,
// then validates everything a reader relies on: safe file names, dtypes,
// shapes, chunk byte lengths, block CRC counts and that each chunk's CRC is
// the combination of its block CRCs (so verifying blocks verifies chunks),
// and that each entry's chunks tile its shape exactly. Nothing in the file is
// ever executed.
#ifndef FSDPP_CHECKPOINT_METADATA_H_
#define FSDPP_CHECKPOINT_METADATA_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"

namespace fsdpp {

// The format version this build writes and reads.
inline constexpr uint32_t kCheckpointFormatVersion = 1;
// The metadata file inside a checkpoint directory.
inline constexpr char kMetadataFileName[] = "metadata.pb";
// MetadataFile.magic.
inline constexpr char kCheckpointMagic[] = "fsdpp-checkpoint";
// Default CRC block size.
inline constexpr uint64_t kDefaultBlockBytes = uint64_t{1} << 20;

// What an entry holds.
enum class EntryKind { kTensor, kBytes };
// "tensor" or "bytes".
const char* EntryKindName(EntryKind kind);

// One saved box of an entry.
struct ChunkMetadata {
  // Where the box sits in the global tensor.
  Box box;
  // Index into CheckpointMetadata::files.
  int64_t file = 0;
  // The box's elements (row-major) are bytes [byte_offset, byte_offset +
  // length) of the file.
  uint64_t byte_offset = 0;
  uint64_t length = 0;
  // CRC-32C of the whole range.
  uint32_t crc32c = 0;
  // CRC-32C of each block_bytes piece of the range (the last may be short).
  std::vector<uint32_t> block_crc32c;
};

// One fully qualified name.
struct EntryMetadata {
  EntryKind kind = EntryKind::kTensor;
  // kBytes entries are u8 with shape [length].
  DType dtype = DType::kF32;
  Shape shape;
  // Non-empty boxes tiling `shape`.
  std::vector<ChunkMetadata> chunks;

  // Bytes of the whole tensor.
  uint64_t nbytes() const {
    return static_cast<uint64_t>(NumElements(shape)) * DTypeSize(dtype);
  }
};

// The contents of metadata.pb.
struct CheckpointMetadata {
  int64_t step = 0;
  // Ranks that saved the checkpoint.
  int world_size = 1;
  // Block size of ChunkMetadata::block_crc32c: a power of two in [8, 2^30].
  uint64_t block_bytes = kDefaultBlockBytes;
  // Data file names, relative to the checkpoint directory.
  std::vector<std::string> files;
  // Keyed by fully qualified name.
  std::map<std::string, EntryMetadata> entries;

  // Sum of all chunk lengths.
  uint64_t TotalBytes() const;
};

// OK when `metadata` is consistent (everything ParseMetadata checks after
// decoding); otherwise InvalidArgument naming the key or file at fault.
absl::Status ValidateMetadata(const CheckpointMetadata& metadata);

// The bytes of a metadata.pb file holding `metadata` (not validated).
std::string SerializeMetadata(const CheckpointMetadata& metadata);

// Decodes and validates a metadata.pb file's bytes. Errors are prefixed with
// `name` (the file's path): DataLoss for truncated or corrupt files (bad
// envelope, body CRC mismatch), InvalidArgument for a wrong magic or
// inconsistent contents (naming the key), FailedPrecondition for another
// format version (naming both versions).
absl::StatusOr<CheckpointMetadata> ParseMetadata(absl::string_view bytes,
                                                 absl::string_view name);

// Reads and parses `<checkpoint_dir>/metadata.pb`; NotFound when it is
// missing.
absl::StatusOr<CheckpointMetadata> ReadMetadata(
    const std::string& checkpoint_dir);

// Number of CRC blocks of a `length`-byte range.
inline uint64_t NumBlocks(uint64_t length, uint64_t block_bytes) {
  return length / block_bytes + (length % block_bytes != 0 ? 1 : 0);
}

// The combination of `block_crc32c` (blocks of `block_bytes`, the last one
// short for a `length`-byte range): the CRC-32C of the whole range.
uint32_t CombineBlockCrcs(const std::vector<uint32_t>& block_crc32c,
                          uint64_t block_bytes, uint64_t length);

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_METADATA_H_
