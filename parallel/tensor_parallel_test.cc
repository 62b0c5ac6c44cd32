// Tensor-parallel styles against the same modules on one rank: a pre-norm
// MLP block (LayerNorm, then fc column-wise and proj row-wise) with and
// without sequence parallelism, and a vocabulary-parallel embedding with a
// tied column-wise head, on tp = 2 and 4 thread ranks over real Gloo. The
// outputs, input gradients and every parameter gradient (this rank's piece)
// match the single-rank run after two forward/backward passes (gradients
// accumulate, each micro-batch's reduced once); bad plans are rejected with
// nothing applied.
#include "parallel/tensor_parallel.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "nn/embedding.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/sequential.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

using testing_util::RandomTensor;
using testing_util::RunOnMesh;
using testing_util::Values;
using Style = ParallelStyle;

constexpr int64_t kB = 2, kT = 8, kC = 8, kHidden = 16;

// norm -> mlp(fc, proj) with nonzero biases and norm weights.
std::unique_ptr<nn::Sequential> NormMlp() {
  auto seq = std::make_unique<nn::Sequential>();
  auto* norm = seq->Append(std::make_unique<nn::LayerNorm>(kC));
  auto* mlp = seq->Append(std::make_unique<nn::Mlp>(kC, kHidden, 0.3f, 0.3f));
  for (auto& [name, p] : norm->NamedParameters()) {
    p->init = InitSpec::Uniform(0.5f, 1.5f);
  }
  mlp->fc()->bias()->init = InitSpec::Uniform(-0.5f, 0.5f);
  mlp->proj()->bias()->init = InitSpec::Uniform(-0.5f, 0.5f);
  return seq;
}

// NormMlp with LoRA adapters (r 2) on fc and proj, B initialised nonzero
// so that A's gradient is too.
std::unique_ptr<nn::Sequential> NormMlpWithLora() {
  auto seq = NormMlp();
  auto* mlp = static_cast<nn::Mlp*>(seq->children()[1].second.get());
  for (nn::Linear* linear : {mlp->fc(), mlp->proj()}) {
    CHECK_OK(linear->EnableLora(2, 3.0f));
    linear->lora_b()->weight()->init = InitSpec::Uniform(-0.5f, 0.5f);
  }
  return seq;
}

// Values of the box of `whole` that `p`'s piece holds (all of it if none).
std::vector<double> PieceOf(const Tensor& whole, const Parameter& p) {
  if (!p.has_piece()) return Values(whole);
  Tensor w = *whole.Reshape(p.piece.layout);
  Tensor box = *Tensor::Empty(p.piece.size, whole.dtype(), Device::Cpu());
  CHECK_OK(CopyBox(w, p.piece.offset, &box, Shape(p.piece.size.size(), 0),
                   p.piece.size));
  return Values(box);
}

// Rows [begin, begin + n) of dim 1 of a [B, T, C] tensor.
Tensor SequenceSlice(const Tensor& x, int64_t begin, int64_t n) {
  Tensor out = *Tensor::Empty({x.dim(0), n, x.dim(2)}, x.dtype(), x.device());
  CHECK_OK(CopyBox(x, {0, begin, 0}, &out, {0, 0, 0}, {x.dim(0), n, x.dim(2)}));
  return out;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want,
                double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i])))
        << what << " [" << i << "]";
  }
}

struct Reference {
  std::vector<double> y, dx;
  std::map<std::string, Tensor> grads;
};

// Two forward/backward passes of the whole block on one rank.
Reference RunReference(const Tensor& x, const Tensor& dy, bool lora) {
  auto model = lora ? NormMlpWithLora() : NormMlp();
  CHECK_OK(model->ToEmpty(Device::Cpu()));
  CHECK_OK(model->InitWeights(7));
  Reference r;
  for (int pass = 0; pass < 2; ++pass) {
    Tensor y = *model->Forward(x);
    Tensor dx = *model->Backward(dy);
    r.y = Values(y);
    r.dx = Values(dx);
  }
  for (auto& [name, p] : model->NamedParameters()) r.grads[name] = p->grad;
  return r;
}

