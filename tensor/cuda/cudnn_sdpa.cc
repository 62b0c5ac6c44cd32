// Causal SDPA graphs on cuDNN's backend API; see cudnn_sdpa.h.
//
// The graphs follow, operation for operation and type for type, the
// composite graphs cudnn-frontend's SDPA nodes lower to for cuDNN 9.x (read
// for the facts, no code taken; by-value scalars here are [1, 1, 1, 1] and
// virtual tensors contiguous): the backend's fused attention engines match
// that pattern, so a graph that computes the same thing differently would
// find no engine.
#include "tensor/cuda/cudnn_sdpa.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/cuda_runtime.h"
#include "core/status.h"

namespace fsdpp {
namespace gpu {

namespace {

using Dims = std::vector<int64_t>;

constexpr int64_t kAlignment = 16;            // bytes, every bound tensor
constexpr int64_t kWorkspaceAlignment = 256;  // bytes, each intermediate

std::string DimsString(const std::array<int64_t, 4>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

std::string VersionString(size_t version) {
  return absl::StrCat(version / 10000, ".", version % 10000 / 100, ".",
                      version % 100);
}

int64_t RoundUp(int64_t bytes, int64_t to) {
  return (bytes + to - 1) / to * to;
}

cudnnDataType_t CudnnType(DType dtype) {
  return dtype == DType::kF16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
}

// k [B, Hkv, T, D] as the matmul's K^T [B, Hkv, D, T] (no data movement).
SdpaTensor Transposed(const SdpaTensor& t) {
  SdpaTensor r = t;
  std::swap(r.dims[2], r.dims[3]);
  std::swap(r.strides[2], r.strides[3]);
  return r;
}

absl::Status CheckDims(const char* op, const char* name, const SdpaTensor& t) {
  for (int i = 0; i < 4; ++i) {
    if (t.dims[i] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " dims ",
                                                     DimsString(t.dims),
                                                     " must all be positive"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStrides(const char* op, const char* name,
                          const SdpaTensor& t) {
  if (t.strides[3] != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " strides ", DimsString(t.strides),
                     " must have the head dim contiguous (last stride 1)"));
  }
  for (int i = 0; i < 3; ++i) {
    if (t.strides[i] < 1 || t.strides[i] % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", name, " strides ", DimsString(t.strides),
          " must be positive multiples of 8 elements (16-byte rows)"));
    }
  }
  return absl::OkStatus();
}

absl::Status SameDims(const char* op, const char* name, const SdpaTensor& t,
                      const char* like_name, const SdpaTensor& like) {
  if (t.dims != like.dims) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " dims ", DimsString(t.dims), " must equal ", like_name,
        " dims ", DimsString(like.dims)));
  }
  return absl::OkStatus();
}

absl::Status ValidateForward(const char* op, const SdpaShape& shape) {
  if (shape.dtype != DType::kBF16 && shape.dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": dtype ", DTypeName(shape.dtype),
                     " is not supported: cuDNN's fused attention takes bf16 "
                     "or f16"));
  }
  FSDPP_RETURN_IF_ERROR(CheckDims(op, "q", shape.q));
  FSDPP_RETURN_IF_ERROR(CheckDims(op, "k", shape.k));
  FSDPP_RETURN_IF_ERROR(CheckDims(op, "v", shape.v));
  FSDPP_RETURN_IF_ERROR(CheckDims(op, "o", shape.o));
  const std::array<int64_t, 4>& q = shape.q.dims;
  const std::array<int64_t, 4>& k = shape.k.dims;
  if (k[0] != q[0] || k[2] != q[2] || k[3] != q[3]) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": k dims ", DimsString(k), " must be [B, Hkv, T, D] with q's B, ",
        "T and D (q dims ", DimsString(q), ")"));
  }
  if (q[1] % k[1] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": q's ", q[1], " heads must be a multiple of k's ",
                     k[1], " (grouped-query attention)"));
  }
  FSDPP_RETURN_IF_ERROR(SameDims(op, "v", shape.v, "k", shape.k));
  FSDPP_RETURN_IF_ERROR(SameDims(op, "o", shape.o, "q", shape.q));
  if (q[3] > kSdpaMaxHeadDim || q[3] % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": head dim ", q[3], " is not supported: it must ",
                     "be a multiple of 8 and at most ", kSdpaMaxHeadDim));
  }
  FSDPP_RETURN_IF_ERROR(CheckStrides(op, "q", shape.q));
  FSDPP_RETURN_IF_ERROR(CheckStrides(op, "k", shape.k));
  FSDPP_RETURN_IF_ERROR(CheckStrides(op, "v", shape.v));
  FSDPP_RETURN_IF_ERROR(CheckStrides(op, "o", shape.o));
  if (!std::isfinite(shape.scale) || shape.scale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": scale ", shape.scale,
                     " must be finite and positive (0: 1 / sqrt(D))"));
  }
  return absl::OkStatus();
}

// Names for DebugString.
const char* ModeName(cudnnPointwiseMode_t mode) {
  switch (mode) {
    case CUDNN_POINTWISE_ADD:
      return "add";
    case CUDNN_POINTWISE_SUB:
      return "sub";
    case CUDNN_POINTWISE_MUL:
      return "mul";
    case CUDNN_POINTWISE_DIV:
      return "div";
    case CUDNN_POINTWISE_EXP:
      return "exp";
    case CUDNN_POINTWISE_LOG:
      return "log";
    case CUDNN_POINTWISE_IDENTITY:
      return "identity";
    case CUDNN_POINTWISE_GEN_INDEX:
      return "gen_index";
    case CUDNN_POINTWISE_CMP_GE:
      return "cmp_ge";
    case CUDNN_POINTWISE_BINARY_SELECT:
      return "binary_select";
    default:
      return "pointwise";
  }
}

}  // namespace

