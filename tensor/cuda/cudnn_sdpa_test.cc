// Tests of the cuDNN SDPA graphs, plans and executions (cudnn_sdpa.h).
//
// Without a GPU cuDNN still finalizes tensor and operation descriptors
// (each operation checks its tensors' ranks, broadcasts and matmul dims)
// and, from 9.8, whole operation graphs: so the graph building runs for real
// everywhere, over MHA, GQA and MQA, bf16 and f16, contiguous tensors and
// views of a fused QKV buffer, and T not a multiple of 64; the builder's own
// dataflow check (one producer per intermediate) runs with it. So do the
// shape checks (InvalidArgument before any cuDNN call) and the Stats/LSE
// contract as far as the graph states it.
//
// Plans and executions need a device; those tests skip visibly in SetUp
// without one and are complete for a GPU machine: forward O and Stats, and
// the backward's dQ, dK, dV, against fsdpp's own CausalAttention /
// CausalAttentionBackward on the CPU (tensor/ops.h), the deterministic
// backward bit-identical over two runs, and the plan cache.
#include "tensor/cuda/cudnn_sdpa.h"

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/cuda_runtime.h"
#include "core/dtype.h"
#include "core/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensor/cuda/cudnn_util.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace gpu {
namespace {

using ::testing::HasSubstr;
using testing_util::AllClose;
using testing_util::RandomTensor;
using testing_util::Values;

// One attention shape; `fused` lays q, k and v out as views of one
// [B, T, H + 2 Hkv, D] projection buffer and o as [B, T, H, D] (what the
// attention layer produces and consumes), else all are contiguous BHTD.
struct Case {
  std::string name;
  int64_t b, h, hkv, t, d;
  DType dtype;
  bool fused;
};

std::vector<Case> Cases() {
  return {
      {"mha_bf16", 2, 4, 4, 64, 64, DType::kBF16, false},
      {"gqa_bf16_t100", 1, 8, 2, 100, 64, DType::kBF16, false},
      {"mha_f16_fused_t37", 2, 3, 3, 37, 32, DType::kF16, true},
      {"gqa_bf16_fused_t130_d128", 2, 6, 2, 130, 128, DType::kBF16, true},
      {"mqa_f16_t65", 1, 4, 1, 65, 16, DType::kF16, false},
  };
}

int64_t RowHeads(const Case& c) { return c.h + 2 * c.hkv; }

SdpaShape ShapeFor(const Case& c) {
  SdpaShape s;
  s.dtype = c.dtype;
  if (c.fused) {
    s.q = BthdTensor(c.b, c.h, c.t, c.d, RowHeads(c));
    s.k = BthdTensor(c.b, c.hkv, c.t, c.d, RowHeads(c));
    s.v = s.k;
    s.o = BthdTensor(c.b, c.h, c.t, c.d, c.h);
  } else {
    s.q = BhtdTensor(c.b, c.h, c.t, c.d);
    s.k = BhtdTensor(c.b, c.hkv, c.t, c.d);
    s.v = s.k;
    s.o = s.q;
  }
  return s;
}

// Gradients laid out like their tensors (dQKV fused when QKV is).
SdpaBackwardShape BackwardShapeFor(const Case& c, bool deterministic) {
  SdpaBackwardShape s;
  s.forward = ShapeFor(c);
  s.d_o = s.forward.o;
  s.d_q = s.forward.q;
  s.d_k = s.forward.k;
  s.d_v = s.forward.v;
  s.deterministic = deterministic;
  return s;
}

// A finalized tensor descriptor's attributes, read back from cuDNN.
struct TensorAttributes {
  cudnnDataType_t type;
  std::vector<int64_t> dims, strides;
  int64_t uid;
  bool is_virtual;
};

TensorAttributes Read(cudnnBackendDescriptor_t t) {
  TensorAttributes a{};
  int64_t n = 0;
  a.dims.resize(8);
  a.strides.resize(8);
  EXPECT_EQ(cudnnBackendGetAttribute(t, CUDNN_ATTR_TENSOR_DATA_TYPE,
                                     CUDNN_TYPE_DATA_TYPE, 1, &n, &a.type),
            CUDNN_STATUS_SUCCESS);
  EXPECT_EQ(cudnnBackendGetAttribute(t, CUDNN_ATTR_TENSOR_DIMENSIONS,
                                     CUDNN_TYPE_INT64, 8, &n, a.dims.data()),
            CUDNN_STATUS_SUCCESS);
  a.dims.resize(n);
  EXPECT_EQ(cudnnBackendGetAttribute(t, CUDNN_ATTR_TENSOR_STRIDES,
                                     CUDNN_TYPE_INT64, 8, &n, a.strides.data()),
            CUDNN_STATUS_SUCCESS);
  a.strides.resize(n);
  EXPECT_EQ(cudnnBackendGetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID,
                                     CUDNN_TYPE_INT64, 1, &n, &a.uid),
            CUDNN_STATUS_SUCCESS);
  EXPECT_EQ(cudnnBackendGetAttribute(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                                     CUDNN_TYPE_BOOLEAN, 1, &n, &a.is_virtual),
            CUDNN_STATUS_SUCCESS);
  return a;
}

