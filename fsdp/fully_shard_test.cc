// fully_shard, AutoWrap and the sharded state dict on small stacks of nn
// layers (no model zoo), thread ranks over real Gloo: gradients of uneven
// shards on W = 2 and 3 (ZeRO-3 and ZeRO-2) and on W = 1 (no collective:
// each gradient cast into its shard, the parameters views of the gathered
// buffer) match the unsharded stack and the shards follow chunk semantics;
// ZeRO-3 frees a unit's unsharded parameters after its forward (allocator
// accounting); AutoWrap plans and groups tied weights; sharded state dicts
// round-trip bitwise and strict loads name the missing key; errors for sharding
// a module twice or splitting a tie.
#include "fsdp/fully_shard.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/allocator.h"
#include "core/logging.h"
#include "core/status.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/state_dict.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "nn/embedding.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/loss.h"
#include "nn/mlp.h"
#include "nn/sequential.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace fsdp {
namespace {

constexpr uint64_t kSeed = 1234;
constexpr int64_t kVocab = 7, kDim = 6, kHidden = 4, kClasses = 5;
constexpr int64_t kBatch = 6, kSeq = 3;  // kBatch divides by 2 and 3.

// ids -> "0" Embedding(7, 6) -> "1" Mlp(6, 4) -> "2" LayerNorm(6) -> "3" head:
// Linear(6, 5), or (tied) the embedding table. Dim 0 of 7, 5 and 4 splits
// unevenly over 2 and 3 ranks (4 over 3 leaves rank 2 empty: 2, 2, 0).
std::unique_ptr<nn::Sequential> MakeStack(bool tied = false) {
  auto stack = std::make_unique<nn::Sequential>();
  nn::Embedding* embedding =
      stack->Append(std::make_unique<nn::Embedding>(kVocab, kDim, 0.5f));
  stack->Append(std::make_unique<nn::Mlp>(kDim, kHidden, 0.5f, 0.5f));
  stack->Append(std::make_unique<nn::LayerNorm>(kDim));
  if (tied) {
    stack->Append(std::make_unique<nn::Linear>(embedding->weight()));
  } else {
    stack->Append(std::make_unique<nn::Linear>(kDim, kClasses, true, 0.5f));
  }
  return stack;
}

// Forward and mean cross-entropy of `model` on rows [begin, begin + rows) of
// the global batch (ids, targets); Backward follows it.
absl::Status Forward(Module* model, nn::CrossEntropyLoss* loss, int64_t begin,
                     int64_t rows, bool tied) {
  std::vector<int64_t> ids, targets;
  for (int64_t i = begin * kSeq; i < (begin + rows) * kSeq; ++i) {
    ids.push_back((i * 5 + i / kSeq) % kVocab);
    targets.push_back((i * 3 + 2) % (tied ? kVocab : kClasses));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor x, Tensor::FromInts({rows, kSeq}, ids));
  FSDPP_ASSIGN_OR_RETURN(Tensor t, Tensor::FromInts({rows, kSeq}, targets));
  FSDPP_ASSIGN_OR_RETURN(Tensor logits, model->Forward(x));
  return loss->Forward(logits, t).status();
}
absl::Status Backward(Module* model, nn::CrossEntropyLoss* loss) {
  FSDPP_ASSIGN_OR_RETURN(Tensor dlogits, loss->Backward());
  return model->Backward(dlogits).status();
}

void Barrier(DeviceMesh& mesh) {
  CHECK_OK((*(*mesh.FlatGroup())->Barrier())->Wait());
}

// Full parameters and gradients by name, of one step on the whole batch.
struct Result {
  std::map<std::string, std::vector<double>> params, grads;
};

Result RunReference(bool tied) {
  auto stack = MakeStack(tied);
  CHECK_OK(stack->ToEmpty(Device::Cpu()));
  CHECK_OK(stack->InitWeights(kSeed));
  CHECK_OK(stack->ZeroGrad());
  nn::CrossEntropyLoss loss;
  CHECK_OK(Forward(stack.get(), &loss, 0, kBatch, tied));
  CHECK_OK(Backward(stack.get(), &loss));
  Result result;
  for (auto& [name, p] : stack->NamedParameters()) {
    result.params[name] = testing_util::Values(p->data);
    result.grads[name] = testing_util::Values(p->grad);
  }
  return result;
}

// Shards one rank's stack on `mesh`; returns its units, root last.
using Plan =
    std::function<std::vector<FsdpUnit*>(nn::Sequential*, DeviceMesh*)>;

// One unit per layer (the LayerNorm is left to the root), then the root.
Plan PerLayer(bool reshard_after_forward = true,
              DType param_dtype = DType::kF32) {
  return [=](nn::Sequential* stack, DeviceMesh* mesh) {
    FullyShardOptions options;
    options.mesh = mesh;
    options.reshard_after_forward = reshard_after_forward;
    options.mp_policy.param_dtype = param_dtype;
    std::vector<FsdpUnit*> units;
    for (Module* m : {stack->at(0), stack->at(1), stack->at(3),
                      static_cast<Module*>(stack)}) {
      absl::StatusOr<FsdpUnit*> unit = FullyShard({m}, options);
      CHECK_OK(unit.status());
      units.push_back(*unit);
    }
    return units;
  };
}

// The same step under FSDP: each rank takes its rows of the batch; the
// full (gathered) parameters and gradients come from rank 0.
// `shared_memory`: the Gloo groups' (RanksOptions::shared_memory).
Result RunSharded(int world, bool tied, const Plan& plan,
                  bool shared_memory = false) {
  Result result;
  testing_util::RunOnMesh(
      {{"dp", world}},
      [&](int rank, DeviceMesh& mesh) {
        auto stack = MakeStack(tied);
        plan(stack.get(), &mesh);
        ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
        const int64_t rows = kBatch / world;
        nn::CrossEntropyLoss loss;
        absl::Status s = Forward(stack.get(), &loss, rank * rows, rows, tied);
        ASSERT_TRUE(s.ok()) << s;
        s = Backward(stack.get(), &loss);
        ASSERT_TRUE(s.ok()) << s;
        for (ShardedParameter* sp : ShardedParameters(stack.get())) {
          absl::StatusOr<Tensor> param = sp->master.FullTensor();
          absl::StatusOr<Tensor> grad = sp->grad.FullTensor();
          ASSERT_TRUE(param.ok() && grad.ok()) << sp->name;
          if (rank != 0) continue;
          result.params[sp->name] = testing_util::Values(*param);
          result.grads[sp->name] = testing_util::Values(*grad);
        }
      },
      absl::Seconds(60), shared_memory);
  return result;
}

// Same initial parameters bitwise; gradients within 1e-5 relative (atol
// relative to each gradient's largest magnitude).
void ExpectParity(const Result& ref, const Result& got,
                  const std::string& what) {
  EXPECT_EQ(got.params, ref.params) << what;
  ASSERT_EQ(got.grads.size(), ref.grads.size()) << what;
  for (auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << what << " " << name;
    double scale = 0;
    for (double v : g) scale = std::max(scale, std::fabs(v));
    EXPECT_GT(scale, 0) << what << " " << name;
    EXPECT_TRUE(
        testing_util::AllClose(got.grads.at(name), g, 1e-5, 1e-5 * scale))
        << what << " grad " << name;
  }
}

TEST(FullyShardTest, UnevenShardsMatchUnshardedGradients) {
  const Result ref = RunReference(/*tied=*/false);
  for (int world : {1, 2, 3}) {
    for (bool zero3 : {true, false}) {
      const std::string what =
          absl::StrCat("W=", world, zero3 ? " ZeRO-3" : " ZeRO-2");
      Plan checked = [&](nn::Sequential* stack, DeviceMesh* mesh) {
        std::vector<FsdpUnit*> units = PerLayer(zero3)(stack, mesh);
        EXPECT_TRUE(units.back()->is_root()) << what;
        // Chunk semantics: chunk = ceil(n / world); the last ranks are short
        // or empty.
        for (ShardedParameter* sp : ShardedParameters(stack)) {
          const int64_t n = sp->shape[0];
          const int64_t chunk = (n + world - 1) / world;
          const int64_t rows =
              std::clamp<int64_t>(n - mesh->rank() * chunk, 0, chunk);
          Shape local = sp->shape;
          local[0] = rows;
          EXPECT_EQ(sp->master.local().shape(), local) << what << sp->name;
          EXPECT_EQ(sp->grad.local().shape(), local) << what << sp->name;
          if (world == 3 && sp->name == "1.fc.weight") {
            EXPECT_EQ(rows, mesh->rank() == 2 ? 0 : 2);  // 4 rows: 2, 2, 0.
          }
        }
        return units;
      };
      ExpectParity(ref, RunSharded(world, false, checked), what);
    }
  }
}

// Through shared memory the shard group gathers into runs
// (ProcessGroup::AllGathersRuns) and reduce-scatters spans of the gradients
// (ReduceScattersSpans): each unit's parameters are views of one gathered
// buffer, in their own layout (no copy-out), holding the masters' values
// (cast), and the gradients go to the reduce-scatter as they are (no
// copy-in). A step gives the same bits as the TCP ring's rank-order gather,
// copy-out and copy-in, in f32 and bf16 (widened into f32), with uneven and
// empty shards.
TEST(FullyShardTest, SharedMemoryStepMatchesTcpBitwise) {
  for (int world : {2, 3}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (bool zero3 : {true, false}) {
        const std::string what = absl::StrCat(
            "W=", world, " ", DTypeName(dtype), zero3 ? " ZeRO-3" : " ZeRO-2");
        const Result tcp = RunSharded(world, false, PerLayer(zero3, dtype));
        const Result shm =
            RunSharded(world, false, PerLayer(zero3, dtype), true);
        EXPECT_EQ(shm.params, tcp.params) << what;
        EXPECT_EQ(shm.grads, tcp.grads) << what;
      }
    }
    testing_util::RunOnMesh(
        {{"dp", world}},
        [&](int, DeviceMesh& mesh) {
          ASSERT_TRUE((*mesh.FlatGroup())->AllGathersRuns());
          auto stack = MakeStack(/*tied=*/false);
          std::vector<FsdpUnit*> units =
              PerLayer(true, DType::kBF16)(stack.get(), &mesh);
          ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
          for (FsdpUnit* unit : units) {
            ASSERT_TRUE(unit->Unshard().ok());
            const std::vector<ShardedParameter>& params = unit->parameters();
            for (const ShardedParameter& sp : params) {
              const Tensor& data = sp.parameter->data;
              EXPECT_TRUE(data.SharesStorageWith(params[0].parameter->data))
                  << sp.name;
              absl::StatusOr<Tensor> full = sp.master.FullTensor();
              ASSERT_TRUE(full.ok()) << full.status();
              absl::StatusOr<Tensor> cast =
                  Tensor::Empty(full->shape(), DType::kBF16, Device::Cpu());
              ASSERT_TRUE(cast.ok() && Copy(*full, &*cast).ok());
              EXPECT_EQ(testing_util::Values(data), testing_util::Values(*cast))
                  << sp.name;
            }
            ASSERT_TRUE(unit->Reshard().ok());
            for (const ShardedParameter& sp : params) {
              EXPECT_TRUE(sp.parameter->data.is_meta()) << sp.name;
            }
          }
        },
        absl::Seconds(60), /*shared_memory=*/true);
  }
}