SdpaTensor BhtdTensor(int64_t b, int64_t n, int64_t t, int64_t d) {
  return SdpaTensor{{b, n, t, d}, {n * t * d, t * d, d, 1}};
}

SdpaTensor BthdTensor(int64_t b, int64_t n, int64_t t, int64_t d,
                      int64_t row_heads) {
  return SdpaTensor{{b, n, t, d}, {t * row_heads * d, d, row_heads * d, 1}};
}

float SdpaScale(const SdpaShape& shape) {
  return shape.scale != 0.0f
             ? shape.scale
             : 1.0f / std::sqrt(static_cast<float>(shape.q.dims[3]));
}

SdpaTensor SdpaStatsTensor(const SdpaShape& shape) {
  const int64_t h = shape.q.dims[1], t = shape.q.dims[2];
  return SdpaTensor{{shape.q.dims[0], h, t, 1}, {h * t, t, 1, 1}};
}

absl::Status ValidateSdpaShape(const SdpaShape& shape) {
  return ValidateForward("SDPA", shape);
}

absl::Status ValidateSdpaBackwardShape(const SdpaBackwardShape& shape) {
  constexpr const char* kOp = "SDPA backward";
  FSDPP_RETURN_IF_ERROR(ValidateForward(kOp, shape.forward));
  FSDPP_RETURN_IF_ERROR(SameDims(kOp, "d_o", shape.d_o, "q", shape.forward.q));
  FSDPP_RETURN_IF_ERROR(SameDims(kOp, "d_q", shape.d_q, "q", shape.forward.q));
  FSDPP_RETURN_IF_ERROR(SameDims(kOp, "d_k", shape.d_k, "k", shape.forward.k));
  FSDPP_RETURN_IF_ERROR(SameDims(kOp, "d_v", shape.d_v, "v", shape.forward.v));
  FSDPP_RETURN_IF_ERROR(CheckStrides(kOp, "d_o", shape.d_o));
  FSDPP_RETURN_IF_ERROR(CheckStrides(kOp, "d_q", shape.d_q));
  FSDPP_RETURN_IF_ERROR(CheckStrides(kOp, "d_k", shape.d_k));
  FSDPP_RETURN_IF_ERROR(CheckStrides(kOp, "d_v", shape.d_v));
  if (shape.forward.q.dims[2] < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp,
                     ": sequence length 1 is not supported (cuDNN's "
                     "backward refuses s_q = s_kv = 1)"));
  }
  return absl::OkStatus();
}

SdpaBackendTraits SdpaTraitsFor(size_t cudnn_version) {
  SdpaBackendTraits traits;
  traits.version = cudnn_version;
  traits.mask_value = cudnn_version >= 91000
                          ? -std::numeric_limits<float>::infinity()
                          : std::numeric_limits<float>::lowest();
  traits.zero_dq_accumulator = cudnn_version < 90600;
  traits.graph_needs_handle = cudnn_version < 90800;
  traits.backward_broken = cudnn_version == 91000 || cudnn_version == 91001;
  return traits;
}

absl::Status CheckSdpaCudnnVersion(size_t cudnn_version, bool backward) {
  if (cudnn_version < 90000 || cudnn_version >= 100000) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SDPA needs cuDNN 9 (built against ", VersionString(CUDNN_VERSION),
        "), found ", VersionString(cudnn_version)));
  }
  if (backward && SdpaTraitsFor(cudnn_version).backward_broken) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SDPA backward: cuDNN ", VersionString(cudnn_version),
        " has known bugs in the fused attention backward; use 9.10.2 or "
        "newer"));
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------- the builder

// Adds finalized tensors and operations to an SdpaGraph. The first failure
// sticks (later calls do nothing) and Finish returns it, named after the
// tensor or operation that failed.
class SdpaGraphBuilder {
 public:
  SdpaGraphBuilder(SdpaGraph::Kind kind, SdpaBackendTraits traits,
                   bool deterministic)
      : graph_(kind, traits) {
    graph_.deterministic_ = deterministic;
  }

  const SdpaBackendTraits& traits() const { return graph_.traits_; }

  // A tensor the caller binds by `uid`.
  int64_t Bound(SdpaUid uid, const std::string& name, cudnnDataType_t type,
                const SdpaTensor& t) {
    const int64_t id = static_cast<int64_t>(uid);
    Add(id, name, type, Dims(t.dims.begin(), t.dims.end()),
        Dims(t.strides.begin(), t.strides.end()), /*is_virtual=*/false,
        /*by_value=*/false);
    if (status_.ok()) graph_.bound_[id] = graph_.tensors_.back().get();
    return id;
  }

  // A tensor that lives only inside the fused kernel.
  int64_t Virtual(const std::string& name, cudnnDataType_t type,
                  const Dims& dims, const Dims& strides) {
    const int64_t id = next_uid_++;
    Add(id, name, type, dims, strides, /*is_virtual=*/true,
        /*by_value=*/false);
    return id;
  }

