// FSDP training-step benchmark: GPT-2 124M (vocabulary padded to 50304),
// global batch 4 x 256 tokens, f32, AdamW with clipping, on this machine's
// cores split between ranks. Every layout runs as real processes (started
// through tools/launch's library, one OpenMP thread per core per rank), so
// memory is per rank and ranks contend for cores as in training:
//
//   unsharded    1 rank  x 2 threads, Replicate over one rank (the
//                single-device baseline)
//   FSDP ZeRO-3  2 ranks x 1 thread, reshard after forward (last block kept)
//   FSDP ZeRO-2  2 ranks x 1 thread, no reshard after forward
//   DDP          2 ranks x 1 thread, Replicate with a bucket per block
//   FSDP W=1     1 rank  x 2 threads (FSDP's own cost without peers)
//
// For each: median step time over the measured steps (slowest rank), the
// ratio to the unsharded baseline, the exposed communication per step (time
// the training thread waited for collectives, from core/trace's comm_wait
// totals; slowest rank), the per-rank sharded state (params + grads +
// optimizer, allocator tags) and the per-rank peak of all allocations
// during the measured steps.
//
//   bazel run -c opt //tools/bench:fsdp_benchmark [-- --steps=5 --warmup=2
//       --caching_allocator]  (keep freed host blocks for reuse: see
//       core/caching_allocator.h; the trainer does by default)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "comm/gloo_backend.h"
#include "comm/rendezvous.h"
#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cli.h"
#include "core/logging.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "core/status.h"
#include "core/trace.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "fsdp/replicate.h"
#include "mesh/device_mesh.h"
#include "models/config.h"
#include "models/transformer.h"
#include "optim/adamw.h"
#include "recipe/step/step.h"
#include "runtime/launch.h"

ABSL_FLAG(std::string, model, "gpt2_124m",
          "model zoo config to train (models/config.cc; the smoke run in CI "
          "uses gpt2_debug)");
ABSL_FLAG(int, steps, 5, "measured steps per layout");
ABSL_FLAG(int, warmup, 2, "unmeasured steps before them");
ABSL_FLAG(bool, caching_allocator, false,
          "keep freed host blocks for reuse (core/caching_allocator.h), as "
          "the trainer does by default");
ABSL_FLAG(std::string, worker, "",
          "internal: run one rank of this layout (set by the benchmark when "
          "it starts its ranks)");
ABSL_FLAG(std::string, out, "", "internal: the worker's result file");

