// Linear: finite-difference gradients (with and without bias, 2-D to 4-D
// inputs, tied to an embedding table), accumulation, bf16 and mixed-dtype
// forward/backward, LoRA adapters (names, init, gradients, merge), and
// errors.
#include "nn/linear.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/dropout.h"
#include "nn/embedding.h"
#include "nn/gradcheck.h"
#include "nn/layer_util.h"
#include "nn/sequential.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using testing_util::CheckBf16Forward;
using testing_util::CheckGradients;
using testing_util::Materialize;

TEST(LinearTest, GradientsWithBias) {
  Linear linear(5, 7);
  ASSERT_OK(Materialize(linear, 1));
  EXPECT_TRUE(CheckGradients(linear, RandomTensor({2, 3, 5}, DType::kF32, 2)));
}

TEST(LinearTest, GradientsWithoutBias) {
  Linear linear(5, 3, /*bias=*/false);
  ASSERT_OK(Materialize(linear, 3));
  EXPECT_EQ(linear.bias(), nullptr);
  EXPECT_EQ(linear.NamedParameters().size(), 1u);
  EXPECT_TRUE(CheckGradients(linear, RandomTensor({2, 3, 5}, DType::kF32, 4)));
}

TEST(LinearTest, GradientsFor2DAnd4DInputs) {
  Linear linear(3, 5);
  ASSERT_OK(Materialize(linear, 5));
  EXPECT_TRUE(CheckGradients(linear, RandomTensor({7, 3}, DType::kF32, 6)));
  EXPECT_TRUE(
      CheckGradients(linear, RandomTensor({2, 1, 3, 3}, DType::kF32, 7)));
}

TEST(LinearTest, ForwardMatchesReference) {
  Linear linear(5, 7);
  ASSERT_OK(Materialize(linear, 8));
  const Tensor x = RandomTensor({2, 3, 5}, DType::kF32, 9);
  ASSERT_OK_AND_ASSIGN(Tensor y, linear.Forward(x));
  EXPECT_EQ(y.shape(), (Shape{2, 3, 7}));
  EXPECT_EQ(y.tag(), MemoryTag::kActivations);
  const std::vector<double> xv = Values(x), w = Values(linear.weight()->data),
                            b = Values(linear.bias()->data);
  std::vector<double> expected(6 * 7);
  for (int r = 0; r < 6; ++r) {
    for (int o = 0; o < 7; ++o) {
      double acc = b[o];
      for (int i = 0; i < 5; ++i) acc += xv[r * 5 + i] * w[o * 5 + i];
      expected[r * 7 + o] = acc;
    }
  }
  EXPECT_TRUE(AllClose(Values(y), expected, 1e-5, 1e-6));
}

TEST(LinearTest, Bf16ForwardCloseToF32) {
  EXPECT_TRUE(CheckBf16Forward(
      [](DType dtype) {
        auto m = std::make_unique<Linear>(5, 7, true, 0.02f, dtype);
        m->weight()->init = InitSpec::Uniform(-1, 1);
        m->bias()->init = InitSpec::Uniform(-1, 1);
        return m;
      },
      RandomTensor({2, 3, 5}, DType::kF32, 10)));
}

// Gradients of `linear` for x and dy (both f32 values), computed with
// activations of `activation_dtype`.
struct Grads {
  std::vector<double> dx, dw, db;
};
Grads RunInDType(Linear& linear, DType activation_dtype) {
  Tensor x = RandomTensor({2, 3, 5}, activation_dtype, 11);
  Tensor dy = RandomTensor({2, 3, 7}, activation_dtype, 12);
  CHECK_OK(linear.ZeroGrad(true));
  absl::StatusOr<Tensor> y = linear.Forward(x);
  CHECK_OK(y.status());
  CHECK(y->dtype() == activation_dtype);
  absl::StatusOr<Tensor> dx = linear.Backward(dy);
  CHECK_OK(dx.status());
  CHECK(dx->dtype() == activation_dtype);
  return {Values(*dx), Values(linear.weight()->grad),
          Values(linear.bias()->grad)};
}

