// Argument validation and device dispatch for tensor ops; see ops.h.
#include "tensor/ops.h"

#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "core/trace.h"
#include "tensor/backend.h"
#include "tensor/cpu/cpu_backend.h"

#if defined(FSDPP_WITH_CUDA)
#include "tensor/cuda/cuda_backend.h"
#endif

namespace fsdpp {
namespace {

struct Named {
  const char* name;
  const Tensor* tensor;
};

std::string Describe(std::initializer_list<Named> args) {
  std::vector<std::string> parts;
  for (const Named& a : args) {
    parts.push_back(absl::StrCat(a.name, " ", a.tensor->ToString()));
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status Invalid(const char* op, absl::string_view what,
                     std::initializer_list<Named> args) {
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", what, " (", Describe(args), ")"));
}

// All defined, all on one device; returns that device.
absl::StatusOr<Device> CommonDevice(const char* op,
                                    std::initializer_list<Named> args) {
  const Device device = args.begin()->tensor->device();
  for (const Named& a : args) {
    if (!a.tensor->defined()) {
      return Invalid(op, absl::StrCat(a.name, " is undefined"), args);
    }
    if (a.tensor->device() != device) {
      return Invalid(op, "tensors are on different devices", args);
    }
  }
  return device;
}

absl::Status SameDType(const char* op, std::initializer_list<Named> args) {
  const DType dtype = args.begin()->tensor->dtype();
  for (const Named& a : args) {
    if (a.tensor->dtype() != dtype) return Invalid(op, "dtype mismatch", args);
  }
  return absl::OkStatus();
}

absl::Status SameShape(const char* op, std::initializer_list<Named> args) {
  const Shape& shape = args.begin()->tensor->shape();
  for (const Named& a : args) {
    if (a.tensor->shape() != shape) return Invalid(op, "shape mismatch", args);
  }
  return absl::OkStatus();
}

absl::Status FloatDType(const char* op, const Named& arg) {
  if (!IsFloatingPoint(arg.tensor->dtype())) {
    return Invalid(op, absl::StrCat(arg.name, " must be f32, bf16 or f16"),
                   {arg});
  }
  return absl::OkStatus();
}

absl::Status IdDType(const char* op, const Named& arg) {
  const DType d = arg.tensor->dtype();
  if (d != DType::kI32 && d != DType::kI64) {
    return Invalid(op, absl::StrCat(arg.name, " must be i32 or i64"), {arg});
  }
  return absl::OkStatus();
}

absl::Status F32WithNumel(const char* op, const Named& arg, int64_t numel) {
  if (arg.tensor->dtype() != DType::kF32 || arg.tensor->numel() != numel) {
    return Invalid(
        op, absl::StrCat(arg.name, " must be f32 with ", numel, " elements"),
        {arg});
  }
  return absl::OkStatus();
}

// The backend for `device`, or nullptr for meta (validated no-op).
absl::StatusOr<Backend*> BackendFor([[maybe_unused]] const char* op,
                                    Device device) {
  switch (device.type()) {
    case DeviceType::kMeta:
      return nullptr;
    case DeviceType::kCpu:
      return cpu::CpuBackend();
    case DeviceType::kCuda:
#if defined(FSDPP_WITH_CUDA)
      return gpu::CudaBackend(device.index());
#else
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": ", device.ToString(),
                       " tensors need a build with --config=cuda"));
#endif
  }
  return absl::InternalError("unknown device type");
}

// The op profile's category of an op (core/trace.h): matmuls and the fused
// attention kernels apart from the rest.
const char* OpCategory(const char* op) {
  if (std::strcmp(op, "Matmul") == 0) return "matmul";
  if (std::strncmp(op, "CausalAttention", 15) == 0) return "attention";
  return "op";
}

// Validates and resolves the backend of an op over `args`; the op's span
// (profile and trace) lasts to the end of the calling scope.
#define FSDPP_BACKEND_OR_RETURN(var, op, ...)                                 \
  OpSpan var##_span(op, OpCategory(op));                                      \
  FSDPP_ASSIGN_OR_RETURN(Device var##_device, CommonDevice(op, __VA_ARGS__)); \
  FSDPP_ASSIGN_OR_RETURN(Backend* var, BackendFor(op, var##_device))

// Rows of `t` when viewed as [rows, last_dim].
int64_t Rows(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.numel() / std::max<int64_t>(1, t.dim(-1));
}

}  // namespace

absl::Status Copy(const Tensor& src, Tensor* dst) {
  constexpr const char* kOp = "Copy";
  OpSpan span(kOp);
  if (!src.defined() || !dst->defined()) {
    return Invalid(kOp, "undefined tensor", {{"src", &src}, {"dst", dst}});
  }
  if (src.numel() != dst->numel()) {
    return Invalid(kOp, "element counts differ", {{"src", &src}, {"dst", dst}});
  }
  const bool cast = src.dtype() != dst->dtype();
  if (cast &&
      !(IsFloatingPoint(src.dtype()) && IsFloatingPoint(dst->dtype()))) {
    return Invalid(kOp, "only float dtypes convert",
                   {{"src", &src}, {"dst", dst}});
  }
  if (src.is_meta() || dst->is_meta()) {
    if (src.is_meta() && dst->is_meta()) return absl::OkStatus();
    return Invalid(kOp, "cannot copy between meta and real tensors",
                   {{"src", &src}, {"dst", dst}});
  }
  if (src.device() == dst->device()) {
    FSDPP_ASSIGN_OR_RETURN(Backend * backend, BackendFor(kOp, src.device()));
    return backend->Copy(src, dst);
  }
  if (!cast) {
    return CopyBytes(dst->raw_data(), dst->device(), src.raw_data(),
                     src.device(), src.nbytes());
  }
  // Across devices with a cast: move first, then convert on the destination.
  FSDPP_ASSIGN_OR_RETURN(Tensor staged,
                         Tensor::Empty(src.shape(), src.dtype(), dst->device(),
                                       MemoryTag::kOther));
  FSDPP_RETURN_IF_ERROR(CopyBytes(staged.raw_data(), staged.device(),
                                  src.raw_data(), src.device(), src.nbytes()));
  FSDPP_ASSIGN_OR_RETURN(Backend * backend, BackendFor(kOp, dst->device()));
  return backend->Copy(staged, dst);
}

absl::Status Fill(Tensor* t, float value) {
  FSDPP_BACKEND_OR_RETURN(backend, "Fill", {{"t", t}});
  FSDPP_RETURN_IF_ERROR(FloatDType("Fill", {"t", t}));
  return backend == nullptr ? absl::OkStatus() : backend->Fill(t, value);
}

absl::Status Zero(Tensor* t) {
  OpSpan span("Zero");
  FSDPP_ASSIGN_OR_RETURN(Device device, CommonDevice("Zero", {{"t", t}}));
  if (device.is_meta()) return absl::OkStatus();
  return ZeroBytes(t->raw_data(), device, t->nbytes());
}

namespace {

absl::Status UnaryOp(const char* op, UnaryKind kind, float alpha,
                     const Tensor& x, Tensor* out) {
  FSDPP_BACKEND_OR_RETURN(backend, op, {{"x", &x}, {"out", out}});
  FSDPP_RETURN_IF_ERROR(SameDType(op, {{"x", &x}, {"out", out}}));
  FSDPP_RETURN_IF_ERROR(SameShape(op, {{"x", &x}, {"out", out}}));
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"x", &x}));
  return backend == nullptr ? absl::OkStatus()
                            : backend->Unary(kind, alpha, x, out);
}

absl::Status BinaryOp(const char* op, BinaryKind kind, float alpha,
                      const char* a_name, const Tensor& a, const char* b_name,
                      const Tensor& b, const char* out_name, Tensor* out) {
  std::initializer_list<Named> args = {
      {a_name, &a}, {b_name, &b}, {out_name, out}};
  FSDPP_BACKEND_OR_RETURN(backend, op, args);
  FSDPP_RETURN_IF_ERROR(SameDType(op, args));
  FSDPP_RETURN_IF_ERROR(SameShape(op, args));
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {a_name, &a}));
  return backend == nullptr ? absl::OkStatus()
                            : backend->Binary(kind, alpha, a, b, out);
}

}  // namespace

