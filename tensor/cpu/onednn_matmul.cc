// oneDNN matmul with a primitive cache; see onednn_matmul.h.
#include "tensor/cpu/onednn_matmul.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/base/casts.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/trace.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "tensor/cpu/simd.h"

namespace fsdpp {
namespace cpu {
namespace {

// Everything a primitive depends on (shapes, strides, dtypes, alpha and
// beta as bits, bias or not); OneDnnMatmul's and OneDnnStridedMatmul's keys
// differ in length. Inline: the lookup every matmul makes allocates nothing.
using Key = absl::InlinedVector<int64_t, 24>;

// The inner dim's chunk length of a K-chunked matmul is about this, and
// the rows of an M-chunked one.
constexpr int64_t kKChunk = 4096;
constexpr int64_t kMChunk = 12288;

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

std::mutex& CacheMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// A built primitive and the scratchpad size it needs per execution.
struct Cached {
  dnnl::matmul primitive;
  size_t scratchpad_bytes = 0;
};

absl::flat_hash_map<Key, Cached>& Cache() {
  static auto* cache = new absl::flat_hash_map<Key, Cached>;
  return *cache;
}

// Per-thread work buffers, page-aligned like oneDNN's own scratchpad (AMX /
// AVX-512 kernels want aligned workspaces).
enum class ThreadBuffer {
  // Primitives use a user-managed scratchpad so that several threads (e.g.
  // ranks as threads) can run them concurrently; oneDNN's library-managed
  // scratchpad is shared between primitives and is not safe for that.
  kScratchpad,
  // The f32 sums of a K-chunked matmul whose c is not f32.
  kAccumulator,
  // A widened matmul's f32 blocks of a, b, c (when c is not f32) and bias.
  kWidenedA,
  kWidenedB,
  kWidenedC,
  kWidenedBias,
};

char* ThreadBufferOf(ThreadBuffer which, size_t bytes) {
  struct Buffer {
    ~Buffer() { std::free(data); }
    char* data = nullptr;
    size_t size = 0;
  };
  thread_local Buffer buffers[6];
  Buffer& buffer = buffers[static_cast<int>(which)];
  if (buffer.size < bytes) {
    std::free(buffer.data);
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    buffer.data = static_cast<char*>(std::aligned_alloc(4096, rounded));
    CHECK(buffer.data != nullptr)
        << "oneDNN matmul work buffer: out of memory for " << rounded
        << " bytes";
    buffer.size = rounded;
  }
  return buffer.data;
}

dnnl::memory::data_type DnnlType(DType dtype) {
  return dtype == DType::kBF16 ? dnnl::memory::data_type::bf16
                               : dnnl::memory::data_type::f32;
}

struct Descs {
  dnnl::memory::desc a, b, c, bias;
};

// The cached primitive for `key` (built from the descriptors on a miss).
// `what` names the matmul in the error of a failed build.
absl::StatusOr<Cached> GetOrBuild(const Key& key, const Descs& descs,
                                  bool with_bias, float alpha, float beta,
                                  absl::FunctionRef<std::string()> what) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto it = Cache().find(key);
  if (it != Cache().end()) return it->second;
  Cached cached;
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::desc desc =
        with_bias ? dnnl::matmul::desc(descs.a, descs.b, descs.bias, descs.c)
                  : dnnl::matmul::desc(descs.a, descs.b, descs.c);
    dnnl::matmul::primitive_desc pd(desc, attr, Engine());
    cached.primitive = dnnl::matmul(pd);
    cached.scratchpad_bytes = pd.scratchpad_desc().get_size();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul ", what(), ": ", e.what()));
  }
  Cache().emplace(key, cached);
  return cached;
}

absl::Status Execute(const Cached& cached, const Descs& descs, const void* a,
                     const void* b, void* c, const void* bias) {
  try {
    thread_local dnnl::stream stream(Engine());
    dnnl::memory a_mem(descs.a, Engine(), const_cast<void*>(a));
    dnnl::memory b_mem(descs.b, Engine(), const_cast<void*>(b));
    dnnl::memory c_mem(descs.c, Engine(), c);
    const dnnl::memory::desc scratch_md(
        {static_cast<dnnl::memory::dim>(cached.scratchpad_bytes)},
        dnnl::memory::data_type::u8, dnnl::memory::format_tag::a);
    dnnl::memory scratch_mem(
        scratch_md, Engine(),
        ThreadBufferOf(ThreadBuffer::kScratchpad, cached.scratchpad_bytes));
    std::unordered_map<int, dnnl::memory> exec_args = {
        {DNNL_ARG_SRC, a_mem},
        {DNNL_ARG_WEIGHTS, b_mem},
        {DNNL_ARG_DST, c_mem},
        {DNNL_ARG_SCRATCHPAD, scratch_mem}};
    if (bias != nullptr) {
      exec_args.emplace(DNNL_ARG_BIAS, dnnl::memory(descs.bias, Engine(),
                                                    const_cast<void*>(bias)));
    }
    cached.primitive.execute(stream, exec_args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul execute: ", e.what()));
  }
  return absl::OkStatus();
}

// Runs the cached primitive for `key` with alpha, beta and whether there
// is a bias appended to it (built from `descs` on a miss) on a, b, c and
// bias.
absl::Status RunCached(Key key, const Descs& descs, float alpha, float beta,
                       const void* a, const void* b, void* c, const void* bias,
                       absl::FunctionRef<std::string()> what) {
  key.push_back(absl::bit_cast<int32_t>(alpha));
  key.push_back(absl::bit_cast<int32_t>(beta));
  key.push_back(bias != nullptr);
  FSDPP_ASSIGN_OR_RETURN(
      const Cached cached,
      GetOrBuild(key, descs, bias != nullptr, alpha, beta, what));
  return Execute(cached, descs, a, b, c, bias);
}

// ---- bf16 (and f16) operands widened to f32; f32 b staged ----

constexpr int64_t kWidenedBlockBytes = int64_t{8} << 20;
std::atomic<int64_t> widened_block_bytes_for_testing{0};
std::atomic<int> mode_for_testing{-1};

int64_t WidenedBlockBytes() {
  const int64_t forced = widened_block_bytes_for_testing.load();
  return forced > 0 ? forced : kWidenedBlockBytes;
}

bool IsIntelCpu() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::string(vendor) == "GenuineIntel";
}

struct ModeChoice {
  absl::StatusOr<Bf16MatmulMode> mode;
  std::string description;
};

ModeChoice ChooseMode() {
  const char* env = std::getenv(kBf16MatmulVariable);
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  ModeChoice choice;
  choice.mode = Bf16MatmulModeFor(env != nullptr ? env : "",
                                  isa == dnnl::cpu_isa::avx512_core_amx,
                                  isa == dnnl::cpu_isa::avx512_core_bf16 ||
                                      isa == dnnl::cpu_isa::avx512_core_amx,
                                  IsIntelCpu(), &choice.description);
  return choice;
}

const ModeChoice& ProcessMode() {
  static const ModeChoice* choice = new ModeChoice(ChooseMode());
  return *choice;
}

// Whether a matmul of `ab_dtype` operands runs widened (f16 always).
absl::StatusOr<bool> Widened(DType ab_dtype) {
  if (ab_dtype == DType::kF32) return false;
  if (ab_dtype == DType::kF16) return true;
  FSDPP_ASSIGN_OR_RETURN(const Bf16MatmulMode mode, OneDnnBf16MatmulMode());
  return mode == Bf16MatmulMode::kWidened;
}

// Runs r < outer * inner of `run` elements, each at element offset
// (r / inner) * outer_stride + (r % inner) * inner_stride on the strided
// side and r * packed_stride (run unless given) on the packed f32 side,
// cast from f32 to `dtype` (`narrow`) or back, split across the pool.
void CastRuns(bool narrow, DType dtype, const void* strided, float* packed,
              int64_t outer, int64_t outer_stride, int64_t inner,
              int64_t inner_stride, int64_t run, int64_t packed_stride = 0) {
  if (packed_stride == 0) packed_stride = run;
  const int64_t size = static_cast<int64_t>(DTypeSize(dtype));
  ParallelChunks(
      outer * inner, outer * inner * run, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          char* at =
              static_cast<char*>(const_cast<void*>(strided)) +
              ((r / inner) * outer_stride + (r % inner) * inner_stride) * size;
          if (narrow) {
            simd::Cast(DType::kF32, packed + r * packed_stride, dtype, at, run);
          } else {
            simd::Cast(dtype, at, DType::kF32, packed + r * packed_stride, run);
          }
        }
      });
}

