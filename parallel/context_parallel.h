// Context parallelism's attention: ring attention over a cp process group.
//
// A sequence of T tokens is split over cp ranks with causal load balancing
// (ContextLayout): 2 cp chunks of T / (2 cp) tokens, rank r holding chunks r
// and 2 cp - 1 - r, so that every rank has as many (query, earlier key)
// pairs as any other. Each rank keeps its own rows' q, k and v; RingAttention
// passes k and v round the ring (to rank r + 1, from rank r - 1, the next
// step's transfer in flight while the current step computes) and runs the
// fused attention of its queries against each rank's keys with the key
// ranges of their global positions (tensor/ops.h KeyRange; document masks
// too), merging the partial results by their log-sum-exp (MergeAttention).
// The backward passes k, v and the f32 accumulators of their gradients
// round the ring the same way (each transfer in flight during the next
// step's compute): each rank adds its queries' share to the keys it holds,
// and after cp steps every accumulator is back with its owner. The results
// equal the unsplit attention's to rounding
// (context_parallel_test: 1e-6 in f32).
//
// RingAttentionCore plugs it into nn::CausalSelfAttention (a layer then
// runs on this rank's rows, RoPE at their global positions), and
// RingContextParallel into a whole model (models::TransformerOptions::
// context_parallel). UlyssesAttention is the all-to-all style over the same
// layout (heads exchanged for rows), UlyssesContextParallel its model split.
#ifndef FSDPP_PARALLEL_CONTEXT_PARALLEL_H_
#define FSDPP_PARALLEL_CONTEXT_PARALLEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/process_group.h"
#include "nn/attention.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace parallel {

// Which rows of a sequence each context-parallel rank holds.
class ContextLayout {
 public:
  // InvalidArgument unless cp >= 1 and seq_len is a positive multiple of 2
  // cp (chunks of equal size: uneven chunks are refused).
  static absl::StatusOr<ContextLayout> Create(int cp, int64_t seq_len);

  int cp() const { return cp_; }
  int64_t seq_len() const { return seq_len_; }
  // Tokens per chunk, and per rank (two chunks).
  int64_t chunk() const { return seq_len_ / (2 * cp_); }
  int64_t local() const { return 2 * chunk(); }
  // Rank r's global positions, ascending: chunk r then chunk 2 cp - 1 - r.
  std::vector<int64_t> Positions(int rank) const;
  // The same for every one of `batch` rows, i32 [batch, L] on `device`.
  absl::StatusOr<Tensor> PositionsTensor(int rank, int64_t batch,
                                         Device device) const;

 private:
  ContextLayout(int cp, int64_t seq_len) : cp_(cp), seq_len_(seq_len) {}
  int cp_;
  int64_t seq_len_;
};

// Ring attention on one rank of `group` (the cp axis: size layout.cp()).
// Shapes: q, out, dq, dout [B, H, L, hd] and k, v, dk, dv [B, KV, L, hd]
// with L = layout.local(), this rank's rows in its positions' order; lse
// [B, H, L] f32. doc_start: null, or the document start (a global
// position) of each of this rank's rows, i32 [B, L] on the host (ops.h
// DocumentMask's key starts of the whole rows, gathered at this rank's
// positions); attention then stays within documents. Every rank of the
// group calls each method with the same shapes. Transfers fail after
// `timeout`, naming the peer.
class RingAttention {
 public:
  RingAttention(ProcessGroup* group, const ContextLayout& layout,
                absl::Duration timeout = absl::Minutes(5));

  // The key ranges of this rank's queries over each rank's keys, by source
  // rank, for one batch and document starts: filled as the ring meets each
  // rank, then reused (every layer of a model's forward or backward has the
  // same ones). Null: computed for the call alone.
  struct RangeCache {
    std::vector<Tensor> lo, hi;
  };