TEST(LinearTest, MixedDTypesCastParametersAndGradients) {
  // f32 reference on bf16-representable inputs.
  Linear f32(5, 7, true, 0.5f, DType::kF32);
  ASSERT_OK(Materialize(f32, 13, /*randomize=*/false));
  const Grads ref = RunInDType(f32, DType::kF32);
  // f32 parameters, bf16 activations: f32 grads.
  const Grads mixed = RunInDType(f32, DType::kBF16);
  EXPECT_EQ(f32.weight()->grad.dtype(), DType::kF32);
  // bf16 parameters, f32 activations: bf16 grads.
  Linear bf16(5, 7, true, 0.5f, DType::kBF16);
  ASSERT_OK(Materialize(bf16, 13, /*randomize=*/false));
  const Grads widened = RunInDType(bf16, DType::kF32);
  EXPECT_EQ(bf16.weight()->grad.dtype(), DType::kBF16);
  for (const Grads* g : {&mixed, &widened}) {
    EXPECT_TRUE(AllClose(g->dx, ref.dx, 3e-2, 3e-2));
    EXPECT_TRUE(AllClose(g->dw, ref.dw, 3e-2, 3e-2));
    EXPECT_TRUE(AllClose(g->db, ref.db, 3e-2, 3e-2));
  }
}

TEST(LinearTest, TiedToEmbeddingTable) {
  // ids -> table rows -> logits with the same table: the table's gradient
  // collects both uses.
  Sequential model;
  Embedding* embedding = model.Append(std::make_unique<Embedding>(11, 5));
  Linear* head =
      model.Append(std::make_unique<Linear>(embedding->weight(), true));
  EXPECT_FALSE(head->owns_weight());
  EXPECT_EQ(head->in_features(), 5);
  EXPECT_EQ(head->out_features(), 11);
  std::vector<std::string> names;
  for (const auto& [name, p] : model.NamedParameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "1.bias"}));
  EXPECT_TRUE(head->LocalParameters().size() == 1);
  ASSERT_OK(Materialize(model, 14));
  ASSERT_OK_AND_ASSIGN(
      Tensor ids, Tensor::FromInts({2, 3}, {0, 3, 10, 3, 7, 1}, DType::kI64));
  testing_util::GradCheckOptions options;
  options.check_input = false;
  EXPECT_TRUE(CheckGradients(model, ids, options));
}

// dW = dy^T x as doubles, [out, in] from x [rows, in] and dy [rows, out].
std::vector<double> ReferenceDw(const std::vector<double>& x,
                                const std::vector<double>& dy, int64_t rows,
                                int64_t in, int64_t out) {
  std::vector<double> dw(out * in, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        dw[o * in + i] += dy[r * out + o] * x[r * in + i];
      }
    }
  }
  return dw;
}

// The first backward writes a gradient that does not exist yet (no zeros,
// beta = 0: GradSink::ForWrite); the next one adds to it. The freed NaN
// buffer of the gradient's size is what the allocator hands out next, so a
// first matmul that added to the uninitialised gradient would give NaN.
TEST(LinearTest, FirstBackwardWritesTheGradientLaterOnesAdd) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Linear linear(5, 7, true, 0.5f, dtype);
    ASSERT_OK(Materialize(linear, 19));
    const Tensor x = RandomTensor({3, 5}, dtype, 20);
    const Tensor dy = RandomTensor({3, 7}, dtype, 21);
    const std::vector<double> once =
        ReferenceDw(Values(x), Values(dy), 3, 5, 7);
    std::vector<double> twice = once;
    for (double& v : twice) v *= 2.0;
    const double tol = dtype == DType::kF32 ? 1e-5 : 3e-2;
    for (int pass = 0; pass < 2; ++pass) {
      ASSERT_OK(linear.ZeroGrad(true));
      {
        ASSERT_OK_AND_ASSIGN(
            Tensor poison,
            Tensor::Empty({7, 5}, dtype, Device::Cpu(), MemoryTag::kGrads));
        ASSERT_OK(Fill(&poison, std::nanf("")));
      }
      ASSERT_OK(linear.Forward(x));
      ASSERT_OK(linear.Backward(dy));
      EXPECT_TRUE(AllClose(Values(linear.weight()->grad), once, tol, tol));
      ASSERT_OK(linear.Forward(x));
      ASSERT_OK(linear.Backward(dy));
      EXPECT_TRUE(AllClose(Values(linear.weight()->grad), twice, tol, tol));
    }
  }
}

