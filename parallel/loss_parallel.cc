// Loss parallel; see loss_parallel.h.
#include "parallel/loss_parallel.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "core/status.h"
#include "core/trace.h"
#include "mesh/device_mesh.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"
#include "tensor/placement.h"

namespace fsdpp {
namespace parallel {
namespace {

constexpr char kName[] = "LossParallelCrossEntropy";

absl::Status Invalid(const DTensor& logits, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(kName, ": ", what, " (logits ", logits.ToString(), ")"));
}

// The mesh axis the vocabulary (the last dim) is sharded on.
absl::StatusOr<int> VocabAxis(const DTensor& logits) {
  const int last = static_cast<int>(logits.shape().size()) - 1;
  const std::vector<Placement>& placements = logits.placements();
  const auto& axes = logits.mesh()->axes();
  int axis = -1;
  for (int a = 0; a < static_cast<int>(placements.size()); ++a) {
    const Placement& p = placements[a];
    if (p.is_partial()) {
      return Invalid(logits,
                     absl::StrCat("Partial on mesh axis '", axes[a].name,
                                  "': reduce the logits first"));
    }
    if (p.is_shard(last)) {
      if (axis >= 0) {
        return Invalid(logits, absl::StrCat("the vocabulary is sharded over "
                                            "two mesh axes ('",
                                            axes[axis].name, "' and '",
                                            axes[a].name, "')"));
      }
      axis = a;
    } else if (p.is_shard()) {
      return Invalid(
          logits, absl::StrCat("dim ", p.dim(), " is sharded over mesh axis '",
                               axes[a].name,
                               "': only the vocabulary (last) dim may be"));
    }
  }
  if (axis < 0) {
    return Invalid(logits,
                   "the vocabulary (last) dim is not sharded: use "
                   "nn::CrossEntropyLoss on the local logits");
  }
  return axis;
}

// In-place blocking all-reduce of an f32 tensor over `group`.
absl::Status AllReduceF32(ProcessGroup* group, Tensor* t, ReduceOp op,
                          absl::Duration timeout) {
  TraceSpan span("loss parallel all-reduce", "comm_wait");
  CollectiveOptions blocking;
  blocking.async_op = false;
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group->AllReduce(AsBuffer(*t), op, blocking));
  return work->Wait(timeout);
}

}  // namespace

absl::StatusOr<float> LossParallelCrossEntropy::Forward(const DTensor& logits,
                                                        const Tensor& targets) {
  saved_ = false;
  logits_ = DTensor();
  targets_ = max_ = sumexp_ = Tensor();
  if (logits.mesh() == nullptr || !logits.local().defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": undefined logits"));
  }
  if (!targets.defined()) {
    return Invalid(logits, "undefined targets");
  }
  if (targets.dtype() != DType::kI32 && targets.dtype() != DType::kI64) {
    return Invalid(logits, absl::StrCat("targets ", targets.ToString(),
                                        " must be i32 or i64"));
  }
  FSDPP_ASSIGN_OR_RETURN(const int axis, VocabAxis(logits));
  DeviceMesh* mesh = logits.mesh();
  FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group,
                         mesh->Group(mesh->axes()[axis].name));
  const Tensor& local = logits.local();
  const Device device = local.device();
  const int64_t vocab = logits.shape().back();
  const int64_t offset = logits.local_box().offset.back();
  const int64_t n = targets.numel();

  // This slice's statistics, then the whole rows' max.
  FSDPP_ASSIGN_OR_RETURN(Tensor max, Tensor::Empty({n}, DType::kF32, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor sumexp,
                         Tensor::Empty({n}, DType::kF32, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor target,
                         Tensor::Empty({n}, DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropyShardStats(local, targets, offset, vocab,
                                      ignore_index_, &max, &sumexp, &target),
               kName));
  FSDPP_ASSIGN_OR_RETURN(Tensor global_max,
                         Tensor::Empty({n}, DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(Copy(max, &global_max));
  FSDPP_RETURN_IF_ERROR(
      AllReduceF32(group, &global_max, ReduceOp::kMax, timeout_));

  // What Backward needs (sumexp_ is set by the caller).
  const auto keep = [&](int64_t count) {
    logits_ = logits;
    targets_ = targets;
    max_ = global_max;
    vocab_offset_ = offset;
    count_ = count;
    saved_ = true;
  };
  if (device.is_meta()) {
    // A dry run (plan/dry_run.h): the same tensors and collectives as below,
    // no values to read (the loss is 0 and every row counts).
    FSDPP_ASSIGN_OR_RETURN(Tensor sums,
                           Tensor::Empty({2 * n}, DType::kF32, device));
    FSDPP_RETURN_IF_ERROR(AllReduceF32(group, &sums, ReduceOp::kSum, timeout_));
    FSDPP_ASSIGN_OR_RETURN(sumexp_, Tensor::Empty({n}, DType::kF32, device));
    keep(n);
    return 0.0f;
  }

  // Rescaled sums and target logits, summed over the slices in one go.
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> m, max.ToFloats());
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> s, sumexp.ToFloats());
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> t, target.ToFloats());
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> gm, global_max.ToFloats());
  std::vector<float> packed(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    packed[i] = s[i] == 0.0f ? 0.0f : s[i] * std::exp(m[i] - gm[i]);
    packed[n + i] = t[i];
  }
  FSDPP_ASSIGN_OR_RETURN(
      Tensor sums, Tensor::FromFloats({2 * n}, packed, DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(AllReduceF32(group, &sums, ReduceOp::kSum, timeout_));
  FSDPP_ASSIGN_OR_RETURN(std::vector<float> summed, sums.ToFloats());

  // Per-row losses as CrossEntropy computes them, their sum as Sum does (in
  // double, rounded to f32), the mean as nn::CrossEntropyLoss takes it.
  FSDPP_ASSIGN_OR_RETURN(const std::vector<int64_t> ids, targets.ToInts());
  std::vector<float> row_sum(summed.begin(), summed.begin() + n);
  double total = 0.0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] == ignore_index_) {
      row_sum[i] = 1.0f;  // Unused by Backward (zero rows); keeps 1/sum finite.
      continue;
    }
    total += std::log(row_sum[i]) + gm[i] - summed[n + i];
    ++count;
  }
  float loss = 0.0f;
  if (count > 0) {
    loss = static_cast<float>(static_cast<double>(static_cast<float>(total)) /
                              count);
  }
  FSDPP_ASSIGN_OR_RETURN(sumexp_,
                         Tensor::FromFloats({n}, row_sum, DType::kF32, device));
  keep(count);
  return loss;
}

