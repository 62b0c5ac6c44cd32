// State dicts of FSDP models on W = 1, 2, 3 and HSDP 2x2 (thread ranks over
// real Gloo): the full state dict equals the unsharded model bitwise, and
// sharded, full (rank 0 / every rank) and redistributed loads round-trip
// bitwise into differently initialised models; AdamW state goes full and
// back; strict loads name the bad keys and shapes on every rank.
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "optim/adamw.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace fsdp {
namespace {

using models::ConfigByName;
using models::Transformer;

constexpr uint64_t kSeed = 1234;

// The bytes of a tensor (bitwise comparisons).
std::vector<char> Bytes(const Tensor& t) {
  std::vector<char> out(t.nbytes());
  if (!out.empty()) std::memcpy(out.data(), t.raw_data(), out.size());
  return out;
}

// A gpt2_debug (or `config`) model sharded block by block on `mesh`, with
// weights from `seed`.
std::unique_ptr<Transformer> ShardedModel(
    DeviceMesh& mesh, uint64_t seed, const std::string& config = "gpt2_debug") {
  auto model = *Transformer::Create(*ConfigByName(config));
  FsdpPlanOptions options;
  options.shard.mesh = &mesh;
  std::vector<Module*> blocks(model->blocks().begin(), model->blocks().end());
  CHECK_OK(ShardBlocksThenRoot(model.get(), blocks, options).status());
  CHECK_OK(InitShardedWeights(model.get(), seed));
  return model;
}

// name -> bytes of this rank's master shard.
std::map<std::string, std::vector<char>> LocalShards(Module* model) {
  std::map<std::string, std::vector<char>> out;
  const NamedDTensors state = *ShardedStateDict(model);
  for (auto& [name, t] : state) out[name] = Bytes(t.local());
  return out;
}

// The unsharded model's parameters, in order.
NamedTensors Reference(const std::string& config = "gpt2_debug") {
  auto model = *Transformer::Create(*ConfigByName(config));
  CHECK_OK(model->ToEmpty(Device::Cpu()));
  CHECK_OK(model->InitWeights(kSeed));
  NamedTensors out;
  for (auto& [name, p] : model->NamedParameters()) {
    Tensor copy = *Tensor::Empty(p->shape, DType::kF32, Device::Cpu());
    CHECK_OK(Copy(p->data, &copy));
    out.emplace_back(name, copy);
  }
  return out;
}

const std::vector<std::vector<MeshAxis>> kLayouts = {
    {{"dp", 1}},
    {{"dp", 2}},
    {{"dp", 3}},
    {{"replicate", 2}, {"shard", 2}},
};

std::string Describe(const std::vector<MeshAxis>& axes) {
  std::string s;
  for (const MeshAxis& a : axes)
    s += a.name + "=" + std::to_string(a.size) + " ";
  return s;
}

TEST(StateDictTest, FullStateDictIsTheUnshardedModelBitwise) {
  const NamedTensors reference = Reference();
  for (const auto& axes : kLayouts) {
    SCOPED_TRACE(Describe(axes));
    testing_util::RunOnMesh(axes, [&](int rank, DeviceMesh& mesh) {
      auto model = ShardedModel(mesh, kSeed);
      absl::StatusOr<NamedTensors> full = FullStateDict(model.get());
      ASSERT_TRUE(full.ok()) << full.status();
      absl::StatusOr<NamedTensors> everywhere =
          FullStateDict(model.get(), /*rank0_only=*/false);
      ASSERT_TRUE(everywhere.ok()) << everywhere.status();
      std::vector<const NamedTensors*> to_check = {&*everywhere};
      if (rank == 0) {
        to_check.push_back(&*full);
      } else {
        EXPECT_TRUE(full->empty());
      }
      for (const NamedTensors* got : to_check) {
        ASSERT_EQ(got->size(), reference.size());
        for (size_t i = 0; i < reference.size(); ++i) {
          EXPECT_EQ((*got)[i].first, reference[i].first);
          EXPECT_EQ((*got)[i].second.shape(), reference[i].second.shape());
          EXPECT_TRUE((*got)[i].second.device().is_cpu());
          EXPECT_EQ(Bytes((*got)[i].second), Bytes(reference[i].second))
              << reference[i].first;
        }
      }
    });
  }
}

TEST(StateDictTest, RoundTripsBitwise) {
  const NamedTensors reference = Reference();
  for (const auto& axes : kLayouts) {
    SCOPED_TRACE(Describe(axes));
    testing_util::RunOnMesh(axes, [&](int rank, DeviceMesh& mesh) {
      auto source = ShardedModel(mesh, kSeed);
      const auto want = LocalShards(source.get());

      // Sharded: the state dict is views of the masters, no communication.
      NamedDTensors sharded = *ShardedStateDict(source.get());
      ASSERT_EQ(sharded.size(), reference.size());
      for (ShardedParameter* sp : ShardedParameters(source.get())) {
        bool found = false;
        for (auto& [name, t] : sharded) {
          if (name != sp->name) continue;
          found = true;
          EXPECT_TRUE(t.local().SharesStorageWith(sp->master.local()));
        }
        EXPECT_TRUE(found) << sp->name;
      }
      // Snapshot (deep copy), then load into a differently seeded model.
      NamedDTensors snapshot;
      for (auto& [name, t] : sharded) {
        Tensor copy =
            *Tensor::Empty(t.local().shape(), t.dtype(), Device::Cpu());
        CHECK_OK(Copy(t.local(), &copy));
        snapshot.emplace_back(
            name,
            *DTensor::FromLocal(copy, t.mesh(), t.placements(), t.shape()));
      }
      auto by_sharded = ShardedModel(mesh, kSeed + 1);
      EXPECT_NE(LocalShards(by_sharded.get()), want);
      ASSERT_TRUE(LoadShardedStateDict(by_sharded.get(), snapshot).ok());
      EXPECT_EQ(LocalShards(by_sharded.get()), want);
      // Loading a model's own state dict is a no-op.
      ASSERT_TRUE(LoadShardedStateDict(by_sharded.get(),
                                       *ShardedStateDict(by_sharded.get()))
                      .ok());
      EXPECT_EQ(LocalShards(by_sharded.get()), want);

      // Other placements are redistributed: all-Replicate copies.
      NamedDTensors replicated;
      for (auto& [name, t] : reference) {
        Tensor whole = t;
        if (whole.ndim() == 0) whole = *whole.Reshape({1});
        replicated.emplace_back(
            name,
            *DTensor::Distribute(
                whole, &mesh,
                std::vector<Placement>(mesh.ndim(), Placement::Replicate())));
      }
      auto by_redistribute = ShardedModel(mesh, kSeed + 2);
      absl::Status s = LoadShardedStateDict(by_redistribute.get(), replicated);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(LocalShards(by_redistribute.get()), want);

      // Full, from rank 0 only (the others pass nothing).
      const NamedTensors full = *FullStateDict(source.get());
      auto by_rank0 = ShardedModel(mesh, kSeed + 3);
      s = LoadFullStateDict(by_rank0.get(), rank == 0 ? full : NamedTensors{});
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(LocalShards(by_rank0.get()), want);

      // Full, on every rank (no communication), from the unsharded model.
      auto by_all = ShardedModel(mesh, kSeed + 4);
      s = LoadFullStateDict(by_all.get(), reference, /*rank0_only=*/false);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(LocalShards(by_all.get()), want);

      // bf16 full tensors are converted (rounded) into the f32 masters.
      NamedTensors bf16;
      for (auto& [name, t] : reference) {
        Tensor b = *Tensor::Empty(t.shape(), DType::kBF16, Device::Cpu());
        CHECK_OK(Copy(t, &b));
        bf16.emplace_back(name, b);
      }
      auto by_bf16 = ShardedModel(mesh, kSeed + 5);
      s = LoadFullStateDict(by_bf16.get(), rank == 0 ? bf16 : NamedTensors{});
      ASSERT_TRUE(s.ok()) << s;
      const NamedTensors back = *FullStateDict(by_bf16.get(), false);
      for (size_t i = 0; i < back.size(); ++i) {
        Tensor expected =
            *Tensor::Empty(bf16[i].second.shape(), DType::kF32, Device::Cpu());
        CHECK_OK(Copy(bf16[i].second, &expected));
        EXPECT_EQ(Bytes(back[i].second), Bytes(expected)) << back[i].first;
      }
    });
  }
}

TEST(StateDictTest, OptimizerStateGoesFullAndBackBitwise) {
  for (const auto& axes : kLayouts) {
    SCOPED_TRACE(Describe(axes));
    testing_util::RunOnMesh(axes, [&](int rank, DeviceMesh& mesh) {
      auto model = ShardedModel(mesh, kSeed);
      auto MakeAdamW = [](Module* m) {
        std::vector<AdamWParam> params;
        for (ShardedParameter* sp : ShardedParameters(m)) {
          params.emplace_back(sp->name, &sp->master, &sp->grad);
        }
        return *AdamW::Create(std::move(params));
      };
      AdamW adamw = MakeAdamW(model.get());
      // Two steps on deterministic gradients give non-trivial state.
      for (int step = 0; step < 2; ++step) {
        for (ShardedParameter* sp : ShardedParameters(model.get())) {
          Tensor g = *sp->grad.mutable_local();
          // A function of the global element index, so that HSDP replicas
          // hold equal shards.
          const Box box = sp->grad.local_box();
          const int64_t row = box.shape.empty() || box.shape[0] == 0
                                  ? 0
                                  : g.numel() / box.shape[0];
          const int64_t first = box.offset.empty() ? 0 : box.offset[0] * row;
          std::vector<float> v(g.numel());
          for (size_t i = 0; i < v.size(); ++i) {
            v[i] = 1e-3f * static_cast<float>((first + i + step) % 17) - 8e-3f;
          }
          Tensor src = *Tensor::FromFloats(g.shape(), v);
          CHECK_OK(Copy(src, &g));
        }
        ASSERT_TRUE(adamw.Step().ok());
      }
      OptimizerStateDict state = *adamw.StateDict();
      std::map<std::string, std::vector<char>> want;
      for (auto& [name, t] : state.tensors) want[name] = Bytes(t.local());

      // Sharded: AdamW's own state dict, into a fresh optimizer.
      auto fresh = ShardedModel(mesh, kSeed);
      AdamW sharded_copy = MakeAdamW(fresh.get());
      ASSERT_TRUE(sharded_copy.LoadStateDict(state).ok());
      EXPECT_EQ(sharded_copy.step(), 2);

      // Full: gathered to rank 0, then distributed into another optimizer.
      const NamedDTensors layout(state.tensors.begin(), state.tensors.end());
      absl::StatusOr<NamedTensors> full = GatherFullTensors(layout);
      ASSERT_TRUE(full.ok()) << full.status();
      EXPECT_EQ(full->size(), rank == 0 ? layout.size() : 0u);
      AdamW full_copy = MakeAdamW(fresh.get());
      OptimizerStateDict target = *full_copy.StateDict();
      const NamedDTensors like(target.tensors.begin(), target.tensors.end());
      absl::StatusOr<NamedDTensors> back = DistributeFullTensors(*full, like);
      ASSERT_TRUE(back.ok()) << back.status();
      OptimizerStateDict loaded;
      loaded.tensors = {back->begin(), back->end()};
      absl::StatusOr<int64_t> step =
          BroadcastFromRank0(rank == 0 ? adamw.step() : -1, &mesh);
      ASSERT_TRUE(step.ok()) << step.status();
      loaded.scalars["step"] = *step;
      ASSERT_TRUE(full_copy.LoadStateDict(loaded).ok());
      EXPECT_EQ(full_copy.step(), 2);
      for (AdamW* copy : {&sharded_copy, &full_copy}) {
        const OptimizerStateDict copied = *copy->StateDict();
        for (auto& [name, t] : copied.tensors) {
          EXPECT_EQ(Bytes(t.local()), want.at(name)) << name;
        }
      }
    });
  }
}

// Checks that `s` failed with every one of `parts` in its message.
void ExpectError(const absl::Status& s, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok());
  for (const std::string& part : parts) {
    EXPECT_NE(s.message().find(part), absl::string_view::npos)
        << "missing '" << part << "' in: " << s;
  }
}

