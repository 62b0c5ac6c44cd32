// The row-wise ops at GPT-2 124M's shapes (1024 tokens, C = 768, V = 50257)
// through tensor/ops.h (the vectorised kernels of tensor/cpu/rowwise), next
// to the scalar reference of tensor/kernels/rowwise.h run in the same OpenMP
// loop the CPU backend used before them ("Scalar" benchmarks), f32 and bf16.
//
//   bazel run -c opt //tensor:rowwise_benchmark
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "tensor/dtype_benchmark.h"
#include "tensor/kernels/rowwise.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

constexpr int64_t kTokens = 1024, kChannels = 768, kVocab = 50257;

Tensor Random(std::vector<int64_t> shape, DType dtype, float lo, float hi,
              uint32_t seed) {
  Tensor f = *Tensor::Empty(shape, DType::kF32, Device::Cpu());
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) p[i] = u(rng);
  Tensor t = *Tensor::Empty(shape, dtype, Device::Cpu());
  CHECK_OK(Copy(f, &t));
  return t;
}

Tensor Targets() {
  Tensor t = *Tensor::Empty({kTokens}, DType::kI64, Device::Cpu());
  std::mt19937 rng(7);
  for (int64_t i = 0; i < kTokens; ++i) t.data<int64_t>()[i] = rng() % kVocab;
  return t;
}

// Calls fn(T()) with the storage type of dtype (f32 or bf16).
template <class Fn>
void WithType(DType dtype, Fn&& fn) {
  if (dtype == DType::kF32) {
    fn(float());
  } else {
    fn(BFloat16());
  }
}

// Bytes of one [kTokens, kChannels] tensor.
int64_t ActBytes(DType dtype) {
  return kTokens * kChannels * static_cast<int64_t>(DTypeSize(dtype));
}

struct NormInputs {
  explicit NormInputs(DType dtype)
      : x(Random({kTokens, kChannels}, dtype, -2, 2, 1)),
        w(Random({kChannels}, dtype, 0.5f, 1.5f, 2)),
        b(Random({kChannels}, dtype, -1, 1, 3)),
        dy(Random({kTokens, kChannels}, dtype, -1, 1, 4)),
        out(*Tensor::Empty({kTokens, kChannels}, dtype, Device::Cpu())),
        dx(*Tensor::Empty({kTokens, kChannels}, dtype, Device::Cpu())),
        dw(*Tensor::Zeros({kChannels}, dtype, Device::Cpu())),
        db(*Tensor::Zeros({kChannels}, dtype, Device::Cpu())),
        mean(*Tensor::Empty({kTokens}, DType::kF32, Device::Cpu())),
        rstd(*Tensor::Empty({kTokens}, DType::kF32, Device::Cpu())) {}
  Tensor x, w, b, dy, out, dx, dw, db, mean, rstd;
};

// LayerNorm forward + backward (the pair a training step runs).
void BM_LayerNorm(benchmark::State& state) {
  NormInputs in(DTypeArg(state));
  for (auto _ : state) {
    CHECK_OK(LayerNorm(in.x, in.w, &in.b, 1e-5f, &in.out, &in.mean, &in.rstd));
    CHECK_OK(LayerNormBackward(in.dy, in.x, in.w, in.mean, in.rstd, &in.dx,
                               &in.dw, &in.db));
  }
  state.SetBytesProcessed(state.iterations() * 5 * ActBytes(in.x.dtype()));
}
FSDPP_BENCHMARK_F32_BF16(BM_LayerNorm);

void BM_LayerNormScalar(benchmark::State& state) {
  NormInputs in(DTypeArg(state));
  const int64_t rows = kTokens, c = kChannels;
  for (auto _ : state) {
    WithType(in.x.dtype(), [&](auto t) {
      using T = decltype(t);
      const T* x = in.x.data<T>();
      const T* w = in.w.data<T>();
      const T* b = in.b.data<T>();
      const T* dy = in.dy.data<T>();
      float* mean = in.mean.data<float>();
      float* rstd = in.rstd.data<float>();
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::LayerNormRowForward(x + r * c, w, b, c, 1e-5f,
                                     in.out.data<T>() + r * c, mean + r,
                                     rstd + r);
      }
#pragma omp parallel
      {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r) {
          kernels::LayerNormRowBackward(dy + r * c, x + r * c, w, mean[r],
                                        rstd[r], c, in.dx.data<T>() + r * c);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < c; ++j) {
          kernels::LayerNormColumnBackward(dy, x, mean, rstd, rows, c, j,
                                           in.dw.data<T>(), in.db.data<T>());
        }
      }
    });
  }
  state.SetBytesProcessed(state.iterations() * 5 * ActBytes(in.x.dtype()));
}
FSDPP_BENCHMARK_F32_BF16(BM_LayerNormScalar);

