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
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/parallel.h"
#include "core/status.h"
#include "tensor/cpu/attention.h"
#include "tensor/cpu/onednn_matmul.h"
#include "tensor/cpu/simd.h"
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

template <typename T>
double ReduceLoop(const T* x, int64_t n, bool squares) {
  const int threads = n > kParallelElements ? omp_get_max_threads() : 1;
  std::vector<double> partial(threads, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    double acc = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const double v = ToFloat(x[i]);
      acc += squares ? v * v : v;
    }
    partial[t] = acc;
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
      if (src.raw_data() != dst->raw_data()) {
        std::memmove(dst->raw_data(), src.raw_data(), src.nbytes());
      }
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
    RETURN_IF_ERROR(dispatched);
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
    double total = 0.0;
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      total = ReduceLoop(static_cast<const T*>(x.raw_data()), x.numel(),
                         kind == ReduceKind::kSumOfSquares);
    });
    RETURN_IF_ERROR(dispatched);
    *out->data<float>() = static_cast<float>(total);
    return absl::OkStatus();
  }

  absl::Status SumRowsAccumulate(const Tensor& x, int64_t rows, int64_t cols,
                                 Tensor* out) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* px = static_cast<const T*>(x.raw_data());
      (void)DispatchFloat(out->dtype(), [&](auto tag_O) {
        using O = typename decltype(tag_O)::type;
        O* po = static_cast<O*>(out->raw_data());
#pragma omp parallel for schedule(static) if (rows * cols > kParallelElements)
        for (int64_t j = 0; j < cols; ++j) {
          float acc = 0.0f;
          for (int64_t r = 0; r < rows; ++r) acc += ToFloat(px[r * cols + j]);
          po[j] = FromFloat<O>(ToFloat(po[j]) + acc);
        }
      });
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status Matmul(const MatmulArgs& m) override {
    if (m.a->dtype() == DType::kF16) return MatmulViaF32(m);
    return OneDnnMatmul(m.a->raw_data(), m.b->raw_data(), m.c->raw_data(),
                        m.a->dtype(), m.c->dtype(), m.batch, m.m, m.n, m.k,
                        m.transpose_a, m.transpose_b, m.broadcast_b, m.alpha,
                        m.beta);
  }

  // f16 operands: oneDNN 2.6 has no f16 matmul on CPUs. f16 -> f32 is exact,
  // so computing in f32 and rounding c once gives the f16 result of an f32
  // accumulation, like cuBLASLt's f16 matmul with 32F compute.
  absl::Status MatmulViaF32(const MatmulArgs& m) {
    ASSIGN_OR_RETURN(Tensor a,
                     Tensor::Empty(m.a->shape(), DType::kF32, Device::Cpu()));
    RETURN_IF_ERROR(Copy(*m.a, &a));
    ASSIGN_OR_RETURN(Tensor b,
                     Tensor::Empty(m.b->shape(), DType::kF32, Device::Cpu()));
    RETURN_IF_ERROR(Copy(*m.b, &b));
    Tensor c = *m.c;
    if (m.c->dtype() != DType::kF32) {
      ASSIGN_OR_RETURN(c,
                       Tensor::Empty(m.c->shape(), DType::kF32, Device::Cpu()));
      if (m.beta != 0.0f) RETURN_IF_ERROR(Copy(*m.c, &c));
    }
    RETURN_IF_ERROR(OneDnnMatmul(a.raw_data(), b.raw_data(), c.raw_data(),
                                 DType::kF32, DType::kF32, m.batch, m.m, m.n,
                                 m.k, m.transpose_a, m.transpose_b,
                                 m.broadcast_b, m.alpha, m.beta));
    if (m.c->dtype() != DType::kF32) return Copy(c, m.c);
    return absl::OkStatus();
  }

  absl::Status Softmax(const Tensor& x, int64_t rows, int64_t n, int64_t tq,
                       int64_t causal_offset, Tensor* y) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* px = static_cast<const T*>(x.raw_data());
      T* py = static_cast<T*>(y->raw_data());
