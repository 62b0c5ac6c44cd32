// Gradient clipping; see clip.h.
//
// Each gradient's local sum of squares lands in one slot of a small f32
// tensor on the gradients' device. On the host and with a pipeline the slots
// are read back once, the per-rank total added up in double and rounded to
// f32 once for the all-reduces; on a GPU (no pipeline) the slots are added
// there (Sum: double accumulation), all-reduced there, and only the final
// total is read back: one host sync. GradNormSquaredOnDevice stops before
// that read, on any device.
#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "optim/kernels/adamw.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace {

// InvalidArgument unless every grad is a defined float DTensor on grad 0's
// mesh (any mesh unless `one_mesh`) without Partial placements, all on one
// device.
absl::Status CheckGrads(const char* op, const std::vector<DTensor*>& grads,
                        bool one_mesh = true) {
  const DeviceMesh* mesh = grads[0] != nullptr ? grads[0]->mesh() : nullptr;
  for (size_t i = 0; i < grads.size(); ++i) {
    const DTensor* g = grads[i];
    if (g == nullptr || g->mesh() == nullptr || !g->local().defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": grad ", i, " is null or undefined"));
    }
    const std::string what =
        absl::StrCat(op, ": grad ", i, " (", g->ToString(), ") ");
    if (one_mesh && g->mesh() != mesh) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "is on another mesh than grad 0"));
    }
    if (!IsFloatingPoint(g->dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(what, "is not float"));
    }
    if (g->local().device() != grads[0]->local().device()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "must be on grad 0's device"));
    }
    for (const Placement& p : g->placements()) {
      if (p.is_partial()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, "has a Partial placement: reduce it first"));
      }
    }
  }
  return absl::OkStatus();
}

// The meshes of `grads`, in order of first appearance.
std::vector<const DeviceMesh*> MeshesOf(const std::vector<DTensor*>& grads) {
  std::vector<const DeviceMesh*> meshes;
  for (const DTensor* g : grads) {
    if (g != nullptr &&
        std::find(meshes.begin(), meshes.end(), g->mesh()) == meshes.end()) {
      meshes.push_back(g->mesh());
    }
  }
  return meshes;
}

// The grads on mesh `m` and their count flags.
void OnMesh(const std::vector<DTensor*>& grads,
            const PipelineNormOptions& options, const DeviceMesh* m,
            std::vector<DTensor*>* on_mesh, PipelineNormOptions* part) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i]->mesh() != m) continue;
    on_mesh->push_back(grads[i]);
    if (!options.counts.empty()) part->counts.push_back(options.counts[i]);
  }
}

// This rank's share of the squared norm: one f32 slot per grad on the grads'
// device, its local sum of squares or 0 for a grad not counted here, and
// the mesh axes the total is reduced over.
struct LocalSquares {
  Tensor sums;
  std::vector<bool> counted;
  std::vector<bool> reduced;
  DeviceMesh* mesh = nullptr;
};

// The squared norm from `local` on its device: the slots added there
// (Sum: double accumulation), all-reduced over the reduced axes there (the
// compute stream waits on each all-reduce), into *total (f32 [1]).
absl::Status ReduceOnDevice(const LocalSquares& local, Tensor* total,
                            absl::Duration timeout) {
  FSDPP_RETURN_IF_ERROR(Sum(local.sums, total));
  for (int a = 0; a < local.mesh->ndim(); ++a) {
    if (!local.reduced[a]) continue;
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group,
                           local.mesh->Group(local.mesh->axes()[a].name));
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<Work> work,
        group->AllReduce(
            Buffer{total->raw_data(), 1, DType::kF32, total->device()},
            ReduceOp::kSum));
    FSDPP_RETURN_IF_ERROR(work->WaitForCompute(total->device(), timeout));
  }
  return absl::OkStatus();
}