namespace fsdpp {
namespace {

constexpr int64_t kGlobalBatch = 4;
constexpr int64_t kSeq = 256;  // Or the model's context length if shorter.

struct Layout {
  const char* name;
  int ranks;
  const char* mode;  // "fsdp3", "fsdp2", "ddp"
};

const Layout kLayouts[] = {
    {"unsharded (1 rank x 2 threads)", 1, "ddp"},
    {"FSDP ZeRO-3 (2 ranks x 1 thread)", 2, "fsdp3"},
    {"FSDP ZeRO-2 (2 ranks x 1 thread)", 2, "fsdp2"},
    {"DDP (2 ranks x 1 thread)", 2, "ddp"},
    {"FSDP ZeRO-3 W=1 (1 rank x 2 threads)", 1, "fsdp3"},
};

struct Trainable {
  std::vector<DTensor*> grads;
  std::vector<AdamWParam> adam;
  recipe::GradientSync sync;
};

// One rank of one layout: trains and writes "step_s comm_s state peak" per
// measured step summary to `out`.
absl::Status Worker(const std::string& mode, const std::string& model_name,
                    int steps, int warmup, const std::string& out, bool cache) {
  if (cache) {
    SetAllocator(new CachingAllocator(CpuRawAllocator()));  // Process-long.
  }
  FSDPP_ASSIGN_OR_RETURN(RendezvousInfo info, RendezvousFromEnv());
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Store> store,
                         StoreFromRendezvous(info, absl::Minutes(2)));
  GlooOptions gloo;
  gloo.timeout = absl::Minutes(5);
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceMesh> mesh,
      DeviceMesh::Create({{"dp", info.world_size}}, info.rank, info.world_size,
                         GlooGroupFactory(store.get(), gloo)));
  TraceRecorder trace(info.rank, "bench");
  ScopedCurrentTrace trace_scope(&trace);
  FSDPP_ASSIGN_OR_RETURN(models::TransformerConfig config,
                         models::ConfigByName(model_name));
  config.vocab_pad_multiple = 64;
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> model,
                         models::Transformer::Create(config));
  Trainable t;
  if (mode == "ddp") {
    FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
    FSDPP_RETURN_IF_ERROR(model->InitWeights(1234));
    fsdp::ReplicateOptions ro;
    ro.mesh = mesh.get();
    ro.broadcast_parameters = false;
    for (Module* b : model->blocks()) ro.bucket_modules.push_back(b);
    FSDPP_ASSIGN_OR_RETURN(fsdp::ReplicatedModule * replicated,
                           fsdp::Replicate(model.get(), ro));
    t.sync.replicated = replicated;
    for (fsdp::ReplicatedParameter& rp : replicated->parameters()) {
      t.grads.push_back(&rp.grad);
      t.adam.emplace_back(rp.name, &rp.param, &rp.grad);
    }
  } else {
    fsdp::FsdpPlanOptions po;
    po.shard.mesh = mesh.get();
    po.shard.reshard_after_forward = mode == "fsdp3";
    std::vector<Module*> blocks(model->blocks().begin(), model->blocks().end());
    FSDPP_ASSIGN_OR_RETURN(t.sync.units,
                           fsdp::ShardBlocksThenRoot(model.get(), blocks, po));
    FSDPP_RETURN_IF_ERROR(fsdp::InitShardedWeights(model.get(), 1234));
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model.get())) {
      t.grads.push_back(&sp->grad);
      t.adam.emplace_back(sp->name, &sp->master, &sp->grad);
    }
  }
  AdamWOptions ao;
  ao.lr = 1e-4;
  ao.decay_filter = DecayMatricesOnly;
  FSDPP_ASSIGN_OR_RETURN(AdamW adamw, AdamW::Create(std::move(t.adam), ao));
  FSDPP_RETURN_IF_ERROR(adamw.Init());
  const int64_t rows = kGlobalBatch / info.world_size;
  const int64_t seq = std::min(kSeq, config.context_length);
  std::vector<int64_t> ids(rows * seq), targets(rows * seq);
  for (size_t i = 0; i < ids.size(); ++i) {
    const Philox4x32 r = PhiloxBlock(77, info.rank, i);
    ids[i] = r.v[0] % config.vocab_size;
    targets[i] = r.v[1] % config.vocab_size;
  }
  recipe::MicroBatch batch;
  FSDPP_ASSIGN_OR_RETURN(batch.ids, Tensor::FromInts({rows, seq}, ids));
  FSDPP_ASSIGN_OR_RETURN(batch.targets, Tensor::FromInts({rows, seq}, targets));
  // The trainer's step: one micro-batch, then the clipped AdamW update.
  recipe::PlainStep train_step(model.get(), t.grads, t.sync);
  const recipe::MicroBatchSource source =
      [&](int64_t) -> absl::StatusOr<recipe::MicroBatch> { return batch; };
  recipe::OptimizerStepOptions optimizer;
  optimizer.lr = 1e-4;
  optimizer.grad_clip = 1.0;
  Allocator* alloc = GetAllocator(Device::Cpu());
  std::vector<double> step_s, comm_s;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) alloc->ResetPeak();
    const int64_t wait0 = trace.TotalMicros("comm_wait");
    const absl::Time t0 = absl::Now();
    FSDPP_RETURN_IF_ERROR(train_step.ForwardBackward(1, 1.0, source).status());
    FSDPP_RETURN_IF_ERROR(
        recipe::OptimizerStep(train_step, adamw, optimizer).status());
    if (step >= warmup) {
      step_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      comm_s.push_back((trace.TotalMicros("comm_wait") - wait0) / 1e6);
    }
  }
  std::sort(step_s.begin(), step_s.end());
  std::sort(comm_s.begin(), comm_s.end());
  const MemoryStats m = alloc->Stats();
  const int64_t state = m.current_of(MemoryTag::kParams) +
                        m.current_of(MemoryTag::kGrads) +
                        m.current_of(MemoryTag::kOptimizerState);
  std::ofstream f(absl::StrCat(out, ".rank", info.rank));
  f << step_s[step_s.size() / 2] << " " << comm_s[comm_s.size() / 2] << " "
    << state << " " << m.total_peak << " " << m.reserved_bytes << "\n";
  return f ? absl::OkStatus()
           : absl::InternalError(absl::StrCat("cannot write ", out));
}

