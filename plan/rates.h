// The rates a plan's step time rests on: a CPU's measured matmul FLOP/s and
// collective bandwidth, a GPU's data-sheet peak.
#ifndef FSDPP_PLAN_RATES_H_
#define FSDPP_PLAN_RATES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/dtype.h"

namespace fsdpp {
namespace plan {

// FLOP/s of an n x n x n matmul in `dtype` (f32 or bf16) on the CPU with the
// calling thread's OpenMP threads: the best of repeated runs over at least
// `budget` (after one warm-up call).
absl::StatusOr<double> MeasureMatmulFlops(DType dtype, int64_t n,
                                          absl::Duration budget);

// Datasheet dense peak FLOP/s of a GPU by name fragment ("H100", "A100",
// ...) for `dtype`; 0 when unknown.
double GpuPeakFlops(const std::string& device_name, DType dtype);

// Bus bandwidth (bytes/s, nccl-tests' busbw) of an all-gather of `bytes`
// between two thread ranks over Gloo on this host, over TCP loopback or
// through shared memory (GlooOptions::shared_memory): the rate of the
// collectives between ranks of one node here. The best of `reps` after one
// warm-up.
absl::StatusOr<double> MeasureGlooBusBandwidth(int64_t bytes, int reps = 3,
                                               bool shared_memory = false);

}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_RATES_H_