void BM_RmsNorm(benchmark::State& state) {
  NormInputs in(DTypeArg(state));
  for (auto _ : state) {
    CHECK_OK(RmsNorm(in.x, in.w, 1e-5f, &in.out, &in.rstd));
    CHECK_OK(RmsNormBackward(in.dy, in.x, in.w, in.rstd, &in.dx, &in.dw));
  }
  state.SetBytesProcessed(state.iterations() * 5 * ActBytes(in.x.dtype()));
}
FSDPP_BENCHMARK_F32_BF16(BM_RmsNorm);

void BM_RmsNormScalar(benchmark::State& state) {
  NormInputs in(DTypeArg(state));
  const int64_t rows = kTokens, c = kChannels;
  for (auto _ : state) {
    WithType(in.x.dtype(), [&](auto t) {
      using T = decltype(t);
      const T* x = in.x.data<T>();
      const T* w = in.w.data<T>();
      const T* dy = in.dy.data<T>();
      float* rstd = in.rstd.data<float>();
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        kernels::RmsNormRowForward(x + r * c, w, c, 1e-5f,
                                   in.out.data<T>() + r * c, rstd + r);
      }
#pragma omp parallel
      {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; ++r) {
          kernels::RmsNormRowBackward(dy + r * c, x + r * c, w, rstd[r], c,
                                      in.dx.data<T>() + r * c);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < c; ++j) {
          kernels::RmsNormColumnBackward(dy, x, rstd, rows, c, j,
                                         in.dw.data<T>());
        }
      }
    });
  }
  state.SetBytesProcessed(state.iterations() * 5 * ActBytes(in.x.dtype()));
}
FSDPP_BENCHMARK_F32_BF16(BM_RmsNormScalar);

struct LossInputs {
  explicit LossInputs(DType dtype)
      : logits(Random({kTokens, kVocab}, dtype, -8, 8, 5)),
        targets(Targets()),
        losses(*Tensor::Empty({kTokens}, DType::kF32, Device::Cpu())),
        dlosses(*Tensor::Empty({kTokens}, DType::kF32, Device::Cpu())),
        dlogits(*Tensor::Empty({kTokens, kVocab}, dtype, Device::Cpu())),
        lse(*Tensor::Empty({kTokens}, DType::kF32, Device::Cpu())) {
    CHECK_OK(Fill(&dlosses, 1.0f / kTokens));
  }
  int64_t bytes() const { return 3 * logits.nbytes(); }
  Tensor logits, targets, losses, dlosses, dlogits, lse;
};

// Cross-entropy over the vocabulary, forward + backward (with the rows'
// log-sum-exp passed on, as nn::CrossEntropyLoss does).
void BM_CrossEntropy(benchmark::State& state) {
  LossInputs in(DTypeArg(state));
  for (auto _ : state) {
    CHECK_OK(CrossEntropy(in.logits, in.targets, -100, &in.losses, &in.lse));
    CHECK_OK(CrossEntropyBackward(in.logits, in.targets, -100, in.dlosses,
                                  &in.dlogits, &in.lse));
  }
  state.SetBytesProcessed(state.iterations() * in.bytes());
}
FSDPP_BENCHMARK_F32_BF16(BM_CrossEntropy);

void BM_CrossEntropyScalar(benchmark::State& state) {
  LossInputs in(DTypeArg(state));
  const int64_t* targets = in.targets.data<int64_t>();
  for (auto _ : state) {
    WithType(in.logits.dtype(), [&](auto t) {
      using T = decltype(t);
      const T* logits = in.logits.data<T>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < kTokens; ++i) {
        in.losses.data<float>()[i] = kernels::CrossEntropyRowForward(
            logits + i * kVocab, kVocab, targets[i], -100);
      }
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < kTokens; ++i) {
        kernels::CrossEntropyRowBackward(
            logits + i * kVocab, kVocab, targets[i], -100,
            in.dlosses.data<float>()[i], in.dlogits.data<T>() + i * kVocab);
      }
    });
  }
  state.SetBytesProcessed(state.iterations() * in.bytes());
}
FSDPP_BENCHMARK_F32_BF16(BM_CrossEntropyScalar);

// Bias gradient of the MLP's first linear: [1024, 3072] summed over rows.
void BM_SumRowsAccumulate(benchmark::State& state) {
  const DType dtype = DTypeArg(state);
  Tensor x = Random({kTokens, 4 * kChannels}, dtype, -1, 1, 6);
  Tensor out = *Tensor::Zeros({4 * kChannels}, DType::kF32, Device::Cpu());
  for (auto _ : state) CHECK_OK(SumRowsAccumulate(x, &out));
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
FSDPP_BENCHMARK_F32_BF16(BM_SumRowsAccumulate);

}  // namespace
}  // namespace fsdpp