struct RankResult {
  double step_s = 0, comm_s = 0;
  int64_t state = 0, peak = 0, reserved = 0;
};

constexpr char kUsage[] =
    "usage: fsdp_benchmark [--model=NAME] [--steps=N] [--warmup=N] "
    "[--caching_allocator]\n"
    "  A training step (GPT-2 124M by default) per layout, each as real "
    "processes.\n";

int Main(int argc, char** argv) {
  ParseCommandLineOrExit(argc, argv, kUsage);
  const std::string model = absl::GetFlag(FLAGS_model);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const bool cache = absl::GetFlag(FLAGS_caching_allocator);
  const std::string worker = absl::GetFlag(FLAGS_worker);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (steps < 1 || warmup < 0) {
    std::fprintf(stderr,
                 "fsdp_benchmark: --steps must be >= 1 and --warmup "
                 ">= 0\n%s",
                 kUsage);
    return 2;
  }
  absl::StatusOr<models::TransformerConfig> config =
      models::ConfigByName(model);
  if (!config.ok()) {
    std::fprintf(stderr, "fsdp_benchmark: --model: %s\n%s",
                 config.status().ToString().c_str(), kUsage);
    return 2;
  }
  if (!worker.empty()) {
    absl::Status s = Worker(worker, model, steps, warmup, out, cache);
    if (!s.ok()) {
      std::fprintf(stderr, "worker: %s\n", s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  char tmpl[] = "/tmp/fsdp_benchmark.XXXXXX";
  const char* dir = mkdtemp(tmpl);
  CHECK(dir != nullptr);
  std::printf(
      "%s (vocab padded to 64), global batch %d x %d tokens, f32, AdamW + "
      "clip; %d warm-up + %d measured steps per layout, %d CPUs\n",
      model.c_str(), static_cast<int>(kGlobalBatch),
      static_cast<int>(std::min(kSeq, config->context_length)), warmup, steps,
      AvailableCpus());
  std::fflush(stdout);
  std::vector<std::vector<RankResult>> results;
  int port = 29700 + getpid() % 200;
  for (const Layout& layout : kLayouts) {
    const std::string file = absl::StrCat(dir, "/", results.size());
    launch::LaunchOptions lo;
    lo.nproc_per_node = layout.ranks;
    lo.master_port = port++;
    lo.program = {"/proc/self/exe",
                  absl::StrCat("--worker=", layout.mode),
                  absl::StrCat("--out=", file),
                  absl::StrCat("--model=", model),
                  absl::StrCat("--steps=", steps),
                  absl::StrCat("--warmup=", warmup)};
    if (cache) lo.program.push_back("--caching_allocator");
    const int rc = launch::RunLaunch(lo);
    CHECK_EQ(rc, 0) << layout.name;
    std::vector<RankResult> ranks;
    for (int r = 0; r < layout.ranks; ++r) {
      std::ifstream f(absl::StrCat(file, ".rank", r));
      RankResult rr;
      f >> rr.step_s >> rr.comm_s >> rr.state >> rr.peak >> rr.reserved;
      CHECK(f) << "no result from " << layout.name << " rank " << r;
      ranks.push_back(rr);
    }
    results.push_back(ranks);
    std::printf("  done: %s\n", layout.name);
    std::fflush(stdout);
  }
  auto worst = [](const std::vector<RankResult>& v, auto field) {
    double w = 0;
    for (const RankResult& r : v)
      w = std::max(w, static_cast<double>(field(r)));
    return w;
  };
  const double base =
      worst(results[0], [](const RankResult& r) { return r.step_s; });
  std::printf(
      "\n| layout | s/step | vs unsharded | exposed comm/step | params+grads+"
      "optimizer per rank | peak per rank (measured steps) | held from the "
      "system per rank |\n"
      "|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& v = results[i];
    const double s = worst(v, [](const RankResult& r) { return r.step_s; });
    std::printf(
        "| %s | %.3f | %.3fx | %.0f ms | %.1f MiB | %.1f MiB | %.1f MiB |\n",
        kLayouts[i].name, s, s / base,
        1000 * worst(v, [](const RankResult& r) { return r.comm_s; }),
        worst(v, [](const RankResult& r) { return r.state; }) / 1048576.0,
        worst(v, [](const RankResult& r) { return r.peak; }) / 1048576.0,
        worst(v, [](const RankResult& r) { return r.reserved; }) / 1048576.0);
  }
  return 0;
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) { return fsdpp::Main(argc, argv); }
