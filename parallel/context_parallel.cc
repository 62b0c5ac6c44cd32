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

// The checks both styles make: a group of cp ranks, q [B, H, L, hd] and
// k, v [B, KV, L, hd] with L this rank's rows. `who` prefixes the error.
absl::Status CheckRankRows(const std::string& who, const ProcessGroup* group,
                           const ContextLayout& layout, const Tensor& q,
                           const Tensor& k, const Tensor& v) {
  if (group == nullptr || group->size() != layout.cp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": the group must have the layout's cp = ", layout.cp(),
        " ranks"));
  }
  const int64_t l = layout.local();
  if (q.ndim() != 4 || k.ndim() != 4 || q.dim(2) != l || k.dim(2) != l ||
      k.shape() != v.shape() || q.dim(0) != k.dim(0) || q.dim(3) != k.dim(3)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": q ", q.ToString(), ", k ", k.ToString(), ", v ", v.ToString(),
        " must be [B, H, L, hd] and [B, KV, L, hd] with L = ", l,
        " (this rank's rows)"));
  }
  return absl::OkStatus();
}

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
  FSDPP_RETURN_IF_ERROR(CheckRankRows(absl::StrCat("RingAttention::", op),
                                      group_, layout_, q, k, v));
  const int64_t l = layout_.local();
  // On meta (a dry run) the document starts are meta too.
  if (doc_start != nullptr && (doc_start->dtype() != DType::kI32 ||
                               !(doc_start->device().is_cpu() ||
                                 (q.is_meta() && doc_start->is_meta())) ||
                               doc_start->shape() != Shape{q.dim(0), l})) {
    return Invalid(op, absl::StrCat("doc_start ", doc_start->ToString(),
                                    " must be i32 [B, ", l, "] on the host"));
  }
  return absl::OkStatus();
}

