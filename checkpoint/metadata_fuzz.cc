// libFuzzer-style entry point for the checkpoint metadata parser.
//
// The first input byte picks the mode: even, the rest is a whole metadata.pb
// file; odd, the rest is a metadata *body*, wrapped here in a valid envelope
// (magic, current version, correct CRC), so that mutations reach the
// semantic validation instead of stopping at the body checksum. Parse errors
// must be DataLoss, InvalidArgument or FailedPrecondition and name the file;
// a parsed result must validate, tile every tensor with in-bounds chunks,
// and survive a serialize / parse round trip unchanged. Any violation aborts.
// Built with g++ into metadata_fuzz_test; the same file links into a real
// libFuzzer binary under clang -fsanitize=fuzzer (see README.md).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "checkpoint/boxes.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.h"
#include "checkpoint/metadata.pb.h"
#include "core/logging.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdpp;  // NOLINT: a C entry point.
  if (size == 0) return 0;
  std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    checkpoint_proto::MetadataFile file;
    file.set_magic(kCheckpointMagic);
    file.set_version(kCheckpointFormatVersion);
    file.set_body_crc32c(Crc32c(input));
    file.set_body(input);
    input = file.SerializeAsString();
  }
  absl::StatusOr<CheckpointMetadata> parsed = ParseMetadata(input, "fuzz");
  if (!parsed.ok()) {
    const absl::StatusCode code = parsed.status().code();
    CHECK(code == absl::StatusCode::kDataLoss ||
          code == absl::StatusCode::kInvalidArgument ||
          code == absl::StatusCode::kFailedPrecondition)
        << parsed.status();
    CHECK(absl::StartsWith(parsed.status().message(), "fuzz: "))
        << parsed.status();
    return 0;
  }
  CHECK_OK(ValidateMetadata(*parsed));
  uint64_t total = 0;
  for (const auto& [key, entry] : parsed->entries) {
    CHECK(!key.empty());
    std::vector<Box> boxes;
    for (const ChunkMetadata& chunk : entry.chunks) {
      CHECK_GE(chunk.file, 0);
      CHECK_LT(static_cast<size_t>(chunk.file), parsed->files.size());
      CHECK_EQ(chunk.block_crc32c.size(),
               NumBlocks(chunk.length, parsed->block_bytes));
      CHECK_EQ(chunk.length,
               static_cast<uint64_t>(NumElements(chunk.box.shape)) *
                   DTypeSize(entry.dtype));
      total += chunk.length;
      boxes.push_back(chunk.box);
    }
    CHECK_OK(CheckTiling(entry.shape, boxes));
    CHECK_EQ(NumElements(entry.shape) == 0, entry.chunks.empty());
  }
  CHECK_EQ(total, parsed->TotalBytes());
  const std::string again = SerializeMetadata(*parsed);
  absl::StatusOr<CheckpointMetadata> reparsed = ParseMetadata(again, "again");
  CHECK_OK(reparsed.status());
  CHECK(SerializeMetadata(*reparsed) == again);
  return 0;
}
