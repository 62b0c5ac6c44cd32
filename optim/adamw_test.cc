// AdamW over thread ranks on real Gloo: params sharded Shard(0) over 1, 2 and
// 3 ranks (uneven shapes, an empty shard) and HSDP 2x2 give, bit for bit, the
// single-rank result (and issue no collective in Step); the single-rank
// result matches torch.optim.AdamW (run by optim/testdata/adamw_reference.py)
// to 1e-6 relative (with a floor of 1e-6 of the tensor's largest magnitude
// for elements that are cancelling sums); optimizer state takes exactly 2 x 4
// bytes per local element under kOptimizerState; compute copies, state dicts
// (round trip, resharded load, errors), weight-decay selection and argument
// errors.
#include "optim/adamw.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/allocator.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "optim/clip.h"
#include "optim/counting_groups.h"
#include "tensor/dtensor.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace {

using P = Placement;
using testing_util::RandomTensor;

// The parameters every test trains: uneven dim 0 over 2 and 3 ranks, a 1-D
// bias without weight decay, a shard that is empty on the third rank, and one
// large enough for the parallel CPU loop.
struct ParamCase {
  const char* name;
  Shape shape;
  bool decay;
};
const std::vector<ParamCase>& Cases() {
  static const auto* cases = new std::vector<ParamCase>{
      {"w", {7, 5}, true},
      {"b", {5}, false},
      {"tiny", {2, 3}, true},
      {"big", {257, 130}, true},
  };
  return *cases;
}

// Learning rate per step (as a schedule would set it).
const std::vector<double> kLrs = {0.01, 0.02, 0.015, 0.005, 0.001};
constexpr int kSteps = 5;

AdamWOptions Options() {
  AdamWOptions o;
  o.lr = kLrs[0];
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  return o;
}

Tensor InitialParam(size_t i) {
  return RandomTensor(Cases()[i].shape, DType::kF32, 1000 + i);
}

// Gradient of param i at step t (0-based); steps differ in scale so v sees
// more than one magnitude.
Tensor GradAt(size_t i, int t) {
  const float scale = 0.5f + 0.5f * t;
  return RandomTensor(Cases()[i].shape, DType::kF32, 2000 + 10 * i + t, -scale,
                      scale);
}

std::vector<uint32_t> Bits(const Tensor& t) {
  std::vector<float> f = *t.ToFloats();
  std::vector<uint32_t> bits(f.size());
  std::memcpy(bits.data(), f.data(), f.size() * sizeof(float));
  return bits;
}

// Full tensors after training.
struct FullState {
  std::vector<Tensor> param, exp_avg, exp_avg_sq;
};

// This rank's params, grads and optimizer over `mesh` with `placements`.
struct Training {
  std::vector<DTensor> params, grads;
  std::vector<Tensor> copies;  // bf16 compute copies of the local shards.
  AdamW opt;
};

Training MakeTraining(DeviceMesh& mesh, const std::vector<Placement>& place) {
  std::vector<DTensor> params, grads;
  for (size_t i = 0; i < Cases().size(); ++i) {
    params.push_back(*DTensor::Distribute(InitialParam(i), &mesh, place));
    grads.push_back(*DTensor::Distribute(GradAt(i, 0), &mesh, place));
  }
  // Vectors are final: the optimizer keeps pointers into them.
  Training tr{std::move(params), std::move(grads), {}, *AdamW::Create({})};
  std::vector<AdamWParam> list;
  for (size_t i = 0; i < Cases().size(); ++i) {
    list.push_back(
        {Cases()[i].name, &tr.params[i], &tr.grads[i], Cases()[i].decay});
  }
  absl::StatusOr<AdamW> opt = AdamW::Create(std::move(list), Options());
  CHECK_OK(opt.status());
  tr.opt = *std::move(opt);
  return tr;
}

