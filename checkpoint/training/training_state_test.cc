// TrainingState on thread ranks over Gloo: a sharded Linear's masters, AdamW's
// moments and step saved in one call and loaded in one call into a fresh
// model and optimizer, bitwise, at the same and at another world size; a
// step that is not a count is refused.
#include "checkpoint/training/training_state.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "core/status.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "nn/linear.h"
#include "nn/sequential.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

std::string Root(const std::string& name) {
  return std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
}

// A sharded two-layer stack with AdamW, `steps` steps taken.
struct Trained {
  std::unique_ptr<nn::Sequential> model;
  std::unique_ptr<AdamW> adamw;
  std::vector<DTensor*> grads;
};

Trained Make(DeviceMesh& mesh) {
  Trained t;
  t.model = std::make_unique<nn::Sequential>();
  t.model->Append(std::make_unique<nn::Linear>(6, 8, true, 0.3f));
  t.model->Append(std::make_unique<nn::Linear>(8, 3, true, 0.3f));
  fsdp::FullyShardOptions options;
  options.mesh = &mesh;
  CHECK_OK(fsdp::FullyShard({t.model.get()}, options).status());
  CHECK_OK(fsdp::InitShardedWeights(t.model.get(), 3));
  std::vector<AdamWParam> params;
  for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(t.model.get())) {
    params.emplace_back(sp->name, &sp->master, &sp->grad);
    t.grads.push_back(&sp->grad);
  }
  t.adamw = std::make_unique<AdamW>(*AdamW::Create(params));
  return t;
}

// One step on a fixed batch of 4 rows, split over the ranks.
void Step(Trained& t, int rank, int world) {
  CHECK_OK(ZeroGrad(t.grads));
  const int64_t rows = 4 / world;
  std::vector<float> x;
  for (int64_t i = rank * rows * 6; i < (rank + 1) * rows * 6; ++i) {
    x.push_back(0.1f * static_cast<float>(i % 7) - 0.3f);
  }
  Tensor in = *Tensor::FromFloats({rows, 6}, x);
  Tensor y = *t.model->Forward(in);
  Tensor dy = *Tensor::Empty(y.shape(), DType::kF32, Device::Cpu());
  CHECK_OK(Fill(&dy, 0.25f));
  CHECK_OK(t.model->Backward(dy).status());
  CHECK_OK(t.adamw->Step());
}

// Every master and moment, gathered (a collective: every rank calls it), by
// name.
std::map<std::string, std::vector<float>> Values(Trained& t) {
  std::map<std::string, std::vector<float>> out;
  for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(t.model.get())) {
    out[sp->name] = *sp->master.FullTensor()->ToFloats();
  }
  const OptimizerStateDict optim = *t.adamw->StateDict();
  for (const auto& [name, d] : optim.tensors) {
    out[name] = *d.FullTensor()->ToFloats();
  }
  return out;
}

// Loads `dir` into `fresh` in one call (not strict: the values the saving
// program added are not this one's).
absl::Status LoadInto(Trained& fresh, const std::string& dir) {
  FSDPP_ASSIGN_OR_RETURN(
      TrainingState state,
      TrainingState::Create(fsdp::ShardedParameters(fresh.model.get()),
                            fresh.adamw.get()));
  LoadOptions lenient;
  lenient.strict = false;
  return state.Load(dir, lenient).status();
}

TEST(TrainingStateTest, OneCallSavesAndOneCallResumesBitwise) {
  const std::string folder = Root("training_state");
  std::map<std::string, std::vector<float>> saved, loaded_w2, loaded_w1;
  int64_t step_w2 = 0, step_w1 = 0;
  testing_util::RunOnMesh({{"dp", 2}}, [&](int rank, DeviceMesh& mesh) {
    Trained t = Make(mesh);
    for (int s = 0; s < 2; ++s) Step(t, rank, 2);
    absl::StatusOr<TrainingState> state = TrainingState::Create(
        fsdp::ShardedParameters(t.model.get()), t.adamw.get());
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_TRUE(state->state().AddBytes("data/position", "17").ok());
    SaveOptions options;
    options.mesh = &mesh;
    ASSERT_TRUE(state->Save(folder, 2, options).ok());
    // Gathered on every rank (a collective), kept from rank 0.
    const auto values = Values(t);
    if (rank == 0) saved = values;
    // A fresh model and optimizer, resumed.
    Trained fresh = Make(mesh);
    absl::StatusOr<TrainingState> again = TrainingState::Create(
        fsdp::ShardedParameters(fresh.model.get()), fresh.adamw.get());
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(again->state().AddBytes("data/position", "").ok());
    ASSERT_TRUE(again->Load(folder + "/step-2").ok());
    EXPECT_EQ(*again->state().bytes("data/position"), "17");
    const auto fresh_values = Values(fresh);
    if (rank == 0) {
      loaded_w2 = fresh_values;
      step_w2 = fresh.adamw->step();
    }
  });
  // At world size 1, from the 2-rank checkpoint.
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    Trained fresh = Make(mesh);
    const absl::Status loaded = LoadInto(fresh, folder + "/step-2");
    ASSERT_TRUE(loaded.ok()) << loaded;
    loaded_w1 = Values(fresh);
    step_w1 = fresh.adamw->step();
  });
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.size(), 3u * 4u);  // 4 parameters, each with 2 moments
  for (const auto& [name, values] : saved) {
    ASSERT_EQ(loaded_w2.at(name).size(), values.size()) << name;
    EXPECT_EQ(std::memcmp(loaded_w2.at(name).data(), values.data(),
                          values.size() * sizeof(float)),
              0)
        << name;
    EXPECT_EQ(std::memcmp(loaded_w1.at(name).data(), values.data(),
                          values.size() * sizeof(float)),
              0)
        << name;
  }
  EXPECT_EQ(step_w2, 2);
  EXPECT_EQ(step_w1, 2);
}

TEST(TrainingStateTest, RefusesWhatItCannotUse) {
  EXPECT_EQ(TrainingState::Create({}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string folder = Root("bad_step");
  StateDict bad;
  ASSERT_TRUE(bad.AddBytes("optim/step", "seven").ok());
  ASSERT_TRUE(Save(bad, folder, 1).ok());
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    Trained fresh = Make(mesh);
    const absl::Status s = LoadInto(fresh, folder + "/step-1");
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_EQ(fresh.adamw->step(), 0);
  });
}

}  // namespace
}  // namespace fsdpp
