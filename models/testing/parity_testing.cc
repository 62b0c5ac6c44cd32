// Parity-test harness; see parity_testing.h.
#include "models/testing/parity_testing.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "fsdp/replicate.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/pipeline.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "parallel/pipeline_runner.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace testing_util {
namespace {

using models::Transformer;

// Deterministic ids and targets of step `step`, [rows, seq] row-major.
struct Batch {
  std::vector<int64_t> ids, targets;
};

Batch MakeBatch(int64_t vocab, int step, int64_t rows, int64_t seq) {
  Batch b;
  for (int64_t i = 0; i < rows * seq; ++i) {
    b.ids.push_back((i * 7 + step * 13 + i / seq) % vocab);
    b.targets.push_back((i * 5 + step * 3 + 1) % vocab);
  }
  return b;
}

// Rows [row_begin, row_begin + rows) of the batch as [rows, seq] tensors.
std::pair<Tensor, Tensor> Slice(const Batch& b, int64_t row_begin, int64_t rows,
                                int64_t seq) {
  std::vector<int64_t> ids(b.ids.begin() + row_begin * seq,
                           b.ids.begin() + (row_begin + rows) * seq);
  std::vector<int64_t> t(b.targets.begin() + row_begin * seq,
                         b.targets.begin() + (row_begin + rows) * seq);
  return {*Tensor::FromInts({rows, seq}, ids),
          *Tensor::FromInts({rows, seq}, t)};
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

// Per-tensor max|got - ref| / max|ref| over a name -> values map; the worst.
double MaxTensorRel(const std::map<std::string, std::vector<double>>& ref,
                    const std::map<std::string, std::vector<double>>& got,
                    std::string* worst) {
  double m = 0;
  for (const auto& [name, r] : ref) {
    auto it = got.find(name);
    if (it == got.end() || it->second.size() != r.size()) {
      if (worst != nullptr) *worst = name + " (missing)";
      return INFINITY;
    }
    const double scale = MaxAbs(r);
    const double d = MaxAbsDiff(it->second, r);
    const double rel = scale > 0 ? d / scale : d;
    if (rel > m) {
      m = rel;
      if (worst != nullptr) *worst = name;
    }
  }
  return m;
}

// One micro-batch: forward and backward on rows [row_begin, row_begin +
// rows) of `batch`; the loss.
absl::StatusOr<float> ForwardBackward(const Batch& batch, int64_t row_begin,
                                      int64_t rows, int64_t seq,
                                      Transformer* model) {
  auto [ids, targets] = Slice(batch, row_begin, rows, seq);
  FSDPP_ASSIGN_OR_RETURN(float loss, model->ForwardLoss(ids, targets));
  FSDPP_RETURN_IF_ERROR(model->Backward());
  return loss;
}

// Multiplies every gradient by 1 / micro-batches (nothing for one).
absl::Status AverageMicroBatches(const TrainingRun& run,
                                 const std::vector<DTensor*>& grads) {
  if (run.micro_batches == 1) return absl::OkStatus();
  for (DTensor* g : grads) {
    FSDPP_RETURN_IF_ERROR(
        Scale(g->local(), 1.0f / run.micro_batches, g->mutable_local()));
  }
  return absl::OkStatus();
}

// The gradients of every parameter as f32 values (one rank: the whole
// tensors).
std::vector<std::vector<float>> CopyGradients(
    const std::vector<DTensor*>& grads) {
  std::vector<std::vector<float>> out;
  for (const DTensor* g : grads) {
    const float* p = g->local().data<float>();
    out.emplace_back(p, p + g->local().numel());
  }
  return out;
}

// Adds to `sum` the ring reduce-scatter of `ranks` (one gradient copy per
// emulated rank) with ReduceOp::kAvg, element by element as
// comm/gloo_backend.cc computes it: the chunk a rank owns (dim-0 rows, as
// FSDP shards) starts at its successor and goes round the ring to it, then
// is multiplied by 1/ranks in f32.
void AddRingAverage(const std::vector<DTensor*>& grads,
                    const std::vector<std::vector<std::vector<float>>>& ranks,
                    std::vector<std::vector<float>>* sum) {
  const int w = static_cast<int>(ranks.size());
  const float inv = 1.0f / static_cast<float>(w);
  for (size_t i = 0; i < grads.size(); ++i) {
    const Shape& shape = grads[i]->local().shape();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    const int64_t row = rows == 0 ? 0 : grads[i]->local().numel() / rows;
    for (int owner = 0; owner < w; ++owner) {
      const Range range = ChunkRange(rows, w, owner);
      for (int64_t e = range.begin * row;
           e < (range.begin + range.length) * row; ++e) {
        float v = ranks[(owner + 1) % w][i][e];
        for (int k = 2; k <= w; ++k) v += ranks[(owner + k) % w][i][e];
        const float average = v * inv;  // rounded before the add, as there
        (*sum)[i][e] += average;
      }
    }
  }
}

// The norm ClipGradNorm computes for `grads` sharded on `ranks` data-parallel
// ranks (TrainingRun::emulated_norm).
absl::StatusOr<double> EmulatedShardedNorm(const std::vector<DTensor*>& grads,
                                           int ranks) {
  float total = 0.0f;
  for (int r = 0; r < ranks; ++r) {
    double rank_total = 0.0;
    for (const DTensor* g : grads) {
      const Tensor& t = g->local();
      if (t.shape().empty()) {
        if (r != 0) continue;  // a replicated scalar counts on rank 0
        FSDPP_ASSIGN_OR_RETURN(Tensor slot,
                               Tensor::Zeros({1}, DType::kF32, Device::Cpu()));
        FSDPP_RETURN_IF_ERROR(SumOfSquares(t, &slot));
        rank_total += slot.data<float>()[0];
        continue;
      }
      const Range range = ChunkRange(t.dim(0), ranks, r);
      if (range.length == 0) continue;
      FSDPP_ASSIGN_OR_RETURN(Tensor chunk, t.Narrow(range.begin, range.length));
      FSDPP_ASSIGN_OR_RETURN(Tensor slot,
                             Tensor::Zeros({1}, DType::kF32, Device::Cpu()));
      FSDPP_RETURN_IF_ERROR(SumOfSquares(chunk, &slot));
      rank_total += slot.data<float>()[0];
    }
    total += static_cast<float>(rank_total);
  }
  return std::sqrt(static_cast<double>(total));
}

// The single-process reference of a data-parallel step on
// run.emulated_ranks ranks (see TrainingRun::emulated_ranks): the step's
// gradient left in `grads`, the ranks' mean loss returned. Its own
// micro-batch loop, not the training step's (recipe/step): it runs several
// ranks' micro-batches one after another on one model and reduces their
// gradients by hand, in the ring's order, as the reference for the step.
absl::StatusOr<double> EmulatedRanksGradients(
    const TrainingRun& run, const Batch& batch, Transformer* model,
    const std::vector<DTensor*>& grads) {
  const int w = run.emulated_ranks, micro = run.micro_batches;
  const int64_t rows = run.batch / w, micro_rows = rows / micro;
  std::vector<std::vector<float>> sum;
  for (const DTensor* g : grads) {
    sum.emplace_back(static_cast<size_t>(g->local().numel()), 0.0f);
  }
  std::vector<std::vector<std::vector<float>>> ranks(w);
  std::vector<double> losses(w, 0.0);
  // Micro-batches [first, last] of every rank, accumulated, then reduced.
  auto reduce = [&](int first, int last) -> absl::Status {
    for (int r = 0; r < w; ++r) {
      FSDPP_RETURN_IF_ERROR(ZeroGrad(grads));
      for (int m = first; m <= last; ++m) {
        FSDPP_ASSIGN_OR_RETURN(float l,
                               ForwardBackward(batch, r * rows + m * micro_rows,
                                               micro_rows, run.seq, model));
        losses[r] += l / micro;
      }
      ranks[r] = CopyGradients(grads);
    }
    AddRingAverage(grads, ranks, &sum);
    return absl::OkStatus();
  };
  if (run.sync_every_micro_batch) {
    for (int m = 0; m < micro; ++m) FSDPP_RETURN_IF_ERROR(reduce(m, m));
  } else {
    FSDPP_RETURN_IF_ERROR(reduce(0, micro - 1));
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    std::copy(sum[i].begin(), sum[i].end(),
              grads[i]->mutable_local()->data<float>());
  }
  FSDPP_RETURN_IF_ERROR(AverageMicroBatches(run, grads));
  float mean = 0;
  for (double l : losses) mean += static_cast<float>(l);
  return mean / static_cast<float>(w);
}

}  // namespace

std::string ParityReport::ToString() const {
  return absl::StrCat("loss rel ", max_loss_rel, ", param rel ", max_param_rel,
                      " (worst ", worst_param, "), param elementwise rel ",
                      max_param_elementwise_rel, ", grad rel ", max_grad_rel);
}

ParityReport Compare(const TrainingResult& ref, const TrainingResult& got) {
  ParityReport r;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    if (i >= got.losses.size()) {
      r.max_loss_rel = INFINITY;
      break;
    }
    r.max_loss_rel =
        std::max(r.max_loss_rel, std::fabs(got.losses[i] - ref.losses[i]) /
                                     std::fabs(ref.losses[i]));
  }
  r.max_param_rel = MaxTensorRel(ref.params, got.params, &r.worst_param);
  r.max_grad_rel = MaxTensorRel(ref.grads, got.grads, nullptr);
  for (const auto& [name, values] : ref.params) {
    auto it = got.params.find(name);
    if (it == got.params.end()) continue;
    for (size_t i = 0; i < values.size() && i < it->second.size(); ++i) {
      if (values[i] == 0) continue;
      r.max_param_elementwise_rel =
          std::max(r.max_param_elementwise_rel,
                   std::fabs(it->second[i] - values[i]) / std::fabs(values[i]));
    }
  }
  return r;
}