// Runs kSteps steps; grads of step t are distributed before it.
void Train(Training& tr, DeviceMesh& mesh, const std::vector<Placement>& place,
           bool counting_mesh) {
  for (int t = 0; t < kSteps; ++t) {
    if (t > 0) {
      for (size_t i = 0; i < Cases().size(); ++i) {
        tr.grads[i] = *DTensor::Distribute(GradAt(i, t), &mesh, place);
      }
    }
    ASSERT_TRUE(tr.opt.SetLr(kLrs[t]).ok());
    const int ops_before = counting_mesh ? testing_util::TotalOps(mesh) : 0;
    ASSERT_TRUE(tr.opt.Step().ok());
    if (counting_mesh) {
      EXPECT_EQ(testing_util::TotalOps(mesh), ops_before)
          << "Step() issued a collective";
    }
  }
  EXPECT_EQ(tr.opt.step(), kSteps);
}

FullState Gather(Training& tr) {
  FullState full;
  absl::StatusOr<OptimizerStateDict> sd = tr.opt.StateDict();
  CHECK_OK(sd.status());
  for (size_t i = 0; i < Cases().size(); ++i) {
    const std::string name = Cases()[i].name;
    full.param.push_back(*tr.params[i].FullTensor());
    full.exp_avg.push_back(*sd->tensors.at(name + ".exp_avg").FullTensor());
    full.exp_avg_sq.push_back(
        *sd->tensors.at(name + ".exp_avg_sq").FullTensor());
  }
  return full;
}

// The single-rank result, computed once.
const FullState& SingleRank() {
  static const FullState* state = [] {
    auto* s = new FullState;
    testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
      Training tr = MakeTraining(mesh, {P::Shard(0)});
      Train(tr, mesh, {P::Shard(0)}, /*counting_mesh=*/false);
      *s = Gather(tr);
    });
    return s;
  }();
  return *state;
}

struct MeshCase {
  std::string label;
  std::vector<MeshAxis> axes;
  std::vector<Placement> placements;
};

class ShardedAdamWTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(ShardedAdamWTest, MatchesSingleRankBitwiseWithoutCommunication) {
  const MeshCase& mc = GetParam();
  const FullState& expected = SingleRank();
  testing_util::RunOnCountingMesh(mc.axes, [&](int rank, DeviceMesh& mesh) {
    Training tr = MakeTraining(mesh, mc.placements);
    // A bf16 compute copy of "w", refreshed by every step.
    tr.copies.push_back(*Tensor::Zeros(tr.params[0].local().shape(),
                                       DType::kBF16, Device::Cpu()));
    ASSERT_TRUE(tr.opt.SetComputeCopy("w", &tr.copies[0]).ok());
    Train(tr, mesh, mc.placements, /*counting_mesh=*/true);

    // State has the params' layout exactly.
    OptimizerStateDict sd = *tr.opt.StateDict();
    for (size_t i = 0; i < Cases().size(); ++i) {
      for (const char* kind : {".exp_avg", ".exp_avg_sq"}) {
        const DTensor& s = sd.tensors.at(Cases()[i].name + std::string(kind));
        EXPECT_EQ(s.mesh(), tr.params[i].mesh());
        EXPECT_EQ(s.placements(), tr.params[i].placements());
        EXPECT_EQ(s.shape(), tr.params[i].shape());
        EXPECT_EQ(s.local().shape(), tr.params[i].local().shape());
        EXPECT_EQ(s.local().tag(), MemoryTag::kOptimizerState);
      }
    }
    // The compute copy is the master rounded to bf16.
    std::vector<float> master = *tr.params[0].local().ToFloats();
    std::vector<float> copy = *tr.copies[0].ToFloats();
    for (size_t j = 0; j < master.size(); ++j) {
      ASSERT_EQ(copy[j], BFloat16ToFloat(FloatToBFloat16(master[j])))
          << "rank " << rank << " element " << j;
    }

    FullState got = Gather(tr);
    for (size_t i = 0; i < Cases().size(); ++i) {
      SCOPED_TRACE(::testing::Message()
                   << mc.label << " rank " << rank << " " << Cases()[i].name);
      EXPECT_EQ(Bits(got.param[i]), Bits(expected.param[i]));
      EXPECT_EQ(Bits(got.exp_avg[i]), Bits(expected.exp_avg[i]));
      EXPECT_EQ(Bits(got.exp_avg_sq[i]), Bits(expected.exp_avg_sq[i]));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ShardedAdamWTest,
    ::testing::Values(MeshCase{"dp1", {{"dp", 1}}, {P::Shard(0)}},
                      MeshCase{"dp2", {{"dp", 2}}, {P::Shard(0)}},
                      MeshCase{"dp3", {{"dp", 3}}, {P::Shard(0)}},
                      MeshCase{"hsdp2x2",
                               {{"replicate", 2}, {"shard", 2}},
                               {P::Replicate(), P::Shard(0)}}),
    [](const ::testing::TestParamInfo<MeshCase>& info) {
      return info.param.label;
    });

// ------------------------------------------------------------ torch

// Runs the torch reference on the same params, grads and learning rates;
// returns "<name> <kind>" -> values, or an empty map with *skip set.
std::map<std::string, std::vector<double>> RunTorch(std::string* skip) {
  const char* python = "/usr/bin/python3";
  const char* script = "optim/testdata/adamw_reference.py";
  if (access(python, X_OK) != 0) {
    *skip = "no /usr/bin/python3";
    return {};
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  const std::string in = dir + "/adamw_in.txt", out = dir + "/adamw_out.txt",
                    err = dir + "/adamw_err.txt";
  {
    std::ofstream f(in);
    const AdamWOptions o = Options();
    f << kSteps;
    char buf[32];
    for (double lr : kLrs) {
      std::snprintf(buf, sizeof(buf), " %.17g", lr);
      f << buf;
    }
    f << "\n";
    for (double x : {o.beta1, o.beta2, o.eps, o.weight_decay}) {
      std::snprintf(buf, sizeof(buf), "%.17g ", x);
      f << buf;
    }
    f << "\n" << Cases().size() << "\n";
    auto write = [&](const Tensor& t) {
      const std::vector<float> values = *t.ToFloats();
      for (float v : values) {
        std::snprintf(buf, sizeof(buf), "%.9g ", v);
        f << buf;
      }
      f << "\n";
    };
    for (size_t i = 0; i < Cases().size(); ++i) {
      f << Cases()[i].name << " " << (Cases()[i].decay ? 1 : 0) << " "
        << Cases()[i].shape.size();
      for (int64_t d : Cases()[i].shape) f << " " << d;
      f << "\n";
      write(InitialParam(i));
      for (int t = 0; t < kSteps; ++t) write(GradAt(i, t));
    }
  }
  const std::string cmd =
      std::string(python) + " " + script + " " + in + " " + out + " 2> " + err;
  const int status = std::system(cmd.c_str());
  std::ifstream ferr(err);
  std::stringstream err_text;
  err_text << ferr.rdbuf();
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    *skip = err_text.str();
    while (!skip->empty() && std::isspace(skip->back())) skip->pop_back();
    return {};
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << cmd << " failed: " << err_text.str();
  std::map<std::string, std::vector<double>> result;
  std::ifstream fout(out);
  std::string line;
  while (std::getline(fout, line)) {
    std::istringstream ls(line);
    std::string name, kind;
    ls >> name >> kind;
    std::vector<double>& values = result[name + " " + kind];
    double v;
    while (ls >> v) values.push_back(v);
  }
  return result;
}

TEST(AdamWTest, MatchesTorchAdamW) {
  std::string skip;
  const std::map<std::string, std::vector<double>> torch = RunTorch(&skip);
  if (!skip.empty()) {
    // As in models/parity_test: a missing torch fails where the setup
    // promises it (FSDPP_REQUIRE_TORCH, set in .bazelrc), else skips.
    if (std::getenv("FSDPP_REQUIRE_TORCH") != nullptr) {
      FAIL() << skip << " [FSDPP_REQUIRE_TORCH is set; install python3-torch "
             << "with tools/setup.sh]";
    }
    GTEST_SKIP() << "torch reference skipped: " << skip;
  }
  const FullState& ours = SingleRank();
  for (size_t i = 0; i < Cases().size(); ++i) {
    const std::string name = Cases()[i].name;
    const std::pair<const char*, const Tensor*> kinds[] = {
        {"param", &ours.param[i]},
        {"exp_avg", &ours.exp_avg[i]},
        {"exp_avg_sq", &ours.exp_avg_sq[i]}};
    for (const auto& [kind, tensor] : kinds) {
      SCOPED_TRACE(name + " " + kind);
      const auto it = torch.find(name + " " + kind);
      ASSERT_NE(it, torch.end());
      // Relative 1e-6; the absolute floor (1e-6 of the tensor's largest
      // value) covers elements that are sums of cancelling terms, where one
      // FMA in torch's kernels moves the last bit of a tiny result.
      double largest = 0.0;
      for (double v : it->second) largest = std::max(largest, std::fabs(v));
      const std::vector<double> got = testing_util::Values(*tensor);
      EXPECT_TRUE(
          testing_util::AllClose(got, it->second, 1e-6, 1e-6 * largest));
      // Report how close: elements equal bit for bit and the worst relative
      // difference.
      size_t equal = 0;
      double worst = 0.0;
      for (size_t j = 0; j < got.size() && j < it->second.size(); ++j) {
        if (got[j] == it->second[j]) ++equal;
        if (it->second[j] != 0.0) {
          worst = std::max(worst, std::fabs(got[j] - it->second[j]) /
                                      std::fabs(it->second[j]));
        }
      }
      std::printf(
          "vs torch: %-4s %-10s %zu/%zu elements equal, worst "
          "relative difference %.3g\n",
          name.c_str(), kind, equal, got.size(), worst);
    }
  }
}

// ------------------------------------------------------------ memory

TEST(AdamWTest, StateBytesAreTwoF32PerLocalElement) {
  Allocator* cpu = GetAllocator(Device::Cpu());
  std::mutex mu;  // Ranks share the process' allocator: measure one at a time.
  // Sends nothing: RunOnCountingMesh keeps every mesh until all ranks are
  // done (see optim/counting_groups.h).
  testing_util::RunOnCountingMesh({{"dp", 3}}, [&](int rank, DeviceMesh& mesh) {
    for (bool eager : {true, false}) {
      Training tr = MakeTraining(mesh, {P::Shard(0)});
      int64_t local_elements = 0;
      for (const DTensor& p : tr.params) local_elements += p.local().numel();
      const int64_t expected = 2 * 4 * local_elements;
      {
        std::lock_guard<std::mutex> lock(mu);
        const int64_t before =
            cpu->Stats().current_of(MemoryTag::kOptimizerState);
        ASSERT_TRUE((eager ? tr.opt.Init() : tr.opt.Step()).ok());
        EXPECT_EQ(cpu->Stats().current_of(MemoryTag::kOptimizerState) - before,
                  expected)
            << "rank " << rank << (eager ? " Init()" : " first Step()");
        ASSERT_TRUE(tr.opt.Step().ok());  // Later steps allocate no state.
        EXPECT_EQ(cpu->Stats().current_of(MemoryTag::kOptimizerState) - before,
                  expected);
      }
      std::lock_guard<std::mutex> lock(mu);
      const int64_t before =
          cpu->Stats().current_of(MemoryTag::kOptimizerState);
      tr = Training{{}, {}, {}, *AdamW::Create({})};  // Frees the state.
      EXPECT_EQ(cpu->Stats().current_of(MemoryTag::kOptimizerState),
                before - expected);
    }
  });
}

// --------------------------------------------------------- state dict

TEST(AdamWTest, StateDictRoundTripAndReshardedLoad) {
  testing_util::RunOnMesh({{"dp", 2}}, [](int rank, DeviceMesh& mesh) {
    const std::vector<Placement> place = {P::Shard(0)};
    Training a = MakeTraining(mesh, place);
    ASSERT_TRUE(a.opt.Step().ok());
    ASSERT_TRUE(a.opt.Step().ok());
    OptimizerStateDict sd = *a.opt.StateDict();
    ASSERT_EQ(sd.tensors.size(), 2 * Cases().size());
    EXPECT_EQ(sd.scalars.size(), 1u);
    EXPECT_EQ(sd.scalars.at("step"), 2);
    for (const ParamCase& c : Cases()) {
      EXPECT_EQ(sd.tensors.count(std::string(c.name) + ".exp_avg"), 1u);
      EXPECT_EQ(sd.tensors.count(std::string(c.name) + ".exp_avg_sq"), 1u);
    }

    // b: same params as a, state loaded as is; c: state loaded from an
    // all-Replicate copy (redistributed back to Shard(0) by the load).
    Training b = MakeTraining(mesh, place);
    Training c = MakeTraining(mesh, place);
    OptimizerStateDict replicated;
    for (const auto& [name, t] : sd.tensors) {
      replicated.tensors.emplace(name, *t.Redistribute({P::Replicate()}));
    }
    replicated.scalars = sd.scalars;
    for (size_t i = 0; i < Cases().size(); ++i) {
      ASSERT_TRUE(Copy(a.params[i].local(), b.params[i].mutable_local()).ok());
      ASSERT_TRUE(Copy(a.params[i].local(), c.params[i].mutable_local()).ok());
    }
    ASSERT_TRUE(b.opt.LoadStateDict(sd).ok());
    absl::Status loaded = c.opt.LoadStateDict(replicated);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_EQ(b.opt.step(), 2);
    EXPECT_EQ(c.opt.step(), 2);
    for (Training* tr : {&a, &b, &c}) {
      ASSERT_TRUE(tr->opt.Step().ok());
    }
    for (size_t i = 0; i < Cases().size(); ++i) {
      SCOPED_TRACE(::testing::Message()
                   << "rank " << rank << " " << Cases()[i].name);
      EXPECT_EQ(Bits(b.params[i].local()), Bits(a.params[i].local()));
      EXPECT_EQ(Bits(c.params[i].local()), Bits(a.params[i].local()));
    }
  });
}

TEST(AdamWTest, LoadStateDictRejectsBadDictsAndChangesNothing) {
  // Sends nothing: see optim/counting_groups.h.
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Training tr = MakeTraining(mesh, {P::Shard(0)});
    ASSERT_TRUE(tr.opt.Step().ok());
    const std::vector<uint32_t> m_before =
        Bits((*tr.opt.StateDict()).tensors.at("w.exp_avg").local());

    OptimizerStateDict missing = *tr.opt.StateDict();
    missing.tensors.erase("b.exp_avg_sq");
    absl::Status s = tr.opt.LoadStateDict(missing);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("b.exp_avg_sq"), std::string::npos) << s;

    OptimizerStateDict extra = *tr.opt.StateDict();
    extra.scalars["lr"] = 1;
    s = tr.opt.LoadStateDict(extra);
    EXPECT_NE(s.message().find("unexpected [lr]"), std::string::npos) << s;

    // A wrong shape placed before a good tensor: nothing is written.
    OptimizerStateDict shape = *tr.opt.StateDict();
    Tensor zeros = *Tensor::Zeros({5, 5}, DType::kF32, Device::Cpu());
    shape.tensors.at("w.exp_avg") =
        *DTensor::Distribute(zeros, &mesh, {P::Shard(0)});
    shape.scalars["step"] = 7;
    s = tr.opt.LoadStateDict(shape);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("w.exp_avg"), std::string::npos) << s;
    EXPECT_EQ(tr.opt.step(), 1);
    EXPECT_EQ(Bits((*tr.opt.StateDict()).tensors.at("w.exp_avg").local()),
              m_before);

    OptimizerStateDict negative = *tr.opt.StateDict();
    negative.scalars["step"] = -1;
    EXPECT_EQ(tr.opt.LoadStateDict(negative).code(),
              absl::StatusCode::kInvalidArgument);
  });
}

