// Ring attention; see context_parallel.h.
#include "parallel/context_parallel.h"

#include <algorithm>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/trace.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace parallel {
namespace {

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("RingAttention::", op, ": ", what));
}

// k and v packed into one [2, B, KV, L, hd] buffer (one transfer a step),
// and its two halves as [B, KV, L, hd] views.
struct KvPair {
  Tensor packed, k, v;
  static absl::StatusOr<KvPair> Make(const Shape& shape, DType dtype,
                                     Device device) {
    KvPair p;
    Shape packed_shape = {2};
    packed_shape.insert(packed_shape.end(), shape.begin(), shape.end());
    FSDPP_ASSIGN_OR_RETURN(p.packed, Tensor::Empty(packed_shape, dtype, device,
                                                   MemoryTag::kAttention));
    FSDPP_ASSIGN_OR_RETURN(Tensor k, p.packed.Narrow(0, 1));
    FSDPP_ASSIGN_OR_RETURN(Tensor v, p.packed.Narrow(1, 1));
    FSDPP_ASSIGN_OR_RETURN(p.k, k.Reshape(shape));
    FSDPP_ASSIGN_OR_RETURN(p.v, v.Reshape(shape));
    return p;
  }
};

}  // namespace

absl::StatusOr<ContextLayout> ContextLayout::Create(int cp, int64_t seq_len) {
  if (cp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("context parallelism: cp must be >= 1, got ", cp));
  }
  if (seq_len < 1 || seq_len % (2 * cp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context parallelism: the sequence length ", seq_len,
        " must be a positive multiple of 2 x cp = ", 2 * cp,
        " (2 cp chunks of equal size; uneven chunks are not supported)"));
  }
  return ContextLayout(cp, seq_len);
}

std::vector<int64_t> ContextLayout::Positions(int rank) const {
  std::vector<int64_t> p;
  p.reserve(local());
  for (int64_t c : {int64_t{rank}, int64_t{2 * cp_ - 1 - rank}}) {
    for (int64_t i = 0; i < chunk(); ++i) p.push_back(c * chunk() + i);
  }
  return p;
}

absl::StatusOr<Tensor> ContextLayout::PositionsTensor(int rank, int64_t batch,
                                                      Device device) const {
  const std::vector<int64_t> p = Positions(rank);
  std::vector<int64_t> all;
  all.reserve(batch * p.size());
  for (int64_t b = 0; b < batch; ++b) all.insert(all.end(), p.begin(), p.end());
  return Tensor::FromInts({batch, local()}, all, DType::kI32, device);
}

RingAttention::RingAttention(ProcessGroup* group, const ContextLayout& layout,
                             absl::Duration timeout)
    : group_(group), layout_(layout), timeout_(timeout) {
  for (int r = 0; r < layout_.cp(); ++r) {
    positions_.push_back(layout_.Positions(r));
  }
}

absl::Status RingAttention::CheckShapes(const char* op, const Tensor& q,
                                        const Tensor& k, const Tensor& v,
                                        const Tensor* doc_start) const {
  if (group_ == nullptr || group_->size() != layout_.cp()) {
    return Invalid(op, absl::StrCat("the group must have the layout's cp = ",
                                    layout_.cp(), " ranks"));
  }
  const int64_t l = layout_.local();
  if (q.ndim() != 4 || k.ndim() != 4 || q.dim(2) != l || k.dim(2) != l ||
      k.shape() != v.shape() || q.dim(0) != k.dim(0) || q.dim(3) != k.dim(3)) {
    return Invalid(op, absl::StrCat("q ", q.ToString(), ", k ", k.ToString(),
                                    ", v ", v.ToString(),
                                    " must be [B, H, L, hd] and [B, KV, L, "
                                    "hd] with L = ",
                                    l, " (this rank's rows)"));
  }
  if (doc_start != nullptr &&
      (doc_start->dtype() != DType::kI32 || !doc_start->device().is_cpu() ||
       doc_start->shape() != Shape{q.dim(0), l})) {
    return Invalid(op, absl::StrCat("doc_start ", doc_start->ToString(),
                                    " must be i32 [B, ", l, "] on the host"));
  }
  return absl::OkStatus();
}