absl::StatusOr<DTensor> LossParallelCrossEntropy::Backward(float scale) {
  if (!saved_) {
    return absl::FailedPreconditionError(
        absl::StrCat(kName, ": Backward without a Forward"));
  }
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        kName, ": Backward scale must be finite and > 0, got ", scale));
  }
  const Tensor& local = logits_.local();
  const int64_t n = targets_.numel();
  FSDPP_ASSIGN_OR_RETURN(Tensor dlosses,
                         Tensor::Empty({n}, DType::kF32, local.device()));
  FSDPP_RETURN_IF_ERROR(Fill(&dlosses, count_ > 0 ? scale / count_ : 0.0f));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor dlocal,
      Tensor::Empty(local.shape(), local.dtype(), local.device()));
  FSDPP_RETURN_IF_ERROR(
      Annotate(CrossEntropyShardBackward(local, targets_, vocab_offset_,
                                         logits_.shape().back(), ignore_index_,
                                         max_, sumexp_, dlosses, &dlocal),
               absl::StrCat(kName, " backward")));
  FSDPP_ASSIGN_OR_RETURN(
      DTensor dlogits,
      DTensor::FromLocal(std::move(dlocal), logits_.mesh(),
                         logits_.placements(), logits_.shape()));
  saved_ = false;
  logits_ = DTensor();
  targets_ = max_ = sumexp_ = Tensor();
  return dlogits;
}

LossParallel::LossParallel(DeviceMesh* mesh, std::string tp_axis,
                           int64_t ignore_index, absl::Duration timeout)
    : mesh_(mesh),
      tp_axis_(std::move(tp_axis)),
      timeout_(timeout),
      loss_(ignore_index, timeout) {}

absl::StatusOr<float> LossParallel::Forward(const Tensor& logits,
                                            const Tensor& targets) {
  if (mesh_ == nullptr) {
    return absl::FailedPreconditionError("LossParallel: null mesh");
  }
  if (!logits.defined() || logits.ndim() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LossParallel: logits must be [.., V / tp], got ", logits.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(DeviceMesh * axis, mesh_->SubMesh({tp_axis_}));
  Shape global = logits.shape();
  global.back() *= axis->size();
  FSDPP_ASSIGN_OR_RETURN(
      DTensor sharded,
      DTensor::FromLocal(logits, axis, {Placement::Shard(logits.ndim() - 1)},
                         std::move(global)));
  // The count's mean, rescaled to the normalizer's (the sum over the
  // targets / normalizer) when one is set.
  FSDPP_ASSIGN_OR_RETURN(float mean, loss_.Forward(sharded, targets));
  return static_cast<float>(static_cast<double>(mean) *
                            CountToNormalizer(loss_.count()));
}

absl::StatusOr<Tensor> LossParallel::Backward(float scale) {
  FSDPP_ASSIGN_OR_RETURN(
      DTensor dlogits,
      loss_.Backward(static_cast<float>(static_cast<double>(scale) *
                                        CountToNormalizer(loss_.count()))));
  return dlogits.local();
}

std::unique_ptr<nn::LossFunction> LossParallel::Clone() const {
  auto out = std::make_unique<LossParallel>(mesh_, tp_axis_,
                                            loss_.ignore_index(), timeout_);
  out->set_normalizer(normalizer()).IgnoreError();  // valid: it is ours
  return out;
}

}  // namespace parallel
}  // namespace fsdpp
