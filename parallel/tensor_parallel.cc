// Tensor-parallel styles and ParallelizeModule; see tensor_parallel.h.
#include "parallel/tensor_parallel.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "core/status.h"
#include "core/trace.h"
#include "nn/embedding.h"
#include "nn/linear.h"
#include "nn/moe.h"
#include "tensor/ops.h"
#include "tensor/placement.h"

namespace fsdpp {
namespace parallel {
namespace {

using Fn = std::function<absl::StatusOr<Tensor>(const Tensor&)>;

// The tp axis as the transforms use it.
struct Axis {
  DeviceMesh* mesh = nullptr;  // 1-D: the tp axis only
  ProcessGroup* group = nullptr;
  int size = 1;
  int rank = 0;
  absl::Duration timeout;
};

// `local` placed `from` over the axis, laid out `to`; this rank's tensor.
absl::StatusOr<Tensor> Relayout(const Axis& axis, const Tensor& local,
                                Placement from, Placement to, Shape global) {
  // The tp collectives block the compute thread: all of their time is
  // exposed communication (the trainer's "comm_wait").
  TraceSpan span("tp relayout", "comm_wait");
  FSDPP_ASSIGN_OR_RETURN(DTensor d, DTensor::FromLocal(local, axis.mesh, {from},
                                                       std::move(global)));
  FSDPP_ASSIGN_OR_RETURN(DTensor r, d.Redistribute({to}, axis.timeout));
  return r.local();
}

absl::Status CheckSequence(const Axis& axis, const Tensor& x, int64_t t) {
  if (x.ndim() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence parallelism needs [B, T, ..] activations, got ",
                     x.ToString()));
  }
  if (t % axis.size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence parallelism: sequence length ", t,
                     " is not divisible by the tp size ", axis.size));
  }
  return absl::OkStatus();
}

// [B, T / tp, ..] -> [B, T, ..].
Fn GatherSequence(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    FSDPP_RETURN_IF_ERROR(CheckSequence(axis, x, 0));
    Shape global = x.shape();
    global[1] *= axis.size;
    return Relayout(axis, x, Placement::Shard(1), Placement::Replicate(),
                    global);
  };
}

// Partial [B, T, ..] -> reduced [B, T / tp, ..].
Fn ReduceScatterSequence(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    FSDPP_RETURN_IF_ERROR(CheckSequence(axis, x, x.ndim() < 2 ? 0 : x.dim(1)));
    return Relayout(axis, x, Placement::Partial(), Placement::Shard(1),
                    x.shape());
  };
}

// Replicated [B, T, ..] -> this rank's [B, T / tp, ..].
Fn SliceSequence(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    FSDPP_RETURN_IF_ERROR(CheckSequence(axis, x, x.ndim() < 2 ? 0 : x.dim(1)));
    return Relayout(axis, x, Placement::Replicate(), Placement::Shard(1),
                    x.shape());
  };
}

// Partial -> reduced, same shape.
Fn AllReduce(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    return Relayout(axis, x, Placement::Partial(), Placement::Replicate(),
                    x.shape());
  };
}

// [.., n / tp] -> [.., n].
Fn GatherLast(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    Shape global = x.shape();
    global.back() *= axis.size;
    return Relayout(axis, x, Placement::Shard(x.ndim() - 1),
                    Placement::Replicate(), global);
  };
}

// [.., n] -> this rank's [.., n / tp].
Fn SliceLast(Axis axis) {
  return [axis](const Tensor& x) -> absl::StatusOr<Tensor> {
    if (x.ndim() < 1 || x.dim(-1) % axis.size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallelism: the last dim of ", x.ToString(),
                       " is not divisible by the tp size ", axis.size));
    }
    return Relayout(axis, x, Placement::Replicate(),
                    Placement::Shard(x.ndim() - 1), x.shape());
  };
}

