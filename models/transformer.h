// The model zoo's decoder-only transformer (GPT-2 and Llama families) as one
// Module built from a TransformerConfig with the nn layers.
//
// Parameter names are an interface: checkpoints, the HF adapter
// (models/hf_adapter.h) and FSDP plans key on them, and every parameter's
// initial values come from an RNG stream derived from its name. They are:
//
//   GPT-2                               Llama
//   wte.weight          [Vp, C]         tok_embeddings.weight       [Vp, C]
//   wpe.weight          [ctx, C]        layers.{i}.attention_norm.weight
//   h.{i}.ln_1.weight, .bias            layers.{i}.attention.wq.weight
//   h.{i}.attn.c_attn.weight, .bias     layers.{i}.attention.wk.weight
//   h.{i}.attn.c_proj.weight, .bias     layers.{i}.attention.wv.weight
//   h.{i}.ln_2.weight, .bias            layers.{i}.attention.wo.weight
//   h.{i}.mlp.fc.weight, .bias          layers.{i}.ffn_norm.weight
//   h.{i}.mlp.proj.weight, .bias        layers.{i}.feed_forward.gate.weight
//   ln_f.weight, .bias                  layers.{i}.feed_forward.up.weight
//   (lm_head: tied to wte.weight)       layers.{i}.feed_forward.down.weight
//                                       norm.weight
//                                       output.weight (untied configs only)
//
// Linear weights are [out, in] (PyTorch layout); c_attn packs q, k, v rows.
// Non-canonical combinations follow the same scheme (a SwiGLU feed-forward
// has gate/up/down, a GELU one fc/proj; biased attention adds .bias entries).
//
// Design choices:
//  * The blocks are not nn::Block (whose children are always named norm1,
//    attn, norm2, mlp) but TransformerBlock, the same pre-norm residual block
//    with per-family child names, so that our names read like the reference
//    implementations' (nanoGPT / Meta Llama).
//  * Every block is wrapped in an nn::ActivationCheckpoint at construction
//    (a transparent child, so names do not change); whether a forward goes
//    through the wrapper or straight to the block is a run-time flag, so
//    activation checkpointing can be toggled without rebuilding. "h.{i}"
//    therefore names both the wrapper and the TransformerBlock in
//    NamedModules(); FSDP plans take the blocks from blocks().
//  * The module's own Forward maps ids [B, T] to logits [B, T, Vp] and its
//    Backward maps dlogits back (returning an undefined tensor: ids have no
//    gradient), so hooks on the root fire like on any module; ForwardLoss /
//    Backward() add the mean cross-entropy on top.
//  * GPT-2 adds position embeddings by looking up a [B, T] positions tensor,
//    so wpe's backward is the ordinary embedding scatter-add.
#ifndef FSDPP_MODELS_TRANSFORMER_H_
#define FSDPP_MODELS_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "models/config.h"
#include "nn/attention.h"
#include "nn/block.h"
#include "nn/checkpoint_wrapper.h"
#include "nn/embedding.h"
#include "nn/linear.h"
#include "nn/linear_cross_entropy.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "nn/moe.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {

// Pre-norm residual block: y = x + attn(norm1(x)); z = y + mlp(norm2(y)),
// with children named per family (GPT-2: ln_1, attn, ln_2, mlp; Llama:
// attention_norm, attention, ffn_norm, feed_forward).
class TransformerBlock : public nn::Block {
 public:
  // All four must be non-null; `names` are the children's names in order.
  TransformerBlock(const std::vector<std::string>& names,
                   std::unique_ptr<Module> norm1, std::unique_ptr<Module> attn,
                   std::unique_ptr<Module> norm2, std::unique_ptr<Module> mlp);
};