std::vector<int64_t> V(const std::array<int64_t, 4>& a) {
  return std::vector<int64_t>(a.begin(), a.end());
}

// Expects the graph's tensor `uid` to be the non-virtual `view` of `type`.
void ExpectBound(const SdpaGraph& graph, SdpaUid uid, cudnnDataType_t type,
                 const SdpaTensor& view) {
  cudnnBackendDescriptor_t t = graph.tensor(uid);
  ASSERT_NE(t, nullptr) << "uid " << static_cast<int64_t>(uid);
  TensorAttributes a = Read(t);
  EXPECT_EQ(a.uid, static_cast<int64_t>(uid));
  EXPECT_EQ(a.type, type);
  EXPECT_EQ(a.dims, V(view.dims));
  EXPECT_EQ(a.strides, V(view.strides));
  EXPECT_FALSE(a.is_virtual);
}

SdpaTensor TransposedView(SdpaTensor t) {
  std::swap(t.dims[2], t.dims[3]);
  std::swap(t.strides[2], t.strides[3]);
  return t;
}

cudnnDataType_t IoType(DType dtype) {
  return dtype == DType::kF16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
}

// Finalizes the operation graph without a handle where cuDNN allows it.
void ExpectOperationGraphFinalizes(const SdpaGraph& graph) {
  if (graph.traits().graph_needs_handle) {
    GTEST_SKIP() << "cuDNN " << graph.traits().version
                 << " needs a handle to finalize an operation graph";
  }
  absl::StatusOr<CudnnDescriptor> op_graph = graph.MakeOperationGraph(nullptr);
  ASSERT_TRUE(op_graph.ok()) << op_graph.status() << "\n"
                             << graph.DebugString();
}

// ------------------------------------------------------------ no device

class SdpaGraphTest : public ::testing::TestWithParam<Case> {};

TEST_P(SdpaGraphTest, ForwardFinalizesEveryDescriptor) {
  const Case& c = GetParam();
  const SdpaShape shape = ShapeFor(c);
  absl::StatusOr<SdpaGraph> graph = BuildSdpaForward(shape);
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ(graph->kind(), SdpaGraph::Kind::kForward);
  // bmm1, scale, 4 mask ops, max, sub, exp, sum, log, stats, div, bmm2.
  EXPECT_EQ(graph->num_operations(), 14) << graph->DebugString();
  EXPECT_EQ(graph->intermediate_bytes(), 0);
  const cudnnDataType_t io = IoType(c.dtype);
  ExpectBound(*graph, SdpaUid::kQ, io, shape.q);
  ExpectBound(*graph, SdpaUid::kK, io, TransposedView(shape.k));
  ExpectBound(*graph, SdpaUid::kV, io, shape.v);
  ExpectBound(*graph, SdpaUid::kO, io, shape.o);
  ExpectBound(*graph, SdpaUid::kStats, CUDNN_DATA_FLOAT,
              SdpaStatsTensor(shape));
  EXPECT_EQ(graph->tensor(SdpaUid::kDQ), nullptr);
  ExpectOperationGraphFinalizes(*graph);
}