absl::Status RingAttention::Ranges(int src, int64_t batch,
                                   const Tensor* doc_start, Device device,
                                   Tensor* lo, Tensor* hi) const {
  const std::vector<int64_t>& mine = positions_[group_->rank()];
  const std::vector<int64_t>& keys = positions_[src];
  const int64_t l = layout_.local();
  std::vector<int64_t> lo_host(batch * l), hi_host(batch * l);
  const int32_t* starts =
      doc_start != nullptr ? doc_start->data<int32_t>() : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < l; ++i) {
      // Keys at global positions [document start, the query's position].
      const int64_t first = starts != nullptr ? starts[b * l + i] : 0;
      lo_host[b * l + i] =
          std::lower_bound(keys.begin(), keys.end(), first) - keys.begin();
      hi_host[b * l + i] =
          std::upper_bound(keys.begin(), keys.end(), mine[i]) - keys.begin();
    }
  }
  FSDPP_ASSIGN_OR_RETURN(
      *lo, Tensor::FromInts({batch, l}, lo_host, DType::kI32, device));
  FSDPP_ASSIGN_OR_RETURN(
      *hi, Tensor::FromInts({batch, l}, hi_host, DType::kI32, device));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Work>> RingAttention::StartShift(
    const Tensor& send, const Tensor& recv) const {
  const int cp = layout_.cp(), rank = group_->rank();
  CollectiveOptions o;
  o.timeout = timeout_;
  return group_->BatchP2P({P2POp::Send(AsBuffer(send), (rank + 1) % cp),
                           P2POp::Recv(AsBuffer(recv), (rank + cp - 1) % cp)},
                          o);
}

absl::Status RingAttention::Wait(const std::shared_ptr<Work>& work) const {
  return work->Wait(timeout_ + absl::Minutes(1));
}

absl::Status RingAttention::Ring(const Tensor& k, const Tensor& v,
                                 int64_t batch, const Tensor* doc_start,
                                 const RingStep& step_fn) const {
  const int cp = layout_.cp(), rank = group_->rank();
  FSDPP_ASSIGN_OR_RETURN(KvPair cur,
                         KvPair::Make(k.shape(), k.dtype(), k.device()));
  FSDPP_RETURN_IF_ERROR(Copy(k, &cur.k));
  FSDPP_RETURN_IF_ERROR(Copy(v, &cur.v));
  KvPair next;
  if (cp > 1) {
    FSDPP_ASSIGN_OR_RETURN(next,
                           KvPair::Make(k.shape(), k.dtype(), k.device()));
  }
  for (int step = 0; step < cp; ++step) {
    std::shared_ptr<Work> shift;
    if (step + 1 < cp) {
      FSDPP_ASSIGN_OR_RETURN(shift, StartShift(cur.packed, next.packed));
    }
    Tensor lo, hi;
    FSDPP_RETURN_IF_ERROR(Ranges((rank - step + cp) % cp, batch, doc_start,
                                 k.device(), &lo, &hi));
    FSDPP_RETURN_IF_ERROR(step_fn(step, cur.k, cur.v, KeyRange{&lo, &hi}));
    if (shift != nullptr) {
      FSDPP_RETURN_IF_ERROR(Wait(shift));
      std::swap(cur, next);
    }
  }
  return absl::OkStatus();
}

absl::Status RingAttention::Forward(const Tensor& q, const Tensor& k,
                                    const Tensor& v, float scale,
                                    const Tensor* doc_start, Tensor* out,
                                    Tensor* lse) {
  FSDPP_RETURN_IF_ERROR(CheckShapes("Forward", q, k, v, doc_start));
  OpSpan span("RingAttention", "attention");
  FSDPP_ASSIGN_OR_RETURN(
      Tensor part_out,
      Tensor::Empty(q.shape(), q.dtype(), q.device(), MemoryTag::kAttention));
  FSDPP_ASSIGN_OR_RETURN(Tensor part_lse,
                         Tensor::Empty(lse->shape(), DType::kF32, q.device(),
                                       MemoryTag::kAttention));
  return Ring(k, v, q.dim(0), doc_start,
              [&](int step, const Tensor& kk, const Tensor& vv,
                  const KeyRange& keys) -> absl::Status {
                if (step == 0) {
                  return CausalAttention(q, kk, vv, scale, out, lse, keys);
                }
                FSDPP_RETURN_IF_ERROR(CausalAttention(
                    q, kk, vv, scale, &part_out, &part_lse, keys));
                return MergeAttention(part_out, part_lse, out, lse);
              });
}

