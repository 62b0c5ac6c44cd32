// A user's FSDP program built against fsdpp's libraries from another Bazel
// workspace (docs/USING.md walks through it): a small MLP classifier sharded
// with fsdp::FullyShard over a 1-D mesh, trained with sharded AdamW, saved
// with a distributed checkpoint and resumed from it.
//
// It checks what a user relies on and prints "train_fsdp ok" when all hold:
//   * 2 ranks train to the losses of 1 rank (each rank takes its half of
//     every batch; FSDP's reduce-scatter averages the gradients);
//   * a run stopped after step 3 and resumed from its checkpoint ends with
//     the parameters of the run that was never stopped, bit for bit.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/training/training_state.h"
#include "comm/host_collectives.h"
#include "core/status.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "mesh/ranks.h"
#include "nn/linear.h"
#include "nn/loss.h"
#include "nn/mlp.h"
#include "nn/sequential.h"
#include "optim/adamw.h"
#include "optim/clip.h"

namespace {

using fsdpp::DeviceMesh;
using fsdpp::Tensor;

constexpr int64_t kIn = 16, kHidden = 32, kClasses = 8, kBatch = 8;
constexpr int kSteps = 6;
constexpr uint64_t kSeed = 7;

// Batch `step`, rows [begin, begin + rows): a fixed function of the indices.
absl::Status MakeBatch(int step, int64_t begin, int64_t rows, Tensor* x,
                       Tensor* targets) {
  std::vector<float> xs;
  std::vector<int64_t> ts;
  for (int64_t r = begin; r < begin + rows; ++r) {
    for (int64_t j = 0; j < kIn; ++j) {
      xs.push_back(std::sin(0.3f * static_cast<float>(r * kIn + j + step)));
    }
    ts.push_back((r * 3 + step) % kClasses);
  }
  FSDPP_ASSIGN_OR_RETURN(*x, Tensor::FromFloats({rows, kIn}, xs));
  FSDPP_ASSIGN_OR_RETURN(*targets, Tensor::FromInts({rows}, ts));
  return absl::OkStatus();
}

struct Run {
  std::vector<double> losses;              // rank 0's view: the global mean
  std::vector<std::vector<float>> params;  // gathered, after the last step
};

// Trains steps [first, last) on this rank; resumes from `resume` (a
// checkpoint directory) when it is not empty, and saves step `save_at` under
// `folder` when it is > 0.
absl::Status Train(int rank, DeviceMesh& mesh, int first, int last,
                   const std::string& resume, const std::string& folder,
                   int save_at, Run* out) {
  // The model: Mlp(16 -> 32 -> 16, GELU) then a linear head; each a FSDP
  // unit, then the root (what FullyShard of the blocks, then the model, is
  // in PyTorch FSDP2). Parameters start on the meta device and are
  // materialised sharded: each rank initialises only its shards.
  fsdpp::nn::Sequential model;
  fsdpp::nn::Mlp* mlp =
      model.Append(std::make_unique<fsdpp::nn::Mlp>(kIn, kHidden, 0.2f, 0.2f));
  fsdpp::nn::Linear* head = model.Append(
      std::make_unique<fsdpp::nn::Linear>(kIn, kClasses, true, 0.2f));
  fsdpp::fsdp::FullyShardOptions shard;
  shard.mesh = &mesh;
  for (fsdpp::Module* m :
       {static_cast<fsdpp::Module*>(mlp), static_cast<fsdpp::Module*>(head),
        static_cast<fsdpp::Module*>(&model)}) {
    FSDPP_RETURN_IF_ERROR(fsdpp::fsdp::FullyShard({m}, shard).status());
  }
  FSDPP_RETURN_IF_ERROR(fsdpp::fsdp::InitShardedWeights(&model, kSeed));

  // AdamW over the sharded fp32 masters, each with its sharded gradient.
  std::vector<fsdpp::AdamWParam> adam_params;
  std::vector<fsdpp::DTensor*> grads;
  for (fsdpp::fsdp::ShardedParameter* sp :
       fsdpp::fsdp::ShardedParameters(&model)) {
    adam_params.emplace_back(sp->name, &sp->master, &sp->grad);
    grads.push_back(&sp->grad);
  }
  fsdpp::AdamWOptions adam_options;
  adam_options.lr = 1e-2;
  FSDPP_ASSIGN_OR_RETURN(fsdpp::AdamW adamw,
                         fsdpp::AdamW::Create(adam_params, adam_options));

  // The training state as one checkpoint (DCP's get_state_dict): the
  // masters, AdamW's moments and its step, each rank saving and loading
  // only its shards; a load writes them in place and sets the step.
  FSDPP_ASSIGN_OR_RETURN(fsdpp::TrainingState training,
                         fsdpp::TrainingState::Create(
                             fsdpp::fsdp::ShardedParameters(&model), &adamw));
  if (!resume.empty()) FSDPP_RETURN_IF_ERROR(training.Load(resume).status());

  FSDPP_ASSIGN_OR_RETURN(fsdpp::ProcessGroup * world, mesh.FlatGroup());
  const int64_t rows = kBatch / mesh.size();
  for (int step = first; step < last; ++step) {
    // optim's ZeroGrad zeroes the sharded gradients FSDP reduces into.
    FSDPP_RETURN_IF_ERROR(fsdpp::ZeroGrad(grads));
    Tensor x, targets;
    FSDPP_RETURN_IF_ERROR(MakeBatch(step, rank * rows, rows, &x, &targets));
    fsdpp::nn::CrossEntropyLoss loss;
    FSDPP_ASSIGN_OR_RETURN(Tensor logits, model.Forward(x));
    FSDPP_ASSIGN_OR_RETURN(float value, loss.Forward(logits, targets));
    FSDPP_ASSIGN_OR_RETURN(Tensor dlogits, loss.Backward());
    FSDPP_RETURN_IF_ERROR(model.Backward(dlogits).status());
    FSDPP_RETURN_IF_ERROR(adamw.Step());
    std::vector<double> mean = {value};
    FSDPP_RETURN_IF_ERROR(
        fsdpp::AllReduceValues(world, &mean, fsdpp::ReduceOp::kAvg));
    if (rank == 0) out->losses.push_back(mean[0]);
    if (step + 1 == save_at) {
      fsdpp::SaveOptions save;
      save.mesh = &mesh;
      FSDPP_RETURN_IF_ERROR(training.Save(folder, save_at, save).status());
    }
  }
  for (fsdpp::fsdp::ShardedParameter* sp :
       fsdpp::fsdp::ShardedParameters(&model)) {
    FSDPP_ASSIGN_OR_RETURN(Tensor full, sp->master.FullTensor());
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> values, full.ToFloats());
    if (rank == 0) out->params.push_back(std::move(values));
  }
  return absl::OkStatus();
}