absl::Status Add(const Tensor& a, const Tensor& b, Tensor* out) {
  return BinaryOp("Add", BinaryKind::kAdd, 0.0f, "a", a, "b", b, "out", out);
}

absl::Status Mul(const Tensor& a, const Tensor& b, Tensor* out) {
  return BinaryOp("Mul", BinaryKind::kMul, 0.0f, "a", a, "b", b, "out", out);
}

absl::Status Scale(const Tensor& x, float alpha, Tensor* out) {
  return UnaryOp("Scale", UnaryKind::kScale, alpha, x, out);
}

absl::Status Axpy(float alpha, const Tensor& x, Tensor* y) {
  return BinaryOp("Axpy", BinaryKind::kAxpy, alpha, "y", *y, "x", x, "y", y);
}

absl::Status Gelu(const Tensor& x, Tensor* out) {
  return UnaryOp("Gelu", UnaryKind::kGelu, 0.0f, x, out);
}

absl::Status GeluBackward(const Tensor& x, const Tensor& dy, Tensor* dx) {
  return BinaryOp("GeluBackward", BinaryKind::kGeluBackward, 0.0f, "x", x, "dy",
                  dy, "dx", dx);
}

absl::Status Silu(const Tensor& x, Tensor* out) {
  return UnaryOp("Silu", UnaryKind::kSilu, 0.0f, x, out);
}

absl::Status SiluBackward(const Tensor& x, const Tensor& dy, Tensor* dx) {
  return BinaryOp("SiluBackward", BinaryKind::kSiluBackward, 0.0f, "x", x, "dy",
                  dy, "dx", dx);
}

namespace {

absl::Status ReduceOp(const char* op, ReduceKind kind, const Tensor& x,
                      Tensor* out) {
  FSDPP_BACKEND_OR_RETURN(backend, op, {{"x", &x}, {"out", out}});
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"x", &x}));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(op, {"out", out}, 1));
  return backend == nullptr ? absl::OkStatus() : backend->Reduce(kind, x, out);
}

}  // namespace

absl::Status Sum(const Tensor& x, Tensor* out) {
  return ReduceOp("Sum", ReduceKind::kSum, x, out);
}

absl::Status SumOfSquares(const Tensor& x, Tensor* out) {
  return ReduceOp("SumOfSquares", ReduceKind::kSumOfSquares, x, out);
}

absl::Status SumRowsAccumulate(const Tensor& x, Tensor* out) {
  constexpr const char* kOp = "SumRowsAccumulate";
  FSDPP_BACKEND_OR_RETURN(backend, kOp, {{"x", &x}, {"out", out}});
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"x", &x}));
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"out", out}));
  const int64_t cols = out->numel();
  if (cols == 0 || x.numel() % cols != 0 || x.ndim() == 0 ||
      x.dim(-1) != cols) {
    return Invalid(kOp, "out must have as many elements as x's last dim",
                   {{"x", &x}, {"out", out}});
  }
  if (out->dtype() != x.dtype() && out->dtype() != DType::kF32) {
    return Invalid(kOp, "out must be f32 or x's dtype",
                   {{"x", &x}, {"out", out}});
  }
  return backend == nullptr
             ? absl::OkStatus()
             : backend->SumRowsAccumulate(x, x.numel() / cols, cols, out);
}