// ZeroGradOnNextReduction: the next reduction writes the sharded gradients
// (whatever they held: filled with 7 here), the one after adds to them, and
// FinishZeroGrad zeroes those of a unit that had no reduction.
TEST(FullyShardTest, LazyZeroGradWritesOnTheFirstReduction) {
  const Result ref = RunReference(/*tied=*/false);
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("W=", world));
    const int64_t rows = kBatch / world;
    Result once, twice;
    testing_util::RunOnMesh({{"dp", world}}, [&](int rank, DeviceMesh& mesh) {
      auto stack = MakeStack(false);
      std::vector<FsdpUnit*> units = PerLayer()(stack.get(), &mesh);
      ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
      auto fill_and_zero_lazily = [&] {
        for (ShardedParameter* sp : ShardedParameters(stack.get())) {
          ASSERT_TRUE(Fill(sp->grad.mutable_local(), 7.0f).ok());
        }
        for (FsdpUnit* u : units) u->ZeroGradOnNextReduction();
      };
      auto step = [&] {
        nn::CrossEntropyLoss loss;
        ASSERT_TRUE(Forward(stack.get(), &loss, rank * rows, rows, false).ok());
        ASSERT_TRUE(Backward(stack.get(), &loss).ok());
      };
      auto full_grads = [&](Result* r) {  // rank 0 keeps them
        for (ShardedParameter* sp : ShardedParameters(stack.get())) {
          absl::StatusOr<Tensor> param = sp->master.FullTensor();
          absl::StatusOr<Tensor> grad = sp->grad.FullTensor();
          ASSERT_TRUE(param.ok() && grad.ok()) << sp->name;
          if (rank != 0) continue;
          r->params[sp->name] = testing_util::Values(*param);
          r->grads[sp->name] = testing_util::Values(*grad);
        }
      };
      fill_and_zero_lazily();
      step();
      for (FsdpUnit* u : units) ASSERT_TRUE(u->FinishZeroGrad().ok());
      full_grads(&once);
      step();  // no flag: accumulates
      full_grads(&twice);
      // No reduction after the flag: FinishZeroGrad zeroes.
      fill_and_zero_lazily();
      for (FsdpUnit* u : units) ASSERT_TRUE(u->FinishZeroGrad().ok());
      for (ShardedParameter* sp : ShardedParameters(stack.get())) {
        for (double v : testing_util::Values(sp->grad.local())) {
          ASSERT_EQ(v, 0.0) << sp->name;
        }
      }
    });
    ExpectParity(ref, once, "lazy zero");
    Result doubled = ref;
    for (auto& [name, g] : doubled.grads) {
      for (double& v : g) v *= 2;
    }
    ExpectParity(doubled, twice, "accumulated");
  }
}

