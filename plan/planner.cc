// The planner; see planner.h.
#include "plan/planner.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "core/parallel.h"
#include "core/status.h"
#include "plan/rates.h"

namespace fsdpp {
namespace plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// MemTotal of /proc/meminfo in bytes (0 if unreadable).
int64_t HostMemoryBytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

// The mesh axis a group spans, from its name: "train/tp@shard=0" -> "tp",
// "train/shard" -> "shard", "train" (the world) -> "".
std::string GroupAxis(const std::string& group) {
  const size_t slash = group.rfind('/');
  if (slash == std::string::npos) return "";
  const std::string axis = group.substr(slash + 1);
  return axis.substr(0, axis.find('@'));
}

// Bytes an op moves on the wire per rank (ring algorithms).
double WireBytes(const SimulatedOp& op) {
  const double n = op.group_size;
  if (n <= 1) return 0;
  if (op.kind == "all_gather") return op.out_bytes * (n - 1) / n;
  if (op.kind == "reduce_scatter") return op.in_bytes * (n - 1) / n;
  if (op.kind == "all_reduce") return 2 * op.in_bytes * (n - 1) / n;
  if (op.kind == "p2p") return std::max(op.in_bytes, op.out_bytes);
  // Expert parallelism's token rows, routed evenly: all but this rank's
  // own share leave it.
  if (op.kind == "all_to_all_v") return op.in_bytes * (n - 1) / n;
  return op.in_bytes;  // broadcast, all_to_all
}

StepTime PredictTime(const models::TransformerConfig& model,
                     const recipe::Layout& s, const DeviceSpec& d,
                     const DryRunResult& run) {
  StepTime t;
  const int64_t seq = s.seq(model);
  const double tokens =
      static_cast<double>(s.micro_batch) * seq * s.grad_accumulation;
  // Tensor parallelism splits each data-parallel rank's work over its tp
  // ranks (attention heads, the MLP's hidden width, the vocabulary),
  // pipeline parallelism over its stages (the blocks) and context
  // parallelism over its cp ranks (the sequence, in chunks that share the
  // causal attention's work evenly).
  const int split = s.tp * std::max(1, s.pp) * s.cp;
  // Frozen weights skip their weight gradients; LoRA's adapters add theirs
  // (the layout is validated: counting its parameters does not fail).
  absl::StatusOr<double> per_token = s.FlopsPerToken(model);
  const double model_flops =
      (per_token.ok() ? *per_token : models::FlopsPerToken(model, seq)) *
      tokens / split;
  // Activation checkpointing runs a fully checkpointed block's forward again
  // in backward (the forward is a third of the training FLOPs); selective
  // recomputes only the cheap ops between the matmuls (their time is in the
  // dry run's allocations, below).
  const double recomputed =
      model.n_layers > 0
          ? static_cast<double>(
                s.activation_checkpointing.FullyRecomputed(model.n_layers)) /
                model.n_layers
          : 0.0;
  const double flops = model_flops * (1.0 + recomputed / 3.0);
  const double rate = s.param_dtype == DType::kF32 ? d.f32_flops : d.bf16_flops;
  const bool llama = model.family == models::ModelFamily::kLlama;
  const bool half = s.param_dtype != DType::kF32;
  t.compute_s = (rate > 0 ? flops / rate : 0) +
                run.step_allocations * d.op_overhead_s[llama][half];
  // A pipeline rank idles for the schedule's bubble.
  if (run.pipeline_bubble > 0 && run.pipeline_bubble < 1) {
    t.compute_s /= 1 - run.pipeline_bubble;
  }
  double first_gather = -1, last_reduce = 0, blocking = 0;
  for (const SimulatedOp& op : run.ops) {
    const std::string axis = GroupAxis(op.group);
    const bool across_nodes =
        axis == "replicate" && d.inter_node_bytes_per_s > 0;
    const double bw =
        across_nodes ? d.inter_node_bytes_per_s : d.link_bytes_per_s;
    // The latency was measured on groups of two (one ring step); a ring of
    // n ranks takes n - 1 steps, each waiting on the next rank; a transfer
    // between two pipeline stages is one step.
    const bool tensor_parallel = axis == "tp";
    // Context parallelism's ring (point-to-point within the shard axis).
    const bool ring = op.kind == "p2p" && axis != "pp";
    // Expert parallelism's exchanges (the rows per expert, the token rows
    // out and back): each one's result is what the next op computes on.
    const bool experts = axis == "ep";
    const double latency = tensor_parallel && d.tp_collective_s > 0
                               ? d.tp_collective_s
                               : d.collective_latency_s;
    const int steps = op.kind == "p2p" ? 1 : std::max(0, op.group_size - 1);
    const double s_op = (bw > 0 ? WireBytes(op) / bw : 0) + steps * latency;
    t.comm_s += s_op;
    // Tensor parallelism's collectives sit between the ops that need their
    // results, on the compute's path, and a pipeline stage waits for its
    // inputs: none of them is hidden. The ring's transfers are counted on
    // the path too: its backward waits for each one, and its forward's
    // overlap with one chunk's attention is not modelled (an upper bound).
    // So are expert parallelism's all-to-alls.
    if (tensor_parallel || axis == "pp" || ring || experts) {
      blocking += s_op;
      continue;
    }
    if (op.kind == "all_gather" && first_gather < 0) first_gather = s_op;
    if (op.kind == "reduce_scatter") last_reduce = s_op;
  }
  if (d.name == "cpu") {
    // Gloo's collectives run on the same cores as the compute: nothing is
    // hidden.
    t.exposed_comm_s = t.comm_s;
  } else {
    // FSDP prefetches: all but the first all-gather and the last
    // reduce-scatter overlap compute, up to the compute's own length.
    const double edges = std::max(first_gather, 0.0) + last_reduce;
    const double overlappable = t.comm_s - blocking;
    t.exposed_comm_s =
        blocking + edges + std::max(0.0, overlappable - edges - t.compute_s);
  }
  t.step_s = t.compute_s + t.exposed_comm_s;
  if (t.step_s > 0) {
    t.tokens_per_s = tokens / split / t.step_s;
    const double peak = s.param_dtype == DType::kF32 ? d.f32_peak : d.bf16_peak;
    t.mfu = peak > 0 ? model_flops / t.step_s / peak : 0;
  }
  return t;
}

std::string LargestAtPeak(const MemoryStats& stats) {
  int best = 0;
  for (int i = 1; i < kNumMemoryTags; ++i) {
    if (stats.at_peak[i] > stats.at_peak[best]) best = i;
  }
  return absl::StrCat(MemoryTagName(static_cast<MemoryTag>(best)), " ",
                      FormatBytes(stats.at_peak[best]));
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= kGiB) return absl::StrFormat("%.2f GiB", b / kGiB);
  if (b >= 1024.0 * 1024.0) {
    return absl::StrFormat("%.1f MiB", b / (1024.0 * 1024.0));
  }
  return absl::StrFormat("%.1f KiB", b / 1024.0);
}

