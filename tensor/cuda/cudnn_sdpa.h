// Causal scaled-dot-product attention on tensor cores through cuDNN's fused
// flash-attention engines, built on cuDNN's C backend API (--config=cuda
// only; the CUDA backend calls it through tensor/cuda/cudnn_attention.h).
//
// What it computes is CausalAttention / CausalAttentionBackward of
// tensor/ops.h: q [B, H, T, D], k and v [B, Hkv, T, D] (query head h reads
// kv head h / (H / Hkv)), query i attends to keys 0..i, out [B, H, T, D],
// and the statistics Stats [B, H, T, 1] f32, the natural-log log-sum-exp of
// each query row's scaled scores. Stats is laid out [B, H, T] contiguous, so
// it is byte for byte the `lse` fsdpp's own attention saves: no conversion.
//
// Which graph. cuDNN 9.13.1 added a unified SDPA operation
// (CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR / _BWD_), but in 9.19 it has
// no causal mask: its attributes are Q, K, V, O, Stats, scale, a block mask
// (tile-granular, so not a causal diagonal), page tables and sequence
// lengths (cudnn_graph_v9.h); cudnn-frontend expresses causal masking on
// the unified node only from cuDNN 9.21 (left/right bound or score-modifier
// subgraph), and never builds the backward descriptor. So every cuDNN 9.x
// takes the composite graph here, the one cuDNN's SDPA engines recognise:
//   forward:  S = Q K^T (f32) * scale; causal mask (GEN_INDEX row/col,
//             CMP_GE, BINARY_SELECT with the mask value); softmax as max,
//             sub, exp, sum, div, Stats = max + log(sum); O = P V.
//   backward: softmax_sum = rowsum(dO * O); P = exp(mask(S * scale - Stats));
//             dV = P^T dO; dS = P (dO V^T - softmax_sum) * scale;
//             dK = dS^T Q; dQ = dS K (GQA: dK, dV summed over each kv
//             head's query heads by a reduction).
// What depends on the running cuDNN (cudnnGetVersion()) is in
// SdpaBackendTraits. Deterministic backward: dQ is written by its matmul
// directly (the dP-workspace form that cuDNN runs without atomics) and
// engine configs noted CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC are skipped;
// the non-deterministic form accumulates dQ in an f32 workspace tensor.
//
// Use: BuildSdpaForward / BuildSdpaBackward check the shapes (InvalidArgument
// before any cuDNN call) and finalize every tensor and operation descriptor,
// which needs no GPU. SdpaPlan::Create finalizes the operation graph, asks
// the heuristics for engine configs and builds the first plan that finalizes;
// Execute runs it. Plans are built once per shape: SdpaPlanCache.
#ifndef FSDPP_TENSOR_CUDA_CUDNN_SDPA_H_
#define FSDPP_TENSOR_CUDA_CUDNN_SDPA_H_

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/dtype.h"
#include "tensor/cuda/cudnn_util.h"