  // An f32 scalar passed by value at execution, [1, 1, 1, 1] (a pointwise
  // operation's inputs must all have its output's rank).
  int64_t Scalar(const std::string& name, float value) {
    const int64_t id = next_uid_++;
    Add(id, name, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1},
        /*is_virtual=*/false, /*by_value=*/true);
    graph_.by_value_->push_back({value, id});
    return id;
  }

  // An f32 tensor (contiguous `dims`) in the caller's workspace.
  int64_t Workspace(const std::string& name, const Dims& dims,
                    const Dims& strides, bool zero) {
    const int64_t id = next_uid_++;
    Add(id, name, CUDNN_DATA_FLOAT, dims, strides, /*is_virtual=*/false,
        /*by_value=*/false);
    int64_t elements = 1;
    for (int64_t d : dims) elements *= d;
    const int64_t bytes = RoundUp(
        elements * static_cast<int64_t>(sizeof(float)), kWorkspaceAlignment);
    graph_.intermediates_.push_back({id, workspace_bytes_, bytes, zero});
    in_workspace_.insert(id);
    workspace_bytes_ += bytes;
    return id;
  }

  // c = a @ b (f32 accumulation).
  void Matmul(const std::string& name, int64_t a, int64_t b, int64_t c) {
    Flow({a, b}, c);
    Run(absl::StrCat("matmul ", name), [&]() -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor desc,
          CudnnDescriptor::Create(CUDNN_BACKEND_MATMUL_DESCRIPTOR));
      const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(desc.get(), CUDNN_ATTR_MATMUL_COMP_TYPE,
                                   CUDNN_TYPE_DATA_TYPE, 1, &comp));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(desc.get()));
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor op,
          CudnnDescriptor::Create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR));
      cudnnBackendDescriptor_t ta = tensor(a), tb = tensor(b), tc = tensor(c),
                               td = desc.get();
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_MATMUL_ADESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ta));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_MATMUL_BDESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tb));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_MATMUL_CDESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tc));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_MATMUL_DESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &td));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(op.get()));
      Keep(std::move(desc), std::move(op),
           absl::StrCat(name, ": matmul(", names_[a], ", ", names_[b], ") -> ",
                        names_[c]));
      return absl::OkStatus();
    });
  }

  // y = mode(x[, b[, t]]) computed in `precision`; `axis` for GEN_INDEX.
  void Pointwise(const std::string& name, cudnnPointwiseMode_t mode,
                 cudnnDataType_t precision, int64_t x, int64_t b, int64_t t,
                 int64_t y, int64_t axis = -1) {
    Flow({x, b, t}, y);
    Run(absl::StrCat("pointwise ", name), [&]() -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor desc,
          CudnnDescriptor::Create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(desc.get(), CUDNN_ATTR_POINTWISE_MODE,
                                   CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(desc.get(), CUDNN_ATTR_POINTWISE_MATH_PREC,
                                   CUDNN_TYPE_DATA_TYPE, 1, &precision));
      if (axis >= 0) {
        FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
            desc.get(), CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
      }
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(desc.get()));
      FSDPP_ASSIGN_OR_RETURN(CudnnDescriptor op,
                             CudnnDescriptor::Create(
                                 CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
      cudnnBackendDescriptor_t td = desc.get(), tx = tensor(x), ty = tensor(y);
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &td));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tx));
      std::string inputs = names_[x];
      if (b >= 0) {
        cudnnBackendDescriptor_t tb = tensor(b);
        FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
            op.get(), CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
            CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tb));
        absl::StrAppend(&inputs, ", ", names_[b]);
      }
      if (t >= 0) {
        cudnnBackendDescriptor_t tt = tensor(t);
        FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
            op.get(), CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
            CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tt));
        absl::StrAppend(&inputs, ", ", names_[t]);
      }
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_POINTWISE_YDESC,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ty));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(op.get()));
      Keep(std::move(desc), std::move(op),
           absl::StrCat(name, ": ", ModeName(mode), "(", inputs, ")",
                        axis >= 0 ? absl::StrCat(" axis ", axis) : "", " -> ",
                        names_[y]));
      return absl::OkStatus();
    });
  }

  // y = reduction of x over the dims where y has extent 1 (f32).
  void Reduce(const std::string& name, cudnnReduceTensorOp_t reduce, int64_t x,
              int64_t y) {
    Flow({x}, y);
    Run(absl::StrCat("reduction ", name), [&]() -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor desc,
          CudnnDescriptor::Create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR));
      const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          desc.get(), CUDNN_ATTR_REDUCTION_OPERATOR,
          CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(desc.get(), CUDNN_ATTR_REDUCTION_COMP_TYPE,
                                   CUDNN_TYPE_DATA_TYPE, 1, &comp));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(desc.get()));
      FSDPP_ASSIGN_OR_RETURN(CudnnDescriptor op,
                             CudnnDescriptor::Create(
                                 CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR));
      cudnnBackendDescriptor_t td = desc.get(), tx = tensor(x), ty = tensor(y);
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tx));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ty));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          op.get(), CUDNN_ATTR_OPERATION_REDUCTION_DESC,
          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &td));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(op.get()));
      Keep(std::move(desc), std::move(op),
           absl::StrCat(name, ": reduce_",
                        reduce == CUDNN_REDUCE_TENSOR_MAX ? "max" : "add", "(",
                        names_[x], ") -> ", names_[y]));
      return absl::OkStatus();
    });
  }

  // y = x seen with y's dims and strides (a view; no data movement).
  void Reshape(const std::string& name, int64_t x, int64_t y) {
    Flow({x}, y);
    Run(absl::StrCat("reshape ", name), [&]() -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor op,
          CudnnDescriptor::Create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR));
      cudnnBackendDescriptor_t tx = tensor(x), ty = tensor(y);
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_RESHAPE_XDESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tx));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(op.get(), CUDNN_ATTR_OPERATION_RESHAPE_YDESC,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ty));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(op.get()));
      Keep(CudnnDescriptor(), std::move(op),
           absl::StrCat(name, ": reshape(", names_[x], ") -> ", names_[y]));
      return absl::OkStatus();
    });
  }

  // The graph, once every tensor is used as its role requires: each
  // virtual or workspace tensor produced by exactly one operation and
  // consumed by some; each of `outputs` produced exactly once; every other
  // bound tensor and scalar only consumed. (cuDNN's operation-graph
  // finalize does not check this without a device.)
  absl::StatusOr<SdpaGraph> Finish(std::initializer_list<SdpaUid> outputs) {
    if (!status_.ok()) return status_;
    absl::flat_hash_set<int64_t> out;
    for (SdpaUid uid : outputs) out.insert(static_cast<int64_t>(uid));
    for (const auto& [uid, name] : names_) {
      const int produced = produced_[uid], consumed = consumed_[uid];
      const bool intermediate = is_virtual_[uid] || in_workspace_.contains(uid);
      const bool ok = out.contains(uid) ? produced == 1
                      : intermediate    ? produced == 1 && consumed >= 1
                                        : produced == 0 && consumed >= 1;
      if (!ok) {
        return absl::InternalError(
            absl::StrCat("SDPA graph: tensor '", name, "' is produced ",
                         produced, " and consumed ", consumed, " times"));
      }
    }
    for (int64_t uid = static_cast<int64_t>(SdpaUid::kQ);
         uid <= static_cast<int64_t>(SdpaUid::kDV); ++uid) {
      if (!graph_.bound_.contains(uid)) continue;
      graph_.debug_lines_.push_back(absl::StrCat(
          "bound ", names_[uid], ": uid ", uid, " ", tensor_lines_[uid]));
    }
    return std::move(graph_);
  }

 private:
  cudnnBackendDescriptor_t tensor(int64_t uid) { return tensors_[uid]; }

  void Flow(std::initializer_list<int64_t> inputs, int64_t output) {
    for (int64_t in : inputs) {
      if (in >= 0) ++consumed_[in];
    }
    ++produced_[output];
  }

  void Run(const std::string& what, const std::function<absl::Status()>& f) {
    if (status_.ok()) status_ = Annotate(f(), what);
  }

  void Keep(CudnnDescriptor attributes, CudnnDescriptor op, std::string line) {
    if (attributes.get() != nullptr) {
      graph_.op_attributes_.push_back(std::move(attributes));
    }
    graph_.ops_.push_back(std::move(op));
    graph_.debug_lines_.push_back(std::move(line));
  }

  void Add(int64_t uid, const std::string& name, cudnnDataType_t type,
           const Dims& dims, const Dims& strides, bool is_virtual,
           bool by_value) {
    names_[uid] = name;
    is_virtual_[uid] = is_virtual;
    Run(absl::StrCat("tensor ", name), [&]() -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(
          CudnnDescriptor t,
          CudnnDescriptor::Create(CUDNN_BACKEND_TENSOR_DESCRIPTOR));
      const int64_t rank = static_cast<int64_t>(dims.size());
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_DATA_TYPE,
                                   CUDNN_TYPE_DATA_TYPE, 1, &type));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_DIMENSIONS,
                                   CUDNN_TYPE_INT64, rank, dims.data()));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_STRIDES,
                                   CUDNN_TYPE_INT64, rank, strides.data()));
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
          t.get(), CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
                                   CUDNN_TYPE_INT64, 1, &kAlignment));
      FSDPP_CUDNN_RETURN_IF_ERROR(
          cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                                   CUDNN_TYPE_BOOLEAN, 1, &is_virtual));
      if (by_value) {
        FSDPP_CUDNN_RETURN_IF_ERROR(
            cudnnBackendSetAttribute(t.get(), CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                                     CUDNN_TYPE_BOOLEAN, 1, &by_value));
      }
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(t.get()));
      tensors_[uid] = t.get();
      tensor_lines_[uid] = absl::StrCat(
          "type ", static_cast<int>(type), " dims [", absl::StrJoin(dims, ", "),
          "] strides [", absl::StrJoin(strides, ", "), "]");
      graph_.tensors_.push_back(std::move(t));
      return absl::OkStatus();
    });
  }

  SdpaGraph graph_;
  absl::Status status_;
  int64_t next_uid_ = 100;  // above every SdpaUid
  int64_t workspace_bytes_ = 0;
  absl::flat_hash_map<int64_t, cudnnBackendDescriptor_t> tensors_;
  absl::flat_hash_map<int64_t, std::string> names_;
  absl::flat_hash_map<int64_t, std::string> tensor_lines_;
  absl::flat_hash_map<int64_t, bool> is_virtual_;
  absl::flat_hash_set<int64_t> in_workspace_;
  absl::flat_hash_map<int64_t, int> produced_, consumed_;
};