// `lora`: adapters on fc and proj (NormMlpWithLora): B split with fc's
// rows, A with proj's columns, the other two whole with their gradients
// all-reduced; the base weights frozen.
void CheckBlock(int tp, bool sequence_parallel, bool lora = false) {
  SCOPED_TRACE(testing::Message()
               << "tp " << tp << (sequence_parallel ? " sequence parallel" : "")
               << (lora ? " LoRA" : ""));
  const Tensor x = RandomTensor({kB, kT, kC}, DType::kF32, 1);
  const Tensor dy = RandomTensor({kB, kT, kC}, DType::kF32, 2);
  const Reference ref = RunReference(x, dy, lora);
  RunOnMesh({{"tp", tp}}, [&](int rank, DeviceMesh& mesh) {
    auto model = lora ? NormMlpWithLora() : NormMlp();
    const Layout stream =
        sequence_parallel ? Layout::kShardSequence : Layout::kReplicate;
    std::vector<PlanEntry> plan = {
        {"1", Style::RegionInput(stream)},
        {"1.fc", Style::ColwiseInRegion()},
        {"1.proj", Style::Rowwise(Layout::kShardLast, stream)},
    };
    if (sequence_parallel) plan.push_back({"0", Style::SequenceParallel()});
    ASSERT_TRUE(ParallelizeModule(model.get(), &mesh, plan).ok());
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE(model->InitWeights(7).ok());
    const int64_t t = kT / tp;
    const Tensor xin = sequence_parallel ? SequenceSlice(x, rank * t, t) : x;
    const Tensor dyin = sequence_parallel ? SequenceSlice(dy, rank * t, t) : dy;
    std::vector<double> y, dx;
    for (int pass = 0; pass < 2; ++pass) {
      absl::StatusOr<Tensor> yt = model->Forward(xin);
      ASSERT_TRUE(yt.ok()) << yt.status();
      absl::StatusOr<Tensor> dxt = model->Backward(dyin);
      ASSERT_TRUE(dxt.ok()) << dxt.status();
      y = Values(*yt);
      dx = Values(*dxt);
    }
    const Tensor yref = *Tensor::FromFloats(
        {kB, kT, kC}, std::vector<float>(ref.y.begin(), ref.y.end()),
        DType::kF32);
    const Tensor dxref = *Tensor::FromFloats(
        {kB, kT, kC}, std::vector<float>(ref.dx.begin(), ref.dx.end()),
        DType::kF32);
    ExpectNear(
        y, Values(sequence_parallel ? SequenceSlice(yref, rank * t, t) : yref),
        1e-5, "y");
    ExpectNear(
        dx,
        Values(sequence_parallel ? SequenceSlice(dxref, rank * t, t) : dxref),
        1e-5, "dx");
    for (auto& [name, p] : model->NamedParameters()) {
      if (!p->requires_grad) continue;  // LoRA's frozen base
      ASSERT_TRUE(p->grad.defined()) << name;
      ExpectNear(Values(p->grad), PieceOf(ref.grads.at(name), *p), 1e-5,
                 name + " grad");
    }
    // The DTensor view: fc's weight is Shard(0), proj's Shard(1), the rest
    // replicated; their global shapes are the parameters'.
    absl::StatusOr<std::vector<TensorParallelParameter>> params =
        TensorParallelParameters(model.get(), &mesh);
    ASSERT_TRUE(params.ok()) << params.status();
    for (const TensorParallelParameter& p : *params) {
      const Placement want =
          p.name == "1.fc.weight" || p.name == "1.fc.bias" ||
                  p.name == "1.fc.lora_B.weight"
              ? Placement::Shard(0)
          : p.name == "1.proj.weight" || p.name == "1.proj.lora_A.weight"
              ? Placement::Shard(1)
              : Placement::Replicate();
      EXPECT_EQ(p.param.placements()[0], want) << p.name;
      EXPECT_EQ(p.param.shape(), p.parameter->shape) << p.name;
    }
  });
}

TEST(TensorParallelTest, LoraAdaptersSplitAsTheirBaseWeights) {
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) CheckBlock(tp, sp, /*lora=*/true);
  }
}

TEST(TensorParallelTest, MlpBlockMatchesOneRank) {
  for (int tp : {2, 4}) {
    for (bool sp : {false, true}) CheckBlock(tp, sp);
  }
}