absl::StatusOr<float> Item(const Tensor& t) {
  if (!t.defined() || t.numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Item: needs exactly one element, got ", t.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> v, t.ToFloats());
  return v[0];
}

absl::Status Matmul(const Tensor& a, const Tensor& b, Tensor* c,
                    const MatmulOptions& options) {
  constexpr const char* kOp = "Matmul";
  std::initializer_list<Named> args = {{"a", &a}, {"b", &b}, {"c", c}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  if (a.dtype() != b.dtype() || !IsFloatingPoint(a.dtype())) {
    return Invalid(kOp, "a and b must have the same float dtype", args);
  }
  if (c->dtype() != DType::kF32 && c->dtype() != a.dtype()) {
    return Invalid(kOp, "c must be f32 or a's dtype", args);
  }
  if (a.ndim() < 2 || b.ndim() < 2 || c->ndim() < 2) {
    return Invalid(kOp, "a, b and c need at least 2 dims", args);
  }
  const int64_t m = options.transpose_a ? a.dim(-1) : a.dim(-2);
  const int64_t k = options.transpose_a ? a.dim(-2) : a.dim(-1);
  const int64_t kb = options.transpose_b ? b.dim(-1) : b.dim(-2);
  const int64_t n = options.transpose_b ? b.dim(-2) : b.dim(-1);
  if (k != kb) {
    return Invalid(kOp,
                   absl::StrCat("inner dims differ: op(a) is ", m, " x ", k,
                                ", op(b) is ", kb, " x ", n),
                   args);
  }
  if (c->dim(-2) != m || c->dim(-1) != n) {
    return Invalid(kOp, absl::StrCat("c must be ", m, " x ", n), args);
  }
  const Shape batch_a(a.shape().begin(), a.shape().end() - 2);
  const Shape batch_c(c->shape().begin(), c->shape().end() - 2);
  const Shape batch_b(b.shape().begin(), b.shape().end() - 2);
  if (batch_a != batch_c)
    return Invalid(kOp, "batch dims of a and c differ", args);
  const bool broadcast_b = batch_b.empty() && !batch_a.empty();
  if (!broadcast_b && batch_b != batch_a) {
    return Invalid(kOp, "b must have a's batch dims or be 2-D", args);
  }
  if (options.bias != nullptr) {
    const Tensor& bias = *options.bias;
    if (!bias.defined() || bias.ndim() != 1 || bias.dim(0) != n ||
        bias.dtype() != c->dtype() || bias.device() != c->device()) {
      return Invalid(kOp,
                     absl::StrCat("bias must be [", n,
                                  "] of c's dtype on c's "
                                  "device, got ",
                                  bias.ToString()),
                     args);
    }
    if (options.alpha != 1.0f || options.beta != 0.0f) {
      return Invalid(kOp, "a bias needs alpha == 1 and beta == 0", args);
    }
  }
  if (backend == nullptr) return absl::OkStatus();
  const int64_t batch = NumElements(batch_a);
  if (batch == 0 || m == 0 || n == 0) return absl::OkStatus();
  if (k == 0) {  // Empty sum: c = beta * c, or the bias in every row.
    if (options.bias != nullptr) {
      FSDPP_ASSIGN_OR_RETURN(Tensor rows, c->Reshape({batch * m, n}));
      for (int64_t r = 0; r < batch * m; ++r) {
        FSDPP_ASSIGN_OR_RETURN(Tensor row, rows.Narrow(r, 1));
        FSDPP_ASSIGN_OR_RETURN(Tensor flat, row.Reshape({n}));
        FSDPP_RETURN_IF_ERROR(Copy(*options.bias, &flat));
      }
      return absl::OkStatus();
    }
    if (options.beta == 0.0f) return Zero(c);
    return Scale(*c, options.beta, c);
  }
  return backend->Matmul(MatmulArgs{
      &a, &b, c, batch, m, n, k, options.transpose_a, options.transpose_b,
      broadcast_b, options.alpha, options.beta, options.bias});
}

absl::Status Softmax(const Tensor& x, Tensor* y, bool causal) {
  constexpr const char* kOp = "Softmax";
  FSDPP_BACKEND_OR_RETURN(backend, kOp, {{"x", &x}, {"y", y}});
  FSDPP_RETURN_IF_ERROR(SameDType(kOp, {{"x", &x}, {"y", y}}));
  FSDPP_RETURN_IF_ERROR(SameShape(kOp, {{"x", &x}, {"y", y}}));
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"x", &x}));
  if (x.ndim() < (causal ? 2 : 1) || x.dim(-1) == 0) {
    return Invalid(kOp,
                   causal ? "causal softmax needs [.., Tq, Tk] with Tk > 0"
                          : "needs a non-empty last dim",
                   {{"x", &x}});
  }
  const int64_t n = x.dim(-1);
  int64_t tq = 1, offset = -1;
  if (causal) {
    tq = x.dim(-2);
    if (tq > n)
      return Invalid(kOp, "causal softmax needs Tq <= Tk", {{"x", &x}});
    offset = n - tq;
  }
  return backend == nullptr ? absl::OkStatus()
                            : backend->Softmax(x, Rows(x), n, tq, offset, y);
}