// Widens the runs of src into the packed dst (runs dst_stride apart, run
// unless given).
void WidenRuns(DType dtype, const void* src, int64_t outer,
               int64_t outer_stride, int64_t inner, int64_t inner_stride,
               int64_t run, float* dst, int64_t dst_stride = 0) {
  CastRuns(false, dtype, src, dst, outer, outer_stride, inner, inner_stride,
           run, dst_stride);
}

// Whether rows of `cols` floats are a multiple of 4 KiB long: the rows
// oneDNN's f32 kernels run slowly over (OneDnnMatmulStagesB).
bool RowsOf4KiB(int64_t cols) { return cols % 1024 == 0; }

// The leading dimension a staged f32 block of `cols` columns is laid out
// at: cols, or 16 more when its rows would be a multiple of 4 KiB long.
int64_t StagedLd(int64_t cols) { return RowsOf4KiB(cols) ? cols + 16 : cols; }

float* WidenedBuffer(ThreadBuffer which, int64_t floats) {
  return reinterpret_cast<float*>(
      ThreadBufferOf(which, static_cast<size_t>(floats) * sizeof(float)));
}

// MatmulPart's rows [i0, i0 + rows) and inner dim [k0, k0 + len) with b
// staged in f32 blocks laid at StagedLd, and a 16-bit a widened to f32 (an
// f32 a is read in place): in blocks of rows and of c's columns whose staged
// a and b take at most WidenedBlockBytes() each, and the f32 block of a c
// that is not f32 (computed there and rounded into place) 4 times that
// (unless one row or column alone takes more).
absl::Status StagedPart(const void* a, const void* b, void* c, DType ab_dtype,
                        DType c_dtype, int64_t batch, int64_t m, int64_t n,
                        int64_t k, int64_t i0, int64_t rows, int64_t k0,
                        int64_t len, bool transpose_a, bool transpose_b,
                        bool broadcast_b, float alpha, float beta,
                        const void* bias) {
  using dims = dnnl::memory::dims;
  const int64_t budget =
      WidenedBlockBytes() / static_cast<int64_t>(sizeof(float));
  const int64_t b_batch = broadcast_b ? 1 : batch;
  const int64_t len1 = std::max<int64_t>(len, 1);
  const bool f32_c = c_dtype == DType::kF32;
  const bool stage_a = ab_dtype != DType::kF32;
  // Column blocks of about equal width (a multiple of 64 where that fits).
  const int64_t max_cols = std::clamp<int64_t>(budget / (b_batch * len1), 1, n);
  const int64_t col_blocks = (n + max_cols - 1) / max_cols;
  int64_t block_cols = (n + col_blocks - 1) / col_blocks;
  if (col_blocks > 1 && (block_cols + 63) / 64 * 64 <= max_cols) {
    block_cols = (block_cols + 63) / 64 * 64;
  }
  // The f32 block of a c that is not f32 stays within 4 times the budget
  // (a Linear's bf16 output of 1024 tokens x 3072 at once).
  const int64_t block_rows = std::clamp<int64_t>(
      std::min(stage_a ? budget / (batch * len1) : rows,
               f32_c ? rows : 4 * budget / (batch * block_cols)),
      1, rows);
  const int64_t ab_size = static_cast<int64_t>(DTypeSize(ab_dtype));
  const int64_t c_size = static_cast<int64_t>(DTypeSize(c_dtype));
  float* wb = nullptr;
  int64_t staged_j0 = -1;  // the column block wb holds
  for (int64_t r0 = i0; r0 < i0 + rows; r0 += block_rows) {
    const int64_t mb = std::min(block_rows, i0 + rows - r0);
    // op(a)'s rows [r0, r0 + mb) and columns [k0, k0 + len), kept in a's
    // orientation: [batch, mb, len], or [batch, len, mb] transposed; an f32
    // a in place, with its own strides.
    const int64_t a_offset = transpose_a ? k0 * m + r0 : r0 * k + k0;
    const char* a_at = static_cast<const char*>(a) + a_offset * ab_size;
    const float* wa = reinterpret_cast<const float*>(a_at);
    if (stage_a) {
      float* widened =
          WidenedBuffer(ThreadBuffer::kWidenedA, batch * mb * len1);
      if (transpose_a) {
        WidenRuns(ab_dtype, a_at, batch, m * k, len, m, mb, widened);
      } else {
        WidenRuns(ab_dtype, a_at, batch, m * k, mb, k, len, widened);
      }
      wa = widened;
    }
    for (int64_t j0 = 0; j0 < n; j0 += block_cols) {
      const int64_t nb = std::min(block_cols, n - j0);
      const int64_t ldb = transpose_b ? len1 : StagedLd(nb);
      const int64_t ldc = StagedLd(nb);
      // op(b)'s rows [k0, k0 + len) and columns [j0, j0 + nb):
      // [b_batch, len, nb], or [b_batch, nb, len] transposed; staged once
      // when one block holds all of c's columns.
      if (staged_j0 != j0) {
        const int64_t rows_b = transpose_b ? nb : len1;
        wb = WidenedBuffer(ThreadBuffer::kWidenedB, b_batch * rows_b * ldb);
        if (transpose_b) {
          WidenRuns(ab_dtype,
                    static_cast<const char*>(b) + (j0 * k + k0) * ab_size,
                    b_batch, k * n, nb, k, len, wb);
        } else {
          // One run per row of each batch: the padding sits between rows.
          WidenRuns(ab_dtype,
                    static_cast<const char*>(b) + (k0 * n + j0) * ab_size,
                    b_batch, k * n, len, n, nb, wb, ldb);
        }
        staged_j0 = j0;
      }
      char* c_at = static_cast<char*>(c) + (r0 * n + j0) * c_size;
      float* wc =
          f32_c ? reinterpret_cast<float*>(c_at)
                : WidenedBuffer(ThreadBuffer::kWidenedC, batch * mb * ldc);
      if (!f32_c && beta != 0.0f) {
        WidenRuns(c_dtype, c_at, batch, m * n, mb, n, nb, wc, ldc);
      }
      const void* wbias = nullptr;
      if (bias != nullptr) {
        const char* bias_at = static_cast<const char*>(bias) + j0 * c_size;
        if (f32_c) {
          wbias = bias_at;
        } else {
          float* widened = WidenedBuffer(ThreadBuffer::kWidenedBias, nb);
          simd::Cast(c_dtype, bias_at, DType::kF32, widened, nb);
          wbias = widened;
        }
      }
      const auto f32 = dnnl::memory::data_type::f32;
      // A staged a's strides, or an f32 a's own.
      const int64_t a_batch_stride = stage_a ? mb * len : m * k;
      const int64_t lda =
          stage_a ? (transpose_a ? mb : len) : (transpose_a ? m : k);
      Descs d;
      d.a = dnnl::memory::desc(dims{batch, mb, len}, f32,
                               transpose_a ? dims{a_batch_stride, 1, lda}
                                           : dims{a_batch_stride, lda, 1});
      d.b = dnnl::memory::desc(
          dims{b_batch, len, nb}, f32,
          transpose_b ? dims{len * nb, 1, len} : dims{len * ldb, ldb, 1});
      d.c = dnnl::memory::desc(
          dims{batch, mb, nb}, f32,
          f32_c ? dims{m * n, n, 1} : dims{mb * ldc, ldc, 1});
      d.bias = dnnl::memory::desc(dims{1, 1, nb}, f32, dims{nb, nb, 1});
      const Key key = {-2,  // not an OneDnnMatmul or strided key
                       batch,
                       mb,
                       nb,
                       len,
                       b_batch,
                       transpose_a,
                       transpose_b,
                       f32_c ? m * n : 0,
                       f32_c ? n : 0,
                       a_batch_stride,
                       lda};
      FSDPP_RETURN_IF_ERROR(
          RunCached(key, d, alpha, beta, wa, wb, wc, wbias, [&] {
            return absl::StrCat(stage_a ? "widened" : "staged", " block [",
                                batch, " x ", mb, " x ", len, "] @ [", len,
                                " x ", nb, "] of ", DTypeName(ab_dtype), " -> ",
                                DTypeName(c_dtype));
          }));
      if (!f32_c) {
        CastRuns(true, c_dtype, c_at, wc, batch, m * n, mb, n, nb, ldc);
      }
    }
  }
  return absl::OkStatus();
}

