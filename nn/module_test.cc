// Module: fully qualified names, tied parameters listed once, transparent
// (empty-named) children, glob name patterns, hook order across a Sequential of
// two Linears, hook errors, zero-byte meta construction, ToEmpty + InitWeights
// equal to InitSlice of arbitrary row ranges bitwise, InitWeights naming a meta
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
#include "tensor/sharding.h"
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

TEST(ModuleTest, NamePatternsMatchWholeNamesGlobStyle) {
  EXPECT_TRUE(MatchesNamePattern("layers.*.attn.wq.weight",
                                 "layers.12.attn.wq.weight"));
  EXPECT_TRUE(MatchesNamePattern("*.bias", "layers.0.mlp.fc.bias"));
  EXPECT_TRUE(MatchesNamePattern("*", "wte.weight"));
  EXPECT_TRUE(MatchesNamePattern("layers.?.attn.*", "layers.3.attn.wo.weight"));
  EXPECT_TRUE(MatchesNamePattern("wte.weight", "wte.weight"));
  EXPECT_TRUE(MatchesNamePattern("*a*b*", "xaxxbx"));
  // Whole names only: no prefix or suffix matches.
  EXPECT_FALSE(MatchesNamePattern("wte", "wte.weight"));
  EXPECT_FALSE(MatchesNamePattern("weight", "wte.weight"));
  EXPECT_FALSE(MatchesNamePattern("layers.?.attn.*", "layers.12.attn.wo"));
  EXPECT_FALSE(MatchesNamePattern("*.bias", "layers.0.mlp.fc.weight"));
  EXPECT_FALSE(MatchesNamePattern("", "x"));
  EXPECT_TRUE(MatchesNamePattern("", ""));
  EXPECT_FALSE(MatchesNamePattern("*a*b", "xaxxbx"));
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

// Values of the box [offset, offset + size) of `whole` (row-major `layout`).
std::vector<double> BoxValues(const Tensor& whole, const Shape& layout,
                              const Shape& offset, const Shape& size) {
  Tensor w = *whole.Reshape(layout);
  Tensor box = *Tensor::Empty(size, whole.dtype(), Device::Cpu());
  CHECK_OK(CopyBox(w, offset, &box, Shape(size.size(), 0), size));
  return Values(box);
}

// A piece initialised on its own (meta, then ToEmpty + InitWeights) equals
// that box of the whole parameter bitwise, for row, column and 3-D view
// boxes; a materialised parameter cut later keeps the box's values.
TEST(ModuleTest, PiecesInitialiseAsTheBoxOfTheWhole) {
  struct Case {
    Shape layout, offset, size, local;
  };
  const std::vector<Case> cases = {
      {{12, 5}, {4, 0}, {4, 5}, {4, 5}},          // rows (column-wise TP)
      {{12, 5}, {0, 2}, {12, 2}, {12, 2}},        // columns (row-wise TP)
      {{3, 4, 5}, {0, 2, 0}, {3, 2, 5}, {6, 5}},  // fused q/k/v view
  };
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    nn::Linear whole(5, 12, true, 0.5f, dtype);
    ASSERT_OK(whole.ToEmpty(Device::Cpu()));
    ASSERT_OK(whole.InitWeights(9));
    for (const Case& c : cases) {
      nn::Linear cut(5, 12, true, 0.5f, dtype);
      ASSERT_OK(cut.weight()->SetPiece({c.layout, c.offset, c.size, c.local}));
      EXPECT_TRUE(cut.weight()->data.is_meta());
      EXPECT_EQ(cut.weight()->LocalShape(), c.local);
      ASSERT_OK(cut.ToEmpty(Device::Cpu()));
      EXPECT_EQ(cut.weight()->data.shape(), c.local);
      ASSERT_OK(cut.InitWeights(9));
      const auto want =
          BoxValues(whole.weight()->data, c.layout, c.offset, c.size);
      EXPECT_EQ(Values(cut.weight()->data), want);
      // Materialised first, cut afterwards.
      nn::Linear late(5, 12, true, 0.5f, dtype);
      ASSERT_OK(late.ToEmpty(Device::Cpu()));
      ASSERT_OK(late.InitWeights(9));
      ASSERT_OK(late.weight()->SetPiece({c.layout, c.offset, c.size, c.local}));
      EXPECT_EQ(Values(late.weight()->data), want);
      ASSERT_OK(late.weight()->EnsureGrad());
      EXPECT_EQ(late.weight()->grad.shape(), c.local);
    }
  }
}

