// Metadata file encoding and validation; see metadata.h.
#include "checkpoint/metadata.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/boxes.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.pb.h"
#include "core/status.h"
#include "formats/file_util.h"

namespace fsdpp {
namespace {

namespace pb = checkpoint_proto;

// Bounds on counts, far above any real checkpoint, that keep a hostile file
// from making validation slow.
constexpr int64_t kMaxFiles = int64_t{1} << 24;
constexpr int kMaxWorldSize = 1 << 24;

// "'w'" with non-printable bytes escaped.
std::string Quote(absl::string_view key) {
  return absl::StrCat("'", absl::CHexEscape(key), "'");
}

absl::Status KeyError(absl::string_view key, absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("key ", Quote(key), ": ", problem));
}

absl::Status ValidateFileName(absl::string_view file) {
  if (file.empty() || file == "." || file == ".." ||
      file.find('/') != absl::string_view::npos ||
      file.find('\0') != absl::string_view::npos || file.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad data file name ", Quote(file),
                     " (must be a plain name inside the checkpoint)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateChunk(const CheckpointMetadata& metadata,
                           const EntryMetadata& entry,
                           const ChunkMetadata& chunk) {
  const std::string where = absl::StrCat("chunk ", BoxToString(chunk.box));
  if (chunk.file < 0 ||
      static_cast<uint64_t>(chunk.file) >= metadata.files.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " names file #", chunk.file, " of ", metadata.files.size()));
  }
  if (IsEmptyBox(chunk.box)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is empty"));
  }
  // The box lies inside the shape (CheckTiling ran first), so this fits.
  const uint64_t expected =
      static_cast<uint64_t>(NumElements(chunk.box.shape)) *
      DTypeSize(entry.dtype);
  if (chunk.length != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has ", chunk.length, " bytes, expected ",
                     expected, " for ", DTypeName(entry.dtype)));
  }
  if (chunk.byte_offset > static_cast<uint64_t>(kMaxCheckpointBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " starts at byte ", chunk.byte_offset, " (beyond 2^62)"));
  }
  const uint64_t blocks = NumBlocks(chunk.length, metadata.block_bytes);
  if (chunk.block_crc32c.size() != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has ", chunk.block_crc32c.size(),
                     " block checksums, expected ", blocks));
  }
  const uint32_t combined =
      CombineBlockCrcs(chunk.block_crc32c, metadata.block_bytes, chunk.length);
  if (combined != chunk.crc32c) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " checksum 0x", absl::Hex(chunk.crc32c, absl::kZeroPad8),
        " disagrees with its block checksums (0x",
        absl::Hex(combined, absl::kZeroPad8), ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEntry(const CheckpointMetadata& metadata,
                           const std::string& key, const EntryMetadata& entry) {
  if (key.empty()) return KeyError(key, "empty key");
  if (entry.kind == EntryKind::kBytes &&
      (entry.dtype != DType::kU8 || entry.shape.size() != 1)) {
    return KeyError(
        key, absl::StrCat("a byte value must be u8[length], not ",
                          DTypeName(entry.dtype), ShapeToString(entry.shape)));
  }
  absl::Status status = CheckShape(entry.shape, DTypeSize(entry.dtype));
  if (!status.ok()) return KeyError(key, status.message());
  std::vector<Box> boxes;
  boxes.reserve(entry.chunks.size());
  for (const ChunkMetadata& chunk : entry.chunks) boxes.push_back(chunk.box);
  status = CheckTiling(entry.shape, boxes);
  if (!status.ok()) return KeyError(key, status.message());
  for (const ChunkMetadata& chunk : entry.chunks) {
    status = ValidateChunk(metadata, entry, chunk);
    if (!status.ok()) return KeyError(key, status.message());
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> DTypeFromName(absl::string_view key,
                                    const std::string& name) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32,
                  DType::kI64, DType::kU8}) {
    if (name == DTypeName(d)) return d;
  }
  return KeyError(key, absl::StrCat("unknown dtype ", Quote(name)));
}

}  // namespace