// A parameter of a unit that takes no part in forward gets a zero gradient
// from every reduction (its rows of the reduce-scatter input are zeros,
// whatever the reused buffer held before).
TEST(FullyShardTest, UnusedParametersReduceToZero) {
  // Over shared memory the reduce-scatter reads spans of zeros for them.
  for (auto [world, shm] :
       {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    SCOPED_TRACE(absl::StrCat("W=", world, shm ? " shared memory" : ""));
    const int64_t rows = kBatch / world;
    testing_util::RunOnMesh(
        {{"dp", world}},
        [&, world = world](int rank, DeviceMesh& mesh) {
          auto stack = MakeStack(false);
          nn::Linear spare(kDim, 3, /*bias=*/true, 0.5f);
          FullyShardOptions options;
          options.mesh = &mesh;
          ASSERT_TRUE(FullyShard({stack->at(1), &spare}, options).ok());
          absl::StatusOr<FsdpUnit*> root = FullyShard({stack.get()}, options);
          ASSERT_TRUE(root.ok()) << root.status();
          ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
          FsdpUnit* unit = UnitOf(stack->at(1));
          ASSERT_NE(unit, nullptr);
          for (int step = 0; step < 3; ++step) {
            for (ShardedParameter& sp : unit->parameters()) {
              ASSERT_TRUE(Fill(sp.grad.mutable_local(), 7.0f).ok());
            }
            unit->ZeroGradOnNextReduction();
            nn::CrossEntropyLoss loss;
            ASSERT_TRUE(
                Forward(stack.get(), &loss, rank * rows, rows, false).ok());
            ASSERT_TRUE(Backward(stack.get(), &loss).ok());
            ASSERT_TRUE(unit->FinishZeroGrad().ok());
            for (ShardedParameter& sp : unit->parameters()) {
              const std::vector<double> g =
                  testing_util::Values(sp.grad.local());
              const bool is_spare = !absl::StartsWith(sp.name, "1.");
              double norm = 0;
              for (double v : g) norm += v * v;
              if (is_spare) {
                EXPECT_EQ(norm, 0.0) << "step " << step << " " << sp.name;
              } else if (!g.empty()) {
                EXPECT_GT(norm, 0.0) << "step " << step << " " << sp.name;
                EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](double v) {
                  return v != 7.0;
                })) << sp.name;
              }
            }
          }
        },
        absl::Seconds(60), shm);
  }
}