absl::Status RingAttention::Ranges(int src, int64_t batch,
                                   const Tensor* doc_start, Device device,
                                   Tensor* lo, Tensor* hi) const {
  const int64_t l = layout_.local();
  if (device.is_meta()) {  // a dry run: the ranges' memory, no values
    FSDPP_ASSIGN_OR_RETURN(*lo, Tensor::Empty({batch, l}, DType::kI32, device));
    FSDPP_ASSIGN_OR_RETURN(*hi, Tensor::Empty({batch, l}, DType::kI32, device));
    return absl::OkStatus();
  }
  const std::vector<int64_t>& mine = positions_[group_->rank()];
  const std::vector<int64_t>& keys = positions_[src];
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
                                 RangeCache* ranges,
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
    const int src = (rank - step + cp) % cp;
    Tensor lo, hi;
    if (ranges != nullptr && static_cast<int>(ranges->lo.size()) == cp &&
        ranges->lo[src].defined()) {
      lo = ranges->lo[src];
      hi = ranges->hi[src];
    } else {
      FSDPP_RETURN_IF_ERROR(
          Ranges(src, batch, doc_start, k.device(), &lo, &hi));
      if (ranges != nullptr) {
        ranges->lo.resize(cp);
        ranges->hi.resize(cp);
        ranges->lo[src] = lo;
        ranges->hi[src] = hi;
      }
    }
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
                                    Tensor* lse, RangeCache* ranges) {
  FSDPP_RETURN_IF_ERROR(CheckShapes("Forward", q, k, v, doc_start));
  OpSpan span("RingAttention", "attention");
  FSDPP_ASSIGN_OR_RETURN(
      Tensor part_out,
      Tensor::Empty(q.shape(), q.dtype(), q.device(), MemoryTag::kAttention));
  FSDPP_ASSIGN_OR_RETURN(Tensor part_lse,
                         Tensor::Empty(lse->shape(), DType::kF32, q.device(),
                                       MemoryTag::kAttention));
  return Ring(k, v, q.dim(0), doc_start, ranges,
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
                                     Tensor* dq, Tensor* dk, Tensor* dv,
                                     RangeCache* ranges) {
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
  // The accumulators go to the next rank after each step (after the last,
  // home: the keys of rank + 1 were last with this rank); each transfer
  // overlaps the next step's attention backward, which writes only the
  // parts.
  std::shared_ptr<Work> grad_shift;
  const auto land = [&]() -> absl::Status {
    if (grad_shift == nullptr) return absl::OkStatus();
    FSDPP_RETURN_IF_ERROR(Wait(grad_shift));
    grad_shift = nullptr;
    std::swap(grad, next_grad);
    return absl::OkStatus();
  };
  absl::Status ring =
      Ring(k, v, q.dim(0), doc_start, ranges,
           [&](int, const Tensor& kk, const Tensor& vv,
               const KeyRange& keys) -> absl::Status {
             FSDPP_RETURN_IF_ERROR(
                 CausalAttentionBackward(q, kk, vv, out, lse, dout, scale,
                                         &dq_part, &dk_part, &dv_part, keys));
             FSDPP_RETURN_IF_ERROR(land());
             for (auto [part, part32, acc] :
                  {std::tuple{&dq_part, &dq_part32, &dq_acc},
                   std::tuple{&dk_part, &dk_part32, &grad.k},
                   std::tuple{&dv_part, &dv_part32, &grad.v}}) {
               if (widen) {
                 FSDPP_RETURN_IF_ERROR(Copy(*part, part32));
               }
               FSDPP_RETURN_IF_ERROR(Add(*acc, widen ? *part32 : *part, acc));
             }
             if (cp == 1) return absl::OkStatus();
             FSDPP_ASSIGN_OR_RETURN(grad_shift,
                                    StartShift(grad.packed, next_grad.packed));
             return absl::OkStatus();
           });
  // The last transfer lands even after a failure (its buffers are freed
  // here).
  const absl::Status landed = land();
  FSDPP_RETURN_IF_ERROR(ring);
  FSDPP_RETURN_IF_ERROR(landed);
  FSDPP_RETURN_IF_ERROR(Copy(dq_acc, dq));
  FSDPP_RETURN_IF_ERROR(Copy(grad.k, dk));
  return Copy(grad.v, dv);
}

std::vector<nn::ContextParallel::Run> RunsOf(const ContextLayout& layout,
                                             int rank) {
  std::vector<nn::ContextParallel::Run> runs;
  for (int64_t position : layout.Positions(rank)) {
    if (!runs.empty() && runs.back().start + runs.back().length == position) {
      ++runs.back().length;
    } else {
      runs.push_back({position, 1});
    }
  }
  return runs;
}

RingContextParallel::RingContextParallel(ProcessGroup* group,
                                         const ContextLayout& layout,
                                         absl::Duration timeout)
    : layout_(layout),
      ring_(group, layout, timeout),
      runs_(RunsOf(layout, group != nullptr ? group->rank() : 0)) {}

absl::StatusOr<std::unique_ptr<nn::ContextParallelCore>>
RingContextParallel::MakeCore(Tensor rope_positions, Tensor key_start) {
  Tensor doc_start;
  if (key_start.defined()) {
    // The ring's ranges are computed on the host: this rank's rows' starts.
    FSDPP_ASSIGN_OR_RETURN(Tensor local, Local(key_start));
    if (local.is_meta()) {
      doc_start = local;
    } else {
      FSDPP_ASSIGN_OR_RETURN(
          doc_start, Tensor::Empty(local.shape(), DType::kI32, Device::Cpu()));
      FSDPP_RETURN_IF_ERROR(Copy(local, &doc_start));
    }
  }
  return std::make_unique<RingAttentionCore>(&ring_, std::move(rope_positions),
                                             std::move(doc_start));
}

// ------------------------------------------------------------- all-to-all

UlyssesAttention::UlyssesAttention(ProcessGroup* group,
                                   const ContextLayout& layout,
                                   absl::Duration timeout)
    : group_(group), layout_(layout), timeout_(timeout) {}

absl::Status UlyssesAttention::CheckShapes(const char* op, const Tensor& q,
                                           const Tensor& k, const Tensor& v,
                                           const Tensor* key_start) const {
  const auto invalid = [op](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("UlyssesAttention::", op, ": ", what));
  };
  FSDPP_RETURN_IF_ERROR(CheckRankRows(absl::StrCat("UlyssesAttention::", op),
                                      group_, layout_, q, k, v));
  const int cp = layout_.cp();
  if (q.dim(1) % cp != 0 || k.dim(1) % cp != 0) {
    return invalid(absl::StrCat(
        "the all-to-all style splits the heads over cp = ", cp, ": ", q.dim(1),
        " query and ", k.dim(1),
        " key/value heads on this rank must both be divisible by it"));
  }
  if (key_start != nullptr &&
      (key_start->dtype() != DType::kI32 ||
       key_start->shape() != Shape{q.dim(0), layout_.seq_len()} ||
       key_start->device() != q.device())) {
    return invalid(absl::StrCat("key_start ", key_start->ToString(),
                                " must be i32 [B, ", layout_.seq_len(),
                                "] on q's device"));
  }
  return absl::OkStatus();
}

absl::Status UlyssesAttention::Exchange(const Tensor& send,
                                        const Tensor& recv) const {
  CollectiveOptions o;
  o.timeout = timeout_;
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Work> work,
                         group_->AllToAll(AsBuffer(send), AsBuffer(recv), o));
  return work->Wait(timeout_ + absl::Minutes(1));
}