TEST_P(SdpaGraphTest, BackwardFinalizesEveryDescriptor) {
  const Case& c = GetParam();
  for (bool deterministic : {true, false}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "non-deterministic");
    const SdpaBackwardShape shape = BackwardShapeFor(c, deterministic);
    absl::StatusOr<SdpaGraph> graph = BuildSdpaBackward(shape);
    ASSERT_TRUE(graph.ok()) << graph.status();
    EXPECT_EQ(graph->kind(), SdpaGraph::Kind::kBackward);
    EXPECT_EQ(graph->deterministic(), deterministic);
    // 3 for softmax_sum, q@k^T, scale, sub stats, 4 mask ops, exp, reshape,
    // d_v (+ its reduction for GQA), d_o@v^T, 3 for ds, reshape, d_k (+
    // reduction), reshape k, d_q (+ identity when non-deterministic).
    const int64_t gqa = c.hkv < c.h ? 2 : 0;
    EXPECT_EQ(graph->num_operations(), 21 + gqa + (deterministic ? 0 : 1))
        << graph->DebugString();
    // softmax_sum [B, H, T, 1] f32, and the f32 dQ accumulator when the
    // backward may use atomics, each rounded up to 256 bytes.
    auto round = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    int64_t expected = round(c.b * c.h * c.t * 4);
    if (!deterministic) expected += round(c.b * c.h * c.t * c.d * 4);
    EXPECT_EQ(graph->intermediate_bytes(), expected);
    const cudnnDataType_t io = IoType(c.dtype);
    ExpectBound(*graph, SdpaUid::kQ, io, shape.forward.q);
    ExpectBound(*graph, SdpaUid::kK, io, TransposedView(shape.forward.k));
    ExpectBound(*graph, SdpaUid::kV, io, TransposedView(shape.forward.v));
    ExpectBound(*graph, SdpaUid::kO, io, shape.forward.o);
    ExpectBound(*graph, SdpaUid::kStats, CUDNN_DATA_FLOAT,
                SdpaStatsTensor(shape.forward));
    ExpectBound(*graph, SdpaUid::kDO, io, shape.d_o);
    ExpectBound(*graph, SdpaUid::kDQ, io, shape.d_q);
    ExpectBound(*graph, SdpaUid::kDK, io, shape.d_k);
    ExpectBound(*graph, SdpaUid::kDV, io, shape.d_v);
    const std::string debug = graph->DebugString();
    if (deterministic) {
      EXPECT_THAT(debug, HasSubstr("d_q: matmul(ds, k) -> d_q"));
    } else {
      EXPECT_THAT(debug, HasSubstr("d_q: identity(d_q accumulator) -> d_q"));
    }
    ExpectOperationGraphFinalizes(*graph);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SdpaGraphTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// Stats is the natural-log log-sum-exp of the scaled, masked scores, laid
// out as fsdpp's lse [B, H, T] f32 (so no conversion), and the backward
// recomputes P = exp(scale s - Stats) from it, as the CPU kernels do.
TEST(SdpaStatsTest, StatsIsFsdppLse) {
  const Case c = Cases()[1];
  const SdpaShape shape = ShapeFor(c);
  const SdpaTensor stats = SdpaStatsTensor(shape);
  EXPECT_EQ(V(stats.dims), (std::vector<int64_t>{c.b, c.h, c.t, 1}));
  // Contiguous [B, H, T]: element (b, h, t) at (b H + h) T + t.
  EXPECT_EQ(V(stats.strides), (std::vector<int64_t>{c.h * c.t, c.t, 1, 1}));

  absl::StatusOr<SdpaGraph> forward = BuildSdpaForward(shape);
  ASSERT_TRUE(forward.ok()) << forward.status();
  const std::string f = forward->DebugString();
  EXPECT_THAT(f, HasSubstr("scaled: mul(s, scale) -> scaled"));
  EXPECT_THAT(f, HasSubstr("masked: binary_select(scaled, mask_value, "
                           "row>=col) -> masked"));
  EXPECT_THAT(f, HasSubstr("max: reduce_max(masked) -> max"));
  EXPECT_THAT(f, HasSubstr("sub: sub(masked, max) -> sub"));
  EXPECT_THAT(f, HasSubstr("exp: exp(sub) -> exp"));
  EXPECT_THAT(f, HasSubstr("sum: reduce_add(exp) -> sum"));
  EXPECT_THAT(f, HasSubstr("log: log(sum) -> log"));  // natural log
  EXPECT_THAT(f, HasSubstr("stats: add(max, log) -> stats"));

  absl::StatusOr<SdpaGraph> backward =
      BuildSdpaBackward(BackwardShapeFor(c, true));
  ASSERT_TRUE(backward.ok()) << backward.status();
  const std::string b = backward->DebugString();
  EXPECT_THAT(b, HasSubstr("shifted: sub(scaled, stats) -> shifted"));
  EXPECT_THAT(b, HasSubstr("p: exp(masked) -> p"));

  // And fsdpp's lse is that function of the scores: check the CPU op on a
  // small case against log(sum_j<=i exp(scale q_i . k_j)) in double.
  const int64_t t = 5, d = 8;
  Tensor q = RandomTensor({1, 1, t, d}, DType::kF32, 1);
  Tensor k = RandomTensor({1, 1, t, d}, DType::kF32, 2);
  Tensor v = RandomTensor({1, 1, t, d}, DType::kF32, 3);
  absl::StatusOr<Tensor> out =
      Tensor::Empty({1, 1, t, d}, DType::kF32, Device::Cpu());
  absl::StatusOr<Tensor> lse =
      Tensor::Empty({1, 1, t}, DType::kF32, Device::Cpu());
  ASSERT_TRUE(out.ok() && lse.ok());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  ASSERT_TRUE(CausalAttention(q, k, v, scale, &*out, &*lse).ok());
  const std::vector<double> qv = Values(q), kv = Values(k);
  std::vector<double> expected(t);
  for (int64_t i = 0; i < t; ++i) {
    double sum = 0.0;
    for (int64_t j = 0; j <= i; ++j) {
      double s = 0.0;
      for (int64_t e = 0; e < d; ++e) s += qv[i * d + e] * kv[j * d + e];
      sum += std::exp(scale * s);
    }
    expected[i] = std::log(sum);
  }
  EXPECT_TRUE(AllClose(Values(*lse), expected, 1e-5, 1e-5));
}

// ------------------------------------------------ refused before cuDNN

// The build refuses `shape` with InvalidArgument mentioning `text`, and it
// is the shape check's own status (so no cuDNN call made it).
void ExpectForwardRefused(const SdpaShape& shape, const std::string& text) {
  absl::StatusOr<SdpaGraph> graph = BuildSdpaForward(shape);
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(graph.status().message()), HasSubstr(text));
  EXPECT_EQ(graph.status(), ValidateSdpaShape(shape));
}

