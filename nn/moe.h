// Mixture of experts: a token-choice top-k router over SwiGLU experts run as
// grouped matmuls (dropless: every token reaches its k experts, there is no
// capacity), optional shared experts every token goes through, and the
// load-balancing auxiliary loss.
//
//   scores  = softmax(x Wr^T) (Switch, Mixtral, Qwen3-MoE, OLMoE) or
//             sigmoid(x Wr^T) (DeepSeek-V3)
//   experts = the k largest of scores + expert_bias, lowest index first on
//             ties; the bias (DeepSeek-V3's e_score_correction_bias, not
//             trained) only selects, it never weighs. DeepSeek-V3's
//             aux-loss-free balancing moves it between steps by the
//             experts' loads (ExpertBiasUpdate, applied by the training
//             step to the bias's master with MoeConfig::bias_update_rate)
//   w_j     = route_scale * s_j (/ sum of the k chosen s with
//             normalize_top_k)
//   y       = sum_j w_j SwiGLU_{e_j}(x) + shared(x)
//
// The auxiliary loss (Switch Transformer's balance, taken per sequence as
// DeepSeek-V3's sequence-wise loss is): for each sequence (the rows of an
// input [.., T, C]; an input [N, C] is one sequence) coef * E * sum_e
// f_e P_e, with f_e the fraction of its T k assignments that went to expert
// e and P_e its tokens' mean softmax probability of e; aux is the mean over
// the sequences. Sequences balance on their own, so the loss of a batch is
// the mean of its parts' however ranks and micro-batches split it. Its
// gradient reaches the router through P (f counts). MoE::last_aux_loss() is
// its value; Backward adds its gradient times set_aux_loss_scale()'s factor
// (the loss scale the model's loss gradient carries), so the gradients are
// those of loss + aux.
//
// Children: "gate" (the router, Linear(dim, E) without bias: Hugging Face's
// `mlp.gate`), "experts" (GroupedExperts) and, with shared experts,
// "shared_experts" (SwiGlu); with an expert bias, the parameter
// "expert_bias" [E] (requires_grad false). The routing (scores, top-k,
// the permutation that groups the tokens by expert) runs on the host, and
// MoE runs on the CPU only for now (FailedPrecondition elsewhere). On meta
// tensors (the planner's dry run) it allocates what a real step does and
// computes nothing: the groups are taken as even (dropless groups hold n k
// rows whatever the routing).
#ifndef FSDPP_NN_MOE_H_
#define FSDPP_NN_MOE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "nn/linear.h"
#include "nn/mlp.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

enum class MoeScoring { kSoftmax, kSigmoid };

struct MoeOptions {
  int64_t dim = 0;          // model width C
  int64_t hidden = 0;       // each routed expert's SwiGLU width
  int64_t num_experts = 0;  // E
  int64_t top_k = 1;        // experts per token, 1 .. E
  MoeScoring scoring = MoeScoring::kSoftmax;
  // Renormalise the k chosen scores to sum to 1 (Mixtral, Qwen3-MoE's
  // norm_topk_prob, DeepSeek-V3); false: the raw scores (OLMoE, Switch).
  bool normalize_top_k = true;
  float route_scale = 1.0f;  // DeepSeek-V3's routed_scaling_factor
  // Width of the shared experts' SwiGLU (DeepSeek: n_shared x the expert
  // width); 0: none.
  int64_t shared_hidden = 0;
  // The load-balancing loss's weight (softmax scoring only; 0: off).
  float aux_loss_coef = 0.0f;
  // A per-expert selection bias (aux-loss-free balancing's; the training
  // step updates it, ExpertBiasUpdate).
  bool expert_bias = false;
  // Router and gate / up weights ~ Normal(0, init_std), down ones ~
  // Normal(0, down_init_std); parameters of `dtype`.
  float init_std = 0.02f;
  float down_init_std = 0.02f;
  DType dtype = DType::kF32;
};

// InvalidArgument naming the first field out of range.
absl::Status ValidateMoeOptions(const MoeOptions& options);