// How a Transformer is built.
struct TransformerOptions {
  // dtype of every parameter (f32, bf16 or f16); activations follow it.
  DType param_dtype = DType::kF32;
  // Initial activation checkpointing of the blocks (none, full, every Nth
  // block, or selective: see nn::CheckpointPolicy).
  nn::CheckpointPolicy activation_checkpointing;
  // The attention core as the fused CausalAttention op (memory O(T) per
  // query row); false: the unfused Matmul + Softmax path that saves the
  // [B, H, T, T] probabilities (nn::AttentionConfig::fused_attention).
  bool fused_attention = true;
  // The LM head fused with the loss in ForwardLoss* (nn::LinearCrossEntropy):
  // logits and their gradient computed this many tokens at a time, never
  // whole. -1: automatic (chunks of at most 128 MiB of logits, and only where
  // that saves memory: more tokens than a chunk plus the model width); 0:
  // never (the head writes whole logits, as Forward does); > 0: always, in
  // chunks of this many tokens. Only with the default loss (not one set by
  // set_loss) and a head holding its whole weight with no bias; pipeline
  // stages run the head unfused.
  int64_t loss_chunk_tokens = -1;
  // Document masking of packed sequences: >= 0 is the end-of-text id that
  // begins each document (ops.h DocumentMask); attention then stays within
  // each document and positions (RoPE's, wpe's) restart at each one, so a
  // packed row trains as its documents would one by one. -1: off (whole
  // rows are one sequence). Needs the fused attention; a part without the
  // embeddings takes the ids through SetBatch. On CUDA the masked attention
  // is the reference kernel, not cuDNN.
  int64_t document_eot_id = -1;
  // Context parallelism (not owned; null: off): Forward, ForwardLoss*,
  // EvalLoss take whole rows of ids and targets [B, T] (T = the split's
  // seq_len) and run this rank's columns of them (context_parallel->runs()),
  // the attention through the split's core (every rank's keys), positions
  // the global ones (or those within documents); the logits are this rank's
  // [B, L, Vp] and the loss the mean over its targets. The whole rows' mean
  // is the mean over the cp ranks (each holds as many tokens), and the
  // parameter gradients averaged over them (FSDP over dp x cp) are the whole
  // sequence's; with ignored targets (-100) spread unevenly over the ranks
  // the loss's normalizer makes it the whole rows' token mean
  // (recipe::MicroBatch::step_loss_tokens), else it is the ranks' means'
  // mean.
  // Needs the fused attention; composes with document masking (masks from the
  // whole rows) and pipeline stages (a part without the embeddings takes the
  // whole ids through SetBatch and hidden states of this rank's rows).
  nn::ContextParallel* context_parallel = nullptr;

  // Pipeline parallelism: build only a contiguous part of the model (one
  // stage), with the whole model's parameter names. Blocks first_block ..
  // first_block + num_blocks - 1 (num_blocks -1: to the last block), keeping
  // their global indices in their names ("h.5...."); the embeddings when
  // `embedding` (the part then maps ids [B, T] to its output, else hidden
  // states [B, T, C] to its output); the final norm and head when `head`
  // (the output is then logits [B, T, Vp], else hidden states [B, T, C]).
  // A part with the head of a tied model but not the embedding keeps its own
  // copy of the token embedding's weight (same name, same initial values),
  // which its head reads: the pipeline keeps the copies' gradients summed.
  int first_block = 0;
  int num_blocks = -1;
  bool embedding = true;
  bool head = true;
};

class BlockStack;

// A GPT-2 or Llama model; see the file comment for its parameter names.
class Transformer : public Module {
 public:
  // Validates `config` (ValidateConfig) and builds the model on the meta
  // device (no memory): call ToEmpty(device) and InitWeights(seed), or let
  // FSDP materialise it shard by shard. Init: GPT-2 weights ~ Normal(0,
  // init_std) with the residual projections (attn.c_proj, mlp.proj) scaled by
  // 1 / sqrt(2 n_layers); Llama weights (embedding and head included) ~
  // Normal(0, init_std) truncated at 2 stds; norm weights 1; biases 0.
  static absl::StatusOr<std::unique_ptr<Transformer>> Create(
      const TransformerConfig& config, const TransformerOptions& options = {});

  const TransformerConfig& config() const { return config_; }

  // Whether this is the whole model or a pipeline stage's part of it
  // (TransformerOptions::first_block ..).
  bool is_whole() const;
  // For a part without the embeddings (a pipeline stage) that masks
  // documents or splits the context: the micro-batch's whole ids [B, T],
  // before each Forward (which its masks and positions come from; kept with
  // the saved tensors until Backward, so they stash with them). A part with
  // the embeddings does this itself from its input.
  absl::Status SetBatch(const Tensor& ids);

  // The row keys (one per row: its sample's, nn/dropout.h) of the next
  // Forward's batch: that Forward is a training one, and dropout (LoRA's)
  // drops under them, in its Backward too; used up by that Forward. Without
  // them a Forward drops nothing (evaluation, inference).
  void SetDropoutRows(std::vector<uint64_t> keys) {
    pending_dropout_keys_ = std::move(keys);
    dropout_pending_ = true;
  }