// Rows [i0, i0 + rows) of c and the inner dim's [k0, k0 + len) of c =
// alpha op(a) op(b) (+ beta c, + bias), read and written in place with the
// whole matrices' strides (all of them: the plain matmul).
absl::Status MatmulPart(const void* a, const void* b, void* c, DType ab_dtype,
                        DType c_dtype, int64_t batch, int64_t m, int64_t n,
                        int64_t k, int64_t i0, int64_t rows, int64_t k0,
                        int64_t len, bool transpose_a, bool transpose_b,
                        bool broadcast_b, float alpha, float beta,
                        const void* bias) {
  FSDPP_ASSIGN_OR_RETURN(const bool widened, Widened(ab_dtype));
  if (widened ||
      OneDnnMatmulStagesB(ab_dtype, transpose_b, batch * rows, n, len)) {
    return StagedPart(a, b, c, ab_dtype, c_dtype, batch, m, n, k, i0, rows, k0,
                      len, transpose_a, transpose_b, broadcast_b, alpha, beta,
                      bias);
  }
  using dims = dnnl::memory::dims;
  const dnnl::memory::data_type ab = DnnlType(ab_dtype);
  Descs d;
  d.a = dnnl::memory::desc(dims{batch, rows, len}, ab,
                           transpose_a ? dims{m * k, 1, m} : dims{m * k, k, 1});
  d.b = dnnl::memory::desc(dims{broadcast_b ? 1 : batch, len, n}, ab,
                           transpose_b ? dims{k * n, 1, k} : dims{k * n, n, 1});
  d.c = dnnl::memory::desc(dims{batch, rows, n}, DnnlType(c_dtype),
                           dims{m * n, n, 1});
  d.bias = dnnl::memory::desc(dims{1, 1, n}, DnnlType(c_dtype), dims{n, n, 1});
  const Key key = {static_cast<int64_t>(ab_dtype),
                   static_cast<int64_t>(c_dtype),
                   batch,
                   m,
                   n,
                   k,
                   rows,
                   len,
                   transpose_a,
                   transpose_b,
                   broadcast_b};
  const int64_t ab_size = static_cast<int64_t>(DTypeSize(ab_dtype));
  const char* a_part = static_cast<const char*>(a) +
                       (transpose_a ? k0 * m + i0 : i0 * k + k0) * ab_size;
  const char* b_part =
      static_cast<const char*>(b) + (transpose_b ? k0 : k0 * n) * ab_size;
  char* c_part =
      static_cast<char*>(c) + i0 * n * static_cast<int64_t>(DTypeSize(c_dtype));
  return RunCached(key, d, alpha, beta, a_part, b_part, c_part, bias, [&] {
    return absl::StrCat(rows == m && len == k
                            ? ""
                            : absl::StrCat("part [", rows, " x ", len, "] of "),
                        "[", batch, " x ", m, " x ", k, "] @ [", k, " x ", n,
                        "] ", DTypeName(ab_dtype), " -> ", DTypeName(c_dtype));
  });
}