// After the module's backward, all-reduces the gradient that backward added
// to each of `params` (earlier micro-batches' sums are kept aside and added
// back, so each contribution is reduced exactly once); the gradient tensors
// keep their storage.
void ReduceGradientsAfterBackward(Module* module,
                                  std::vector<Parameter*> params, Axis axis) {
  auto stash = std::make_shared<std::vector<Tensor>>(params.size());
  module->AddPreBackwardHook([params, stash](Module&) -> absl::Status {
    for (size_t i = 0; i < params.size(); ++i) {
      Parameter* p = params[i];
      (*stash)[i] = Tensor();
      if (!p->grad.defined()) continue;
      FSDPP_ASSIGN_OR_RETURN(
          (*stash)[i], Tensor::Empty(p->grad.shape(), p->grad.dtype(),
                                     p->grad.device(), MemoryTag::kGrads));
      FSDPP_RETURN_IF_ERROR(Copy(p->grad, &(*stash)[i]));
      FSDPP_RETURN_IF_ERROR(Zero(&p->grad));
    }
    return absl::OkStatus();
  });
  module->AddPostBackwardHook([params, stash, axis](Module&) -> absl::Status {
    for (size_t i = 0; i < params.size(); ++i) {
      Parameter* p = params[i];
      if (!p->grad.defined()) continue;
      TraceSpan span("tp gradient all-reduce", "comm_wait");
      FSDPP_ASSIGN_OR_RETURN(
          std::shared_ptr<Work> work,
          axis.group->AllReduce({p->grad.raw_data(), p->grad.numel(),
                                 p->grad.dtype(), p->grad.device()},
                                ReduceOp::kSum));
      FSDPP_RETURN_IF_ERROR(work->Wait(axis.timeout));
      if ((*stash)[i].defined()) {
        FSDPP_RETURN_IF_ERROR(Axpy(1.0f, (*stash)[i], &p->grad));
        (*stash)[i] = Tensor();
      }
    }
    return absl::OkStatus();
  });
}

// What applying one plan entry does, decided before anything changes.
struct Step {
  std::string path;
  Module* module = nullptr;
  ParallelStyle style;
  std::vector<std::pair<Parameter*, ParameterPiece>> pieces;
  std::vector<Parameter*> reduced_gradients;
  std::vector<Module::Transform> inputs, outputs;
  nn::Linear* bias_on_rank0 = nullptr;
  // A mixture of experts whose auxiliary-loss gradient rank 0 adds.
  nn::MoE* aux_gradient_on_rank0 = nullptr;
  // Descendants whose parameters this step cuts (a Linear's LoRA adapters).
  std::vector<std::string> cut_children;
};

// The piece of `p` split on `dim` of `layout` into axis.size parts.
ParameterPiece SplitPiece(const Shape& layout, int dim, const Shape& local,
                          const Axis& axis) {
  ParameterPiece piece;
  piece.layout = layout;
  piece.offset = Shape(layout.size(), 0);
  piece.size = layout;
  piece.size[dim] = layout[dim] / axis.size;
  piece.offset[dim] = piece.size[dim] * axis.rank;
  piece.local_shape = local;
  return piece;
}

bool SamePiece(const ParameterPiece& a, const ParameterPiece& b) {
  return a.layout == b.layout && a.offset == b.offset && a.size == b.size &&
         a.local_shape == b.local_shape;
}

absl::Status Unsupported(const Step& s, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("tensor parallel plan: module '", s.path, "' (",
                   s.module->kind(), ") with ", s.style.ToString(), ": ", why));
}

absl::Status NotDivisible(const Step& s, const std::string& what, int64_t n,
                          const Axis& axis) {
  return Unsupported(
      s, absl::StrCat(what, " (", n, ") is not divisible by the tp size ",
                      axis.size));
}

