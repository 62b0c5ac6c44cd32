// Causal multi-head / grouped-query self-attention for GPT-2 and Llama, with
// an explicit backward.
//
// Two parameter layouts, named as in the reference checkpoints so FSDP plans
// and checkpoint loaders can address them by fully qualified name:
//   GPT-2 (fused):    c_attn.weight [(H + 2 KV) hd, C] (= [3C, C] for MHA),
//                     c_attn.bias, c_proj.weight [C, H hd], c_proj.bias
//   Llama (separate): wq.weight [H hd, C], wk.weight [KV hd, C],
//                     wv.weight [KV hd, C], wo.weight [C, H hd]
//                     (+ wq/wk/wv.bias, wo.bias when biases are enabled).
// The projections are child nn::Linear modules (hooks fire per projection);
// the attention core, over heads laid out [B, H, T, hd], is the fused
// CausalAttention op by default (flash style: no [T, T] matrix kept), or
// Matmul + causal Softmax with the probabilities saved
// (AttentionConfig::fused_attention = false). Grouped-query attention makes no
// copies of K and V: heads h = g * (H / KV) + r are contiguous, so Q viewed as
// [B, KV, (H / KV) T, hd] multiplies each kv head's [T, hd] block directly, and
// the backward matmuls sum the repeated heads' gradients into their kv head for
// free. RoPE uses the Hugging Face rotate_half convention
// (tensor/kernels/rope.h).
//
// Compute follows the input dtype (f32 or bf16; the projections cast weights
// of another dtype): scores and softmax are f32 (bf16 matmuls write f32), the
// probabilities are kept in the compute dtype for the P V matmul and its
// backward. Saved activations (roped q and k, v; the merged heads are saved
// by the output projection) are tagged kActivations, the core's own memory
// (probabilities and score buffers, or the fused output and log-sum-exp)
// kAttention; all are released by Backward or ReleaseSavedTensors.
//
// Document masking: while a DocumentMasks::Scope is installed on the thread
// (the Transformer installs its batch's over its forward and backward), the
// attention core keeps each token within its document (ops.h DocumentMask's
// key starts) and RoPE rotates by the positions within the documents; the
// forward keeps references to both for its backward. Fused attention only.
//
// Context parallelism: while a ContextParallelCore::Scope is installed, the
// input holds this rank's rows of the sequence, RoPE rotates by their global
// positions and the attention core is the installed one (parallel::
// RingAttention's), whose forward and backward reach the other ranks' keys;
// the layer's parameter gradients are this rank's share (summed over the cp
// ranks by the caller, as FSDP does over dp x cp).
#ifndef FSDPP_NN_ATTENTION_H_
#define FSDPP_NN_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "nn/linear.h"
#include "nn/module.h"
#include "nn/rms_norm.h"
#include "tensor/kernels/rope.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace nn {

// The packed documents of the batch being run (ops.h DocumentMask):
// key_start and positions, i32 [B, T], on the activations' device.
struct DocumentMasks {
  Tensor key_start;
  Tensor positions;

  // The masks installed on this thread, or null.
  static const DocumentMasks* Active();
  // Installs `masks` (null: none) on this thread for the scope.
  class Scope {
   public:
    explicit Scope(const DocumentMasks* masks);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const DocumentMasks* previous_;
  };
};

// The attention core over a context-parallel group (parallel/
// context_parallel.h implements it): q, k, v hold this rank's rows (in
// positions()' order) and the core attends to every rank's keys. A
// layer's backward runs under the core of its forward's batch, installed
// again (the same one, or an equal one made for the same batch).
class ContextParallelCore {
 public:
  virtual ~ContextParallelCore() = default;
  // tensor/ops.h CausalAttention's contract over the whole sequence.
  virtual absl::Status Forward(const Tensor& q, const Tensor& k,
                               const Tensor& v, float scale, Tensor* out,
                               Tensor* lse) = 0;
  virtual absl::Status Backward(const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out,
                                const Tensor& lse, const Tensor& dout,
                                float scale, Tensor* dq, Tensor* dk,
                                Tensor* dv) = 0;
  // This rank's rows' positions (RoPE's), i32 [B, L] on the device.
  virtual const Tensor& positions() const = 0;

