// GPT-2 / Llama transformer; see transformer.h.
#include "models/transformer.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "core/allocator.h"
#include "core/logging.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "nn/attention.h"
#include "nn/checkpoint_wrapper.h"
#include "nn/dropout.h"
#include "nn/layer_norm.h"
#include "nn/mlp.h"
#include "nn/rms_norm.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace models {

// ------------------------------------------------------------ TransformerBlock

namespace {

nn::Block::ChildNames BlockNames(const std::vector<std::string>& names) {
  CHECK(names.size() == 4) << "TransformerBlock: needs 4 child names";
  nn::Block::ChildNames out;
  out.norm1 = names[0];
  out.attn = names[1];
  out.norm2 = names[2];
  out.mlp = names[3];
  return out;
}

}  // namespace

TransformerBlock::TransformerBlock(const std::vector<std::string>& names,
                                   std::unique_ptr<Module> norm1,
                                   std::unique_ptr<Module> attn,
                                   std::unique_ptr<Module> norm2,
                                   std::unique_ptr<Module> mlp)
    : nn::Block(std::move(norm1), std::move(attn), std::move(norm2),
                std::move(mlp), BlockNames(names), "TransformerBlock") {}

// ------------------------------------------------------------------ BlockStack

// The blocks as children "0", "1", ..., each an ActivationCheckpoint wrapper
// around its TransformerBlock; runs them in order, through the wrappers when
// checkpointing is on.
class BlockStack : public Module {
 public:
  BlockStack() : Module("BlockStack") {}

  // Appends `block`, wrapped; returns it.
  TransformerBlock* Append(int64_t index,
                           std::unique_ptr<TransformerBlock> block) {
    TransformerBlock* raw = block.get();
    wrappers_.push_back(AddModule(
        std::to_string(index),
        std::make_unique<nn::ActivationCheckpoint>(std::move(block))));
    blocks_.push_back(raw);
    indices_.push_back(index);
    return raw;
  }

  // Which blocks the next Forward runs through their checkpoint wrappers,
  // and in which mode.
  void set_checkpointing(const nn::CheckpointPolicy& policy) {
    policy_ = policy;
  }
  const nn::CheckpointPolicy& checkpointing() const { return policy_; }

 protected:
  absl::StatusOr<Tensor> ForwardImpl(const Tensor& x) override {
    forward_policy_ = policy_;
    for (nn::ActivationCheckpoint* w : wrappers_) {
      w->set_selective(policy_.kind == nn::CheckpointPolicy::Kind::kSelective);
    }
    Tensor h = x;
    for (size_t i = 0; i < blocks_.size(); ++i) {
      FSDPP_ASSIGN_OR_RETURN(h, Unit(i)->Forward(h));
    }
    return h;
  }

  absl::StatusOr<Tensor> BackwardImpl(const Tensor& dy) override {
    Tensor d = dy;
    for (size_t i = blocks_.size(); i-- > 0;) {
      FSDPP_ASSIGN_OR_RETURN(d, Unit(i)->Backward(d));
    }
    return d;
  }

 private:
  Module* Unit(size_t i) const {
    // By the block's index in the whole model: every:N checkpoints the same
    // blocks whatever the pipeline split.
    return forward_policy_.Wraps(indices_[i])
               ? static_cast<Module*>(wrappers_[i])
               : static_cast<Module*>(blocks_[i]);
  }

  std::vector<nn::ActivationCheckpoint*> wrappers_;
  std::vector<TransformerBlock*> blocks_;
  std::vector<int64_t> indices_;
  nn::CheckpointPolicy policy_;
  nn::CheckpointPolicy forward_policy_;  // The paths the last Forward took.
};

// ----------------------------------------------------------------- Transformer