// A vocabulary-parallel embedding and a column-wise head sharing its table
// (tied), the logits gathered: equal to the single-rank lookup and head.
TEST(TensorParallelTest, VocabularyParallelEmbeddingWithTiedHead) {
  static constexpr int64_t kV = 12;
  auto build = [] {
    auto seq = std::make_unique<nn::Sequential>();
    auto* embed = seq->Append(std::make_unique<nn::Embedding>(kV, kC, 0.5f));
    seq->Append(std::make_unique<nn::Linear>(embed->weight()));
    return seq;
  };
  const Tensor ids =
      *Tensor::FromInts({kB, 3}, {0, 11, 5, 6, 3, 11}, DType::kI64);
  const Tensor dlogits = RandomTensor({kB, 3, kV}, DType::kF32, 3);
  auto ref = build();
  ASSERT_TRUE(ref->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(ref->InitWeights(4).ok());
  const std::vector<double> want = Values(*ref->Forward(ids));
  ASSERT_TRUE(ref->Backward(dlogits).ok());
  const Tensor want_grad = ref->NamedParameters()[0].second->grad;
  RunOnMesh({{"tp", 2}}, [&](int rank, DeviceMesh& mesh) {
    auto model = build();
    absl::Status s = ParallelizeModule(
        model.get(), &mesh,
        {{"0", Style::Rowwise(Layout::kReplicate, Layout::kReplicate)},
         {"1", Style::Colwise(Layout::kReplicate, Layout::kReplicate)}});
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(model->ToEmpty(Device::Cpu()).ok());
    ASSERT_TRUE(model->InitWeights(4).ok());
    absl::StatusOr<Tensor> logits = model->Forward(ids);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ExpectNear(Values(*logits), want, 1e-6, "logits");
    ASSERT_TRUE(model->Backward(dlogits).ok());
    Parameter* table = model->NamedParameters()[0].second;
    EXPECT_EQ(table->LocalShape(), (Shape{kV / 2, kC})) << rank;
    ExpectNear(Values(table->grad), PieceOf(want_grad, *table), 1e-5, "grad");
  });
}

TEST(TensorParallelTest, BadPlansAreRejectedWithNothingApplied) {
  RunOnMesh({{"tp", 3}}, [&](int, DeviceMesh& mesh) {
    struct Case {
      std::vector<PlanEntry> plan;
      std::string message;
    };
    const std::vector<Case> cases = {
        {{{"1", Style::SequenceParallel()}, {"1.nope", Style::Rowwise()}},
         "no module '1.nope'"},
        // 16 hidden features over 3 ranks.
        {{{"1.fc", Style::ColwiseInRegion()}},
         "module '1.fc' (Linear) with Colwise(in region): dim 0 of the "
         "weight (out_features) (16) is not divisible by the tp size 3"},
        {{{"0", Style::Rowwise()}}, "row-wise needs a Linear or an Embedding"},
        {{{"1", Style::SequenceParallel()}, {"1", Style::SequenceParallel()}},
         "appears twice"},
    };
    for (const Case& c : cases) {
      auto model = NormMlp();
      absl::Status s = ParallelizeModule(model.get(), &mesh, c.plan);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), c.message)) << s;
      for (auto& [name, p] : model->NamedParameters()) {
        EXPECT_FALSE(p->has_piece()) << name << " after " << s;
      }
    }
  });
  // A tied table split by one reader only.
  RunOnMesh({{"tp", 2}}, [&](int, DeviceMesh& mesh) {
    auto seq = std::make_unique<nn::Sequential>();
    auto* embed = seq->Append(std::make_unique<nn::Embedding>(6, kC));
    seq->Append(std::make_unique<nn::Linear>(embed->weight()));
    absl::Status s =
        ParallelizeModule(seq.get(), &mesh, {{"1", Style::Colwise()}});
    EXPECT_TRUE(absl::StrContains(s.message(), "module '0' reads")) << s;
    EXPECT_FALSE(embed->weight()->has_piece());
    // Split differently by the two readers.
    s = ParallelizeModule(seq.get(), &mesh,
                          {{"0", Style::Colwise()}, {"1", Style::Colwise()}});
    EXPECT_TRUE(absl::StrContains(s.message(), "split it differently")) << s;
    EXPECT_FALSE(embed->weight()->has_piece());
  });
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