void ExpectBackwardRefused(const SdpaBackwardShape& shape,
                           const std::string& text) {
  absl::StatusOr<SdpaGraph> graph = BuildSdpaBackward(shape);
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(graph.status().message()), HasSubstr(text));
  EXPECT_EQ(graph.status(), ValidateSdpaBackwardShape(shape));
}

Case Base() { return Cases()[0]; }

TEST(SdpaShapeTest, RefusesHeadDimOverTheLimit) {
  Case c = Base();
  c.d = 2 * kSdpaMaxHeadDim;
  ExpectForwardRefused(ShapeFor(c), "head dim 256 is not supported");
  c.d = 60;  // not a multiple of 8
  ExpectForwardRefused(ShapeFor(c), "head dim 60 is not supported");
}

TEST(SdpaShapeTest, RefusesHeadsNotAMultipleOfKvHeads) {
  Case c = Base();
  c.h = 6;
  c.hkv = 4;
  ExpectForwardRefused(ShapeFor(c), "q's 6 heads must be a multiple of k's 4");
}

TEST(SdpaShapeTest, RefusesFloat32) {
  Case c = Base();
  c.dtype = DType::kF32;
  ExpectForwardRefused(ShapeFor(c), "dtype f32 is not supported");
}

TEST(SdpaShapeTest, RefusesMismatchedShapes) {
  SdpaShape s = ShapeFor(Base());
  s.k = BhtdTensor(2, 4, 32, 64);  // T differs from q's
  ExpectForwardRefused(s, "k dims [2, 4, 32, 64] must be [B, Hkv, T, D]");
  s = ShapeFor(Base());
  s.v = BhtdTensor(2, 2, 64, 64);
  ExpectForwardRefused(s, "v dims [2, 2, 64, 64] must equal k dims");
  s = ShapeFor(Base());
  s.o = BhtdTensor(2, 4, 64, 32);
  ExpectForwardRefused(s, "o dims [2, 4, 64, 32] must equal q dims");
  SdpaBackwardShape b = BackwardShapeFor(Base(), true);
  b.d_k = BhtdTensor(2, 2, 64, 64);
  ExpectBackwardRefused(b, "d_k dims [2, 2, 64, 64] must equal k dims");
  b = BackwardShapeFor(Base(), true);
  b.d_o = BhtdTensor(1, 4, 64, 64);
  ExpectBackwardRefused(b, "d_o dims [1, 4, 64, 64] must equal q dims");
}

TEST(SdpaShapeTest, RefusesBadStridesAndScales) {
  SdpaShape s = ShapeFor(Base());
  s.q.strides = {4 * 64 * 64, 64, 4 * 64, 2};  // head dim not contiguous
  ExpectForwardRefused(s, "last stride 1");
  s = ShapeFor(Base());
  s.k.strides[2] = 68;  // rows not 16-byte aligned in bf16
  ExpectForwardRefused(s, "multiples of 8 elements");
  s = ShapeFor(Base());
  s.q.dims[0] = 0;
  ExpectForwardRefused(s, "must all be positive");
  s = ShapeFor(Base());
  s.scale = -1.0f;
  ExpectForwardRefused(s, "scale -1 must be finite and positive");
  s.scale = std::numeric_limits<float>::quiet_NaN();
  ExpectForwardRefused(s, "must be finite and positive");
}

TEST(SdpaShapeTest, BackwardRefusesOneToken) {
  Case c = Base();
  c.t = 1;
  EXPECT_TRUE(ValidateSdpaShape(ShapeFor(c)).ok());
  ExpectBackwardRefused(BackwardShapeFor(c, true), "sequence length 1");
}

TEST(SdpaShapeTest, DefaultScaleIsOneOverSqrtHeadDim) {
  SdpaShape s = ShapeFor(Base());
  EXPECT_FLOAT_EQ(SdpaScale(s), 0.125f);
  s.scale = 0.5f;
  EXPECT_FLOAT_EQ(SdpaScale(s), 0.5f);
}

TEST(SdpaShapeTest, FusedViewsStepThroughOneBuffer) {
  // [B=2, T=3, 3, H=4, D=8]: q, k, v start 32 elements apart, a token row
  // is 96 elements, a batch 288.
  const SdpaTensor q = BthdTensor(2, 4, 3, 8, 12);
  EXPECT_EQ(V(q.dims), (std::vector<int64_t>{2, 4, 3, 8}));
  EXPECT_EQ(V(q.strides), (std::vector<int64_t>{288, 8, 96, 1}));
}