TEST(GradSinkTest, WriteSinksLeaveNewGradientsUninitialised) {
  Parameter p;
  p.shape = {2, 3};
  ASSERT_OK_AND_ASSIGN(p.data,
                       Tensor::Zeros({2, 3}, DType::kF32, Device::Cpu()));
  {
    // No gradient yet: p->grad is the target, to be written whole.
    ASSERT_OK_AND_ASSIGN(GradSink sink,
                         GradSink::ForWrite(&p, DType::kF32, true));
    EXPECT_FALSE(sink.accumulate());
    EXPECT_EQ(sink.target(), &p.grad);
    EXPECT_TRUE(p.grad.defined());
    // Moved, it is still one sink: only the last owner drops the gradient.
    GradSink moved = std::move(sink);
    EXPECT_TRUE(p.grad.defined());
  }
  // Not committed (the op failed): the uninitialised gradient is dropped.
  EXPECT_FALSE(p.grad.defined());
  {
    ASSERT_OK_AND_ASSIGN(GradSink sink,
                         GradSink::ForWrite(&p, DType::kF32, true));
    ASSERT_OK(Fill(sink.target(), 2.0f));
    ASSERT_OK(sink.Commit());
  }
  EXPECT_EQ(Values(p.grad), std::vector<double>(6, 2.0));
  {
    // A gradient exists: the op adds to it.
    ASSERT_OK_AND_ASSIGN(GradSink sink,
                         GradSink::ForWrite(&p, DType::kF32, true));
    EXPECT_TRUE(sink.accumulate());
    ASSERT_OK(Axpy(1.0f, *sink.target(), sink.target()));
  }
  // Dropping a sink never drops a gradient it did not make.
  EXPECT_EQ(Values(p.grad), std::vector<double>(6, 4.0));
  {
    // bf16 ops into this f32 gradient go through a temporary, written whole
    // and added in by Commit.
    ASSERT_OK_AND_ASSIGN(GradSink sink,
                         GradSink::ForWrite(&p, DType::kBF16, false));
    EXPECT_FALSE(sink.accumulate());
    EXPECT_NE(sink.target(), &p.grad);
    EXPECT_EQ(sink.target()->dtype(), DType::kBF16);
    ASSERT_OK(Fill(sink.target(), 1.0f));
    ASSERT_OK(sink.Commit());
  }
  EXPECT_EQ(Values(p.grad), std::vector<double>(6, 5.0));
  // For (accumulating ops) always hands out zeros or the gradient.
  p.grad = Tensor();
  {
    ASSERT_OK_AND_ASSIGN(GradSink sink, GradSink::For(&p, DType::kF32, true));
    EXPECT_TRUE(sink.accumulate());
    EXPECT_EQ(Values(*sink.target()), std::vector<double>(6, 0.0));
  }
  EXPECT_TRUE(p.grad.defined());
}

TEST(LinearTest, FrozenParametersGetNoGradient) {
  Linear linear(5, 7);
  ASSERT_OK(Materialize(linear, 15));
  linear.weight()->requires_grad = false;
  ASSERT_OK(linear.Forward(RandomTensor({3, 5}, DType::kF32, 16)));
  ASSERT_OK(linear.Backward(RandomTensor({3, 7}, DType::kF32, 17)));
  EXPECT_FALSE(linear.weight()->grad.defined());
  EXPECT_TRUE(linear.bias()->grad.defined());
}