// Materialises `model` whole on a one-rank `mesh` and hands its parameters
// over as Shard(0) DTensors kept in `storage`.
absl::Status WrapWholeParameters(Transformer* model, DeviceMesh* mesh,
                                 uint64_t seed, std::deque<DTensor>* storage,
                                 TrainableModel* out) {
  if (mesh->size() != 1) {
    return absl::InvalidArgumentError(
        "whole parameters (no FSDP, no tensor parallelism) need a mesh of one "
        "rank");
  }
  FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(model->InitWeights(seed));
  for (auto& [name, p] : model->NamedParameters()) {
    FSDPP_RETURN_IF_ERROR(p->EnsureGrad());
    // Shard(0) over one rank is the whole tensor, laid out like FSDP's
    // masters, so the optimizer code takes the same paths on both
    // (ClipGradNorm rounds the squared norm to f32 for its all-reduce on
    // sharded gradients only).
    const std::vector<Placement> placements(
        mesh->ndim(),
        p->shape.empty() ? Placement::Replicate() : Placement::Shard(0));
    FSDPP_ASSIGN_OR_RETURN(
        DTensor param, DTensor::FromLocal(p->data, mesh, placements, p->shape));
    FSDPP_ASSIGN_OR_RETURN(
        DTensor grad, DTensor::FromLocal(p->grad, mesh, placements, p->shape));
    storage->push_back(std::move(param));
    DTensor* param_ptr = &storage->back();
    storage->push_back(std::move(grad));
    out->params.push_back({name, param_ptr, &storage->back()});
  }
  return absl::OkStatus();
}

