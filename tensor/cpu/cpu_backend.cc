// CPU kernels; see cpu_backend.h.
//
// Loops are OpenMP-parallel above a size threshold and use the same libgomp
// pool as oneDNN (one pool, no oversubscription). Reductions accumulate in
// double per thread and combine in a fixed order, so results do not depend on
// scheduling within a run of the same thread count.
#include "tensor/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/parallel.h"
#include "core/status.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/cpu/rowwise.h"
#include "tensor/cpu/simd.h"
#include "tensor/kernels/attention.h"
#include "tensor/kernels/rowwise.h"

namespace fsdpp {
namespace cpu {
namespace {

// Element `i` of a raw array of `dtype`.
inline void* At(void* p, DType dtype, int64_t i) {
  return static_cast<char*>(p) + i * static_cast<int64_t>(DTypeSize(dtype));
}
inline const void* At(const void* p, DType dtype, int64_t i) {
  return static_cast<const char*>(p) +
         i * static_cast<int64_t>(DTypeSize(dtype));
}

// A key range's bound (ops.h KeyRange), or null.
inline const int32_t* Bound(const Tensor* bound) {
  return bound != nullptr ? bound->data<int32_t>() : nullptr;
}

// Sum (or sum of squares) in double: each thread sums a contiguous part with
// the vectorised kernel, and the parts are added in thread order, so the
// result depends only on the data and the thread count.
double ReduceLoop(DType dtype, const void* x, int64_t n, bool squares) {
  const int threads = n > kParallelElements ? omp_get_max_threads() : 1;
  std::vector<double> partial(threads, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    partial[t] =
        rowwise::SumF64(dtype, At(x, dtype, begin), end - begin, squares);
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

class CpuBackendImpl final : public Backend {
 public:
  absl::Status Copy(const Tensor& src, Tensor* dst) override {
    const int64_t n = src.numel();
    if (src.dtype() == dst->dtype()) {
      const char* s = static_cast<const char*>(src.raw_data());
      char* d = static_cast<char*>(dst->raw_data());
      const size_t bytes = src.nbytes();
      if (s == d) return absl::OkStatus();
      if (s < d + bytes && d < s + bytes) {  // overlapping: one pass
        std::memmove(d, s, bytes);
        return absl::OkStatus();
      }
      // Large copies on every thread (one core's copy does not fill the
      // memory bandwidth).
      const int64_t esize = static_cast<int64_t>(DTypeSize(src.dtype()));
      ParallelChunks(n, [&](int64_t begin, int64_t end) {
        std::memcpy(d + begin * esize, s + begin * esize,
                    (end - begin) * esize);
      });
      return absl::OkStatus();
    }
    if (simd::IsFloat(src.dtype()) && simd::IsFloat(dst->dtype())) {
      const void* s = src.raw_data();
      void* d = dst->raw_data();
      ParallelChunks(n, [&](int64_t begin, int64_t end) {
        simd::Cast(src.dtype(), At(s, src.dtype(), begin), dst->dtype(),
                   At(d, dst->dtype(), begin), end - begin);
      });
      return absl::OkStatus();
    }
    // Only float dtypes convert (tensor/ops.cc checks first): the error
    // names the one that is not.
    return DispatchFloat(
        simd::IsFloat(src.dtype()) ? dst->dtype() : src.dtype(), [](auto) {});
  }

  absl::Status Fill(Tensor* t, float value) override {
    const int64_t n = t->numel();
    const absl::Status dispatched = DispatchFloat(t->dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      T* p = static_cast<T*>(t->raw_data());
      const T v = FromFloat<T>(value);
#pragma omp parallel for schedule(static) if (n > kParallelElements)
      for (int64_t i = 0; i < n; ++i) p[i] = v;
    });
    FSDPP_RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status Unary(UnaryKind kind, float alpha, const Tensor& x,
                     Tensor* out) override {
    const int64_t n = x.numel();
    if (simd::IsFloat(x.dtype())) {  // Every float dtype.
      const DType dt = x.dtype();
      ParallelChunks(n, [&](int64_t begin, int64_t end) {
        const void* px = At(x.raw_data(), dt, begin);
        void* po = At(out->raw_data(), dt, begin);
        switch (kind) {
          case UnaryKind::kScale:
            simd::Scale(dt, alpha, px, po, end - begin);
            break;
          case UnaryKind::kGelu:
            simd::Gelu(dt, px, po, end - begin);
            break;
          case UnaryKind::kSilu:
            simd::Silu(dt, px, po, end - begin);
            break;
        }
      });
      return absl::OkStatus();
    }
    return DispatchFloat(x.dtype(), [](auto) {});  // The error.
  }

  absl::Status Binary(BinaryKind kind, float alpha, const Tensor& a,
                      const Tensor& b, Tensor* out) override {
    const int64_t n = a.numel();
    if (simd::IsFloat(a.dtype())) {  // Every float dtype.
      const DType dt = a.dtype();
      ParallelChunks(n, [&](int64_t begin, int64_t end) {
        const void* pa = At(a.raw_data(), dt, begin);
        const void* pb = At(b.raw_data(), dt, begin);
        void* po = At(out->raw_data(), dt, begin);
        const int64_t count = end - begin;
        switch (kind) {
          case BinaryKind::kAdd:
            simd::Add(dt, pa, pb, po, count);
            break;
          case BinaryKind::kMul:
            simd::Mul(dt, pa, pb, po, count);
            break;
          case BinaryKind::kAxpy:
            simd::Axpy(dt, alpha, pa, pb, po, count);
            break;
          case BinaryKind::kGeluBackward:
            simd::GeluBackward(dt, pa, pb, po, count);
            break;
          case BinaryKind::kSiluBackward:
            simd::SiluBackward(dt, pa, pb, po, count);
            break;
        }
      });
      return absl::OkStatus();
    }
    return DispatchFloat(a.dtype(), [](auto) {});  // The error.
  }

  absl::Status Reduce(ReduceKind kind, const Tensor& x, Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    *out->data<float>() = static_cast<float>(ReduceLoop(
        x.dtype(), x.raw_data(), x.numel(), kind == ReduceKind::kSumOfSquares));
    return absl::OkStatus();
  }

  absl::Status SumRowsAccumulate(const Tensor& x, int64_t rows, int64_t cols,
                                 Tensor* out) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    FSDPP_RETURN_IF_ERROR(CheckFloat(out->dtype()));
    rowwise::SumRowsAccumulate(x.dtype(), x.raw_data(), rows, cols,
                               out->dtype(), out->raw_data());
    return absl::OkStatus();
  }

  // bf16 and f16 operands may be widened to f32 in blocks
  // (onednn_matmul.h): f16 always, bf16 where this CPU's bf16 dot products
  // are slower than its f32 FMAs.
  absl::Status Matmul(const MatmulArgs& m) override {
    return OneDnnMatmul(m.a->raw_data(), m.b->raw_data(), m.c->raw_data(),
                        m.a->dtype(), m.c->dtype(), m.batch, m.m, m.n, m.k,
                        m.transpose_a, m.transpose_b, m.broadcast_b, m.alpha,
                        m.beta,
                        m.bias != nullptr ? m.bias->raw_data() : nullptr);
  }

  absl::Status Softmax(const Tensor& x, int64_t rows, int64_t n, int64_t tq,
                       int64_t causal_offset, Tensor* y) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    rowwise::SoftmaxForward(x.dtype(), x.raw_data(), rows, n, tq, causal_offset,
                            y->raw_data());
    return absl::OkStatus();
  }

  absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, int64_t rows,
                               int64_t n, Tensor* dx) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(y.dtype()));
    rowwise::SoftmaxBackward(y.dtype(), y.raw_data(), dy.raw_data(), rows, n,
                             dx->raw_data());
    return absl::OkStatus();
  }

