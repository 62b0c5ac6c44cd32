// Module: fully qualified names, tied parameters listed once, transparent
// (empty-named) children, hook order across a Sequential of two Linears,
// hook errors, zero-byte meta construction, ToEmpty + InitWeights equal to
// InitSlice of arbitrary row ranges bitwise, InitWeights naming a meta
// parameter, ZeroGrad and ReleaseSavedTensors.
#include "nn/module.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nn/block.h"
#include "nn/embedding.h"
#include "nn/gradcheck.h"
#include "nn/layer_norm.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/sequential.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using nn::testing_util::CheckGradients;
using nn::testing_util::GradCheckOptions;
using nn::testing_util::Materialize;
using nn::testing_util::ScopedCpuAllocator;

// A tiny language model: embed -> blocks (2 pre-norm blocks) -> tied head.
class Tower : public Module {
 public:
  Tower(int64_t vocab, int64_t c, int64_t hidden) : Module("Tower") {
    embed_ = AddModule("embed", std::make_unique<nn::Embedding>(vocab, c));
    blocks_ = AddModule("blocks", std::make_unique<nn::Sequential>());
    for (int i = 0; i < 2; ++i) {
      blocks_->Append(
          std::make_unique<nn::Block>(std::make_unique<nn::LayerNorm>(c),
                                      std::make_unique<nn::Linear>(c, c),
                                      std::make_unique<nn::LayerNorm>(c),
                                      std::make_unique<nn::Mlp>(c, hidden)));
    }
    head_ = AddModule("head", std::make_unique<nn::Linear>(embed_->weight()));
  }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& ids) override {
    absl::StatusOr<Tensor> h = embed_->Forward(ids);
    if (h.ok()) h = blocks_->Forward(*h);
    if (h.ok()) h = head_->Forward(*h);
    return h;
  }
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override {
    absl::StatusOr<Tensor> g = head_->Backward(dy);
    if (g.ok()) g = blocks_->Backward(*g);
    if (g.ok()) g = embed_->Backward(*g);
    return g;
  }

 private:
  nn::Embedding* embed_;
  nn::Sequential* blocks_;
  nn::Linear* head_;
};

std::vector<std::string> ParameterNames(const Module& m,
                                        const std::string& prefix = "") {
  std::vector<std::string> names;
  for (const auto& [name, p] : m.NamedParameters(prefix)) names.push_back(name);
  return names;
}

TEST(ModuleTest, FullyQualifiedNamesAndTiedParameterOnce) {
  Tower tower(11, 5, 7);
  const std::vector<std::string> names = ParameterNames(tower);
  ASSERT_EQ(names.size(), 1u + 2 * 10);
  EXPECT_EQ(names[0], "embed.weight");
  EXPECT_EQ(names[1], "blocks.0.norm1.weight");
  EXPECT_EQ(names[17], "blocks.1.mlp.fc.weight");
  EXPECT_EQ(names.back(), "blocks.1.mlp.proj.bias");
  int embed = 0;
  for (const std::string& n : names) {
    EXPECT_FALSE(absl::StartsWith(n, "head")) << n;
    embed += n == "embed.weight";
  }
  EXPECT_EQ(embed, 1);
  EXPECT_EQ(tower.NumParameters(),
            11 * 5 + 2 * (4 * 5 + 5 * 5 + 5 + 5 * 7 + 7 + 7 * 5 + 5));
  EXPECT_EQ(ParameterNames(tower, "model")[0], "model.embed.weight");

  std::vector<std::string> modules;
  for (const auto& [name, m] : tower.NamedModules()) modules.push_back(name);
  EXPECT_EQ(modules[0], "");
  EXPECT_EQ(modules[1], "embed");
  EXPECT_EQ(modules[2], "blocks");
  EXPECT_EQ(modules[3], "blocks.0");
  EXPECT_EQ(modules.back(), "head");
  EXPECT_EQ(tower.LocalParameters().size(), 0u);
}

TEST(ModuleTest, TiedGradientsThroughWholeModel) {
  Tower tower(11, 5, 7);
  ASSERT_OK(Materialize(tower, 1));
  ASSERT_OK_AND_ASSIGN(
      Tensor ids, Tensor::FromInts({2, 3}, {1, 4, 4, 10, 0, 7}, DType::kI32));
  GradCheckOptions options;
  options.check_input = false;
  // Logits of a 2-block model with O(1) weights are large enough that f32
  // rounding noise dominates central differences at h = 1e-3 (errors ~2e-3);
  // at h = 1e-2 it is below 3e-4 and the truncation error is still smaller.
  options.step = 1e-2;
  EXPECT_TRUE(CheckGradients(tower, ids, options));
}