// ------------------------------------------------- versions and status

TEST(SdpaVersionTest, TraitsFollowTheRunningCudnn) {
  const SdpaBackendTraits old = SdpaTraitsFor(90500);
  EXPECT_EQ(old.mask_value, std::numeric_limits<float>::lowest());
  EXPECT_TRUE(old.zero_dq_accumulator);
  EXPECT_TRUE(old.graph_needs_handle);
  const SdpaBackendTraits now = SdpaTraitsFor(91900);
  EXPECT_EQ(now.mask_value, -std::numeric_limits<float>::infinity());
  EXPECT_FALSE(now.zero_dq_accumulator);
  EXPECT_FALSE(now.graph_needs_handle);
  EXPECT_FALSE(now.backward_broken);
  EXPECT_TRUE(SdpaTraitsFor(91001).backward_broken);

  EXPECT_EQ(CheckSdpaCudnnVersion(80906, false).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(CheckSdpaCudnnVersion(91000, false).ok());
  EXPECT_THAT(std::string(CheckSdpaCudnnVersion(91000, true).message()),
              HasSubstr("9.10.0 has known bugs"));
  EXPECT_TRUE(CheckSdpaCudnnVersion(91900, true).ok());

  absl::StatusOr<SdpaGraph> graph = BuildSdpaForward(ShapeFor(Base()));
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ(graph->traits().version, cudnnGetVersion());
  std::cout << "cuDNN " << cudnnGetVersion()
            << ": composite SDPA graph (the unified SDPA operation has no "
               "causal mask before 9.21)\n";
}

TEST(CudnnStatusTest, NamesTheCallAndTheStatus) {
  EXPECT_TRUE(CudnnStatus(CUDNN_STATUS_SUCCESS, "x").ok());
  absl::Status bad = CudnnStatus(CUDNN_STATUS_BAD_PARAM, "cudnnFoo(a, b)");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cudnnFoo(a, b)"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("CUDNN_STATUS_BAD_PARAM"));
  EXPECT_EQ(CudnnStatus(CUDNN_STATUS_NOT_SUPPORTED_SHAPE, "f").code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(
      CudnnStatus(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED, "f")
          .code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudnnStatus(CUDNN_STATUS_EXECUTION_FAILED, "f").code(),
            absl::StatusCode::kInternal);

  // A real refusal: a tensor descriptor finalized with no dims.
  absl::StatusOr<CudnnDescriptor> t =
      CudnnDescriptor::Create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::Status s = CudnnStatus(cudnnBackendFinalize(t->get()),
                               "cudnnBackendFinalize(tensor)");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("cudnnBackendFinalize"));
}

// ------------------------------------------------------- on a device

// Device memory freed with the object.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) CHECK_OK(CudaStatus(cudaMalloc(&ptr_, bytes), "cudaMalloc"));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  char* bytes() const { return static_cast<char*>(ptr_); }
  size_t size() const { return bytes_; }
  void Upload(const std::vector<uint16_t>& host) {
    CHECK_OK(CudaStatus(
        cudaMemcpy(ptr_, host.data(), host.size() * 2, cudaMemcpyHostToDevice),
        "cudaMemcpy"));
  }
  template <typename T>
  std::vector<T> Download(size_t offset_bytes, size_t count) const {
    std::vector<T> host(count);
    CHECK_OK(CudaStatus(cudaMemcpy(host.data(), bytes() + offset_bytes,
                                   count * sizeof(T), cudaMemcpyDeviceToHost),
                        "cudaMemcpy"));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Elements (16-bit) a view spans from its first element.
int64_t Span(const SdpaTensor& t) {
  int64_t last = 0;
  for (int i = 0; i < 4; ++i) last += (t.dims[i] - 1) * t.strides[i];
  return last + 1;
}

// Copies contiguous [B, N, T, D] 16-bit `src` into `view` of `dst` starting
// at element `base`, or back (Gather).
void Scatter(const Tensor& src, const SdpaTensor& view, int64_t base,
             std::vector<uint16_t>* dst) {
  const uint16_t* s = static_cast<const uint16_t*>(src.raw_data());
  int64_t i = 0;
  for (int64_t b = 0; b < view.dims[0]; ++b)
    for (int64_t n = 0; n < view.dims[1]; ++n)
      for (int64_t t = 0; t < view.dims[2]; ++t)
        for (int64_t d = 0; d < view.dims[3]; ++d) {
          (*dst)[base + b * view.strides[0] + n * view.strides[1] +
                 t * view.strides[2] + d] = s[i++];
        }
}

Tensor Gather(const std::vector<uint16_t>& src, const SdpaTensor& view,
              int64_t base, DType dtype) {
  absl::StatusOr<Tensor> out =
      Tensor::Empty({view.dims[0], view.dims[1], view.dims[2], view.dims[3]},
                    dtype, Device::Cpu());
  CHECK_OK(out.status());
  uint16_t* o = static_cast<uint16_t*>(out->raw_data());
  int64_t i = 0;
  for (int64_t b = 0; b < view.dims[0]; ++b)
    for (int64_t n = 0; n < view.dims[1]; ++n)
      for (int64_t t = 0; t < view.dims[2]; ++t)
        for (int64_t d = 0; d < view.dims[3]; ++d) {
          o[i++] = src[base + b * view.strides[0] + n * view.strides[1] +
                       t * view.strides[2] + d];
        }
  return *std::move(out);
}

// Where q, k and v (or their gradients) live: one fused buffer, or three.
struct QkvLayout {
  int64_t q_base, k_base, v_base;  // element offsets into `elements`
  int64_t elements;
};

QkvLayout LayoutFor(const Case& c, const SdpaShape& s) {
  if (c.fused) {
    const int64_t span = c.b * c.t * RowHeads(c) * c.d;
    return {0, c.h * c.d, (c.h + c.hkv) * c.d, span};
  }
  const int64_t q = Span(s.q), k = Span(s.k);
  return {0, q, q + k, q + 2 * k};
}

// Relative tolerance per storage type: cuDNN rounds P and dS to the storage
// type before their matmuls, the CPU reference keeps them in f32.
double Tol(DType dtype) { return dtype == DType::kBF16 ? 2e-2 : 5e-3; }

double MaxAbs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Within `tol` relative, plus `tol` of the largest reference value.
::testing::AssertionResult Close(const Tensor& actual, const Tensor& expected,
                                 double tol) {
  const std::vector<double> e = Values(expected);
  return AllClose(Values(actual), e, tol, tol * std::max(MaxAbs(e), 1e-3));
}

class SdpaDeviceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device: plans and executions need a GPU";
    }
    ASSERT_EQ(cudnnCreate(&handle_), CUDNN_STATUS_SUCCESS);
    ASSERT_TRUE(
        CudaStatus(cudaStreamCreate(&stream_), "cudaStreamCreate").ok());
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (handle_ != nullptr) cudnnDestroy(handle_);
  }

  // The CPU reference forward and the inputs it saw.
  struct Reference {
    Tensor q, k, v, out, lse;
  };
  Reference CpuForward(const Case& c, uint64_t seed) {
    Reference r;
    r.q = RandomTensor({c.b, c.h, c.t, c.d}, c.dtype, seed);
    r.k = RandomTensor({c.b, c.hkv, c.t, c.d}, c.dtype, seed + 1);
    r.v = RandomTensor({c.b, c.hkv, c.t, c.d}, c.dtype, seed + 2);
    absl::StatusOr<Tensor> out =
        Tensor::Empty({c.b, c.h, c.t, c.d}, c.dtype, Device::Cpu());
    absl::StatusOr<Tensor> lse =
        Tensor::Empty({c.b, c.h, c.t}, DType::kF32, Device::Cpu());
    CHECK_OK(out.status());
    CHECK_OK(lse.status());
    CHECK_OK(CausalAttention(r.q, r.k, r.v,
                             1.0f / std::sqrt(static_cast<float>(c.d)), &*out,
                             &*lse));
    r.out = *std::move(out);
    r.lse = *std::move(lse);
    return r;
  }

  // A backward's inputs staged on the device from the reference forward and
  // `d_out` (q, k, v and dq, dk, dv in one buffer each, laid out as the case
  // says), and the pointers Execute takes.
  struct BackwardBuffers {
    BackwardBuffers(const Case& c, const SdpaBackwardShape& shape,
                    const Reference& ref, const Tensor& d_out)
        : layout(LayoutFor(c, shape.forward)),
          qkv(layout.elements * 2),
          o(Span(shape.forward.o) * 2),
          d_o(Span(shape.d_o) * 2),
          stats(ref.lse.nbytes()),
          d_qkv(layout.elements * 2) {
      std::vector<uint16_t> qkv_host(layout.elements, 0),
          o_host(Span(shape.forward.o), 0), do_host(Span(shape.d_o), 0);
      Scatter(ref.q, shape.forward.q, layout.q_base, &qkv_host);
      Scatter(ref.k, shape.forward.k, layout.k_base, &qkv_host);
      Scatter(ref.v, shape.forward.v, layout.v_base, &qkv_host);
      Scatter(ref.out, shape.forward.o, 0, &o_host);
      Scatter(d_out, shape.d_o, 0, &do_host);
      qkv.Upload(qkv_host);
      o.Upload(o_host);
      d_o.Upload(do_host);
      CHECK_OK(CudaStatus(cudaMemcpy(stats.get(), ref.lse.raw_data(),
                                     ref.lse.nbytes(), cudaMemcpyHostToDevice),
                          "cudaMemcpy"));
      pointers.q = qkv.bytes() + layout.q_base * 2;
      pointers.k = qkv.bytes() + layout.k_base * 2;
      pointers.v = qkv.bytes() + layout.v_base * 2;
      pointers.o = o.get();
      pointers.stats = static_cast<float*>(stats.get());
      pointers.d_o = d_o.get();
      pointers.d_q = d_qkv.bytes() + layout.q_base * 2;
      pointers.d_k = d_qkv.bytes() + layout.k_base * 2;
      pointers.d_v = d_qkv.bytes() + layout.v_base * 2;
    }
    QkvLayout layout;
    DeviceBuffer qkv, o, d_o, stats, d_qkv;
    SdpaPointers pointers;
  };

  // Runs `plan` after checking its workspace; synchronizes.
  void Run(const SdpaPlan& plan, const SdpaPointers& p) {
    DeviceBuffer workspace(plan.workspace_bytes());
    ASSERT_TRUE(plan.Execute(handle_, p, workspace.get(), stream_).ok());
    ASSERT_TRUE(
        CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")
            .ok());
  }

  cudnnHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

