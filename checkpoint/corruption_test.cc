// Damaged checkpoints fail loudly and precisely: a flipped data byte is a
// checksum error naming the file and the key (and only the ranks whose rows
// cover it fail), truncated and deleted data files, a corrupt, truncated or
// missing metadata file and an unknown format version each give a clear
// error naming the file.
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/metadata.h"
#include "checkpoint/metadata.pb.h"
#include "checkpoint/reader.h"
#include "checkpoint/test_checkpoints.h"
#include "formats/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;
using testing_util::BitPattern;
using testing_util::BitwiseEqual;
using testing_util::BoxOn;
using testing_util::FreshDir;
using testing_util::MakeDTensor;
using testing_util::RunOnMesh;
using testing_util::Slice;
using testing_util::ZerosLike;

const Tensor& W() {
  static const Tensor w = BitPattern({64, 16}, DType::kF32, 1);  // 4 KiB.
  return w;
}
const Tensor& B() {
  static const Tensor b = BitPattern({10}, DType::kBF16, 2);
  return b;
}

// Saves {w, b, step} alone and returns the checkpoint directory.
std::string SaveSample(const std::string& name) {
  const std::string root = FreshDir(name);
  StateDict state;
  CHECK_OK(state.AddTensor("w", W()));
  CHECK_OK(state.AddTensor("b", B()));
  CHECK_OK(state.AddBytes("step", "5"));
  SaveOptions options;
  options.block_bytes = 256;
  absl::StatusOr<SaveResult> saved = Save(state, root, 5, options);
  CHECK_OK(saved.status());
  return saved->path;
}

absl::Status LoadSample(const std::string& dir) {
  StateDict state;
  CHECK_OK(state.AddTensor("w", ZerosLike({64, 16}, DType::kF32)));
  CHECK_OK(state.AddTensor("b", ZerosLike({10}, DType::kBF16)));
  CHECK_OK(state.AddBytes("step", ""));
  return Load(&state, dir).status();
}

absl::Status Verify(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(dir);
  if (!reader.ok()) return reader.status();
  return (*reader)->VerifyAll();
}

void RewriteFile(const std::string& path, const std::string& contents) {
  CHECK_OK(RemoveTree(path));
  CHECK_OK(WriteFileDurably(path, contents));
}

TEST(CorruptionTest, IntactCheckpointLoadsAndVerifies) {
  const std::string dir = SaveSample("intact");
  EXPECT_TRUE(LoadSample(dir).ok());
  EXPECT_TRUE(Verify(dir).ok());
}

TEST(CorruptionTest, FlippedByteIsAChecksumErrorNamingFileAndKey) {
  const std::string dir = SaveSample("flipped");
  const CheckpointMetadata metadata = *ReadMetadata(dir);
  const ChunkMetadata& chunk = metadata.entries.at("w").chunks[0];
  const std::string file = absl::StrCat(dir, "/", metadata.files[chunk.file]);
  std::string bytes = *ReadFileToString(file);
  // Row 1 of w: bytes [64, 128) of the chunk, in CRC block 0.
  bytes[chunk.byte_offset + 100] ^= 0x10;
  RewriteFile(file, bytes);

  for (const absl::Status& status : {LoadSample(dir), Verify(dir)}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(file));
    EXPECT_THAT(status.message(), HasSubstr("checksum mismatch"));
    EXPECT_THAT(status.message(), HasSubstr("key 'w'"));
  }
  // Only the rank whose rows include the damaged block notices: the others
  // read and verify just their own blocks.
  RunOnMesh({{"dp", 4}}, [&](int rank, DeviceMesh& mesh) {
    const std::vector<Placement> s0 = {Placement::Shard(0)};
    StateDict state;
    ASSERT_TRUE(
        state
            .AddDTensor(
                "w", MakeDTensor(ZerosLike({64, 16}, DType::kF32), &mesh, s0))
            .ok());
    LoadOptions options;
    options.strict = false;
    const absl::Status status = Load(&state, dir, options).status();
    if (rank == 0) {
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    } else {
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_TRUE(BitwiseEqual(state.Find("w")->dtensor.local(),
                               Slice(W(), BoxOn({64, 16}, mesh, s0))));
    }
    testing_util::Barrier(mesh);
  });
}

