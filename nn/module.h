// Modules: a tree of named parameters with an explicit forward/backward
// contract and hook points — the seam FSDP attaches to.
//
// A Module owns parameters (value + accumulated gradient + how to initialise
// it) and child modules, named so that every parameter has a fully qualified
// name ("layers.3.attn.wq.weight"). Forward(x) runs the pre-forward hooks,
// ForwardImpl (which saves what backward needs inside the module), then the
// post-forward hooks; Backward(dy) runs the pre-backward hooks, BackwardImpl
// (which adds parameter gradients into Parameter::grad and returns dx), then
// the post-backward hooks. Containers call their children's Forward/Backward
// (children's backward in reverse order), so hooks fire in a stable order:
// FSDP unshards in pre-forward / pre-backward and reshards / reduce-scatters
// in post-forward / post-backward. A module drops what it saved at the end of
// its Backward; ReleaseSavedTensors drops it without one (activation
// checkpointing).
//
// Models are built on the meta device (shapes only, zero bytes), then either
// materialised whole (ToEmpty + InitWeights) or shard by shard by FSDP with
// InitSlice: every parameter's values come from the counter-based RNG keyed
// by (seed, a stream id derived from its fully qualified name, global element
// index), so both give the same weights bitwise at any world size.
#ifndef FSDPP_NN_MODULE_H_
#define FSDPP_NN_MODULE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "tensor/tensor.h"

namespace fsdpp {

// How a parameter's initial values are drawn.
struct InitSpec {
  enum class Kind {
    kZeros,
    kOnes,
    kConstant,
    kNormal,
    kTruncatedNormal,
    kUniform
  };
  Kind kind = Kind::kZeros;
  float a = 0.0f;      // constant value / mean / lower bound
  float b = 0.0f;      // - / std / upper bound
  float bound = 2.0f;  // truncation in stds (kTruncatedNormal)

  static InitSpec Zeros() { return {Kind::kZeros}; }
  static InitSpec Ones() { return {Kind::kOnes}; }
  static InitSpec Constant(float v) { return {Kind::kConstant, v}; }
  static InitSpec Normal(float std, float mean = 0.0f) {
    return {Kind::kNormal, mean, std};
  }
  static InitSpec TruncatedNormal(float std, float bound = 2.0f) {
    return {Kind::kTruncatedNormal, 0.0f, std, bound};
  }
  static InitSpec Uniform(float lo, float hi) {
    return {Kind::kUniform, lo, hi};
  }
};

// RNG stream id of a parameter: a stable 64-bit hash of its fully qualified
// name (FNV-1a), the same in every process.
uint64_t InitStreamId(const std::string& fully_qualified_name);

// Fills `out` (f32, bf16 or f16, any device) with elements
// [element_offset, element_offset + out->numel()) of the flattened parameter
// initialised by `spec` under (seed, stream). A shard initialised alone equals
// the same slice of the whole parameter, bitwise.
absl::Status InitSlice(const InitSpec& spec, uint64_t seed, uint64_t stream,
                       int64_t element_offset, Tensor* out);

// The part of a parameter one process holds under tensor parallelism: the
// box [offset, offset + size) of the parameter viewed as `layout`, stored as
// a tensor of `local_shape`. `layout` is the parameter's shape itself or a
// view of it with the same elements in the same row-major order (GPT-2's
// fused c_attn [3 C, C] viewed as [3, C, C], so that each rank's q, k and v
// rows form one box); `local_shape` has the box's elements in the box's
// row-major order, shaped as the layer computes with them ([3 C / tp, C]).
struct ParameterPiece {
  Shape layout;
  Shape offset;
  Shape size;
  Shape local_shape;

  // The dims of `layout` the box does not span whole, in order (tensor
  // parallelism splits one).
  std::vector<int> SplitDims() const {
    std::vector<int> dims;
    for (size_t d = 0; d < size.size() && d < layout.size(); ++d) {
      if (size[d] != layout[d]) dims.push_back(static_cast<int>(d));
    }
    return dims;
  }
};

struct Parameter {
  Shape shape;
  DType dtype = DType::kF32;
  InitSpec init;
  bool requires_grad = true;
  // The value forward/backward read (meta until materialised; FSDP points it
  // at the unsharded view of its all-gather buffer). Its shape is
  // LocalShape().
  Tensor data;
  // Accumulated gradient (same shape and dtype as data); undefined until the
  // first backward or ZeroGrad.
  Tensor grad;
  // Set by tensor parallelism (SetPiece); empty size = the whole parameter.
  ParameterPiece piece;

