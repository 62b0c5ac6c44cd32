// Test harness for fully_shard: the unsharded single-process reference and
// the same training under FSDP on thread ranks (real Gloo), with hook points
// for tests that probe memory, collectives or prefetching along the way.
//
// Both runs train a Transformer for a few steps on a fixed synthetic batch;
// the FSDP run gives every rank its rows of the batch and averages, so with
// SGD the losses, last-step gradients and final parameters must match the
// reference (ExpectParity). The FSDP run's plan is the usual one: one unit per
// block, then the root.
#ifndef FSDPP_TESTS_FSDP_TESTING_H_
#define FSDPP_TESTS_FSDP_TESTING_H_

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace fsdp {
namespace parity {

// Init seed, batch shape (rows x tokens) and SGD learning rate of every run.
inline constexpr uint64_t kSeed = 1234;
inline constexpr int64_t kBatch = 12, kSeq = 8;
inline constexpr float kLr = 0.05f;

// A named debug config with `n_layers` blocks (0 keeps the config's).
inline models::TransformerConfig DebugConfig(const std::string& name,
                                             int64_t n_layers = 0) {
  models::TransformerConfig config = *models::ConfigByName(name);
  if (n_layers > 0) config.n_layers = n_layers;
  return config;
}

// The ids and targets of step `step`, [kBatch, kSeq] row-major.
struct Batch {
  std::vector<int64_t> ids, targets;
};

// The deterministic synthetic batch of step `step` over a `vocab` vocabulary.
inline Batch MakeBatch(int64_t vocab, int step) {
  Batch b;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    b.ids.push_back((i * 7 + step * 13 + i / kSeq) % vocab);
    b.targets.push_back((i * 5 + step * 3 + 1) % vocab);
  }
  return b;
}

// Rows [row_begin, row_begin + rows) of the batch as [rows, kSeq] tensors.
inline std::pair<Tensor, Tensor> Slice(const Batch& b, int64_t row_begin,
                                       int64_t rows) {
  std::vector<int64_t> ids(b.ids.begin() + row_begin * kSeq,
                           b.ids.begin() + (row_begin + rows) * kSeq);
  std::vector<int64_t> t(b.targets.begin() + row_begin * kSeq,
                         b.targets.begin() + (row_begin + rows) * kSeq);
  return {*Tensor::FromInts({rows, kSeq}, ids),
          *Tensor::FromInts({rows, kSeq}, t)};
}

// Blocks until every rank of `mesh` got here.
inline void Barrier(DeviceMesh& mesh) {
  CHECK_OK((*(*mesh.FlatGroup())->Barrier())->Wait());
}

// What a training run produced (the FSDP run fills it from rank 0).
struct TrainResult {
  std::vector<float> losses;                          // per step
  std::map<std::string, std::vector<double>> grads;   // of the last step
  std::map<std::string, std::vector<double>> params;  // after the steps
};

// One process, whole model, whole batch, SGD on f32 params.
inline TrainResult RunReference(const models::TransformerConfig& config,
                                int steps) {
  auto model = *models::Transformer::Create(config);
  CHECK_OK(model->ToEmpty(Device::Cpu()));
  CHECK_OK(model->InitWeights(kSeed));
  TrainResult result;
  for (int step = 0; step < steps; ++step) {
    Batch batch = MakeBatch(config.vocab_size, step);
    auto [ids, targets] = Slice(batch, 0, kBatch);
    CHECK_OK(model->ZeroGrad());
    result.losses.push_back(*model->ForwardLoss(ids, targets));
    CHECK_OK(model->Backward());
    for (auto& [name, p] : model->NamedParameters()) {
      if (step == steps - 1)
        result.grads[name] = ::fsdpp::testing_util::Values(p->grad);
      CHECK_OK(Axpy(-kLr, p->grad, &p->data));
    }
  }
  for (auto& [name, p] : model->NamedParameters()) {
    result.params[name] = ::fsdpp::testing_util::Values(p->data);
  }
  return result;
}

// The units of one rank's model.
struct Units {
  std::vector<FsdpUnit*> blocks;  // in model order
  FsdpUnit* root = nullptr;
};

// How to run the FSDP side, and where to look in.
struct FsdpRun {
  std::vector<MeshAxis> axes;
  FullyShardOptions options;  // `mesh` is filled in per rank
  // Adjusts the options of block `index` (e.g. keep the last one unsharded).
  std::function<void(size_t index, FullyShardOptions* options)> block_options;
  int steps = 3;
  // Gather the last step's gradients and the final parameters into the
  // result (allocates comm buffers at the last step).
  bool collect = true;
  // Per rank, after sharding and initialisation (e.g. explicit prefetching,
  // probe hooks, resetting memory peaks).
  std::function<void(int rank, DeviceMesh& mesh, models::Transformer& model,
                     const Units& units)>
      setup;
  // Per rank, between the forward and the backward of `step`.
  std::function<void(int rank, int step, DeviceMesh& mesh)> after_forward;
  // Per rank, at the end of `step` (after the update).
  std::function<void(int rank, int step, DeviceMesh& mesh)> after_step;
  // The update of the masters from the gradients (default: SGD with kLr).
  std::function<void(int rank, const std::vector<ShardedParameter*>& params)>
      update;
  // Per rank, after the last step, before the model is destroyed.
  std::function<void(int rank, DeviceMesh& mesh, const Units& units)> finish;
};

// The same training as RunReference under FSDP: every rank takes its rows of
// the batch (kBatch must divide by the mesh size).
inline TrainResult RunFsdp(const models::TransformerConfig& config,
                           const FsdpRun& run) {
  TrainResult result;
  ::fsdpp::testing_util::RunOnMesh(run.axes, [&](int rank, DeviceMesh& mesh) {
    auto model = *models::Transformer::Create(config);
    FullyShardOptions options = run.options;
    options.mesh = &mesh;
    Units units;
    for (size_t i = 0; i < model->blocks().size(); ++i) {
      FullyShardOptions block = options;
      if (run.block_options) run.block_options(i, &block);
      absl::StatusOr<FsdpUnit*> unit = FullyShard({model->blocks()[i]}, block);
      ASSERT_TRUE(unit.ok()) << unit.status();
      units.blocks.push_back(*unit);
    }
    absl::StatusOr<FsdpUnit*> root = FullyShard({model.get()}, options);
    ASSERT_TRUE(root.ok()) << root.status();
    units.root = *root;
    ASSERT_TRUE(InitShardedWeights(model.get(), kSeed).ok());
    std::vector<ShardedParameter*> params = ShardedParameters(model.get());
    if (run.setup) run.setup(rank, mesh, *model, units);
    const int64_t rows = kBatch / mesh.size();
    for (int step = 0; step < run.steps; ++step) {
      Batch batch = MakeBatch(config.vocab_size, step);
      for (ShardedParameter* sp : params) {
        Tensor g = *sp->grad.mutable_local();
        CHECK_OK(Zero(&g));
      }
      auto [ids, targets] = Slice(batch, rank * rows, rows);
      absl::StatusOr<float> loss = model->ForwardLoss(ids, targets);
      ASSERT_TRUE(loss.ok()) << loss.status();
      if (run.after_forward) run.after_forward(rank, step, mesh);
      absl::Status s = model->Backward();
      ASSERT_TRUE(s.ok()) << s;
      float l32 = *loss;
      Buffer b{&l32, 1, DType::kF32, Device::Cpu()};
      ASSERT_TRUE(
          (*(*mesh.FlatGroup())->AllReduce(b, ReduceOp::kAvg))->Wait().ok());
      if (rank == 0) result.losses.push_back(l32);
      if (run.collect && step == run.steps - 1) {
        for (ShardedParameter* sp : params) {
          Tensor full = *sp->grad.FullTensor();
          if (rank == 0)
            result.grads[sp->name] = ::fsdpp::testing_util::Values(full);
        }
      }
      if (run.update) {
        run.update(rank, params);
      } else {
        for (ShardedParameter* sp : params) {
          Tensor master = *sp->master.mutable_local();
          CHECK_OK(Axpy(-kLr, sp->grad.local(), &master));
        }
      }
      if (run.after_step) run.after_step(rank, step, mesh);
    }
    if (run.collect) {
      for (ShardedParameter* sp : params) {
        Tensor full = *sp->master.FullTensor();
        if (rank == 0)
          result.params[sp->name] = ::fsdpp::testing_util::Values(full);
      }
    }
    if (run.finish) run.finish(rank, mesh, units);
  });
  return result;
}

// Losses, gradients and parameters agree within rtol / atol (gradients:
// atol relative to the largest magnitude of each gradient).
inline void ExpectParity(const TrainResult& ref, const TrainResult& got,
                         double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i],
                rtol * std::fabs(ref.losses[i]) + atol)
        << what << " step " << i;
  }
  ASSERT_EQ(got.grads.size(), ref.grads.size()) << what;
  for (auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << what << " " << name;
    double scale = 0;
    for (double v : g) scale = std::max(scale, std::fabs(v));
    EXPECT_TRUE(::fsdpp::testing_util::AllClose(got.grads.at(name), g, rtol,
                                                atol * scale + 1e-12))
        << what << " grad " << name;
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (auto& [name, p] : ref.params) {
    ASSERT_TRUE(got.params.count(name)) << what << " " << name;
    EXPECT_TRUE(
        ::fsdpp::testing_util::AllClose(got.params.at(name), p, rtol, atol))
        << what << " param " << name;
  }
}

// Bitwise equality of two runs (same numbers, not just close ones).
inline void ExpectIdentical(const TrainResult& a, const TrainResult& b,
                            const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_EQ(a.grads, b.grads) << what;
  EXPECT_EQ(a.params, b.params) << what;
}

}  // namespace parity
}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_TESTS_FSDP_TESTING_H_