// An operand of OneDnnStridedMatmul widened into `dst` ([batch, rows,
// cols] in the order of its unit stride: row-major when the columns are
// contiguous, column-major when the rows are, element by element
// otherwise); the returned operand describes dst.
StridedOperand WidenStrided(DType dtype, const StridedOperand& op, float* dst) {
  const int64_t batch = op.dims[0], rows = op.dims[1], cols = op.dims[2];
  StridedOperand out{dst, {batch, rows, cols}, {rows * cols, cols, 1}};
  if (op.strides[2] == 1 || rows == 1) {
    WidenRuns(dtype, op.data, batch, op.strides[0], rows, op.strides[1], cols,
              dst);
  } else if (op.strides[1] == 1 || cols == 1) {
    WidenRuns(dtype, op.data, batch, op.strides[0], cols, op.strides[2], rows,
              dst);
    out.strides[1] = 1;
    out.strides[2] = rows;
  } else {
    for (int64_t bt = 0; bt < batch; ++bt) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          simd::Cast(
              dtype,
              static_cast<const char*>(op.data) +
                  (bt * op.strides[0] + i * op.strides[1] + j * op.strides[2]) *
                      static_cast<int64_t>(DTypeSize(dtype)),
              DType::kF32, dst + (bt * rows + i) * cols + j, 1);
        }
      }
    }
  }
  return out;
}