TEST_P(SdpaDeviceTest, ForwardMatchesCpuReference) {
  const Case& c = GetParam();
  const SdpaShape shape = ShapeFor(c);
  absl::StatusOr<SdpaGraph> graph = BuildSdpaForward(shape);
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<std::unique_ptr<SdpaPlan>> plan =
      SdpaPlan::Create(handle_, *std::move(graph));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::cout << c.name << ": engine " << (*plan)->engine_index() << ", "
            << (*plan)->workspace_bytes() << " workspace bytes\n";

  const Reference ref = CpuForward(c, 10);
  const QkvLayout in = LayoutFor(c, shape);
  std::vector<uint16_t> host(in.elements, 0);
  Scatter(ref.q, shape.q, in.q_base, &host);
  Scatter(ref.k, shape.k, in.k_base, &host);
  Scatter(ref.v, shape.v, in.v_base, &host);
  DeviceBuffer qkv(host.size() * 2), o(Span(shape.o) * 2),
      stats(c.b * c.h * c.t * sizeof(float));
  qkv.Upload(host);
  SdpaPointers p;
  p.q = qkv.bytes() + in.q_base * 2;
  p.k = qkv.bytes() + in.k_base * 2;
  p.v = qkv.bytes() + in.v_base * 2;
  p.o = o.get();
  p.stats = static_cast<float*>(stats.get());
  Run(**plan, p);

  const Tensor out =
      Gather(o.Download<uint16_t>(0, Span(shape.o)), shape.o, 0, c.dtype);
  EXPECT_TRUE(Close(out, ref.out, Tol(c.dtype)));
  const std::vector<float> lse = stats.Download<float>(0, c.b * c.h * c.t);
  EXPECT_TRUE(AllClose(std::vector<double>(lse.begin(), lse.end()),
                       Values(ref.lse), 1e-3, 1e-3))
      << "Stats against fsdpp's lse";
}