absl::StatusOr<Tensor> UlyssesAttention::ToHeads(const Tensor& x) const {
  const int cp = layout_.cp();
  const int64_t b = x.dim(0), heads = x.dim(1), l = x.dim(2), hd = x.dim(3);
  const int64_t n = heads / cp, c = layout_.chunk(), t = layout_.seq_len();
  const auto temp = [&](const Shape& shape) {
    return Tensor::Empty(shape, x.dtype(), x.device(), MemoryTag::kAttention);
  };
  // Piece j: heads [j n, (j + 1) n) of this rank's rows, for rank j.
  FSDPP_ASSIGN_OR_RETURN(Tensor send, temp({cp, b, n, l, hd}));
  FSDPP_ASSIGN_OR_RETURN(const Tensor rows, x.Reshape({b, heads * l * hd}));
  for (int j = 0; j < cp; ++j) {
    FSDPP_ASSIGN_OR_RETURN(Tensor piece, send.Narrow(j, 1));
    FSDPP_ASSIGN_OR_RETURN(piece, piece.Reshape({b, n * l * hd}));
    FSDPP_RETURN_IF_ERROR(
        CopyColumns(rows, j * n * l * hd, n * l * hd, &piece, 0));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor recv, temp({cp, b, n, l, hd}));
  FSDPP_RETURN_IF_ERROR(Exchange(send, recv));
  // Rank s's rows are its chunks s and 2 cp - 1 - s: into their places.
  FSDPP_ASSIGN_OR_RETURN(Tensor out, temp({b, n, t, hd}));
  FSDPP_ASSIGN_OR_RETURN(Tensor whole, out.Reshape({b * n, t * hd}));
  for (int s = 0; s < cp; ++s) {
    FSDPP_ASSIGN_OR_RETURN(Tensor piece, recv.Narrow(s, 1));
    FSDPP_ASSIGN_OR_RETURN(piece, piece.Reshape({b * n, l * hd}));
    FSDPP_RETURN_IF_ERROR(CopyColumns(piece, 0, c * hd, &whole, s * c * hd));
    FSDPP_RETURN_IF_ERROR(
        CopyColumns(piece, c * hd, c * hd, &whole, (2 * cp - 1 - s) * c * hd));
  }
  return out;
}

absl::Status UlyssesAttention::ToRows(const Tensor& heads_out,
                                      Tensor* x) const {
  const int cp = layout_.cp();
  const int64_t b = x->dim(0), heads = x->dim(1), l = x->dim(2), hd = x->dim(3);
  const int64_t n = heads / cp, c = layout_.chunk(), t = layout_.seq_len();
  const auto temp = [&](const Shape& shape) {
    return Tensor::Empty(shape, x->dtype(), x->device(), MemoryTag::kAttention);
  };
  // Piece s: rank s's chunks of the whole rows, for rank s.
  FSDPP_ASSIGN_OR_RETURN(Tensor send, temp({cp, b, n, l, hd}));
  FSDPP_ASSIGN_OR_RETURN(const Tensor whole,
                         heads_out.Reshape({b * n, t * hd}));
  for (int s = 0; s < cp; ++s) {
    FSDPP_ASSIGN_OR_RETURN(Tensor piece, send.Narrow(s, 1));
    FSDPP_ASSIGN_OR_RETURN(piece, piece.Reshape({b * n, l * hd}));
    FSDPP_RETURN_IF_ERROR(CopyColumns(whole, s * c * hd, c * hd, &piece, 0));
    FSDPP_RETURN_IF_ERROR(
        CopyColumns(whole, (2 * cp - 1 - s) * c * hd, c * hd, &piece, c * hd));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor recv, temp({cp, b, n, l, hd}));
  FSDPP_RETURN_IF_ERROR(Exchange(send, recv));
  // Piece j holds heads [j n, (j + 1) n) of this rank's rows.
  FSDPP_ASSIGN_OR_RETURN(Tensor rows, x->Reshape({b, heads * l * hd}));
  for (int j = 0; j < cp; ++j) {
    FSDPP_ASSIGN_OR_RETURN(Tensor piece, recv.Narrow(j, 1));
    FSDPP_ASSIGN_OR_RETURN(piece, piece.Reshape({b, n * l * hd}));
    FSDPP_RETURN_IF_ERROR(
        CopyColumns(piece, 0, n * l * hd, &rows, j * n * l * hd));
  }
  return absl::OkStatus();
}