  // Whether Forward takes ids (the part has the embeddings) and gives logits
  // (the part has the head).
  bool has_embedding() const { return options_.embedding; }
  bool has_head() const { return options_.head; }

  // Mean cross-entropy of Forward(input) against `targets` ([B, T] like
  // ids, i32/i64, -100 = ignored) over the non-ignored targets (their sum /
  // loss().normalizer() when one is set); input is ids
  // [B, T] or, for a part without the embeddings, hidden states [B, T, C].
  // Keeps the activations and logits for Backward(). FailedPrecondition on a
  // part without the head.
  absl::StatusOr<float> ForwardLoss(const Tensor& input, const Tensor& targets);
  // ForwardLoss with the loss left on the device: `weight` times it is added
  // to `*sum` (f32, one element, on the model's device) and nothing is read
  // back (nn::LossFunction::ForwardAccumulate). Backward() follows as after
  // ForwardLoss.
  absl::Status ForwardLossAccumulate(const Tensor& input, const Tensor& targets,
                                     double weight, Tensor* sum);
  // Accumulates loss_scale x d(last ForwardLoss)/d(parameter) into every
  // Parameter::grad (loss_scale: e.g. 1 / micro-batches for gradient
  // accumulation, times a LossScaler's scale for fp16; finite and > 0).
  absl::Status Backward(float loss_scale = 1.0f);
  using Module::Backward;
  // Targets counted by the last ForwardLoss (the mean's denominator).
  int64_t last_target_count() const {
    return lm_head_ != nullptr && lm_head_->last_forward_fused()
               ? lm_head_->count()
               : loss_->count();
  }

  // The loss ForwardLoss, Backward() and EvalLoss use (default: mean
  // cross-entropy with ignore index -100). Tensor parallelism's loss
  // parallel sets one that reads vocabulary-sharded logits.
  // It turns off the fused head (TransformerOptions::loss_chunk_tokens).
  void set_loss(std::unique_ptr<nn::LossFunction> loss) {
    loss_ = std::move(loss);
    default_loss_ = false;
  }
  const nn::LossFunction& loss() const { return *loss_; }
  nn::LossFunction* mutable_loss() { return loss_.get(); }

  // Logits [B, T, Vp] (parameter dtype) for ids [B, T], keeping nothing for a
  // backward (an evaluation-only forward). Under loss parallel (a column-wise
  // head left sharded) this rank's vocabulary slice of them.
  absl::StatusOr<Tensor> Logits(const Tensor& ids);
  // The mean cross-entropy of ForwardLoss, keeping nothing for a backward
  // (evaluation: under FSDP a forward-only pass, see fsdp/fully_shard.h).
  absl::StatusOr<float> EvalLoss(const Tensor& ids, const Tensor& targets);

  // The mixture-of-experts layers (config().moe; a part's), in block order.
  const std::vector<nn::MoE*>& moe_layers() const { return moe_layers_; }
  // The sum of their last Forward's auxiliary losses (nn::MoE; 0 without).
  // It is not part of ForwardLoss's value (the cross-entropy alone, the
  // same for dense and MoE models); its gradient is part of Backward's.
  double AuxLoss() const;
  // The MoE layers' stats since the last call (nn::MoE::TakeStats), summed
  // over the layers: tokens per expert, the auxiliary losses' sum (over the
  // layers and the trained micro-batches) and the backwards per layer.
  nn::MoE::Stats TakeMoeStats();
  // The factor the MoE layers' Backward scales their auxiliary loss's
  // gradient by: the loss scale of the gradient the head's loss sends (the
  // step sets it, 1 / micro-batches times a loss scaler's scale).
  void SetAuxLossScale(float scale);

  // The n_layers blocks (a part's blocks), in order (units for FSDP plans).
  const std::vector<TransformerBlock*>& blocks() const { return blocks_; }
  // Index in the whole model of blocks()[0].
  int first_block() const { return options_.first_block; }
  // Token embedding (wte / tok_embeddings); nullptr for a part without it
  // (a tied part with the head keeps it as the holder of the head's weight,
  // never run).
  nn::Embedding* token_embedding() const { return token_embedding_; }
  // Position embedding (wpe); nullptr for Llama and parts without the
  // embeddings.
  nn::Embedding* position_embedding() const { return position_embedding_; }
  // Final norm (ln_f / norm); nullptr for a part without the head.
  Module* final_norm() const { return final_norm_; }
  // LM head (lm_head / output); shares the token embedding when tied;
  // nullptr for a part without the head.
  nn::LinearCrossEntropy* lm_head() const { return lm_head_; }