// dQ, dK, dV against CausalAttentionBackward, from the reference forward's
// out and lse; both dQ forms.
TEST_P(SdpaDeviceTest, BackwardMatchesCpuReference) {
  const Case& c = GetParam();
  const Reference ref = CpuForward(c, 20);
  const Tensor d_out = RandomTensor({c.b, c.h, c.t, c.d}, c.dtype, 30);
  absl::StatusOr<Tensor> dq =
      Tensor::Empty({c.b, c.h, c.t, c.d}, c.dtype, Device::Cpu());
  absl::StatusOr<Tensor> dk =
      Tensor::Empty({c.b, c.hkv, c.t, c.d}, c.dtype, Device::Cpu());
  absl::StatusOr<Tensor> dv =
      Tensor::Empty({c.b, c.hkv, c.t, c.d}, c.dtype, Device::Cpu());
  ASSERT_TRUE(dq.ok() && dk.ok() && dv.ok());
  ASSERT_TRUE(CausalAttentionBackward(
                  ref.q, ref.k, ref.v, ref.out, ref.lse, d_out,
                  1.0f / std::sqrt(static_cast<float>(c.d)), &*dq, &*dk, &*dv)
                  .ok());

  for (bool deterministic : {true, false}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "non-deterministic");
    const SdpaBackwardShape shape = BackwardShapeFor(c, deterministic);
    absl::StatusOr<SdpaGraph> graph = BuildSdpaBackward(shape);
    ASSERT_TRUE(graph.ok()) << graph.status();
    absl::StatusOr<std::unique_ptr<SdpaPlan>> plan =
        SdpaPlan::Create(handle_, *std::move(graph));
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::cout << c.name << (deterministic ? " deterministic" : "")
              << " backward: engine " << (*plan)->engine_index() << ", "
              << (*plan)->workspace_bytes() << " workspace bytes\n";

    const BackwardBuffers b(c, shape, ref, d_out);
    Run(**plan, b.pointers);

    const std::vector<uint16_t> grads =
        b.d_qkv.Download<uint16_t>(0, b.layout.elements);
    const QkvLayout& in = b.layout;
    const double tol = Tol(c.dtype);
    EXPECT_TRUE(Close(Gather(grads, shape.d_q, in.q_base, c.dtype), *dq, tol))
        << "dQ";
    EXPECT_TRUE(Close(Gather(grads, shape.d_k, in.k_base, c.dtype), *dk, tol))
        << "dK";
    EXPECT_TRUE(Close(Gather(grads, shape.d_v, in.v_base, c.dtype), *dv, tol))
        << "dV";
  }
}