TEST(ModuleTest, BadPiecesAreRejectedAndChangeNothing) {
  nn::Linear linear(5, 12);
  Parameter* w = linear.weight();
  const std::vector<ParameterPiece> bad = {
      {{13, 5}, {0, 0}, {4, 5}, {4, 5}},   // layout has other elements
      {{12, 5}, {10, 0}, {4, 5}, {4, 5}},  // outside the layout
      {{12, 5}, {0}, {4}, {4, 5}},         // offset / size rank
      {{12, 5}, {0, 0}, {4, 5}, {4, 4}},   // local shape's elements
  };
  for (const ParameterPiece& p : bad) {
    const absl::Status s = w->SetPiece(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_FALSE(w->has_piece());
    EXPECT_EQ(w->data.shape(), (Shape{12, 5}));
  }
  ASSERT_OK(w->SetPiece({{12, 5}, {0, 0}, {6, 5}, {6, 5}}));
  EXPECT_EQ(w->SetPiece({{12, 5}, {6, 0}, {6, 5}, {6, 5}}).code(),
            absl::StatusCode::kFailedPrecondition);  // outside the held box
  EXPECT_EQ(w->SetPiece({{6, 10}, {0, 0}, {3, 10}, {3, 10}}).code(),
            absl::StatusCode::kFailedPrecondition);  // another layout
  EXPECT_EQ(w->LocalShape(), (Shape{6, 5}));
  nn::Linear trained(5, 12);
  ASSERT_OK(trained.ToEmpty(Device::Cpu()));
  ASSERT_OK(trained.weight()->EnsureGrad());
  EXPECT_EQ(
      trained.weight()->SetPiece({{12, 5}, {0, 0}, {6, 5}, {6, 5}}).code(),
      absl::StatusCode::kFailedPrecondition);  // has a gradient
}

// A piece cut again to a box inside it (expert parallelism narrowing a
// tensor-parallel piece) holds that box of the whole, materialised or
// initialised afterwards.
TEST(ModuleTest, PiecesNarrowToABoxInsideThem) {
  nn::Linear whole(6, 8, false, 0.5f);
  ASSERT_OK(whole.ToEmpty(Device::Cpu()));
  ASSERT_OK(whole.InitWeights(4));
  const ParameterPiece columns{{8, 6}, {0, 3}, {8, 3}, {8, 3}};
  const ParameterPiece rows_of_it{{8, 6}, {4, 3}, {2, 3}, {2, 3}};
  const auto want =
      BoxValues(whole.weight()->data, {8, 6}, rows_of_it.offset, {2, 3});
  nn::Linear late(6, 8, false, 0.5f);
  ASSERT_OK(late.ToEmpty(Device::Cpu()));
  ASSERT_OK(late.InitWeights(4));
  ASSERT_OK(late.weight()->SetPiece(columns));
  ASSERT_OK(late.weight()->SetPiece(rows_of_it));
  EXPECT_EQ(late.weight()->LocalShape(), (Shape{2, 3}));
  EXPECT_EQ(Values(late.weight()->data), want);
  nn::Linear early(6, 8, false, 0.5f);
  ASSERT_OK(early.weight()->SetPiece(columns));
  ASSERT_OK(early.weight()->SetPiece(rows_of_it));
  ASSERT_OK(early.ToEmpty(Device::Cpu()));
  ASSERT_OK(early.InitWeights(4));
  EXPECT_EQ(Values(early.weight()->data), want);
}

// Column pieces of a Linear compute the matching columns of the whole
// output, row pieces (with the bias on one piece only) partial sums that add
// up to it; an embedding's row pieces give zeros for the other rows' ids.
TEST(ModuleTest, LayersComputeWithTheirPieces) {
  nn::Linear whole(6, 8);
  whole.bias()->init = InitSpec::Uniform(-1, 1);
  ASSERT_OK(whole.ToEmpty(Device::Cpu()));
  ASSERT_OK(whole.InitWeights(3));
  const Tensor x = RandomTensor({3, 6}, DType::kF32, 4);
  ASSERT_OK_AND_ASSIGN(Tensor y, whole.Forward(x));
  const std::vector<double> vy = Values(y);
  std::vector<double> sum(vy.size(), 0.0);
  for (int r = 0; r < 2; ++r) {
    nn::Linear col(6, 8);
    col.bias()->init = InitSpec::Uniform(-1, 1);
    ASSERT_OK(col.weight()->SetPiece({{8, 6}, {4 * r, 0}, {4, 6}, {4, 6}}));
    ASSERT_OK(col.bias()->SetPiece({{8}, {4 * r}, {4}, {4}}));
    ASSERT_OK(col.ToEmpty(Device::Cpu()));
    ASSERT_OK(col.InitWeights(3));
    ASSERT_OK_AND_ASSIGN(Tensor yc, col.Forward(x));
    EXPECT_EQ(Values(yc), BoxValues(y, {3, 8}, {0, 4 * r}, {3, 4}));

    nn::Linear row(6, 8);
    row.bias()->init = InitSpec::Uniform(-1, 1);
    ASSERT_OK(row.weight()->SetPiece({{8, 6}, {0, 3 * r}, {8, 3}, {8, 3}}));
    row.set_add_bias_in_forward(r == 0);
    ASSERT_OK(row.ToEmpty(Device::Cpu()));
    ASSERT_OK(row.InitWeights(3));
    const Tensor xr = *Tensor::FromFloats(
        {3, 3},
        [&] {
          std::vector<float> v;
          const auto vx = Values(x);
          for (int i = 0; i < 3; ++i)
            for (int j = 0; j < 3; ++j) v.push_back(vx[i * 6 + 3 * r + j]);
          return v;
        }(),
        DType::kF32);
    ASSERT_OK_AND_ASSIGN(Tensor yr, row.Forward(xr));
    const auto vr = Values(yr);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += vr[i];
  }
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_NEAR(sum[i], vy[i], 1e-6);

  nn::Embedding table(10, 4);
  ASSERT_OK(table.ToEmpty(Device::Cpu()));
  ASSERT_OK(table.InitWeights(5));
  const Tensor ids = *Tensor::FromInts({5}, {0, 9, 4, 5, 3}, DType::kI64);
  ASSERT_OK_AND_ASSIGN(Tensor e, table.Forward(ids));
  nn::Embedding piece(10, 4);
  ASSERT_OK(piece.weight()->SetPiece({{10, 4}, {5, 0}, {5, 4}, {5, 4}}));
  ASSERT_OK(piece.ToEmpty(Device::Cpu()));
  ASSERT_OK(piece.InitWeights(5));
  ASSERT_OK_AND_ASSIGN(Tensor ep, piece.Forward(ids));
  const auto ve = Values(e), vp = Values(ep);
  for (int i = 0; i < 5; ++i) {
    const bool mine = i == 1 || i == 3;  // ids 9 and 5
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(vp[i * 4 + j], mine ? ve[i * 4 + j] : 0.0) << i << "," << j;
    }
  }
}