  // The core installed on this thread, or null.
  static ContextParallelCore* Active();
  class Scope {
   public:
    explicit Scope(ContextParallelCore* core);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ContextParallelCore* previous_;
  };
};

// A model's split of its sequences over a context-parallel group (parallel/
// context_parallel.h implements it): which of a sequence's positions this
// rank holds, as runs of consecutive positions in the order its rows keep
// them, and the attention core for one batch. models::Transformer takes
// whole rows of ids and targets, keeps this rank's columns and runs its
// layers under the batch's core.
class ContextParallel {
 public:
  virtual ~ContextParallel() = default;
  struct Run {
    int64_t start = 0;  // first global position
    int64_t length = 0;
  };
  // The sequence length the split is for.
  virtual int64_t seq_len() const = 0;
  // This rank's runs, in its rows' order.
  virtual const std::vector<Run>& runs() const = 0;
  // The core for a batch: rope_positions, RoPE's (and a position
  // embedding's) positions of this rank's rows, i32 [B, L] on the device;
  // key_start, ops.h DocumentMask's key starts of the whole rows (i32 [B,
  // T] on the device), or undefined without document masks.
  virtual absl::StatusOr<std::unique_ptr<ContextParallelCore>> MakeCore(
      Tensor rope_positions, Tensor key_start) = 0;

  // This rank's columns of whole rows [B, T] (T = seq_len()), [B, L] on
  // their device (CopyColumns, one per run; ids checked on the host stay
  // so); InvalidArgument for rows of another shape.
  absl::StatusOr<Tensor> Local(const Tensor& whole) const;
  // Local's check of the rows alone.
  absl::Status CheckWhole(const Tensor& whole) const;
  // Tokens per rank (the runs' total).
  int64_t local() const;
};

// Shape and options of a CausalSelfAttention.
struct AttentionConfig {
  int64_t dim = 0;          // C: model width (input and output features).
  int64_t n_heads = 0;      // H: query heads; head_dim = dim / n_heads.
  int64_t n_kv_heads = 0;   // KV: key/value heads; 0 means n_heads (MHA).
  int64_t max_seq_len = 0;  // T_max: longest sequence Forward accepts.
  // GPT-2 fused c_attn/c_proj layout; otherwise Llama's wq/wk/wv/wo.
  bool fused_qkv = false;
  bool qkv_bias = false;        // Bias on the q, k, v projections.
  bool out_bias = false;        // Bias on the output projection.
  bool rope = false;            // Rotary embeddings on q and k (position = t).
  float rope_theta = 10000.0f;  // RoPE base (Llama 3: 500000).
  kernels::RopeScaling rope_scaling;  // Llama 3.1/3.2 (default: none).
  DType param_dtype = DType::kF32;    // Any float dtype.
  // The attention core as one fused op (tensor/ops.h CausalAttention: flash
  // style, memory O(T) per query row, the probabilities recomputed in the
  // backward); false: Matmul + causal Softmax with the [B, H, T, T]
  // probabilities saved (the reference the fused op is tested against).
  bool fused_attention = true;
  // OLMo-2 / OLMoE's q and k norms: RMSNorm over each token's whole q
  // projection [H hd] and k projection [KV hd] (children "q_norm",
  // "k_norm", weights of those widths), before RoPE. Separate projections
  // only; tensor parallelism does not split them (the norm spans every
  // head).
  bool qk_norm = false;
  float qk_norm_eps = 1e-5f;
  float init_std = 0.02f;      // Normal init std of the q, k, v weights.
  float out_init_std = 0.02f;  // ... of the output projection (GPT-2 scales
                               // it by 1 / sqrt(2 n_layers)).

  // GPT-2: fused projections, biases, no RoPE, MHA.
  static AttentionConfig Gpt2(int64_t dim, int64_t n_heads,
                              int64_t max_seq_len);
  // Llama: separate projections, no biases, RoPE with `rope_theta`.
  static AttentionConfig Llama(int64_t dim, int64_t n_heads, int64_t n_kv_heads,
                               int64_t max_seq_len,
                               float rope_theta = 500000.0f);

