// oneDNN matmul with a primitive cache; see onednn_matmul.h.
#include "tensor/cpu/onednn_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/base/casts.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
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
};

char* ThreadBufferOf(ThreadBuffer which, size_t bytes) {
  struct Buffer {
    ~Buffer() { std::free(data); }
    char* data = nullptr;
    size_t size = 0;
  };
  thread_local Buffer buffers[2];
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
absl::StatusOr<Cached> GetOrBuild(const Key& key, const Descs& descs,
                                  bool with_bias, float alpha, float beta,
                                  const std::string& what) {
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
        absl::StrCat("oneDNN matmul ", what, ": ", e.what()));
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

// Rows [i0, i0 + rows) of c and the inner dim's [k0, k0 + len) of c =
// alpha op(a) op(b) (+ beta c, + bias), read and written in place with the
// whole matrices' strides (all of them: the plain matmul).
absl::Status MatmulPart(const void* a, const void* b, void* c, DType ab_dtype,
                        DType c_dtype, int64_t batch, int64_t m, int64_t n,
                        int64_t k, int64_t i0, int64_t rows, int64_t k0,
                        int64_t len, bool transpose_a, bool transpose_b,
                        bool broadcast_b, float alpha, float beta,
                        const void* bias) {
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
                   broadcast_b,
                   absl::bit_cast<int32_t>(alpha),
                   absl::bit_cast<int32_t>(beta),
                   bias != nullptr};
  FSDPP_ASSIGN_OR_RETURN(
      const Cached cached,
      GetOrBuild(
          key, d, bias != nullptr, alpha, beta,
          absl::StrCat(rows == m && len == k
                           ? ""
                           : absl::StrCat("part [", rows, " x ", len, "] of "),
                       "[", batch, " x ", m, " x ", k, "] @ [", k, " x ", n,
                       "] ", DTypeName(ab_dtype), " -> ", DTypeName(c_dtype))));
  const int64_t ab_size = static_cast<int64_t>(DTypeSize(ab_dtype));
  const char* a_part = static_cast<const char*>(a) +
                       (transpose_a ? k0 * m + i0 : i0 * k + k0) * ab_size;
  const char* b_part =
      static_cast<const char*>(b) + (transpose_b ? k0 : k0 * n) * ab_size;
  char* c_part =
      static_cast<char*>(c) + i0 * n * static_cast<int64_t>(DTypeSize(c_dtype));
  return Execute(cached, d, a_part, b_part, c_part, bias);
}

}  // namespace

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
  using dims = dnnl::memory::dims;
  const int64_t m = a.dims[1], k = a.dims[2], n = b.dims[2];
  if (b.dims[1] != k || (b.dims[0] != a.dims[0] && b.dims[0] != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OneDnnStridedMatmul: [", a.dims[0], " x ", m, " x ", k, "] @ [",
        b.dims[0], " x ", b.dims[1], " x ", n, "] do not multiply"));
  }
  Descs descs;
  descs.a = dnnl::memory::desc(dims(a.dims, a.dims + 3), DnnlType(ab_dtype),
                               dims(a.strides, a.strides + 3));
  descs.b = dnnl::memory::desc(dims(b.dims, b.dims + 3), DnnlType(ab_dtype),
                               dims(b.strides, b.strides + 3));
  descs.c = dnnl::memory::desc(dims{a.dims[0], m, n}, DnnlType(c_dtype),
                               dims(c_strides, c_strides + 3));
  Key key = {static_cast<int64_t>(ab_dtype), static_cast<int64_t>(c_dtype),
             absl::bit_cast<int32_t>(alpha), absl::bit_cast<int32_t>(beta),
             -1};  // -1: not an OneDnnMatmul key
  key.insert(key.end(), a.dims, a.dims + 3);
  key.insert(key.end(), a.strides, a.strides + 3);
  key.insert(key.end(), b.dims, b.dims + 3);
  key.insert(key.end(), b.strides, b.strides + 3);
  key.insert(key.end(), c_strides, c_strides + 3);
  FSDPP_ASSIGN_OR_RETURN(
      const Cached cached,
      GetOrBuild(
          key, descs, /*with_bias=*/false, alpha, beta,
          absl::StrCat("strided [", a.dims[0], " x ", m, " x ", k, "] @ [",
                       b.dims[0], " x ", k, " x ", n, "] ", DTypeName(ab_dtype),
                       " -> ", DTypeName(c_dtype))));
  return Execute(cached, descs, a.data, b.data, c, nullptr);
}

int64_t OneDnnMatmulCacheSize() {
  std::lock_guard<std::mutex> lock(CacheMutex());
  return static_cast<int64_t>(Cache().size());
}

}  // namespace cpu
}  // namespace fsdpp
