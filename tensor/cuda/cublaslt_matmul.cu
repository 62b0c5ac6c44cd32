// cuBLASLt matmul; see cublaslt_matmul.h.
//
// The heuristic query is told the real alignment of every pointer
// (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*): tensors are views into shared
// storage (Narrow), so operands are not always 256-byte aligned as cuBLASLt
// assumes by default, and an algorithm picked for aligned pointers may not
// run on unaligned ones. The alignments are therefore part of the cache key.
// The per-device mutex is held across the launch because the workspace is
// shared by every call on that device.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/status.h"
#include "tensor/cuda/cublaslt_matmul.h"

namespace fsdpp {
namespace gpu {
namespace {

// Workspace per device: what NVIDIA recommends for Hopper (enough for Ampere).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// How many candidates the heuristic returns; we run the best-ranked one.
constexpr int kHeuristicCandidates = 8;

absl::Status LtStatus(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      call, ": ", cublasLtGetStatusName(status), " (", static_cast<int>(status),
      "): ", cublasLtGetStatusString(status)));
}

// Calls the cuBLASLt function `fn` and returns a Status naming it on failure.
#define FSDPP_CUBLASLT_RETURN_IF_ERROR(fn, ...) \
  FSDPP_RETURN_IF_ERROR(LtStatus(fn(__VA_ARGS__), #fn))

template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
struct LtDeleter {
  void operator()(Handle h) const { Destroy(h); }
};
using MatmulDesc =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                    LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<
    std::remove_pointer_t<cublasLtMatrixLayout_t>,
    LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<
    std::remove_pointer_t<cublasLtMatmulPreference_t>,
    LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

// batch, m, n, k, transpose_a, transpose_b, broadcast_b, ab_dtype, c_dtype,
// alignment of a, b, c (bytes), bias epilogue.
using AlgoKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool,
                           DType, DType, uint32_t, uint32_t, uint32_t, bool>;

// What one AlgoKey runs with: its descriptors and algorithm.
struct MatmulPlan {
  MatmulDesc desc;
  Layout first, second, c;
  cublasLtMatmulAlgo_t algo;
};

// The cuBLASLt state of one GPU. Lives for the whole process.
struct DeviceContext {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<AlgoKey, MatmulPlan> plans;  // Guarded by mu.
};

std::atomic<int64_t> cache_size{0};

// The context of `device` (current device already set), created on first
// use. A failed creation is not cached, so a later call retries.
absl::StatusOr<DeviceContext*> ContextFor(int device) {
  static auto* mu = new std::mutex;
  static auto* contexts = new std::unordered_map<int, DeviceContext*>;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = contexts->find(device);
  if (it != contexts->end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtCreate, &handle);
  void* workspace = nullptr;
  const cudaError_t e = cudaMalloc(&workspace, kWorkspaceBytes);
  if (e != cudaSuccess) {
    cublasLtDestroy(handle);
    return CudaStatus(e, "cudaMalloc(cuBLASLt workspace)");
  }
  auto* context = new DeviceContext;
  context->handle = handle;
  context->workspace = workspace;
  contexts->emplace(device, context);
  return context;
}

absl::StatusOr<cudaDataType_t> CudaType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("CublasLtMatmul: unsupported dtype ", DTypeName(dtype),
                       " (f32, bf16 or f16)"));
  }
}

// The largest power of two (at most 256) that divides the address.
uint32_t Alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  if (address == 0) return 256;
  return static_cast<uint32_t>(
      std::min<uintptr_t>(address & (~address + 1), 256));
}

// A column-major rows x cols layout with leading dimension ld, repeated
// `batch` times `stride` elements apart.
absl::StatusOr<Layout> MakeLayout(cudaDataType_t type, int64_t rows,
                                  int64_t cols, int64_t ld, int32_t batch,
                                  int64_t stride) {
  cublasLtMatrixLayout_t raw = nullptr;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate, &raw, type,
                                 static_cast<uint64_t>(rows),
                                 static_cast<uint64_t>(cols), ld);
  Layout layout(raw);
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute, raw,
                                 CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                 sizeof(batch));
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute, raw,
                                 CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                 &stride, sizeof(stride));
  return layout;
}

// Asks the heuristic for the best algorithm for these descriptors.
absl::StatusOr<cublasLtMatmulAlgo_t> PickAlgo(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
    cublasLtMatrixLayout_t lt_a, cublasLtMatrixLayout_t lt_b,
    cublasLtMatrixLayout_t lt_c, uint32_t align_lt_a, uint32_t align_lt_b,
    uint32_t align_c, const AlgoKey& key) {
  cublasLtMatmulPreference_t raw = nullptr;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate, &raw);
  Preference preference(raw);
  const uint64_t workspace_bytes = kWorkspaceBytes;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute, raw,
                                 CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                 &workspace_bytes, sizeof(workspace_bytes));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] =
      {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_lt_a},
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_lt_b},
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}};
  for (const auto& [attr, bytes] : alignments) {
    FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute, raw,
                                   attr, &bytes, sizeof(bytes));
  }
  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates] = {};
  int returned = 0;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic, handle, desc,
                                 lt_a, lt_b, lt_c, lt_c, raw,
                                 kHeuristicCandidates, results, &returned);
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) return results[i].algo;
  }
  const auto& [batch, m, n, k, ta, tb, bcast, ab_dtype, c_dtype, aa, ab, ac,
               bias] = key;
  return absl::NotFoundError(absl::StrCat(
      "cublasLtMatmulAlgoGetHeuristic: no algorithm for batch ", batch, " m ",
      m, " n ", n, " k ", k, " transpose_a ", ta, " transpose_b ", tb,
      " broadcast_b ", bcast, " ", DTypeName(ab_dtype), " x ",
      DTypeName(ab_dtype), " -> ", DTypeName(c_dtype), " (alignments a ", aa,
      " b ", ab, " c ", ac, bias ? "; bias epilogue" : "", ")"));
}