  // Effective KV (n_kv_heads, or n_heads when 0).
  int64_t kv_heads() const { return n_kv_heads == 0 ? n_heads : n_kv_heads; }
  int64_t head_dim() const { return n_heads == 0 ? 0 : dim / n_heads; }
};

// y = CausalSelfAttention(x): x, y [B, T, C] with T <= max_seq_len.
class CausalSelfAttention : public Module {
 public:
  // Validates `config` (positive sizes, n_heads dividing dim, n_kv_heads
  // dividing n_heads, even head_dim with RoPE, float params) and builds the
  // module on the meta device.
  static absl::StatusOr<std::unique_ptr<CausalSelfAttention>> Create(
      const AttentionConfig& config);

  const AttentionConfig& config() const { return config_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override;
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&q_heads_,   &k_heads_, &v_heads_,   &probs_,
            &heads_out_, &lse_,     &key_start_, &positions_};
  }

 private:
  explicit CausalSelfAttention(const AttentionConfig& config);

  // The heads this process computes: all of them, or under tensor
  // parallelism those of its projections' pieces (query heads split across
  // the ranks; kv heads split too, or, with fewer kv heads than ranks, all
  // projected on every rank and the ones its query heads share used).
  struct LocalHeads {
    int64_t h = 0;         // query heads
    int64_t kv = 0;        // kv heads the attention core uses
    int64_t kv_proj = 0;   // kv heads the k and v projections compute
    int64_t kv_first = 0;  // the first used one among those
  };
  absl::StatusOr<LocalHeads> ComputeLocalHeads() const;
  // 1 / sqrt(head_dim).
  float Scale() const;
  // The attention core on the saved q_heads_, k_heads_, v_heads_: the heads'
  // output [B, H, T, hd]; saves what its backward needs.
  absl::StatusOr<Tensor> AttendFused();
  absl::StatusOr<Tensor> AttendUnfused();
  // dq, dk, dv of the unfused core from the heads' output gradient.
  absl::Status UnfusedBackward(const Tensor& dout, Tensor* dq, Tensor* dk,
                               Tensor* dv);

  AttentionConfig config_;
  // RoPE's frequencies (head_dim / 2), computed once from the config.
  std::vector<float> rope_inv_freq_;
  // Fused layout: qkv_ = c_attn. Separate layout: q_, k_, v_ = wq, wk, wv.
  Linear* qkv_ = nullptr;
  Linear* q_ = nullptr;
  Linear* k_ = nullptr;
  Linear* v_ = nullptr;
  Linear* out_ = nullptr;      // c_proj or wo.
  RmsNorm* q_norm_ = nullptr;  // qk_norm
  RmsNorm* k_norm_ = nullptr;

  // Saved by Forward for Backward (undefined otherwise).
  LocalHeads heads_;
  Shape out_shape_;  // The output's shape (the output projection's layout).
  int64_t batch_ = 0;
  int64_t seq_len_ = 0;
  Tensor q_heads_;  // [B, H, T, hd], after RoPE.
  Tensor k_heads_;  // [B, KV, T, hd], after RoPE.
  Tensor v_heads_;  // [B, KV, T, hd].
  // Unfused: [B, H, T, T] softmax probabilities, compute dtype.
  Tensor probs_;
  // Fused: the heads' output [B, H, T, hd] and the rows' log-sum-exp
  // [B, H, T] f32.
  Tensor heads_out_;
  Tensor lse_;
  // Document masking (the installed DocumentMasks' tensors, shared): the
  // keys' starts and RoPE's positions; undefined without.
  Tensor key_start_;
  Tensor positions_;
  // Context parallelism: whether the forward ran under a core (the
  // backward runs under the batch's, installed again: several micro-batches
  // may be in flight through one layer).
  bool context_parallel_ = false;
};

}  // namespace nn
}  // namespace fsdpp

#endif  // FSDPP_NN_ATTENTION_H_