absl::Status PlanColwise(const Axis& axis, Step* s) {
  const ParallelStyle& st = s->style;
  if (auto* linear = dynamic_cast<nn::Linear*>(s->module)) {
    const int64_t out = linear->out_features(), in = linear->in_features();
    const int blocks = st.fused_blocks;
    if (blocks < 1 || out % blocks != 0) {
      return Unsupported(
          *s, absl::StrCat("out_features ", out, " do not split into ", blocks,
                           " fused blocks"));
    }
    if ((out / blocks) % axis.size != 0) {
      return NotDivisible(
          *s,
          blocks == 1
              ? std::string("dim 0 of the weight (out_features)")
              : absl::StrCat("each of the ", blocks, " fused blocks' rows"),
          out / blocks, axis);
    }
    const int64_t local_out = out / axis.size;
    if (linear->lora_a() != nullptr) {
      // LoRA: B [out, r] is split as the weight's rows are; A [r, in] stays
      // whole, and its gradient, each rank's share of the output's, is
      // all-reduced after the backward.
      const int64_t r = linear->lora_a()->out_features();
      s->pieces.push_back({linear->lora_b()->weight(),
                           blocks == 1
                               ? SplitPiece({out, r}, 0, {local_out, r}, axis)
                               : SplitPiece({blocks, out / blocks, r}, 1,
                                            {local_out, r}, axis)});
      s->reduced_gradients.push_back(linear->lora_a()->weight());
      s->cut_children = {"lora_A", "lora_B"};
    }
    if (blocks == 1) {
      s->pieces.push_back(
          {linear->weight(), SplitPiece({out, in}, 0, {local_out, in}, axis)});
      if (linear->bias() != nullptr) {
        s->pieces.push_back(
            {linear->bias(), SplitPiece({out}, 0, {local_out}, axis)});
      }
    } else {
      s->pieces.push_back(
          {linear->weight(),
           SplitPiece({blocks, out / blocks, in}, 1, {local_out, in}, axis)});
      if (linear->bias() != nullptr) {
        s->pieces.push_back({linear->bias(), SplitPiece({blocks, out / blocks},
                                                        1, {local_out}, axis)});
      }
    }
  } else if (auto* embedding = dynamic_cast<nn::Embedding*>(s->module)) {
    if (st.fused_blocks != 1) {
      return Unsupported(*s, "an embedding has no fused blocks");
    }
    const int64_t v = embedding->num_embeddings(), c = embedding->dim();
    if (c % axis.size != 0) {
      return NotDivisible(*s, "dim 1 of the table (embedding dim)", c, axis);
    }
    s->pieces.push_back(
        {embedding->weight(), SplitPiece({v, c}, 1, {v, c / axis.size}, axis)});
  } else {
    return Unsupported(*s, "column-wise needs a Linear or an Embedding");
  }
  const bool is_embedding = dynamic_cast<nn::Embedding*>(s->module) != nullptr;
  if (!st.in_region && !is_embedding) {
    switch (st.input) {
      case Layout::kReplicate:
        s->inputs.push_back({nullptr, AllReduce(axis)});
        break;
      case Layout::kShardSequence:
        s->inputs.push_back(
            {GatherSequence(axis), ReduceScatterSequence(axis)});
        break;
      case Layout::kShardLast:
        return Unsupported(*s,
                           "the input must be replicated or sequence-"
                           "sharded");
    }
  } else if (is_embedding && st.input != Layout::kReplicate) {
    return Unsupported(*s, "an embedding's ids are replicated");
  }
  switch (st.output) {
    case Layout::kShardLast:
      break;
    case Layout::kReplicate:
      s->outputs.push_back({GatherLast(axis), SliceLast(axis)});
      break;
    case Layout::kShardSequence:
      return Unsupported(*s,
                         "the output is replicated or sharded on its "
                         "last dim");
  }
  return absl::OkStatus();
}

