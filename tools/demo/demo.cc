// A small end-to-end exercise of core/ and tensor/ until the trainer exists:
// a character-level next-byte model (embedding -> LayerNorm -> Linear -> GELU
// -> Linear -> cross-entropy) trained with plain SGD, every forward and
// backward step done with fsdpp ops on the CPU. Prints the loss falling below
// the unigram baseline, the tagged memory table and the matmul throughput.
//
//   bazel run //tools/demo
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/logging.h"
#include "core/rng.h"
#include "core/status.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

constexpr char kText[] =
    "the quick brown fox jumps over the lazy dog. a sharded model keeps one "
    "slice of every weight on each device and gathers the rest when it needs "
    "them. the gradients are reduced and scattered so that each device again "
    "owns one slice. the optimizer then steps on its slice alone. this is how "
    "large models fit on small devices, and how many devices train one model "
    "together. ";

constexpr int64_t kVocab = 128;
constexpr int64_t kContext = 1;  // Bigram: predict byte t+1 from byte t.
constexpr int64_t kEmbed = 64;
constexpr int64_t kHidden = 256;
constexpr int64_t kSteps = 300;
constexpr float kLr = 0.5f;

struct Param {
  Tensor value, grad;
};

absl::StatusOr<Param> MakeParam(Shape shape, uint64_t stream, float std) {
  Param p;
  ASSIGN_OR_RETURN(p.value, Tensor::Empty(shape, DType::kF32, Device::Cpu(),
                                          MemoryTag::kParams));
  ASSIGN_OR_RETURN(p.grad, Tensor::Zeros(shape, DType::kF32, Device::Cpu(),
                                         MemoryTag::kGrads));
  FillNormal(/*seed=*/1234, stream, 0, p.value.numel(), 0.0f, std,
             p.value.data<float>());
  return p;
}