// On one rank nothing moves between ranks. Computing in bf16, the gathered
// (cast) buffer holds each parameter in its own layout: when every
// parameter starts 64-byte aligned in it they are all views of it (no
// copy-out), else all are copies. Computing in f32, the parameters are views
// of the masters. Either way they hold the masters' values (cast) and go
// back to meta on reshard.
TEST(FullyShardTest, OneRankParametersAreViewsOfTheGatheredBufferOrMasters) {
  enum Case { kAligned, kNotAligned, kF32 };
  for (Case c : {kAligned, kNotAligned, kF32}) {
    SCOPED_TRACE(c == kAligned ? "bf16 aligned"
                 : c == kF32   ? "f32"
                               : "bf16 one not aligned");
    testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
      // bf16 offsets in bytes: w 0, b 1024, w 1088, b 3136 (aligned); then
      // w 3200, b 3280 (not).
      nn::Sequential stack;
      stack.Append(std::make_unique<nn::Linear>(16, 32, true, 0.5f));
      stack.Append(std::make_unique<nn::Linear>(32, 32, true, 0.5f));
      if (c == kNotAligned) {
        stack.Append(std::make_unique<nn::Linear>(5, 8, true, 0.5f));
      }
      FullyShardOptions options;
      options.mesh = &mesh;
      if (c != kF32) options.mp_policy.param_dtype = DType::kBF16;
      absl::StatusOr<FsdpUnit*> unit = FullyShard({&stack}, options);
      ASSERT_TRUE(unit.ok()) << unit.status();
      ASSERT_TRUE(InitShardedWeights(&stack, kSeed).ok());
      ASSERT_TRUE((*unit)->Unshard().ok());
      std::vector<ShardedParameter>& params = (*unit)->parameters();
      ASSERT_EQ(params.size(), c == kNotAligned ? 6u : 4u);
      for (size_t i = 0; i < params.size(); ++i) {
        const ShardedParameter& sp = params[i];
        const Tensor& data = sp.parameter->data;
        if (c == kF32) {
          EXPECT_TRUE(data.SharesStorageWith(sp.master.local())) << sp.name;
          EXPECT_EQ(data.raw_data(), sp.master.local().raw_data()) << sp.name;
        } else if (i > 0) {
          EXPECT_EQ(data.SharesStorageWith(params[0].parameter->data),
                    c == kAligned)
              << sp.name;
        }
        EXPECT_EQ(data.shape(), sp.shape) << sp.name;
        Tensor cast = *Tensor::Empty(sp.shape, data.dtype(), Device::Cpu());
        Tensor master = *sp.master.local().Reshape(sp.shape);
        ASSERT_TRUE(Copy(master, &cast).ok());
        EXPECT_EQ(testing_util::Values(data), testing_util::Values(cast))
            << sp.name;
      }
      ASSERT_TRUE((*unit)->Reshard().ok());
      for (ShardedParameter& sp : params) {
        EXPECT_TRUE(sp.parameter->data.is_meta()) << sp.name;
      }
    });
  }
}