  absl::Status Forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       float scale, const Tensor* doc_start, Tensor* out,
                       Tensor* lse, RangeCache* ranges = nullptr);
  // dq, dk, dv overwritten; out and lse those of Forward.
  absl::Status Backward(const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse,
                        const Tensor& dout, float scale,
                        const Tensor* doc_start, Tensor* dq, Tensor* dk,
                        Tensor* dv, RangeCache* ranges = nullptr);

 private:
  // Key ranges of this rank's queries over rank `src`'s keys, i32 [B, L]
  // each, on `device`.
  absl::Status Ranges(int src, int64_t batch, const Tensor* doc_start,
                      Device device, Tensor* lo, Tensor* hi) const;
  absl::Status CheckShapes(const char* op, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor* doc_start) const;
  // Runs step_fn(step, k, v, keys) cp times: step s with rank (rank - s)'s
  // k and v (the next pair already on its way) and the key ranges of this
  // rank's queries over them.
  using RingStep = std::function<absl::Status(
      int step, const Tensor& k, const Tensor& v, const KeyRange& keys)>;
  absl::Status Ring(const Tensor& k, const Tensor& v, int64_t batch,
                    const Tensor* doc_start, RangeCache* ranges,
                    const RingStep& step_fn) const;
  // Starts sending `send` to the next rank and receiving `recv` from the
  // previous one (both kept alive by the caller until the work is waited).
  absl::StatusOr<std::shared_ptr<Work>> StartShift(const Tensor& send,
                                                   const Tensor& recv) const;
  absl::Status Wait(const std::shared_ptr<Work>& work) const;

  ProcessGroup* group_;
  ContextLayout layout_;
  absl::Duration timeout_;
  std::vector<std::vector<int64_t>> positions_;  // every rank's
};

// RingAttention as a layer's attention core (nn::ContextParallelCore, the
// layer's forward and backward run under its Scope): positions, RoPE's
// positions of this rank's rows (their global positions,
// ContextLayout::PositionsTensor, or with document masks their positions
// within their documents); doc_start as RingAttention's (undefined: no
// document masks). The ring must outlive the core.
class RingAttentionCore : public nn::ContextParallelCore {
 public:
  RingAttentionCore(RingAttention* ring, Tensor positions,
                    Tensor doc_start = Tensor())
      : ring_(ring),
        positions_(std::move(positions)),
        doc_start_(std::move(doc_start)) {}

  absl::Status Forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       float scale, Tensor* out, Tensor* lse) override {
    return ring_->Forward(q, k, v, scale, DocStart(), out, lse, &ranges_);
  }
  absl::Status Backward(const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse,
                        const Tensor& dout, float scale, Tensor* dq, Tensor* dk,
                        Tensor* dv) override {
    return ring_->Backward(q, k, v, out, lse, dout, scale, DocStart(), dq, dk,
                           dv, &ranges_);
  }
  const Tensor& positions() const override { return positions_; }

 private:
  const Tensor* DocStart() const {
    return doc_start_.defined() ? &doc_start_ : nullptr;
  }
  RingAttention* ring_;
  Tensor positions_;
  Tensor doc_start_;
  // The batch's key ranges, shared by its layers.
  RingAttention::RangeCache ranges_;
};

// Rank `rank`'s positions of `layout` as runs of consecutive ones.
std::vector<nn::ContextParallel::Run> RunsOf(const ContextLayout& layout,
                                             int rank);

// Context parallelism for a whole model (nn::ContextParallel, models::
// TransformerOptions::context_parallel): this rank's chunks of `layout`
// (group->rank()'s) and ring attention over `group`.
class RingContextParallel : public nn::ContextParallel {
 public:
  RingContextParallel(ProcessGroup* group, const ContextLayout& layout,
                      absl::Duration timeout = absl::Minutes(5));

