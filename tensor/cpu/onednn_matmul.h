// Matrix multiply on the CPU through oneDNN.
//
// oneDNN picks AVX-512 / AMX (bf16) kernels from CPUID at run time, so the
// binaries stay portable. Primitives are cached per (shapes, transposes,
// dtypes, alpha, beta): training repeats the same few shapes every step and
// building a primitive costs far more than running a small one.
//
// bf16 operands are multiplied either natively (oneDNN's bf16 kernels: AMX
// tiles, or AVX-512-BF16 dot products) or widened: converted to f32 in
// blocks of at most 8 MiB for a and for b (32 MiB for c when c is not
// f32; per-thread buffers the thread keeps, like oneDNN's scratchpad) and
// multiplied by the f32 kernels. Both accumulate in
// f32 (a bf16 product is exact in f32), so they differ only in the order
// of the sums. Widened is the default where the CPU's bf16 dot products
// are slower than its f32 FMAs: an Intel CPU without AMX (VDPBF16PS at half
// the FMAs' FLOP rate; on such a machine oneDNN's bf16 kernels ran GPT-2's
// Linear calls at 80-164 GFLOP/s, widened 178-257, docs/PERFORMANCE.md) or one
// without AVX-512-BF16. f16 operands (no f16 matmul in oneDNN 2.6 on CPUs) are
// always widened. OneDnnStridedMatmul widens nothing (on that machine the
// blocked attention's small blocks ran 1.5x slower widened one by one); the
// blocked attention itself widens a group's tensors once where bf16
// matmuls are widened (cpu/attention.h).
#ifndef FSDPP_TENSOR_CPU_ONEDNN_MATMUL_H_
#define FSDPP_TENSOR_CPU_ONEDNN_MATMUL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace fsdpp {
namespace cpu {

// How bf16 operands are multiplied on this CPU (see above).
enum class Bf16MatmulMode { kNative, kWidened };

// The mode every bf16 matmul of this process takes: FSDPP_CPU_BF16_MATMUL=
// native | widen, or (unset, empty or "auto") chosen from the CPU: native
// with AMX, or with AVX-512-BF16 on a CPU not made by Intel (AMD Zen 4 and
// 5 run VDPBF16PS at twice the FLOP rate of their FMAs); widened otherwise.
// InvalidArgument naming the variable for any other value.
absl::StatusOr<Bf16MatmulMode> OneDnnBf16MatmulMode();
// One line saying which mode and why ("bf16 matmul widened to f32: Intel
// CPU without AMX"), for the trainer's header; the error's text when the
// variable is bad.
std::string OneDnnBf16MatmulModeDescription();

// The environment variable above.
inline constexpr char kBf16MatmulVariable[] = "FSDPP_CPU_BF16_MATMUL";

// The choice OneDnnBf16MatmulMode makes for the variable's value `setting`
// ("" when unset) on a CPU with / without AMX and AVX-512-BF16, made by
// Intel or not; `description` gets the line OneDnnBf16MatmulModeDescription
// gives (or the error's text).
absl::StatusOr<Bf16MatmulMode> Bf16MatmulModeFor(const std::string& setting,
                                                 bool amx, bool avx512_bf16,
                                                 bool intel,
                                                 std::string* description);

// Tests: force a mode (nullptr: back to the process's own), and the most
// bytes one widened operand's block may take (0: back to the default,
// 8 MiB). Not thread-safe against concurrent matmuls.
void SetBf16MatmulModeForTesting(const Bf16MatmulMode* mode);
void SetWidenedBlockBytesForTesting(int64_t bytes);

// Row-major c[bt] = alpha * op(a[bt]) @ op(b[bt or 0]) + beta * c[bt] for bt in
// [0, batch). a: [batch, M, K] (or [batch, K, M] transposed), b: [batch or 1,
// K, N] (or [.., N, K] transposed), c: [batch, M, N]. a_dtype == b_dtype, each
// f32, bf16 or f16; c_dtype f32 or a_dtype. `bias` ([n] of c_dtype, or null) is
// added to every row of c in the same pass (then alpha == 1, beta == 0).
absl::Status OneDnnMatmul(const void* a, const void* b, void* c, DType ab_dtype,
                          DType c_dtype, int64_t batch, int64_t m, int64_t n,
                          int64_t k, bool transpose_a, bool transpose_b,
                          bool broadcast_b, float alpha, float beta,
                          const void* bias = nullptr);

// Whether OneDnnMatmul stages b for [rows x k] @ [k x n] (rows: all of c's
// batches' rows): an f32, row-major b whose rows are a multiple of 4 KiB
// long, with at least 512 rows of c and k >= 256 to pay for the copy, is
// copied in column blocks laid a little wider than n. oneDNN 2.6's f32
// matmul of a row-major b and c with rows of 3072 or 6144 floats ran at
// half its rate (an MLP's down-projection's dx and dW); the copy costs
// about 1/M of the matmul.
bool OneDnnMatmulStagesB(DType ab_dtype, bool transpose_b, int64_t rows,
                         int64_t n, int64_t k);

// The inner dim's chunk length OneDnnMatmul takes for [m x k] @ [k x n]
// (0: the whole k at once). A k of at least 16384 and 8 times m and n goes
// in chunks of about 4096 that add up in f32 (unless c is not f32 and beta
// != 0, or with a bias: then at once).
int64_t OneDnnMatmulKChunk(int64_t m, int64_t n, int64_t k);
// The rows of c OneDnnMatmul computes per call otherwise (0: all at once):
// a transposed bf16 a of at least 24576 rows and 8 times n and k goes in
// chunks of about 12288 rows.
int64_t OneDnnMatmulMChunk(DType ab_dtype, bool transpose_a, int64_t m,
                           int64_t n, int64_t k);

// One operand of OneDnnStridedMatmul: a batch of matrices, dims [batch,
// rows, cols] with element strides (a batch of 1 broadcasts).
struct StridedOperand {
  const void* data;
  int64_t dims[3];
  int64_t strides[3];
};

// c[i] = alpha * a[i] @ b[i] + beta * c[i] for i < a's batch; a: [batch, m,
// k], b: [batch or 1, k, n], c: [batch, m, n] with strides c_strides, any
// strides (a transpose is a swap of the last two). a and b of `ab_dtype`
// (f32, bf16 or f16), c of `c_dtype` (f32 or ab_dtype). Cached like
// OneDnnMatmul (by shapes and strides). An op-profile span "StridedMatmul"
// (category matmul).
absl::Status OneDnnStridedMatmul(DType ab_dtype, DType c_dtype,
                                 const StridedOperand& a,
                                 const StridedOperand& b, void* c,
                                 const int64_t c_strides[3], float alpha,
                                 float beta);

// Number of distinct primitives built so far (for tests of the cache).
int64_t OneDnnMatmulCacheSize();

}  // namespace cpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CPU_ONEDNN_MATMUL_H_