TEST(StateDictTest, StrictLoadsNameKeysAndShapesOnEveryRank) {
  const NamedTensors reference = Reference();
  testing_util::RunOnMesh({{"dp", 2}}, [&](int rank, DeviceMesh& mesh) {
    auto model = ShardedModel(mesh, kSeed);
    const auto before = LocalShards(model.get());
    NamedTensors bad = reference;
    bad.erase(bad.begin() + 1);  // wpe.weight
    bad.emplace_back("bogus.weight", reference[0].second);
    bad[0].second = *Tensor::Zeros({3, 4}, DType::kF32, Device::Cpu());
    const std::vector<std::string> parts = {
        "LoadFullStateDict", "missing keys [wpe.weight]",
        "unexpected keys [bogus.weight]",
        "'wte.weight' has shape [3, 4] in the state dict but [512, 64] in the "
        "model"};
    // Rank 0 judges; rank 1 (which passes nothing) gets the same verdict.
    absl::Status s =
        LoadFullStateDict(model.get(), rank == 0 ? bad : NamedTensors{});
    ExpectError(s, parts);
    if (rank == 1) ExpectError(s, {"(reported by rank 0)"});
    // Every rank judging its own copy.
    ExpectError(LoadFullStateDict(model.get(), bad, /*rank0_only=*/false),
                parts);
    NamedTensors ints = reference;
    ints[2].second = *Tensor::FromInts({64}, std::vector<int64_t>(64, 1));
    ExpectError(LoadFullStateDict(model.get(), ints, false),
                {"'h.0.ln_1.weight' has dtype i32, not a float dtype"});

    NamedDTensors sharded = *ShardedStateDict(model.get());
    NamedDTensors bad_sharded(sharded.begin() + 1, sharded.end());
    bad_sharded.emplace_back(
        "h.0.ln_1.weight",
        *DTensor::Distribute(*Tensor::Zeros({7}, DType::kF32, Device::Cpu()),
                             &mesh, {Placement::Shard(0)}));
    ExpectError(LoadShardedStateDict(model.get(), bad_sharded),
                {"LoadShardedStateDict", "missing keys [wte.weight]",
                 "duplicate keys [h.0.ln_1.weight]"});
    NamedDTensors wrong_shape = sharded;
    wrong_shape[1].second = *DTensor::Distribute(
        *Tensor::Zeros({7, 64}, DType::kF32, Device::Cpu()), &mesh,
        {Placement::Shard(0)});
    ExpectError(LoadShardedStateDict(model.get(), wrong_shape),
                {"'wpe.weight' has shape [7, 64] in the state dict but "
                 "[128, 64] in the model"});
    // Nothing was written by any failed load.
    EXPECT_EQ(LocalShards(model.get()), before);

    // Unsharded models have no sharded state.
    auto plain = *Transformer::Create(*ConfigByName("gpt2_debug"));
    ExpectError(ShardedStateDict(plain.get()).status(),
                {"parameter 'wte.weight' is in no FSDP unit"});
  });
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
