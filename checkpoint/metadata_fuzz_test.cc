// Runs the metadata fuzz entry point (metadata_fuzz.cc) over a deterministic
// corpus of 20000 mutations of real metadata files (saved by one rank and by
// a 2x2 mesh with 2-D layouts): byte flips, truncations, insertions and
// deletions of whole files, and field-level edits of the decoded body
// (shapes, offsets, sizes, lengths, file indices and names, checksums, block
// counts, dtypes, kinds, duplicate keys, block size, world size) re-wrapped
// with a correct checksum so they reach the semantic checks. No input may
// crash or trip the entry point's invariant CHECKs.
#include <cstdint>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.h"
#include "checkpoint/metadata.pb.h"
#include "checkpoint/test_checkpoints.h"
#include "comm/store.h"
#include "formats/file_util.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fsdpp {
namespace {

namespace pb = checkpoint_proto;
using testing_util::BitPattern;
using testing_util::FreshDir;
using testing_util::MakeDTensor;

constexpr int kInputs = 20000;

// Metadata files of real checkpoints.
std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  {
    const std::string root = FreshDir("fuzz_seed_single");
    StateDict state;
    CHECK_OK(state.AddTensor("w", BitPattern({7, 5}, DType::kF32, 1)));
    CHECK_OK(state.AddTensor("b", BitPattern({3}, DType::kBF16, 2)));
    CHECK_OK(state.AddTensor("s", BitPattern({}, DType::kI64, 3)));
    CHECK_OK(state.AddTensor("e", BitPattern({0, 4}, DType::kF16, 4)));
    CHECK_OK(state.AddBytes("step", "12"));
    CHECK_OK(state.AddBytes("empty", ""));
    SaveOptions options;
    options.block_bytes = 32;
    CHECK_OK(Save(state, root, 1, options).status());
    seeds.push_back(
        *ReadFileToString(absl::StrCat(root, "/step-1/", kMetadataFileName)));
  }
  {
    const std::string root = FreshDir("fuzz_seed_mesh");
    InMemoryStore store;
    const Placement s0 = Placement::Shard(0), s1 = Placement::Shard(1);
    testing_util::RunOnMesh(
        {{"replicate", 2}, {"shard", 2}}, [&](int, DeviceMesh& mesh) {
          StateDict state;
          CHECK_OK(state.AddDTensor(
              "tp", MakeDTensor(BitPattern({5, 7}, DType::kF32, 5), &mesh,
                                {s0, s1})));
          CHECK_OK(state.AddDTensor(
              "hsdp", MakeDTensor(BitPattern({9, 2}, DType::kI32, 6), &mesh,
                                  {Placement::Replicate(), s0})));
          CHECK_OK(state.AddBytes("cfg", "{}"));
          SaveOptions options;
          options.mesh = &mesh;
          options.store = &store;
          options.block_bytes = 8;
          CHECK_OK(Save(state, root, 2, options).status());
        });
    seeds.push_back(
        *ReadFileToString(absl::StrCat(root, "/step-2/", kMetadataFileName)));
  }
  return seeds;
}

// One random edit of a whole file.
void MutateBytes(std::string* file, std::mt19937_64* rng) {
  auto pick = [&](uint64_t n) { return n == 0 ? 0 : (*rng)() % n; };
  switch ((*rng)() % 4) {
    case 0:
      if (!file->empty())
        (*file)[pick(file->size())] ^= static_cast<char>(1 + pick(255));
      break;
    case 1:
      file->resize(pick(file->size() + 1));
      break;
    case 2:
      file->insert(pick(file->size() + 1),
                   std::string(1 + pick(8), static_cast<char>((*rng)())));
      break;
    case 3:
      if (!file->empty()) file->erase(pick(file->size()), 1 + pick(16));
      break;
  }
}

// a + b wrapped to 64 bits (two's complement) without signed overflow.
int64_t WrappingAdd(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) +
                              static_cast<uint64_t>(b));
}

// A value near the interesting edges.
int64_t Edge(std::mt19937_64* rng, int64_t current) {
  const int64_t choices[] = {0,
                             -1,
                             1,
                             WrappingAdd(current, 1),
                             WrappingAdd(current, -1),
                             WrappingAdd(current, current),
                             int64_t{1} << 31,
                             int64_t{1} << 62,
                             INT64_MAX,
                             INT64_MIN,
                             static_cast<int64_t>((*rng)() % 64)};
  return choices[(*rng)() % (sizeof(choices) / sizeof(choices[0]))];
}