// ------------------------------------------------------- weight decay

TEST(AdamWTest, WeightDecaySelection) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    Training tr = MakeTraining(mesh, {P::Shard(0)});
    AdamWOptions o = Options();
    o.decay_filter = DecayMatricesOnly;
    std::vector<AdamWParam> list;
    for (size_t i = 0; i < Cases().size(); ++i) {
      list.push_back({Cases()[i].name, &tr.params[i], &tr.grads[i]});
    }
    list[2].weight_decay = false;  // Explicit group beats the filter.
    AdamW opt = *AdamW::Create(std::move(list), o);
    EXPECT_TRUE(*opt.DecaysWeight("w"));
    EXPECT_FALSE(*opt.DecaysWeight("b"));
    EXPECT_FALSE(*opt.DecaysWeight("tiny"));
    EXPECT_TRUE(*opt.DecaysWeight("big"));
    EXPECT_EQ(opt.DecaysWeight("nope").status().code(),
              absl::StatusCode::kNotFound);

    // With a zero gradient the Adam term vanishes (m = v = 0 gives
    // 0 / (0 + eps)), so only decayed params move, by exactly
    // p * (1 - lr * wd).
    for (DTensor& g : tr.grads) ASSERT_TRUE(Zero(g.mutable_local()).ok());
    std::vector<std::vector<float>> before;
    for (const DTensor& p : tr.params) before.push_back(*p.local().ToFloats());
    ASSERT_TRUE(opt.Step().ok());
    const float decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
    for (size_t i = 0; i < Cases().size(); ++i) {
      const bool decays = *opt.DecaysWeight(Cases()[i].name);
      std::vector<float> after = *tr.params[i].local().ToFloats();
      for (size_t j = 0; j < after.size(); ++j) {
        ASSERT_EQ(after[j], decays ? before[i][j] * decay : before[i][j])
            << Cases()[i].name << "[" << j << "]";
      }
    }
  });
}

