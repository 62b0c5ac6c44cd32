// Metadata encoding and validation: a round trip through the file format,
// and one test per inconsistency the parser must name (overlapping, missing
// and out-of-bounds chunks, wrong lengths, block checksum counts and values,
// unsafe or unknown files, duplicate keys, unknown dtypes, bad byte entries,
// bad block sizes), plus the box helpers CheckTiling relies on.
#include "checkpoint/metadata.h"

#include <string>
#include <vector>

#include "checkpoint/boxes.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;

// A chunk of `box` (f32) at `offset` of file 0 whose checksums match
// `length` bytes of a fixed pattern.
ChunkMetadata MakeChunk(Box box, uint64_t offset, uint64_t block_bytes,
                        size_t element_size = 4) {
  ChunkMetadata chunk;
  chunk.box = std::move(box);
  chunk.byte_offset = offset;
  chunk.length = NumElements(chunk.box.shape) * element_size;
  std::string data(chunk.length, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  for (uint64_t at = 0; at < chunk.length; at += block_bytes) {
    chunk.block_crc32c.push_back(
        Crc32c(data.data() + at, std::min(block_bytes, chunk.length - at)));
  }
  chunk.crc32c = Crc32c(data);
  return chunk;
}

// "w": f32[7, 5] in two row chunks; "step": a byte value.
CheckpointMetadata Valid() {
  CheckpointMetadata m;
  m.step = 42;
  m.world_size = 2;
  m.block_bytes = 32;
  m.files = {"rank-0.data", "rank-1.data"};
  EntryMetadata& w = m.entries["w"];
  w.dtype = DType::kF32;
  w.shape = {7, 5};
  w.chunks.push_back(MakeChunk({{0, 0}, {4, 5}}, 0, 32));
  w.chunks.push_back(MakeChunk({{4, 0}, {3, 5}}, 0, 32));
  w.chunks[1].file = 1;
  EntryMetadata& step = m.entries["step"];
  step.kind = EntryKind::kBytes;
  step.dtype = DType::kU8;
  step.shape = {2};
  step.chunks.push_back(MakeChunk({{0}, {2}}, 80, 32, 1));
  return m;
}

absl::Status Parse(const CheckpointMetadata& m) {
  return ParseMetadata(SerializeMetadata(m), "meta.pb").status();
}

void ExpectInvalid(const CheckpointMetadata& m, const std::string& part) {
  const absl::Status status = Parse(m);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("meta.pb: "));
  EXPECT_THAT(status.message(), HasSubstr(part));
}

TEST(MetadataTest, RoundTrip) {
  const CheckpointMetadata m = Valid();
  absl::StatusOr<CheckpointMetadata> parsed =
      ParseMetadata(SerializeMetadata(m), "meta.pb");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->step, 42);
  EXPECT_EQ(parsed->world_size, 2);
  EXPECT_EQ(parsed->files, m.files);
  EXPECT_EQ(parsed->TotalBytes(), 7u * 5 * 4 + 2);
  const EntryMetadata& w = parsed->entries.at("w");
  EXPECT_EQ(w.shape, (Shape{7, 5}));
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[1].box.offset, (Shape{4, 0}));
  EXPECT_EQ(w.chunks[1].file, 1);
  EXPECT_EQ(w.chunks[1].crc32c, m.entries.at("w").chunks[1].crc32c);
  EXPECT_EQ(w.chunks[0].block_crc32c.size(), 3u);  // 80 bytes / 32.
  EXPECT_EQ(parsed->entries.at("step").kind, EntryKind::kBytes);
  EXPECT_EQ(SerializeMetadata(*parsed), SerializeMetadata(m));
}

TEST(MetadataTest, ChunksMustTileTheShape) {
  CheckpointMetadata m = Valid();
  m.entries["w"].chunks[1] = MakeChunk({{3, 0}, {4, 5}}, 0, 32);
  m.entries["w"].chunks[1].file = 1;
  ExpectInvalid(m, "key 'w': chunk [0, 0]+[4, 5] overlaps chunk [3, 0]+[4, 5]");

  m = Valid();
  m.entries["w"].chunks.pop_back();
  ExpectInvalid(m, "key 'w': chunks cover 20 of the 35 elements");

  m = Valid();
  m.entries["w"].chunks[1] = MakeChunk({{4, 1}, {3, 5}}, 0, 32);
  ExpectInvalid(m, "chunk [4, 1]+[3, 5] lies outside the shape [7, 5]");

  m = Valid();
  m.entries["w"].chunks[1].box = Box{{4}, {3}};
  ExpectInvalid(m, "has 1 offsets and 1 sizes for a tensor of shape [7, 5]");
}

TEST(MetadataTest, ChunkBytesAndChecksumsMustAgree) {
  CheckpointMetadata m = Valid();
  m.entries["w"].chunks[0].length = 81;
  ExpectInvalid(m, "has 81 bytes, expected 80 for f32");

  m = Valid();
  m.entries["w"].chunks[0].block_crc32c.pop_back();
  ExpectInvalid(m, "has 2 block checksums, expected 3");

  m = Valid();
  m.entries["w"].chunks[0].crc32c ^= 1;
  ExpectInvalid(m, "disagrees with its block checksums");

  m = Valid();
  m.entries["w"].chunks[0].byte_offset = uint64_t{1} << 63;
  ExpectInvalid(m, "beyond 2^62");
}

TEST(MetadataTest, FilesMustBePlainAndKnown) {
  for (const char* name : {"", ".", "..", "../x", "a/b"}) {
    CheckpointMetadata m = Valid();
    m.files[0] = name;
    ExpectInvalid(m, "bad data file name");
  }
  CheckpointMetadata m = Valid();
  m.files[1] = m.files[0];
  ExpectInvalid(m, "is listed twice");
  m = Valid();
  m.entries["w"].chunks[1].file = 2;
  ExpectInvalid(m, "names file #2 of 2");
}