// fsdpp promises bit-identical reruns: two deterministic backwards (outputs
// poisoned in between) write the same bytes.
TEST_P(SdpaDeviceTest, DeterministicBackwardIsBitIdentical) {
  const Case& c = GetParam();
  const SdpaBackwardShape shape = BackwardShapeFor(c, true);
  absl::StatusOr<SdpaGraph> graph = BuildSdpaBackward(shape);
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<std::unique_ptr<SdpaPlan>> plan =
      SdpaPlan::Create(handle_, *std::move(graph));
  ASSERT_TRUE(plan.ok()) << plan.status();

  const Reference ref = CpuForward(c, 40);
  const Tensor d_out = RandomTensor({c.b, c.h, c.t, c.d}, c.dtype, 50);
  const BackwardBuffers buffers(c, shape, ref, d_out);
  const QkvLayout& in = buffers.layout;
  const DeviceBuffer& d_qkv = buffers.d_qkv;

  std::vector<std::vector<uint16_t>> runs;
  for (int run = 0; run < 2; ++run) {
    ASSERT_TRUE(
        CudaStatus(cudaMemset(d_qkv.get(), run == 0 ? 0 : 0x7f, d_qkv.size()),
                   "cudaMemset")
            .ok());
    Run(**plan, buffers.pointers);
    runs.push_back(d_qkv.Download<uint16_t>(0, in.elements));
  }
  // Compare only the gradient views (a fused buffer's gaps keep the fill).
  for (const auto& [view, base] : {std::make_pair(shape.d_q, in.q_base),
                                   std::make_pair(shape.d_k, in.k_base),
                                   std::make_pair(shape.d_v, in.v_base)}) {
    const Tensor a = Gather(runs[0], view, base, c.dtype);
    const Tensor b = Gather(runs[1], view, base, c.dtype);
    EXPECT_TRUE(testing_util::BitwiseEqual(a, b));
  }
}

TEST_P(SdpaDeviceTest, CacheBuildsOncePerShape) {
  const Case& c = GetParam();
  SdpaPlanCache cache(handle_);
  absl::StatusOr<const SdpaPlan*> a = cache.Forward(ShapeFor(c));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<const SdpaPlan*> again = cache.Forward(ShapeFor(c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*a, *again);
  EXPECT_EQ(cache.size(), 1);
  absl::StatusOr<const SdpaPlan*> det =
      cache.Backward(BackwardShapeFor(c, true));
  absl::StatusOr<const SdpaPlan*> nondet =
      cache.Backward(BackwardShapeFor(c, false));
  ASSERT_TRUE(det.ok()) << det.status();
  ASSERT_TRUE(nondet.ok()) << nondet.status();
  EXPECT_NE(*det, *nondet);
  EXPECT_EQ(cache.size(), 3);
  SdpaShape scaled = ShapeFor(c);
  scaled.scale = 0.5f * SdpaScale(ShapeFor(c));  // not the default 1/sqrt(D)
  ASSERT_TRUE(cache.Forward(scaled).ok());
  EXPECT_EQ(cache.size(), 4);
}

TEST_P(SdpaDeviceTest, ExecuteRefusesMissingPointers) {
  const Case& c = GetParam();
  absl::StatusOr<SdpaGraph> graph = BuildSdpaForward(ShapeFor(c));
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<std::unique_ptr<SdpaPlan>> plan =
      SdpaPlan::Create(handle_, *std::move(graph));
  ASSERT_TRUE(plan.ok()) << plan.status();
  DeviceBuffer buffer(1024);
  SdpaPointers p;
  p.q = p.k = p.v = buffer.get();
  p.o = buffer.get();
  absl::Status s = (*plan)->Execute(handle_, p, nullptr, stream_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("stats is null"));
  p.stats = reinterpret_cast<float*>(buffer.bytes() + 4);
  s = (*plan)->Execute(handle_, p, nullptr, stream_);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not 16-byte aligned"));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SdpaDeviceTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace gpu
}  // namespace fsdpp
