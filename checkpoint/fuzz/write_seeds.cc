// Writes the seed corpora of the libFuzzer runs (run_fuzzers.sh):
//
//   write_seeds METADATA_DIR SAFETENSORS_DIR
//
// The same kinds of seeds the deterministic fuzz tests start from, written by
// the production writers instead of being checked in. Metadata: the files of
// a one-rank checkpoint and of a 2x2-mesh checkpoint (the layouts
// metadata_fuzz_test saves), each as a whole file ("\x00" prefix) and as a
// bare body ("\x01" prefix, which metadata_fuzz.cc wraps in a valid
// envelope). Built with SerializeMetadata rather than Save so that no
// process group or mesh is linked in; chunk CRCs are those of real bytes.
// Safetensors: the valid files of safetensors_fuzz_test (every dtype, odd
// shapes, __metadata__, an empty file) via WriteSafetensors, plus its
// foreign-dtype file. Every seed is checked to parse before it is written.
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.h"
#include "checkpoint/metadata.pb.h"
#include "core/logging.h"
#include "formats/safetensors/safetensors.h"
#include "formats/safetensors/safetensors_seeds.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  CHECK(out.good()) << path;
}

// Lays out chunks in data files the way Save does: 64-byte aligned, with the
// CRC-32C of every block and their combination.
class Layout {
 public:
  explicit Layout(CheckpointMetadata* metadata) : metadata_(metadata) {}

  // Adds the box `offset`+`shape` of entry `key`, stored in file `file`.
  void AddChunk(const std::string& key, int64_t file, Shape offset,
                Shape shape) {
    EntryMetadata& entry = metadata_->entries.at(key);
    ChunkMetadata chunk;
    chunk.box = Box{std::move(offset), std::move(shape)};
    chunk.file = file;
    chunk.length = static_cast<uint64_t>(NumElements(chunk.box.shape)) *
                   DTypeSize(entry.dtype);
    uint64_t& end = ends_[file];
    chunk.byte_offset = (end + 63) / 64 * 64;
    end = chunk.byte_offset + chunk.length;
    std::string bytes(chunk.length, '\0');
    for (char& c : bytes) c = static_cast<char>(rng_());
    const uint64_t block = metadata_->block_bytes;
    for (uint64_t at = 0; at < chunk.length; at += block) {
      chunk.block_crc32c.push_back(
          Crc32c(absl::string_view(bytes).substr(at, block)));
    }
    chunk.crc32c = CombineBlockCrcs(chunk.block_crc32c, block, chunk.length);
    entry.chunks.push_back(std::move(chunk));
  }

 private:
  CheckpointMetadata* metadata_;
  std::map<int64_t, uint64_t> ends_;
  std::mt19937_64 rng_{7};
};

void AddEntry(CheckpointMetadata* metadata, const std::string& key,
              EntryKind kind, DType dtype, Shape shape) {
  EntryMetadata& entry = metadata->entries[key];
  entry.kind = kind;
  entry.dtype = dtype;
  entry.shape = std::move(shape);
}

// Saved by one rank (metadata_fuzz_test's "fuzz_seed_single").
CheckpointMetadata SingleRank() {
  CheckpointMetadata m;
  m.step = 1;
  m.world_size = 1;
  m.block_bytes = 32;
  m.files = {"rank-0.data"};
  AddEntry(&m, "w", EntryKind::kTensor, DType::kF32, {7, 5});
  AddEntry(&m, "b", EntryKind::kTensor, DType::kBF16, {3});
  AddEntry(&m, "s", EntryKind::kTensor, DType::kI64, {});
  AddEntry(&m, "e", EntryKind::kTensor, DType::kF16, {0, 4});
  AddEntry(&m, "step", EntryKind::kBytes, DType::kU8, {2});
  AddEntry(&m, "empty", EntryKind::kBytes, DType::kU8, {0});
  Layout layout(&m);
  layout.AddChunk("b", 0, {0}, {3});
  layout.AddChunk("s", 0, {}, {});
  layout.AddChunk("step", 0, {0}, {2});
  layout.AddChunk("w", 0, {0, 0}, {7, 5});
  return m;
}

// Saved on a ("replicate" 2, "shard" 2) mesh (metadata_fuzz_test's
// "fuzz_seed_mesh"): "tp" [5, 7] sharded on both dims, "hsdp" [9, 2]
// replicated x sharded (each box written once), bytes on rank 0.
CheckpointMetadata Mesh2x2() {
  CheckpointMetadata m;
  m.step = 2;
  m.world_size = 4;
  m.block_bytes = 8;
  m.files = {"rank-0.data", "rank-1.data", "rank-2.data", "rank-3.data"};
  AddEntry(&m, "tp", EntryKind::kTensor, DType::kF32, {5, 7});
  AddEntry(&m, "hsdp", EntryKind::kTensor, DType::kI32, {9, 2});
  AddEntry(&m, "cfg", EntryKind::kBytes, DType::kU8, {2});
  Layout layout(&m);
  layout.AddChunk("cfg", 0, {0}, {2});
  layout.AddChunk("hsdp", 0, {0, 0}, {5, 2});
  layout.AddChunk("hsdp", 1, {5, 0}, {4, 2});
  const int64_t rows[] = {0, 3, 5}, cols[] = {0, 4, 7};
  for (int r = 0; r < 4; ++r) {
    const int i = r / 2, j = r % 2;
    layout.AddChunk("tp", r, {rows[i], cols[j]},
                    {rows[i + 1] - rows[i], cols[j + 1] - cols[j]});
  }
  return m;
}

void WriteMetadataSeeds(const std::string& dir) {
  const std::pair<const char*, CheckpointMetadata> seeds[] = {
      {"single", SingleRank()}, {"mesh", Mesh2x2()}};
  for (const auto& [name, metadata] : seeds) {
    const std::string file = SerializeMetadata(metadata);
    CHECK_OK(ParseMetadata(file, name).status());
    checkpoint_proto::MetadataFile envelope;
    CHECK(envelope.ParseFromString(file)) << name;
    WriteFile(absl::StrCat(dir, "/", name, "-file"),
              std::string(1, '\0') + file);
    WriteFile(absl::StrCat(dir, "/", name, "-body"),
              std::string(1, '\1') + envelope.body());
  }
}

// formats/safetensors/safetensors_seeds.h, each checked to parse.
void WriteSafetensorsSeeds(const std::string& dir) {
  for (const auto& [name, bytes] : SafetensorsSeeds(dir)) {
    CHECK_OK(SafetensorsFile::FromBuffer(bytes).status()) << name;
    WriteFile(absl::StrCat(dir, "/", name), bytes);
  }
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: write_seeds METADATA_DIR SAFETENSORS_DIR\n";
    return 2;
  }
  fsdpp::WriteMetadataSeeds(argv[1]);
  fsdpp::WriteSafetensorsSeeds(argv[2]);
  return 0;
}