namespace fsdpp {
namespace gpu {

// Largest head dim accepted: the backward's limit on Ampere and Blackwell
// (Hopper goes to 256); D must also be a multiple of 8.
inline constexpr int64_t kSdpaMaxHeadDim = 128;

// A 4-D view [batch, heads, seq, head_dim] of a device buffer: dims and
// strides in elements. The head dim must be contiguous (stride 1) and every
// other stride a multiple of 8 elements (16-byte rows).
struct SdpaTensor {
  std::array<int64_t, 4> dims{};
  std::array<int64_t, 4> strides{};
};

// A contiguous [b, n, t, d] tensor.
SdpaTensor BhtdTensor(int64_t b, int64_t n, int64_t t, int64_t d);
// n heads of a [b, t, row_heads, d] buffer seen as [b, n, t, d]: the
// layout of a fused QKV projection ([B, T, 3, H, D] has row_heads = 3H; its
// q, k and v start H * D elements apart) or of attention's [B, T, H, D]
// output. The caller offsets the pointer to the first head.
SdpaTensor BthdTensor(int64_t b, int64_t n, int64_t t, int64_t d,
                      int64_t row_heads);

// The forward's inputs and outputs.
struct SdpaShape {
  DType dtype = DType::kBF16;  // of q, k, v, o: bf16 or f16
  SdpaTensor q;                // [B, H, T, D]
  SdpaTensor k;                // [B, Hkv, T, D], Hkv divides H
  SdpaTensor v;                // like k
  SdpaTensor o;                // like q
  float scale = 0.0f;          // 0: 1 / sqrt(D)
};

// The backward's: the forward's (o is its input now) plus the gradients.
struct SdpaBackwardShape {
  SdpaShape forward;
  SdpaTensor d_o;  // like q
  SdpaTensor d_q;  // like q
  SdpaTensor d_k;  // like k
  SdpaTensor d_v;  // like v
  // Bit-identical reruns (fsdpp's promise); false lets cuDNN accumulate dQ
  // with atomics.
  bool deterministic = true;
};

// The scale the graph applies: shape.scale, or 1 / sqrt(D) when it is 0.
float SdpaScale(const SdpaShape& shape);
// Stats' layout: f32 [B, H, T, 1], strides {H T, T, 1, 1} (= lse [B, H, T]).
SdpaTensor SdpaStatsTensor(const SdpaShape& shape);

// InvalidArgument naming the tensor and the rule when the shapes cannot
// run: dtype not bf16/f16, dims that do not agree, H not a multiple of Hkv,
// D over kSdpaMaxHeadDim or not a multiple of 8, bad strides, a scale that
// is negative or not finite (and for the backward T = 1, which cuDNN
// refuses).
absl::Status ValidateSdpaShape(const SdpaShape& shape);
absl::Status ValidateSdpaBackwardShape(const SdpaBackwardShape& shape);

// What the graph and its execution depend on in the running cuDNN.
struct SdpaBackendTraits {
  size_t version = 0;  // cudnnGetVersion(): major * 10000 + minor * 100 + patch
  // Written over masked scores: -inf from 9.10, the lowest float before
  // (older engines prefer a finite value).
  float mask_value = 0.0f;
  // Before 9.6 the non-deterministic backward's f32 dQ accumulator must be
  // zeroed by the caller (cudnn-frontend stops zeroing it from 9.6).
  bool zero_dq_accumulator = false;
  // Before 9.8 an operation graph needs a handle to finalize.
  bool graph_needs_handle = false;
  // 9.10.0 and 9.10.1 have known backward bugs (cudnn-frontend refuses them).
  bool backward_broken = false;
};
SdpaBackendTraits SdpaTraitsFor(size_t cudnn_version);
// FailedPrecondition unless `cudnn_version` is a cuDNN 9 this code supports
// (for the backward: not 9.10.0 / 9.10.1).
absl::Status CheckSdpaCudnnVersion(size_t cudnn_version, bool backward);

// The unique ids of the tensors a caller binds (the variant pack).
enum class SdpaUid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
};

// The finalized tensor and operation descriptors of one SDPA graph (forward
// or backward). Move-only; owns every descriptor.
class SdpaGraph {
 public:
  enum class Kind { kForward, kBackward };

  SdpaGraph(SdpaGraph&&);
  SdpaGraph& operator=(SdpaGraph&&);
  ~SdpaGraph();

  Kind kind() const { return kind_; }
  // The backward's flag (true for a forward graph, which has no atomics).
  bool deterministic() const { return deterministic_; }
  const SdpaBackendTraits& traits() const { return traits_; }
  int64_t num_operations() const { return static_cast<int64_t>(ops_.size()); }
  int64_t num_tensors() const { return static_cast<int64_t>(tensors_.size()); }
  // The finalized descriptor of a bound tensor (null if the graph has none).
  cudnnBackendDescriptor_t tensor(SdpaUid uid) const;
  // Bytes of the f32 tensors the graph keeps in the caller's workspace (the
  // backward's softmax_sum and, non-deterministic, its dQ accumulator),
  // each rounded up to 256 bytes; the plan's own workspace follows them.
  int64_t intermediate_bytes() const;
  // One line per operation in graph order ("exp(sub) -> exp"), then one per
  // bound tensor; for tests and logs.
  std::string DebugString() const;
  // Finalizes an operation graph over the operations. `handle` may be null
  // where traits().graph_needs_handle is false: that checks each operation's
  // tensors against each other without a GPU (the builder itself checks
  // that every intermediate has one producer and a consumer).
  absl::StatusOr<CudnnDescriptor> MakeOperationGraph(
      cudnnHandle_t handle) const;

 private:
  friend class SdpaGraphBuilder;
  struct alignas(16) ByValue {  // the value's address is 16-byte aligned
    float value;
    int64_t uid;
  };
  struct Intermediate {
    int64_t uid;
    int64_t offset;  // in the workspace, bytes
    int64_t bytes;
    bool zero;  // cudaMemsetAsync before each execution
  };
  SdpaGraph(Kind kind, SdpaBackendTraits traits);

