// The attention core, fused (CausalAttention, flash style) against the
// unfused path the nn layer can also take (Matmul + causal Softmax + Matmul,
// saving the [B, H, T, T] probabilities), forward and forward + backward, at
// GPT-2 124M's head shape (H = 12, hd = 64) with B * T = 1024 tokens; and
// the fused op with document masks (packed documents of `doc` tokens each)
// against the same op unmasked at T = 1024.
//
//   bazel run -c opt //tensor:attention_benchmark
#include <cmath>

#include "benchmark/benchmark.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

constexpr int64_t kHeads = 12, kHeadDim = 64, kTokens = 1024;

struct Shapes {
  int64_t b, t;
  DType dtype;
};

Shapes Args(const benchmark::State& state) {
  const int64_t t = state.range(0);
  return {kTokens / t, t, state.range(1) ? DType::kBF16 : DType::kF32};
}

Tensor Empty(const Shape& shape, DType dtype) {
  return *Tensor::Empty(shape, dtype, Device::Cpu());
}

struct Heads {
  Tensor q, k, v, dout;
};

Heads MakeHeads(const Shapes& s) {
  const Shape shape{s.b, kHeads, s.t, kHeadDim};
  return {testing_util::RandomTensor(shape, s.dtype, 1),
          testing_util::RandomTensor(shape, s.dtype, 2),
          testing_util::RandomTensor(shape, s.dtype, 3),
          testing_util::RandomTensor(shape, s.dtype, 4)};
}

const float kScale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

// Document key starts [b, t] for packed documents of `doc` tokens.
Tensor DocumentStarts(int64_t b, int64_t t, int64_t doc) {
  Tensor starts = Empty({b, t}, DType::kI32);
  int32_t* p = starts.data<int32_t>();
  for (int64_t i = 0; i < b * t; ++i) {
    p[i] = static_cast<int32_t>((i % t) / doc * doc);
  }
  return starts;
}

void Fused(benchmark::State& state, bool backward, int64_t doc = 0) {
  const Shapes s = Args(state);
  const Heads x = MakeHeads(s);
  const Tensor starts = DocumentStarts(s.b, s.t, doc > 0 ? doc : s.t);
  const KeyRange keys = doc > 0 ? KeyRange{&starts} : KeyRange{};
  Tensor out = Empty(x.q.shape(), s.dtype);
  Tensor lse = Empty({s.b, kHeads, s.t}, DType::kF32);
  Tensor dq = Empty(x.q.shape(), s.dtype), dk = Empty(x.q.shape(), s.dtype),
         dv = Empty(x.q.shape(), s.dtype);
  auto step = [&] {
    CHECK_OK(CausalAttention(x.q, x.k, x.v, kScale, &out, &lse, keys));
    if (backward) {
      CHECK_OK(CausalAttentionBackward(x.q, x.k, x.v, out, lse, x.dout, kScale,
                                       &dq, &dk, &dv, keys));
    }
  };
  step();  // Warm-up, untimed (as for the unfused path's oneDNN set-up).
  for (auto _ : state) step();
}

// What nn::CausalSelfAttention does with fused_attention = false.
void Unfused(benchmark::State& state, bool backward) {
  const Shapes s = Args(state);
  const Heads x = MakeHeads(s);
  const Shape square{s.b, kHeads, s.t, s.t};
  Tensor scores = Empty(square, DType::kF32), p32 = Empty(square, DType::kF32);
  Tensor p = Empty(square, s.dtype), dp = Empty(square, DType::kF32),
         ds32 = Empty(square, DType::kF32), ds = Empty(square, s.dtype);
  Tensor out = Empty(x.q.shape(), s.dtype);
  Tensor dq = Empty(x.q.shape(), s.dtype), dk = Empty(x.q.shape(), s.dtype),
         dv = Empty(x.q.shape(), s.dtype);
  MatmulOptions abt, atb, scaled, atb_scaled;
  abt.transpose_b = true;
  atb.transpose_a = true;
  scaled.alpha = kScale;
  atb_scaled.transpose_a = true;
  atb_scaled.alpha = kScale;
  MatmulOptions qkt = abt;
  qkt.alpha = kScale;
  auto step = [&] {
    CHECK_OK(Matmul(x.q, x.k, &scores, qkt));
    CHECK_OK(Softmax(scores, &p32, /*causal=*/true));
    CHECK_OK(Copy(p32, &p));
    CHECK_OK(Matmul(p, x.v, &out));
    if (backward) {
      CHECK_OK(Matmul(x.dout, x.v, &dp, abt));
      CHECK_OK(Matmul(p, x.dout, &dv, atb));
      CHECK_OK(Copy(p, &p32));
      CHECK_OK(SoftmaxBackward(p32, dp, &ds32));
      CHECK_OK(Copy(ds32, &ds));
      CHECK_OK(Matmul(ds, x.k, &dq, scaled));
      CHECK_OK(Matmul(ds, x.q, &dk, atb_scaled));
    }
  };
  step();  // Warm-up, untimed: oneDNN creates its primitives on first use.
  for (auto _ : state) step();
}

void BM_FusedForward(benchmark::State& state) { Fused(state, false); }
void BM_FusedForwardBackward(benchmark::State& state) { Fused(state, true); }
void BM_UnfusedForward(benchmark::State& state) { Unfused(state, false); }
void BM_UnfusedForwardBackward(benchmark::State& state) {
  Unfused(state, true);
}

// T = 256 (B = 4) and T = 1024 (B = 1); f32 (bf16:0) and bf16 (bf16:1).
#define FSDPP_ATTENTION_BENCHMARK(fn)      \
  BENCHMARK(fn)                            \
      ->ArgsProduct({{256, 1024}, {0, 1}}) \
      ->ArgNames({"T", "bf16"})            \
      ->Unit(benchmark::kMillisecond)      \
      ->UseRealTime()

FSDPP_ATTENTION_BENCHMARK(BM_FusedForward);
FSDPP_ATTENTION_BENCHMARK(BM_UnfusedForward);
FSDPP_ATTENTION_BENCHMARK(BM_FusedForwardBackward);
FSDPP_ATTENTION_BENCHMARK(BM_UnfusedForwardBackward);

// Forward + backward at T = 1024 with document masks of doc = 1024 (one
// document: the masks' own cost) and 256 tokens (four documents), f32 and
// bf16; BM_FusedForwardBackward/T:1024 is the unmasked op.
void BM_FusedDocumentsForwardBackward(benchmark::State& state) {
  Fused(state, true, state.range(2));
}
BENCHMARK(BM_FusedDocumentsForwardBackward)
    ->ArgsProduct({{1024}, {0, 1}, {1024, 256}})
    ->ArgNames({"T", "bf16", "doc"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace fsdpp