// The checks, the reduced axes, the counted grads and their sums of squares
// (GradNorm's first half, its errors naming `op`). grads is not empty.
absl::StatusOr<LocalSquares> Squares(const char* op,
                                     const std::vector<DTensor*>& grads,
                                     const PipelineNormOptions& pipeline) {
  FSDPP_RETURN_IF_ERROR(CheckGrads(op, grads));
  LocalSquares out;
  DeviceMesh* mesh = out.mesh = grads[0]->mesh();
  const int64_t n = static_cast<int64_t>(grads.size());

  // The axes some grad is sharded on: the ones the total is reduced over.
  out.reduced.assign(mesh->ndim(), false);
  for (const DTensor* g : grads) {
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (g->placements()[a].is_shard()) out.reduced[a] = true;
    }
  }

  // This rank's share: a grad that is Replicate on a reduced axis counts only
  // on that axis' coordinate 0 (its other coordinates hold copies).
  out.counted.assign(n, false);
  for (int64_t i = 0; i < n; ++i) {
    bool counts = pipeline.counts.empty() || pipeline.counts[i];
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (out.reduced[a] && !grads[i]->placements()[a].is_shard() &&
          mesh->coordinate()[a] != 0) {
        counts = false;
      }
    }
    out.counted[i] = counts;
  }

  // Local sums of squares of the counted grads, one slot per grad (meta
  // gradients, a dry run's, have no values: their sums are zeros).
  FSDPP_ASSIGN_OR_RETURN(
      out.sums, Tensor::Zeros({n}, DType::kF32, grads[0]->local().device()));
  for (int64_t i = 0; i < n; ++i) {
    if (!out.counted[i]) continue;
    FSDPP_ASSIGN_OR_RETURN(Tensor slot, out.sums.Narrow(i, 1));
    FSDPP_RETURN_IF_ERROR(SumOfSquares(grads[i]->local(), &slot));
  }
  return out;
}

absl::Status CheckCounts(const char* op, const std::vector<DTensor*>& grads,
                         const PipelineNormOptions& pipeline) {
  if (!pipeline.counts.empty() && pipeline.counts.size() != grads.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", pipeline.counts.size(), " count flags for ",
                     grads.size(), " grads"));
  }
  return absl::OkStatus();
}

// The stages' squared norms gathered over the pipeline group in double (as
// 64-bit words) and added in pipeline-rank order on every rank, so that
// splitting the model into stages changes only how the squares associate.
absl::StatusOr<double> PipelineTotal(ProcessGroup* group, double total,
                                     absl::Duration timeout) {
  int64_t bits = 0;
  std::memcpy(&bits, &total, sizeof(bits));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor mine,
      group->device().is_meta()
          ? Tensor::Zeros({1}, DType::kI64, group->device())
          : Tensor::FromInts({1}, {bits}, DType::kI64, group->device()));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor all, Tensor::Zeros({group->size()}, DType::kI64, group->device()));
  CollectiveOptions blocking;
  blocking.async_op = false;
  FSDPP_ASSIGN_OR_RETURN(
      std::shared_ptr<Work> work,
      group->AllGather(
          Buffer{mine.raw_data(), 1, DType::kI64, mine.device()},
          Buffer{all.raw_data(), group->size(), DType::kI64, all.device()},
          blocking));
  FSDPP_RETURN_IF_ERROR(work->Wait(timeout));
  std::vector<int64_t> words(group->size(), 0);
  if (!all.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(words, all.ToInts());
  }
  double sum = 0.0;
  for (int64_t w : words) {
    double stage_total = 0.0;
    std::memcpy(&stage_total, &w, sizeof(stage_total));
    sum += stage_total;
  }
  return sum;
}