// OneDnnStridedMatmul without its span.
absl::Status StridedMatmul(DType ab_dtype, DType c_dtype,
                           const StridedOperand& a, const StridedOperand& b,
                           void* c, const int64_t c_strides[3], float alpha,
                           float beta);

// OneDnnStridedMatmul with f16 a and b widened to f32 (no blocking), c computed
// in place when it is f32 and in an f32 copy rounded back otherwise.
absl::Status WidenedStridedMatmul(DType ab_dtype, DType c_dtype,
                                  const StridedOperand& a,
                                  const StridedOperand& b, void* c,
                                  const int64_t c_strides[3], float alpha,
                                  float beta) {
  const StridedOperand wa =
      WidenStrided(ab_dtype, a,
                   WidenedBuffer(ThreadBuffer::kWidenedA,
                                 a.dims[0] * a.dims[1] * a.dims[2]));
  const StridedOperand wb =
      WidenStrided(ab_dtype, b,
                   WidenedBuffer(ThreadBuffer::kWidenedB,
                                 b.dims[0] * b.dims[1] * b.dims[2]));
  if (c_dtype == DType::kF32) {
    return StridedMatmul(DType::kF32, DType::kF32, wa, wb, c, c_strides, alpha,
                         beta);
  }
  const int64_t batch = a.dims[0], m = a.dims[1], n = b.dims[2];
  const int64_t c_size = static_cast<int64_t>(DTypeSize(c_dtype));
  float* wc = WidenedBuffer(ThreadBuffer::kWidenedC, batch * m * n);
  char* base = static_cast<char*>(c);
  auto element = [&](int64_t bt, int64_t i, int64_t j) {
    return base +
           (bt * c_strides[0] + i * c_strides[1] + j * c_strides[2]) * c_size;
  };
  for (int64_t bt = 0; beta != 0.0f && bt < batch; ++bt) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        simd::Cast(c_dtype, element(bt, i, j), DType::kF32,
                   wc + (bt * m + i) * n + j, 1);
      }
    }
  }
  const int64_t wc_strides[3] = {m * n, n, 1};
  FSDPP_RETURN_IF_ERROR(StridedMatmul(DType::kF32, DType::kF32, wa, wb, wc,
                                      wc_strides, alpha, beta));
  for (int64_t bt = 0; bt < batch; ++bt) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        simd::Cast(DType::kF32, wc + (bt * m + i) * n + j, c_dtype,
                   element(bt, i, j), 1);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status StridedMatmul(DType ab_dtype, DType c_dtype,
                           const StridedOperand& a, const StridedOperand& b,
                           void* c, const int64_t c_strides[3], float alpha,
                           float beta) {
  using dims = dnnl::memory::dims;
  const int64_t m = a.dims[1], k = a.dims[2], n = b.dims[2];
  if (b.dims[1] != k || (b.dims[0] != a.dims[0] && b.dims[0] != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OneDnnStridedMatmul: [", a.dims[0], " x ", m, " x ", k, "] @ [",
        b.dims[0], " x ", b.dims[1], " x ", n, "] do not multiply"));
  }
  // bf16 stays native here whatever the mode: the blocked attention's
  // blocks are small (an inner dim of 64 to 128), and widening them cost
  // more than the f32 kernels saved (onednn_matmul.h).
  if (ab_dtype == DType::kF16) {
    return WidenedStridedMatmul(ab_dtype, c_dtype, a, b, c, c_strides, alpha,
                                beta);
  }
  Descs descs;
  descs.a = dnnl::memory::desc(dims(a.dims, a.dims + 3), DnnlType(ab_dtype),
                               dims(a.strides, a.strides + 3));
  descs.b = dnnl::memory::desc(dims(b.dims, b.dims + 3), DnnlType(ab_dtype),
                               dims(b.strides, b.strides + 3));
  descs.c = dnnl::memory::desc(dims{a.dims[0], m, n}, DnnlType(c_dtype),
                               dims(c_strides, c_strides + 3));
  Key key = {static_cast<int64_t>(ab_dtype), static_cast<int64_t>(c_dtype),
             -1};  // -1: not an OneDnnMatmul key
  key.insert(key.end(), a.dims, a.dims + 3);
  key.insert(key.end(), a.strides, a.strides + 3);
  key.insert(key.end(), b.dims, b.dims + 3);
  key.insert(key.end(), b.strides, b.strides + 3);
  key.insert(key.end(), c_strides, c_strides + 3);
  return RunCached(key, descs, alpha, beta, a.data, b.data, c, nullptr, [&] {
    return absl::StrCat("strided [", a.dims[0], " x ", m, " x ", k, "] @ [",
                        b.dims[0], " x ", k, " x ", n, "] ",
                        DTypeName(ab_dtype), " -> ", DTypeName(c_dtype));
  });
}

}  // namespace