absl::Status SoftmaxBackward(const Tensor& y, const Tensor& dy, Tensor* dx) {
  constexpr const char* kOp = "SoftmaxBackward";
  std::initializer_list<Named> args = {{"y", &y}, {"dy", &dy}, {"dx", dx}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(SameDType(kOp, args));
  FSDPP_RETURN_IF_ERROR(SameShape(kOp, args));
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"y", &y}));
  if (y.ndim() == 0) return Invalid(kOp, "needs at least one dim", args);
  return backend == nullptr
             ? absl::OkStatus()
             : backend->SoftmaxBackward(y, dy, Rows(y), y.dim(-1), dx);
}

namespace {

// [B, H, T, hd], [B, KV, T, hd] x 2 with KV dividing H; the sizes.
struct AttentionDims {
  int64_t b, h, kv, t, hd;
};

absl::StatusOr<AttentionDims> CheckAttention(
    const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
    std::initializer_list<Named> args) {
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"q", &q}));
  if (q.ndim() != 4 || k.ndim() != 4 || k.shape() != v.shape() ||
      k.dim(0) != q.dim(0) || k.dim(2) != q.dim(2) || k.dim(3) != q.dim(3)) {
    return Invalid(op,
                   "needs q [B, H, T, hd] and k, v [B, KV, T, hd] with the "
                   "same B, T and hd",
                   args);
  }
  const AttentionDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), q.dim(3)};
  if (d.kv == 0 || d.h % d.kv != 0) {
    return Invalid(op,
                   absl::StrCat("the kv heads (", d.kv,
                                ") must divide the query heads (", d.h, ")"),
                   args);
  }
  return d;
}

// The key ranges' bounds: each null, or i32 [B, T] on the op's device.
absl::Status CheckKeyRange(const char* op, const KeyRange& keys,
                           const Device& device, const AttentionDims& d,
                           std::initializer_list<Named> args) {
  for (const auto& [name, bound] :
       {std::pair{"keys.lo", keys.lo}, std::pair{"keys.hi", keys.hi}}) {
    if (bound == nullptr) continue;
    if (!bound->defined() || bound->dtype() != DType::kI32 ||
        bound->shape() != Shape{d.b, d.t} || bound->device() != device) {
      return Invalid(
          op,
          absl::StrCat(name, " ",
                       bound->defined() ? bound->ToString() : "(undefined)",
                       " must be i32 [B, T] on the device of q"),
          args);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CausalAttention(const Tensor& q, const Tensor& k, const Tensor& v,
                             float scale, Tensor* out, Tensor* lse,
                             const KeyRange& keys) {
  constexpr const char* kOp = "CausalAttention";
  std::initializer_list<Named> args = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", out}, {"lse", lse}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(
      SameDType(kOp, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", out}}));
  FSDPP_ASSIGN_OR_RETURN(AttentionDims d, CheckAttention(kOp, q, k, v, args));
  FSDPP_RETURN_IF_ERROR(SameShape(kOp, {{"q", &q}, {"out", out}}));
  if (lse->dtype() != DType::kF32 || lse->shape() != Shape{d.b, d.h, d.t}) {
    return Invalid(kOp, "lse must be f32 [B, H, T]", args);
  }
  FSDPP_RETURN_IF_ERROR(CheckKeyRange(kOp, keys, backend_device, d, args));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->CausalAttention(q, k, v, d.b, d.h, d.kv, d.t, d.hd,
                                        scale, keys, out, lse);
}

absl::Status CausalAttentionBackward(const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout,
                                     float scale, Tensor* dq, Tensor* dk,
                                     Tensor* dv, const KeyRange& keys) {
  constexpr const char* kOp = "CausalAttentionBackward";
  std::initializer_list<Named> args = {
      {"q", &q},       {"k", &k},  {"v", &v},  {"out", &out}, {"lse", &lse},
      {"dout", &dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(SameDType(kOp, {{"q", &q},
                                        {"k", &k},
                                        {"v", &v},
                                        {"out", &out},
                                        {"dout", &dout},
                                        {"dq", dq},
                                        {"dk", dk},
                                        {"dv", dv}}));
  FSDPP_ASSIGN_OR_RETURN(AttentionDims d, CheckAttention(kOp, q, k, v, args));
  FSDPP_RETURN_IF_ERROR(
      SameShape(kOp, {{"q", &q}, {"out", &out}, {"dout", &dout}, {"dq", dq}}));
  FSDPP_RETURN_IF_ERROR(SameShape(kOp, {{"k", &k}, {"dk", dk}, {"dv", dv}}));
  if (lse.dtype() != DType::kF32 || lse.shape() != Shape{d.b, d.h, d.t}) {
    return Invalid(kOp, "lse must be f32 [B, H, T]", args);
  }
  FSDPP_RETURN_IF_ERROR(CheckKeyRange(kOp, keys, backend_device, d, args));
  return backend == nullptr ? absl::OkStatus()
                            : backend->CausalAttentionBackward(
                                  q, k, v, out, lse, dout, d.b, d.h, d.kv, d.t,
                                  d.hd, scale, keys, dq, dk, dv);
}

absl::Status MergeAttention(const Tensor& out_part, const Tensor& lse_part,
                            Tensor* out, Tensor* lse) {
  constexpr const char* kOp = "MergeAttention";
  std::initializer_list<Named> args = {{"out_part", &out_part},
                                       {"lse_part", &lse_part},
                                       {"out", out},
                                       {"lse", lse}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"out", out}));
  FSDPP_RETURN_IF_ERROR(
      SameDType(kOp, {{"out_part", &out_part}, {"out", out}}));
  FSDPP_RETURN_IF_ERROR(
      SameShape(kOp, {{"out_part", &out_part}, {"out", out}}));
  if (out->ndim() != 4 || lse->dtype() != DType::kF32 ||
      lse_part.dtype() != DType::kF32 ||
      lse->shape() != Shape{out->dim(0), out->dim(1), out->dim(2)} ||
      lse_part.shape() != lse->shape()) {
    return Invalid(kOp, "needs out [B, H, T, hd] and lse f32 [B, H, T]", args);
  }
  if (backend == nullptr || out->numel() == 0) return absl::OkStatus();
  return backend->MergeAttention(out_part, lse_part, lse->numel(), out->dim(3),
                                 out, lse);
}

absl::Status DocumentMask(const Tensor& ids, int64_t eot_id, Tensor* key_start,
                          Tensor* positions) {
  constexpr const char* kOp = "DocumentMask";
  std::initializer_list<Named> args = {
      {"ids", &ids}, {"key_start", key_start}, {"positions", positions}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  if (ids.ndim() != 2 ||
      (ids.dtype() != DType::kI32 && ids.dtype() != DType::kI64)) {
    return Invalid(kOp, "ids must be i32 or i64 [B, T]", args);
  }
  if (key_start->dtype() != DType::kI32 || key_start->shape() != ids.shape() ||
      positions->dtype() != DType::kI32 || positions->shape() != ids.shape()) {
    return Invalid(kOp, "key_start and positions must be i32 shaped like ids",
                   args);
  }
  if (ids.dim(1) > std::numeric_limits<int32_t>::max()) {
    return Invalid(kOp, "rows longer than int32 positions", args);
  }
  if (backend == nullptr || ids.numel() == 0) return absl::OkStatus();
  return backend->DocumentMask(ids, ids.dim(0), ids.dim(1), eot_id, key_start,
                               positions);
}

namespace {

// Checks x [.., C] against a [C] parameter; returns C.
absl::StatusOr<int64_t> NormDims(const char* op, const Tensor& x,
                                 const char* param_name, const Tensor& param) {
  if (x.ndim() == 0 || x.dim(-1) == 0) {
    return Invalid(op, "x needs a non-empty last dim", {{"x", &x}});
  }
  const int64_t c = x.dim(-1);
  if (param.ndim() != 1 || param.dim(0) != c) {
    return Invalid(op, absl::StrCat(param_name, " must be [", c, "]"),
                   {{"x", &x}, {param_name, &param}});
  }
  return c;
}

// The checks LayerNorm and RmsNorm share: a float x; x, weight and out of
// one dtype; out shaped like x; x [.., C] and weight [C]. Returns C.
absl::StatusOr<int64_t> CheckNorm(const char* op, const Tensor& x,
                                  const Tensor& weight, const Tensor* out) {
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"x", &x}));
  FSDPP_RETURN_IF_ERROR(
      SameDType(op, {{"x", &x}, {"weight", &weight}, {"out", out}}));
  FSDPP_RETURN_IF_ERROR(SameShape(op, {{"x", &x}, {"out", out}}));
  return NormDims(op, x, "weight", weight);
}

// The checks LayerNormBackward and RmsNormBackward share: a float x; dy, x,
// weight, dx and dweight of one dtype; dy and dx shaped like x, dweight like
// weight; x [.., C] and weight [C]. Returns C.
absl::StatusOr<int64_t> CheckNormBackward(const char* op, const Tensor& dy,
                                          const Tensor& x, const Tensor& weight,
                                          const Tensor* dx,
                                          const Tensor* dweight) {
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"x", &x}));
  FSDPP_RETURN_IF_ERROR(SameDType(op, {{"dy", &dy},
                                       {"x", &x},
                                       {"weight", &weight},
                                       {"dx", dx},
                                       {"dweight", dweight}}));
  FSDPP_RETURN_IF_ERROR(SameShape(op, {{"dy", &dy}, {"x", &x}, {"dx", dx}}));
  FSDPP_RETURN_IF_ERROR(
      SameShape(op, {{"weight", &weight}, {"dweight", dweight}}));
  return NormDims(op, x, "weight", weight);
}

}  // namespace