  Kind kind_;
  SdpaBackendTraits traits_;
  bool deterministic_ = true;
  std::vector<CudnnDescriptor> tensors_;
  std::vector<CudnnDescriptor> ops_;
  // Matmul / pointwise / reduction descriptors the operations refer to.
  std::vector<CudnnDescriptor> op_attributes_;
  absl::flat_hash_map<int64_t, cudnnBackendDescriptor_t> bound_;
  // Scalars passed by value; a unique_ptr so their addresses stay put.
  std::unique_ptr<std::vector<ByValue>> by_value_;
  std::vector<Intermediate> intermediates_;
  std::vector<std::string> debug_lines_;

  friend class SdpaPlan;
};

// Builds the graphs; InvalidArgument (from Validate*) before any cuDNN call,
// FailedPrecondition for an unsupported cuDNN, otherwise the failing cuDNN
// call. Needs no GPU.
absl::StatusOr<SdpaGraph> BuildSdpaForward(const SdpaShape& shape);
absl::StatusOr<SdpaGraph> BuildSdpaBackward(const SdpaBackwardShape& shape);

// Device pointers for one execution. Forward: q, k, v in; o, stats out.
// Backward: q, k, v, o, stats, d_o in; d_q, d_k, d_v out. Each points at the
// first element of its SdpaTensor view, 16-byte aligned.
struct SdpaPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;       // written by the forward, read by the backward
  float* stats = nullptr;  // likewise
  const void* d_o = nullptr;
  void* d_q = nullptr;
  void* d_k = nullptr;
  void* d_v = nullptr;
};

// An execution plan for one SdpaGraph on the device of the handle it was
// built with.
class SdpaPlan {
 public:
  // Finalizes `graph`'s operation graph, takes the engine configs of
  // heuristics mode A (then the fallback mode), skipping non-deterministic
  // ones for a deterministic backward, and keeps the first whose execution
  // plan finalizes. Unimplemented when none does, with the last refusal.
  static absl::StatusOr<std::unique_ptr<SdpaPlan>> Create(cudnnHandle_t handle,
                                                          SdpaGraph graph);

  const SdpaGraph& graph() const { return graph_; }
  // Bytes of device workspace Execute needs (the graph's intermediates plus
  // the plan's own).
  int64_t workspace_bytes() const {
    return graph_.intermediate_bytes() + plan_workspace_bytes_;
  }
  // The engine's global index (for logs and tests).
  int64_t engine_index() const { return engine_index_; }

  // Runs the graph on `stream` (set on `handle`): the pointers the graph's
  // kind needs (InvalidArgument if one is null or misaligned) and a
  // workspace of workspace_bytes() (may be null when that is 0).
  absl::Status Execute(cudnnHandle_t handle, const SdpaPointers& pointers,
                       void* workspace, cudaStream_t stream) const;

 private:
  SdpaPlan(SdpaGraph graph, CudnnDescriptor operation_graph,
           CudnnDescriptor engine_config, CudnnDescriptor plan,
           int64_t plan_workspace_bytes, int64_t engine_index);

  SdpaGraph graph_;
  CudnnDescriptor operation_graph_;
  CudnnDescriptor engine_config_;
  CudnnDescriptor plan_;
  int64_t plan_workspace_bytes_;
  int64_t engine_index_;
};

// Plans built once per (kind, dtype, every tensor's dims and strides, scale,
// deterministic flag) on one handle's device. Thread-safe; plans live as
// long as the cache.
class SdpaPlanCache {
 public:
  // `handle` (not owned) builds every plan; keep one cache per device.
  explicit SdpaPlanCache(cudnnHandle_t handle) : handle_(handle) {}

  // The plan for `shape`, built on first use.
  absl::StatusOr<const SdpaPlan*> Forward(const SdpaShape& shape);
  absl::StatusOr<const SdpaPlan*> Backward(const SdpaBackwardShape& shape);
  // Plans built so far.
  int64_t size() const;

 private:
  // The shape as the cache key: kind, dtype, dims and strides, scale bits,
  // deterministic flag.
  using Key = std::vector<int64_t>;
  absl::StatusOr<const SdpaPlan*> GetOrBuild(
      Key key, const std::function<absl::StatusOr<SdpaGraph>()>& build);

  cudnnHandle_t handle_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, std::unique_ptr<SdpaPlan>> plans_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace gpu
}  // namespace fsdpp

#endif  // FSDPP_TENSOR_CUDA_CUDNN_SDPA_H_