// A wrapper whose child is added under the empty name.
class Wrapper : public Module {
 public:
  explicit Wrapper(std::unique_ptr<Module> inner) : Module("Wrapper") {
    inner_ = AddModule("", std::move(inner));
  }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override {
    return inner_->Forward(x);
  }
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override {
    return inner_->Backward(dy);
  }

 private:
  Module* inner_;
};

TEST(ModuleTest, EmptyNamedChildIsTransparent) {
  Wrapper root(std::make_unique<Wrapper>(std::make_unique<nn::Mlp>(5, 7)));
  EXPECT_EQ(ParameterNames(root),
            (std::vector<std::string>{"fc.weight", "fc.bias", "proj.weight",
                                      "proj.bias"}));
  EXPECT_EQ(ParameterNames(root, "layers.2")[0], "layers.2.fc.weight");
  std::vector<std::string> modules;
  for (const auto& [name, m] : root.NamedModules("m")) {
    modules.push_back(name + ":" + m->kind());
  }
  EXPECT_EQ(modules,
            (std::vector<std::string>{"m:Wrapper", "m:Wrapper", "m:Mlp",
                                      "m.fc:Linear", "m.proj:Linear"}));
}

TEST(ModuleTest, HookOrderAcrossSequential) {
  nn::Sequential seq;
  nn::Linear* first = seq.Append(std::make_unique<nn::Linear>(5, 7));
  nn::Linear* second = seq.Append(std::make_unique<nn::Linear>(7, 3));
  ASSERT_OK(Materialize(seq, 2));
  std::vector<std::string> events;
  auto record = [&events](Module* m, const std::string& label) {
    m->AddPreForwardHook([&events, label](Module& self) {
      events.push_back(label + ".pre_fwd:" + self.kind());
      return absl::OkStatus();
    });
    m->AddPostForwardHook([&events, label](Module&) {
      events.push_back(label + ".post_fwd");
      return absl::OkStatus();
    });
    m->AddPreBackwardHook([&events, label](Module&) {
      events.push_back(label + ".pre_bwd");
      return absl::OkStatus();
    });
    m->AddPostBackwardHook([&events, label](Module&) {
      events.push_back(label + ".post_bwd");
      return absl::OkStatus();
    });
  };
  record(&seq, "seq");
  record(first, "0");
  record(second, "1");
  // A second hook of the same kind runs after the first.
  first->AddPreForwardHook([&events](Module&) {
    events.push_back("0.pre_fwd#2");
    return absl::OkStatus();
  });
  ASSERT_OK_AND_ASSIGN(Tensor y,
                       seq.Forward(RandomTensor({2, 5}, DType::kF32, 3)));
  ASSERT_OK(seq.Backward(y));
  EXPECT_EQ(events,
            (std::vector<std::string>{
                "seq.pre_fwd:Sequential", "0.pre_fwd:Linear", "0.pre_fwd#2",
                "0.post_fwd", "1.pre_fwd:Linear", "1.post_fwd", "seq.post_fwd",
                "seq.pre_bwd", "1.pre_bwd", "1.post_bwd", "0.pre_bwd",
                "0.post_bwd", "seq.post_bwd"}));
}