absl::Status PlanRowwise(const Axis& axis, Step* s) {
  const ParallelStyle& st = s->style;
  if (st.fused_blocks != 1) return Unsupported(*s, "row-wise has no blocks");
  if (auto* linear = dynamic_cast<nn::Linear*>(s->module)) {
    const int64_t out = linear->out_features(), in = linear->in_features();
    if (in % axis.size != 0) {
      return NotDivisible(*s, "dim 1 of the weight (in_features)", in, axis);
    }
    s->pieces.push_back(
        {linear->weight(),
         SplitPiece({out, in}, 1, {out, in / axis.size}, axis)});
    if (linear->bias() != nullptr) s->bias_on_rank0 = linear;
    if (linear->lora_a() != nullptr) {
      // LoRA: A [r, in] is split as the weight's columns are, so its path
      // adds to the partial sum the output reduces; B [out, r] stays whole,
      // and its gradient (a partial sum) is all-reduced after the backward.
      const int64_t r = linear->lora_a()->out_features();
      s->pieces.push_back({linear->lora_a()->weight(),
                           SplitPiece({r, in}, 1, {r, in / axis.size}, axis)});
      s->reduced_gradients.push_back(linear->lora_b()->weight());
      s->cut_children = {"lora_A", "lora_B"};
    }
    switch (st.input) {
      case Layout::kShardLast:
        break;
      case Layout::kReplicate:
        s->inputs.push_back({SliceLast(axis), GatherLast(axis)});
        break;
      case Layout::kShardSequence:
        return Unsupported(*s,
                           "the input must be sharded on its last dim or "
                           "replicated");
    }
  } else if (auto* embedding = dynamic_cast<nn::Embedding*>(s->module)) {
    const int64_t v = embedding->num_embeddings(), c = embedding->dim();
    if (v % axis.size != 0) {
      return NotDivisible(*s, "dim 0 of the table (vocabulary rows)", v, axis);
    }
    if (st.input != Layout::kReplicate) {
      return Unsupported(*s, "an embedding's ids are replicated");
    }
    s->pieces.push_back(
        {embedding->weight(), SplitPiece({v, c}, 0, {v / axis.size, c}, axis)});
  } else {
    return Unsupported(*s, "row-wise needs a Linear or an Embedding");
  }
  switch (st.output) {
    case Layout::kReplicate:
      s->outputs.push_back({AllReduce(axis), nullptr});
      break;
    case Layout::kShardSequence:
      s->outputs.push_back({ReduceScatterSequence(axis), GatherSequence(axis)});
      break;
    case Layout::kShardLast:
      return Unsupported(*s,
                         "the output (a partial sum) must be reduced to "
                         "replicated or sequence-sharded");
  }
  return absl::OkStatus();
}

// The stream's transforms around a region: in (gather; backward reduce the
// partial gradient) and out (reduce the partial sum; backward gather).
absl::Status RegionTransforms(const Axis& axis, Layout stream, bool output,
                              Step* s) {
  if (stream == Layout::kShardSequence) {
    s->inputs.push_back({GatherSequence(axis), ReduceScatterSequence(axis)});
    if (output) {
      s->outputs.push_back({ReduceScatterSequence(axis), GatherSequence(axis)});
    }
  } else if (stream == Layout::kReplicate) {
    s->inputs.push_back({nullptr, AllReduce(axis)});
    if (output) s->outputs.push_back({AllReduce(axis), nullptr});
  } else {
    return Unsupported(*s,
                       "a region's input is replicated or sequence-"
                       "sharded");
  }
  return absl::OkStatus();
}

absl::Status PlanMixtureOfExperts(const Axis& axis, Step* s) {
  auto* moe = dynamic_cast<nn::MoE*>(s->module);
  if (moe == nullptr) return Unsupported(*s, "needs an MoE");
  if (s->style.input != s->style.output) {
    return Unsupported(*s, "the input and output share the stream's layout");
  }
  const nn::MoeOptions& o = moe->options();
  if (o.hidden % axis.size != 0) {
    return NotDivisible(*s, "the experts' hidden width", o.hidden, axis);
  }
  if (o.shared_hidden % axis.size != 0) {
    return NotDivisible(*s, "the shared experts' hidden width", o.shared_hidden,
                        axis);
  }
  const int64_t e = o.num_experts, c = o.dim, h = o.hidden / axis.size;
  nn::GroupedExperts* experts = moe->experts();
  s->pieces.push_back(
      {experts->gate_proj(), SplitPiece({e, o.hidden, c}, 1, {e, h, c}, axis)});
  s->pieces.push_back(
      {experts->up_proj(), SplitPiece({e, o.hidden, c}, 1, {e, h, c}, axis)});
  s->pieces.push_back(
      {experts->down_proj(), SplitPiece({e, c, o.hidden}, 2, {e, c, h}, axis)});
  s->cut_children = {"experts"};
  std::vector<nn::Linear*> linears = {moe->gate()};
  if (nn::SwiGlu* shared = moe->shared_experts(); shared != nullptr) {
    const int64_t sh = o.shared_hidden / axis.size;
    for (nn::Linear* l : {shared->gate(), shared->up()}) {
      s->pieces.push_back(
          {l->weight(), SplitPiece({o.shared_hidden, c}, 0, {sh, c}, axis)});
    }
    s->pieces.push_back({shared->down()->weight(),
                         SplitPiece({c, o.shared_hidden}, 1, {c, sh}, axis)});
    for (const char* child : {"gate", "up", "down"}) {
      s->cut_children.push_back(absl::StrCat("shared_experts.", child));
    }
    linears.insert(linears.end(),
                   {shared->gate(), shared->up(), shared->down()});
  }
  for (nn::Linear* l : linears) {
    if (l->lora_a() != nullptr) {
      return Unsupported(*s, "LoRA adapters inside a mixture of experts");
    }
    if (l != moe->gate() && l->bias() != nullptr) {
      return Unsupported(*s, "the shared experts have biases");
    }
  }
  for (auto& [name, p] : moe->gate()->UsedParameters()) {
    s->reduced_gradients.push_back(p);
  }
  s->aux_gradient_on_rank0 = moe;
  return RegionTransforms(axis, s->style.input, /*output=*/true, s);
}