namespace {

constexpr int kCalibrationRuns = 7;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// See CpuRates::op_s.
double MeasureOpOverhead(const std::string& model, DType dtype,
                         double flops_per_s) {
  absl::StatusOr<models::TransformerConfig> config =
      models::ConfigByName(model);
  if (!config.ok() || flops_per_s <= 0) return 0;
  recipe::Layout s;
  s.micro_batch = 2;
  s.seq_len = 32;
  s.param_dtype = dtype;
  double best = -1;
  int64_t allocations = 0;
  for (int i = 0; i < 3; ++i) {
    InMemoryStore store;
    absl::StatusOr<DryRunResult> r =
        RunStepOn(*config, s, 0, GlooGroupFactory(&store), Device::Cpu());
    if (!r.ok() || r->step_allocations <= 0) return 0;
    if (best < 0 || r->step_seconds < best) best = r->step_seconds;
    allocations = r->step_allocations;
  }
  const double flops =
      models::FlopsPerToken(*config, s.seq_len) * s.micro_batch * s.seq_len;
  return std::max(0.0, best - flops / flops_per_s) / allocations;
}

// A collective's cost inside a training step here (the comm thread waking,
// sharing the cores with compute): the same tiny step (gpt2_debug, 2 x 32
// tokens per rank) on two thread ranks over Gloo (TCP or, with
// `shared_memory`, shared memory) against one rank, the
// difference over the collectives the step issues; with `tensor_parallel`
// the two ranks are one tp group (each computes half of every layer) and the
// difference is charged to tensor parallelism's collectives alone: what a
// blocking collective in the middle of the compute costs, the ranks'
// arrival skew included. 0 if it cannot run.
double MeasureStepCollectiveCost(bool tensor_parallel, bool shared_memory) {
  absl::StatusOr<models::TransformerConfig> config =
      models::ConfigByName("gpt2_debug");
  if (!config.ok()) return 0;
  recipe::Layout one;
  one.micro_batch = 2;
  one.seq_len = 32;
  recipe::Layout two = one;
  two.world = 2;
  if (tensor_parallel) two.tp = 2;
  absl::StatusOr<DryRunResult> dry = DryRun(*config, two);
  if (!dry.ok()) return 0;
  // The collectives the difference is charged to: all of them, or those on
  // the tp axis (the others are then only the step's two scalars).
  int64_t count = 0;
  for (const SimulatedOp& op : dry->ops) {
    count += !tensor_parallel || GroupAxis(op.group) == "tp";
  }
  if (count == 0) return 0;
  // Medians of 7, the one- and two-rank runs alternating: a step's
  // collectives wait on whatever else the cores run, and the trainer's step
  // time is a mean over steps, not the luckiest one.
  std::vector<double> t1, t2;
  for (int i = 0; i < kCalibrationRuns; ++i) {
    InMemoryStore store;
    absl::StatusOr<DryRunResult> r =
        RunStepOn(*config, one, 0, GlooGroupFactory(&store), Device::Cpu());
    if (!r.ok()) return 0;
    t1.push_back(r->step_seconds);
    InMemoryStore store2;
    GlooOptions gloo;
    gloo.shared_memory = shared_memory;
    std::vector<absl::StatusOr<DryRunResult>> r2(2,
                                                 absl::UnknownError("not run"));
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        r2[rank] = RunStepOn(*config, two, rank,
                             GlooGroupFactory(&store2, gloo), Device::Cpu());
      });
    }
    for (std::thread& t : ranks) t.join();
    if (!r2[0].ok() || !r2[1].ok()) return 0;
    t2.push_back(std::max(r2[0]->step_seconds, r2[1]->step_seconds));
  }
  return std::max(0.0, Median(t2) - Median(t1)) / static_cast<double>(count);
}

}  // namespace