const char* EntryKindName(EntryKind kind) {
  return kind == EntryKind::kBytes ? "bytes" : "tensor";
}

uint64_t CheckpointMetadata::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& [key, entry] : entries) {
    for (const ChunkMetadata& chunk : entry.chunks) total += chunk.length;
  }
  return total;
}

uint32_t CombineBlockCrcs(const std::vector<uint32_t>& block_crc32c,
                          uint64_t block_bytes, uint64_t length) {
  uint32_t crc = 0;
  uint64_t done = 0;
  for (uint32_t block : block_crc32c) {
    const uint64_t n = std::min(block_bytes, length - std::min(length, done));
    crc = Crc32cCombine(crc, block, n);
    done += n;
  }
  return crc;
}

absl::Status ValidateMetadata(const CheckpointMetadata& metadata) {
  if (metadata.world_size < 1 || metadata.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad world size ", metadata.world_size));
  }
  if (metadata.block_bytes < 8 || metadata.block_bytes > (uint64_t{1} << 30) ||
      (metadata.block_bytes & (metadata.block_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad block size ", metadata.block_bytes,
                     " (must be a power of two in [8, 2^30])"));
  }
  if (static_cast<int64_t>(metadata.files.size()) > kMaxFiles) {
    return absl::InvalidArgumentError(
        absl::StrCat("too many data files (", metadata.files.size(), ")"));
  }
  std::set<absl::string_view> names;
  for (const std::string& file : metadata.files) {
    FSDPP_RETURN_IF_ERROR(ValidateFileName(file));
    if (!names.insert(file).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("data file ", Quote(file), " is listed twice"));
    }
  }
  for (const auto& [key, entry] : metadata.entries) {
    FSDPP_RETURN_IF_ERROR(ValidateEntry(metadata, key, entry));
  }
  return absl::OkStatus();
}

std::string SerializeMetadata(const CheckpointMetadata& metadata) {
  pb::Metadata body;
  body.set_step(metadata.step);
  body.set_world_size(static_cast<uint32_t>(metadata.world_size));
  body.set_block_bytes(metadata.block_bytes);
  for (const std::string& file : metadata.files) body.add_files(file);
  for (const auto& [key, entry] : metadata.entries) {
    pb::Entry* e = body.add_entries();
    e->set_key(key);
    e->set_kind(entry.kind == EntryKind::kBytes ? pb::Entry::BYTES
                                                : pb::Entry::TENSOR);
    e->set_dtype(DTypeName(entry.dtype));
    for (int64_t d : entry.shape) e->add_shape(d);
    for (const ChunkMetadata& chunk : entry.chunks) {
      pb::Chunk* c = e->add_chunks();
      for (int64_t o : chunk.box.offset) c->add_offsets(o);
      for (int64_t s : chunk.box.shape) c->add_sizes(s);
      c->set_file(static_cast<uint32_t>(chunk.file));
      c->set_byte_offset(chunk.byte_offset);
      c->set_length(chunk.length);
      c->set_crc32c(chunk.crc32c);
      for (uint32_t b : chunk.block_crc32c) c->add_block_crc32c(b);
    }
  }
  pb::MetadataFile file;
  file.set_magic(kCheckpointMagic);
  file.set_version(kCheckpointFormatVersion);
  std::string serialized_body;
  body.SerializeToString(&serialized_body);
  file.set_body_crc32c(Crc32c(serialized_body));
  file.set_body(std::move(serialized_body));
  std::string out;
  file.SerializeToString(&out);
  return out;
}