// LoRA: PEFT's names and initialisation (B zero: the output is the base's),
// the base frozen, finite-difference gradients of x, A and B, and the
// output equal to the merged weight's W + (alpha / r) B A.
// LoRA dropout: under installed rows the adapter's input is the keyed
// dropout's (the output is base + scale * B A dropout(x), checked against
// nn::KeyedDropout), the gradients are right by central differences (the
// same mask in backward), and without rows (evaluation) nothing drops.
TEST(LinearTest, LoraDropoutMasksTheAdaptersInput) {
  Linear layer(6, 5);
  ASSERT_OK(layer.EnableLora(3, 6.0f, /*dropout=*/0.4f, /*dropout_key=*/77));
  EXPECT_EQ(Linear(4, 4).EnableLora(2, 1.0f, 1.0f).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(Materialize(layer, 23));
  const Tensor x = RandomTensor({2, 4, 6}, DType::kF32, 24);
  DropoutRows rows;
  rows.keys = {5, 6};
  rows.columns = {0, 1, 2, 3};
  ASSERT_OK_AND_ASSIGN(Tensor undropped, layer.Forward(x));
  layer.ReleaseSavedTensors();
  DropoutRows::Scope scope(&rows);
  ASSERT_OK_AND_ASSIGN(Tensor y, layer.Forward(x));
  layer.ReleaseSavedTensors();
  Tensor xd = *Tensor::Empty(x.shape(), DType::kF32, Device::Cpu());
  ASSERT_OK(KeyedDropout(x, 0.4f, 77, 0, 6, rows, &xd));
  const std::vector<double> xs = Values(x), xds = Values(xd);
  const std::vector<double> w = Values(layer.weight()->data),
                            bias = Values(layer.bias()->data),
                            a = Values(layer.lora_a()->weight()->data),
                            b = Values(layer.lora_b()->weight()->data);
  const std::vector<double> got = Values(y), plain = Values(undropped);
  bool differs = false;
  for (int row = 0; row < 8; ++row) {
    for (int o = 0; o < 5; ++o) {
      double want = bias[o];
      for (int i = 0; i < 6; ++i) want += xs[row * 6 + i] * w[o * 6 + i];
      for (int k = 0; k < 3; ++k) {
        double h = 0;
        for (int i = 0; i < 6; ++i) h += xds[row * 6 + i] * a[k * 6 + i];
        want += 2.0 * b[o * 3 + k] * h;
      }
      EXPECT_NEAR(got[row * 5 + o], want, 1e-5);
      differs = differs || std::fabs(plain[row * 5 + o] - want) > 1e-4;
    }
  }
  EXPECT_TRUE(differs);
  EXPECT_TRUE(CheckGradients(layer, x));
}

TEST(LinearTest, LoraAdapterNamesInitGradientsAndMerge) {
  Linear base(6, 5);
  ASSERT_OK(base.EnableLora(/*rank=*/3, /*alpha=*/12.0f));
  EXPECT_FLOAT_EQ(base.lora_scale(), 4.0f);
  std::vector<std::string> names;
  for (const auto& [name, p] : base.NamedParameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "lora_A.weight",
                                             "lora_B.weight"}));
  EXPECT_FALSE(base.weight()->requires_grad);
  EXPECT_FALSE(base.bias()->requires_grad);
  EXPECT_EQ(base.lora_a()->weight()->shape, (Shape{3, 6}));
  EXPECT_EQ(base.lora_b()->weight()->shape, (Shape{5, 3}));
  EXPECT_EQ(base.EnableLora(2, 1.0f).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Linear(4, 4).EnableLora(0, 1.0f).code(),
            absl::StatusCode::kInvalidArgument);

  // PEFT's init: A ~ U(+-1/sqrt(in)), B = 0, so the adapter adds nothing.
  ASSERT_OK(Materialize(base, 19, /*randomize=*/false));
  const std::vector<double> a = Values(base.lora_a()->weight()->data);
  for (double v : a) EXPECT_LE(std::fabs(v), 1.0 / std::sqrt(6.0));
  const Tensor x = RandomTensor({2, 4, 6}, DType::kF32, 20);
  Linear plain(6, 5);
  ASSERT_OK(Materialize(plain, 19, /*randomize=*/false));
  ASSERT_OK_AND_ASSIGN(Tensor y0, base.Forward(x));
  ASSERT_OK_AND_ASSIGN(Tensor y_plain, plain.Forward(x));
  EXPECT_EQ(Values(y0), Values(y_plain));
  base.ReleaseSavedTensors();

  // Generic values everywhere: gradients by central differences (the base
  // weight and bias frozen: none for them).
  ASSERT_OK(Materialize(base, 21));
  EXPECT_TRUE(CheckGradients(base, x));
  EXPECT_FALSE(base.weight()->grad.defined());
  EXPECT_FALSE(base.bias()->grad.defined());

  // The merged weight gives the same output.
  ASSERT_OK_AND_ASSIGN(Tensor y, base.Forward(x));
  base.ReleaseSavedTensors();
  const std::vector<double> w = Values(base.weight()->data);
  const std::vector<double> aa = Values(base.lora_a()->weight()->data);
  const std::vector<double> bb = Values(base.lora_b()->weight()->data);
  std::vector<float> merged(30);
  for (int o = 0; o < 5; ++o) {
    for (int i = 0; i < 6; ++i) {
      double ba = 0;
      for (int r = 0; r < 3; ++r) ba += bb[o * 3 + r] * aa[r * 6 + i];
      merged[o * 6 + i] = static_cast<float>(w[o * 6 + i] + 4.0 * ba);
    }
  }
  Linear merged_layer(6, 5);
  ASSERT_OK(Materialize(merged_layer, 1));
  ASSERT_OK_AND_ASSIGN(Tensor mw, Tensor::FromFloats({5, 6}, merged));
  ASSERT_OK(Copy(mw, &merged_layer.weight()->data));
  ASSERT_OK(Copy(base.bias()->data, &merged_layer.bias()->data));
  ASSERT_OK_AND_ASSIGN(Tensor ym, merged_layer.Forward(x));
  EXPECT_TRUE(AllClose(Values(y), Values(ym), 1e-5, 1e-5));
}