// -------------------------------------------------------------- errors

TEST(AdamWTest, CreateRejectsBadOptionsAndParams) {
  testing_util::RunOnMesh({{"dp", 1}}, [](int, DeviceMesh& mesh) {
    DTensor p = *DTensor::Distribute(InitialParam(0), &mesh, {P::Shard(0)});
    DTensor g = p;
    for (auto bad : std::vector<std::function<void(AdamWOptions&)>>{
             [](AdamWOptions& o) { o.lr = -1; },
             [](AdamWOptions& o) { o.lr = std::nan(""); },
             [](AdamWOptions& o) { o.beta1 = 1.0; },
             [](AdamWOptions& o) { o.beta2 = -0.1; },
             [](AdamWOptions& o) { o.eps = -1e-8; },
             [](AdamWOptions& o) { o.weight_decay = -0.1; }}) {
      AdamWOptions o;
      bad(o);
      EXPECT_EQ(AdamW::Create({{"w", &p, &g}}, o).status().code(),
                absl::StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(AdamW::Create({{"w", &p, &g}, {"w", &p, &g}}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(AdamW::Create({{"", &p, &g}}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(AdamW::Create({{"w", nullptr, &g}}).status().code(),
              absl::StatusCode::kInvalidArgument);
    DTensor bf16 = *DTensor::Distribute(RandomTensor({4}, DType::kBF16, 1),
                                        &mesh, {P::Shard(0)});
    EXPECT_EQ(AdamW::Create({{"h", &bf16, &bf16}}).status().code(),
              absl::StatusCode::kInvalidArgument);
    AdamW opt = *AdamW::Create({{"w", &p, &g}});
    EXPECT_EQ(opt.SetLr(-1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(opt.SetStep(-1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(opt.SetStep(7).ok());
    EXPECT_EQ(opt.step(), 7);
    Tensor wrong = *Tensor::Zeros({3}, DType::kBF16, Device::Cpu());
    EXPECT_EQ(opt.SetComputeCopy("w", &wrong).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(opt.SetComputeCopy("x", &wrong).code(),
              absl::StatusCode::kNotFound);
  });
}

// Step(grad_scale) is clipping fused into the update: bit for bit the step
// on grads scaled first (as ClipGradNorm scales them), grads left alone.
TEST(AdamWTest, GradScaleEqualsScalingTheGradsFirstBitForBit) {
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Training fused = MakeTraining(mesh, {P::Shard(0)});
    Training scaled = MakeTraining(mesh, {P::Shard(0)});
    for (int t = 0; t < 3; ++t) {
      const float coef = t == 1 ? 1.0f : 0.3f + 0.2f * t;
      for (size_t i = 0; i < Cases().size(); ++i) {
        fused.grads[i] =
            *DTensor::Distribute(GradAt(i, t), &mesh, {P::Shard(0)});
        scaled.grads[i] =
            *DTensor::Distribute(GradAt(i, t), &mesh, {P::Shard(0)});
        ASSERT_TRUE(Scale(scaled.grads[i].local(), coef,
                          scaled.grads[i].mutable_local())
                        .ok());
      }
      const std::vector<uint32_t> grad_before = Bits(fused.grads[0].local());
      ASSERT_TRUE(fused.opt.Step(coef).ok());
      ASSERT_TRUE(scaled.opt.Step().ok());
      EXPECT_EQ(Bits(fused.grads[0].local()), grad_before) << "step " << t;
      for (size_t i = 0; i < Cases().size(); ++i) {
        ASSERT_EQ(Bits(fused.params[i].local()), Bits(scaled.params[i].local()))
            << Cases()[i].name << " step " << t;
      }
    }
    // Not finite or not positive: rejected, nothing stepped.
    for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      const absl::Status s = fused.opt.Step(bad);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(s.message().find("grad_scale"), std::string::npos) << s;
    }
    EXPECT_EQ(fused.opt.step(), 3);
  });
}

// Step(StepGuard) reads the loss and squared norm where they are: the same
// bits as Step(ClipCoefficient(sqrt(norm_sq), max_norm)), nothing updated
// for a non-finite value (the counter still advances), bad guards refused.
TEST(AdamWTest, GuardedStepEqualsTheClippedStepAndSkipsNonFinite) {
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Training guarded = MakeTraining(mesh, {P::Shard(0)});
    Training plain = MakeTraining(mesh, {P::Shard(0)});
    Tensor loss = *Tensor::FromFloats({1}, {2.5f});
    Tensor norm_sq = *Tensor::FromFloats({1}, {0.0f});
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    // (loss, norm_sq, max_norm): clipped, not clipped, no clipping, then
    // a NaN loss, an infinite norm and a NaN norm (skipped).
    const std::vector<std::array<float, 3>> steps = {
        {2.5f, 9.0f, 1.0f}, {2.5f, 0.25f, 1.0f}, {2.5f, 16.0f, 0.0f},
        {nan, 1.0f, 1.0f},  {2.5f, inf, 1.0f},   {2.5f, nan, 0.0f}};
    for (size_t t = 0; t < steps.size(); ++t) {
      const auto [l, n2, max_norm] = steps[t];
      for (size_t i = 0; i < Cases().size(); ++i) {
        for (Training* tr : {&guarded, &plain}) {
          tr->grads[i] = *DTensor::Distribute(GradAt(i, static_cast<int>(t)),
                                              &mesh, {P::Shard(0)});
        }
      }
      ASSERT_TRUE(Fill(&loss, l).ok());
      ASSERT_TRUE(Fill(&norm_sq, n2).ok());
      std::vector<std::vector<uint32_t>> before;
      for (const DTensor& p : guarded.params) before.push_back(Bits(p.local()));
      AdamW::StepGuard guard;
      guard.loss = &loss;
      guard.norm_sq = &norm_sq;
      guard.max_norm = max_norm;
      ASSERT_TRUE(guarded.opt.Step(guard).ok()) << "step " << t;
      EXPECT_EQ(guarded.opt.step(), static_cast<int64_t>(t + 1));
      const bool finite = std::isfinite(l) && std::isfinite(n2);
      for (size_t i = 0; i < Cases().size(); ++i) {
        if (!finite) {
          EXPECT_EQ(Bits(guarded.params[i].local()), before[i])
              << Cases()[i].name << " step " << t;
        }
      }
      if (!finite) {
        // The plain optimizer takes no step either; its counter follows.
        ASSERT_TRUE(plain.opt.SetStep(plain.opt.step() + 1).ok());
        continue;
      }
      const float coef = max_norm > 0
                             ? ClipCoefficient(std::sqrt(double{n2}), max_norm)
                             : 1.0f;
      EXPECT_EQ(coef < 1.0f, t == 0) << "step " << t;
      ASSERT_TRUE(plain.opt.Step(coef).ok());
      for (size_t i = 0; i < Cases().size(); ++i) {
        ASSERT_EQ(Bits(guarded.params[i].local()),
                  Bits(plain.params[i].local()))
            << Cases()[i].name << " step " << t;
      }
    }
    // Refused before anything changes: a missing tensor, two elements, an
    // integer tensor, a negative or infinite max_norm.
    Tensor two = *Tensor::FromFloats({2}, {1.0f, 1.0f});
    Tensor ints = *Tensor::FromInts({1}, {1});
    const int64_t steps_before = guarded.opt.step();
    for (const auto& [bad_loss, bad_norm, max_norm] :
         std::vector<std::tuple<const Tensor*, const Tensor*, double>>{
             {nullptr, &norm_sq, 1.0},
             {&loss, &two, 1.0},
             {&ints, &norm_sq, 1.0},
             {&loss, &norm_sq, -1.0},
             {&loss, &norm_sq, std::numeric_limits<double>::infinity()}}) {
      AdamW::StepGuard guard;
      guard.loss = bad_loss;
      guard.norm_sq = bad_norm;
      guard.max_norm = max_norm;
      const absl::Status s = guarded.opt.Step(guard);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("guard"), std::string::npos) << s;
    }
    EXPECT_EQ(guarded.opt.step(), steps_before);
  });
}

TEST(AdamWTest, StepRejectsMismatchedGradsAndChangesNothing) {
  // Sends nothing: see optim/counting_groups.h.
  testing_util::RunOnCountingMesh({{"dp", 2}}, [](int, DeviceMesh& mesh) {
    Training tr = MakeTraining(mesh, {P::Shard(0)});
    const std::vector<uint32_t> w_before = Bits(tr.params[0].local());
    // "b"'s grad replicated instead of sharded: rejected before "w" (listed
    // first) is touched.
    tr.grads[1] = *DTensor::Distribute(GradAt(1, 0), &mesh, {P::Replicate()});
    absl::Status s = tr.opt.Step();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("grad of 'b'"), std::string::npos) << s;
    EXPECT_EQ(tr.opt.step(), 0);
    EXPECT_EQ(Bits(tr.params[0].local()), w_before);
    // A bf16 grad.
    tr.grads[1] = *DTensor::Distribute(RandomTensor({5}, DType::kBF16, 3),
                                       &mesh, {P::Shard(0)});
    EXPECT_EQ(tr.opt.Step().code(), absl::StatusCode::kInvalidArgument);
    tr.grads[1] = *DTensor::Distribute(GradAt(1, 0), &mesh, {P::Shard(0)});
    EXPECT_TRUE(tr.opt.Step().ok());
    EXPECT_EQ(tr.opt.step(), 1);
  });
}

}  // namespace
}  // namespace fsdpp