Transformer::Transformer(const TransformerConfig& config,
                         const TransformerOptions& options)
    : Module("Transformer"), config_(config), options_(options) {}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Create(
    const TransformerConfig& config, const TransformerOptions& options) {
  FSDPP_RETURN_IF_ERROR(ValidateConfig(config));
  if (!IsFloatingPoint(options.param_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transformer: param_dtype must be f32, bf16 or f16, got ",
                     DTypeName(options.param_dtype)));
  }
  const int64_t n = config.n_layers;
  if (options.first_block < 0 || options.first_block > n ||
      options.num_blocks < -1 ||
      (options.num_blocks >= 0 &&
       options.first_block + options.num_blocks > n) ||
      (options.num_blocks == -1 && options.first_block == n && n > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Transformer: part with blocks from ", options.first_block, " (",
        options.num_blocks, " blocks, -1 = to the end) does not fit the ", n,
        " blocks of ", config.name));
  }
  if (options.document_eot_id >= 0 && !options.fused_attention) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transformer: document masking (end-of-text id ",
                     options.document_eot_id, ") needs the fused attention"));
  }
  if (options.context_parallel != nullptr && !options.fused_attention) {
    return absl::InvalidArgumentError(
        "Transformer: context parallelism needs the fused attention");
  }
  if (options.document_eot_id >= config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transformer: document masking's end-of-text id ",
                     options.document_eot_id, " is not in the vocabulary of ",
                     config.vocab_size, " tokens"));
  }
  TransformerOptions resolved = options;
  if (resolved.num_blocks == -1) resolved.num_blocks = n - options.first_block;
  if (resolved.num_blocks == 0 && !resolved.embedding && !resolved.head) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transformer: a part of ", config.name,
                     " with no blocks, no embeddings and no head is empty"));
  }
  auto model = absl::WrapUnique(new Transformer(config, resolved));
  FSDPP_RETURN_IF_ERROR(model->Build());
  return model;
}

absl::Status Transformer::Build() {
  const TransformerConfig& c = config_;
  const DType dtype = options_.param_dtype;
  const bool gpt2 = c.family == ModelFamily::kGpt2;
  const int64_t vocab = c.padded_vocab_size();
  const float init_std = c.init_std;
  const float residual_std =
      gpt2 ? init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers))
           : init_std;

  const TransformerOptions& o = options_;
  // A tied head reads the token embedding's weight: a part with the head
  // keeps the embedding module as that weight's holder.
  if (o.embedding || (o.head && c.tied_embeddings)) {
    token_embedding_ = AddModule(
        gpt2 ? "wte" : "tok_embeddings",
        std::make_unique<nn::Embedding>(vocab, c.dim, init_std, dtype));
  }
  if (gpt2 && o.embedding) {
    position_embedding_ =
        AddModule("wpe", std::make_unique<nn::Embedding>(
                             c.context_length, c.dim, init_std, dtype));
  }

  const auto make_norm = [&]() -> std::unique_ptr<Module> {
    if (gpt2) {
      return std::make_unique<nn::LayerNorm>(c.dim, c.norm_eps, c.bias, dtype);
    }
    return std::make_unique<nn::RmsNorm>(c.dim, c.norm_eps, dtype);
  };
  const std::vector<std::string> names =
      gpt2 ? std::vector<std::string>{"ln_1", "attn", "ln_2", "mlp"}
           : std::vector<std::string>{"attention_norm", "attention", "ffn_norm",
                                      "feed_forward"};

  stack_ = AddModule(gpt2 ? "h" : "layers", std::make_unique<BlockStack>());
  stack_->set_checkpointing(options_.activation_checkpointing);
  for (int64_t i = o.first_block; i < o.first_block + o.num_blocks; ++i) {
    nn::AttentionConfig ac;
    ac.dim = c.dim;
    ac.n_heads = c.n_heads;
    ac.n_kv_heads = c.kv_heads();
    ac.max_seq_len = c.context_length;
    ac.fused_qkv = gpt2;
    ac.qkv_bias = c.bias;
    ac.out_bias = c.bias;
    ac.rope = c.UsesRope(i);
    ac.rope_theta = c.rope_theta;
    ac.rope_scaling = c.rope_scaling;
    ac.qk_norm = c.qk_norm;
    ac.qk_norm_eps = c.norm_eps;
    ac.param_dtype = dtype;
    ac.fused_attention = options_.fused_attention;
    ac.init_std = init_std;
    ac.out_init_std = residual_std;
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<nn::CausalSelfAttention> attention,
                           nn::CausalSelfAttention::Create(ac));
    std::unique_ptr<Module> mlp;
    if (c.UsesMoe(i)) {
      nn::MoeOptions mo;
      mo.dim = c.dim;
      mo.hidden = c.moe.hidden;
      mo.num_experts = c.moe.num_experts;
      mo.top_k = c.moe.top_k;
      mo.scoring =
          c.moe.sigmoid ? nn::MoeScoring::kSigmoid : nn::MoeScoring::kSoftmax;
      mo.normalize_top_k = c.moe.normalize_top_k;
      mo.route_scale = c.moe.route_scale;
      mo.shared_hidden = c.moe.shared_hidden;
      mo.aux_loss_coef = c.moe.aux_loss_coef;
      mo.expert_bias = c.moe.expert_bias;
      mo.init_std = init_std;
      mo.down_init_std = residual_std;
      mo.dtype = dtype;
      auto moe = std::make_unique<nn::MoE>(mo);
      moe_layers_.push_back(moe.get());
      mlp = std::move(moe);
    } else if (c.activation == Activation::kGelu) {
      mlp = std::make_unique<nn::Mlp>(c.dim, c.ffn_hidden, init_std,
                                      residual_std, dtype);
    } else {
      mlp = std::make_unique<nn::SwiGlu>(c.dim, c.ffn_hidden, init_std,
                                         residual_std, dtype);
    }
    blocks_.push_back(stack_->Append(
        i, std::make_unique<TransformerBlock>(names, make_norm(),
                                              std::move(attention), make_norm(),
                                              std::move(mlp))));
  }

  if (o.head) {
    final_norm_ = AddModule(gpt2 ? "ln_f" : "norm", make_norm());
    const std::string head_name = gpt2 ? "lm_head" : "output";
    if (c.tied_embeddings) {
      lm_head_ = AddModule(head_name, std::make_unique<nn::LinearCrossEntropy>(
                                          token_embedding_->weight(), false));
    } else {
      lm_head_ =
          AddModule(head_name, std::make_unique<nn::LinearCrossEntropy>(
                                   c.dim, vocab, false, init_std, dtype));
    }
  }

  if (!gpt2) {  // matrices, and the experts' stacks of them
    for (auto& [name, p] : NamedParameters()) {
      if (p->shape.size() >= 2)
        p->init = InitSpec::TruncatedNormal(init_std, 2.0f);
    }
  }
  return absl::OkStatus();
}