Setup ReferenceSetup() {
  return [](Transformer* model, DeviceMesh* mesh,
            uint64_t seed) -> absl::StatusOr<TrainableModel> {
    auto storage = std::make_shared<std::deque<DTensor>>();
    TrainableModel out;
    FSDPP_RETURN_IF_ERROR(
        Annotate(WrapWholeParameters(model, mesh, seed, storage.get(), &out),
                 "ReferenceSetup"));
    out.storage = storage;
    return out;
  };
}

Setup FsdpPlanSetup(FsdpPlan plan, fsdp::FsdpPlanOptions options) {
  return [plan, options](Transformer* model, DeviceMesh* mesh,
                         uint64_t seed) -> absl::StatusOr<TrainableModel> {
    fsdp::FsdpPlanOptions o = options;
    o.shard.mesh = mesh;
    FSDPP_ASSIGN_OR_RETURN(std::vector<fsdp::FsdpUnit*> units, plan(model, o));
    FSDPP_RETURN_IF_ERROR(fsdp::InitShardedWeights(model, seed));
    TrainableModel out;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model)) {
      out.params.push_back({sp->name, &sp->master, &sp->grad});
    }
    out.sync.units = units;
    return out;
  };
}

Setup ReplicateSetup(bool bucket_per_block) {
  return [bucket_per_block](Transformer* model, DeviceMesh* mesh,
                            uint64_t seed) -> absl::StatusOr<TrainableModel> {
    FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
    FSDPP_RETURN_IF_ERROR(model->InitWeights(seed));
    fsdp::ReplicateOptions options;
    options.mesh = mesh;
    options.broadcast_parameters = false;
    if (bucket_per_block) {
      for (Module* block : model->blocks()) {
        options.bucket_modules.push_back(block);
      }
    }
    FSDPP_ASSIGN_OR_RETURN(fsdp::ReplicatedModule * replicated,
                           fsdp::Replicate(model, options));
    TrainableModel out;
    for (fsdp::ReplicatedParameter& rp : replicated->parameters()) {
      out.params.push_back({rp.name, &rp.param, &rp.grad});
    }
    out.sync.replicated = replicated;
    return out;
  };
}