namespace {

// The causal mask over scores [B, H, T, T]: keeps (row >= col), writes the
// traits' mask value elsewhere. As cudnn-frontend's top-left diagonal band
// with right bound 0: GEN_INDEX computed in f32 into int32, the comparison
// in boolean, the select in f32.
int64_t CausalMask(SdpaGraphBuilder& g, int64_t scores, const Dims& dims,
                   const Dims& strides) {
  const int64_t row = g.Virtual("row", CUDNN_DATA_INT32, dims, strides);
  g.Pointwise("row", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, -1,
              -1, row, /*axis=*/2);
  const int64_t col = g.Virtual("col", CUDNN_DATA_INT32, dims, strides);
  g.Pointwise("col", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scores, -1,
              -1, col, /*axis=*/3);
  const int64_t keep = g.Virtual("row>=col", CUDNN_DATA_BOOLEAN, dims, strides);
  g.Pointwise("row>=col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col,
              -1, keep);
  const int64_t fill = g.Scalar("mask_value", g.traits().mask_value);
  const int64_t masked = g.Virtual("masked", CUDNN_DATA_FLOAT, dims, strides);
  g.Pointwise("masked", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores,
              fill, keep, masked);
  return masked;
}

// dK or dV [B, Hkv, T, D] = a [B, H, T, T] @ b [B, H, T, D], summed over
// each kv head's H / Hkv query heads when Hkv < H.
void GradientOfKv(SdpaGraphBuilder& g, const std::string& name,
                  cudnnDataType_t io, int64_t a, int64_t b, int64_t out,
                  const SdpaShape& shape) {
  const int64_t bt = shape.q.dims[0], h = shape.q.dims[1], t = shape.q.dims[2],
                d = shape.q.dims[3];
  if (shape.k.dims[1] == h) {
    g.Matmul(name, a, b, out);
    return;
  }
  const int64_t full = g.Virtual(absl::StrCat(name, " per query head"), io,
                                 {bt, h, t, d}, {h * t * d, t * d, d, 1});
  g.Matmul(name, a, b, full);
  g.Reduce(absl::StrCat(name, " over query heads"), CUDNN_REDUCE_TENSOR_ADD,
           full, out);
}

}  // namespace