absl::Status PlanStep(const Axis& axis, Step* s) {
  const ParallelStyle& st = s->style;
  switch (st.kind) {
    case ParallelStyle::Kind::kColwise:
      return PlanColwise(axis, s);
    case ParallelStyle::Kind::kRowwise:
      return PlanRowwise(axis, s);
    case ParallelStyle::Kind::kSequenceParallel:
    case ParallelStyle::Kind::kReplicatedInRegion:
      for (auto& [name, p] : s->module->UsedParameters()) {
        s->reduced_gradients.push_back(p);
      }
      return absl::OkStatus();
    case ParallelStyle::Kind::kRegionInput:
      return RegionTransforms(axis, st.input, /*output=*/false, s);
    case ParallelStyle::Kind::kMixtureOfExperts:
      return PlanMixtureOfExperts(axis, s);
    case ParallelStyle::Kind::kPrepareOutput:
      if (st.input == Layout::kReplicate &&
          st.output == Layout::kShardSequence) {
        s->outputs.push_back({SliceSequence(axis), GatherSequence(axis)});
        return absl::OkStatus();
      }
      return Unsupported(*s,
                         "only replicated -> sequence-sharded outputs "
                         "are prepared");
  }
  return Unsupported(*s, "unknown style");
}

// The modules that read each parameter: a Linear or Embedding reads its
// weight (owned or shared) and bias, any other module its own parameters.
std::map<Parameter*, std::vector<std::string>> Readers(Module* root) {
  std::map<Parameter*, std::vector<std::string>> readers;
  for (auto& [path, m] : root->NamedModules()) {
    std::vector<Parameter*> params;
    if (auto* linear = dynamic_cast<nn::Linear*>(m)) {
      params.push_back(linear->weight());
      if (linear->bias() != nullptr) params.push_back(linear->bias());
    } else if (auto* embedding = dynamic_cast<nn::Embedding*>(m)) {
      params.push_back(embedding->weight());
    } else {
      for (auto& [name, p] : m->LocalParameters()) params.push_back(p);
    }
    for (Parameter* p : params) readers[p].push_back(path);
  }
  return readers;
}

absl::StatusOr<Axis> MakeAxis(DeviceMesh* mesh, const std::string& tp_axis,
                              absl::Duration timeout) {
  if (mesh == nullptr) {
    return absl::InvalidArgumentError("tensor parallelism: null mesh");
  }
  Axis axis;
  FSDPP_ASSIGN_OR_RETURN(axis.mesh, mesh->SubMesh({tp_axis}));
  FSDPP_ASSIGN_OR_RETURN(axis.group, mesh->Group(tp_axis));
  axis.size = axis.group->size();
  axis.rank = axis.group->rank();
  axis.timeout = timeout;
  return axis;
}

}  // namespace

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kReplicate:
      return "R";
    case Layout::kShardSequence:
      return "S(1)";
    case Layout::kShardLast:
      return "S(-1)";
  }
  return "?";
}