Setup TensorParallelSetup(TensorParallelPlanFn plan) {
  return [plan](Transformer* model, DeviceMesh* mesh,
                uint64_t seed) -> absl::StatusOr<TrainableModel> {
    FSDPP_RETURN_IF_ERROR(plan(model, mesh));
    FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
    FSDPP_RETURN_IF_ERROR(model->InitWeights(seed));
    FSDPP_ASSIGN_OR_RETURN(
        std::vector<parallel::TensorParallelParameter> params,
        parallel::TensorParallelParameters(model, mesh));
    auto storage =
        std::make_shared<std::vector<parallel::TensorParallelParameter>>(
            std::move(params));
    TrainableModel out;
    for (parallel::TensorParallelParameter& p : *storage) {
      out.params.push_back({p.name, &p.param, &p.grad});
    }
    out.storage = storage;
    out.data_rank = 0;
    out.data_ranks = 1;
    return out;
  };
}

Setup FsdpTensorParallelSetup(TensorParallelPlanFn tp_plan, FsdpPlan plan,
                              fsdp::FsdpPlanOptions options) {
  options.shard.tp_axis = "tp";
  Setup fsdp = FsdpPlanSetup(std::move(plan), options);
  return [tp_plan, fsdp](Transformer* model, DeviceMesh* mesh,
                         uint64_t seed) -> absl::StatusOr<TrainableModel> {
    FSDPP_RETURN_IF_ERROR(tp_plan(model, mesh));
    FSDPP_ASSIGN_OR_RETURN(TrainableModel out, fsdp(model, mesh, seed));
    // The tp ranks of one data-parallel rank share its rows.
    std::vector<std::string> data_axes;
    for (const MeshAxis& a : mesh->axes()) {
      if (a.name != "tp") data_axes.push_back(a.name);
    }
    FSDPP_ASSIGN_OR_RETURN(DeviceMesh * data_mesh, mesh->SubMesh(data_axes));
    out.data_rank = data_mesh->rank();
    out.data_ranks = data_mesh->size();
    return out;
  };
}