void Transformer::set_activation_checkpointing(
    const nn::CheckpointPolicy& policy) {
  stack_->set_checkpointing(policy);
}

const nn::CheckpointPolicy& Transformer::activation_checkpointing() const {
  return stack_->checkpointing();
}

bool Transformer::is_whole() const {
  return options_.embedding && options_.head && options_.first_block == 0 &&
         options_.num_blocks == config_.n_layers;
}

absl::StatusOr<Tensor> Transformer::LocalColumns(const Tensor& whole) const {
  if (options_.context_parallel == nullptr) return whole;
  absl::StatusOr<Tensor> local = options_.context_parallel->Local(whole);
  if (!local.ok()) return Annotate(local.status(), "Transformer");
  return local;
}

absl::Status Transformer::SetBatch(const Tensor& ids) {
  batch_ready_ = false;
  if (!ids.defined() || ids.ndim() != 2 || ids.dim(0) < 1 || ids.dim(1) < 1 ||
      ids.dim(1) > config_.context_length ||
      (ids.dtype() != DType::kI32 && ids.dtype() != DType::kI64)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ids ", ids.ToString(),
        " must be i32/i64 [B, T] with 1 <= T <= ", config_.context_length));
  }
  const int64_t b = ids.dim(0), t = ids.dim(1);
  documents_ = nn::DocumentMasks();
  cp_positions_ = Tensor();
  batch_seq_ = t;
  if (options_.document_eot_id >= 0) {
    FSDPP_ASSIGN_OR_RETURN(documents_.key_start,
                           Tensor::Empty({b, t}, DType::kI32, ids.device(),
                                         MemoryTag::kActivations));
    FSDPP_ASSIGN_OR_RETURN(documents_.positions,
                           Tensor::Empty({b, t}, DType::kI32, ids.device(),
                                         MemoryTag::kActivations));
    FSDPP_RETURN_IF_ERROR(DocumentMask(ids, options_.document_eot_id,
                                       &documents_.key_start,
                                       &documents_.positions));
    // Positions within the documents (< t: no range check needed).
    documents_.positions.MarkIdsCheckedBelow(t);
  }
  if (const nn::ContextParallel* cp = options_.context_parallel) {
    // This rank's rows' positions: within the documents, or the global
    // ones; the core takes the whole rows' key starts.
    if (documents_.positions.defined()) {
      FSDPP_ASSIGN_OR_RETURN(cp_positions_, LocalColumns(documents_.positions));
      documents_.positions = Tensor();
    } else {
      FSDPP_RETURN_IF_ERROR(Annotate(cp->CheckWhole(ids), "Transformer"));
      const int64_t l = cp->local();
      if (ids.is_meta()) {
        FSDPP_ASSIGN_OR_RETURN(
            cp_positions_, Tensor::Empty({b, l}, DType::kI32, ids.device()));
      } else {
        std::vector<int64_t> values;
        values.reserve(b * l);
        for (int64_t row = 0; row < b; ++row) {
          for (const nn::ContextParallel::Run& run : cp->runs()) {
            for (int64_t i = 0; i < run.length; ++i) {
              values.push_back(run.start + i);
            }
          }
        }
        FSDPP_ASSIGN_OR_RETURN(
            cp_positions_,
            Tensor::FromInts({b, l}, values, DType::kI32, ids.device()));
      }
    }
    // Every position is below the sequence length.
    cp_positions_.MarkIdsCheckedBelow(cp->seq_len());
  }
  batch_ready_ = true;
  return absl::OkStatus();
}