absl::StatusOr<Bf16MatmulMode> Bf16MatmulModeFor(const std::string& setting,
                                                 bool amx, bool avx512_bf16,
                                                 bool intel,
                                                 std::string* description) {
  if (setting == "native" || setting == "widen") {
    *description =
        absl::StrCat(setting == "native" ? "bf16 matmul native"
                                         : "bf16 matmul widened to f32",
                     " (", kBf16MatmulVariable, "=", setting, ")");
    return setting == "native" ? Bf16MatmulMode::kNative
                               : Bf16MatmulMode::kWidened;
  }
  if (!setting.empty() && setting != "auto") {
    const absl::Status error = absl::InvalidArgumentError(
        absl::StrCat(kBf16MatmulVariable, "='", setting,
                     "': expected native, widen or auto (or unset)"));
    *description = std::string(error.message());
    return error;
  }
  if (amx) {
    *description = "bf16 matmul native (AMX)";
    return Bf16MatmulMode::kNative;
  }
  if (avx512_bf16 && !intel) {
    *description = "bf16 matmul native (AVX-512-BF16, not an Intel CPU)";
    return Bf16MatmulMode::kNative;
  }
  *description =
      avx512_bf16
          ? "bf16 matmul widened to f32 (an Intel CPU without AMX: its bf16 "
            "dot products run at half the rate of its f32 FMAs)"
          : "bf16 matmul widened to f32 (no AVX-512-BF16 or AMX)";
  return Bf16MatmulMode::kWidened;
}