Setup PipelineSetup(PipelineLayout layout) {
  return [layout](Transformer* model, DeviceMesh* mesh,
                  uint64_t seed) -> absl::StatusOr<TrainableModel> {
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * pp, mesh->Group("pp"));
    std::vector<std::string> stage_axes, data_axes;
    for (const MeshAxis& a : mesh->axes()) {
      if (a.name == "pp") continue;
      stage_axes.push_back(a.name);
      if (a.name != "tp") data_axes.push_back(a.name);
    }
    if (data_axes.empty()) {
      return absl::InvalidArgumentError(
          "PipelineSetup: the mesh needs a data-parallel axis besides pp (of "
          "size 1 for a pipeline alone)");
    }
    FSDPP_ASSIGN_OR_RETURN(DeviceMesh * stage_mesh, mesh->SubMesh(stage_axes));
    FSDPP_ASSIGN_OR_RETURN(DeviceMesh * data_mesh, mesh->SubMesh(data_axes));
    // What the stages' parameters are handed over as (whole, or pieces).
    struct State {
      std::deque<DTensor> whole;
      std::vector<std::vector<parallel::TensorParallelParameter>> pieces;
    };
    auto state = std::make_shared<State>();
    FSDPP_ASSIGN_OR_RETURN(parallel::PipelineSchedule schedule,
                           parallel::MakePipelineSchedule(
                               layout.schedule, pp->size(),
                               layout.virtual_stages, layout.microbatches));
    FSDPP_ASSIGN_OR_RETURN(
        std::vector<models::PipelineStagePart> parts,
        models::BuildPipelineParts(model->config(), layout.model_options,
                                   schedule, pp->rank(), layout.cuts));
    TrainableModel out;
    std::vector<recipe::PipelineStageTraining> stages;
    for (models::PipelineStagePart& part : parts) {
      Transformer* m = part.model.get();
      recipe::PipelineStageTraining stage;
      const size_t first_param = out.params.size();
      if (layout.tp_plan) FSDPP_RETURN_IF_ERROR(layout.tp_plan(m, stage_mesh));
      if (layout.fsdp_plan) {
        fsdp::FsdpPlanOptions o = layout.fsdp_options;
        o.shard.mesh = stage_mesh;
        if (layout.tp_plan) o.shard.tp_axis = "tp";
        FSDPP_ASSIGN_OR_RETURN(stage.units, layout.fsdp_plan(m, o));
        FSDPP_RETURN_IF_ERROR(fsdp::InitShardedWeights(m, seed));
        for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(m)) {
          out.params.push_back({sp->name, &sp->master, &sp->grad});
        }
      } else if (layout.tp_plan) {
        FSDPP_RETURN_IF_ERROR(m->ToEmpty(Device::Cpu()));
        FSDPP_RETURN_IF_ERROR(m->InitWeights(seed));
        FSDPP_ASSIGN_OR_RETURN(
            state->pieces.emplace_back(),
            parallel::TensorParallelParameters(m, stage_mesh));
        for (parallel::TensorParallelParameter& p : state->pieces.back()) {
          out.params.push_back({p.name, &p.param, &p.grad});
        }
      } else {
        FSDPP_RETURN_IF_ERROR(Annotate(
            WrapWholeParameters(m, stage_mesh, seed, &state->whole, &out),
            "PipelineSetup"));
      }
      for (size_t i = first_param; i < out.params.size(); ++i) {
        stage.grads.push_back({out.params[i].name, out.params[i].grad});
      }
      stage.part = std::move(part);
      stages.push_back(std::move(stage));
    }
    recipe::PipelineStepOptions options;
    options.seq_split =
        layout.tp_plan && layout.sequence_parallel ? *mesh->AxisSize("tp") : 1;
    options.hidden_dtype = layout.model_options.param_dtype;
    options.timeout = absl::Seconds(60);
    FSDPP_ASSIGN_OR_RETURN(
        out.pipeline, recipe::PipelineStep::Create(pp, std::move(schedule),
                                                   std::move(stages), options));
    out.data_rank = data_mesh->rank();
    out.data_ranks = data_mesh->size();
    out.storage = state;
    return out;
  };
}