absl::Status Run() {
  const std::string text(kText);
  const int64_t n = static_cast<int64_t>(text.size()) - kContext;
  std::vector<int64_t> inputs(n), targets(n);
  std::vector<double> counts(kVocab, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    inputs[i] = static_cast<unsigned char>(text[i]);
    targets[i] = static_cast<unsigned char>(text[i + kContext]);
    counts[targets[i]] += 1;
  }
  double unigram = 0;  // Entropy of the target bytes: the no-context baseline.
  for (double c : counts) {
    if (c > 0) unigram -= c / n * std::log(c / n);
  }

  ASSIGN_OR_RETURN(Param embed, MakeParam({kVocab, kEmbed}, 0, 1.0f));
  ASSIGN_OR_RETURN(Param ln_w, MakeParam({kEmbed}, 1, 0.0f));
  ASSIGN_OR_RETURN(Param w1, MakeParam({kHidden, kEmbed}, 2, 0.1f));
  ASSIGN_OR_RETURN(Param w2, MakeParam({kVocab, kHidden}, 3, 0.05f));
  RETURN_IF_ERROR(Fill(&ln_w.value, 1.0f));
  std::vector<Param*> params = {&embed, &ln_w, &w1, &w2};

  auto act = [&](Shape shape) {
    return Tensor::Empty(std::move(shape), DType::kF32, Device::Cpu(),
                         MemoryTag::kActivations);
  };
  ASSIGN_OR_RETURN(Tensor ids, Tensor::FromInts({n}, inputs));
  ASSIGN_OR_RETURN(Tensor tgt, Tensor::FromInts({n}, targets));
  ASSIGN_OR_RETURN(Tensor x, act({n, kEmbed}));
  ASSIGN_OR_RETURN(Tensor xn, act({n, kEmbed}));
  ASSIGN_OR_RETURN(Tensor mean, act({n}));
  ASSIGN_OR_RETURN(Tensor rstd, act({n}));
  ASSIGN_OR_RETURN(Tensor h, act({n, kHidden}));
  ASSIGN_OR_RETURN(Tensor g, act({n, kHidden}));
  ASSIGN_OR_RETURN(Tensor logits, act({n, kVocab}));
  ASSIGN_OR_RETURN(Tensor losses, act({n}));
  ASSIGN_OR_RETURN(Tensor dlosses, act({n}));
  ASSIGN_OR_RETURN(Tensor dlogits, act({n, kVocab}));
  ASSIGN_OR_RETURN(Tensor dg, act({n, kHidden}));
  ASSIGN_OR_RETURN(Tensor dh, act({n, kHidden}));
  ASSIGN_OR_RETURN(Tensor dxn, act({n, kEmbed}));
  ASSIGN_OR_RETURN(Tensor dx, act({n, kEmbed}));
  ASSIGN_OR_RETURN(Tensor loss_sum, act({1}));
  RETURN_IF_ERROR(Fill(&dlosses, 1.0f / n));

  std::printf("demo: %lld training bytes, unigram baseline %.3f nats\n",
              static_cast<long long>(n), unigram);
  const auto start = std::chrono::steady_clock::now();
  double flops = 0;
  float loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    // Forward.
    RETURN_IF_ERROR(Embedding(ids, embed.value, &x));
    RETURN_IF_ERROR(
        LayerNorm(x, ln_w.value, nullptr, 1e-5f, &xn, &mean, &rstd));
    RETURN_IF_ERROR(Matmul(xn, w1.value, &h, {false, true}));
    RETURN_IF_ERROR(Gelu(h, &g));
    RETURN_IF_ERROR(Matmul(g, w2.value, &logits, {false, true}));
    RETURN_IF_ERROR(CrossEntropy(logits, tgt, -1, &losses));
    RETURN_IF_ERROR(Sum(losses, &loss_sum));
    ASSIGN_OR_RETURN(float total, Item(loss_sum));
    loss = total / n;
    // Backward (parameter gradients accumulate; zeroed after each step).
    RETURN_IF_ERROR(CrossEntropyBackward(logits, tgt, -1, dlosses, &dlogits));
    RETURN_IF_ERROR(Matmul(dlogits, g, &w2.grad, {true, false, 1.0f, 1.0f}));
    RETURN_IF_ERROR(Matmul(dlogits, w2.value, &dg));
    RETURN_IF_ERROR(GeluBackward(h, dg, &dh));
    RETURN_IF_ERROR(Matmul(dh, xn, &w1.grad, {true, false, 1.0f, 1.0f}));
    RETURN_IF_ERROR(Matmul(dh, w1.value, &dxn));
    RETURN_IF_ERROR(LayerNormBackward(dxn, x, ln_w.value, mean, rstd, &dx,
                                      &ln_w.grad, nullptr));
    RETURN_IF_ERROR(EmbeddingBackward(ids, dx, &embed.grad));
    // SGD.
    for (Param* p : params) {
      RETURN_IF_ERROR(Axpy(-kLr, p->grad, &p->value));
      RETURN_IF_ERROR(Zero(&p->grad));
    }
    flops += 6.0 * n * (kEmbed * kHidden + kHidden * kVocab);
    if (step % 50 == 0 || step == kSteps - 1) {
      std::printf("step %4d/%lld  loss %.4f\n", step,
                  static_cast<long long>(kSteps), loss);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf(
      "demo: final loss %.4f vs unigram %.4f (%s); %.2f s, %.2f GFLOP/s\n",
      loss, unigram, loss < unigram ? "learned" : "NOT learned", seconds,
      flops / seconds / 1e9);
  std::printf("\nmemory on cpu (bytes by tag, from the allocator):\n%s",
              GetAllocator(Device::Cpu())->Stats().ToString().c_str());
  if (!(loss < unigram)) {
    return absl::InternalError(
        "the demo model did not beat the unigram baseline");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace fsdpp

int main() {
  absl::Status status = fsdpp::Run();
  if (!status.ok()) {
    LOG(ERROR) << status;
    return 1;
  }
  return 0;
}