// On one rank an f32 gradient that the backward wrote whole becomes its
// shard: no copy into the old shard, which is freed, so the shard is a new
// storage after every step, equal to the unsharded model's gradient; a
// second backward before the next zeroing (accumulation) adds into it in
// place. bf16 gradients are cast into the same shard every step.
TEST(FullyShardTest, OneRankF32GradientsBecomeTheirShards) {
  const Result ref = RunReference(false);
  for (DType param_dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(param_dtype));
    testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
      auto stack = MakeStack(false);
      const std::vector<FsdpUnit*> units =
          PerLayer(true, param_dtype)(stack.get(), &mesh);
      ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
      const std::vector<ShardedParameter*> params =
          ShardedParameters(stack.get());
      std::map<std::string, const void*> held;
      const auto step = [&](bool zero) {
        for (ShardedParameter* sp : params) {
          held[sp->name] = sp->grad.local().raw_data();
        }
        if (zero) {
          for (FsdpUnit* u : units) u->ZeroGradOnNextReduction();
        }
        nn::CrossEntropyLoss loss;
        ASSERT_TRUE(Forward(stack.get(), &loss, 0, kBatch, false).ok());
        ASSERT_TRUE(Backward(stack.get(), &loss).ok());
        for (FsdpUnit* u : units) ASSERT_TRUE(u->FinishZeroGrad().ok());
      };
      for (int s = 0; s < 2; ++s) {
        step(/*zero=*/true);
        for (ShardedParameter* sp : params) {
          EXPECT_EQ(sp->grad.local().raw_data() == held[sp->name],
                    param_dtype != DType::kF32)
              << "step " << s << " " << sp->name;
          EXPECT_EQ(sp->grad.local().storage().use_count(), 1) << sp->name;
          if (param_dtype == DType::kF32) {
            EXPECT_EQ(testing_util::Values(sp->grad.local()),
                      ref.grads.at(sp->name))
                << sp->name;
          }
        }
      }
      std::map<std::string, std::vector<double>> once;
      for (ShardedParameter* sp : params) {
        once[sp->name] = testing_util::Values(sp->grad.local());
      }
      step(/*zero=*/false);
      for (ShardedParameter* sp : params) {
        EXPECT_EQ(sp->grad.local().raw_data(), held[sp->name]) << sp->name;
        std::vector<double> twice = once[sp->name];
        for (double& v : twice) v *= 2;
        EXPECT_EQ(testing_util::Values(sp->grad.local()), twice) << sp->name;
      }
    });
  }
}