TEST(LinearTest, Errors) {
  Linear linear(5, 7);
  ASSERT_OK(Materialize(linear, 18));
  absl::StatusOr<Tensor> y =
      linear.Forward(RandomTensor({3, 4}, DType::kF32, 1));
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(y.status().message().find("Linear forward"), std::string::npos)
      << y.status();
  absl::StatusOr<Tensor> dx =
      linear.Backward(RandomTensor({3, 7}, DType::kF32, 1));
  EXPECT_EQ(dx.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(linear.Forward(RandomTensor({3, 5}, DType::kF32, 1)));
  dx = linear.Backward(RandomTensor({3, 6}, DType::kF32, 1));
  EXPECT_EQ(dx.status().code(), absl::StatusCode::kInvalidArgument);
  // Backward releases what Forward saved.
  ASSERT_OK(linear.Backward(RandomTensor({3, 7}, DType::kF32, 1)));
  dx = linear.Backward(RandomTensor({3, 7}, DType::kF32, 1));
  EXPECT_EQ(dx.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LinearTest, RunsOnMeta) {
  Linear linear(5, 7);
  ASSERT_OK_AND_ASSIGN(Tensor x,
                       Tensor::Empty({2, 3, 5}, DType::kF32, Device::Meta()));
  ASSERT_OK_AND_ASSIGN(Tensor y, linear.Forward(x));
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.shape(), (Shape{2, 3, 7}));
  ASSERT_OK_AND_ASSIGN(Tensor dx, linear.Backward(y));
  EXPECT_EQ(dx.shape(), x.shape());
}

}  // namespace
}  // namespace nn
}  // namespace fsdpp