absl::StatusOr<CheckpointMetadata> ParseMetadata(absl::string_view bytes,
                                                 absl::string_view name) {
  auto error = [&](absl::StatusCode code, absl::string_view problem) {
    return absl::Status(code, absl::StrCat(name, ": ", problem));
  };
  pb::MetadataFile file;
  if (bytes.size() > static_cast<size_t>(INT32_MAX) ||
      !file.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return error(absl::StatusCode::kDataLoss,
                 absl::StrCat("not a readable metadata file (", bytes.size(),
                              " bytes; truncated or corrupt)"));
  }
  if (file.magic() != kCheckpointMagic) {
    return error(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("not an fsdpp checkpoint metadata file (magic ",
                              Quote(file.magic()), ")"));
  }
  if (file.version() != kCheckpointFormatVersion) {
    return error(absl::StatusCode::kFailedPrecondition,
                 absl::StrCat("unsupported checkpoint format version ",
                              file.version(), " (this build reads version ",
                              kCheckpointFormatVersion, ")"));
  }
  const uint32_t crc = Crc32c(file.body());
  if (crc != file.body_crc32c()) {
    return error(absl::StatusCode::kDataLoss,
                 absl::StrCat("metadata checksum mismatch (stored 0x",
                              absl::Hex(file.body_crc32c(), absl::kZeroPad8),
                              ", computed 0x", absl::Hex(crc, absl::kZeroPad8),
                              "): the file is corrupt"));
  }
  pb::Metadata body;
  if (!body.ParseFromString(file.body())) {
    return error(absl::StatusCode::kInvalidArgument,
                 "the metadata body does not decode");
  }
  CheckpointMetadata metadata;
  metadata.step = body.step();
  if (body.world_size() < 1 ||
      body.world_size() > static_cast<uint32_t>(kMaxWorldSize)) {
    return error(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("bad world size ", body.world_size()));
  }
  metadata.world_size = static_cast<int>(body.world_size());
  metadata.block_bytes = body.block_bytes();
  metadata.files.assign(body.files().begin(), body.files().end());
  for (const pb::Entry& e : body.entries()) {
    EntryMetadata entry;
    if (e.kind() != pb::Entry::TENSOR && e.kind() != pb::Entry::BYTES) {
      return error(
          absl::StatusCode::kInvalidArgument,
          KeyError(e.key(), absl::StrCat("unknown kind ", e.kind())).message());
    }
    entry.kind =
        e.kind() == pb::Entry::BYTES ? EntryKind::kBytes : EntryKind::kTensor;
    absl::StatusOr<DType> dtype = DTypeFromName(e.key(), e.dtype());
    if (!dtype.ok()) {
      return error(absl::StatusCode::kInvalidArgument,
                   dtype.status().message());
    }
    entry.dtype = *dtype;
    entry.shape.assign(e.shape().begin(), e.shape().end());
    entry.chunks.reserve(e.chunks_size());
    for (const pb::Chunk& c : e.chunks()) {
      ChunkMetadata chunk;
      chunk.box.offset.assign(c.offsets().begin(), c.offsets().end());
      chunk.box.shape.assign(c.sizes().begin(), c.sizes().end());
      chunk.file = c.file();
      chunk.byte_offset = c.byte_offset();
      chunk.length = c.length();
      chunk.crc32c = c.crc32c();
      chunk.block_crc32c.assign(c.block_crc32c().begin(),
                                c.block_crc32c().end());
      entry.chunks.push_back(std::move(chunk));
    }
    if (!metadata.entries.emplace(e.key(), std::move(entry)).second) {
      return error(absl::StatusCode::kInvalidArgument,
                   KeyError(e.key(), "listed twice").message());
    }
  }
  absl::Status status = ValidateMetadata(metadata);
  if (!status.ok()) {
    return error(absl::StatusCode::kInvalidArgument, status.message());
  }
  return metadata;
}

absl::StatusOr<CheckpointMetadata> ReadMetadata(
    const std::string& checkpoint_dir) {
  const std::string path = absl::StrCat(checkpoint_dir, "/", kMetadataFileName);
  FSDPP_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  return ParseMetadata(bytes, path);
}

}  // namespace fsdpp