TEST(MetadataTest, EntriesAndHeaderFieldsAreChecked) {
  CheckpointMetadata m = Valid();
  m.entries["step"].dtype = DType::kI32;
  m.entries["step"].chunks[0] = MakeChunk({{0}, {2}}, 80, 32);
  ExpectInvalid(m, "a byte value must be u8[length]");

  m = Valid();
  m.entries["w"].shape = {7, -5};
  ExpectInvalid(m, "negative dim");

  m = Valid();
  m.block_bytes = 48;
  ExpectInvalid(m, "bad block size 48");

  // Fields the C++ struct cannot express: edit the wire form.
  checkpoint_proto::MetadataFile file;
  ASSERT_TRUE(file.ParseFromString(SerializeMetadata(Valid())));
  checkpoint_proto::Metadata body;
  ASSERT_TRUE(body.ParseFromString(file.body()));
  auto reparse = [&](const checkpoint_proto::Metadata& edited) {
    checkpoint_proto::MetadataFile f = file;
    f.set_body(edited.SerializeAsString());
    f.set_body_crc32c(Crc32c(f.body()));
    return ParseMetadata(f.SerializeAsString(), "meta.pb").status();
  };
  checkpoint_proto::Metadata duplicate = body;
  *duplicate.add_entries() = body.entries(0);
  EXPECT_THAT(reparse(duplicate).message(), HasSubstr("listed twice"));
  checkpoint_proto::Metadata dtype = body;
  dtype.mutable_entries(1)->set_dtype("f64");
  EXPECT_THAT(reparse(dtype).message(), HasSubstr("unknown dtype 'f64'"));
  checkpoint_proto::Metadata world = body;
  world.set_world_size(0);
  EXPECT_THAT(reparse(world).message(), HasSubstr("bad world size 0"));
  // A body that is not a Metadata message at all.
  checkpoint_proto::MetadataFile garbage = file;
  garbage.set_body("\xff\xff\xff");
  garbage.set_body_crc32c(Crc32c(garbage.body()));
  EXPECT_EQ(
      ParseMetadata(garbage.SerializeAsString(), "meta.pb").status().code(),
      absl::StatusCode::kInvalidArgument);
  // The wrong magic.
  checkpoint_proto::MetadataFile foreign = file;
  foreign.set_magic("something-else");
  EXPECT_THAT(
      ParseMetadata(foreign.SerializeAsString(), "meta.pb").status().message(),
      HasSubstr("not an fsdpp checkpoint metadata file"));
}

TEST(BoxesTest, TilingChecksEveryLayout) {
  // Column shards (the sweep runs along dim 1) and a 3x3 grid.
  std::vector<Box> columns;
  for (int i = 0; i < 100; ++i) columns.push_back(Box{{0, i}, {8, 1}});
  EXPECT_TRUE(CheckTiling({8, 100}, columns).ok());
  std::vector<Box> grid;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) grid.push_back(Box{{3 * i, 2 * j}, {3, 2}});
  }
  EXPECT_TRUE(CheckTiling({9, 6}, grid).ok());
  grid[4].offset[1] = 3;
  EXPECT_FALSE(CheckTiling({9, 6}, grid).ok());
  // Empty boxes are ignored; a scalar is one box.
  EXPECT_TRUE(CheckTiling({4}, {Box{{0}, {4}}, Box{{4}, {0}}}).ok());
  EXPECT_TRUE(CheckTiling({}, {Box{{}, {}}}).ok());
  EXPECT_FALSE(CheckTiling({}, {Box{{}, {}}, Box{{}, {}}}).ok());
  EXPECT_FALSE(CheckTiling({}, {}).ok());
  EXPECT_TRUE(CheckTiling({0, 3}, {}).ok());
}

TEST(BoxesTest, EmptyShapesStillBoundTheirOtherDims) {
  // Found by metadata_fuzz (UBSan): a zero dim made CheckShape skip the size
  // bound, and the element count of the dims before it overflowed int64.
  Shape huge_then_empty(15, int64_t{1} << 40);
  huge_then_empty.push_back(0);
  absl::Status s = CheckShape(huge_then_empty, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("is too large"));
  EXPECT_TRUE(CheckShape({0, 1 << 20, 1 << 20}, 4).ok());
  EXPECT_FALSE(CheckShape({int64_t{1} << 40, int64_t{1} << 40, 0}, 4).ok());
}

TEST(BoxesTest, IntersectAndShapes) {
  const Box a{{0, 0}, {4, 5}}, b{{2, 3}, {4, 4}};
  const Box c = Intersect(a, b);
  EXPECT_EQ(c.offset, (Shape{2, 3}));
  EXPECT_EQ(c.shape, (Shape{2, 2}));
  EXPECT_TRUE(IsEmptyBox(Intersect(a, Box{{4, 0}, {1, 5}})));
  EXPECT_EQ(BoxToString(c), "[2, 3]+[2, 2]");
  EXPECT_TRUE(CheckShape({1 << 20, 1 << 20}, 4).ok());
  EXPECT_FALSE(CheckShape({int64_t{1} << 40, int64_t{1} << 40}, 4).ok());
  // Empty, but its other dims are still bounded (strides are products of
  // them).
  EXPECT_TRUE(CheckShape({0, int64_t{1} << 40}, 8).ok());
  EXPECT_FALSE(CheckShape({0, int64_t{1} << 62}, 8).ok());
  EXPECT_FALSE(CheckShape(Shape(17, 1), 4).ok());
}

}  // namespace
}  // namespace fsdpp