// Frozen parameters (requires_grad = false before FullyShard): the
// embedding's unit is all frozen and issues no reduce-scatter; the MLP's
// unit has a frozen fc.weight beside trainable ones and reduces only those
// (its reduce-scatter segment is theirs alone). The trainable gradients
// equal the unsharded stack's at W = 2 and 3, frozen ones have no gradient
// shard and their values never change.
TEST(FullyShardTest, FrozenParametersHaveNoGradientAndNoReduction) {
  const Result ref = RunReference(false);
  const std::set<std::string> frozen = {"0.weight", "1.fc.weight"};
  for (int world : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("W=", world));
    testing_util::RunOnMesh({{"dp", world}}, [&](int rank, DeviceMesh& mesh) {
      auto stack = MakeStack(false);
      int64_t trainable_elements = 0;
      for (auto& [name, p] : stack->NamedParameters()) {
        p->requires_grad = frozen.count(name) == 0;
      }
      const std::vector<FsdpUnit*> units = PerLayer()(stack.get(), &mesh);
      ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
      for (FsdpUnit* u : units) {
        trainable_elements += u->gradient_segment_elements();
      }
      EXPECT_EQ(units[0]->gradient_segment_elements(), 0);
      EXPECT_GT(units[1]->gradient_segment_elements(), 0);
      EXPECT_LT(units[1]->gradient_segment_elements(),
                units[1]->segment_elements());
      const int64_t rows = kBatch / world;
      for (int step = 0; step < 2; ++step) {
        nn::CrossEntropyLoss loss;
        ASSERT_TRUE(Forward(stack.get(), &loss, rank * rows, rows, false).ok());
        absl::Status s = Backward(stack.get(), &loss);
        ASSERT_TRUE(s.ok()) << s;
      }
      EXPECT_EQ(units[0]->stats().reduce_scatters, 0);
      int64_t reduced = 0;
      for (FsdpUnit* u : units) reduced += u->stats().reduce_scatter_elements;
      EXPECT_EQ(reduced, 2 * world * trainable_elements);
      for (ShardedParameter* sp : ShardedParameters(stack.get())) {
        const bool is_frozen = frozen.count(sp->name) > 0;
        EXPECT_EQ(sp->requires_grad, !is_frozen) << sp->name;
        absl::StatusOr<Tensor> param = sp->master.FullTensor();
        ASSERT_TRUE(param.ok()) << sp->name;
        EXPECT_EQ(testing_util::Values(*param), ref.params.at(sp->name))
            << sp->name;
        if (is_frozen) {
          EXPECT_FALSE(sp->grad.local().defined()) << sp->name;
          continue;
        }
        absl::StatusOr<Tensor> grad = sp->grad.FullTensor();
        ASSERT_TRUE(grad.ok()) << sp->name;
        // Two backwards accumulate twice the one-step gradient.
        std::vector<double> want = ref.grads.at(sp->name);
        for (double& v : want) v *= 2;
        EXPECT_TRUE(testing_util::AllClose(testing_util::Values(*grad), want,
                                           1e-5, 1e-5))
            << sp->name;
      }
    });
  }
}

// A parameter frozen when its unit was made that still gets a gradient
// (requires_grad set back to true after FullyShard) is refused, by name.
TEST(FullyShardTest, FrozenParameterWithAGradientIsAnError) {
  testing_util::RunOnMesh({{"dp", 2}}, [&](int rank, DeviceMesh& mesh) {
    auto stack = MakeStack(false);
    Parameter* head = nullptr;
    for (auto& [name, p] : stack->NamedParameters()) {
      if (name == "3.weight") head = p;
    }
    ASSERT_NE(head, nullptr);
    head->requires_grad = false;
    PerLayer()(stack.get(), &mesh);
    ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
    head->requires_grad = true;
    nn::CrossEntropyLoss loss;
    ASSERT_TRUE(Forward(stack.get(), &loss, rank * 3, 3, false).ok());
    const absl::Status s = Backward(stack.get(), &loss);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "'3.weight' was frozen")) << s;
  });
}

// The unsharded bytes of a unit's parameters (f32).
int64_t UnshardedBytes(FsdpUnit* unit) {
  int64_t n = 0;
  for (ShardedParameter& sp : unit->parameters()) n += NumElements(sp.shape);
  return n * 4;
}

TEST(FullyShardTest, ReshardAfterForwardFreesUnshardedParameters) {
  for (int world : {1, 2}) {
    for (bool zero3 : {true, false}) {
      SCOPED_TRACE(absl::StrCat(zero3 ? "ZeRO-3" : "ZeRO-2", " W=", world));
      // Thread ranks share the allocator: comm-buffer bytes (all-gather
      // outputs, unsharded parameters) are read between barriers as sums.
      CpuAllocator alloc;
      Allocator* previous = SetAllocator(&alloc);
      testing_util::RunOnMesh({{"dp", world}}, [&](int rank, DeviceMesh& mesh) {
        auto stack = MakeStack();
        const std::vector<FsdpUnit*> units =
            PerLayer(zero3)(stack.get(), &mesh);
        ASSERT_TRUE(InitShardedWeights(stack.get(), kSeed).ok());
        FsdpUnit* root = units.back();
        ASSERT_GT(UnshardedBytes(root), 0);  // The LayerNorm.
        int64_t all_bytes = 0;
        for (FsdpUnit* u : units) all_bytes += UnshardedBytes(u);
        const int64_t rows = kBatch / world;
        // Step 2 prefetches in the recorded order; its "before" includes
        // Gloo's reduce-scatter scratch from step 1.
        for (int step = 0; step < 2; ++step) {
          int64_t before = 0;
          Barrier(mesh);
          if (rank == 0)
            before = alloc.Stats().current_of(MemoryTag::kCommBuffers);
          Barrier(mesh);
          nn::CrossEntropyLoss loss;
          ASSERT_TRUE(
              Forward(stack.get(), &loss, rank * rows, rows, false).ok());
          Barrier(mesh);
          // On one rank (f32) the parameters are views of the masters.
          if (rank == 0) {
            EXPECT_EQ(
                alloc.Stats().current_of(MemoryTag::kCommBuffers) - before,
                world == 1 ? 0
                           : world * (zero3 ? UnshardedBytes(root) : all_bytes))
                << "step " << step;
          }
          Barrier(mesh);
          for (FsdpUnit* u : units) {
            for (ShardedParameter& sp : u->parameters()) {
              EXPECT_EQ(sp.parameter->data.is_meta(), zero3 && !u->is_root())
                  << "after forward, step " << step << ": " << sp.name;
            }
          }
          ASSERT_TRUE(Backward(stack.get(), &loss).ok());
          for (FsdpUnit* u : units) {
            for (ShardedParameter& sp : u->parameters()) {
              EXPECT_TRUE(sp.parameter->data.is_meta())
                  << "after backward, step " << step << ": " << sp.name;
            }
          }
        }
      });
      SetAllocator(previous);
    }
  }
}

