// Sharded safetensors import: a file written by one process (as
// models/hf_adapter.h's export does) loads into FSDP, HSDP and 2-D sharded
// DTensors at several world sizes, each rank copying only its slices, bit
// for bit; name mapping, plain tensors and byte values; strict errors.
#include "checkpoint/safetensors_sharded.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/test_checkpoints.h"
#include "formats/safetensors/safetensors.h"
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

const Placement S0 = Placement::Shard(0);
const Placement S1 = Placement::Shard(1);
const Placement R = Placement::Replicate();

const Tensor& W() {
  static const Tensor t = BitPattern({7, 5}, DType::kF32, 1);
  return t;
}
const Tensor& B() {
  static const Tensor t = BitPattern({13}, DType::kBF16, 2);
  return t;
}
const Tensor& C() {
  static const Tensor t = BitPattern({6, 4, 3}, DType::kF16, 3);
  return t;
}

// model.w, model.b, model.c, model.count and model.loader (U8 bytes).
std::string WriteSample() {
  const std::string path = FreshDir("st_sharded") + "/model.safetensors";
  const std::string loader = "epoch=2";
  Tensor bytes = *Tensor::Empty({static_cast<int64_t>(loader.size())},
                                DType::kU8, Device::Cpu());
  std::memcpy(bytes.raw_data(), loader.data(), loader.size());
  CHECK_OK(
      WriteSafetensors(path, {{"model.w", W()},
                              {"model.b", B()},
                              {"model.c", C()},
                              {"model.count", BitPattern({}, DType::kI64, 4)},
                              {"model.loader", bytes}}));
  return path;
}

std::string Prefixed(const std::string& key) { return "model." + key; }

TEST(SafetensorsShardedTest, EachRankLoadsItsSlicesBitwise) {
  const std::string path = WriteSample();
  struct Layout {
    std::vector<MeshAxis> axes;
    std::vector<Placement> w, b, c;
  };
  const std::vector<Layout> layouts = {
      {{{"dp", 1}}, {S0}, {S0}, {S0}},
      {{{"dp", 3}}, {S0}, {S0}, {S1}},
      {{{"dp", 4}}, {S0}, {R}, {Placement::Shard(2)}},
      {{{"replicate", 2}, {"shard", 2}}, {R, S0}, {R, S0}, {S0, S1}},
  };
  for (const Layout& layout : layouts) {
    RunOnMesh(layout.axes, [&](int, DeviceMesh& mesh) {
      StateDict state;
      ASSERT_TRUE(
          state
              .AddDTensor("w", MakeDTensor(ZerosLike({7, 5}, DType::kF32),
                                           &mesh, layout.w))
              .ok());
      ASSERT_TRUE(
          state
              .AddDTensor("b", MakeDTensor(ZerosLike({13}, DType::kBF16), &mesh,
                                           layout.b))
              .ok());
      ASSERT_TRUE(
          state
              .AddDTensor("c", MakeDTensor(ZerosLike({6, 4, 3}, DType::kF16),
                                           &mesh, layout.c))
              .ok());
      ASSERT_TRUE(state.AddTensor("count", ZerosLike({}, DType::kI64)).ok());
      ASSERT_TRUE(state.AddBytes("loader", "").ok());
      SafetensorsLoadOptions options;
      options.name_for_key = &Prefixed;
      absl::StatusOr<LoadResult> loaded =
          LoadSafetensorsSharded(path, &state, options);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      const Box wb = BoxOn({7, 5}, mesh, layout.w);
      const Box bb = BoxOn({13}, mesh, layout.b);
      const Box cb = BoxOn({6, 4, 3}, mesh, layout.c);
      EXPECT_TRUE(
          BitwiseEqual(state.Find("w")->dtensor.local(), Slice(W(), wb)));
      EXPECT_TRUE(
          BitwiseEqual(state.Find("b")->dtensor.local(), Slice(B(), bb)));
      EXPECT_TRUE(
          BitwiseEqual(state.Find("c")->dtensor.local(), Slice(C(), cb)));
      EXPECT_TRUE(BitwiseEqual(state.Find("count")->tensor,
                               BitPattern({}, DType::kI64, 4)));
      EXPECT_EQ(*state.bytes("loader"), "epoch=2");
      // Only this rank's slices were copied (for c, whole dim-0 rows).
      const uint64_t c_rows_bytes =
          NumElements(cb.shape) == 0 ? 0 : cb.shape[0] * 4 * 3 * 2;
      testing_util::Barrier(mesh);
      EXPECT_EQ(loaded->bytes_read,
                static_cast<uint64_t>(NumElements(wb.shape)) * 4 +
                    NumElements(bb.shape) * 2 + c_rows_bytes + 8 + 7);
    });
  }
}

TEST(SafetensorsShardedTest, StrictErrorsNameFileAndTensor) {
  const std::string path = WriteSample();
  SafetensorsLoadOptions prefixed;
  prefixed.name_for_key = &Prefixed;
  {  // Keys without tensors, and tensors without keys.
    StateDict state;
    ASSERT_TRUE(state.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    ASSERT_TRUE(state.AddTensor("nope", ZerosLike({1}, DType::kF32)).ok());
    absl::Status status =
        LoadSafetensorsSharded(path, &state, prefixed).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(status.message(), HasSubstr("'nope'"));
    EXPECT_THAT(status.message(), HasSubstr(path));
    StateDict only_w;
    ASSERT_TRUE(only_w.AddTensor("w", ZerosLike({7, 5}, DType::kF32)).ok());
    status = LoadSafetensorsSharded(path, &only_w, prefixed).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("'model.b'"));
    // Non-strict: loads what matches, reports the rest.
    SafetensorsLoadOptions lenient = prefixed;
    lenient.strict = false;
    absl::StatusOr<LoadResult> loaded =
        LoadSafetensorsSharded(path, &state, lenient);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->missing_keys, std::vector<std::string>{"nope"});
    EXPECT_EQ(loaded->unexpected_keys.size(), 4u);
    EXPECT_TRUE(BitwiseEqual(state.Find("w")->tensor, W()));
  }
  {  // Shape and dtype mismatches name both sides.
    StateDict state;
    ASSERT_TRUE(state.AddTensor("w", ZerosLike({5, 7}, DType::kF32)).ok());
    SafetensorsLoadOptions lenient = prefixed;
    lenient.strict = false;
    absl::Status status =
        LoadSafetensorsSharded(path, &state, lenient).status();
    EXPECT_THAT(status.message(), HasSubstr("'model.w'"));
    EXPECT_THAT(status.message(), HasSubstr("f32[7, 5]"));
    EXPECT_THAT(status.message(), HasSubstr("f32[5, 7]"));
    StateDict wrong_dtype;
    ASSERT_TRUE(wrong_dtype.AddTensor("b", ZerosLike({13}, DType::kF32)).ok());
    status = LoadSafetensorsSharded(path, &wrong_dtype, lenient).status();
    EXPECT_THAT(status.message(), HasSubstr("dtype mismatch"));
    EXPECT_THAT(status.message(), HasSubstr("bf16[13]"));
  }
}

}  // namespace
}  // namespace fsdpp