// GradNorm, its errors naming `op`.
absl::StatusOr<double> Norm(const char* op, const std::vector<DTensor*>& grads,
                            const PipelineNormOptions& pipeline,
                            absl::Duration timeout) {
  FSDPP_RETURN_IF_ERROR(CheckCounts(op, grads, pipeline));
  if (grads.empty() && pipeline.pipeline == nullptr) return 0.0;
  if (grads.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": a pipeline rank without grads"));
  }
  // Grads on several meshes (a mixture of experts' experts on the expert
  // mesh, the rest on the model's): each mesh's share reduced over its own
  // axes, the squares added, in the meshes' order of first appearance.
  const std::vector<const DeviceMesh*> meshes = MeshesOf(grads);
  if (meshes.size() > 1) {
    FSDPP_RETURN_IF_ERROR(CheckGrads(op, grads, /*one_mesh=*/false));
    if (pipeline.pipeline != nullptr && !pipeline.stage_reduced) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": grads on ", meshes.size(),
          " meshes with a pipeline need PipelineNormOptions::stage_reduced"));
    }
    // This stage's share (each mesh reduced over its own axes), then the
    // stages' shares added over the pipeline.
    double squares = 0.0;
    for (const DeviceMesh* m : meshes) {
      std::vector<DTensor*> on_mesh;
      PipelineNormOptions part;
      OnMesh(grads, pipeline, m, &on_mesh, &part);
      FSDPP_ASSIGN_OR_RETURN(const double norm,
                             Norm(op, on_mesh, part, timeout));
      squares += norm * norm;
    }
    if (pipeline.pipeline != nullptr) {
      FSDPP_ASSIGN_OR_RETURN(
          squares, PipelineTotal(pipeline.pipeline, squares, timeout));
    }
    return std::sqrt(squares);
  }
  FSDPP_ASSIGN_OR_RETURN(LocalSquares local, Squares(op, grads, pipeline));
  DeviceMesh* mesh = local.mesh;
  const std::vector<bool>& reduced = local.reduced;
  const std::vector<bool>& counted = local.counted;
  const int64_t n = static_cast<int64_t>(grads.size());
  const Device device = local.sums.device();
  if (device.is_cuda() && pipeline.pipeline == nullptr) {
    // On a GPU: added and all-reduced there, one host read.
    FSDPP_ASSIGN_OR_RETURN(Tensor total,
                           Tensor::Zeros({1}, DType::kF32, device));
    FSDPP_RETURN_IF_ERROR(ReduceOnDevice(local, &total, timeout));
    FSDPP_ASSIGN_OR_RETURN(float value, Item(total));
    return std::sqrt(static_cast<double>(value));
  }
  std::vector<float> local_sums(n, 0.0f);
  if (!device.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(local_sums, local.sums.ToFloats());
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (counted[i]) total += local_sums[i];
  }

  // Pipeline (by default): the stages' local totals added first, then
  // reduced over the mesh's axes below.
  if (pipeline.pipeline != nullptr && !pipeline.stage_reduced) {
    FSDPP_ASSIGN_OR_RETURN(total,
                           PipelineTotal(pipeline.pipeline, total, timeout));
  }

  // One all-reduce of one scalar per reduced axis.
  Tensor scalar;
  const auto reduce_over = [&](ProcessGroup* group) -> absl::Status {
    if (!scalar.defined()) {
      FSDPP_ASSIGN_OR_RETURN(
          scalar, group->device().is_meta()
                      ? Tensor::Zeros({1}, DType::kF32, group->device())
                      : Tensor::FromFloats({1}, {static_cast<float>(total)},
                                           DType::kF32, group->device()));
    }
    CollectiveOptions blocking;  // Waited for at once.
    blocking.async_op = false;
    FSDPP_ASSIGN_OR_RETURN(
        std::shared_ptr<Work> work,
        group->AllReduce(
            Buffer{scalar.raw_data(), 1, DType::kF32, scalar.device()},
            ReduceOp::kSum, blocking));
    return work->Wait(timeout);
  };
  for (int a = 0; a < mesh->ndim(); ++a) {
    if (!reduced[a]) continue;
    FSDPP_ASSIGN_OR_RETURN(ProcessGroup * group,
                           mesh->Group(mesh->axes()[a].name));
    FSDPP_RETURN_IF_ERROR(reduce_over(group));
  }
  if (scalar.defined() && !scalar.is_meta()) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> reduced_total, scalar.ToFloats());
    total = reduced_total[0];
  }
  if (pipeline.pipeline != nullptr && pipeline.stage_reduced) {
    FSDPP_ASSIGN_OR_RETURN(total,
                           PipelineTotal(pipeline.pipeline, total, timeout));
  }
  return std::sqrt(total);
}

}  // namespace