absl::StatusOr<SdpaGraph> BuildSdpaForward(const SdpaShape& shape) {
  FSDPP_RETURN_IF_ERROR(ValidateSdpaShape(shape));
  const size_t version = cudnnGetVersion();
  FSDPP_RETURN_IF_ERROR(CheckSdpaCudnnVersion(version, /*backward=*/false));
  SdpaGraphBuilder g(SdpaGraph::Kind::kForward, SdpaTraitsFor(version),
                     /*deterministic=*/true);
  const cudnnDataType_t io = CudnnType(shape.dtype);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const int64_t b = shape.q.dims[0], h = shape.q.dims[1], t = shape.q.dims[2];
  const Dims scores = {b, h, t, t}, scores_strides = {h * t * t, t * t, t, 1};
  const Dims rows = {b, h, t, 1}, rows_strides = {h * t, t, 1, 1};

  const int64_t q = g.Bound(SdpaUid::kQ, "q", io, shape.q);
  const int64_t kt = g.Bound(SdpaUid::kK, "k^T", io, Transposed(shape.k));
  const int64_t v = g.Bound(SdpaUid::kV, "v", io, shape.v);
  const int64_t o = g.Bound(SdpaUid::kO, "o", io, shape.o);
  const int64_t stats =
      g.Bound(SdpaUid::kStats, "stats", f32, SdpaStatsTensor(shape));
  const int64_t scale = g.Scalar("scale", SdpaScale(shape));

  const int64_t s = g.Virtual("s", f32, scores, scores_strides);
  g.Matmul("bmm1", q, kt, s);
  const int64_t scaled = g.Virtual("scaled", f32, scores, scores_strides);
  g.Pointwise("scaled", CUDNN_POINTWISE_MUL, f32, s, scale, -1, scaled);
  const int64_t masked = CausalMask(g, scaled, scores, scores_strides);

  // Softmax with its statistics: Stats = max + log(sum(exp(x - max))).
  const int64_t max = g.Virtual("max", f32, rows, rows_strides);
  g.Reduce("max", CUDNN_REDUCE_TENSOR_MAX, masked, max);
  const int64_t sub = g.Virtual("sub", f32, scores, scores_strides);
  g.Pointwise("sub", CUDNN_POINTWISE_SUB, f32, masked, max, -1, sub);
  const int64_t exp = g.Virtual("exp", f32, scores, scores_strides);
  g.Pointwise("exp", CUDNN_POINTWISE_EXP, f32, sub, -1, -1, exp);
  const int64_t sum = g.Virtual("sum", f32, rows, rows_strides);
  g.Reduce("sum", CUDNN_REDUCE_TENSOR_ADD, exp, sum);
  const int64_t log = g.Virtual("log", f32, rows, rows_strides);
  g.Pointwise("log", CUDNN_POINTWISE_LOG, f32, sum, -1, -1, log);
  g.Pointwise("stats", CUDNN_POINTWISE_ADD, f32, max, log, -1, stats);
  // The probabilities enter the second matmul in the storage type.
  const int64_t p = g.Virtual("p", io, scores, scores_strides);
  g.Pointwise("p", CUDNN_POINTWISE_DIV, f32, exp, sum, -1, p);
  g.Matmul("bmm2", p, v, o);
  return g.Finish({SdpaUid::kO, SdpaUid::kStats});
}

