// The planner: memory and step time of a training run before it starts, for
// any model of the zoo, mesh and layout, on this machine's CPU or a GPU
// described by its data sheet.
//
// Memory is the dry run's (plan/dry_run.h: one step executed on meta
// tensors, so every figure is what fsdpp's allocators would hold, per tag,
// with the phase of the peak), plus what no fsdpp allocator sees, as slack:
// a fixed per-process overhead (code, libraries, thread stacks, the math
// libraries' scratch, a GPU's CUDA context). Step time is compute (the
// model's FLOPs per token, the recomputed forward with activation
// checkpointing, at the device's achieved matmul rate) plus the
// communication left exposed (each collective's bytes on the wire over the
// link bandwidth, the part not hidden behind compute by FSDP's prefetch).
#ifndef FSDPP_PLAN_PLANNER_H_
#define FSDPP_PLAN_PLANNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/config.h"
#include "plan/dry_run.h"
#include "recipe/layout.h"

namespace fsdpp {
namespace plan {

// What a rank runs on.
struct DeviceSpec {
  std::string name;          // "cpu", "h100", "h200"
  int64_t memory_bytes = 0;  // per rank
  // The dense matmul peak per rank (FLOP/s, what MFU is relative to) and
  // the rate a training step achieves, in bf16 and f32.
  double bf16_peak = 0, f32_peak = 0;
  double bf16_flops = 0, f32_flops = 0;
  // Collective bandwidth per rank (bytes/s on the wire): within a node, and
  // across nodes (HSDP's replicate axis spans nodes).
  double link_bytes_per_s = 0, inter_node_bytes_per_s = 0;
  // Fixed costs: per tensor op (the dry run counts about one allocation per
  // op), for f32 and bf16/f16 compute and GPT-2 / Llama blocks, and per
  // collective, seconds.
  double op_overhead_s[2][2] = {{0, 0}, {0, 0}};  // [llama][half]
  double collective_latency_s = 0;
  // What one of tensor parallelism's blocking collectives adds to a step
  // beyond its bytes (the ranks meeting in the middle of the compute); 0:
  // collective_latency_s.
  double tp_collective_s = 0;
  // Per-rank memory no fsdpp allocator sees.
  int64_t overhead_bytes = 0;
  // A GPU: offloaded state goes to host memory, counted apart.
  bool separate_host = false;
  // "cpu": the collectives' all-gathers and reduce-scatters go through shared
  // memory (comm.shared_memory, every rank on one node), which holds no ring
  // buffers.
  bool shared_memory = false;
  std::string source;  // where the figures come from
};

// The presets: "h100" and "h200" (SXM data sheets: 80 / 141 GB HBM, 989
// dense bf16 TFLOP/s of which 50% is taken as achieved, NVLink 450 GB/s per
// direction, 400 Gb/s InfiniBand per GPU across nodes) and "cpu": this
// machine's memory (MemTotal of /proc/meminfo shared by `ranks_per_node`),
// with rates measured here (MeasureCpuRates) unless `calibrate` is false,
// in which case it is a fixed conservative estimate. InvalidArgument for an
// unknown name.
// `shared_memory`: DeviceSpec::shared_memory, and the rates measured
// through shared memory.
absl::StatusOr<DeviceSpec> DeviceByName(const std::string& name,
                                        int ranks_per_node = 1,
                                        bool calibrate = true,
                                        bool shared_memory = false);

// Measures this machine's CPU rates: a 1024^3 matmul per dtype on this
// thread's OpenMP threads, and the bus bandwidth of an 8 MiB all-gather
// between two ranks over Gloo (the collectives between ranks of one node),
// over TCP or through shared memory; the collectives' costs likewise.
struct CpuRates {
  double bf16_flops = 0, f32_flops = 0, gloo_bus_bytes_per_s = 0;
  // The fixed cost of a tensor op: a real step of a tiny model (gpt2_debug
  // or llama_debug, f32 or bf16, one rank, 2 x 32 tokens) timed, less its
  // FLOPs at the matmul rate, over the tensors it allocates; and a small
  // collective's time (an 8 KiB all-gather between two ranks).
  double op_s[2][2] = {{0, 0}, {0, 0}};  // [llama][bf16]
  double gloo_latency_s = 0;
  // What one collective adds to a training step here: a tiny step on two
  // thread ranks against one, over its collectives; and the same with the
  // two ranks tensor-parallel, over tensor parallelism's collectives.
  double step_collective_s = 0;
  double step_tp_collective_s = 0;
};
CpuRates MeasureCpuRates(bool shared_memory = false);

// The fraction of the matmul rate a CPU training step's FLOPs run at (the
// ops that are not matmuls, the optimizer), from the trainer's default run
// here: MFU 72-74% against the measured matmul rate (docs/PERFORMANCE.md,
// "Trainer: the default run").
inline constexpr double kCpuStepEfficiency = 0.75;

struct StepTime {
  double compute_s = 0;
  double comm_s = 0;          // all collectives' time on the wire
  double exposed_comm_s = 0;  // the part compute does not hide
  double step_s = 0;
  double tokens_per_s = 0;  // per rank
  double mfu = 0;           // model FLOPs / (peak x step time)
};

struct Plan {
  models::TransformerConfig model;
  recipe::Layout layout;
  DeviceSpec device;
  DryRunResult run;
  // Peak live bytes (the dry run's) plus the device's overhead.
  int64_t predicted_peak_bytes = 0;
  bool fits = false;
  // The largest component at the peak, e.g. "activations 3.2 GiB".
  std::string largest;
  StepTime time;
};

// Plans `layout` for rank `rank`; kLargestRank: the rank whose peak is
// the largest (rank 0, whose FSDP shards are the rounded-up ones; with
// pipeline parallelism the first rank of each pipeline stage is planned and
// the largest kept: the first stage holds the most micro-batches in flight,
// the last the head and the loss).
inline constexpr int kLargestRank = -1;
absl::StatusOr<Plan> MakePlan(const models::TransformerConfig& model,
                              const recipe::Layout& layout,
                              const DeviceSpec& device,
                              int rank = kLargestRank);

// The breakdown: per tag the bytes after setup and at the step's peak, the
// peak's phase, the slack, the total against the device's memory, then the
// predicted step time, tokens/s and MFU.
std::string FormatPlan(const Plan& plan);

// Strategies for `base` (its world, model, batch, precision and hpZ kept)
// with ZeRO-2/3, activation checkpointing (none, selective, full), offload
// and micro-batches that keep the global batch, each planned; the ones that
// fit first (fastest first), then the others (smallest peak first), each
// with why it does not.
struct Candidate {
  Plan plan;
  std::string why_not;  // empty when it fits
};
absl::StatusOr<std::vector<Candidate>> SearchStrategies(
    const models::TransformerConfig& model, const recipe::Layout& base,
    const DeviceSpec& device);

// "activations 3.20 GiB" / "12.0 MiB".
std::string FormatBytes(int64_t bytes);

// The refusal of a plan that does not fit: names the largest component and
// the alternatives from SearchStrategies that would fit (or says none does).
std::string ExplainDoesNotFit(const Plan& plan,
                              const std::vector<Candidate>& alternatives);

}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_PLANNER_H_