absl::Status LayerNorm(const Tensor& x, const Tensor& weight,
                       const Tensor* bias, float eps, Tensor* out, Tensor* mean,
                       Tensor* rstd) {
  constexpr const char* kOp = "LayerNorm";
  std::initializer_list<Named> args = {{"x", &x},
                                       {"weight", &weight},
                                       {"out", out},
                                       {"mean", mean},
                                       {"rstd", rstd}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_ASSIGN_OR_RETURN(int64_t c, CheckNorm(kOp, x, weight, out));
  if (bias != nullptr) {
    FSDPP_RETURN_IF_ERROR(
        CommonDevice(kOp, {{"x", &x}, {"bias", bias}}).status());
    FSDPP_RETURN_IF_ERROR(SameDType(kOp, {{"x", &x}, {"bias", bias}}));
    FSDPP_RETURN_IF_ERROR(NormDims(kOp, x, "bias", *bias).status());
  }
  const int64_t rows = Rows(x);
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"mean", mean}, rows));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"rstd", rstd}, rows));
  if (!(eps >= 0.0f)) return Invalid(kOp, "eps must be >= 0", {{"x", &x}});
  return backend == nullptr ? absl::OkStatus()
                            : backend->LayerNorm(x, weight, bias, eps, rows, c,
                                                 out, mean, rstd);
}