namespace {

// A batch's document masks (without context parallelism, which takes them
// through its core) or context-parallel core, installed on the thread over
// a forward or a backward.
class BatchScope {
 public:
  // `dropout_keys` (undefined: no dropout) and `dropout_columns`: i64 host
  // tensors.
  static absl::StatusOr<std::unique_ptr<BatchScope>> Enter(
      nn::ContextParallel* cp, const nn::DocumentMasks& documents,
      const Tensor& cp_positions, const Tensor& dropout_keys,
      const Tensor& dropout_columns) {
    std::unique_ptr<nn::ContextParallelCore> core;
    if (cp != nullptr) {
      FSDPP_ASSIGN_OR_RETURN(core,
                             cp->MakeCore(cp_positions, documents.key_start));
    }
    const nn::DocumentMasks* masks =
        cp == nullptr && documents.key_start.defined() ? &documents : nullptr;
    auto rows = std::make_unique<nn::DropoutRows>();
    if (dropout_keys.defined() && dropout_keys.is_meta()) {
      // A dry run: the shapes only.
      rows->keys.assign(dropout_keys.numel(), 0);
      rows->columns.assign(dropout_columns.numel(), 0);
    } else if (dropout_keys.defined()) {
      FSDPP_ASSIGN_OR_RETURN(const std::vector<int64_t> keys,
                             dropout_keys.ToInts());
      rows->keys.assign(keys.begin(), keys.end());
      FSDPP_ASSIGN_OR_RETURN(rows->columns, dropout_columns.ToInts());
    } else {
      rows.reset();
    }
    return absl::WrapUnique(
        new BatchScope(masks, std::move(core), std::move(rows)));
  }

 private:
  BatchScope(const nn::DocumentMasks* masks,
             std::unique_ptr<nn::ContextParallelCore> core,
             std::unique_ptr<nn::DropoutRows> rows)
      : core_(std::move(core)),
        rows_(std::move(rows)),
        masks_(masks),
        installed_(core_.get()),
        dropout_(rows_.get()) {}
  std::unique_ptr<nn::ContextParallelCore> core_;
  std::unique_ptr<nn::DropoutRows> rows_;
  nn::DocumentMasks::Scope masks_;
  nn::ContextParallelCore::Scope installed_;
  nn::DropoutRows::Scope dropout_;
};

}  // namespace