// The descriptors and algorithm for `key` (see CublasLtMatmul).
absl::StatusOr<MatmulPlan> MakePlan(cublasLtHandle_t handle,
                                    const AlgoKey& key) {
  const auto& [batch, m, n, k, transpose_a, transpose_b, broadcast_b, ab_dtype,
               c_dtype, align_a, align_b, align_c, bias] = key;
  FSDPP_ASSIGN_OR_RETURN(const cudaDataType_t ab_type, CudaType(ab_dtype));
  FSDPP_ASSIGN_OR_RETURN(const cudaDataType_t c_type, CudaType(c_dtype));
  // Column-major C^T [n, m] = op(B)^T [n, k] @ op(A)^T [k, m]: cuBLASLt's
  // first operand is our b, its second our a. Row-major b [k, n] is already
  // column-major [n, k] (no transpose); stored [n, k] it is column-major
  // [k, n] and needs one. Likewise for a. The bias, one value per row of
  // C^T (per column of our c), is what the BIAS epilogue adds.
  cublasLtMatmulDesc_t raw_desc = nullptr;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescCreate, &raw_desc,
                                 CUBLAS_COMPUTE_32F, CUDA_R_32F);
  MatmulDesc desc(raw_desc);
  const cublasOperation_t op_first = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute, raw_desc,
                                 CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                 sizeof(op_first));
  FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute, raw_desc,
                                 CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                 sizeof(op_second));
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute, raw_desc,
                                   CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                   sizeof(epilogue));
    const cudaDataType_t bias_type = c_type;
    FSDPP_CUBLASLT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute, raw_desc,
                                   CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                   &bias_type, sizeof(bias_type));
  }
  const int32_t batch32 = static_cast<int32_t>(batch);
  FSDPP_ASSIGN_OR_RETURN(
      Layout lt_first,
      transpose_b
          ? MakeLayout(ab_type, k, n, k, batch32, broadcast_b ? 0 : n * k)
          : MakeLayout(ab_type, n, k, n, batch32, broadcast_b ? 0 : n * k));
  FSDPP_ASSIGN_OR_RETURN(Layout lt_second,
                         transpose_a
                             ? MakeLayout(ab_type, m, k, m, batch32, m * k)
                             : MakeLayout(ab_type, k, m, k, batch32, m * k));
  FSDPP_ASSIGN_OR_RETURN(Layout lt_c,
                         MakeLayout(c_type, n, m, n, batch32, m * n));
  FSDPP_ASSIGN_OR_RETURN(
      cublasLtMatmulAlgo_t algo,
      PickAlgo(handle, raw_desc, lt_first.get(), lt_second.get(), lt_c.get(),
               align_b, align_a, align_c, key));
  return MatmulPlan{std::move(desc), std::move(lt_first), std::move(lt_second),
                    std::move(lt_c), algo};
}

}  // namespace

bool CublasLtTakesBias(int64_t batch, const void* bias) {
  return batch == 1 && bias != nullptr && Alignment(bias) >= 16;
}

absl::Status CublasLtMatmul(int device, const void* a, const void* b, void* c,
                            DType ab_dtype, DType c_dtype, int64_t batch,
                            int64_t m, int64_t n, int64_t k, bool transpose_a,
                            bool transpose_b, bool broadcast_b, float alpha,
                            float beta, const void* bias) {
  if (batch <= 0 || m <= 0 || n <= 0 || k <= 0 || batch > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("CublasLtMatmul: need 0 < batch <= 2^31-1 and positive m, "
                     "n, k; got batch ",
                     batch, " m ", m, " n ", n, " k ", k));
  }
  if (bias != nullptr && !CublasLtTakesBias(batch, bias)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CublasLtMatmul: the bias epilogue needs batch 1 and a 16-byte aligned "
        "bias; got batch ",
        batch, " and alignment ", Alignment(bias)));
  }
  FSDPP_RETURN_IF_ERROR(CudaType(ab_dtype).status());
  FSDPP_RETURN_IF_ERROR(CudaType(c_dtype).status());
  FSDPP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  FSDPP_ASSIGN_OR_RETURN(DeviceContext * context, ContextFor(device));

  const AlgoKey key{batch,
                    m,
                    n,
                    k,
                    transpose_a,
                    transpose_b,
                    broadcast_b,
                    ab_dtype,
                    c_dtype,
                    Alignment(a),
                    Alignment(b),
                    Alignment(c),
                    bias != nullptr};
  std::lock_guard<std::mutex> lock(context->mu);
  auto it = context->plans.find(key);
  if (it == context->plans.end()) {
    FSDPP_ASSIGN_OR_RETURN(MatmulPlan plan, MakePlan(context->handle, key));
    it = context->plans.emplace(key, std::move(plan)).first;
    cache_size.fetch_add(1, std::memory_order_relaxed);
  }
  MatmulPlan& plan = it->second;
  if (bias != nullptr) {
    FSDPP_CUBLASLT_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute, plan.desc.get(),
        CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  }
  FSDPP_CUBLASLT_RETURN_IF_ERROR(
      cublasLtMatmul, context->handle, plan.desc.get(), &alpha, b,
      plan.first.get(), a, plan.second.get(), &beta, c, plan.c.get(), c,
      plan.c.get(), &plan.algo, context->workspace, kWorkspaceBytes,
      cudaStreamLegacy);
  return absl::OkStatus();
}

int64_t CublasLtMatmulCacheSize() {
  return cache_size.load(std::memory_order_relaxed);
}

}  // namespace gpu
}  // namespace fsdpp