TEST(CorruptionTest, TruncatedDataFileNamesFileAndKey) {
  const std::string dir = SaveSample("truncated");
  const CheckpointMetadata metadata = *ReadMetadata(dir);
  const std::string file = absl::StrCat(dir, "/", metadata.files[0]);
  ASSERT_EQ(::truncate(file.c_str(), 1000), 0);
  for (const absl::Status& status : {LoadSample(dir), Verify(dir)}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(file));
    EXPECT_THAT(status.message(), HasSubstr("truncated"));
    EXPECT_THAT(status.message(), HasSubstr("the file has 1000 bytes"));
    EXPECT_THAT(status.message(), HasSubstr("key '"));
  }
}

TEST(CorruptionTest, DeletedDataFileNamesFileAndKey) {
  const std::string dir = SaveSample("deleted");
  const CheckpointMetadata metadata = *ReadMetadata(dir);
  const std::string file = absl::StrCat(dir, "/", metadata.files[0]);
  ASSERT_EQ(::unlink(file.c_str()), 0);
  for (const absl::Status& status : {LoadSample(dir), Verify(dir)}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
    EXPECT_THAT(status.message(), HasSubstr(file));
    EXPECT_THAT(status.message(), HasSubstr("key '"));
  }
}

TEST(CorruptionTest, UnknownFormatVersionIsRejected) {
  const std::string dir = SaveSample("version");
  const std::string path = absl::StrCat(dir, "/", kMetadataFileName);
  checkpoint_proto::MetadataFile file;
  ASSERT_TRUE(file.ParseFromString(*ReadFileToString(path)));
  file.set_version(kCheckpointFormatVersion + 1);
  RewriteFile(path, file.SerializeAsString());
  const absl::Status status = LoadSample(dir);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("version ", kCheckpointFormatVersion + 1,
                                     " (this build reads version ",
                                     kCheckpointFormatVersion, ")")));
}

TEST(CorruptionTest, CorruptTruncatedOrMissingMetadataIsNamed) {
  const std::string dir = SaveSample("metadata");
  const std::string path = absl::StrCat(dir, "/", kMetadataFileName);
  const std::string good = *ReadFileToString(path);
  {  // A flipped byte inside the body: the body checksum catches it.
    std::string bad = good;
    bad[bad.size() / 2] ^= 0x01;
    RewriteFile(path, bad);
    const absl::Status status = LoadSample(dir);
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(status.message(), HasSubstr(path));
  }
  {  // Truncated.
    RewriteFile(path, good.substr(0, good.size() - 7));
    const absl::Status status = LoadSample(dir);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(path));
  }
  {  // Missing: the directory no longer counts as a checkpoint.
    ASSERT_EQ(::unlink(path.c_str()), 0);
    const absl::Status status = LoadSample(dir);
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
    EXPECT_THAT(status.message(), HasSubstr(path));
    const std::string root = dir.substr(0, dir.rfind('/'));
    EXPECT_EQ(LatestCheckpoint(root).status().code(),
              absl::StatusCode::kNotFound);
  }
  {  // Restored, it loads again.
    RewriteFile(path, good);
    EXPECT_TRUE(LoadSample(dir).ok());
  }
}

// A 6 MiB chunk is read in six 1 MiB windows, checksummed by a helper
// thread while the next window is read.
TEST(CorruptionTest, LongChunksAreVerifiedWhileStreaming) {
  const std::string root = FreshDir("long");
  const Tensor big = BitPattern({1536, 1024}, DType::kF32, 7);
  StateDict state;
  ASSERT_TRUE(state.AddTensor("big", big).ok());
  absl::StatusOr<SaveResult> saved = Save(state, root, 1);
  ASSERT_TRUE(saved.ok()) << saved.status();
  const std::string file = saved->path + "/rank-0.data";
  const std::string good = *ReadFileToString(file);
  auto load = [&] {
    StateDict s;
    CHECK_OK(s.AddTensor("big", ZerosLike({1536, 1024}, DType::kF32)));
    absl::Status status = Load(&s, saved->path).status();
    if (status.ok()) {
      EXPECT_TRUE(BitwiseEqual(s.Find("big")->tensor, big));
    }
    return status;
  };
  EXPECT_TRUE(load().ok());
  for (size_t at : {size_t{100}, (size_t{9} << 19) + 3, good.size() - 1}) {
    std::string bad = good;
    bad[at] ^= 0x40;
    RewriteFile(file, bad);
    const absl::Status status = load();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(),
                HasSubstr(absl::StrCat("block ", at >> 20, " ")));
  }
  RewriteFile(file, good.substr(0, (size_t{3} << 20) + 5));
  const absl::Status status = load();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("truncated"));
  RewriteFile(file, good);
  EXPECT_TRUE(load().ok());
}

}  // namespace
}  // namespace fsdpp