absl::StatusOr<Bf16MatmulMode> OneDnnBf16MatmulMode() {
  const int forced = mode_for_testing.load();
  if (forced >= 0) return static_cast<Bf16MatmulMode>(forced);
  return ProcessMode().mode;
}

std::string OneDnnBf16MatmulModeDescription() {
  const int forced = mode_for_testing.load();
  if (forced >= 0) {
    return static_cast<Bf16MatmulMode>(forced) == Bf16MatmulMode::kNative
               ? "bf16 matmul native (forced by a test)"
               : "bf16 matmul widened to f32 (forced by a test)";
  }
  return ProcessMode().description;
}

void SetBf16MatmulModeForTesting(const Bf16MatmulMode* mode) {
  mode_for_testing.store(mode == nullptr ? -1 : static_cast<int>(*mode));
}

void SetWidenedBlockBytesForTesting(int64_t bytes) {
  widened_block_bytes_for_testing.store(bytes);
}

bool OneDnnMatmulStagesB(DType ab_dtype, bool transpose_b, int64_t rows,
                         int64_t n, int64_t k) {
  return ab_dtype == DType::kF32 && !transpose_b && RowsOf4KiB(n) &&
         rows >= 512 && k >= 256;
}

int64_t OneDnnMatmulKChunk(int64_t m, int64_t n, int64_t k) {
  if (k < 4 * kKChunk || k < 8 * std::max(m, n)) return 0;
  const int64_t chunks = (k + kKChunk - 1) / kKChunk;
  const int64_t len = (k + chunks - 1) / chunks;
  return len + len % 2;  // even: bf16 operands pair along k
}

