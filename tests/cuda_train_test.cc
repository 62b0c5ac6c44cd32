// FSDP training on a GPU against the same training on the CPU: GPT-2 and
// Llama (debug configs) built and stepped by the trainer's recipe
// (recipe::Training: the family's FSDP plan over a one-rank mesh, AdamW,
// gradient clipping), on cuda:0 through NCCL with a Gloo mesh for the host
// values as the trainer arranges it, and on the host through Gloo, from the
// same initial weights and batches. The losses of
// every step and the final parameters must agree (f32 within reduction-order
// noise; bf16 compute within bf16 rounding). A last test times GPT-2 124M
// steps on the GPU and prints them (informational, never asserted).
//
// Skips, visibly, without a GPU (and is not built without --config=cuda).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/gloo_backend.h"
#include "comm/nccl_backend.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "core/device_wait.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "nn/checkpoint_wrapper.h"
#include "recipe/layout.h"
#include "recipe/step/step.h"
#include "recipe/training.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

struct RunOptions {
  std::string model = "gpt2_debug";
  Device device = Device::Cpu();
  DType param_dtype = DType::kF32;  // FSDP's compute dtype
  int steps = 4;
  int64_t rows = 4, seq = 32;
  int64_t vocab_pad_multiple = 0;  // 0 keeps the config's
  nn::CheckpointPolicy activation_checkpointing;
  int64_t loss_chunk_tokens = -1;  // recipe::Layout's
};

struct RunResult {
  std::vector<float> losses;
  std::vector<std::string> names;          // parameters, plan order
  std::vector<std::vector<float>> grads0;  // step 0's, before clipping
  std::vector<std::vector<float>> params;  // final masters
  std::vector<double> step_s;
  // The host's blocking waits on the GPU in each step after the first
  // (core/device_wait.h).
  std::vector<int64_t> host_syncs;
};

// The ids (or targets) of the batch every step trains on (one batch, so
// the loss must fall), on `device`.
absl::StatusOr<Tensor> Tokens(const RunOptions& o, int64_t vocab, int salt) {
  std::vector<int64_t> v(o.rows * o.seq);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = (static_cast<int64_t>(i) * (7 + salt) + salt) % vocab;
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor host, Tensor::FromInts({o.rows, o.seq}, v));
  if (o.device.is_cpu()) return host;
  // As the trainer stages its batches: checked here, copied without a wait.
  FSDPP_ASSIGN_OR_RETURN(Tensor on_device,
                         Tensor::Empty(host.shape(), host.dtype(), o.device));
  FSDPP_RETURN_IF_ERROR(CopyBytesFromHostAsync(on_device.raw_data(), o.device,
                                               host.raw_data(), host.nbytes()));
  on_device.MarkIdsCheckedBelow(vocab);
  return on_device;
}

// Waits (bounded) for the kernels issued so far: tensor ops and the AdamW
// kernels run on the legacy default stream, which orders all of them.
absl::Status DeviceIdle(Device device) {
  if (!device.is_cuda()) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<CudaEvent> event,
      CudaEvent::RecordOn(nullptr, device.index(), "step end"));
  return event->Wait(absl::Minutes(2));
}

// One forward and backward of the model unsharded on `o.device` (no FSDP,
// no communication): the loss and every parameter's gradient.
absl::StatusOr<RunResult> PlainStep(const RunOptions& o) {
  FSDPP_ASSIGN_OR_RETURN(models::TransformerConfig config,
                         models::ConfigByName(o.model));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> model,
                         models::Transformer::Create(config));
  FSDPP_RETURN_IF_ERROR(model->ToEmpty(o.device));
  FSDPP_RETURN_IF_ERROR(model->InitWeights(1234));
  FSDPP_ASSIGN_OR_RETURN(Tensor ids, Tokens(o, config.vocab_size, 0));
  FSDPP_ASSIGN_OR_RETURN(Tensor targets, Tokens(o, config.vocab_size, 3));
  RunResult r;
  FSDPP_ASSIGN_OR_RETURN(float loss, model->ForwardLoss(ids, targets));
  r.losses.push_back(loss);
  FSDPP_RETURN_IF_ERROR(model->Backward());
  for (const auto& [name, p] : model->NamedParameters()) {
    r.names.push_back(name);
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> v, p->grad.ToFloats());
    r.grads0.push_back(std::move(v));
  }
  return r;
}