// Input and output transforms wrap ForwardImpl inside the hooks, and their
// backwards run in reverse around BackwardImpl.
TEST(ModuleTest, TransformsWrapTheLayerInsideTheHooks) {
  nn::Linear linear(3, 3, false);
  ASSERT_OK(linear.ToEmpty(Device::Cpu()));
  ASSERT_OK(linear.InitWeights(1));
  std::vector<std::string> log;
  auto scale = [](float a) {
    return [a](const Tensor& t) -> absl::StatusOr<Tensor> {
      Tensor out = *Tensor::Empty(t.shape(), t.dtype(), t.device());
      FSDPP_RETURN_IF_ERROR(Scale(t, a, &out));
      return out;
    };
  };
  auto logged = [&](std::string what,
                    std::function<absl::StatusOr<Tensor>(const Tensor&)> f) {
    return [&log, what, f](const Tensor& t) -> absl::StatusOr<Tensor> {
      log.push_back(what);
      return f(t);
    };
  };
  linear.AddPreForwardHook([&](Module&) {
    log.push_back("pre-forward");
    return absl::OkStatus();
  });
  linear.AddPostForwardHook([&](Module&) {
    log.push_back("post-forward");
    return absl::OkStatus();
  });
  linear.AddPreBackwardHook([&](Module&) {
    log.push_back("pre-backward");
    return absl::OkStatus();
  });
  linear.AddPostBackwardHook([&](Module&) {
    log.push_back("post-backward");
    return absl::OkStatus();
  });
  linear.AddInputTransform({logged("in1", scale(2)), logged("din1", scale(3))});
  linear.AddInputTransform({logged("in2", scale(5)), logged("din2", scale(7))});
  linear.AddOutputTransform(
      {logged("out", scale(11)), logged("dout", scale(13))});
  const Tensor x = RandomTensor({2, 3}, DType::kF32, 2);
  ASSERT_OK_AND_ASSIGN(Tensor y, linear.Forward(x));
  const Tensor dy = RandomTensor({2, 3}, DType::kF32, 3);
  ASSERT_OK_AND_ASSIGN(Tensor dx, linear.Backward(dy));
  EXPECT_EQ(log, (std::vector<std::string>{
                     "pre-forward", "in1", "in2", "out", "post-forward",
                     "pre-backward", "dout", "din2", "din1", "post-backward"}));
  // y = 11 (10 x) W^T; dx = 21 (13 dy) W.
  nn::Linear plain(3, 3, false);
  ASSERT_OK(plain.ToEmpty(Device::Cpu()));
  ASSERT_OK(plain.InitWeights(1));
  ASSERT_OK_AND_ASSIGN(Tensor y0, plain.Forward(x));
  ASSERT_OK_AND_ASSIGN(Tensor dx0, plain.Backward(dy));
  const auto vy = Values(y), vy0 = Values(y0), vdx = Values(dx),
             vdx0 = Values(dx0);
  for (size_t i = 0; i < vy.size(); ++i) {
    EXPECT_NEAR(vy[i], 110 * vy0[i], 1e-4);
    EXPECT_NEAR(vdx[i], 273 * vdx0[i], 1e-3);
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