int64_t OneDnnMatmulMChunk(DType ab_dtype, bool transpose_a, int64_t m,
                           int64_t n, int64_t k) {
  if (ab_dtype != DType::kBF16 || !transpose_a || m < 2 * kMChunk ||
      m < 8 * std::max(n, k)) {
    return 0;
  }
  const int64_t chunks = (m + kMChunk - 1) / kMChunk;
  return (m + chunks - 1) / chunks;
}

absl::Status OneDnnMatmul(const void* a, const void* b, void* c, DType ab_dtype,
                          DType c_dtype, int64_t batch, int64_t m, int64_t n,
                          int64_t k, bool transpose_a, bool transpose_b,
                          bool broadcast_b, float alpha, float beta,
                          const void* bias) {
  // A long inner dim over a small c: oneDNN reads b again for every block
  // of c's rows, from memory once b outgrows the caches (the LM head's dx:
  // 1.5x slower in f32). Chunks of k keep each chunk's b in cache; their
  // products add up in f32 (c, or a buffer rounded into c once at the end),
  // as oneDNN's own accumulation does.
  const int64_t chunk = OneDnnMatmulKChunk(m, n, k);
  const bool f32_c = c_dtype == DType::kF32;
  if (chunk > 0 && (f32_c || beta == 0.0f) && bias == nullptr) {
    float* acc = f32_c
                     ? static_cast<float*>(c)
                     : reinterpret_cast<float*>(ThreadBufferOf(
                           ThreadBuffer::kAccumulator,
                           static_cast<size_t>(batch * m * n) * sizeof(float)));
    for (int64_t k0 = 0; k0 < k; k0 += chunk) {
      FSDPP_RETURN_IF_ERROR(
          MatmulPart(a, b, acc, ab_dtype, DType::kF32, batch, m, n, k, 0, m, k0,
                     std::min(chunk, k - k0), transpose_a, transpose_b,
                     broadcast_b, alpha, k0 == 0 ? beta : 1.0f, nullptr));
    }
    if (!f32_c) simd::Cast(DType::kF32, acc, c_dtype, c, batch * m * n);
    return absl::OkStatus();
  }
  // Many rows of a transposed bf16 a (the LM head's weight gradient, [V,
  // tokens]^T): oneDNN copies all of op(a) into its own layout first;
  // chunks of c's rows keep that copy in cache (1.1x here). Each row of c is
  // computed as it would be at once.
  if (const int64_t rows = OneDnnMatmulMChunk(ab_dtype, transpose_a, m, n, k);
      rows > 0) {
    for (int64_t i0 = 0; i0 < m; i0 += rows) {
      FSDPP_RETURN_IF_ERROR(MatmulPart(a, b, c, ab_dtype, c_dtype, batch, m, n,
                                       k, i0, std::min(rows, m - i0), 0, k,
                                       transpose_a, transpose_b, broadcast_b,
                                       alpha, beta, bias));
    }
    return absl::OkStatus();
  }
  return MatmulPart(a, b, c, ab_dtype, c_dtype, batch, m, n, k, 0, m, 0, k,
                    transpose_a, transpose_b, broadcast_b, alpha, beta, bias);
}

absl::Status OneDnnStridedMatmul(DType ab_dtype, DType c_dtype,
                                 const StridedOperand& a,
                                 const StridedOperand& b, void* c,
                                 const int64_t c_strides[3], float alpha,
                                 float beta) {
  // Its own row of the op profile, category matmul, inside its caller's
  // span (the blocked attention's).
  OpSpan span("StridedMatmul", "matmul");
  return StridedMatmul(ab_dtype, c_dtype, a, b, c, c_strides, alpha, beta);
}

int64_t OneDnnMatmulCacheSize() {
  std::lock_guard<std::mutex> lock(CacheMutex());
  return static_cast<int64_t>(Cache().size());
}

}  // namespace cpu
}  // namespace fsdpp