absl::Status LayerNormBackward(const Tensor& dy, const Tensor& x,
                               const Tensor& weight, const Tensor& mean,
                               const Tensor& rstd, Tensor* dx, Tensor* dweight,
                               Tensor* dbias) {
  constexpr const char* kOp = "LayerNormBackward";
  std::initializer_list<Named> args = {
      {"dy", &dy},     {"x", &x},  {"weight", &weight}, {"mean", &mean},
      {"rstd", &rstd}, {"dx", dx}, {"dweight", dweight}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_ASSIGN_OR_RETURN(int64_t c,
                         CheckNormBackward(kOp, dy, x, weight, dx, dweight));
  if (dbias != nullptr) {
    FSDPP_RETURN_IF_ERROR(
        CommonDevice(kOp, {{"x", &x}, {"dbias", dbias}}).status());
    FSDPP_RETURN_IF_ERROR(SameDType(kOp, {{"x", &x}, {"dbias", dbias}}));
    FSDPP_RETURN_IF_ERROR(NormDims(kOp, x, "dbias", *dbias).status());
  }
  const int64_t rows = Rows(x);
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"mean", &mean}, rows));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"rstd", &rstd}, rows));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->LayerNormBackward(dy, x, weight, mean, rstd, rows, c,
                                          dx, dweight, dbias);
}

namespace {

// Checks the [B, T, N, hd] / [B, n, T, hd] pair of SplitHeads / MergeHeads.
absl::Status CheckHeads(const char* op, const Tensor& wide, const Tensor& heads,
                        int64_t first, std::initializer_list<Named> args) {
  FSDPP_RETURN_IF_ERROR(SameDType(op, args));
  if (wide.ndim() != 4 || heads.ndim() != 4) {
    return Invalid(op, "needs 4-D [B, T, N, hd] and [B, n, T, hd]", args);
  }
  if (wide.dim(0) != heads.dim(0) || wide.dim(1) != heads.dim(2) ||
      wide.dim(3) != heads.dim(3)) {
    return Invalid(op,
                   "B, T or hd differ between [B, T, N, hd] and "
                   "[B, n, T, hd]",
                   args);
  }
  if (first < 0 || first + heads.dim(1) > wide.dim(2)) {
    return Invalid(
        op,
        absl::StrCat("heads [", first, ", ", first + heads.dim(1),
                     ") are outside the ", wide.dim(2), " there are"),
        args);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CopyColumns(const Tensor& src, int64_t src_first, int64_t count,
                         Tensor* dst, int64_t dst_first) {
  constexpr const char* kOp = "CopyColumns";
  std::initializer_list<Named> args = {{"src", &src}, {"dst", dst}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  if (src.ndim() != 2 || dst->ndim() != 2 || src.dim(0) != dst->dim(0) ||
      src.dtype() != dst->dtype()) {
    return Invalid(kOp, "needs src [R, S] and dst [R, D] of one dtype", args);
  }
  if (count < 0 || src_first < 0 || dst_first < 0 ||
      src_first + count > src.dim(1) || dst_first + count > dst->dim(1)) {
    return Invalid(kOp,
                   absl::StrCat("columns [", src_first, ", ", src_first + count,
                                ") into [", dst_first, ", ", dst_first + count,
                                ") are out of range"),
                   args);
  }
  if (backend == nullptr || count == 0 || src.dim(0) == 0) {
    return absl::OkStatus();
  }
  return backend->CopyColumns(src, src_first, dst, dst_first, src.dim(0),
                              count);
}

absl::Status SplitHeads(const Tensor& src, int64_t first, Tensor* dst) {
  constexpr const char* kOp = "SplitHeads";
  std::initializer_list<Named> args = {{"src", &src}, {"dst", dst}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(CheckHeads(kOp, src, *dst, first, args));
  if (backend == nullptr || dst->numel() == 0) return absl::OkStatus();
  return backend->CopyHeads(src, dst, src.dim(0), src.dim(1), src.dim(2), first,
                            dst->dim(1), src.dim(3), /*merge=*/false);
}

absl::Status MergeHeads(const Tensor& src, int64_t first, Tensor* dst) {
  constexpr const char* kOp = "MergeHeads";
  std::initializer_list<Named> args = {{"src", &src}, {"dst", dst}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_RETURN_IF_ERROR(CheckHeads(kOp, *dst, src, first, args));
  if (backend == nullptr || src.numel() == 0) return absl::OkStatus();
  return backend->CopyHeads(src, dst, dst->dim(0), dst->dim(1), dst->dim(2),
                            first, src.dim(1), dst->dim(3), /*merge=*/true);
}

absl::Status Rope(Tensor* x, const std::vector<float>& inv_freq, bool inverse,
                  const Tensor* positions) {
  constexpr const char* kOp = "Rope";
  FSDPP_BACKEND_OR_RETURN(backend, kOp, {{"x", x}});
  FSDPP_RETURN_IF_ERROR(FloatDType(kOp, {"x", x}));
  if (x->ndim() < 2 || x->dim(-1) < 2 || x->dim(-1) % 2 != 0) {
    return Invalid(kOp, "needs [.., T, hd] with an even head dim hd >= 2",
                   {{"x", x}});
  }
  const int64_t hd = x->dim(-1);
  if (static_cast<int64_t>(inv_freq.size()) != hd / 2) {
    return Invalid(
        kOp,
        absl::StrCat("has ", inv_freq.size(), " frequencies for head dim ", hd,
                     " (needs ", hd / 2, ")"),
        {{"x", x}});
  }
  if (positions != nullptr &&
      (!positions->defined() || positions->dtype() != DType::kI32 ||
       positions->ndim() != 2 || x->ndim() != 4 ||
       positions->shape() != Shape{x->dim(0), x->dim(2)} ||
       positions->device() != backend_device)) {
    return Invalid(kOp,
                   "positions must be i32 [B, T] on x's device, x [B, N, T, "
                   "hd]",
                   {{"x", x}, {"positions", positions}});
  }
  if (backend == nullptr || x->numel() == 0) return absl::OkStatus();
  return backend->Rope(x, Rows(*x), x->dim(-2), hd, inv_freq.data(), inverse,
                       positions);
}

absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps,
                     Tensor* out, Tensor* rstd) {
  constexpr const char* kOp = "RmsNorm";
  std::initializer_list<Named> args = {
      {"x", &x}, {"weight", &weight}, {"out", out}, {"rstd", rstd}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_ASSIGN_OR_RETURN(int64_t c, CheckNorm(kOp, x, weight, out));
  const int64_t rows = Rows(x);
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"rstd", rstd}, rows));
  if (!(eps >= 0.0f)) return Invalid(kOp, "eps must be >= 0", {{"x", &x}});
  return backend == nullptr
             ? absl::OkStatus()
             : backend->RmsNorm(x, weight, eps, rows, c, out, rstd);
}

absl::Status RmsNormBackward(const Tensor& dy, const Tensor& x,
                             const Tensor& weight, const Tensor& rstd,
                             Tensor* dx, Tensor* dweight) {
  constexpr const char* kOp = "RmsNormBackward";
  std::initializer_list<Named> args = {
      {"dy", &dy},     {"x", &x},  {"weight", &weight},
      {"rstd", &rstd}, {"dx", dx}, {"dweight", dweight}};
  FSDPP_BACKEND_OR_RETURN(backend, kOp, args);
  FSDPP_ASSIGN_OR_RETURN(int64_t c,
                         CheckNormBackward(kOp, dy, x, weight, dx, dweight));
  const int64_t rows = Rows(x);
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"rstd", &rstd}, rows));
  return backend == nullptr ? absl::OkStatus()
                            : backend->RmsNormBackward(dy, x, weight, rstd,
                                                       rows, c, dx, dweight);
}