absl::StatusOr<SdpaGraph> BuildSdpaBackward(const SdpaBackwardShape& shape) {
  FSDPP_RETURN_IF_ERROR(ValidateSdpaBackwardShape(shape));
  const size_t version = cudnnGetVersion();
  FSDPP_RETURN_IF_ERROR(CheckSdpaCudnnVersion(version, /*backward=*/true));
  const SdpaShape& fwd = shape.forward;
  SdpaGraphBuilder g(SdpaGraph::Kind::kBackward, SdpaTraitsFor(version),
                     shape.deterministic);
  const cudnnDataType_t io = CudnnType(fwd.dtype);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const int64_t b = fwd.q.dims[0], h = fwd.q.dims[1], t = fwd.q.dims[2],
                d = fwd.q.dims[3];
  const Dims scores = {b, h, t, t}, scores_strides = {h * t * t, t * t, t, 1};
  // The same [B, H, T, T] scores read as [B, H, T_k, T_q] (transposed).
  const Dims scores_t_strides = {h * t * t, t * t, 1, t};
  const Dims rows = {b, h, t, 1}, rows_strides = {h * t, t, 1, 1};
  const Dims heads = {b, h, t, d}, heads_strides = {h * t * d, t * d, d, 1};

  const int64_t q = g.Bound(SdpaUid::kQ, "q", io, fwd.q);
  const int64_t kt = g.Bound(SdpaUid::kK, "k^T", io, Transposed(fwd.k));
  const int64_t vt = g.Bound(SdpaUid::kV, "v^T", io, Transposed(fwd.v));
  const int64_t o = g.Bound(SdpaUid::kO, "o", io, fwd.o);
  const int64_t stats =
      g.Bound(SdpaUid::kStats, "stats", f32, SdpaStatsTensor(fwd));
  const int64_t d_o = g.Bound(SdpaUid::kDO, "d_o", io, shape.d_o);
  const int64_t d_q = g.Bound(SdpaUid::kDQ, "d_q", io, shape.d_q);
  const int64_t d_k = g.Bound(SdpaUid::kDK, "d_k", io, shape.d_k);
  const int64_t d_v = g.Bound(SdpaUid::kDV, "d_v", io, shape.d_v);
  const int64_t one = g.Scalar("one", 1.0f);
  const int64_t scale = g.Scalar("scale", SdpaScale(fwd));

  // softmax_sum = rowsum(dO * O), kept in the workspace (f32).
  const int64_t do_o = g.Virtual("d_o*o", f32, heads, heads_strides);
  g.Pointwise("d_o*o", CUDNN_POINTWISE_MUL, f32, d_o, o, -1, do_o);
  const int64_t rowsum = g.Virtual("rowsum", f32, rows, rows_strides);
  g.Reduce("rowsum", CUDNN_REDUCE_TENSOR_ADD, do_o, rowsum);
  const int64_t softmax_sum =
      g.Workspace("softmax_sum", rows, rows_strides, /*zero=*/false);
  g.Pointwise("softmax_sum", CUDNN_POINTWISE_MUL, f32, rowsum, one, -1,
              softmax_sum);

  // P = exp(mask(scale * Q K^T - Stats)), recomputed from the statistics.
  const int64_t s = g.Virtual("s", f32, scores, scores_strides);
  g.Matmul("q@k^T", q, kt, s);
  const int64_t scaled = g.Virtual("scaled", f32, scores, scores_strides);
  g.Pointwise("scaled", CUDNN_POINTWISE_MUL, f32, s, scale, -1, scaled);
  const int64_t shifted = g.Virtual("shifted", f32, scores, scores_strides);
  g.Pointwise("shifted", CUDNN_POINTWISE_SUB, f32, scaled, stats, -1, shifted);
  const int64_t masked = CausalMask(g, shifted, scores, scores_strides);
  const int64_t p = g.Virtual("p", f32, scores, scores_strides);
  g.Pointwise("p", CUDNN_POINTWISE_EXP, f32, masked, -1, -1, p);

  // dV = P^T dO.
  const int64_t p_t = g.Virtual("p^T", io, scores, scores_t_strides);
  g.Reshape("p^T", p, p_t);
  GradientOfKv(g, "d_v", io, p_t, d_o, d_v, fwd);

  // dS = P (dO V^T - softmax_sum) * scale.
  const int64_t dp = g.Virtual("dp", f32, scores, scores_strides);
  g.Matmul("d_o@v^T", d_o, vt, dp);
  const int64_t dp_sub =
      g.Virtual("dp-softmax_sum", f32, scores, scores_strides);
  g.Pointwise("dp-softmax_sum", CUDNN_POINTWISE_SUB, f32, dp, softmax_sum, -1,
              dp_sub);
  const int64_t dp_p =
      g.Virtual("(dp-softmax_sum)*p", f32, scores, scores_strides);
  g.Pointwise("(dp-softmax_sum)*p", CUDNN_POINTWISE_MUL, f32, dp_sub, p, -1,
              dp_p);
  const int64_t ds = g.Virtual("ds", f32, scores, scores_strides);
  g.Pointwise("ds", CUDNN_POINTWISE_MUL, f32, dp_p, scale, -1, ds);

  // dK = dS^T Q.
  const int64_t ds_t = g.Virtual("ds^T", io, scores, scores_t_strides);
  g.Reshape("ds^T", ds, ds_t);
  GradientOfKv(g, "d_k", io, ds_t, q, d_k, fwd);

  // dQ = dS K: straight into d_q (deterministic), or through an f32
  // accumulator in the workspace.
  const int64_t k =
      g.Virtual("k", f32, Dims(fwd.k.dims.begin(), fwd.k.dims.end()),
                Dims(fwd.k.strides.begin(), fwd.k.strides.end()));
  g.Reshape("k", kt, k);
  if (shape.deterministic) {
    g.Matmul("d_q", ds, k, d_q);
  } else {
    const int64_t acc = g.Workspace("d_q accumulator", heads, heads_strides,
                                    g.traits().zero_dq_accumulator);
    g.Matmul("d_q accumulator", ds, k, acc);
    g.Pointwise("d_q", CUDNN_POINTWISE_IDENTITY, f32, acc, -1, -1, d_q);
  }
  return g.Finish({SdpaUid::kDQ, SdpaUid::kDK, SdpaUid::kDV});
}

// ----------------------------------------------------------------- graph

SdpaGraph::SdpaGraph(Kind kind, SdpaBackendTraits traits)
    : kind_(kind),
      traits_(traits),
      by_value_(std::make_unique<std::vector<ByValue>>()) {}
SdpaGraph::SdpaGraph(SdpaGraph&&) = default;
SdpaGraph& SdpaGraph::operator=(SdpaGraph&&) = default;
SdpaGraph::~SdpaGraph() = default;

cudnnBackendDescriptor_t SdpaGraph::tensor(SdpaUid uid) const {
  auto it = bound_.find(static_cast<int64_t>(uid));
  return it == bound_.end() ? nullptr : it->second;
}

int64_t SdpaGraph::intermediate_bytes() const {
  int64_t bytes = 0;
  for (const Intermediate& i : intermediates_) bytes += i.bytes;
  return bytes;
}

std::string SdpaGraph::DebugString() const {
  return absl::StrCat(absl::StrJoin(debug_lines_, "\n"), "\n");
}