  absl::Status CausalAttention(const Tensor& q, const Tensor& k,
                               const Tensor& v, int64_t b, int64_t h,
                               int64_t kv, int64_t t, int64_t hd, float scale,
                               const KeyRange& keys, Tensor* out,
                               Tensor* lse) override {
    const int32_t* lo = Bound(keys.lo);
    const int32_t* hi = Bound(keys.hi);
    if (q.dtype() == DType::kBF16 || q.dtype() == DType::kF32) {
      return cpu::BlockedAttentionForward(
          q.dtype(), q.raw_data(), k.raw_data(), v.raw_data(), b, h, kv, t, hd,
          scale, out->raw_data(), lse->data<float>(), lo, hi);
    }
    cpu::CausalAttentionForward(q.dtype(), q.raw_data(), k.raw_data(),
                                v.raw_data(), b, h, kv, t, hd, scale,
                                out->raw_data(), lse->data<float>(), lo, hi);
    return absl::OkStatus();
  }

  absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& dout,
                                       int64_t b, int64_t h, int64_t kv,
                                       int64_t t, int64_t hd, float scale,
                                       const KeyRange& keys, Tensor* dq,
                                       Tensor* dk, Tensor* dv) override {
    const int32_t* lo = Bound(keys.lo);
    const int32_t* hi = Bound(keys.hi);
    if (q.dtype() == DType::kBF16 || q.dtype() == DType::kF32) {
      return cpu::BlockedAttentionBackward(
          q.dtype(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
          lse.data<float>(), dout.raw_data(), b, h, kv, t, hd, scale,
          dq->raw_data(), dk->raw_data(), dv->raw_data(), lo, hi);
    }
    cpu::CausalAttentionBackward(
        q.dtype(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
        lse.data<float>(), dout.raw_data(), b, h, kv, t, hd, scale,
        dq->raw_data(), dk->raw_data(), dv->raw_data(), lo, hi);
    return absl::OkStatus();
  }

  absl::Status MergeAttention(const Tensor& out_part, const Tensor& lse_part,
                              int64_t rows, int64_t hd, Tensor* out,
                              Tensor* lse) override {
    float* l = lse->data<float>();
    const float* lp = lse_part.data<float>();
    return DispatchFloat(out->dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = static_cast<T*>(out->raw_data());
      const T* op = static_cast<const T*>(out_part.raw_data());
#pragma omp parallel for schedule(static) if (rows * hd > kParallelElements)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::MergeAttentionRow(op + r * hd, lp[r], hd, o + r * hd, l + r);
      }
    });
  }

  absl::Status DocumentMask(const Tensor& ids, int64_t b, int64_t t,
                            int64_t eot_id, Tensor* key_start,
                            Tensor* positions) override {
    int32_t* starts = key_start->data<int32_t>();
    int32_t* pos = positions->data<int32_t>();
    const auto fill = [&](const auto* id) {
      for (int64_t r = 0; r < b; ++r) {
        kernels::DocumentMaskRow(id + r * t, t, eot_id, starts + r * t,
                                 pos + r * t);
      }
    };
    if (ids.dtype() == DType::kI32) {
      fill(ids.data<int32_t>());
    } else {
      fill(ids.data<int64_t>());
    }
    return absl::OkStatus();
  }

  absl::Status CopyColumns(const Tensor& src, int64_t src_first, Tensor* dst,
                           int64_t dst_first, int64_t rows,
                           int64_t count) override {
    const int64_t esize = static_cast<int64_t>(DTypeSize(src.dtype()));
    const char* s = static_cast<const char*>(src.raw_data());
    char* d = static_cast<char*>(dst->raw_data());
    const int64_t src_row = src.dim(1) * esize, dst_row = dst->dim(1) * esize;
    for (int64_t r = 0; r < rows; ++r) {
      std::memmove(d + r * dst_row + dst_first * esize,
                   s + r * src_row + src_first * esize, count * esize);
    }
    return absl::OkStatus();
  }

  absl::Status CopyHeads(const Tensor& src, Tensor* dst, int64_t b, int64_t t,
                         int64_t heads, int64_t first, int64_t n, int64_t hd,
                         bool merge) override {
    const int64_t esize = static_cast<int64_t>(DTypeSize(src.dtype()));
    const int64_t row = hd * esize;
    const char* s = static_cast<const char*>(src.raw_data());
    char* d = static_cast<char*>(dst->raw_data());
    // One row of hd per (batch, head, position): its offsets in the wide
    // [b, t, heads, hd] and the narrow [b, n, t, hd] tensor.
#pragma omp parallel for schedule(static) \
    collapse(2) if (b * n * t * hd > kParallelElements)
    for (int64_t bh = 0; bh < b * n; ++bh) {
      for (int64_t i = 0; i < t; ++i) {
        const int64_t bi = bh / n, h = bh % n;
        const int64_t wide = ((bi * t + i) * heads + first + h) * row;
        const int64_t narrow = (bh * t + i) * row;
        if (merge) {
          std::memcpy(d + wide, s + narrow, row);
        } else {
          std::memcpy(d + narrow, s + wide, row);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Rope(Tensor* x, int64_t rows, int64_t seq_len, int64_t head_dim,
                    const float* inv_freq, bool inverse,
                    const Tensor* positions) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x->dtype()));
    rowwise::Rope(x->dtype(), x->raw_data(), rows, seq_len, head_dim, inv_freq,
                  inverse,
                  positions != nullptr ? positions->data<int32_t>() : nullptr,
                  positions != nullptr ? positions->dim(0) : 1);
    return absl::OkStatus();
  }

  absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                         const Tensor* bias, float eps, int64_t rows, int64_t c,
                         Tensor* out, Tensor* mean, Tensor* rstd) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    rowwise::LayerNormForward(x.dtype(), x.raw_data(), weight.raw_data(),
                              bias != nullptr ? bias->raw_data() : nullptr, eps,
                              rows, c, out->raw_data(), mean->data<float>(),
                              rstd->data<float>());
    return absl::OkStatus();
  }

  absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd, int64_t rows, int64_t c,
                                 Tensor* dx, Tensor* dweight,
                                 Tensor* dbias) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    rowwise::LayerNormBackward(
        x.dtype(), dy.raw_data(), x.raw_data(), weight.raw_data(),
        mean.data<float>(), rstd.data<float>(), rows, c, dx->raw_data(),
        dweight->raw_data(), dbias != nullptr ? dbias->raw_data() : nullptr);
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                       int64_t rows, int64_t c, Tensor* out,
                       Tensor* rstd) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    rowwise::RmsNormForward(x.dtype(), x.raw_data(), weight.raw_data(), eps,
                            rows, c, out->raw_data(), rstd->data<float>());
    return absl::OkStatus();
  }

  absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                               const Tensor& weight, const Tensor& rstd,
                               int64_t rows, int64_t c, Tensor* dx,
                               Tensor* dweight) override {
    FSDPP_RETURN_IF_ERROR(CheckFloat(x.dtype()));
    rowwise::RmsNormBackward(x.dtype(), dy.raw_data(), x.raw_data(),
                             weight.raw_data(), rstd.data<float>(), rows, c,
                             dx->raw_data(), dweight->raw_data());
    return absl::OkStatus();
  }

  absl::Status Embedding(const Tensor& ids, const Tensor& table, int64_t n,
                         int64_t v, int64_t c, int64_t row_offset,
                         int64_t vocab, Tensor* out) override {
    FSDPP_ASSIGN_OR_RETURN(const std::vector<int64_t> rows,
                           CheckedIds(ids, n, vocab, false, 0, "Embedding"));
    const size_t row_bytes = c * DTypeSize(table.dtype());
    const char* pt = static_cast<const char*>(table.raw_data());
    char* po = static_cast<char*>(out->raw_data());
#pragma omp parallel for schedule(static) if (n * c > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = rows[i] - row_offset;
      if (row >= 0 && row < v) {
        std::memcpy(po + i * row_bytes, pt + row * row_bytes, row_bytes);
      } else {
        std::memset(po + i * row_bytes, 0, row_bytes);
      }
    }
    return absl::OkStatus();
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                                 int64_t n, int64_t v, int64_t c,
                                 int64_t row_offset, int64_t vocab,
                                 Tensor* dtable) override {
    FSDPP_ASSIGN_OR_RETURN(
        const std::vector<int64_t> rows,
        CheckedIds(ids, n, vocab, false, 0, "EmbeddingBackward"));
    FSDPP_RETURN_IF_ERROR(CheckFloat(dout.dtype()));
    const DType dt = dout.dtype();
    // Columns are independent: each thread takes a range of them and walks
    // the rows in order, adding each into its table row with the vector Add,
    // so repeated ids add up without races, in the scalar loop's order.
    ParallelChunks(c, n * c, [&](int64_t begin, int64_t end) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rows[i] - row_offset;
        if (r < 0 || r >= v) continue;  // Another rank's row.
        void* row = At(dtable->raw_data(), dt, r * c + begin);
        simd::Add(dt, row, At(dout.raw_data(), dt, i * c + begin), row,
                  end - begin);
      }
    });
    return absl::OkStatus();
  }

  absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                            int64_t n, int64_t v, int64_t ignore_index,
                            Tensor* losses, Tensor* lse) override {
    FSDPP_ASSIGN_OR_RETURN(
        const std::vector<int64_t> ids,
        CheckedIds(targets, n, v, true, ignore_index, "CrossEntropy"));
    FSDPP_RETURN_IF_ERROR(CheckFloat(logits.dtype()));
    rowwise::CrossEntropyForward(logits.dtype(), logits.raw_data(), ids.data(),
                                 n, v, ignore_index, losses->data<float>(),
                                 lse == nullptr ? nullptr : lse->data<float>());
    return absl::OkStatus();
  }

  absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                    const Tensor& dlosses, int64_t n, int64_t v,
                                    int64_t ignore_index, const Tensor* lse,
                                    Tensor* dlogits) override {
    FSDPP_ASSIGN_OR_RETURN(
        const std::vector<int64_t> ids,
        CheckedIds(targets, n, v, true, ignore_index, "CrossEntropyBackward"));
    FSDPP_RETURN_IF_ERROR(CheckFloat(logits.dtype()));
    rowwise::CrossEntropyBackward(logits.dtype(), logits.raw_data(), ids.data(),
                                  dlosses.data<float>(),
                                  lse == nullptr ? nullptr : lse->data<float>(),
                                  n, v, ignore_index, dlogits->raw_data());
    return absl::OkStatus();
  }

  absl::Status CrossEntropyShardStats(const Tensor& logits,
                                      const Tensor& targets, int64_t n,
                                      int64_t v, int64_t vocab_offset,
                                      int64_t vocab_size, int64_t ignore_index,
                                      Tensor* max, Tensor* sumexp,
                                      Tensor* target_logit) override {
    FSDPP_ASSIGN_OR_RETURN(const std::vector<int64_t> ids,
                           CheckedIds(targets, n, vocab_size, true,
                                      ignore_index, "CrossEntropyShardStats"));
    FSDPP_RETURN_IF_ERROR(CheckFloat(logits.dtype()));
    const ShardTargets st(ids, v, vocab_offset, ignore_index);
    rowwise::CrossEntropyShardStats(logits.dtype(), logits.raw_data(),
                                    st.local.data(), st.ignored.get(), n, v,
                                    max->data<float>(), sumexp->data<float>(),
                                    target_logit->data<float>());
    return absl::OkStatus();
  }

  absl::Status CrossEntropyShardBackward(
      const Tensor& logits, const Tensor& targets, const Tensor& max,
      const Tensor& sumexp, const Tensor& dlosses, int64_t n, int64_t v,
      int64_t vocab_offset, int64_t vocab_size, int64_t ignore_index,
      Tensor* dlogits) override {
    FSDPP_ASSIGN_OR_RETURN(
        const std::vector<int64_t> ids,
        CheckedIds(targets, n, vocab_size, true, ignore_index,
                   "CrossEntropyShardBackward"));
    FSDPP_RETURN_IF_ERROR(CheckFloat(logits.dtype()));
    const ShardTargets st(ids, v, vocab_offset, ignore_index);
    rowwise::CrossEntropyShardBackward(
        logits.dtype(), logits.raw_data(), st.local.data(), st.ignored.get(),
        max.data<float>(), sumexp.data<float>(), dlosses.data<float>(), n, v,
        dlogits->raw_data());
    return absl::OkStatus();
  }

 private:
  // The error DispatchFloat gives for a dtype these kernels do not take.
  static absl::Status CheckFloat(DType dtype) {
    return DispatchFloat(dtype, [](auto) {});
  }

  // Loss parallel's per-row targets within a vocabulary slice.
  struct ShardTargets {
    ShardTargets(const std::vector<int64_t>& targets, int64_t v, int64_t offset,
                 int64_t ignore_index)
        : local(targets.size()), ignored(new bool[targets.size()]) {
      for (size_t i = 0; i < targets.size(); ++i) {
        local[i] = kernels::LocalTarget(targets[i], ignore_index, offset, v);
        ignored[i] = targets[i] == ignore_index;
      }
    }
    std::vector<int64_t> local;
    std::unique_ptr<bool[]> ignored;
  };

  // The first n ids (i32 or i64) as int64, read once; InvalidArgument
  // naming the first id outside [0, v) (ignore_index allowed if asked).
  static absl::StatusOr<std::vector<int64_t>> CheckedIds(const Tensor& ids,
                                                         int64_t n, int64_t v,
                                                         bool allow_ignore,
                                                         int64_t ignore_index,
                                                         const char* op) {
    std::vector<int64_t> out(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = IdAt(ids.raw_data(), ids.dtype(), i);
      if (!(allow_ignore && id == ignore_index) && (id < 0 || id >= v)) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": id ", id, " at position ", i, " is outside [0, ", v, ")"));
      }
      out[i] = id;
    }
    return out;
  }
};

}  // namespace

Backend* CpuBackend() {
  static Backend* backend = new CpuBackendImpl;
  return backend;
}

}  // namespace cpu
}  // namespace fsdpp