absl::StatusOr<double> GradNorm(const std::vector<DTensor*>& grads,
                                absl::Duration timeout) {
  return Norm("GradNorm", grads, {}, timeout);
}

absl::StatusOr<double> GradNorm(const std::vector<DTensor*>& grads,
                                const PipelineNormOptions& pipeline,
                                absl::Duration timeout) {
  return Norm("GradNorm", grads, pipeline, timeout);
}

absl::Status GradNormSquaredOnDevice(const std::vector<DTensor*>& grads,
                                     const PipelineNormOptions& options,
                                     Tensor* norm_sq, absl::Duration timeout) {
  const char* op = "GradNormSquaredOnDevice";
  FSDPP_RETURN_IF_ERROR(CheckCounts(op, grads, options));
  if (options.pipeline != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op,
                     ": not with a pipeline (its stages' totals travel as host "
                     "doubles); use GradNorm"));
  }
  if (norm_sq == nullptr || !norm_sq->defined() ||
      norm_sq->dtype() != DType::kF32 || norm_sq->numel() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": the output must be an f32 tensor of one element, got ",
        norm_sq == nullptr ? std::string("null") : norm_sq->ToString()));
  }
  if (grads.empty()) return Zero(norm_sq);
  if (norm_sq->device() != grads[0]->local().device()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the output ", norm_sq->ToString(),
                     " is not on the grads' device ",
                     grads[0]->local().device().ToString()));
  }
  // Several meshes (Norm's note): each one's share reduced on the device,
  // added there.
  const std::vector<const DeviceMesh*> meshes = MeshesOf(grads);
  if (meshes.size() > 1) {
    FSDPP_RETURN_IF_ERROR(CheckGrads(op, grads, /*one_mesh=*/false));
    FSDPP_RETURN_IF_ERROR(Zero(norm_sq));
    FSDPP_ASSIGN_OR_RETURN(Tensor part,
                           Tensor::Zeros({1}, DType::kF32, norm_sq->device()));
    for (const DeviceMesh* m : meshes) {
      std::vector<DTensor*> on_mesh;
      PipelineNormOptions part_options;
      OnMesh(grads, options, m, &on_mesh, &part_options);
      FSDPP_ASSIGN_OR_RETURN(LocalSquares local,
                             Squares(op, on_mesh, part_options));
      FSDPP_RETURN_IF_ERROR(ReduceOnDevice(local, &part, timeout));
      FSDPP_RETURN_IF_ERROR(Add(*norm_sq, part, norm_sq));
    }
    return absl::OkStatus();
  }
  FSDPP_ASSIGN_OR_RETURN(LocalSquares local, Squares(op, grads, options));
  return ReduceOnDevice(local, norm_sq, timeout);
}

float ClipCoefficient(double norm, double max_norm) {
  return kernels::ClipCoefficient(norm, max_norm);
}

absl::StatusOr<double> ClipGradNorm(const std::vector<DTensor*>& grads,
                                    double max_norm, absl::Duration timeout) {
  return ClipGradNorm(grads, max_norm, PipelineNormOptions{}, timeout);
}

absl::StatusOr<double> ClipGradNorm(const std::vector<DTensor*>& grads,
                                    double max_norm,
                                    const PipelineNormOptions& pipeline,
                                    absl::Duration timeout) {
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClipGradNorm: max_norm must be finite and > 0, got ", max_norm));
  }
  FSDPP_ASSIGN_OR_RETURN(const double norm,
                         Norm("ClipGradNorm", grads, pipeline, timeout));
  if (!std::isfinite(norm)) return norm;
  const float coef = ClipCoefficient(norm, max_norm);
  if (coef < 1.0f) {
    for (DTensor* g : grads) {
      FSDPP_RETURN_IF_ERROR(Scale(g->local(), coef, g->mutable_local()));
    }
  }
  return norm;
}

absl::Status ZeroGrad(const std::vector<DTensor*>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("ZeroGrad: grad ", i, " is null"));
    }
    FSDPP_RETURN_IF_ERROR(Zero(grads[i]->mutable_local()));
  }
  return absl::OkStatus();
}

}  // namespace fsdpp