absl::Status UlyssesAttention::Forward(const Tensor& q, const Tensor& k,
                                       const Tensor& v, float scale,
                                       const Tensor* key_start, Tensor* out,
                                       Tensor* lse) {
  FSDPP_RETURN_IF_ERROR(CheckShapes("Forward", q, k, v, key_start));
  OpSpan span("UlyssesAttention", "attention");
  FSDPP_ASSIGN_OR_RETURN(const Tensor qh, ToHeads(q));
  FSDPP_ASSIGN_OR_RETURN(const Tensor kh, ToHeads(k));
  FSDPP_ASSIGN_OR_RETURN(const Tensor vh, ToHeads(v));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor outh,
      Tensor::Empty(qh.shape(), q.dtype(), q.device(), MemoryTag::kAttention));
  const Shape lse_shape = {qh.dim(0), qh.dim(1), qh.dim(2)};
  FSDPP_ASSIGN_OR_RETURN(
      Tensor lseh,
      Tensor::Empty(lse_shape, DType::kF32, q.device(), MemoryTag::kAttention));
  FSDPP_RETURN_IF_ERROR(
      CausalAttention(qh, kh, vh, scale, &outh, &lseh, KeyRange{key_start}));
  FSDPP_RETURN_IF_ERROR(ToRows(outh, out));
  // The log-sum-exp as heads of one element.
  FSDPP_ASSIGN_OR_RETURN(
      const Tensor lse_heads,
      lseh.Reshape({lse_shape[0], lse_shape[1], lse_shape[2], 1}));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor lse_rows,
      lse->Reshape({lse->dim(0), lse->dim(1), lse->dim(2), 1}));
  return ToRows(lse_heads, &lse_rows);
}

absl::Status UlyssesAttention::Backward(const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& out,
                                        const Tensor& lse, const Tensor& dout,
                                        float scale, const Tensor* key_start,
                                        Tensor* dq, Tensor* dk, Tensor* dv) {
  FSDPP_RETURN_IF_ERROR(CheckShapes("Backward", q, k, v, key_start));
  OpSpan span("UlyssesAttentionBackward", "attention");
  // The forward's inputs and results back in the heads' layout (exchanged
  // again rather than kept: the layer already saves this rank's rows).
  FSDPP_ASSIGN_OR_RETURN(const Tensor qh, ToHeads(q));
  FSDPP_ASSIGN_OR_RETURN(const Tensor kh, ToHeads(k));
  FSDPP_ASSIGN_OR_RETURN(const Tensor vh, ToHeads(v));
  FSDPP_ASSIGN_OR_RETURN(const Tensor outh, ToHeads(out));
  FSDPP_ASSIGN_OR_RETURN(const Tensor douth, ToHeads(dout));
  FSDPP_ASSIGN_OR_RETURN(const Tensor lse_rows,
                         lse.Reshape({lse.dim(0), lse.dim(1), lse.dim(2), 1}));
  FSDPP_ASSIGN_OR_RETURN(Tensor lseh, ToHeads(lse_rows));
  FSDPP_ASSIGN_OR_RETURN(lseh,
                         lseh.Reshape({lseh.dim(0), lseh.dim(1), lseh.dim(2)}));
  const auto temp = [&](const Tensor& like) {
    return Tensor::Empty(like.shape(), like.dtype(), like.device(),
                         MemoryTag::kAttention);
  };
  FSDPP_ASSIGN_OR_RETURN(Tensor dqh, temp(qh));
  FSDPP_ASSIGN_OR_RETURN(Tensor dkh, temp(kh));
  FSDPP_ASSIGN_OR_RETURN(Tensor dvh, temp(vh));
  FSDPP_RETURN_IF_ERROR(CausalAttentionBackward(qh, kh, vh, outh, lseh, douth,
                                                scale, &dqh, &dkh, &dvh,
                                                KeyRange{key_start}));
  FSDPP_RETURN_IF_ERROR(ToRows(dqh, dq));
  FSDPP_RETURN_IF_ERROR(ToRows(dkh, dk));
  return ToRows(dvh, dv);
}

UlyssesContextParallel::UlyssesContextParallel(ProcessGroup* group,
                                               const ContextLayout& layout,
                                               absl::Duration timeout)
    : attention_(group, layout, timeout),
      runs_(RunsOf(layout, group != nullptr ? group->rank() : 0)),
      seq_len_(layout.seq_len()) {}

absl::StatusOr<std::unique_ptr<nn::ContextParallelCore>>
UlyssesContextParallel::MakeCore(Tensor rope_positions, Tensor key_start) {
  return std::make_unique<Core>(&attention_, std::move(rope_positions),
                                std::move(key_start));
}

}  // namespace parallel
}  // namespace fsdpp