absl::StatusOr<RunResult> Train(const RunOptions& o) {
  InMemoryStore store;
  FSDPP_ASSIGN_OR_RETURN(models::TransformerConfig config,
                         models::ConfigByName(o.model));
  if (o.vocab_pad_multiple > 0) {
    config.vocab_pad_multiple = o.vocab_pad_multiple;
  }
  recipe::Layout layout;
  layout.param_dtype = o.param_dtype;
  layout.micro_batch = o.rows;
  layout.seq_len = o.seq;
  layout.activation_checkpointing = o.activation_checkpointing;
  layout.loss_chunk_tokens = o.loss_chunk_tokens;
  // The trainer's arrangement: NCCL for the mesh on a GPU, and a Gloo mesh
  // of the same axes for the host values (the loss).
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceMesh> mesh,
      DeviceMesh::Create(layout.MeshAxes(), 0, 1,
                         o.device.is_cuda()
                             ? NcclGroupFactory(&store, o.device.index())
                             : GlooGroupFactory(&store),
                         "train"));
  std::unique_ptr<DeviceMesh> host_mesh;
  recipe::BuildOptions options;
  options.seed = 1234;
  options.adamw.lr = 1e-3;
  // As the trainer on a GPU: the loss and norm stay there until read.
  options.step_values_on_device = o.device.is_cuda();
  if (o.device.is_cuda()) {
    FSDPP_ASSIGN_OR_RETURN(
        host_mesh, DeviceMesh::Create(layout.MeshAxes(), 0, 1,
                                      GlooGroupFactory(&store), "host"));
    options.host_mesh = host_mesh.get();
  }
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<recipe::Training> training,
      recipe::Training::Build(config, layout, mesh.get(), options));
  RunResult r;
  for (fsdp::ShardedParameter* sp : training->params()) {
    if (sp->master.local().device() != o.device) {
      return absl::InternalError(absl::StrCat(
          sp->name, " lives on ", sp->master.local().device().ToString(),
          ", not ", o.device.ToString()));
    }
    r.names.push_back(sp->name);
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor ids, Tokens(o, config.vocab_size, 0));
  FSDPP_ASSIGN_OR_RETURN(Tensor targets, Tokens(o, config.vocab_size, 3));
  const recipe::MicroBatchSource batch =
      [&](int64_t) -> absl::StatusOr<recipe::MicroBatch> {
    return recipe::MicroBatch{ids, targets};
  };
  recipe::OptimizerStepOptions optimizer;
  optimizer.lr = 1e-3;
  optimizer.grad_clip = 1.0;
  for (int step = 0; step < o.steps; ++step) {
    FSDPP_RETURN_IF_ERROR(DeviceIdle(o.device));
    const absl::Time t0 = absl::Now();
    const int64_t syncs_before = HostSyncCount();
    FSDPP_ASSIGN_OR_RETURN(recipe::StepLoss loss,
                           training->ForwardBackward(batch));
    for (size_t i = 0; step == 0 && i < training->params().size(); ++i) {
      FSDPP_ASSIGN_OR_RETURN(std::vector<float> v,
                             training->params()[i]->grad.local().ToFloats());
      r.grads0.push_back(std::move(v));
    }
    FSDPP_ASSIGN_OR_RETURN(recipe::OptimizerStepResult applied,
                           training->OptimizerStep(optimizer));
    if (!applied.applied) {
      return absl::InternalError(
          absl::StrCat("step ", step, ": gradient norm ", applied.grad_norm));
    }
    if (step > 0) r.host_syncs.push_back(HostSyncCount() - syncs_before);
    FSDPP_RETURN_IF_ERROR(DeviceIdle(o.device));
    r.step_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    if (!training->values_on_device()) {
      r.losses.push_back(static_cast<float>(loss.loss));
    }
  }
  FSDPP_ASSIGN_OR_RETURN(std::vector<recipe::Training::StepValues> values,
                         training->ReadStepValues());
  for (size_t i = 0; i < values.size(); ++i) {
    if (!values[i].applied()) {
      return absl::InternalError(absl::StrCat(
          "step ", i, ": loss ", values[i].loss, ", gradient norm ",
          values[i].grad_norm, " (AdamW skipped it)"));
    }
    r.losses.push_back(static_cast<float>(values[i].loss));
  }
  for (fsdp::ShardedParameter* sp : training->params()) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> v, sp->master.local().ToFloats());
    r.params.push_back(std::move(v));
  }
  return r;
}

class CudaTrainTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
    RegisterCudaAllocators();
  }
};

// Worst |a - b| / (|b| + 1) over the final parameters.
double MaxParamError(const RunResult& a, const RunResult& b) {
  double worst = 0;
  for (size_t p = 0; p < a.params.size(); ++p) {
    for (size_t i = 0; i < a.params[p].size(); ++i) {
      const double d = std::fabs(a.params[p][i] - b.params[p][i]);
      worst = std::max(worst, d / (std::fabs(b.params[p][i]) + 1.0));
    }
  }
  return worst;
}

// Step 0's gradient of each parameter: worst |gpu - cpu| over the CPU
// gradient's largest magnitude.
void ExpectGradientsMatch(const RunResult& gpu, const RunResult& cpu,
                          double tol) {
  ASSERT_EQ(gpu.grads0.size(), cpu.grads0.size());
  for (size_t p = 0; p < cpu.grads0.size(); ++p) {
    ASSERT_EQ(gpu.grads0[p].size(), cpu.grads0[p].size()) << cpu.names[p];
    double scale = 0, worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < cpu.grads0[p].size(); ++i) {
      scale = std::max(scale, std::fabs(double{cpu.grads0[p][i]}));
      const double d = std::fabs(double{gpu.grads0[p][i]} - cpu.grads0[p][i]);
      if (d > worst) worst = d, at = i;
    }
    const double rel = worst / std::max(scale, 1e-30);
    if (rel > tol) {
      ADD_FAILURE() << cpu.names[p] << ": step 0 gradient differs by " << rel
                    << " of its largest magnitude " << scale << " (element "
                    << at << ": cuda " << gpu.grads0[p][at] << ", cpu "
                    << cpu.grads0[p][at] << ")";
    }
  }
}

// Two runs on the GPU give the same bits: its kernels use no atomics and
// nothing depends on timing (a race between streams would show here).
void ExpectSameBits(const RunResult& a, const RunResult& b) {
  EXPECT_EQ(a.losses, b.losses);
  for (size_t p = 0; p < a.params.size(); ++p) {
    EXPECT_EQ(a.grads0[p], b.grads0[p]) << "step 0 gradient of " << a.names[p];
    EXPECT_EQ(a.params[p], b.params[p]) << "final " << a.names[p];
  }
}

