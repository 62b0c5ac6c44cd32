#include "core/parallel.h"

#include <omp.h>

namespace fsdpp {

void ParallelChunks(int64_t n,
                    absl::FunctionRef<void(int64_t begin, int64_t end)> chunk) {
  if (n <= kParallelElements) {
    if (n > 0) chunk(0, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = (n * t / nt) & ~int64_t{63};
    const int64_t end = t + 1 == nt ? n : (n * (t + 1) / nt) & ~int64_t{63};
    if (end > begin) chunk(begin, end);
  }
}

}  // namespace fsdpp