absl::StatusOr<CudnnDescriptor> SdpaGraph::MakeOperationGraph(
    cudnnHandle_t handle) const {
  if (handle == nullptr && traits_.graph_needs_handle) {
    return absl::FailedPreconditionError(
        absl::StrCat("SDPA: cuDNN ", VersionString(traits_.version),
                     " needs a handle to finalize an operation graph"));
  }
  FSDPP_ASSIGN_OR_RETURN(
      CudnnDescriptor graph,
      CudnnDescriptor::Create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
  std::vector<cudnnBackendDescriptor_t> ops;
  ops.reserve(ops_.size());
  for (const CudnnDescriptor& op : ops_) ops.push_back(op.get());
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      graph.get(), CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
      static_cast<int64_t>(ops.size()), ops.data()));
  if (handle != nullptr) {
    FSDPP_CUDNN_RETURN_IF_ERROR(
        cudnnBackendSetAttribute(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
                                 CUDNN_TYPE_HANDLE, 1, &handle));
  }
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(graph.get()));
  return graph;
}

// ------------------------------------------------------------------ plan

namespace {

// The engine behind `config` (its global index) and whether cuDNN notes it
// as non-deterministic.
absl::Status DescribeEngine(cudnnBackendDescriptor_t config, int64_t* index,
                            bool* nondeterministic) {
  FSDPP_ASSIGN_OR_RETURN(
      CudnnDescriptor engine,
      CudnnDescriptor::Create(CUDNN_BACKEND_ENGINE_DESCRIPTOR));
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t count = 0;
  FSDPP_CUDNN_RETURN_IF_ERROR(
      cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &raw));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendGetAttribute(
      raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &count, index));
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendGetAttribute(
      raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
      CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes));
  *nondeterministic = false;
  for (int64_t i = 0; i < count; ++i) {
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) {
      *nondeterministic = true;
    }
  }
  return absl::OkStatus();
}

// The engine configs heuristics `mode` proposes for `graph`, best first.
absl::StatusOr<std::vector<CudnnDescriptor>> EngineConfigs(
    cudnnBackendDescriptor_t graph, cudnnBackendHeurMode_t mode) {
  FSDPP_ASSIGN_OR_RETURN(
      CudnnDescriptor heur,
      CudnnDescriptor::Create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      heur.get(), CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
      CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      heur.get(), CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(heur.get()));
  int64_t count = 0;
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendGetAttribute(
      heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
      0, &count, nullptr));
  std::vector<CudnnDescriptor> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    FSDPP_ASSIGN_OR_RETURN(
        CudnnDescriptor c,
        CudnnDescriptor::Create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(c.get());
    configs.push_back(std::move(c));
  }
  int64_t returned = 0;
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendGetAttribute(
      heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
      count, &returned, raw.data()));
  configs.resize(static_cast<size_t>(returned));
  return configs;
}

absl::StatusOr<CudnnDescriptor> MakePlan(cudnnHandle_t handle,
                                         cudnnBackendDescriptor_t config) {
  FSDPP_ASSIGN_OR_RETURN(
      CudnnDescriptor plan,
      CudnnDescriptor::Create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
  FSDPP_CUDNN_RETURN_IF_ERROR(
      cudnnBackendSetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                               CUDNN_TYPE_HANDLE, 1, &handle));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      plan.get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
      CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(plan.get()));
  return plan;
}

bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kAlignment == 0;
}

}  // namespace

SdpaPlan::SdpaPlan(SdpaGraph graph, CudnnDescriptor operation_graph,
                   CudnnDescriptor engine_config, CudnnDescriptor plan,
                   int64_t plan_workspace_bytes, int64_t engine_index)
    : graph_(std::move(graph)),
      operation_graph_(std::move(operation_graph)),
      engine_config_(std::move(engine_config)),
      plan_(std::move(plan)),
      plan_workspace_bytes_(plan_workspace_bytes),
      engine_index_(engine_index) {}

absl::StatusOr<std::unique_ptr<SdpaPlan>> SdpaPlan::Create(cudnnHandle_t handle,
                                                           SdpaGraph graph) {
  if (handle == nullptr) {
    return absl::InvalidArgumentError("SdpaPlan::Create: null cuDNN handle");
  }
  FSDPP_ASSIGN_OR_RETURN(CudnnDescriptor op_graph,
                         graph.MakeOperationGraph(handle));
  const bool deterministic =
      graph.kind() == SdpaGraph::Kind::kBackward && graph.deterministic();
  absl::Status last = absl::NotFoundError("no engine config proposed");
  int tried = 0, skipped = 0;
  for (cudnnBackendHeurMode_t mode :
       {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    absl::StatusOr<std::vector<CudnnDescriptor>> configs =
        EngineConfigs(op_graph.get(), mode);
    if (!configs.ok()) {
      last = Annotate(configs.status(),
                      absl::StrCat("heuristics mode ", static_cast<int>(mode)));
      continue;
    }
    for (CudnnDescriptor& config : *configs) {
      int64_t index = -1;
      bool nondeterministic = false;
      absl::Status described =
          DescribeEngine(config.get(), &index, &nondeterministic);
      if (!described.ok()) {
        last = described;
        continue;
      }
      if (deterministic && nondeterministic) {
        ++skipped;
        continue;
      }
      ++tried;
      absl::StatusOr<CudnnDescriptor> plan = MakePlan(handle, config.get());
      if (!plan.ok()) {
        last = Annotate(plan.status(), absl::StrCat("engine ", index));
        continue;
      }
      int64_t workspace = 0, count = 0;
      FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendGetAttribute(
          plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
          CUDNN_TYPE_INT64, 1, &count, &workspace));
      return std::unique_ptr<SdpaPlan>(
          new SdpaPlan(std::move(graph), std::move(op_graph), std::move(config),
                       *std::move(plan), workspace, index));
    }
  }
  return absl::UnimplementedError(absl::StrCat(
      "SDPA ",
      graph.kind() == SdpaGraph::Kind::kForward ? "forward" : "backward",
      ": no engine of cuDNN ", VersionString(graph.traits().version),
      " runs this graph (", tried, " execution plans refused, ", skipped,
      " non-deterministic engine configs skipped); last: ", last.message()));
}