CpuRates MeasureCpuRates(bool shared_memory) {
  CpuRates r;
  constexpr int64_t kN = 1024;
  const absl::Duration budget = absl::Milliseconds(300);
  r.f32_flops = MeasureMatmulFlops(DType::kF32, kN, budget).value_or(0);
  r.bf16_flops = MeasureMatmulFlops(DType::kBF16, kN, budget).value_or(0);
  r.gloo_bus_bytes_per_s =
      MeasureGlooBusBandwidth(int64_t{8} << 20, 3, shared_memory).value_or(0);
  // A small all-gather's time is its latency: bytes / busbw x (n - 1) / n.
  constexpr int64_t kSmall = 8 << 10;
  const double small_bw =
      MeasureGlooBusBandwidth(kSmall, 20, shared_memory).value_or(0);
  r.gloo_latency_s = small_bw > 0 ? kSmall / 2.0 / small_bw : 0;
  r.step_collective_s =
      MeasureStepCollectiveCost(/*tensor_parallel=*/false, shared_memory);
  r.step_tp_collective_s =
      MeasureStepCollectiveCost(/*tensor_parallel=*/true, shared_memory);
  for (int llama : {0, 1}) {
    for (int half : {0, 1}) {
      r.op_s[llama][half] = MeasureOpOverhead(
          llama ? "llama_debug" : "gpt2_debug",
          half ? DType::kBF16 : DType::kF32,
          (half ? r.bf16_flops : r.f32_flops) * kCpuStepEfficiency);
    }
  }
  return r;
}