// One random field edit of a decoded body.
void MutateBody(pb::Metadata* body, std::mt19937_64* rng) {
  auto pick = [&](int n) {
    return n <= 0 ? 0 : static_cast<int>((*rng)() % n);
  };
  if (body->entries_size() == 0) return;
  pb::Entry* entry = body->mutable_entries(pick(body->entries_size()));
  pb::Chunk* chunk = entry->chunks_size() > 0
                         ? entry->mutable_chunks(pick(entry->chunks_size()))
                         : nullptr;
  switch ((*rng)() % 16) {
    case 0:
      if (entry->shape_size() > 0) {
        const int d = pick(entry->shape_size());
        entry->set_shape(d, Edge(rng, entry->shape(d)));
      }
      break;
    case 1:
      if (chunk != nullptr && chunk->offsets_size() > 0) {
        const int d = pick(chunk->offsets_size());
        chunk->set_offsets(d, Edge(rng, chunk->offsets(d)));
      }
      break;
    case 2:
      if (chunk != nullptr && chunk->sizes_size() > 0) {
        const int d = pick(chunk->sizes_size());
        chunk->set_sizes(d, Edge(rng, chunk->sizes(d)));
      }
      break;
    case 3:
      if (chunk != nullptr) chunk->set_length(Edge(rng, chunk->length()));
      break;
    case 4:
      if (chunk != nullptr)
        chunk->set_byte_offset(Edge(rng, chunk->byte_offset()));
      break;
    case 5:
      if (chunk != nullptr)
        chunk->set_file(static_cast<uint32_t>((*rng)() % 4));
      break;
    case 6:
      if (chunk != nullptr) chunk->set_crc32c(static_cast<uint32_t>((*rng)()));
      break;
    case 7:
      if (chunk != nullptr) {
        if ((*rng)() % 2 == 0) {
          chunk->add_block_crc32c(static_cast<uint32_t>((*rng)()));
        } else if (chunk->block_crc32c_size() > 0) {
          chunk->mutable_block_crc32c()->RemoveLast();
        }
      }
      break;
    case 8: {
      const char* dtypes[] = {"f32", "bf16", "u8", "i64", "f64", ""};
      entry->set_dtype(dtypes[pick(6)]);
      break;
    }
    case 9:
      entry->set_kind(static_cast<pb::Entry::Kind>(pick(3)));
      break;
    case 10:  // Duplicate an entry (same key).
      *body->add_entries() = *entry;
      break;
    case 11: {
      const char* names[] = {"", ".", "..", "../escape", "a/b", "rank-0.data"};
      if (body->files_size() > 0)
        body->set_files(pick(body->files_size()), names[pick(6)]);
      break;
    }
    case 12:
      body->set_block_bytes(
          static_cast<uint64_t>(Edge(rng, body->block_bytes())));
      break;
    case 13:
      body->set_world_size(
          static_cast<uint32_t>(Edge(rng, body->world_size())));
      break;
    case 14:  // Drop a chunk (a gap) or duplicate one (an overlap).
      if (chunk != nullptr) {
        if ((*rng)() % 2 == 0) {
          entry->mutable_chunks()->RemoveLast();
        } else {
          *entry->add_chunks() = *chunk;
        }
      }
      break;
    case 15:
      if (chunk != nullptr) {
        chunk->add_offsets(0);
      } else {
        entry->add_shape(1);
      }
      break;
  }
}

int Feed(const std::string& input, bool body) {
  std::string bytes(1, body ? '\x01' : '\x00');
  bytes += input;
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                                bytes.size());
}

TEST(MetadataFuzzTest, MutatedMetadataParsesOrFailsCleanly) {
  const std::vector<std::string> seeds = Seeds();
  std::vector<std::string> bodies;
  for (const std::string& seed : seeds) {
    ASSERT_TRUE(ParseMetadata(seed, "seed").ok());
    ASSERT_EQ(Feed(seed, false), 0);
    pb::MetadataFile file;
    ASSERT_TRUE(file.ParseFromString(seed));
    bodies.push_back(file.body());
    ASSERT_EQ(Feed(file.body(), true), 0);
  }
  std::mt19937_64 rng(20240611);
  std::map<absl::StatusCode, int> outcomes;
  for (int i = 0; i < kInputs; ++i) {
    const size_t which = rng() % seeds.size();
    std::string input;
    bool as_body = false;
    if (rng() % 3 == 0) {
      input = seeds[which];
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < edits; ++e) MutateBytes(&input, &rng);
    } else {
      pb::Metadata body;
      ASSERT_TRUE(body.ParseFromString(bodies[which]));
      const int edits = 1 + static_cast<int>(rng() % 2);
      for (int e = 0; e < edits; ++e) MutateBody(&body, &rng);
      input = body.SerializeAsString();
      as_body = true;
    }
    ASSERT_EQ(Feed(input, as_body), 0);
    if (as_body) {
      pb::MetadataFile file;
      file.set_magic(kCheckpointMagic);
      file.set_version(kCheckpointFormatVersion);
      file.set_body_crc32c(Crc32c(input));
      file.set_body(input);
      input = file.SerializeAsString();
    }
    ++outcomes[ParseMetadata(input, "x").status().code()];
  }
  // Both outcomes and every error kind are reached.
  EXPECT_GT(outcomes[absl::StatusCode::kOk], 500);
  EXPECT_GT(outcomes[absl::StatusCode::kInvalidArgument], 5000);
  EXPECT_GT(outcomes[absl::StatusCode::kDataLoss], 500);
  for (const auto& [code, count] : outcomes) {
    std::cout << absl::StatusCodeToString(code) << ": " << count << "\n";
  }
}

}  // namespace
}  // namespace fsdpp
