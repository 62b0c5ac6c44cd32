// Matrix multiply on the GPU through cuBLASLt.
//
// cuBLASLt is column-major; a row-major matrix is the column-major view of its
// transpose, so row-major C = op(A) op(B) is computed as the column-major
// C^T = op(B)^T op(A)^T, i.e. with the operands swapped and no data movement.
// Per device we keep one cublasLtHandle_t and one workspace buffer, and cache
// per (shape, transposes, dtypes, pointer alignments, epilogue) the matmul
// and layout descriptors with the algorithm cublasLtMatmulAlgoGetHeuristic
// picks: training repeats the same few shapes, and the heuristic query and
// descriptor creation cost far more than the launch. Plain C++ header (no CUDA
// types) so host code may include it.
#ifndef FSDPP_TENSOR_CUDA_CUBLASLT_MATMUL_H_
#define FSDPP_TENSOR_CUDA_CUBLASLT_MATMUL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace fsdpp {
namespace gpu {

// Row-major c[bt] = alpha * op(a[bt]) @ op(b[bt or 0]) + beta * c[bt] for bt in
// [0, batch) on GPU `device`, enqueued on the legacy default stream. a:
// [batch, M, K] (or [batch, K, M] transposed), b: [batch or 1, K, N] (or
// [.., N, K] transposed), c: [batch, M, N]; all device pointers. ab_dtype is
// f32 or bf16 (accumulation in f32, no TF32); c_dtype is f32 or ab_dtype.
// `bias` (optional, c_dtype [N], 16-byte aligned, batch 1 only) is added to
// every row by cuBLASLt's BIAS epilogue. Errors name the failing cuBLASLt
// call and its cublasStatus_t.
absl::Status CublasLtMatmul(int device, const void* a, const void* b, void* c,
                            DType ab_dtype, DType c_dtype, int64_t batch,
                            int64_t m, int64_t n, int64_t k, bool transpose_a,
                            bool transpose_b, bool broadcast_b, float alpha,
                            float beta, const void* bias = nullptr);

// Whether CublasLtMatmul takes `bias` for this call (batch 1 and a 16-byte
// aligned bias); otherwise the caller adds it.
bool CublasLtTakesBias(int64_t batch, const void* bias);

// Number of algorithm choices cached so far over all devices (for tests of
// the cache).
int64_t CublasLtMatmulCacheSize();

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CUDA_CUBLASLT_MATMUL_H_
