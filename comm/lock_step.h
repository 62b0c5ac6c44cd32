// Two thread ranks of one process in lock step, for benchmarks of
// collectives: rank 0 is the calling (benchmark) thread, rank 1 a helper
// thread that runs `step(1)` once for each Step() of rank 0. Every step ends
// with a spin barrier of both threads (so an iteration takes as long as the
// slower rank); what a step returns is destroyed only after both ranks have
// finished that step. A rank that does not arrive within `barrier_timeout`
// aborts the process with a message instead of hanging it.
#ifndef FSDPP_COMM_LOCK_STEP_H_
#define FSDPP_COMM_LOCK_STEP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/logging.h"

namespace fsdpp {
namespace testing_util {

class LockStep {
 public:
  using StepFn = std::function<std::shared_ptr<void>(int rank)>;

  explicit LockStep(StepFn step,
                    absl::Duration barrier_timeout = absl::Minutes(5))
      : step_(std::move(step)),
        barrier_timeout_(barrier_timeout),
        helper_([this] { HelperLoop(); }) {}
  ~LockStep() {
    stop_.store(true);
    helper_.join();
  }
  LockStep(const LockStep&) = delete;
  LockStep& operator=(const LockStep&) = delete;

  // Runs one step on both ranks.
  void Step() {
    go_.fetch_add(1);
    std::shared_ptr<void> keep = step_(0);
    Arrive(0);
  }

 private:
  static constexpr int kRanks = 2;

  // Rank 1 waits for the next Step() (idle between benchmark runs: no
  // deadline) or for the destructor.
  void HelperLoop() {
    for (int64_t i = 0;; ++i) {
      while (go_.load() <= i) {
        if (stop_.load() && go_.load() <= i) return;
        std::this_thread::yield();
      }
      std::shared_ptr<void> keep = step_(1);
      Arrive(1);
    }
  }

  // A spin barrier of the two threads.
  void Arrive(int rank) {
    const int64_t generation = generation_.load();
    if (arrived_.fetch_add(1) == kRanks - 1) {
      arrived_.store(0);
      generation_.fetch_add(1);
      return;
    }
    const absl::Time deadline = absl::Now() + barrier_timeout_;
    while (generation_.load() == generation) {
      CHECK(absl::Now() < deadline)
          << "LockStep: rank " << rank << " waited "
          << absl::FormatDuration(barrier_timeout_) << " for rank " << 1 - rank
          << " to finish its step";
      std::this_thread::yield();
    }
  }

  const StepFn step_;
  const absl::Duration barrier_timeout_;
  std::atomic<int64_t> go_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> arrived_{0};
  std::atomic<int64_t> generation_{0};
  std::thread helper_;  // Last: starts after the members it reads.
};

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_COMM_LOCK_STEP_H_