std::optional<std::vector<uint64_t>> Transformer::TakePendingDropoutKeys() {
  dropout_keys_ = Tensor();
  dropout_columns_ = Tensor();
  if (!dropout_pending_) return std::nullopt;
  dropout_pending_ = false;
  std::vector<uint64_t> keys = std::move(pending_dropout_keys_);
  pending_dropout_keys_.clear();
  return keys;
}

bool Transformer::HasDropout() {
  if (has_dropout_ < 0) {
    has_dropout_ = 0;
    for (auto& [name, m] : NamedModules()) {
      const auto* linear = dynamic_cast<const nn::Linear*>(m);
      if (linear != nullptr && linear->lora_dropout() > 0) has_dropout_ = 1;
    }
  }
  return has_dropout_ == 1;
}

absl::Status Transformer::KeepDropoutRows(
    std::optional<std::vector<uint64_t>> keys, int64_t rows, Device device) {
  if (!keys.has_value() || !HasDropout()) return absl::OkStatus();
  if (static_cast<int64_t>(keys->size()) != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transformer: ", keys->size(), " dropout row keys for ",
                     rows, " rows"));
  }
  // This rank's tokens' columns in the whole sequence.
  std::vector<int64_t> columns;
  if (const nn::ContextParallel* cp = options_.context_parallel) {
    for (const nn::ContextParallel::Run& run : cp->runs()) {
      for (int64_t i = 0; i < run.length; ++i) columns.push_back(run.start + i);
    }
  } else {
    for (int64_t i = 0; i < batch_seq_; ++i) columns.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(columns.size());
  // On the batch's device like its masks (a dry run's meta tensors count
  // what a run's do); dropout itself runs on the CPU only.
  if (!device.is_meta() && !device.is_cpu()) {
    return absl::UnimplementedError(absl::StrCat(
        "Transformer: LoRA dropout runs on the CPU only for now, not ",
        device.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(
      dropout_keys_,
      Tensor::Empty({rows}, DType::kI64, device, MemoryTag::kActivations));
  FSDPP_ASSIGN_OR_RETURN(
      dropout_columns_,
      Tensor::Empty({n}, DType::kI64, device, MemoryTag::kActivations));
  if (device.is_meta()) return absl::OkStatus();
  std::copy(keys->begin(), keys->end(), dropout_keys_.data<int64_t>());
  std::copy(columns.begin(), columns.end(), dropout_columns_.data<int64_t>());
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Transformer::ForwardImpl(const Tensor& input) {
  // Used up by this forward, whatever happens to it.
  std::optional<std::vector<uint64_t>> keys = TakePendingDropoutKeys();
  if (!options_.embedding) {
    if (!input.defined() || input.ndim() != 3 || input.dim(0) < 1 ||
        input.dim(1) < 1 || input.dim(1) > config_.context_length ||
        input.dim(2) != config_.dim || !IsFloatingPoint(input.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden states ", input.ToString(), " into the part from block ",
          options_.first_block, " must be float [B, T, ", config_.dim,
          "] with 1 <= T <= ", config_.context_length));
    }
    if (NeedsBatch() && !batch_ready_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Transformer: the part from block ", options_.first_block,
          " masks documents or splits the context: SetBatch(ids) must "
          "precede each Forward"));
    }
    batch_ready_ = false;
    FSDPP_RETURN_IF_ERROR(
        KeepDropoutRows(std::move(keys), input.dim(0), input.device()));
    return Blocks(input);
  }
  const Tensor& ids = input;
  FSDPP_RETURN_IF_ERROR(SetBatch(ids));
  batch_ready_ = false;
  FSDPP_RETURN_IF_ERROR(
      KeepDropoutRows(std::move(keys), ids.dim(0), ids.device()));
  const int64_t b = ids.dim(0), t = ids.dim(1);
  FSDPP_ASSIGN_OR_RETURN(const Tensor local_ids, LocalColumns(ids));
  FSDPP_ASSIGN_OR_RETURN(Tensor x, token_embedding_->Forward(local_ids));
  if (position_embedding_ != nullptr) {
    Tensor positions =
        cp_positions_.defined() ? cp_positions_ : documents_.positions;
    if (!positions.defined() && ids.is_meta()) {
      FSDPP_ASSIGN_OR_RETURN(positions,
                             Tensor::Empty({b, t}, ids.dtype(), ids.device()));
    } else if (!positions.defined()) {
      std::vector<int64_t> values(b * t);
      for (int64_t i = 0; i < b * t; ++i) values[i] = i % t;
      FSDPP_ASSIGN_OR_RETURN(positions,
                             Tensor::FromInts({b, t}, values, ids.dtype()));
      if (!ids.device().is_cpu()) {
        // Staged without waiting for the GPU; they lie in [0, t), which
        // spares the embedding its own check (a device-to-host copy).
        FSDPP_ASSIGN_OR_RETURN(
            Tensor on_device, Tensor::Empty({b, t}, ids.dtype(), ids.device()));
        FSDPP_RETURN_IF_ERROR(
            CopyBytesFromHostAsync(on_device.raw_data(), on_device.device(),
                                   positions.raw_data(), positions.nbytes()));
        on_device.MarkIdsCheckedBelow(t);
        positions = on_device;
      }
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor pos, position_embedding_->Forward(positions));
    // The token embedding's output is saved by no one: add in place.
    FSDPP_RETURN_IF_ERROR(Add(x, pos, &x));
  }
  return Blocks(x);
}

absl::StatusOr<Tensor> Transformer::Blocks(const Tensor& x) {
  FSDPP_ASSIGN_OR_RETURN(
      const std::unique_ptr<BatchScope> batch,
      BatchScope::Enter(options_.context_parallel, documents_, cp_positions_,
                        dropout_keys_, dropout_columns_));
  FSDPP_ASSIGN_OR_RETURN(Tensor y, stack_->Forward(x));
  return Head(y);
}

absl::StatusOr<Tensor> Transformer::Head(const Tensor& x) {
  if (!options_.head) return x;
  FSDPP_ASSIGN_OR_RETURN(Tensor h, final_norm_->Forward(x));
  return lm_head_->Forward(h);
}

absl::StatusOr<Tensor> Transformer::BackwardImpl(const Tensor& doutput) {
  FSDPP_ASSIGN_OR_RETURN(
      const std::unique_ptr<BatchScope> batch,
      BatchScope::Enter(options_.context_parallel, documents_, cp_positions_,
                        dropout_keys_, dropout_columns_));
  Tensor dx = doutput;
  if (options_.head) {
    FSDPP_ASSIGN_OR_RETURN(dx, lm_head_->Backward(dx));
    FSDPP_ASSIGN_OR_RETURN(dx, final_norm_->Backward(dx));
  }
  FSDPP_ASSIGN_OR_RETURN(dx, stack_->Backward(dx));
  ReleaseOwnSavedTensors();  // the batch's masks and positions
  if (!options_.embedding) return dx;
  // x = wte(ids) + wpe(positions): both tables get dx.
  FSDPP_RETURN_IF_ERROR(token_embedding_->Backward(dx).status());
  if (position_embedding_ != nullptr) {
    FSDPP_RETURN_IF_ERROR(position_embedding_->Backward(dx).status());
  }
  return Tensor();
}

namespace {

// Targets must be given with the shape of the ids.
absl::Status CheckTargets(const Tensor& input, const Tensor& targets,
                          bool has_head, absl::string_view caller) {
  if (!has_head) {
    return absl::FailedPreconditionError(
        absl::StrCat("Transformer::", caller,
                     ": this pipeline part has no head to compute a loss"));
  }
  if (targets.defined() && input.defined() && input.ndim() >= 2 &&
      targets.ndim() == 2 && targets.dim(0) == input.dim(0) &&
      targets.dim(1) == input.dim(1)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Transformer::", caller, ": targets ", targets.ToString(),
                   " must be [B, T] like the input ", input.ToString()));
}

}  // namespace