// Expert parallelism's communication (parallel::ExpertParallel implements it
// over a process group): the ranks of an ep group each hold num_experts /
// size() consecutive experts (rank q: [q L, (q + 1) L)).
class ExpertParallelism {
 public:
  virtual ~ExpertParallelism() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Every rank's `sizes` (rows per global expert, E of them), rank-major:
  // [size() x E]. `sizes` may be on any host buffer; a dry run (meta
  // tensors) gets its own back from groups that move no data.
  virtual absl::StatusOr<std::vector<int64_t>> GatherSizes(
      const std::vector<int64_t>& sizes) = 0;
  // Rows [.., C] of `in` (send_rows[d] rows for rank d, in rank order) to
  // their ranks; `out` (recv_rows[s] rows from rank s, in rank order) gets
  // theirs. Rows, not elements; `in` and `out` have the same dtype, C and
  // device and do not overlap.
  virtual absl::Status AllToAllRows(const Tensor& in,
                                    const std::vector<int64_t>& send_rows,
                                    Tensor* out,
                                    const std::vector<int64_t>& recv_rows) = 0;
};

// E SwiGLU experts whose weights are stacked on a leading expert dim, so
// that one parameter holds them all (sharded, checkpointed and, under
// expert parallelism, split by expert like any dim-0 split):
// "gate_proj" and "up_proj" [E, hidden, dim], "down_proj" [E, dim, hidden]
// (the Hugging Face experts' [out, in] weights, stacked). Forward takes the
// rows grouped by expert: the first sizes[0] rows go to expert 0, the next
// sizes[1] to expert 1, and so on (SetGroupSizes before each Forward), and
// runs each group as its own matmuls.
class GroupedExperts : public Module {
 public:
  GroupedExperts(int64_t num_experts, int64_t dim, int64_t hidden,
                 float init_std = 0.02f, float down_init_std = 0.02f,
                 DType dtype = DType::kF32);

  // All experts; local_experts(): the ones this rank holds (its expert-
  // parallel piece of the stacks, Parameter::SetPiece on the expert dim).
  int64_t num_experts() const { return num_experts_; }
  int64_t local_experts() const { return gate_proj_->LocalShape()[0]; }
  // The hidden width this rank computes: all of it, or its tensor-parallel
  // piece (gate / up split on dim 1, down on dim 2; the output is then this
  // rank's partial sum).
  int64_t local_hidden() const { return gate_proj_->LocalShape()[1]; }
  Parameter* gate_proj() const { return gate_proj_; }
  Parameter* up_proj() const { return up_proj_; }
  Parameter* down_proj() const { return down_proj_; }

  // The rows per expert of the next Forward's input (local_experts()
  // counts, each >= 0, summing to its rows): used up by that Forward.
  void SetGroupSizes(std::vector<int64_t> sizes) {
    pending_sizes_ = std::move(sizes);
  }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&saved_x_, &saved_gate_, &saved_up_, &saved_sizes_};
  }

 private:
  // Expert e's [rows, cols] matrix of `w` ([E, rows, cols]).
  static absl::StatusOr<Tensor> ExpertMatrix(const Tensor& w, int64_t e);

  int64_t num_experts_, dim_;
  Parameter* gate_proj_;
  Parameter* up_proj_;
  Parameter* down_proj_;
  std::vector<int64_t> pending_sizes_;
  Tensor saved_x_;      // the grouped input [M, dim]
  Tensor saved_gate_;   // x W_gate^T per group [M, hidden]
  Tensor saved_up_;     // x W_up^T per group [M, hidden]
  Tensor saved_sizes_;  // the group sizes, i64 [E]
};

class MoE : public Module {
 public:
  // `options` must be valid (ValidateMoeOptions; checked, fatal otherwise:
  // validate configs before building).
  explicit MoE(const MoeOptions& options);

  const MoeOptions& options() const { return options_; }
  Linear* gate() const { return gate_; }
  GroupedExperts* experts() const { return experts_; }
  SwiGlu* shared_experts() const { return shared_; }
  Parameter* expert_bias() const { return expert_bias_; }

  // Expert parallelism (not owned; null: every expert here): the experts'
  // stacks must hold this rank's num_experts / ep->size() experts (a piece
  // on the expert dim, parallel::ShardExperts). Forward then sends each
  // grouped row to the rank of its expert and back (two all-to-alls, and
  // two in Backward), after one all-gather of the rows per expert.
  void set_expert_parallelism(ExpertParallelism* ep) { ep_ = ep; }
  ExpertParallelism* expert_parallelism() const { return ep_; }

  // Whether Backward adds the auxiliary loss's gradient (default true).
  // Under tensor parallelism every tp rank routes the same tokens and adds
  // its partial sum of the routed gradient: one rank adds the aux loss's.
  void set_adds_aux_gradient(bool adds) { adds_aux_gradient_ = adds; }