absl::StatusOr<DeviceSpec> DeviceByName(const std::string& name,
                                        int ranks_per_node, bool calibrate,
                                        bool shared_memory) {
  if (ranks_per_node < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: ranks per node must be >= 1, got ", ranks_per_node));
  }
  DeviceSpec d;
  d.name = name;
  d.shared_memory = shared_memory;
  if (name == "h100" || name == "h200") {
    // Memory as nvidia-smi reports it on the SXM parts (MiB).
    d.memory_bytes = (name == "h100" ? int64_t{81559} : int64_t{143771}) << 20;
    d.bf16_peak = GpuPeakFlops("H100", DType::kBF16);
    d.f32_peak = GpuPeakFlops("H100", DType::kF32);
    // Large bf16 matmuls reach about half the dense peak inside a training
    // step (kernels between them, launch gaps).
    d.bf16_flops = 0.5 * d.bf16_peak;
    d.f32_flops = 0.5 * d.f32_peak;
    d.link_bytes_per_s = 360e9;           // NVLink 4: 450 GB/s, ~80% as busbw
    d.inter_node_bytes_per_s = 45e9;      // 400 Gb/s InfiniBand per GPU
    d.overhead_bytes = int64_t{3} << 29;  // CUDA context, cuBLAS, NCCL
    d.separate_host = true;
    d.source = absl::StrCat(name == "h100" ? "H100" : "H200",
                            " SXM data sheet; 50% of the dense peak achieved");
    return d;
  }
  if (name == "cpu") {
    d.memory_bytes = HostMemoryBytes() / ranks_per_node;
    d.overhead_bytes = int64_t{256} << 20;  // code, libraries, pools, data
    if (calibrate) {
      const CpuRates r = MeasureCpuRates(shared_memory);
      // Ranks of a node share its cores.
      d.f32_peak = r.f32_flops / ranks_per_node;
      d.bf16_peak = r.bf16_flops / ranks_per_node;
      d.link_bytes_per_s = r.gloo_bus_bytes_per_s;

      // Small ops run on one core: ranks beyond the cores share them.
      const double share = std::max(1.0, static_cast<double>(ranks_per_node) /
                                             std::max(1, AvailableCpus()));
      // A collective in a step costs at least its latency on an idle
      // machine; in a step, what the two-rank step measured, more where
      // ranks outnumber the cores.
      d.collective_latency_s =
          std::max(r.gloo_latency_s, r.step_collective_s * share);
      d.tp_collective_s =
          std::max(r.gloo_latency_s, r.step_tp_collective_s * share);
      for (int llama : {0, 1}) {
        for (int half : {0, 1}) {
          d.op_overhead_s[llama][half] = r.op_s[llama][half] * share;
        }
      }
      d.source = absl::StrFormat(
          "measured here: %.0f / %.0f GFLOP/s f32 / bf16 matmul (1024^3), "
          "Gloo all-gather (%s) busbw %.2f GB/s and latency %.0f us (%.0f us "
          "per collective inside a step, %.0f us per tensor-parallel one), "
          "%.1f us per op (gpt2, f32)",
          r.f32_flops / 1e9, r.bf16_flops / 1e9,
          shared_memory ? "shared memory" : "TCP", r.gloo_bus_bytes_per_s / 1e9,
          r.gloo_latency_s * 1e6, r.step_collective_s * 1e6,
          r.step_tp_collective_s * 1e6, r.op_s[0][0] * 1e6);
    } else {
      d.f32_peak = 50e9 / ranks_per_node;
      d.bf16_peak = 100e9 / ranks_per_node;
      d.link_bytes_per_s = 1e9;
      d.collective_latency_s = 100e-6;
      for (auto& row : d.op_overhead_s) row[0] = row[1] = 10e-6;
      d.source = "uncalibrated estimate";
    }
    // A training step reaches this fraction of the matmul rate (the ops
    // that are not matmuls, the optimizer); measured against the trainer
    // (docs/PERFORMANCE.md, "Planner").
    d.f32_flops = kCpuStepEfficiency * d.f32_peak;
    d.bf16_flops = kCpuStepEfficiency * d.bf16_peak;
    return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("plan: unknown device '", name, "' (cpu, h100, h200)"));
}

