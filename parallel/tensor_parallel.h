// Tensor parallelism: a plan maps module paths to styles (torch's
// parallelize_module, Megatron's layouts), and ParallelizeModule cuts each
// parameter to this rank's piece (Parameter::SetPiece) and puts the
// collectives on the module boundaries as input/output transforms
// (Module::AddInputTransform), so the layers themselves compute on their
// pieces unchanged.
//
// Activations between modules are in one of three layouts over the tp ranks
// (Layout): replicated, sharded on the sequence dim 1 ([B, T / tp, ..],
// sequence parallelism), or sharded on the last dim (a column-wise layer's
// output). The styles, with the communication each puts where:
//
//   Colwise   Linear weight [out, in] and bias split on dim 0 (Shard(0)),
//             output Shard(-1); Embedding table split on dim 1. A fused
//             projection (GPT-2's c_attn: q, k, v rows stacked) is viewed as
//             [blocks, out / blocks, in] and split on dim 1, so every rank
//             keeps its heads of each block. Input: kReplicate (backward
//             all-reduces the partial input gradient), kShardSequence
//             (all-gather; backward reduce-scatter), or inside a region
//             (ColwiseInRegion: the enclosing RegionInput does both).
//             Output: kShardLast as computed, or kReplicate (all-gather of
//             the last dim; backward keeps this rank's slice). A LoRA
//             adapter (nn::Linear::EnableLora): B split as the weight's
//             rows, A whole with its gradient all-reduced after the
//             backward.
//   Rowwise   Linear weight split on dim 1 (Shard(1)), bias replicated and
//             added by rank 0 only; Embedding table split on dim 0 (the
//             vocabulary: ids of other ranks' rows give zeros). The output is
//             a partial sum: kReplicate all-reduces it, kShardSequence
//             reduce-scatters it over the sequence (backward: all-gather).
//             Input (Linear): kShardLast as is, or kReplicate (this rank's
//             slice; backward all-gathers the input gradient). A LoRA
//             adapter: A split as the weight's columns (its path joins the
//             partial sum), B whole with its gradient all-reduced.
//   SequenceParallel  a per-token module (a norm) computes on its sequence
//             slice as is; its replicated parameters' gradients, partial
//             sums over the ranks, are all-reduced after its backward.
//   ReplicatedInRegion  a module inside a region keeps its parameters whole
//             (e.g. k and v projections when there are fewer kv heads than
//             ranks); their gradients are partial sums and are all-reduced.
//   RegionInput  a module whose input feeds column-wise layers only
//             (attention, MLP): the input is gathered from kShardSequence (or
//             kept, kReplicate) once, and the partial input gradient the
//             column-wise layers leave is reduce-scattered (or all-reduced)
//             once, instead of once per projection.
//   MixtureOfExperts  an nn::MoE: the input is gathered from kShardSequence
//             (or kept, kReplicate) as RegionInput's; every rank routes all
//             the tokens with the router ("gate") whole, and computes its
//             slice of every expert's hidden width (the stacks' gate / up
//             split on dim 1, down on dim 2; the shared experts' gate / up
//             Shard(0), down Shard(1)), so its output is a partial sum,
//             reduce-scattered over the sequence (or all-reduced; backward:
//             all-gather). The router's gradient, a partial sum, is
//             all-reduced after the backward, to which one rank adds the
//             auxiliary loss's. Expert parallelism (parallel::ShardExperts)
//             may then narrow the stacks to its experts.
//   PrepareOutput(kReplicate -> kShardSequence)  keeps this rank's sequence
//             slice of a replicated output (backward: all-gather), e.g.
//             GPT-2's position embedding joining the sequence-parallel
//             stream.
//
// Parameter gradients accumulate into Parameter::grad in the piece's layout;
// TensorParallelParameters lists each parameter as DTensors on the tp axis
// (Shard of its split dim, Replicate otherwise) for the optimizer, gradient
// clipping (each element counted once) and checkpoints.
//
// Sequence parallelism needs the sequence length divisible by the tp size
// (a clear error at the first forward otherwise).
#ifndef FSDPP_PARALLEL_TENSOR_PARALLEL_H_
#define FSDPP_PARALLEL_TENSOR_PARALLEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mesh/device_mesh.h"
#include "nn/module.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace parallel {