namespace {

// Checks ids (N elements) against a [V, C] table and rows of `rows_tensor`.
absl::Status EmbeddingDims(const char* op, const Tensor& ids,
                           const Tensor& table, const char* rows_name,
                           const Tensor& rows_tensor) {
  std::initializer_list<Named> args = {
      {"ids", &ids}, {"table", &table}, {rows_name, &rows_tensor}};
  FSDPP_RETURN_IF_ERROR(IdDType(op, {"ids", &ids}));
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"table", &table}));
  FSDPP_RETURN_IF_ERROR(
      SameDType(op, {{"table", &table}, {rows_name, &rows_tensor}}));
  if (table.ndim() != 2) return Invalid(op, "table must be [V, C]", args);
  if (rows_tensor.ndim() < 1 || rows_tensor.dim(-1) != table.dim(1) ||
      Rows(rows_tensor) != ids.numel()) {
    return Invalid(op,
                   absl::StrCat(rows_name, " must have ", ids.numel(),
                                " rows of ", table.dim(1)),
                   args);
  }
  return absl::OkStatus();
}

// Resolves rows.vocab = -1 to the table's rows and checks that the table's
// rows lie inside the vocabulary.
absl::Status CheckEmbeddingRows(const char* op, const Tensor& table,
                                EmbeddingRows* rows) {
  if (rows->vocab == -1) rows->vocab = table.dim(0);
  if (rows->row_offset < 0 || rows->vocab < 0 ||
      rows->row_offset + table.dim(0) > rows->vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": table ", table.ToString(), " at row offset ", rows->row_offset,
        " does not fit a vocabulary of ", rows->vocab, " rows"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Embedding(const Tensor& ids, const Tensor& table, Tensor* out,
                       EmbeddingRows rows) {
  constexpr const char* kOp = "Embedding";
  FSDPP_BACKEND_OR_RETURN(backend, kOp,
                          {{"ids", &ids}, {"table", &table}, {"out", out}});
  FSDPP_RETURN_IF_ERROR(EmbeddingDims(kOp, ids, table, "out", *out));
  FSDPP_RETURN_IF_ERROR(CheckEmbeddingRows(kOp, table, &rows));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->Embedding(ids, table, ids.numel(), table.dim(0),
                                  table.dim(1), rows.row_offset, rows.vocab,
                                  out);
}

absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& dout,
                               Tensor* dtable, EmbeddingRows rows) {
  constexpr const char* kOp = "EmbeddingBackward";
  FSDPP_BACKEND_OR_RETURN(backend, kOp,
                          {{"ids", &ids}, {"dout", &dout}, {"dtable", dtable}});
  FSDPP_RETURN_IF_ERROR(EmbeddingDims(kOp, ids, *dtable, "dout", dout));
  FSDPP_RETURN_IF_ERROR(CheckEmbeddingRows(kOp, *dtable, &rows));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->EmbeddingBackward(ids, dout, ids.numel(),
                                          dtable->dim(0), dtable->dim(1),
                                          rows.row_offset, rows.vocab, dtable);
}

namespace {

absl::Status CrossEntropyDims(const char* op, const Tensor& logits,
                              const Tensor& targets) {
  std::initializer_list<Named> args = {{"logits", &logits},
                                       {"targets", &targets}};
  FSDPP_RETURN_IF_ERROR(FloatDType(op, {"logits", &logits}));
  FSDPP_RETURN_IF_ERROR(IdDType(op, {"targets", &targets}));
  if (logits.ndim() < 1 || logits.dim(-1) == 0 ||
      Rows(logits) != targets.numel()) {
    return Invalid(op, "logits must be [.., V] with one row per target", args);
  }
  return absl::OkStatus();
}

}  // namespace

// The optional per-row log-sum-exp of a cross-entropy: null, or f32 with
// one element per row on the logits' device.
absl::Status CheckRowLse(const char* op, const Tensor* lse,
                         const Tensor& logits, int64_t rows) {
  if (lse == nullptr) return absl::OkStatus();
  if (!lse->defined()) return Invalid(op, "lse is undefined", {{"lse", lse}});
  if (lse->device() != logits.device()) {
    return Invalid(op, "tensors are on different devices",
                   {{"logits", &logits}, {"lse", lse}});
  }
  return F32WithNumel(op, {"lse", lse}, rows);
}

absl::Status CrossEntropy(const Tensor& logits, const Tensor& targets,
                          int64_t ignore_index, Tensor* losses, Tensor* lse) {
  constexpr const char* kOp = "CrossEntropy";
  FSDPP_BACKEND_OR_RETURN(
      backend, kOp,
      {{"logits", &logits}, {"targets", &targets}, {"losses", losses}});
  FSDPP_RETURN_IF_ERROR(CrossEntropyDims(kOp, logits, targets));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"losses", losses}, targets.numel()));
  FSDPP_RETURN_IF_ERROR(CheckRowLse(kOp, lse, logits, targets.numel()));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->CrossEntropy(logits, targets, targets.numel(),
                                     logits.dim(-1), ignore_index, losses, lse);
}