absl::StatusOr<Plan> MakePlan(const models::TransformerConfig& model,
                              const recipe::Layout& layout,
                              const DeviceSpec& device, int rank) {
  if (rank == kLargestRank) {
    // Each pipeline rank's first rank.
    std::optional<Plan> largest;
    for (int q = 0; q < std::max(1, layout.pp); ++q) {
      FSDPP_ASSIGN_OR_RETURN(
          Plan p,
          MakePlan(model, layout, device, layout.FirstRankOfPipelineRank(q)));
      if (!largest.has_value() || p.run.peak_bytes > largest->run.peak_bytes) {
        largest = std::move(p);
      }
    }
    return *std::move(largest);
  }
  Plan p;
  p.model = model;
  p.layout = layout;
  p.device = device;
  FSDPP_ASSIGN_OR_RETURN(
      p.run, DryRun(model, layout, rank, device.separate_host,
                    device.name != "cpu"   ? SimulatedBackend::kNccl
                    : device.shared_memory ? SimulatedBackend::kGlooSharedMemory
                                           : SimulatedBackend::kGloo));
  p.predicted_peak_bytes = p.run.peak_bytes + device.overhead_bytes;
  p.fits =
      device.memory_bytes <= 0 || p.predicted_peak_bytes <= device.memory_bytes;
  for (const PhaseMemory& phase : p.run.phases) {
    if (phase.name == p.run.peak_phase) p.largest = LargestAtPeak(phase.stats);
  }
  p.time = PredictTime(model, layout, device, p.run);
  return p;
}

std::string FormatPlan(const Plan& p) {
  std::string out = absl::StrFormat("Plan: %s (%.3f B parameters) on %s, %s\n",
                                    p.model.name, p.run.model_params / 1e9,
                                    p.device.name, p.layout.ToString());
  const PhaseMemory* peak = nullptr;
  for (const PhaseMemory& phase : p.run.phases) {
    if (phase.name == p.run.peak_phase) peak = &phase;
  }
  absl::StrAppendFormat(&out, "%-12s %14s %14s\n", "per rank", "after setup",
                        "at the peak");
  for (int i = 0; i < kNumMemoryTags; ++i) {
    absl::StrAppendFormat(
        &out, "%-12s %14s %14s\n", MemoryTagName(static_cast<MemoryTag>(i)),
        FormatBytes(p.run.after_setup.current[i]),
        FormatBytes(peak != nullptr ? peak->stats.at_peak[i] : 0));
  }
  absl::StrAppendFormat(&out, "%-12s %14s %14s\n", "total",
                        FormatBytes(p.run.after_setup.total_current),
                        FormatBytes(p.run.peak_bytes));
  absl::StrAppendFormat(
      &out,
      "Peak %s in %s (largest: %s); + %s outside fsdpp's allocators = %s of "
      "%s: %s\n",
      FormatBytes(p.run.peak_bytes), p.run.peak_phase, p.largest,
      FormatBytes(p.device.overhead_bytes), FormatBytes(p.predicted_peak_bytes),
      p.device.memory_bytes > 0 ? FormatBytes(p.device.memory_bytes)
                                : std::string("unlimited"),
      p.fits ? "fits" : "DOES NOT FIT");
  if (p.device.separate_host && p.run.host_peak_bytes > 0) {
    absl::StrAppendFormat(&out, "Host memory (offloaded state): peak %s\n",
                          FormatBytes(p.run.host_peak_bytes));
  }
  absl::StrAppendFormat(
      &out,
      "Sharded state of this rank (exact): params %s (%d of %d elements), "
      "grads %s, optimizer %s\n",
      FormatBytes(p.run.param_bytes), p.run.rank_params, p.run.model_params,
      FormatBytes(p.run.grad_bytes), FormatBytes(p.run.optimizer_bytes));
  std::map<std::string, std::pair<int, double>> ops;
  for (const SimulatedOp& op : p.run.ops) {
    auto& [count, bytes] = ops[op.kind];
    ++count;
    bytes += WireBytes(op);
  }
  std::vector<std::string> parts;
  for (const auto& [kind, v] : ops) {
    parts.push_back(
        absl::StrFormat("%d %s (%s on the wire)", v.first, kind,
                        FormatBytes(static_cast<int64_t>(v.second))));
  }
  absl::StrAppendFormat(&out, "Collectives per step: %s\n",
                        parts.empty() ? "none" : absl::StrJoin(parts, ", "));
  absl::StrAppendFormat(
      &out,
      "Step time: compute %.3f s + exposed comm %.3f s (of %.3f s) = %.3f s; "
      "%.0f tokens/s per rank, MFU %.1f%%\n(rates: %s)\n",
      p.time.compute_s, p.time.exposed_comm_s, p.time.comm_s, p.time.step_s,
      p.time.tokens_per_s, 100 * p.time.mfu, p.device.source);
  return out;
}

