// Test harness: trains a model-zoo Transformer for a few steps under a
// parallel layout (thread ranks over real Gloo) and returns what the parity
// tests compare against the unsharded single-process run — per-step losses
// and gradient norms, the last step's gradients and the final parameters.
//
// The layout is a Setup function (FSDP via a plan or AutoWrap, Replicate, or
// nothing at all for the reference): it materialises the model and hands the
// training loop (name, param DTensor, grad DTensor) triples, so AdamW, SGD
// and ClipGradNorm run the same code on every layout. Every rank trains on
// its contiguous rows of one global batch, micro-batch by micro-batch
// through the training step the trainer runs (recipe/step: PlainStep, or a
// PipelineStep); losses are averaged over ranks. The one other loop is the
// reference's emulation of several data-parallel ranks (emulated_ranks),
// which must reduce the ranks' gradients in the ring's order by hand.
//
// The harness is model-agnostic: the GPT-2 and Llama plan tests and the
// integration tests in tests/ use it.
#ifndef FSDPP_MODELS_TESTING_PARITY_TESTING_H_
#define FSDPP_MODELS_TESTING_PARITY_TESTING_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/transformer.h"
#include "optim/clip.h"
#include "recipe/step/step.h"
#include "tensor/dtensor.h"

namespace fsdpp {
namespace testing_util {

// What to train and how.
struct TrainingRun {
  std::string config = "gpt2_debug";
  // > 0: the config with this many blocks (pipeline stages need at least as
  // many blocks as stages).
  int64_t n_layers = 0;
  int steps = 3;
  int64_t batch = 12;  // Rows of the global batch (divisible by the world).
  int64_t seq = 8;
  uint64_t seed = 1234;
  enum class Optimizer { kSgd, kAdamW };
  Optimizer optimizer = Optimizer::kSgd;
  double lr = 0.05;
  double weight_decay = 0.1;  // AdamW only, matrices only.
  // AdamW's epsilon. The first steps move every element by about lr whatever
  // its gradient's size, so elements whose gradients are rounding noise
  // (cancellations, e.g. a key bias's) follow the noise's sign; a larger
  // epsilon damps those for comparisons across summation orders.
  double adam_eps = 1e-8;
  double max_grad_norm = 0;  // > 0: ClipGradNorm before every step.
  // Micro-batches per step (gradient accumulation), and whether the ones
  // before the last sync their gradients.
  int micro_batches = 1;
  bool sync_every_micro_batch = true;
  // The single-process reference only (one rank): > 1 reproduces how a 1-D
  // data-parallel run on this many ranks reduces its gradients, so that the
  // two differ only in what FSDP itself changes (sharded clipping, the
  // optimizer on shards). Each rank's rows of every micro-batch are a
  // separate forward/backward; the ranks' gradients are summed element by
  // element in the ring reduce-scatter's order (the owner's successor first,
  // the owner last; owners by dim-0 chunks), multiplied by 1/ranks as f32,
  // and added to the accumulated gradient once per synced micro-batch (once
  // per step when the micro-batches before the last do not sync).
  int emulated_ranks = 1;
  // The single-process reference only: the tied embedding weight's two uses
  // (the head's and the embedding's) accumulate their gradients apart over
  // the micro-batches, are reduced (emulated_ranks) and averaged like any
  // gradient, and are added once per step (embedding + head): the order in
  // which a pipeline's two copies of the weight (first and last stage) get
  // their summed gradient (models/parallelize/pipeline.h).
  bool tied_copies = false;
  // The single-process reference with emulated_ranks > 1 only: the
  // clipping norm as a data-parallel run on that many ranks computes it
  // (each rank's sums of squares of its dim-0 chunks, added in double and
  // rounded to f32, then the ranks' f32 totals added; optim/clip.h), so that
  // the clip coefficient is the same to the last bit (exact for 2 ranks,
  // whose f32 sum has one order).
  bool emulated_norm = false;
};

// What the parity tests compare.
struct TrainingResult {
  std::vector<double> losses;      // Per step, averaged over ranks.
  std::vector<double> grad_norms;  // Per step, before clipping.
  // The last step's gradients (after clipping) and the final parameters,
  // as full tensors by fully qualified name.
  std::map<std::string, std::vector<double>> grads;
  std::map<std::string, std::vector<double>> params;
};

// A parameter as the training loop sees it (not owned).
struct TrainableParameter {
  std::string name;
  DTensor* param;  // f32 (the sharded master under FSDP)
  DTensor* grad;   // f32, same layout
};

// What a Setup hands to the loop.
struct TrainableModel {
  std::vector<TrainableParameter> params;
  // What the step switches per micro-batch: FSDP's units or a Replicate'd
  // module (every_micro_batch is the run's sync_every_micro_batch); none for
  // the reference and tensor parallelism alone.
  recipe::GradientSync sync;
  // Keeps whatever the setup made for `params` alive (may be null).
  std::shared_ptr<void> storage;
  // Which rows of the global batch this rank trains: its index among
  // data_ranks equal parts (-1: the mesh rank among all ranks; tensor
  // parallel ranks share one part).
  int data_rank = -1;
  int data_ranks = -1;
  // Pipeline parallelism (PipelineSetup): the step over this rank's stages
  // (the schedule over the run's micro-batches, the tied embedding's copies
  // summed, the loss on every pipeline rank); null otherwise, and the loop
  // steps the whole model (recipe::PlainStep).
  std::shared_ptr<recipe::PipelineStep> pipeline;
};

// Prepares `model` (built on the meta device) on `mesh`: shards or
// replicates it and initialises its weights from `seed`.
using Setup = std::function<absl::StatusOr<TrainableModel>(
    models::Transformer* model, DeviceMesh* mesh, uint64_t seed)>;

// The unsharded reference (one rank only): materialise + InitWeights, no
// hooks. Parameters and gradients are handed over as Shard(0) DTensors over
// the one rank (the whole tensors), laid out like FSDP's masters, so that
// the optimizer and ClipGradNorm take the same code paths as under FSDP.
Setup ReferenceSetup();

// A model's FSDP plan (models/<name>/parallelize.h ApplyFsdp).
using FsdpPlan = std::function<absl::StatusOr<std::vector<fsdp::FsdpUnit*>>(
    models::Transformer*, const fsdp::FsdpPlanOptions&)>;

// Shards with `plan` (options.shard.mesh set to the rank's mesh), then
// fsdp::InitShardedWeights; the loop trains the sharded masters.
Setup FsdpPlanSetup(FsdpPlan plan, fsdp::FsdpPlanOptions options);

// Materialises the model, then fsdp::Replicate (no broadcast: every rank
// initialised the same weights) with one gradient bucket per block when
// `bucket_per_block`, else one flat bucket.
Setup ReplicateSetup(bool bucket_per_block);

// Applies a tensor-parallel plan to a model on a mesh (e.g.
// models::gpt2::ApplyTensorParallel with its options bound).
using TensorParallelPlanFn =
    std::function<absl::Status(models::Transformer*, DeviceMesh*)>;

// Tensor parallelism over the whole mesh (a 1-D "tp" mesh): `plan`, then
// ToEmpty + InitWeights (each rank initialises its pieces); the loop trains
// the pieces as DTensors on the tp axis (parallel::TensorParallelParameters),
// and every rank trains on the whole batch.
Setup TensorParallelSetup(TensorParallelPlanFn plan);

// FSDP + tensor parallelism on a mesh with a "tp" axis and one or two
// data-parallel axes ([dp, tp] or [replicate, shard, tp]): `tp_plan` first,
// then the FSDP `plan` with options.shard.mesh = the mesh and tp_axis "tp",
// then fsdp::InitShardedWeights; the loop trains the 2-D (3-D) masters, and
// the tp ranks of one data-parallel rank share its rows of the batch.
Setup FsdpTensorParallelSetup(TensorParallelPlanFn tp_plan, FsdpPlan plan,
                              fsdp::FsdpPlanOptions options);

// Pipeline parallelism on a mesh with a "pp" axis and a data-parallel one
// ([pp, dp] or [pp, dp, tp]; dp may have size 1): each rank builds its
// stages' Transformer parts (models::BuildPipelineParts), applies `tp_plan`
// (if any) and the FSDP `fsdp_plan` (if any; else whole parameters, the
// stage mesh then one rank) to each on the stage mesh (the mesh without
// pp), and trains them with a recipe::PipelineStep over the pp group.
// The model the loop builds gives the config; `model_options` the parts'
// options.
struct PipelineLayout {
  std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved
  int virtual_stages = 1;
  int microbatches = 2;  // must equal TrainingRun::micro_batches
  std::vector<int> cuts;
  models::TransformerOptions model_options;
  FsdpPlan fsdp_plan;  // empty: no FSDP
  fsdp::FsdpPlanOptions fsdp_options;
  TensorParallelPlanFn tp_plan;    // empty: no tensor parallelism
  bool sequence_parallel = false;  // what tp_plan does (the hidden shape)
};
Setup PipelineSetup(PipelineLayout layout);

// Trains `run` on the mesh `axes` with `setup`; the result as rank 0 saw it.
// Fails the current test (and returns what it has) on any error.
TrainingResult Train(const TrainingRun& run, const std::vector<MeshAxis>& axes,
                     const Setup& setup,
                     const models::TransformerOptions& model_options = {});

// The unsharded single-process run (Train on one rank with ReferenceSetup).
TrainingResult TrainReference(const TrainingRun& run);

// How far `got` is from `ref`.
struct ParityReport {
  double max_loss_rel = 0;  // max over steps |got - ref| / |ref|
  // max over parameters of max|got - ref| / max|ref| (per tensor).
  double max_param_rel = 0;
  std::string worst_param;
  // max over elements with ref != 0 of |got - ref| / |ref|.
  double max_param_elementwise_rel = 0;
  double max_grad_rel = 0;  // like max_param_rel, for the last gradients
  std::string ToString() const;
};
ParityReport Compare(const TrainingResult& ref, const TrainingResult& got);

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_MODELS_TESTING_PARITY_TESTING_H_
