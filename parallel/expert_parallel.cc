// Expert parallelism; see expert_parallel.h.
#include "parallel/expert_parallel.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/trace.h"

namespace fsdpp {
namespace parallel {

absl::StatusOr<std::vector<int64_t>> ExpertParallel::GatherSizes(
    const std::vector<int64_t>& sizes) {
  TraceSpan span("expert_parallel.sizes", "comm");
  const int64_t n = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> in = sizes;
  std::vector<int64_t> all(n * size());
  const Buffer input{in.data(), n, DType::kI64, group_->device()};
  const Buffer output{all.data(), n * size(), DType::kI64, group_->device()};
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group_->AllGather(input, output));
  FSDPP_RETURN_IF_ERROR(
      Annotate(work->Wait(timeout_), "expert parallel: rows per expert"));
  return all;
}

absl::Status ExpertParallel::AllToAllRows(
    const Tensor& in, const std::vector<int64_t>& send_rows, Tensor* out,
    const std::vector<int64_t>& recv_rows) {
  TraceSpan span("expert_parallel.all_to_all", "comm");
  if (in.ndim() != 2 || out->ndim() != 2 || in.dim(1) != out->dim(1) ||
      in.dtype() != out->dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert parallel: rows ", in.ToString(), " and ",
                     out->ToString(), " must be [rows, C] of one dtype"));
  }
  const int64_t c = in.dim(1);
  std::vector<int64_t> send(send_rows.size()), recv(recv_rows.size());
  for (size_t i = 0; i < send.size(); ++i) send[i] = send_rows[i] * c;
  for (size_t i = 0; i < recv.size(); ++i) recv[i] = recv_rows[i] * c;
  const Buffer input{in.raw_data(), in.numel(), in.dtype(), in.device()};
  const Buffer output{out->raw_data(), out->numel(), out->dtype(),
                      out->device()};
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group_->AllToAllV(input, send, output, recv));
  return Annotate(work->Wait(timeout_), "expert parallel: token rows");
}

absl::Status ShardExperts(Module& module, ExpertParallel* ep) {
  std::vector<std::pair<std::string, nn::MoE*>> moes;
  for (const auto& [path, m] : module.NamedModules()) {
    if (auto* moe = dynamic_cast<nn::MoE*>(m)) moes.push_back({path, moe});
  }
  const int64_t ranks = ep->size(), q = ep->rank();
  for (const auto& [path, moe] : moes) {
    const int64_t experts = moe->options().num_experts;
    if (experts % ranks != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert parallel: ", path, " has ", experts,
          " experts, which the ep size ", ranks, " does not divide"));
    }
    if (moe->expert_parallelism() != nullptr ||
        moe->experts()->local_experts() != experts) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert parallel: ", path, "'s experts are split already"));
    }
  }
  for (const auto& [path, moe] : moes) {
    const int64_t local = moe->options().num_experts / ranks;
    nn::GroupedExperts* e = moe->experts();
    for (Parameter* p : {e->gate_proj(), e->up_proj(), e->down_proj()}) {
      // A tensor-parallel piece (the hidden split) is narrowed to these
      // experts.
      ParameterPiece piece;
      piece.layout = p->shape;
      piece.offset = p->has_piece() ? p->piece.offset : Shape{0, 0, 0};
      piece.size = p->has_piece() ? p->piece.size : p->shape;
      piece.offset[0] = q * local;
      piece.size[0] = local;
      piece.local_shape = piece.size;
      FSDPP_RETURN_IF_ERROR(
          Annotate(p->SetPiece(std::move(piece)),
                   absl::StrCat("expert parallel: ", path, ".experts")));
    }
    moe->set_expert_parallelism(ep);
  }
  return absl::OkStatus();
}

}  // namespace parallel
}  // namespace fsdpp