  int64_t seq_len() const override { return layout_.seq_len(); }
  const std::vector<Run>& runs() const override { return runs_; }
  absl::StatusOr<std::unique_ptr<nn::ContextParallelCore>> MakeCore(
      Tensor rope_positions, Tensor key_start) override;

 private:
  ContextLayout layout_;
  RingAttention ring_;
  std::vector<Run> runs_;
};

// The all-to-all (DeepSpeed-Ulysses) style over the same layout: q, k and v
// of this rank's rows [B, N, L, hd] are exchanged for every row of N / cp
// heads ([B, N / cp, T, hd], rank j getting heads [j N / cp, (j + 1) N /
// cp)), the fused attention runs on whole rows (document masks as whole
// rows' key starts), and the output and log-sum-exp are exchanged back;
// the backward exchanges q, k, v, out, lse and dout again (nothing kept
// beyond what the layer saves) and dq, dk, dv back. Both the query and the
// key/value heads on a rank must be divisible by cp. The result is the
// whole attention's per head, to rounding (the same kernel on the same
// rows).
class UlyssesAttention {
 public:
  UlyssesAttention(ProcessGroup* group, const ContextLayout& layout,
                   absl::Duration timeout = absl::Minutes(5));

  // key_start: null, or ops.h DocumentMask's key starts of the whole rows,
  // i32 [B, T] on q's device.
  absl::Status Forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       float scale, const Tensor* key_start, Tensor* out,
                       Tensor* lse);
  absl::Status Backward(const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse,
                        const Tensor& dout, float scale,
                        const Tensor* key_start, Tensor* dq, Tensor* dk,
                        Tensor* dv);

 private:
  absl::Status CheckShapes(const char* op, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor* key_start) const;
  // x [B, N, L, hd], this rank's rows -> [B, N / cp, T, hd], this rank's
  // heads of the whole rows; and back into x.
  absl::StatusOr<Tensor> ToHeads(const Tensor& x) const;
  absl::Status ToRows(const Tensor& heads, Tensor* x) const;
  absl::Status Exchange(const Tensor& send, const Tensor& recv) const;

  ProcessGroup* group_;
  ContextLayout layout_;
  absl::Duration timeout_;
};

// UlyssesAttention as a whole model's split (parallelism.cp_style
// "alltoall").
class UlyssesContextParallel : public nn::ContextParallel {
 public:
  UlyssesContextParallel(ProcessGroup* group, const ContextLayout& layout,
                         absl::Duration timeout = absl::Minutes(5));

  int64_t seq_len() const override { return seq_len_; }
  const std::vector<Run>& runs() const override { return runs_; }
  absl::StatusOr<std::unique_ptr<nn::ContextParallelCore>> MakeCore(
      Tensor rope_positions, Tensor key_start) override;

 private:
  class Core : public nn::ContextParallelCore {
   public:
    Core(UlyssesAttention* attention, Tensor positions, Tensor key_start)
        : attention_(attention),
          positions_(std::move(positions)),
          key_start_(std::move(key_start)) {}
    absl::Status Forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         float scale, Tensor* out, Tensor* lse) override {
      return attention_->Forward(q, k, v, scale, KeyStart(), out, lse);
    }
    absl::Status Backward(const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse,
                          const Tensor& dout, float scale, Tensor* dq,
                          Tensor* dk, Tensor* dv) override {
      return attention_->Backward(q, k, v, out, lse, dout, scale, KeyStart(),
                                  dq, dk, dv);
    }
    const Tensor& positions() const override { return positions_; }

   private:
    const Tensor* KeyStart() const {
      return key_start_.defined() ? &key_start_ : nullptr;
    }
    UlyssesAttention* attention_;
    Tensor positions_;
    Tensor key_start_;
  };

  UlyssesAttention attention_;
  std::vector<Run> runs_;
  int64_t seq_len_;
};

}  // namespace parallel
}  // namespace fsdpp

#endif  // FSDPP_PARALLEL_CONTEXT_PARALLEL_H_