// How an activation is laid out over the tp ranks.
enum class Layout {
  kReplicate,      // every rank holds all of it
  kShardSequence,  // dim 1 split: [B, T / tp, ..]
  kShardLast,      // the last dim split
};
const char* LayoutName(Layout layout);

struct ParallelStyle {
  enum class Kind {
    kColwise,
    kRowwise,
    kSequenceParallel,
    kReplicatedInRegion,
    kRegionInput,
    kPrepareOutput,
    kMixtureOfExperts,
  };
  Kind kind = Kind::kColwise;
  Layout input = Layout::kReplicate;
  Layout output = Layout::kShardLast;
  // Colwise: the input was laid out by an enclosing RegionInput.
  bool in_region = false;
  // Colwise Linear: the weight's rows are this many stacked blocks, each
  // split across the ranks (GPT-2's fused c_attn: 3).
  int fused_blocks = 1;

  static ParallelStyle Colwise(Layout input = Layout::kReplicate,
                               Layout output = Layout::kShardLast);
  static ParallelStyle ColwiseInRegion(int fused_blocks = 1);
  static ParallelStyle Rowwise(Layout input = Layout::kShardLast,
                               Layout output = Layout::kReplicate);
  static ParallelStyle SequenceParallel();
  static ParallelStyle ReplicatedInRegion();
  static ParallelStyle RegionInput(Layout from);
  static ParallelStyle PrepareOutput(Layout from, Layout to);
  // Input and output in `stream` (kReplicate or kShardSequence).
  static ParallelStyle MixtureOfExperts(Layout stream);

  // "Colwise(input R, output S(-1))".
  std::string ToString() const;
};

// One plan entry: the module at `path` (as in Module::NamedModules, "" for
// the root) gets `style`.
struct PlanEntry {
  std::string path;
  ParallelStyle style;
};

struct TensorParallelOptions {
  // The mesh axis that tensor parallelism splits over.
  std::string tp_axis = "tp";
  // Limit of every collective the transforms run.
  absl::Duration timeout = absl::Minutes(5);
};

// Applies `plan` to `root` for this rank of `mesh`'s tp axis. Everything is
// checked before anything changes (nothing is half-applied): every path
// names a module; each style suits its module (Colwise / Rowwise: a Linear
// or an Embedding; MixtureOfExperts: an nn::MoE without LoRA adapters; the
// layouts each accepts); the split dims divide by the
// tp size (InvalidArgument naming the module, the dim and both sizes); a
// parameter shared by two modules (tied embedding and LM head) gets the same
// piece from both; no parameter is already cut or has a gradient; a module
// appears once. Parameters may be on the meta device (materialise with
// ToEmpty + InitWeights: each rank initialises only its piece, bitwise equal
// to the whole model's) or materialised (cut in place). The mesh must
// outlive the module.
absl::Status ParallelizeModule(Module* root, DeviceMesh* mesh,
                               const std::vector<PlanEntry>& plan,
                               const TensorParallelOptions& options = {});

// A parameter as DTensors over the tp axis (a 1-D sub-mesh): its piece's
// split dim as Shard (of the piece's layout: GPT-2's fused c_attn is
// [3, C, C]), Replicate when whole. The DTensors share the parameter's data
// and gradient (made with EnsureGrad).
struct TensorParallelParameter {
  std::string name;
  Parameter* parameter = nullptr;
  DTensor param;
  DTensor grad;
};

// Every parameter of `root` (NamedParameters order) on the tp axis of
// `mesh`.
absl::StatusOr<std::vector<TensorParallelParameter>> TensorParallelParameters(
    Module* root, DeviceMesh* mesh, const std::string& tp_axis = "tp");

// The placement of `p` along the tp axis, from its piece.
absl::StatusOr<Placement> PieceSplit(const Parameter& p);

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_TENSOR_PARALLEL_H_