TrainingResult Train(const TrainingRun& run, const std::vector<MeshAxis>& axes,
                     const Setup& setup,
                     const models::TransformerOptions& model_options) {
  TrainingResult result;
  // Every rank records the full tensors it holds (a pipeline rank holds only
  // its stages'); the ranks holding one tensor must agree on it exactly
  // (replicas, or the tied embedding's copies on two stages).
  std::mutex record_mu;
  const auto Record = [&](const std::string& name, std::vector<double> values,
                          std::map<std::string, std::vector<double>>* into) {
    std::lock_guard<std::mutex> lock(record_mu);
    auto [it, inserted] = into->emplace(name, values);
    if (!inserted) {
      EXPECT_TRUE(it->second == values)
          << name << " differs between the ranks that hold it";
    }
  };
  RunOnMesh(axes, [&](int rank, DeviceMesh& mesh) {
    absl::StatusOr<models::TransformerConfig> config =
        models::ConfigByName(run.config);
    ASSERT_TRUE(config.ok()) << config.status();
    if (run.n_layers > 0) config->n_layers = run.n_layers;
    absl::StatusOr<std::unique_ptr<Transformer>> model =
        Transformer::Create(*config, model_options);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<TrainableModel> trainable =
        setup(model->get(), &mesh, run.seed);
    ASSERT_TRUE(trainable.ok()) << trainable.status();
    // Weight decay for matrices by the parameters' own shapes: a
    // tensor-parallel piece's DTensor may be a view with more dims (GPT-2's
    // fused c_attn bias is [3, C] there).
    std::map<std::string, size_t> ndim;
    for (auto& [name, p] : (*model)->NamedParameters()) {
      ndim[name] = p->shape.size();
    }
    std::vector<DTensor*> grads;
    std::vector<AdamWParam> adamw_params;
    for (const TrainableParameter& p : trainable->params) {
      grads.push_back(p.grad);
      adamw_params.emplace_back(p.name, p.param, p.grad,
                                /*weight_decay=*/ndim.at(p.name) >= 2);
    }
    std::optional<AdamW> adamw;
    if (run.optimizer == TrainingRun::Optimizer::kAdamW) {
      AdamWOptions options;
      options.lr = run.lr;
      options.weight_decay = run.weight_decay;
      options.eps = run.adam_eps;
      absl::StatusOr<AdamW> created =
          AdamW::Create(std::move(adamw_params), options);
      ASSERT_TRUE(created.ok()) << created.status();
      adamw.emplace(*std::move(created));
    }
    absl::StatusOr<ProcessGroup*> flat = mesh.FlatGroup();
    ASSERT_TRUE(flat.ok()) << flat.status();
    const int world =
        trainable->data_ranks > 0 ? trainable->data_ranks : mesh.size();
    const int data_rank =
        trainable->data_rank >= 0 ? trainable->data_rank : rank;
    ASSERT_TRUE(run.emulated_ranks == 1 || world == 1)
        << "emulated_ranks is for the single-process reference";
    ASSERT_EQ(run.batch % (world * run.emulated_ranks * run.micro_batches), 0);
    // tied_copies: the tied weight's head and embedding gradients in two
    // extra gradients (the hooks move each use's contribution there), which
    // the reduction and averaging treat like the others.
    std::vector<DTensor*> computed = grads;
    std::deque<DTensor> tied_parts;
    Parameter* tied = nullptr;
    if (run.tied_copies) {
      ASSERT_TRUE(world == 1 && config->tied_embeddings)
          << "tied_copies is for the single-process reference of a tied model";
      tied = (*model)->token_embedding()->weight();
      for (Module* use : {static_cast<Module*>((*model)->lm_head()),
                          static_cast<Module*>((*model)->token_embedding())}) {
        absl::StatusOr<Tensor> part =
            Tensor::Zeros(tied->shape, DType::kF32, Device::Cpu());
        ASSERT_TRUE(part.ok()) << part.status();
        absl::StatusOr<DTensor> d = DTensor::FromLocal(
            *part, &mesh, {Placement::Shard(0)}, tied->shape);
        ASSERT_TRUE(d.ok()) << d.status();
        tied_parts.push_back(*std::move(d));
        DTensor* into = &tied_parts.back();
        computed.push_back(into);
        use->AddPostBackwardHook([tied, into](Module&) -> absl::Status {
          FSDPP_RETURN_IF_ERROR(
              Add(into->local(), tied->grad, into->mutable_local()));
          return Zero(&tied->grad);
        });
      }
    }
    // The step the trainer runs: the pipeline's, or the whole model's with
    // the layout's reductions switched per micro-batch.
    recipe::Step* step_fn = trainable->pipeline.get();
    std::unique_ptr<recipe::PlainStep> plain;
    if (step_fn == nullptr) {
      recipe::GradientSync sync = trainable->sync;
      sync.every_micro_batch = run.sync_every_micro_batch;
      plain = std::make_unique<recipe::PlainStep>(model->get(), grads, sync);
      step_fn = plain.get();
    }
    std::vector<DTensor*> tied_grads;
    for (DTensor& d : tied_parts) tied_grads.push_back(&d);
    const int64_t rows = run.batch / world;
    const int64_t micro_rows = rows / run.micro_batches;
    for (int step = 0; step < run.steps; ++step) {
      const Batch batch =
          MakeBatch(config->vocab_size, step, run.batch, run.seq);
      absl::StatusOr<double> loss;
      if (run.emulated_ranks > 1) {
        // The reference's own loop: several ranks' micro-batches one after
        // another, their gradients reduced in the ring's order by hand.
        loss = EmulatedRanksGradients(run, batch, model->get(), computed);
      } else {
        ASSERT_TRUE(ZeroGrad(tied_grads).ok());
        const recipe::MicroBatchSource source =
            [&](int64_t m) -> absl::StatusOr<recipe::MicroBatch> {
          auto [ids, targets] = Slice(batch, data_rank * rows + m * micro_rows,
                                      micro_rows, run.seq);
          return recipe::MicroBatch{ids, targets};
        };
        absl::StatusOr<recipe::StepLoss> got =
            step_fn->ForwardBackward(run.micro_batches, 1.0, source);
        loss = got.ok() ? absl::StatusOr<double>(got->loss) : got.status();
      }
      if (tied != nullptr && loss.ok()) {
        // embedding + head, as the first stage adds them.
        ASSERT_TRUE(
            Add(tied_parts[1].local(), tied_parts[0].local(), &tied->grad)
                .ok());
      }
      ASSERT_TRUE(loss.ok()) << loss.status();
      float l32 = static_cast<float>(*loss);
      absl::StatusOr<std::shared_ptr<Work>> reduced = (*flat)->AllReduce(
          {&l32, 1, DType::kF32, Device::Cpu()}, ReduceOp::kAvg);
      ASSERT_TRUE(reduced.ok()) << reduced.status();
      ASSERT_TRUE((*reduced)->Wait().ok());
      // Without clipping, a max_norm no norm reaches only measures.
      const double max_norm = run.max_grad_norm > 0 ? run.max_grad_norm : 1e30;
      absl::StatusOr<double> norm;
      if (run.emulated_norm) {
        ASSERT_TRUE(world == 1 && run.emulated_ranks > 1)
            << "emulated_norm is for the reference with emulated_ranks";
        norm = EmulatedShardedNorm(grads, run.emulated_ranks);
        const float coef = norm.ok() ? ClipCoefficient(*norm, max_norm) : 1.0f;
        for (DTensor* g : grads) {
          if (coef < 1.0f) {
            ASSERT_TRUE(Scale(g->local(), coef, g->mutable_local()).ok());
          }
        }
      } else {
        norm = ClipGradNorm(grads, max_norm, step_fn->norm_options());
      }
      ASSERT_TRUE(norm.ok()) << norm.status();
      if (rank == 0) {
        result.losses.push_back(l32);
        result.grad_norms.push_back(*norm);
      }
      if (step + 1 == run.steps) {
        for (const TrainableParameter& p : trainable->params) {
          absl::StatusOr<Tensor> full = p.grad->FullTensor();
          ASSERT_TRUE(full.ok()) << full.status();
          Record(p.name, Values(*full), &result.grads);
        }
      }
      if (adamw.has_value()) {
        absl::Status s = adamw->Step();
        ASSERT_TRUE(s.ok()) << s;
      } else {
        for (const TrainableParameter& p : trainable->params) {
          ASSERT_TRUE(Axpy(static_cast<float>(-run.lr), p.grad->local(),
                           p.param->mutable_local())
                          .ok());
        }
      }
    }
    for (const TrainableParameter& p : trainable->params) {
      absl::StatusOr<Tensor> full = p.param->FullTensor();
      ASSERT_TRUE(full.ok()) << full.status();
      Record(p.name, Values(*full), &result.params);
    }
  });
  return result;
}

TrainingResult TrainReference(const TrainingRun& run) {
  return Train(run, {{"ref", 1}}, ReferenceSetup());
}

}  // namespace testing_util
}  // namespace fsdpp