absl::Status SdpaPlan::Execute(cudnnHandle_t handle,
                               const SdpaPointers& pointers, void* workspace,
                               cudaStream_t stream) const {
  const bool backward = graph_.kind() == SdpaGraph::Kind::kBackward;
  std::vector<std::pair<SdpaUid, const void*>> bound = {
      {SdpaUid::kQ, pointers.q},
      {SdpaUid::kK, pointers.k},
      {SdpaUid::kV, pointers.v},
      {SdpaUid::kO, pointers.o},
      {SdpaUid::kStats, pointers.stats}};
  if (backward) {
    bound.insert(bound.end(), {{SdpaUid::kDO, pointers.d_o},
                               {SdpaUid::kDQ, pointers.d_q},
                               {SdpaUid::kDK, pointers.d_k},
                               {SdpaUid::kDV, pointers.d_v}});
  }
  static constexpr const char* kNames[] = {"",      "q",   "k",   "v",   "o",
                                           "stats", "d_o", "d_q", "d_k", "d_v"};
  std::vector<int64_t> uids;
  std::vector<void*> data;
  for (const auto& [uid, ptr] : bound) {
    const char* name = kNames[static_cast<int64_t>(uid)];
    if (ptr == nullptr || !Aligned(ptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SdpaPlan::Execute (", backward ? "backward" : "forward", "): ", name,
          " is ", ptr == nullptr ? "null" : "not 16-byte aligned"));
    }
    uids.push_back(static_cast<int64_t>(uid));
    data.push_back(const_cast<void*>(ptr));
  }
  if (workspace_bytes() > 0 && (workspace == nullptr || !Aligned(workspace))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SdpaPlan::Execute: the workspace of ", workspace_bytes(), " bytes is ",
        workspace == nullptr ? "null" : "not 16-byte aligned"));
  }
  for (const SdpaGraph::ByValue& s : *graph_.by_value_) {
    uids.push_back(s.uid);
    data.push_back(const_cast<float*>(&s.value));
  }
  char* base = static_cast<char*>(workspace);
  for (const SdpaGraph::Intermediate& i : graph_.intermediates_) {
    uids.push_back(i.uid);
    data.push_back(base + i.offset);
  }
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnSetStream(handle, stream));
  for (const SdpaGraph::Intermediate& i : graph_.intermediates_) {
    if (i.zero) {
      FSDPP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(base + i.offset, 0, i.bytes, stream));
    }
  }
  void* plan_workspace =
      workspace == nullptr ? nullptr : base + graph_.intermediate_bytes();
  FSDPP_ASSIGN_OR_RETURN(
      CudnnDescriptor pack,
      CudnnDescriptor::Create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
      static_cast<int64_t>(uids.size()), uids.data()));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendSetAttribute(
      pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
      static_cast<int64_t>(data.size()), data.data()));
  FSDPP_CUDNN_RETURN_IF_ERROR(
      cudnnBackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                               CUDNN_TYPE_VOID_PTR, 1, &plan_workspace));
  FSDPP_CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(pack.get()));
  FSDPP_CUDNN_RETURN_IF_ERROR(
      cudnnBackendExecute(handle, plan_.get(), pack.get()));
  return absl::OkStatus();
}

// ----------------------------------------------------------------- cache

namespace {

void AppendTensor(const SdpaTensor& t, std::vector<int64_t>* key) {
  key->insert(key->end(), t.dims.begin(), t.dims.end());
  key->insert(key->end(), t.strides.begin(), t.strides.end());
}

std::vector<int64_t> ForwardKey(const SdpaShape& shape) {
  float scale = SdpaScale(shape);
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale_bits));
  std::vector<int64_t> key = {static_cast<int64_t>(shape.dtype), scale_bits};
  for (const SdpaTensor* t : {&shape.q, &shape.k, &shape.v, &shape.o}) {
    AppendTensor(*t, &key);
  }
  return key;
}

}  // namespace

absl::StatusOr<const SdpaPlan*> SdpaPlanCache::Forward(const SdpaShape& shape) {
  std::vector<int64_t> key = ForwardKey(shape);
  key.push_back(0);  // forward
  return GetOrBuild(std::move(key), [&] { return BuildSdpaForward(shape); });
}

absl::StatusOr<const SdpaPlan*> SdpaPlanCache::Backward(
    const SdpaBackwardShape& shape) {
  std::vector<int64_t> key = ForwardKey(shape.forward);
  key.push_back(shape.deterministic ? 1 : 2);  // backward, and which
  for (const SdpaTensor* t : {&shape.d_o, &shape.d_q, &shape.d_k, &shape.d_v}) {
    AppendTensor(*t, &key);
  }
  return GetOrBuild(std::move(key), [&] { return BuildSdpaBackward(shape); });
}

int64_t SdpaPlanCache::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(plans_.size());
}

absl::StatusOr<const SdpaPlan*> SdpaPlanCache::GetOrBuild(
    Key key, const std::function<absl::StatusOr<SdpaGraph>()>& build) {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second.get();
  FSDPP_ASSIGN_OR_RETURN(SdpaGraph graph, build());
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<SdpaPlan> plan,
                         SdpaPlan::Create(handle_, std::move(graph)));
  const SdpaPlan* result = plan.get();
  plans_.emplace(std::move(key), std::move(plan));
  return result;
}

}  // namespace gpu
}  // namespace fsdpp