  // The last Forward's auxiliary loss (0 without one).
  float last_aux_loss() const { return last_aux_loss_; }
  // The factor Backward multiplies the auxiliary loss's gradient by (the
  // loss scale of the gradient it receives; default 1).
  void set_aux_loss_scale(float scale) { aux_loss_scale_ = scale; }
  // What the trained micro-batches routed: counted by Backward (once per
  // trained forward, whatever activation checkpointing recomputes;
  // evaluation forwards count nothing), for the metrics and the bias update.
  struct Stats {
    std::vector<int64_t> tokens;  // assignments per expert
    double aux_loss_sum = 0.0;    // of the backwards' forwards
    int64_t backwards = 0;
  };
  // The stats since the last call; resets them.
  Stats TakeStats();
  // Assignments per expert since the last call (counted as the stats are,
  // kept apart from them): the load the step's expert-bias update reads.
  std::vector<int64_t> TakeLoad();
  // DeepSeek-V3's auxiliary-loss-free balancing: the change of the expert
  // bias after a step whose experts received `load` (every data-parallel
  // rank's, summed): + rate for an expert below the mean load, - rate above
  // it, 0 at it; centred (the mean change subtracted, as torchtitan does),
  // so the biases keep their mean and only their differences move.
  static std::vector<double> ExpertBiasUpdate(const std::vector<double>& load,
                                              double rate);

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&saved_out_,   &saved_logits_, &saved_topk_, &saved_position_,
            &saved_order_, &saved_counts_, &saved_aux_,  &saved_ep_sizes_};
  }

 private:
  // Under expert parallelism: how the grouped rows travel, from every
  // rank's rows per expert ([ep x E], GatherSizes).
  struct EpRoute {
    std::vector<int64_t> send_rows, recv_rows;  // per rank
    std::vector<int64_t> local_sizes;           // rows per local expert
    // Row i of the local grouped order (local expert-major, source rank
    // within) is row from_received[i] of the received ones (source-major,
    // local expert within).
    std::vector<int64_t> from_received;
  };
  EpRoute Route(const std::vector<int64_t>& all_sizes) const;
  // The experts' forward / backward on the grouped rows [M, C] (global
  // expert order, `sizes` rows each), through the ep ranks under expert
  // parallelism.
  absl::StatusOr<Tensor> RunExperts(const Tensor& grouped,
                                    const std::vector<int64_t>& sizes);
  absl::StatusOr<Tensor> RunExpertsBackward(const Tensor& d_out);
  // Under expert parallelism: `rows` (grouped, global expert order) to the
  // ranks of their experts by the route of `all`, `run` on the rows this
  // rank's experts receive (grouped by local expert), and its result back
  // in `rows`' order, allocated with `tag`.
  absl::StatusOr<Tensor> ThroughExperts(
      const Tensor& rows, const std::vector<int64_t>& all, MemoryTag tag,
      const std::function<absl::StatusOr<Tensor>(const EpRoute&,
                                                 const Tensor&)>& run);
  // What a dry run takes GatherSizes to give: every rank's `rows` grouped
  // as evenly as they can be.
  std::vector<int64_t> EvenSizesOfEveryRank(int64_t rows) const;
  // Rows of `rows` reordered: out[i] = rows[index[i]].
  static absl::StatusOr<Tensor> Gather(const Tensor& rows,
                                       const std::vector<int64_t>& index);
  // out[index[i]] = rows[i].
  static absl::StatusOr<Tensor> Scatter(const Tensor& rows,
                                        const std::vector<int64_t>& index);

  ExpertParallelism* ep_ = nullptr;
  MoeOptions options_;
  Linear* gate_;
  GroupedExperts* experts_;
  SwiGlu* shared_ = nullptr;
  Parameter* expert_bias_ = nullptr;
  float last_aux_loss_ = 0.0f;
  float aux_loss_scale_ = 1.0f;
  bool adds_aux_gradient_ = true;
  Stats stats_;
  std::vector<int64_t> load_;
  // What Backward needs (tensors, so pipeline stages can stash them):
  Tensor saved_out_;       // the experts' outputs, grouped [N k, C]
  Tensor saved_logits_;    // the router's logits [N, E]
  Tensor saved_topk_;      // chosen experts, i64 [N, k]
  Tensor saved_position_;  // row of assignment (t, j) in the grouped order,
                           // i64 [N, k]
  Tensor saved_order_;     // token of each grouped row, i64 [N k]
  Tensor saved_counts_;    // assignments per sequence and expert, i64 [S, E]
  Tensor saved_aux_;       // the auxiliary loss, f32 [1]
  Tensor saved_ep_sizes_;  // expert parallelism: GatherSizes, i64 [ep, E]
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_MOE_H_
