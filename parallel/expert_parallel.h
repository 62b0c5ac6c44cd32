// Expert parallelism: a mixture of experts' experts split over the ranks of
// an `ep` process group (torchtitan's expert parallelism). Each rank keeps
// num_experts / ep consecutive experts of every MoE layer (a piece of the
// experts' stacked weights on the expert dim, so FSDP shards, and
// checkpoints save, each rank's experts as a box of the whole stack, and a
// checkpoint loads at any ep), routes its own tokens, and sends each token
// row to the rank of its expert and back: one all-gather of the rows per
// expert, then all-to-alls with uneven splits (ProcessGroup::AllToAllV), two
// in forward and two in backward (nn/moe.h). Every rank of the group reads
// different data: the group's ranks are data-parallel ranks that share
// their experts, and an expert's gradient sums what every rank's tokens
// gave it.
#ifndef FSDPP_PARALLEL_EXPERT_PARALLEL_H_
#define FSDPP_PARALLEL_EXPERT_PARALLEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "nn/module.h"
#include "nn/moe.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace parallel {

// nn::ExpertParallelism over `group` (not owned; Gloo: host buffers). Each
// collective waits at most `timeout`, then fails naming itself.
class ExpertParallel final : public nn::ExpertParallelism {
 public:
  explicit ExpertParallel(ProcessGroup* group,
                          absl::Duration timeout = absl::Minutes(5))
      : group_(group), timeout_(timeout) {}

  int size() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  ProcessGroup* group() const { return group_; }

  absl::StatusOr<std::vector<int64_t>> GatherSizes(
      const std::vector<int64_t>& sizes) override;
  absl::Status AllToAllRows(const Tensor& in,
                            const std::vector<int64_t>& send_rows, Tensor* out,
                            const std::vector<int64_t>& recv_rows) override;

 private:
  ProcessGroup* group_;
  absl::Duration timeout_;
};

// Splits every nn::MoE under `module` over `ep`: its experts' stacks keep
// this rank's experts [q L, (q + 1) L), L = num_experts / ep.size(), q =
// ep.rank() (Parameter::SetPiece on dim 0: on the meta device a shape, on
// materialised weights a copy of the box; a tensor-parallel piece of the
// experts' hidden, from the plan's MixtureOfExperts style, is narrowed to
// these experts), and the MoE dispatches through
// `ep` (not owned; it must outlive the module's use). Before FSDP and before
// any gradient. InvalidArgument naming the layer when ep's size does not
// divide its experts; FailedPrecondition for a layer already split. Nothing
// changes on error.
absl::Status ShardExperts(Module& module, ExpertParallel* ep);

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_EXPERT_PARALLEL_H_
