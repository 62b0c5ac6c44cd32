// Gradient-norm clipping and zeroing over sharded gradients.
//
// The global norm needs every rank's share of every gradient, but only one
// scalar per sharding mesh axis travels: each rank adds up the local sums of
// squares of all its gradients first (one host read for all of them), then
// all-reduces that scalar once over each mesh axis some gradient is sharded
// on. Axes no gradient is sharded on (HSDP's replicate axis) are not reduced
// over at all: every rank along them already holds the same total. A
// gradient that is Replicate on a reduced axis (a small unsharded tensor next
// to sharded ones) counts only on that axis' coordinate-0 rank. So no copy is
// counted twice, whatever the mix of placements.
#ifndef FSDPP_OPTIM_CLIP_H_
#define FSDPP_OPTIM_CLIP_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "tensor/dtensor.h"

namespace fsdpp {

// Computes the L2 norm of all `grads` together (sqrt of the sum over tensors
// of their SumOfSquares, the same value on every rank) and, when it exceeds
// `max_norm`, scales every grad in place (locally, no further communication)
// by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_ does.
// Returns the norm before clipping. Every rank of the mesh must call it with
// the same list. Grads must be float DTensors without Partial placements,
// on one mesh or on several over the same ranks (a mixture of experts'
// experts on their own mesh: each mesh's share is reduced over its own axes
// and the squares added; with a pipeline, PipelineNormOptions::stage_reduced);
// max_norm must be > 0. A
// non-finite norm is returned and the grads are left unscaled (the caller skips
// the step). An empty list has norm 0.
absl::StatusOr<double> ClipGradNorm(const std::vector<DTensor*>& grads,
                                    double max_norm,
                                    absl::Duration timeout = absl::Minutes(30));

// The norm ClipGradNorm computes (same arguments, same communication),
// without scaling anything. Meta gradients (a dry run's, plan/dry_run.h)
// have norm 0, after the same allocations and collectives.
absl::StatusOr<double> GradNorm(const std::vector<DTensor*>& grads,
                                absl::Duration timeout = absl::Minutes(30));

// Pipeline parallelism: each rank holds the grads of its own stages, so the
// model's norm adds the ranks' totals over the pipeline group too.
struct PipelineNormOptions {
  // The pipeline ranks: each rank's total (in double) is gathered over it
  // and added up before the grads' own mesh axes are reduced over (the
  // rounding of a one-device run's norm); null: none.
  ProcessGroup* pipeline = nullptr;
  // Each stage's total reduced over its own meshes' axes first, and the
  // stages' reduced totals then gathered and added (in double): needed when
  // some stage's grads lie on several meshes (expert parallelism's experts),
  // and then set on every pipeline rank alike. Grads on several meshes with
  // a pipeline are refused without it.
  bool stage_reduced = false;
  // Per grad: whether it counts in the norm (empty: all). A tied weight's
  // copy on another stage is scaled but not counted, so that the weight
  // counts once.
  std::vector<bool> counts;
};
absl::StatusOr<double> ClipGradNorm(const std::vector<DTensor*>& grads,
                                    double max_norm,
                                    const PipelineNormOptions& pipeline,
                                    absl::Duration timeout = absl::Minutes(30));
absl::StatusOr<double> GradNorm(const std::vector<DTensor*>& grads,
                                const PipelineNormOptions& pipeline,
                                absl::Duration timeout = absl::Minutes(30));

// The square of GradNorm's norm (same arguments, same collectives), left in
// `*norm_sq` (f32, one element, on the grads' device) with nothing read
// back: the local sums of squares are added on the device and all-reduced
// there, and the device, not the host, waits for each all-reduce
// (Work::WaitForCompute). What AdamW::Step(StepGuard) reads on a GPU, so
// that a step needs no host synchronisation. `options.pipeline` must be null
// (the stages' totals travel as host doubles). Note the total is rounded to
// f32 before the all-reduces, as on a GPU GradNorm does; on the host
// GradNorm keeps a rank's total in double until then.
absl::Status GradNormSquaredOnDevice(
    const std::vector<DTensor*>& grads, const PipelineNormOptions& options,
    Tensor* norm_sq, absl::Duration timeout = absl::Minutes(30));

// The factor ClipGradNorm scales the grads by for `norm`: max_norm /
// (norm + 1e-6) rounded to f32 when that is below 1, else exactly 1. Pass it
// to AdamW::Step(grad_scale) to clip inside the optimizer's pass instead of
// in a pass of its own: the update is bit for bit the same.
float ClipCoefficient(double norm, double max_norm);

// Sets every element of every grad's local shard to 0.
absl::Status ZeroGrad(const std::vector<DTensor*>& grads);

}  // namespace fsdpp

#endif  // FSDPP_OPTIM_CLIP_H_