namespace {

// The slice [vocab_offset, vocab_offset + Vl) of a vocabulary of vocab_size.
absl::Status CheckVocabSlice(const char* op, const Tensor& logits,
                             int64_t vocab_offset, int64_t vocab_size) {
  if (vocab_offset < 0 || vocab_offset + logits.dim(-1) > vocab_size) {
    return Invalid(op,
                   absl::StrCat("the slice [", vocab_offset, ", ",
                                vocab_offset + logits.dim(-1),
                                ") is outside the vocabulary of ", vocab_size),
                   {{"logits", &logits}});
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CrossEntropyShardStats(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_offset, int64_t vocab_size,
                                    int64_t ignore_index, Tensor* max,
                                    Tensor* sumexp, Tensor* target_logit) {
  constexpr const char* kOp = "CrossEntropyShardStats";
  FSDPP_BACKEND_OR_RETURN(backend, kOp,
                          {{"logits", &logits},
                           {"targets", &targets},
                           {"max", max},
                           {"sumexp", sumexp},
                           {"target_logit", target_logit}});
  FSDPP_RETURN_IF_ERROR(CrossEntropyDims(kOp, logits, targets));
  FSDPP_RETURN_IF_ERROR(CheckVocabSlice(kOp, logits, vocab_offset, vocab_size));
  const int64_t n = targets.numel();
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"max", max}, n));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"sumexp", sumexp}, n));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"target_logit", target_logit}, n));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->CrossEntropyShardStats(
                   logits, targets, n, logits.dim(-1), vocab_offset, vocab_size,
                   ignore_index, max, sumexp, target_logit);
}

absl::Status CrossEntropyShardBackward(const Tensor& logits,
                                       const Tensor& targets,
                                       int64_t vocab_offset, int64_t vocab_size,
                                       int64_t ignore_index, const Tensor& max,
                                       const Tensor& sumexp,
                                       const Tensor& dlosses, Tensor* dlogits) {
  constexpr const char* kOp = "CrossEntropyShardBackward";
  FSDPP_BACKEND_OR_RETURN(backend, kOp,
                          {{"logits", &logits},
                           {"targets", &targets},
                           {"max", &max},
                           {"sumexp", &sumexp},
                           {"dlosses", &dlosses},
                           {"dlogits", dlogits}});
  FSDPP_RETURN_IF_ERROR(CrossEntropyDims(kOp, logits, targets));
  FSDPP_RETURN_IF_ERROR(CheckVocabSlice(kOp, logits, vocab_offset, vocab_size));
  const int64_t n = targets.numel();
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"max", &max}, n));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"sumexp", &sumexp}, n));
  FSDPP_RETURN_IF_ERROR(F32WithNumel(kOp, {"dlosses", &dlosses}, n));
  FSDPP_RETURN_IF_ERROR(
      SameDType(kOp, {{"logits", &logits}, {"dlogits", dlogits}}));
  FSDPP_RETURN_IF_ERROR(
      SameShape(kOp, {{"logits", &logits}, {"dlogits", dlogits}}));
  return backend == nullptr
             ? absl::OkStatus()
             : backend->CrossEntropyShardBackward(
                   logits, targets, max, sumexp, dlosses, n, logits.dim(-1),
                   vocab_offset, vocab_size, ignore_index, dlogits);
}

absl::Status CrossEntropyBackward(const Tensor& logits, const Tensor& targets,
                                  int64_t ignore_index, const Tensor& dlosses,
                                  Tensor* dlogits, const Tensor* lse) {
  constexpr const char* kOp = "CrossEntropyBackward";
  FSDPP_BACKEND_OR_RETURN(backend, kOp,
                          {{"logits", &logits},
                           {"targets", &targets},
                           {"dlosses", &dlosses},
                           {"dlogits", dlogits}});
  FSDPP_RETURN_IF_ERROR(CrossEntropyDims(kOp, logits, targets));
  FSDPP_RETURN_IF_ERROR(
      F32WithNumel(kOp, {"dlosses", &dlosses}, targets.numel()));
  FSDPP_RETURN_IF_ERROR(
      SameDType(kOp, {{"logits", &logits}, {"dlogits", dlogits}}));
  FSDPP_RETURN_IF_ERROR(
      SameShape(kOp, {{"logits", &logits}, {"dlogits", dlogits}}));
  FSDPP_RETURN_IF_ERROR(CheckRowLse(kOp, lse, logits, targets.numel()));
  return backend == nullptr ? absl::OkStatus()
                            : backend->CrossEntropyBackward(
                                  logits, targets, dlosses, targets.numel(),
                                  logits.dim(-1), ignore_index, lse, dlogits);
}

}  // namespace fsdpp
