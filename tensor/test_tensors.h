// Test helpers for tensor code: deterministic random tensors and
// comparisons against double-precision references with readable failures.
#ifndef FSDPP_TENSOR_TEST_TENSORS_H_
#define FSDPP_TENSOR_TEST_TENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace testing_util {

// A tensor of `shape` with uniform values in [lo, hi), stored as `dtype`.
Tensor RandomTensor(const Shape& shape, DType dtype, uint64_t seed,
                    float lo = -1.0f, float hi = 1.0f);

// The tensor's values as doubles (after its storage rounding).
std::vector<double> Values(const Tensor& t);

// Passes when |actual - expected| <= atol + rtol * |expected| everywhere;
// otherwise reports the worst element.
::testing::AssertionResult AllClose(const std::vector<double>& actual,
                                    const std::vector<double>& expected,
                                    double rtol, double atol);

// True when both tensors have the same dtype, shape and bytes (empty ones
// compare without touching their null storage).
bool BitwiseEqual(const Tensor& a, const Tensor& b);

// Tolerances per storage type: f32 results against a double reference that
// saw the same (rounded) inputs; 16-bit results additionally carry one
// output rounding (2^-8 relative for bf16, 2^-11 for f16).
double RelTol(DType dtype);

// Rows `rows` (indices along T) of a host [B, N, T, hd] tensor of any
// dtype, as [B, N, rows.size(), hd] (a context-parallel rank's rows).
Tensor GatherRows(const Tensor& x, const std::vector<int64_t>& rows);

// Ids [b, t] (i32) of packed documents: end-of-text id 0 at the start of
// each row and then every 7 to 40 tokens (a fixed pseudo-random walk), 1
// elsewhere.
Tensor PackedDocumentIds(int64_t b, int64_t t);

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_TEST_TENSORS_H_