absl::Status Transformer::ArmFusedLoss(const Tensor& targets) {
  const int64_t chunk = options_.loss_chunk_tokens;
  if (chunk == 0 || !default_loss_ || lm_head_ == nullptr ||
      !lm_head_->CanFuseLoss()) {
    return absl::OkStatus();
  }
  return lm_head_->ArmLoss(
      targets, loss_->ignore_index(),
      chunk < 0 ? nn::LinearCrossEntropy::kAutoChunk : chunk);
}

absl::StatusOr<float> Transformer::ForwardLoss(const Tensor& input,
                                               const Tensor& targets) {
  FSDPP_RETURN_IF_ERROR(
      CheckTargets(input, targets, options_.head, "ForwardLoss"));
  FSDPP_ASSIGN_OR_RETURN(const Tensor local, LocalColumns(targets));
  FSDPP_RETURN_IF_ERROR(ArmFusedLoss(local));
  absl::StatusOr<Tensor> forward = Forward(input);
  lm_head_->Disarm();  // used up, unless the forward failed before the head
  FSDPP_ASSIGN_OR_RETURN(Tensor output, std::move(forward));
  if (!lm_head_->last_forward_fused()) return loss_->Forward(output, local);
  return nn::MeanOfTotal(output, lm_head_->count(),  // count 0 on meta
                         loss_->normalizer());
}