#pragma omp parallel for schedule(static) if (rows * n > kParallelElements)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t valid =
            causal_offset < 0 ? n : std::min(n, r % tq + causal_offset + 1);
        kernels::SoftmaxRowForward(px + r * n, n, valid, py + r * n);
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, int64_t rows,
                               int64_t n, Tensor* dx) override {
    const absl::Status dispatched = DispatchFloat(y.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* py = static_cast<const T*>(y.raw_data());
      const T* pdy = static_cast<const T*>(dy.raw_data());
      T* pdx = static_cast<T*>(dx->raw_data());
#pragma omp parallel for schedule(static) if (rows * n > kParallelElements)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::SoftmaxRowBackward(py + r * n, pdy + r * n, n, pdx + r * n);
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status CausalAttention(const Tensor& q, const Tensor& k,
                               const Tensor& v, int64_t b, int64_t h,
                               int64_t kv, int64_t t, int64_t hd, float scale,
                               Tensor* out, Tensor* lse) override {
    cpu::CausalAttentionForward(q.dtype(), q.raw_data(), k.raw_data(),
                                v.raw_data(), b, h, kv, t, hd, scale,
                                out->raw_data(), lse->data<float>());
    return absl::OkStatus();
  }

  absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out,
                                       const Tensor& lse, const Tensor& dout,
                                       int64_t b, int64_t h, int64_t kv,
                                       int64_t t, int64_t hd, float scale,
                                       Tensor* dq, Tensor* dk,
                                       Tensor* dv) override {
    cpu::CausalAttentionBackward(
        q.dtype(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
        lse.data<float>(), dout.raw_data(), b, h, kv, t, hd, scale,
        dq->raw_data(), dk->raw_data(), dv->raw_data());
    return absl::OkStatus();
  }

  absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                         const Tensor* bias, float eps, int64_t rows, int64_t c,
                         Tensor* out, Tensor* mean, Tensor* rstd) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* px = static_cast<const T*>(x.raw_data());
      const T* pw = static_cast<const T*>(weight.raw_data());
      const T* pb = bias ? static_cast<const T*>(bias->raw_data()) : nullptr;
      T* po = static_cast<T*>(out->raw_data());
      float* pm = mean->data<float>();
      float* pr = rstd->data<float>();
#pragma omp parallel for schedule(static) if (rows * c > kParallelElements)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::LayerNormRowForward(px + r * c, pw, pb, c, eps, po + r * c,
                                     pm + r, pr + r);
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd, int64_t rows, int64_t c,
                                 Tensor* dx, Tensor* dweight,
                                 Tensor* dbias) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pdy = static_cast<const T*>(dy.raw_data());
      const T* px = static_cast<const T*>(x.raw_data());
      const T* pw = static_cast<const T*>(weight.raw_data());
      const float* pm = mean.data<float>();
      const float* pr = rstd.data<float>();
      T* pdx = static_cast<T*>(dx->raw_data());
      T* pdw = static_cast<T*>(dweight->raw_data());
      T* pdb = dbias ? static_cast<T*>(dbias->raw_data()) : nullptr;
#pragma omp parallel
      {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r) {
          kernels::LayerNormRowBackward(pdy + r * c, px + r * c, pw, pm[r],
                                        pr[r], c, pdx + r * c);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < c; ++j) {
          kernels::LayerNormColumnBackward(pdy, px, pm, pr, rows, c, j, pdw,
                                           pdb);
        }
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                       int64_t rows, int64_t c, Tensor* out,
                       Tensor* rstd) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* px = static_cast<const T*>(x.raw_data());
      const T* pw = static_cast<const T*>(weight.raw_data());
      T* po = static_cast<T*>(out->raw_data());
      float* pr = rstd->data<float>();