TEST(ModuleTest, HookErrorStopsTheCall) {
  nn::Linear linear(5, 7);
  ASSERT_OK(Materialize(linear, 4));
  bool ran_post = false;
  linear.AddPreForwardHook(
      [](Module&) { return absl::UnavailableError("all-gather failed"); });
  linear.AddPostForwardHook([&ran_post](Module&) {
    ran_post = true;
    return absl::OkStatus();
  });
  absl::StatusOr<Tensor> y =
      linear.Forward(RandomTensor({2, 5}, DType::kF32, 5));
  EXPECT_EQ(y.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(ran_post);
}

TEST(ModuleTest, MetaConstructionAllocatesNothing) {
  ScopedCpuAllocator fresh;
  Tower tower(11, 5, 7);
  EXPECT_EQ(fresh.Stats().total_peak, 0);
  EXPECT_EQ(fresh.Stats().num_allocations, 0);
  for (const auto& [name, p] : tower.NamedParameters()) {
    EXPECT_TRUE(p->data.is_meta()) << name;
  }
  ASSERT_OK(tower.ToEmpty(Device::Cpu()));
  EXPECT_EQ(fresh.Stats().current_of(MemoryTag::kParams),
            tower.NumParameters() * 4);
  EXPECT_EQ(fresh.Stats().total_current, tower.NumParameters() * 4);
}

TEST(ModuleTest, InitWeightsEqualsInitSliceOfAnyRowRange) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    nn::Linear linear(5, 7, true, 0.02f, dtype);
    nn::Mlp mlp(7, 9, 0.5f, 0.3f, dtype);
    mlp.fc()->bias()->init = InitSpec::Uniform(-1, 1);
    mlp.proj()->weight()->init = InitSpec::TruncatedNormal(0.5f);
    for (Module* m : std::vector<Module*>{&linear, &mlp}) {
      ASSERT_OK(m->ToEmpty(Device::Cpu()));
      ASSERT_OK(m->InitWeights(42));
      for (const auto& [name, p] : m->NamedParameters()) {
        const int64_t rows = p->shape[0];
        const int64_t row_elems = p->data.numel() / rows;
        const size_t row_bytes = row_elems * DTypeSize(dtype);
        for (int64_t start : {int64_t{0}, int64_t{1}, rows / 2, rows - 1}) {
          for (int64_t len : {int64_t{0}, int64_t{1}, rows - start}) {
            Shape shape = p->shape;
            shape[0] = len;
            ASSERT_OK_AND_ASSIGN(Tensor slice,
                                 Tensor::Empty(shape, dtype, Device::Cpu()));
            ASSERT_OK(InitSlice(p->init, 42, InitStreamId(name),
                                start * row_elems, &slice));
            const char* whole = static_cast<const char*>(p->data.raw_data()) +
                                start * row_bytes;
            EXPECT_TRUE(len == 0 || std::memcmp(slice.raw_data(), whole,
                                                len * row_bytes) == 0)
                << name << " rows [" << start << ", " << start + len << ")";
          }
        }
      }
    }
  }
}

TEST(ModuleTest, InitWeightsNamesMetaParameter) {
  Tower tower(11, 5, 7);
  EXPECT_EQ(tower.InitWeights(1).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(tower.ToEmpty(Device::Cpu()));
  Parameter* fc = nullptr;
  for (const auto& [name, p] : tower.NamedParameters()) {
    if (name == "blocks.1.mlp.fc.weight") fc = p;
  }
  ASSERT_NE(fc, nullptr);
  ASSERT_OK_AND_ASSIGN(fc->data,
                       Tensor::Empty(fc->shape, fc->dtype, Device::Meta()));
  const absl::Status s = tower.InitWeights(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "'blocks.1.mlp.fc.weight'")) << s;
}

TEST(ModuleTest, ZeroGradAndReleaseSavedTensors) {
  nn::Sequential seq;
  seq.Append(std::make_unique<nn::Linear>(5, 7));
  seq.Append(std::make_unique<nn::Mlp>(7, 3));
  ASSERT_OK(Materialize(seq, 6));
  const Tensor x = RandomTensor({2, 5}, DType::kF32, 7);
  ASSERT_OK_AND_ASSIGN(Tensor y, seq.Forward(x));
  ASSERT_OK(seq.Backward(y));
  for (const auto& [name, p] : seq.NamedParameters()) {
    ASSERT_TRUE(p->grad.defined()) << name;
    EXPECT_EQ(p->grad.tag(), MemoryTag::kGrads);
  }
  ASSERT_OK(seq.ZeroGrad());
  for (const auto& [name, p] : seq.NamedParameters()) {
    for (double v : Values(p->grad)) EXPECT_EQ(v, 0.0) << name;
  }
  ASSERT_OK(seq.ZeroGrad(/*set_to_none=*/true));
  for (const auto& [name, p] : seq.NamedParameters()) {
    EXPECT_FALSE(p->grad.defined()) << name;
  }
  // Released activations: the next backward needs a forward first.
  ASSERT_OK_AND_ASSIGN(y, seq.Forward(x));
  seq.ReleaseSavedTensors();
  EXPECT_EQ(seq.Backward(y).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace fsdpp