absl::Status TrainOn(int world, int first, int last, const std::string& resume,
                     const std::string& folder, int save_at, Run* out) {
  return fsdpp::RunOnThreads({{"dp", world}}, [&](int rank, DeviceMesh& mesh) {
    return Train(rank, mesh, first, last, resume, folder, save_at, out);
  });
}

bool SameBits(const std::vector<std::vector<float>>& a,
              const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float))) {
      return false;
    }
  }
  return true;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "train_fsdp FAILED: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string folder =
      argc > 1 ? argv[1] : absl::StrCat("/tmp/train_fsdp_", ::getpid());
  Run one, two, first_half, resumed;
  if (absl::Status s = TrainOn(1, 0, kSteps, "", "", 0, &one); !s.ok()) {
    return Fail(s.ToString());
  }
  if (absl::Status s = TrainOn(2, 0, kSteps, "", "", 0, &two); !s.ok()) {
    return Fail(s.ToString());
  }
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    worst = std::max(worst,
                     std::fabs(two.losses[i] - one.losses[i]) / one.losses[i]);
  }
  std::printf("losses, 1 rank:  ");
  for (double l : one.losses) std::printf(" %.6f", l);
  std::printf("\nlosses, 2 ranks: ");
  for (double l : two.losses) std::printf(" %.6f", l);
  std::printf("\nlargest relative difference: %.2e\n", worst);
  if (!(worst < 1e-5)) return Fail("2 ranks do not train to 1 rank's losses");

  // Stopped after step 3 (saved), then resumed from that checkpoint.
  if (absl::Status s = TrainOn(2, 0, 3, "", folder, 3, &first_half); !s.ok()) {
    return Fail(s.ToString());
  }
  const std::string checkpoint = folder + "/step-3";
  if (absl::Status s = TrainOn(2, 3, kSteps, checkpoint, "", 0, &resumed);
      !s.ok()) {
    return Fail(s.ToString());
  }
  if (!SameBits(resumed.params, two.params)) {
    return Fail("the resumed run's parameters differ from the uninterrupted");
  }
  std::printf("resumed from %s: parameters bitwise equal\n",
              checkpoint.c_str());
  std::printf("train_fsdp ok\n");
  return 0;
}