void ExpectMatchesCpu(const char* model, DType param_dtype, double grad_tol,
                      double loss_tol, double param_tol) {
  RunOptions o;
  o.model = model;
  o.param_dtype = param_dtype;
  absl::StatusOr<RunResult> cpu = Train(o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  o.device = Device::Cuda(0);
  absl::StatusOr<RunResult> gpu = Train(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  absl::StatusOr<RunResult> again = Train(o);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameBits(*gpu, *again);
  ExpectGradientsMatch(*gpu, *cpu, grad_tol);
  ASSERT_EQ(gpu->losses.size(), cpu->losses.size());
  for (size_t s = 0; s < cpu->losses.size(); ++s) {
    std::printf("%s %s step %zu: loss cpu %.7f cuda %.7f\n", model,
                DTypeName(param_dtype), s, cpu->losses[s], gpu->losses[s]);
    EXPECT_NEAR(gpu->losses[s], cpu->losses[s],
                loss_tol * std::fabs(cpu->losses[s]))
        << "step " << s;
  }
  // The loss moved: the steps trained something.
  EXPECT_LT(cpu->losses.back(), cpu->losses.front());
  ASSERT_EQ(gpu->params.size(), cpu->params.size());
  const double err = MaxParamError(*gpu, *cpu);
  std::printf("%s %s: worst final parameter error %.3g\n", model,
              DTypeName(param_dtype), err);
  EXPECT_LE(err, param_tol);
}

// The model's kernels alone: one step unsharded on each device.
TEST_P(CudaTrainTest, UnshardedF32GradientsMatchTheCpu) {
  RunOptions o;
  o.model = GetParam();
  absl::StatusOr<RunResult> cpu = PlainStep(o);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  o.device = Device::Cuda(0);
  absl::StatusOr<RunResult> gpu = PlainStep(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::printf("%s unsharded: loss cpu %.7f cuda %.7f\n", GetParam(),
              cpu->losses[0], gpu->losses[0]);
  EXPECT_NEAR(gpu->losses[0], cpu->losses[0], 1e-6 * cpu->losses[0]);
  ExpectGradientsMatch(*gpu, *cpu, 1e-4);
}

TEST_P(CudaTrainTest, F32MatchesTheCpu) {
  // AdamW's first steps move every weight by about lr whatever the gradient's
  // size, so a gradient that is noise-level on one side can move a weight
  // the other way: 2 * lr per step bounds that.
  ExpectMatchesCpu(GetParam(), DType::kF32, 1e-4, 1e-5, 2 * 1e-3 * 4);
}

TEST_P(CudaTrainTest, Bf16ComputeMatchesTheCpu) {
  ExpectMatchesCpu(GetParam(), DType::kBF16, 3e-2, 2e-2, 2 * 1e-3 * 4);
}

// On the GPU (cuDNN's attention in bf16): selective, every:2 and full
// activation checkpointing train to the bits of none; the LM head fused with
// the loss (5-token chunks of 128 rows, f32) matches the unfused head.
TEST_P(CudaTrainTest, CheckpointPoliciesAndTheFusedHead) {
  RunOptions o;
  o.model = GetParam();
  o.device = Device::Cuda(0);
  o.param_dtype = DType::kBF16;
  o.loss_chunk_tokens = 0;
  absl::StatusOr<RunResult> none = Train(o);
  ASSERT_TRUE(none.ok()) << none.status();
  for (const nn::CheckpointPolicy& policy :
       {nn::CheckpointPolicy::Selective(), nn::CheckpointPolicy::Every(2),
        nn::CheckpointPolicy::Full()}) {
    SCOPED_TRACE(policy.ToString());
    o.activation_checkpointing = policy;
    absl::StatusOr<RunResult> r = Train(o);
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSameBits(*r, *none);
  }
  o.activation_checkpointing = nn::CheckpointPolicy::None();
  o.param_dtype = DType::kF32;
  absl::StatusOr<RunResult> unfused = Train(o);
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  o.loss_chunk_tokens = 5;
  absl::StatusOr<RunResult> fused = Train(o);
  ASSERT_TRUE(fused.ok()) << fused.status();
  ExpectGradientsMatch(*fused, *unfused, 1e-5);
  ASSERT_EQ(fused->losses.size(), unfused->losses.size());
  for (size_t s = 0; s < fused->losses.size(); ++s) {
    EXPECT_NEAR(fused->losses[s], unfused->losses[s],
                1e-5 * std::fabs(unfused->losses[s]))
        << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, CudaTrainTest,
                         ::testing::Values("gpt2_debug", "llama_debug"));

// GPT-2 124M (vocabulary padded to 50304), batch 8 x 1024, bf16 compute:
// step times on the GPU, printed. Its PyTorch peer:
//   tools/bench/pytorch_gpt2_step.py --device=cuda --dtype=bf16 --batch=8
//       --seq=1024
TEST(CudaTrainTiming, Gpt2_124mSteps) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  RegisterCudaAllocators();
  RunOptions o;
  o.model = "gpt2_124m";
  o.device = Device::Cuda(0);
  o.param_dtype = DType::kBF16;
  o.steps = 8;
  o.rows = 8;
  o.seq = 1024;
  o.vocab_pad_multiple = 64;
  absl::StatusOr<RunResult> r = Train(o);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<double> measured(r->step_s.begin() + 3, r->step_s.end());
  std::sort(measured.begin(), measured.end());
  const double median = measured[measured.size() / 2];
  std::printf(
      "gpt2_124m bf16 on cuda:0, 8 x 1024 tokens: median step %.1f ms "
      "(%.0f tokens/s) over %zu steps after 3 warm-up; losses %.4f -> %.4f\n",
      median * 1e3, o.rows * o.seq / median, measured.size(), r->losses[0],
      r->losses.back());
  EXPECT_TRUE(std::isfinite(r->losses.back()));
  // A step never waits for the GPU: FSDP's all-gathers and reduce-scatters
  // are waited for by the GPU, ids are checked on the host, and the loss
  // and gradient norm stay on the GPU (AdamW reads them there) until
  // ReadStepValues.
  ASSERT_EQ(r->host_syncs.size(), static_cast<size_t>(o.steps - 1));
  for (size_t i = 0; i < r->host_syncs.size(); ++i) {
    EXPECT_EQ(r->host_syncs[i], 0) << "host syncs in step " << i + 2;
  }
  std::printf("host syncs per step: %s\n",
              absl::StrJoin(r->host_syncs, " ").c_str());
}

}  // namespace
}  // namespace fsdpp