  // True when this process holds only a piece of the parameter.
  bool has_piece() const { return !piece.size.empty(); }
  // The shape of data and grad: piece.local_shape, or `shape`.
  const Shape& LocalShape() const {
    return has_piece() ? piece.local_shape : shape;
  }
  // The global tensor the piece is a box of: piece.layout, or `shape`.
  const Shape& Layout() const { return has_piece() ? piece.layout : shape; }
  // Makes `grad` (tagged kGrads, on data's device) if undefined: zeros, or
  // uninitialised with `zeroed` false (the caller writes every element).
  absl::Status EnsureGrad(bool zeroed = true);
  // Keeps only `piece` of the parameter. Checks that the layout has the
  // parameter's elements, that the box lies inside it and that local_shape
  // has the box's elements; a parameter is cut before it has a gradient.
  // A parameter holding a piece may be cut again to a box inside
  // it, of the same layout, when both are stored as their boxes' shapes
  // (expert parallelism narrowing a tensor-parallel piece to its experts).
  // On the meta device the data becomes a meta tensor of local_shape;
  // materialised data is replaced by a copy of the box.
  // InvalidArgument / FailedPrecondition naming what is wrong; the parameter
  // is unchanged on error.
  absl::Status SetPiece(ParameterPiece piece);
};

// Fills `out` (any shape with the box's elements) with the values InitSlice
// gives the box [offset, offset + size) of a parameter of row-major shape
// `layout`, in the box's row-major order: bitwise the box of the whole.
absl::Status InitBox(const InitSpec& spec, uint64_t seed, uint64_t stream,
                     const Shape& layout, const Shape& offset,
                     const Shape& size, Tensor* out);

// Fills `out` (LocalShape() of `p`) with the values InitSlice gives the
// elements of p's piece (or of the whole parameter): bitwise the same as the
// box of the whole parameter initialised at once.
absl::Status InitParameter(const Parameter& p, uint64_t seed, uint64_t stream,
                           Tensor* out);

// Whether the fully qualified parameter or module name `name` matches
// `pattern`, glob style over the whole name: '*' matches any run of
// characters (dots included), '?' any one; everything else itself.
// "layers.*.attn.wq.weight", "*.bias", "tok_embeddings.weight".
bool MatchesNamePattern(std::string_view pattern, std::string_view name);

class Module {
 public:
  // `kind` names the module type in messages ("Linear", "Block").
  explicit Module(std::string kind) : kind_(std::move(kind)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& kind() const { return kind_; }

  // ------------------------------------------------------------- the tree

  // A new parameter named `name` (no dots), created on the meta device.
  Parameter* AddParameter(const std::string& name, Shape shape, InitSpec init,
                          DType dtype = DType::kF32);
  // Uses another module's parameter here too (tied weights). It is listed
  // once, under the name where it was created.
  void ShareParameter(const std::string& name, Parameter* parameter);
  // Adds a child; returns it. A child added under the empty name is
  // transparent: its parameters and modules take this module's qualified name
  // as their prefix (wrappers such as ActivationCheckpoint use this so that
  // wrapping changes neither parameter names nor their RNG init streams).
  template <typename M>
  M* AddModule(const std::string& name, std::unique_ptr<M> child) {
    M* raw = child.get();
    children_.emplace_back(name, std::move(child));
    return raw;
  }

  // (name, child) in registration order.
  const std::vector<std::pair<std::string, std::unique_ptr<Module>>>& children()
      const {
    return children_;
  }
  // Own parameters (not children's), in registration order.
  std::vector<std::pair<std::string, Parameter*>> LocalParameters() const;
  // All parameters of the subtree with fully qualified names, depth-first in
  // registration order; shared (tied) parameters appear once.
  std::vector<std::pair<std::string, Parameter*>> NamedParameters(
      const std::string& prefix = "") const;
  // Every parameter the subtree reads: its own and the ones it shares from
  // elsewhere (tied weights), each once, as (name here, parameter).
  std::vector<std::pair<std::string, Parameter*>> UsedParameters(
      const std::string& prefix = "") const;
  // This module and its descendants with their qualified names ("" = this).
  std::vector<std::pair<std::string, Module*>> NamedModules(
      const std::string& prefix = "");
  // Total elements over NamedParameters().
  int64_t NumParameters() const;

  // -------------------------------------------------------- materialising

  // Gives every meta parameter uninitialised storage on `device` (tagged
  // kParams). Parameters already materialised are left alone.
  absl::Status ToEmpty(Device device);
  // Fills every parameter from its InitSpec with the counter-based RNG.
  absl::Status InitWeights(uint64_t seed);
  // Zeros (or drops, with `set_to_none`) every gradient.
  absl::Status ZeroGrad(bool set_to_none = false);

  // ---------------------------------------------------------------- hooks

  // A change of layout at the module's boundary (tensor parallelism's
  // collectives): `forward` maps a tensor as it crosses in forward,
  // `backward` maps its gradient as it crosses back. Either may be empty
  // (identity).
  struct Transform {
    std::function<absl::StatusOr<Tensor>(const Tensor&)> forward;
    std::function<absl::StatusOr<Tensor>(const Tensor&)> backward;
  };
  // Input transforms run on x after the pre-forward hooks, in the order
  // added; their backward runs on dx after BackwardImpl (an undefined dx,
  // e.g. an embedding's, is passed through untouched), in reverse order.
  void AddInputTransform(Transform t) {
    input_transforms_.push_back(std::move(t));
  }
  // Output transforms run on y after ForwardImpl, before the post-forward
  // hooks; their backward runs on dy after the pre-backward hooks, before
  // BackwardImpl, in reverse order.
  void AddOutputTransform(Transform t) {
    output_transforms_.push_back(std::move(t));
  }
  // Whether any layout transform is set on this module.
  bool has_transforms() const {
    return !input_transforms_.empty() || !output_transforms_.empty();
  }

  using Hook = std::function<absl::Status(Module&)>;
  void AddPreForwardHook(Hook hook) { pre_forward_.push_back(std::move(hook)); }
  void AddPostForwardHook(Hook hook) {
    post_forward_.push_back(std::move(hook));
  }
  void AddPreBackwardHook(Hook hook) {
    pre_backward_.push_back(std::move(hook));
  }
  void AddPostBackwardHook(Hook hook) {
    post_backward_.push_back(std::move(hook));
  }

  // -------------------------------------------------- forward / backward

  // Runs the hooks and transforms around ForwardImpl. Errors name the module
  // kind.
  absl::StatusOr<Tensor> Forward(const Tensor& x);
  // Runs the hooks and transforms around BackwardImpl: adds this call's
  // parameter gradients to Parameter::grad and returns dLoss/dx. Must follow
  // a Forward.
  absl::StatusOr<Tensor> Backward(const Tensor& dy);

  // Drops every tensor this module and its descendants saved for backward
  // (a following Backward fails until the next Forward). Layers release their
  // saved tensors at the end of their own Backward; this is for the others:
  // activation checkpointing frees a subtree's activations right after its
  // forward, and an evaluation-only forward can free them too. Runs no hooks.
  void ReleaseSavedTensors();

  // What a subtree saved for backward, moved out of its modules, so that
  // another forward can run before this one's backward (pipeline
  // parallelism keeps one per micro-batch in flight). The tensors keep their
  // memory (and its activation tag) until restored and released.
  class SavedTensors {
   public:
    SavedTensors() = default;
    SavedTensors(SavedTensors&&) = default;
    SavedTensors& operator=(SavedTensors&&) = default;
    // Bytes held.
    int64_t bytes() const;
    bool empty() const { return slots_.empty(); }

   private:
    friend class Module;
    const Module* owner_ = nullptr;
    std::vector<std::pair<Tensor*, Tensor>> slots_;
  };
  // Moves every tensor the subtree saved into the result; the subtree is
  // left as after ReleaseSavedTensors. Runs no hooks. Non-tensor state a
  // forward records (shapes) must be the same for the forwards whose saved
  // tensors are swapped: equal micro-batch shapes.
  SavedTensors StashSavedTensors();
  // Puts back what StashSavedTensors of this module returned, so that the
  // next Backward is that forward's. FailedPrecondition (nothing changed)
  // when `saved` came from another module or the subtree holds saved
  // tensors of another forward.
  absl::Status RestoreSavedTensors(SavedTensors saved);

 protected:
  virtual absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) = 0;
  virtual absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) = 0;
  // The members where this module itself (not its children) keeps what its
  // forward saved for backward: the one list ReleaseSavedTensors,
  // StashSavedTensors and RestoreSavedTensors work through. Modules that
  // save tensors override it.
  virtual std::vector<Tensor*> SavedTensorSlots() { return {}; }
  // Clears SavedTensorSlots() (layers call it at the end of their Backward).
  void ReleaseOwnSavedTensors();

 private:
  static absl::Status RunHooks(std::vector<Hook>& hooks, Module& m);

  std::string kind_;
  std::vector<std::pair<std::string, std::unique_ptr<Parameter>>> parameters_;
  std::vector<std::pair<std::string, Parameter*>> shared_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::vector<Hook> pre_forward_, post_forward_, pre_backward_, post_backward_;
  std::vector<Transform> input_transforms_, output_transforms_;
};

}  // namespace fsdpp

#endif  // FSDPP_NN_MODULE_H_