absl::Status RingAttention::Backward(const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout,
                                     float scale, const Tensor* doc_start,
                                     Tensor* dq, Tensor* dk, Tensor* dv) {
  FSDPP_RETURN_IF_ERROR(CheckShapes("Backward", q, k, v, doc_start));
  OpSpan span("RingAttentionBackward", "attention");
  const int cp = layout_.cp();
  const Device device = q.device();
  // The f32 accumulators of k's and v's gradients travel behind them.
  FSDPP_ASSIGN_OR_RETURN(KvPair grad,
                         KvPair::Make(k.shape(), DType::kF32, device));
  FSDPP_RETURN_IF_ERROR(Fill(&grad.packed, 0.0f));
  KvPair next_grad;
  if (cp > 1) {
    FSDPP_ASSIGN_OR_RETURN(next_grad,
                           KvPair::Make(k.shape(), DType::kF32, device));
  }
  const auto temp = [&](const Shape& shape, DType dtype) {
    return Tensor::Empty(shape, dtype, device, MemoryTag::kAttention);
  };
  FSDPP_ASSIGN_OR_RETURN(Tensor dq_acc, temp(q.shape(), DType::kF32));
  FSDPP_RETURN_IF_ERROR(Fill(&dq_acc, 0.0f));
  FSDPP_ASSIGN_OR_RETURN(Tensor dq_part, temp(q.shape(), q.dtype()));
  FSDPP_ASSIGN_OR_RETURN(Tensor dk_part, temp(k.shape(), k.dtype()));
  FSDPP_ASSIGN_OR_RETURN(Tensor dv_part, temp(k.shape(), k.dtype()));
  // 16-bit parts are widened to f32 before they are added (f32 ones as
  // they are).
  const bool widen = q.dtype() != DType::kF32;
  Tensor dq_part32, dk_part32, dv_part32;
  if (widen) {
    FSDPP_ASSIGN_OR_RETURN(dq_part32, temp(q.shape(), DType::kF32));
    FSDPP_ASSIGN_OR_RETURN(dk_part32, temp(k.shape(), DType::kF32));
    FSDPP_ASSIGN_OR_RETURN(dv_part32, temp(k.shape(), DType::kF32));
  }
  FSDPP_RETURN_IF_ERROR(Ring(
      k, v, q.dim(0), doc_start,
      [&](int, const Tensor& kk, const Tensor& vv,
          const KeyRange& keys) -> absl::Status {
        FSDPP_RETURN_IF_ERROR(CausalAttentionBackward(q, kk, vv, out, lse, dout,
                                                      scale, &dq_part, &dk_part,
                                                      &dv_part, keys));
        for (auto [part, part32, acc] :
             {std::tuple{&dq_part, &dq_part32, &dq_acc},
              std::tuple{&dk_part, &dk_part32, &grad.k},
              std::tuple{&dv_part, &dv_part32, &grad.v}}) {
          if (widen) {
            FSDPP_RETURN_IF_ERROR(Copy(*part, part32));
          }
          FSDPP_RETURN_IF_ERROR(Add(*acc, widen ? *part32 : *part, acc));
        }
        // The accumulators go to the next rank (after the last step, home:
        // the keys of rank + 1 were last with this rank).
        if (cp == 1) return absl::OkStatus();
        FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> shift,
                               StartShift(grad.packed, next_grad.packed));
        FSDPP_RETURN_IF_ERROR(Wait(shift));
        std::swap(grad, next_grad);
        return absl::OkStatus();
      }));
  FSDPP_RETURN_IF_ERROR(Copy(dq_acc, dq));
  FSDPP_RETURN_IF_ERROR(Copy(grad.k, dk));
  return Copy(grad.v, dv);
}

RingContextParallel::RingContextParallel(ProcessGroup* group,
                                         const ContextLayout& layout,
                                         absl::Duration timeout)
    : layout_(layout), ring_(group, layout, timeout) {
  const int rank = group != nullptr ? group->rank() : 0;
  for (int64_t position : layout_.Positions(rank)) {
    if (!runs_.empty() &&
        runs_.back().start + runs_.back().length == position) {
      ++runs_.back().length;
    } else {
      runs_.push_back({position, 1});
    }
  }
}

absl::StatusOr<std::unique_ptr<nn::ContextParallelCore>>
RingContextParallel::MakeCore(Tensor rope_positions, Tensor doc_start) {
  return std::make_unique<RingAttentionCore>(&ring_, std::move(rope_positions),
                                             std::move(doc_start));
}

}  // namespace parallel
}  // namespace fsdpp