// The plan as lists of module names.
std::vector<std::vector<std::string>> PlanNames(Module* root,
                                                const WrapPredicate& predicate,
                                                TiedParameterPolicy tied) {
  std::vector<std::vector<std::string>> out;
  absl::StatusOr<std::vector<WrapGroup>> plan =
      PlanAutoWrap(root, predicate, tied);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  for (const WrapGroup& g : *plan) {
    out.emplace_back();
    for (const auto& [name, m] : g.modules) out.back().push_back(name);
  }
  return out;
}

TEST(FullyShardTest, AutoWrapPlansAndTiedWeights) {
  using Names = std::vector<std::vector<std::string>>;
  using P = TiedParameterPolicy;
  auto stack = MakeStack();
  EXPECT_EQ(PlanNames(stack.get(), WrapModuleKinds({"Linear"}), P::kGroup),
            (Names{{"1.fc"}, {"1.proj"}, {"3"}}));
  // Embedding 42 elements, Mlp 28 + 30 (neither Linear alone), head 35.
  EXPECT_EQ(PlanNames(stack.get(), WrapMinParameters(40), P::kGroup),
            (Names{{"0"}, {"1"}}));
  // The tied head joins the embedding's unit, or both go to the root.
  auto tied = MakeStack(/*tied=*/true);
  const WrapPredicate kinds = WrapModuleKinds({"Embedding", "Mlp"});
  EXPECT_EQ(PlanNames(tied.get(), kinds, P::kGroup),
            (Names{{"1"}, {"0", "3"}}));
  EXPECT_EQ(PlanNames(tied.get(), kinds, P::kLeaveToRoot), (Names{{"1"}}));

  const Result ref = RunReference(/*tied=*/true);
  for (auto [world, policy] :
       {std::pair{2, P::kGroup}, std::pair{3, P::kLeaveToRoot}}) {
    const bool group = policy == P::kGroup;
    const std::string what =
        absl::StrCat("W=", world, group ? " kGroup" : " kLeaveToRoot");
    Plan wrap = [&](nn::Sequential* s, DeviceMesh* mesh) {
      AutoWrapOptions options;
      options.shard.mesh = mesh;
      options.tied = policy;
      absl::StatusOr<std::vector<FsdpUnit*>> units =
          AutoWrap(s, kinds, options);
      CHECK_OK(units.status());
      EXPECT_EQ(units->size(), group ? 3u : 2u) << what;
      EXPECT_EQ((*units)[0]->name(), "Mlp") << what;
      EXPECT_EQ((*units)[1]->name(), group ? "Embedding+..." : "Sequential")
          << what;
      EXPECT_TRUE(units->back()->is_root()) << what;
      return *units;
    };
    ExpectParity(ref, RunSharded(world, /*tied=*/true, wrap), what);
  }
}

// name -> bytes of this rank's master shard.
std::map<std::string, std::vector<char>> LocalShards(Module* model) {
  std::map<std::string, std::vector<char>> out;
  const NamedDTensors state = *ShardedStateDict(model);
  for (auto& [name, t] : state) {
    std::vector<char>& bytes = out[name];
    bytes.resize(t.local().nbytes());
    if (!bytes.empty())
      std::memcpy(bytes.data(), t.local().raw_data(), bytes.size());
  }
  return out;
}

