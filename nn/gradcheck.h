// Test helpers for modules: finite-difference gradient checks, gradient
// accumulation checks and bf16-vs-f32 forward comparisons.
//
// The scalar checked is L = sum(dy * y) for a fixed random dy, so dL/dy = dy
// and Backward(dy) must return dL/dx and add dL/dp to every Parameter::grad.
// L is accumulated in double from the f32 outputs and differentiated by
// central differences, perturbing every input element and every parameter
// element in place (CPU, f32), one at a time.
#ifndef FSDPP_NN_GRADCHECK_H_
#define FSDPP_NN_GRADCHECK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/allocator.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {
namespace testing_util {

struct GradCheckOptions {
  double step = 1e-3;  // Central-difference step h.
  // |analytic - numeric| <= atol + rtol * |numeric| for every element.
  double rtol = 1e-3;
  double atol = 1e-3;
  // Perturb the input too (it must then be a float tensor).
  bool check_input = true;
  uint64_t dy_seed = 1234;  // Seed of the random dy.
};

// Materialises `module` on the CPU (ToEmpty) and initialises it with `seed`;
// with `randomize`, every parameter's InitSpec is first replaced by
// Uniform(-1, 1), so that ones/zeros-initialised norms and biases also get
// checked at generic values and outputs are O(1).
absl::Status Materialize(Module& module, uint64_t seed, bool randomize = true);

// Checks `module` (materialised, f32 parameters on the CPU) at input `x`
// (CPU): dx and every parameter gradient against central differences, and
// that a second Forward + Backward adds the same gradients again (grads
// accumulate; dx does not). Leaves the module's grads set.
::testing::AssertionResult CheckGradients(Module& module, const Tensor& x,
                                          const GradCheckOptions& options = {});

// Builds a module with parameters of the given dtype (the same structure and
// names for every call).
using ModuleFactory = std::function<std::unique_ptr<Module>(DType)>;

// Runs the module built with f32 parameters on x (f32) and the one built with
// bf16 parameters on x rounded to bf16, both initialised with `seed`, and
// checks the bf16 output against the f32 one:
// |y_bf16 - y_f32| <= tol * (|y_f32| + max |y_f32|).
::testing::AssertionResult CheckBf16Forward(const ModuleFactory& factory,
                                            const Tensor& x, double tol = 2e-2,
                                            uint64_t seed = 7);

// Installs a fresh CpuAllocator (exact stats from zero) for its lifetime and
// restores the previous one after. Declare it before any tensor it should
// count, so those are freed first.
class ScopedCpuAllocator {
 public:
  ScopedCpuAllocator() : previous_(SetAllocator(&allocator_)) {}
  ~ScopedCpuAllocator() { SetAllocator(previous_); }
  ScopedCpuAllocator(const ScopedCpuAllocator&) = delete;
  ScopedCpuAllocator& operator=(const ScopedCpuAllocator&) = delete;

  // The fresh allocator's accounting.
  MemoryStats Stats() const { return allocator_.Stats(); }

 private:
  CpuAllocator allocator_;
  Allocator* previous_;
};

// The status of a Status or StatusOr (for the assertion macros below).
inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

}  // namespace testing_util
}  // namespace nn
}  // namespace fsdpp

// Fails the test (returning) when `expr` (Status or StatusOr) is not OK.
#ifndef ASSERT_OK
#define ASSERT_OK(expr)                               \
  for (const ::absl::Status fsdpp_assert_status_ =    \
           ::fsdpp::nn::testing_util::StatusOf(expr); \
       !fsdpp_assert_status_.ok();)                   \
  FAIL() << #expr << ": " << fsdpp_assert_status_
#endif

// `lhs` = the value of `rexpr` (a StatusOr), or the test fails (returning).
#ifndef ASSERT_OK_AND_ASSIGN
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  FSDPP_ASSERT_OK_AND_ASSIGN_IMPL(       \
      FSDPP_STATUS_CONCAT(fsdpp_assert_statusor_, __COUNTER__), lhs, rexpr)
#define FSDPP_ASSERT_OK_AND_ASSIGN_IMPL(statusor, lhs, rexpr)        \
  auto statusor = (rexpr);                                           \
  ASSERT_TRUE(statusor.ok()) << #rexpr << ": " << statusor.status(); \
  lhs = std::move(statusor).value()
#endif

#endif  // FSDPP_NN_GRADCHECK_H_
