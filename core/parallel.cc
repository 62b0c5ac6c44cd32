#include "core/parallel.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

namespace fsdpp {

void ThreadChunk(int64_t n, int t, int nt, int64_t* begin, int64_t* end) {
  *begin = (n * t / nt) & ~int64_t{63};
  *end = t + 1 == nt ? n : (n * (t + 1) / nt) & ~int64_t{63};
}

void ParallelChunks(int64_t n, int64_t work,
                    absl::FunctionRef<void(int64_t begin, int64_t end)> chunk) {
  if (work <= kParallelElements) {
    if (n > 0) chunk(0, n);
    return;
  }
#pragma omp parallel
  {
    int64_t begin, end;
    ThreadChunk(n, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
    if (end > begin) chunk(begin, end);
  }
}

void ParallelChunks(int64_t n,
                    absl::FunctionRef<void(int64_t begin, int64_t end)> chunk) {
  ParallelChunks(n, n, chunk);
}

int AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

int ParallelThreads() { return omp_get_max_threads(); }

}  // namespace fsdpp