  // Which blocks' forwards recompute their activations in backward
  // (nn::ActivationCheckpoint) instead of keeping them, and how. Takes effect
  // at the next Forward; a Backward follows the path its Forward took.
  void set_activation_checkpointing(const nn::CheckpointPolicy& policy);
  const nn::CheckpointPolicy& activation_checkpointing() const;

 protected:
  // ids [B, T] (i32/i64, 1 <= T <= context_length) -> logits [B, T, Vp]
  // (a part: hidden states in or out instead, see TransformerOptions).
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& input) override;
  // dlogits [B, T, Vp] -> undefined (ids have no gradient); a part: the
  // gradient of its output -> that of its input.
  absl::StatusOr<Tensor> BackwardImpl(const Tensor& doutput) override;
  std::vector<Tensor*> SavedTensorSlots() override {
    return {&documents_.key_start, &documents_.positions, &cp_positions_,
            &dropout_keys_, &dropout_columns_};
  }

 private:
  Transformer(const TransformerConfig& config,
              const TransformerOptions& options);
  absl::Status Build();
  // The final norm and head on the blocks' output x (x itself for a part
  // without the head).
  absl::StatusOr<Tensor> Head(const Tensor& x);
  // This rank's columns of whole rows [B, T] under context parallelism
  // (the rows themselves without).
  absl::StatusOr<Tensor> LocalColumns(const Tensor& whole) const;
  // Whether a Forward needs the batch's ids (SetBatch) for its masks or
  // positions.
  bool NeedsBatch() const {
    return options_.document_eot_id >= 0 ||
           options_.context_parallel != nullptr;
  }
  // SetDropoutRows' keys, if any (used up), clearing the batch's.
  std::optional<std::vector<uint64_t>> TakePendingDropoutKeys();
  // Whether a layer drops (LoRA's dropout > 0); found once.
  bool HasDropout();
  // With `keys` and a layer that drops: the batch's keys (one per row) and
  // columns as tensors on `device` (the CPU, or meta in a dry run).
  absl::Status KeepDropoutRows(std::optional<std::vector<uint64_t>> keys,
                               int64_t rows, Device device);
  // The blocks (under the batch's masks or core) and the head.
  absl::StatusOr<Tensor> Blocks(const Tensor& x);
  // Arms the head's fused loss for this ForwardLoss* when
  // options_.loss_chunk_tokens and the model allow it.
  absl::Status ArmFusedLoss(const Tensor& targets);

  TransformerConfig config_;
  TransformerOptions options_;
  nn::Embedding* token_embedding_ = nullptr;
  nn::Embedding* position_embedding_ = nullptr;
  BlockStack* stack_ = nullptr;
  std::vector<TransformerBlock*> blocks_;
  std::vector<nn::MoE*> moe_layers_;
  Module* final_norm_ = nullptr;
  nn::LinearCrossEntropy* lm_head_ = nullptr;
  // The logits are the loss's alone: their gradient overwrites them.
  std::unique_ptr<nn::LossFunction> loss_ =
      std::make_unique<nn::CrossEntropyLoss>(-100,
                                             /*gradient_in_place=*/true);
  bool default_loss_ = true;
  // Document masking: the masks of the batch in flight, from Forward to the
  // end of Backward (installed over both: activation checkpointing's
  // recomputation runs inside Backward).
  nn::DocumentMasks documents_;
  // Context parallelism: RoPE's (and wpe's) positions of this rank's rows,
  // likewise; the core is made from them and the masks' key starts for the
  // forward and again for the backward.
  Tensor cp_positions_;
  // SetBatch ran since the last Forward.
  bool batch_ready_ = false;
  // Dropout (LoRA's): SetDropoutRows' keys for the next Forward, then the
  // keys (i64 [B]) and this rank's whole-sequence columns (i64 [L]) of the
  // batch in flight, installed with its masks.
  std::vector<uint64_t> pending_dropout_keys_;
  bool dropout_pending_ = false;
  Tensor dropout_keys_;
  Tensor dropout_columns_;
  int has_dropout_ = -1;  // unknown
  // The sequence length of the last SetBatch.
  int64_t batch_seq_ = 0;
};

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_TRANSFORMER_H_