TEST(FullyShardTest, ShardedStateDictRoundTripsAndLoadsStrictly) {
  const Result ref = RunReference(/*tied=*/false);
  testing_util::RunOnMesh({{"dp", 2}}, [&](int rank, DeviceMesh& mesh) {
    auto Sharded = [&](uint64_t seed) {
      auto stack = MakeStack();
      PerLayer()(stack.get(), &mesh);
      CHECK_OK(InitShardedWeights(stack.get(), seed));
      return stack;
    };
    auto source = Sharded(kSeed);
    const auto want = LocalShards(source.get());
    // Deep copy: the state dict's DTensors are views of the masters.
    NamedDTensors snapshot;
    const NamedDTensors state = *ShardedStateDict(source.get());
    for (auto& [name, t] : state) {
      Tensor copy = *Tensor::Empty(t.local().shape(), t.dtype(), Device::Cpu());
      CHECK_OK(Copy(t.local(), &copy));
      snapshot.emplace_back(
          name, *DTensor::FromLocal(copy, t.mesh(), t.placements(), t.shape()));
    }
    auto target = Sharded(kSeed + 1);
    EXPECT_NE(LocalShards(target.get()), want);
    absl::Status s = LoadShardedStateDict(target.get(), snapshot);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(LocalShards(target.get()), want);
    // And the loaded stack is the unsharded stack's weights.
    absl::StatusOr<NamedTensors> full = FullStateDict(target.get());
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full->size(), rank == 0 ? ref.params.size() : 0u);
    for (auto& [name, t] : *full) {
      EXPECT_EQ(testing_util::Values(t), ref.params.at(name)) << name;
    }

    // A missing key fails on every rank and writes nothing.
    NamedDTensors missing;
    for (auto& entry : snapshot) {
      if (entry.first != "2.bias") missing.push_back(entry);
    }
    ASSERT_EQ(missing.size() + 1, snapshot.size());
    auto other = Sharded(kSeed + 2);
    const auto before = LocalShards(other.get());
    s = LoadShardedStateDict(other.get(), missing);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_EQ(s.message(), "LoadShardedStateDict: missing keys [2.bias]");
    EXPECT_EQ(LocalShards(other.get()), before);
  });
}

// Checks that `status` failed with `part` in its message.
void ExpectError(const absl::Status& status, const std::string& part) {
  EXPECT_FALSE(status.ok()) << "expected an error with '" << part << "'";
  EXPECT_NE(status.message().find(part), absl::string_view::npos) << status;
}

TEST(FullyShardTest, ErrorsNameTheProblem) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    FullyShardOptions options;
    options.mesh = &mesh;
    auto stack = MakeStack();
    ASSERT_TRUE(FullyShard({stack->at(3)}, options).ok());
    absl::StatusOr<FsdpUnit*> again = FullyShard({stack->at(3)}, options);
    EXPECT_TRUE(absl::IsFailedPrecondition(again.status())) << again.status();
    EXPECT_EQ(again.status().message(),
              "FullyShard: module Linear is already sharded (unit 'Linear')");
    // AutoWrap names the group that failed.
    AutoWrapOptions wrap;
    wrap.shard = options;
    ExpectError(
        AutoWrap(stack.get(), WrapModuleKinds({"Linear"}), wrap).status(),
        "AutoWrap: sharding [3]: FullyShard: module Linear is already "
        "sharded");
    // A tied weight split over two units.
    auto tied = MakeStack(/*tied=*/true);
    ASSERT_TRUE(FullyShard({tied->at(0)}, options).ok());
    absl::Status split = FullyShard({tied->at(3)}, options).status();
    ExpectError(split, "is already in unit 'Embedding'");
    ExpectError(split, "a parameter shared by two units");
    // No mesh; no FSDP unit.
    ExpectError(FullyShard({tied->at(2)}, FullyShardOptions()).status(),
                "needs a 1-D (shard) or 2-D (replicate, shard) mesh");
    ExpectError(ShardedStateDict(MakeStack().get()).status(),
                "parameter '0.weight' is in no FSDP unit");
    // A tensor-parallel piece without the tp axis named.
    auto cut = MakeStack();
    Parameter* w = cut->at(1)->NamedParameters()[0].second;
    const Shape whole = w->shape;
    ASSERT_TRUE(w->SetPiece({whole,
                             Shape(whole.size(), 0),
                             {whole[0] / 2, whole[1]},
                             {whole[0] / 2, whole[1]}})
                    .ok());
    ExpectError(FullyShard({cut->at(1)}, options).status(),
                "is a tensor-parallel piece: set FullyShardOptions::tp_axis");
    EXPECT_EQ(UnitOf(cut->at(1)), nullptr);
  });
}

}  // namespace
}  // namespace fsdp
}  // namespace fsdpp
