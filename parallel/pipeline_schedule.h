// Pipeline-parallel schedules as data ([pp]), and how a model's blocks are
// split into stages: for each pipeline rank, the
// ordered list of forward / backward actions it runs on which micro-batch and
// which stage, so that a runner executes them and a test can print and check
// them.
//
// Stages are numbered 0 .. S - 1 along the model; with V virtual stages per
// rank (interleaved 1F1B), rank r holds stages r, r + P, .., r + (V - 1) P
// (Megatron's layout), so S = P V. A forward of (stage s, micro-batch i)
// needs the forward of (s - 1, i); a backward of (s, i) needs the backward of
// (s + 1, i) and its own forward.
//
//   GPipe            every rank runs all m forwards, then all m backwards.
//   1F1B             rank r runs P - 1 - r warm-up forwards, then alternates
//                    one forward and one backward, then drains the
//                    backwards: at most P - r micro-batches in flight.
//   Interleaved1F1B  Megatron's interleaved schedule: micro-batches go
//                    through the V chunks of a rank in groups of P; warm-up
//                    (P - 1 - r) 2 + (V - 1) P forwards; m a multiple of P.
//
// Simulate runs a schedule with given forward / backward times (each rank
// runs its list in order, an action starts once its inputs are ready) and
// reports the makespan and the bubble: the idle fraction of the ranks' time.
// With equal times and V = 1 it is (P - 1) / (m + P - 1) for GPipe and 1F1B
// alike; interleaving divides the warm-up's cost by V.
#ifndef FSDPP_PARALLEL_PIPELINE_SCHEDULE_H_
#define FSDPP_PARALLEL_PIPELINE_SCHEDULE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdpp {
namespace parallel {

struct PipelineAction {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int stage = 0;  // global stage index
  int microbatch = 0;

  // "F3.1" (forward, stage 3, micro-batch 1) / "B3.1".
  std::string ToString() const;
  friend bool operator==(const PipelineAction& a, const PipelineAction& b) {
    return a.kind == b.kind && a.stage == b.stage &&
           a.microbatch == b.microbatch;
  }
};

struct PipelineSchedule {
  std::string name;
  int ranks = 1;           // P
  int virtual_stages = 1;  // V (stages per rank)
  int microbatches = 1;    // m
  // actions[r]: what rank r runs, in order.
  std::vector<std::vector<PipelineAction>> actions;

  int stages() const { return ranks * virtual_stages; }
  // The rank holding `stage`.
  int RankOf(int stage) const { return stage % ranks; }
  // One line per rank: "rank 0: F0.0 F0.1 B0.0 ...".
  std::string ToString() const;
  // The most micro-batches whose forward ran and backward did not yet, on
  // `rank`, counted per (stage, micro-batch): what its activations hold.
  int PeakInFlight(int rank) const;
};

// The schedules; InvalidArgument for sizes < 1, 1F1B with fewer
// micro-batches than ranks, interleaved with m not a multiple of P.
absl::StatusOr<PipelineSchedule> GPipeSchedule(int ranks, int microbatches);
absl::StatusOr<PipelineSchedule> OneFOneBSchedule(int ranks, int microbatches);
absl::StatusOr<PipelineSchedule> Interleaved1F1BSchedule(int ranks,
                                                         int virtual_stages,
                                                         int microbatches);

// The schedule named `name` ("gpipe", "1f1b", "interleaved"; V must be 1
// except for "interleaved", which needs V >= 2) for `ranks` pipeline ranks
// and `microbatches` micro-batches. InvalidArgument naming the option.
absl::StatusOr<PipelineSchedule> MakePipelineSchedule(const std::string& name,
                                                      int ranks,
                                                      int virtual_stages,
                                                      int microbatches);

// Checks that every (stage, micro-batch) has exactly one forward and one
// backward, on the rank that holds the stage, the backward after the
// forward; InvalidArgument naming the first problem.
absl::Status ValidateSchedule(const PipelineSchedule& schedule);

struct PipelineSimulation {
  double makespan = 0;  // time from the first action to the last
  double bubble = 0;    // 1 - busy time / (ranks x makespan)
};

// Runs the schedule with every forward taking `forward_time` and every
// backward `backward_time` (> 0). FailedPrecondition naming the ranks'
// next actions if the lists deadlock (an action waits for one that a rank
// runs only later).
absl::StatusOr<PipelineSimulation> Simulate(const PipelineSchedule& schedule,
                                            double forward_time,
                                            double backward_time);

// Which transformer blocks a pipeline stage runs: a contiguous range; stage
// 0 also runs the embeddings, the last stage the final norm, the head and the
// loss.
struct StageBlocks {
  int first = 0;  // first block
  int count = 0;  // blocks
  bool embedding = false;
  bool head = false;
};

// Splits `blocks` blocks into `stages` contiguous stages: evenly when `cuts`
// is empty (the first blocks % stages stages get one block more), else at
// `cuts` (the first block of stages 1 .. stages - 1, increasing, each stage
// keeping at least one block). InvalidArgument naming what is wrong:
// fewer blocks than stages, a cut count other than stages - 1, cuts out of
// order or out of range.
absl::StatusOr<std::vector<StageBlocks>> SplitStages(
    int blocks, int stages, const std::vector<int>& cuts = {});

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_PIPELINE_SCHEDULE_H_