#pragma omp parallel for schedule(static) if (rows * c > kParallelElements)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::RmsNormRowForward(px + r * c, pw, c, eps, po + r * c, pr + r);
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                               const Tensor& weight, const Tensor& rstd,
                               int64_t rows, int64_t c, Tensor* dx,
                               Tensor* dweight) override {
    const absl::Status dispatched = DispatchFloat(x.dtype(), [&](auto tag_T) {
      using T = typename decltype(tag_T)::type;
      const T* pdy = static_cast<const T*>(dy.raw_data());
      const T* px = static_cast<const T*>(x.raw_data());
      const T* pw = static_cast<const T*>(weight.raw_data());
      const float* pr = rstd.data<float>();
      T* pdx = static_cast<T*>(dx->raw_data());
      T* pdw = static_cast<T*>(dweight->raw_data());
#pragma omp parallel
      {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r) {
          kernels::RmsNormRowBackward(pdy + r * c, px + r * c, pw, pr[r], c,
                                      pdx + r * c);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < c; ++j) {
          kernels::RmsNormColumnBackward(pdy, px, pr, rows, c, j, pdw);
        }
      }
    });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status Embedding(const Tensor& ids, const Tensor& table, int64_t n,
                         int64_t v, int64_t c, Tensor* out) override {
    RETURN_IF_ERROR(CheckIds(ids, n, v, false, 0, "Embedding"));
    const size_t row_bytes = c * DTypeSize(table.dtype());
    const char* pt = static_cast<const char*>(table.raw_data());
    char* po = static_cast<char*>(out->raw_data());
#pragma omp parallel for schedule(static) if (n * c > kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(po + i * row_bytes,
                  pt + IdAt(ids.raw_data(), ids.dtype(), i) * row_bytes,
                  row_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                                 int64_t n, int64_t v, int64_t c,
                                 Tensor* dtable) override {
    RETURN_IF_ERROR(CheckIds(ids, n, v, false, 0, "EmbeddingBackward"));
    const absl::Status dispatched =
        DispatchFloat(dout.dtype(), [&](auto tag_T) {
          using T = typename decltype(tag_T)::type;
          const T* pd = static_cast<const T*>(dout.raw_data());
          T* pt = static_cast<T*>(dtable->raw_data());
      // Columns are independent: split them across threads, walk rows in
      // order, so repeated ids add up without races, deterministically.
#pragma omp parallel for schedule(static) if (n * c > kParallelElements)
          for (int64_t j = 0; j < c; ++j) {
            for (int64_t i = 0; i < n; ++i) {
              const int64_t id = IdAt(ids.raw_data(), ids.dtype(), i);
              pt[id * c + j] = FromFloat<T>(ToFloat(pt[id * c + j]) +
                                            ToFloat(pd[i * c + j]));
            }
          }
        });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                            int64_t n, int64_t v, int64_t ignore_index,
                            Tensor* losses) override {
    RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropy"));
    const absl::Status dispatched =
        DispatchFloat(logits.dtype(), [&](auto tag_T) {
          using T = typename decltype(tag_T)::type;
          const T* pl = static_cast<const T*>(logits.raw_data());
          float* po = losses->data<float>();
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
          for (int64_t i = 0; i < n; ++i) {
            po[i] = kernels::CrossEntropyRowForward(
                pl + i * v, v, IdAt(targets.raw_data(), targets.dtype(), i),
                ignore_index);
          }
        });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

  absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                    const Tensor& dlosses, int64_t n, int64_t v,
                                    int64_t ignore_index,
                                    Tensor* dlogits) override {
    RETURN_IF_ERROR(
        CheckIds(targets, n, v, true, ignore_index, "CrossEntropyBackward"));
    const absl::Status dispatched =
        DispatchFloat(logits.dtype(), [&](auto tag_T) {
          using T = typename decltype(tag_T)::type;
          const T* pl = static_cast<const T*>(logits.raw_data());
          const float* pdl = dlosses.data<float>();
          T* pd = static_cast<T*>(dlogits->raw_data());
#pragma omp parallel for schedule(static) if (n * v > kParallelElements)
          for (int64_t i = 0; i < n; ++i) {
            kernels::CrossEntropyRowBackward(
                pl + i * v, v, IdAt(targets.raw_data(), targets.dtype(), i),
                ignore_index, pdl[i], pd + i * v);
          }
        });
    RETURN_IF_ERROR(dispatched);
    return absl::OkStatus();
  }

 private:
  // Returns InvalidArgument naming the first id outside [0, v).
  static absl::Status CheckIds(const Tensor& ids, int64_t n, int64_t v,
                               bool allow_ignore, int64_t ignore_index,
                               const char* op) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = IdAt(ids.raw_data(), ids.dtype(), i);
      if (allow_ignore && id == ignore_index) continue;
      if (id < 0 || id >= v) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": id ", id, " at position ", i, " is outside [0, ", v, ")"));
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

Backend* CpuBackend() {
  static Backend* backend = new CpuBackendImpl;
  return backend;
}

}  // namespace cpu
}  // namespace fsdpp
