// Splitting a memory-bound loop across the OpenMP pool, and the CPUs this
// process may use.
#ifndef FSDPP_CORE_PARALLEL_H_
#define FSDPP_CORE_PARALLEL_H_

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace fsdpp {

// Below this many elements a loop runs on the calling thread: the pool's
// wake-up costs more than the work.
constexpr int64_t kParallelElements = 1 << 15;

// Calls chunk(begin, end) on disjoint ranges covering [0, n) exactly once:
// one range on the calling thread when n <= kParallelElements, otherwise one
// per OpenMP thread, each starting at a multiple of 64 elements (whole cache
// lines for every dtype, so no two threads write one line). For kernels whose
// result per element does not depend on the split.
void ParallelChunks(int64_t n,
                    absl::FunctionRef<void(int64_t begin, int64_t end)> chunk);

// The same split of [0, n), parallel when `work` (the elements the chunks
// touch in all, e.g. rows x columns when the chunks are column ranges)
// exceeds kParallelElements.
void ParallelChunks(int64_t n, int64_t work,
                    absl::FunctionRef<void(int64_t begin, int64_t end)> chunk);

// The part of [0, n) thread t of nt takes in ParallelChunks ([begin, end),
// possibly empty), for a split inside a parallel region already open.
void ThreadChunk(int64_t n, int t, int nt, int64_t* begin, int64_t* end);

// Number of CPUs this process may run on (its affinity mask), at least 1:
// what the launcher divides among local ranks and the planner measures on.
int AvailableCpus();

// The OpenMP pool's size for the next parallel region (omp_get_max_threads).
int ParallelThreads();

}  // namespace fsdpp

#endif  // FSDPP_CORE_PARALLEL_H_