ParallelStyle ParallelStyle::Colwise(Layout input, Layout output) {
  ParallelStyle s;
  s.kind = Kind::kColwise;
  s.input = input;
  s.output = output;
  return s;
}

ParallelStyle ParallelStyle::ColwiseInRegion(int fused_blocks) {
  ParallelStyle s = Colwise(Layout::kReplicate, Layout::kShardLast);
  s.in_region = true;
  s.fused_blocks = fused_blocks;
  return s;
}

ParallelStyle ParallelStyle::Rowwise(Layout input, Layout output) {
  ParallelStyle s;
  s.kind = Kind::kRowwise;
  s.input = input;
  s.output = output;
  return s;
}

ParallelStyle ParallelStyle::SequenceParallel() {
  ParallelStyle s;
  s.kind = Kind::kSequenceParallel;
  s.input = s.output = Layout::kShardSequence;
  return s;
}

ParallelStyle ParallelStyle::ReplicatedInRegion() {
  ParallelStyle s;
  s.kind = Kind::kReplicatedInRegion;
  s.input = s.output = Layout::kReplicate;
  return s;
}

ParallelStyle ParallelStyle::RegionInput(Layout from) {
  ParallelStyle s;
  s.kind = Kind::kRegionInput;
  s.input = from;
  s.output = Layout::kReplicate;
  return s;
}

ParallelStyle ParallelStyle::MixtureOfExperts(Layout stream) {
  ParallelStyle s;
  s.kind = Kind::kMixtureOfExperts;
  s.input = s.output = stream;
  return s;
}

ParallelStyle ParallelStyle::PrepareOutput(Layout from, Layout to) {
  ParallelStyle s;
  s.kind = Kind::kPrepareOutput;
  s.input = from;
  s.output = to;
  return s;
}

std::string ParallelStyle::ToString() const {
  const std::string io = absl::StrCat("input ", LayoutName(input), ", output ",
                                      LayoutName(output));
  switch (kind) {
    case Kind::kColwise:
      return absl::StrCat("Colwise(", in_region ? std::string("in region") : io,
                          fused_blocks > 1
                              ? absl::StrCat(", ", fused_blocks, " blocks")
                              : std::string(),
                          ")");
    case Kind::kRowwise:
      return absl::StrCat("Rowwise(", io, ")");
    case Kind::kSequenceParallel:
      return "SequenceParallel";
    case Kind::kReplicatedInRegion:
      return "ReplicatedInRegion";
    case Kind::kRegionInput:
      return absl::StrCat("RegionInput(from ", LayoutName(input), ")");
    case Kind::kPrepareOutput:
      return absl::StrCat("PrepareOutput(", LayoutName(input), " -> ",
                          LayoutName(output), ")");
    case Kind::kMixtureOfExperts:
      return absl::StrCat("MixtureOfExperts(stream ", LayoutName(input), ")");
  }
  return "?";
}

