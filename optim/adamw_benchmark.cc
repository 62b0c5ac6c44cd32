// The optimizer's per-step hot path on a 1-rank mesh (thread rank over real
// Gloo): AdamW::Step over 4.2M f32 parameters (16 [512, 512] matrices with
// weight decay and 16 [512] biases without), and ClipGradNorm over their
// gradients (local sum of squares, one scalar all-reduce, scaling).
// items_per_second counts parameter elements; bytes_per_second the bytes
// the update touches (AdamW: reads param, grad, exp_avg, exp_avg_sq and
// writes param, exp_avg, exp_avg_sq = 28 bytes per element; clipping: reads
// and writes the gradient = 8 bytes per element).
//
//   bazel run -c opt //optim:adamw_benchmark
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "tensor/dtensor.h"
#include "tensor/placement.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

constexpr int kMatrices = 16;
constexpr int64_t kWidth = 512;

// A tensor of `shape` holding small deterministic values.
Tensor Values(const Shape& shape, uint64_t seed, float scale) {
  std::vector<float> v(NumElements(shape));
  uint64_t s = seed;
  for (float& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = scale * (static_cast<float>(s >> 40) / 16777216.0f - 0.5f);
  }
  return *Tensor::FromFloats(shape, v, DType::kF32);
}

// The parameters and gradients, Shard(0) over `mesh`.
struct Params {
  std::vector<DTensor> params;
  std::vector<DTensor> grads;
  int64_t elements = 0;
};

Params MakeParams(DeviceMesh& mesh) {
  Params p;
  for (int i = 0; i < 2 * kMatrices; ++i) {
    const Shape shape = i < kMatrices ? Shape{kWidth, kWidth} : Shape{kWidth};
    p.params.push_back(*DTensor::Distribute(Values(shape, 2 * i + 1, 0.1f),
                                            &mesh, {Placement::Shard(0)}));
    p.grads.push_back(*DTensor::Distribute(Values(shape, 2 * i + 2, 1e-3f),
                                           &mesh, {Placement::Shard(0)}));
    p.elements += NumElements(shape);
  }
  return p;
}

void BM_AdamWStep(benchmark::State& state) {
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    Params p = MakeParams(mesh);
    std::vector<AdamWParam> list;
    for (size_t i = 0; i < p.params.size(); ++i) {
      list.emplace_back(absl::StrCat("p", i), &p.params[i], &p.grads[i],
                        /*weight_decay=*/i < kMatrices);
    }
    AdamWOptions options;
    options.lr = 1e-4;
    AdamW opt = *AdamW::Create(std::move(list), options);
    CHECK_OK(opt.Step());  // Warm-up: allocates the state.
    for (auto _ : state) {
      CHECK_OK(opt.Step());
    }
    state.SetItemsProcessed(state.iterations() * p.elements);
    state.SetBytesProcessed(state.iterations() * p.elements * 28);
  });
}
BENCHMARK(BM_AdamWStep)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_ClipGradNorm(benchmark::State& state) {
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    Params p = MakeParams(mesh);
    std::vector<DTensor*> grads;
    for (DTensor& g : p.grads) grads.push_back(&g);
    // The gradients' norm starts at ~0.6: max_norm 0.5 makes the first call
    // scale them to it (later calls compute the same norm and coefficient).
    for (auto _ : state) {
      CHECK_OK(ClipGradNorm(grads, /*max_norm=*/0.5).status());
    }
    state.SetItemsProcessed(state.iterations() * p.elements);
    state.SetBytesProcessed(state.iterations() * p.elements * 8);
  });
}
BENCHMARK(BM_ClipGradNorm)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace fsdpp
