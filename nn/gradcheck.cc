// Module test helpers; see gradcheck.h.
#include "nn/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace nn {
namespace testing_util {
namespace {

using ::fsdpp::testing_util::AllClose;
using ::fsdpp::testing_util::RandomTensor;
using ::fsdpp::testing_util::Values;
using Vec = std::vector<double>;

// L = sum(dy * module(x)), or NaN (with `error` set) if forward fails.
double Objective(Module& module, const Tensor& x, const Vec& dy,
                 std::string* error) {
  absl::StatusOr<Tensor> y = module.Forward(x);
  if (!y.ok()) {
    *error = y.status().ToString();
    return NAN;
  }
  const Vec v = Values(*y);
  double l = 0.0;
  for (size_t i = 0; i < v.size(); ++i) l += v[i] * dy[i];
  return l;
}

// Central differences of the objective w.r.t. every element of `t` (f32,
// CPU), perturbed in place.
Vec NumericGrad(Module& module, const Tensor& x, Tensor& t, const Vec& dy,
                double h, std::string* error) {
  float* p = t.data<float>();
  Vec g(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float keep = p[i];
    p[i] = static_cast<float>(keep + h);
    const double up_step = static_cast<double>(p[i]) - keep;
    const double up = Objective(module, x, dy, error);
    p[i] = static_cast<float>(keep - h);
    const double down_step = keep - static_cast<double>(p[i]);
    const double down = Objective(module, x, dy, error);
    p[i] = keep;
    g[i] = (up - down) / (up_step + down_step);
  }
  return g;
}

}  // namespace

absl::Status Materialize(Module& module, uint64_t seed, bool randomize) {
  if (absl::Status s = module.ToEmpty(Device::Cpu()); !s.ok()) return s;
  if (randomize) {
    for (const auto& [name, p] : module.NamedParameters()) {
      p->init = InitSpec::Uniform(-1.0f, 1.0f);
    }
  }
  return module.InitWeights(seed);
}

::testing::AssertionResult CheckGradients(Module& module, const Tensor& x,
                                          const GradCheckOptions& options) {
  auto fail = [](const std::string& what) {
    return ::testing::AssertionFailure() << what;
  };
  if (absl::Status s = module.ZeroGrad(/*set_to_none=*/true); !s.ok()) {
    return fail(s.ToString());
  }
  absl::StatusOr<Tensor> y = module.Forward(x);
  if (!y.ok()) return fail(absl::StrCat("forward: ", y.status().ToString()));
  const Tensor dy = RandomTensor(y->shape(), y->dtype(), options.dy_seed);
  const Vec dy_values = Values(dy);
  absl::StatusOr<Tensor> dx = module.Backward(dy);
  if (!dx.ok()) return fail(absl::StrCat("backward: ", dx.status().ToString()));

  const auto params = module.NamedParameters();
  std::vector<Vec> grads;
  for (const auto& [name, p] : params) {
    if (!p->requires_grad) {
      grads.emplace_back();
      continue;
    }
    if (!p->grad.defined()) return fail(absl::StrCat("no grad for ", name));
    grads.push_back(Values(p->grad));
  }
  const Vec dx_values = options.check_input ? Values(*dx) : Vec();

  // A second forward + backward: the same dx, twice the gradients.
  absl::StatusOr<Tensor> y2 = module.Forward(x);
  if (!y2.ok()) return fail(y2.status().ToString());
  absl::StatusOr<Tensor> dx2 = module.Backward(dy);
  if (!dx2.ok()) return fail(dx2.status().ToString());
  if (options.check_input) {
    if (auto r = AllClose(Values(*dx2), dx_values, 0, 0); !r) {
      return fail(
          absl::StrCat("dx differs between two backwards: ", r.message()));
    }
  }
  for (size_t k = 0; k < params.size(); ++k) {
    if (!params[k].second->requires_grad) continue;
    Vec twice = grads[k];
    for (double& v : twice) v *= 2;
    if (auto r = AllClose(Values(params[k].second->grad), twice, 1e-5, 1e-7);
        !r) {
      return fail(absl::StrCat("grad of ", params[k].first,
                               " does not accumulate: ", r.message()));
    }
  }

  std::string error;
  if (options.check_input) {
    Tensor x_copy = *Tensor::Empty(x.shape(), x.dtype(), x.device());
    if (absl::Status s = Copy(x, &x_copy); !s.ok()) return fail(s.ToString());
    const Vec numeric =
        NumericGrad(module, x_copy, x_copy, dy_values, options.step, &error);
    if (!error.empty()) return fail(error);
    if (auto r = AllClose(dx_values, numeric, options.rtol, options.atol); !r) {
      return fail(absl::StrCat("dx: ", r.message()));
    }
  }
  for (size_t k = 0; k < params.size(); ++k) {
    Parameter* p = params[k].second;
    if (!p->requires_grad) continue;
    const Vec numeric =
        NumericGrad(module, x, p->data, dy_values, options.step, &error);
    if (!error.empty()) return fail(error);
    if (auto r = AllClose(grads[k], numeric, options.rtol, options.atol); !r) {
      return fail(absl::StrCat("grad of ", params[k].first, ": ", r.message()));
    }
  }
  module.ReleaseSavedTensors();
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult CheckBf16Forward(const ModuleFactory& factory,
                                            const Tensor& x, double tol,
                                            uint64_t seed) {
  std::vector<Vec> outputs;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    std::unique_ptr<Module> m = factory(dtype);
    absl::Status s = m->ToEmpty(Device::Cpu());
    if (s.ok()) s = m->InitWeights(seed);
    if (!s.ok()) return ::testing::AssertionFailure() << s;
    Tensor input = x;
    if (IsFloatingPoint(x.dtype())) {
      input = *Tensor::Empty(x.shape(), dtype, x.device());
      if (s = Copy(x, &input); !s.ok()) {
        return ::testing::AssertionFailure() << s;
      }
    }
    absl::StatusOr<Tensor> y = m->Forward(input);
    if (!y.ok()) return ::testing::AssertionFailure() << y.status();
    if (y->dtype() != dtype) {
      return ::testing::AssertionFailure()
             << "output " << y->ToString() << " is not " << DTypeName(dtype);
    }
    outputs.push_back(Values(*y));
  }
  double scale = 0.0;
  for (double v : outputs[0]) scale = std::max(scale, std::fabs(v));
  return AllClose(outputs[1], outputs[0], tol, tol * scale);
}

}  // namespace testing_util
}  // namespace nn
}  // namespace fsdpp