absl::Status ParallelizeModule(Module* root, DeviceMesh* mesh,
                               const std::vector<PlanEntry>& plan,
                               const TensorParallelOptions& options) {
  if (root == nullptr) {
    return absl::InvalidArgumentError("tensor parallelism: null module");
  }
  FSDPP_ASSIGN_OR_RETURN(const Axis axis,
                         MakeAxis(mesh, options.tp_axis, options.timeout));
  std::map<std::string, Module*> modules;
  for (auto& [path, m] : root->NamedModules()) modules.emplace(path, m);

  // Check and plan every entry; nothing changes until all passed.
  std::vector<Step> steps;
  std::set<std::string> seen;
  for (const PlanEntry& e : plan) {
    auto it = modules.find(e.path);
    if (it == modules.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallel plan: no module '", e.path, "' in the ",
                       root->kind()));
    }
    if (!seen.insert(e.path).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor parallel plan: module '", e.path, "' appears twice"));
    }
    Step s;
    s.path = e.path;
    s.module = it->second;
    s.style = e.style;
    FSDPP_RETURN_IF_ERROR(PlanStep(axis, &s));
    steps.push_back(std::move(s));
  }
  // Every parameter gets one piece, from every module that reads it.
  std::map<Parameter*, std::pair<ParameterPiece, std::string>> pieces;
  std::set<std::string> cutting;
  for (const Step& s : steps) {
    for (const std::string& child : s.cut_children) {
      cutting.insert(s.path.empty() ? child : absl::StrCat(s.path, ".", child));
    }
    for (const auto& [p, piece] : s.pieces) {
      cutting.insert(s.path);
      if (p->has_piece() || p->grad.defined()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor parallel plan: a parameter of module '", s.path,
            "' is already ", p->has_piece() ? "cut to a piece" : "trained",
            " (apply the plan once, before the first backward)"));
      }
      auto [it, inserted] = pieces.emplace(p, std::make_pair(piece, s.path));
      if (!inserted && !SamePiece(it->second.first, piece)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor parallel plan: modules '", it->second.second,
                         "' and '", s.path, "' share a parameter ",
                         ShapeToString(p->shape), " but split it differently"));
      }
    }
  }
  for (const auto& [p, paths] : Readers(root)) {
    if (pieces.count(p) == 0) continue;
    for (const std::string& path : paths) {
      if (cutting.count(path) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor parallel plan: module '", path,
            "' reads the parameter that '", pieces[p].second,
            "' splits, but has no column- or row-wise style itself"));
      }
    }
  }

  // Apply.
  for (auto& [p, piece] : pieces) {
    FSDPP_RETURN_IF_ERROR(Annotate(
        p->SetPiece(piece.first),
        absl::StrCat("tensor parallel plan, module '", piece.second, "'")));
  }
  for (Step& s : steps) {
    if (s.bias_on_rank0 != nullptr) {
      s.bias_on_rank0->set_add_bias_in_forward(axis.rank == 0);
    }
    if (s.aux_gradient_on_rank0 != nullptr) {
      s.aux_gradient_on_rank0->set_adds_aux_gradient(axis.rank == 0);
    }
    for (Module::Transform& t : s.inputs) s.module->AddInputTransform(t);
    for (Module::Transform& t : s.outputs) s.module->AddOutputTransform(t);
    if (!s.reduced_gradients.empty()) {
      ReduceGradientsAfterBackward(s.module, s.reduced_gradients, axis);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Placement> PieceSplit(const Parameter& p) {
  if (!p.has_piece()) return Placement::Replicate();
  const std::vector<int> split = p.piece.SplitDims();
  if (split.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", ShapeToString(p.shape), ": its piece ",
        ShapeToString(p.piece.size), " of ", ShapeToString(p.piece.layout),
        " is split on more than one dim"));
  }
  return split.empty() ? Placement::Replicate() : Placement::Shard(split[0]);
}

absl::StatusOr<std::vector<TensorParallelParameter>> TensorParallelParameters(
    Module* root, DeviceMesh* mesh, const std::string& tp_axis) {
  if (root == nullptr || mesh == nullptr) {
    return absl::InvalidArgumentError(
        "TensorParallelParameters: null module or mesh");
  }
  FSDPP_ASSIGN_OR_RETURN(DeviceMesh * axis, mesh->SubMesh({tp_axis}));
  std::vector<TensorParallelParameter> out;
  for (auto& [name, p] : root->NamedParameters()) {
    FSDPP_RETURN_IF_ERROR(p->EnsureGrad());
    FSDPP_ASSIGN_OR_RETURN(const Placement split, PieceSplit(*p));
    const Shape& layout = p->Layout();
    const Shape box = p->has_piece() ? p->piece.size : p->shape;
    TensorParallelParameter tp;
    tp.name = name;
    tp.parameter = p;
    FSDPP_ASSIGN_OR_RETURN(Tensor data, p->data.Reshape(box));
    FSDPP_ASSIGN_OR_RETURN(Tensor grad, p->grad.Reshape(box));
    absl::StatusOr<DTensor> param =
        DTensor::FromLocal(data, axis, {split}, layout);
    if (!param.ok()) return Annotate(param.status(), name);
    tp.param = *std::move(param);
    FSDPP_ASSIGN_OR_RETURN(tp.grad,
                           DTensor::FromLocal(grad, axis, {split}, layout));
    out.push_back(std::move(tp));
  }
  return out;
}

}  // namespace parallel
}  // namespace fsdpp