absl::Status Transformer::ForwardLossAccumulate(const Tensor& input,
                                                const Tensor& targets,
                                                double weight, Tensor* sum) {
  FSDPP_RETURN_IF_ERROR(
      CheckTargets(input, targets, options_.head, "ForwardLossAccumulate"));
  FSDPP_ASSIGN_OR_RETURN(const Tensor local, LocalColumns(targets));
  FSDPP_RETURN_IF_ERROR(ArmFusedLoss(local));
  absl::StatusOr<Tensor> forward = Forward(input);
  lm_head_->Disarm();  // used up, unless the forward failed before the head
  FSDPP_ASSIGN_OR_RETURN(Tensor output, std::move(forward));
  if (!lm_head_->last_forward_fused()) {
    return loss_->ForwardAccumulate(output, local, weight, sum);
  }
  FSDPP_RETURN_IF_ERROR(nn::CheckLossSum(sum, output.device(),
                                         "Transformer::ForwardLossAccumulate"));
  return nn::AccumulateMean(output, lm_head_->count(), weight, sum,
                            loss_->normalizer());
}

absl::Status Transformer::Backward(float loss_scale) {
  if (lm_head_ != nullptr && lm_head_->fused_pending()) {
    // The fused head's gradient is the count's mean's; a normalizer
    // rescales it (nn::LossFunction::set_normalizer).
    lm_head_->set_backward_scale(
        static_cast<float>(static_cast<double>(loss_scale) *
                           loss_->CountToNormalizer(lm_head_->count())));
    return Module::Backward(Tensor()).status();
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor dlogits, loss_->Backward(loss_scale));
  return Module::Backward(dlogits).status();
}

double Transformer::AuxLoss() const {
  double sum = 0.0;
  for (const nn::MoE* moe : moe_layers_) sum += moe->last_aux_loss();
  return sum;
}

nn::MoE::Stats Transformer::TakeMoeStats() {
  nn::MoE::Stats sum;
  sum.tokens.assign(config_.moe.num_experts, 0);
  for (nn::MoE* moe : moe_layers_) {
    const nn::MoE::Stats s = moe->TakeStats();
    for (size_t e = 0; e < s.tokens.size(); ++e) sum.tokens[e] += s.tokens[e];
    sum.aux_loss_sum += s.aux_loss_sum;
    sum.backwards = s.backwards;
  }
  return sum;
}

void Transformer::SetAuxLossScale(float scale) {
  for (nn::MoE* moe : moe_layers_) moe->set_aux_loss_scale(scale);
}

absl::StatusOr<Tensor> Transformer::Logits(const Tensor& ids) {
  FSDPP_ASSIGN_OR_RETURN(Tensor logits, Forward(ids));
  ReleaseSavedTensors();
  return logits;
}

absl::StatusOr<float> Transformer::EvalLoss(const Tensor& ids,
                                            const Tensor& targets) {
  FSDPP_RETURN_IF_ERROR(CheckTargets(ids, targets, options_.head, "EvalLoss"));
  FSDPP_ASSIGN_OR_RETURN(const Tensor local, LocalColumns(targets));
  FSDPP_ASSIGN_OR_RETURN(Tensor logits, Logits(ids));
  std::unique_ptr<nn::LossFunction> loss = loss_->Clone();
  return loss->Forward(logits, local);
}

}  // namespace models
}  // namespace fsdpp