absl::StatusOr<std::vector<Candidate>> SearchStrategies(
    const models::TransformerConfig& model, const recipe::Layout& base,
    const DeviceSpec& device) {
  FSDPP_RETURN_IF_ERROR(base.Validate(model));
  std::vector<recipe::Layout> tries;
  const int64_t per_rank_batch = base.micro_batch * base.grad_accumulation;
  for (int64_t mb = base.micro_batch; mb >= 1; mb /= 2) {
    if (per_rank_batch % mb != 0) continue;
    for (bool zero3 : {true, false}) {
      for (const nn::CheckpointPolicy& ac :
           {nn::CheckpointPolicy::None(), nn::CheckpointPolicy::Selective(),
            nn::CheckpointPolicy::Full()}) {
        for (bool offload : {false, true}) {
          recipe::Layout s = base;
          s.micro_batch = mb;
          s.grad_accumulation = per_rank_batch / mb;
          s.reshard_after_forward = zero3;
          s.activation_checkpointing = ac;
          s.offload = offload;
          tries.push_back(s);
        }
      }
    }
    if (mb == 1) break;
  }
  std::vector<Candidate> fits, others;
  for (const recipe::Layout& s : tries) {
    FSDPP_ASSIGN_OR_RETURN(Plan p, MakePlan(model, s, device));
    Candidate c{std::move(p), ""};
    if (c.plan.fits) {
      fits.push_back(std::move(c));
    } else {
      c.why_not = absl::StrCat(FormatBytes(c.plan.predicted_peak_bytes), " > ",
                               FormatBytes(device.memory_bytes),
                               " (largest: ", c.plan.largest, ")");
      others.push_back(std::move(c));
    }
  }
  std::stable_sort(fits.begin(), fits.end(),
                   [](const Candidate& a, const Candidate& b) {
                     return a.plan.time.step_s < b.plan.time.step_s;
                   });
  std::stable_sort(
      others.begin(), others.end(), [](const Candidate& a, const Candidate& b) {
        return a.plan.predicted_peak_bytes < b.plan.predicted_peak_bytes;
      });
  fits.insert(fits.end(), std::make_move_iterator(others.begin()),
              std::make_move_iterator(others.end()));
  return fits;
}

std::string ExplainDoesNotFit(const Plan& plan,
                              const std::vector<Candidate>& alternatives) {
  std::string out = absl::StrFormat(
      "%s does not fit: %s predicted per rank (%s at the peak in %s + %s "
      "overhead) against %s; the largest part is %s.",
      plan.layout.ToString(), FormatBytes(plan.predicted_peak_bytes),
      FormatBytes(plan.run.peak_bytes), plan.run.peak_phase,
      FormatBytes(plan.device.overhead_bytes),
      FormatBytes(plan.device.memory_bytes), plan.largest);
  std::vector<std::string> fixes;
  for (const Candidate& c : alternatives) {
    if (!c.why_not.empty() || fixes.size() == 3) continue;
    fixes.push_back(absl::StrFormat(
        "%s (%s, %.2f s/step)", c.plan.layout.ToString(),
        FormatBytes(c.plan.predicted_peak_bytes), c.plan.time.step_s));
  }
  if (fixes.empty()) {
    absl::StrAppend(&out,
                    " No ZeRO-2/3, activation checkpointing, offload or "
                    "micro-batch setting fits at this world size: use more "
                    "ranks, a smaller model or a shorter sequence.");
  } else {
    absl::StrAppend(&out, " These fit: ", absl::StrJoin(fixes, "; "), ".");
  }
  return out;
}

}  // namespace plan
}  // namespace fsdpp
