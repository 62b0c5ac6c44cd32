// Causal self-attention forward and backward; see attention.h.
//
// Heads are moved between the projections' [B, T, heads, hd] layout and the
// attention core's [B, heads, T, hd] layout by the SplitHeads / MergeHeads
// ops (tensor/ops.h, one pass each). RoPE is the Rope op
// (tensor/ops.h), in place on the tensor's own device.
#include "nn/attention.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/kernels/rope.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {
namespace {

thread_local const DocumentMasks* active_documents = nullptr;
thread_local ContextParallelCore* active_context_parallel = nullptr;

// Rotates every [hd] row of t [B, n, T, hd] in place (position = t, or
// `positions` [B, T] when defined), or applies the inverse rotation with
// `backward`.
absl::Status ApplyRope(Tensor* t, const std::vector<float>& inv_freq,
                       bool backward, const Tensor& positions) {
  if (t->is_meta() || t->numel() == 0) return absl::OkStatus();
  return Rope(t, inv_freq, backward,
              positions.defined() ? &positions : nullptr);
}

// Null for an undefined tensor.
const Tensor* OrNull(const Tensor& t) { return t.defined() ? &t : nullptr; }

}  // namespace

const DocumentMasks* DocumentMasks::Active() { return active_documents; }

DocumentMasks::Scope::Scope(const DocumentMasks* masks)
    : previous_(active_documents) {
  active_documents = masks;
}

DocumentMasks::Scope::~Scope() { active_documents = previous_; }

ContextParallelCore* ContextParallelCore::Active() {
  return active_context_parallel;
}

ContextParallelCore::Scope::Scope(ContextParallelCore* core)
    : previous_(active_context_parallel) {
  active_context_parallel = core;
}

ContextParallelCore::Scope::~Scope() { active_context_parallel = previous_; }

int64_t ContextParallel::local() const {
  int64_t total = 0;
  for (const Run& run : runs()) total += run.length;
  return total;
}

absl::Status ContextParallel::CheckWhole(const Tensor& whole) const {
  if (!whole.defined() || whole.ndim() != 2 || whole.dim(1) != seq_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("context parallelism takes whole rows [B, ", seq_len(),
                     "] of ids and targets, got ", whole.ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> ContextParallel::Local(const Tensor& whole) const {
  FSDPP_RETURN_IF_ERROR(CheckWhole(whole));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor out, Tensor::Empty({whole.dim(0), local()}, whole.dtype(),
                                whole.device(), MemoryTag::kActivations));
  int64_t at = 0;
  for (const Run& run : runs()) {
    FSDPP_RETURN_IF_ERROR(CopyColumns(whole, run.start, run.length, &out, at));
    at += run.length;
  }
  // Ids checked on the host stay checked (no copy back from a GPU to count
  // or bound them).
  if (whole.ids_checked_below() > 0) {
    out.MarkIdsCheckedBelow(whole.ids_checked_below());
  }
  return out;
}

AttentionConfig AttentionConfig::Gpt2(int64_t dim, int64_t n_heads,
                                      int64_t max_seq_len) {
  AttentionConfig c;
  c.dim = dim;
  c.n_heads = n_heads;
  c.n_kv_heads = n_heads;
  c.max_seq_len = max_seq_len;
  c.fused_qkv = true;
  c.qkv_bias = true;
  c.out_bias = true;
  c.rope = false;
  return c;
}

AttentionConfig AttentionConfig::Llama(int64_t dim, int64_t n_heads,
                                       int64_t n_kv_heads, int64_t max_seq_len,
                                       float rope_theta) {
  AttentionConfig c;
  c.dim = dim;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.max_seq_len = max_seq_len;
  c.fused_qkv = false;
  c.qkv_bias = false;
  c.out_bias = false;
  c.rope = true;
  c.rope_theta = rope_theta;
  return c;
}

absl::StatusOr<std::unique_ptr<CausalSelfAttention>>
CausalSelfAttention::Create(const AttentionConfig& config) {
  const auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CausalSelfAttention: ", why, " (dim ", config.dim, ", n_heads ",
        config.n_heads, ", n_kv_heads ", config.n_kv_heads, ", max_seq_len ",
        config.max_seq_len, ")"));
  };
  if (config.dim <= 0 || config.n_heads <= 0 || config.n_kv_heads < 0 ||
      config.max_seq_len <= 0) {
    return invalid("sizes must be positive");
  }
  if (config.dim % config.n_heads != 0) {
    return invalid("n_heads must divide dim");
  }
  if (config.n_heads % config.kv_heads() != 0) {
    return invalid("n_kv_heads must divide n_heads");
  }
  if (config.qk_norm && config.fused_qkv) {
    return invalid("qk_norm needs separate q, k, v projections");
  }
  if (config.qk_norm && !(config.qk_norm_eps > 0.0f)) {
    return invalid("qk_norm_eps must be positive");
  }
  if (config.rope && config.head_dim() % 2 != 0) {
    return invalid("RoPE needs an even head_dim");
  }
  if (config.rope && !(config.rope_theta > 0.0f)) {
    return invalid("rope_theta must be positive");
  }
  if (const char* problem = kernels::RopeScalingProblem(config.rope_scaling);
      config.rope && problem != nullptr) {
    return invalid(problem);
  }
  if (!IsFloatingPoint(config.param_dtype)) {
    return invalid(absl::StrCat("param_dtype ", DTypeName(config.param_dtype),
                                " is not a float dtype"));
  }
  return absl::WrapUnique(new CausalSelfAttention(config));
}

CausalSelfAttention::CausalSelfAttention(const AttentionConfig& config)
    : Module("CausalSelfAttention"), config_(config) {
  const int64_t c = config.dim, hd = config.head_dim();
  if (config.rope) {
    rope_inv_freq_ =
        kernels::RopeInvFreqs(config.rope_theta, hd, config.rope_scaling);
  }
  const int64_t q_width = config.n_heads * hd,
                kv_width = config.kv_heads() * hd;
  const DType dtype = config.param_dtype;
  if (config.fused_qkv) {
    qkv_ = AddModule("c_attn", std::make_unique<Linear>(
                                   c, q_width + 2 * kv_width, config.qkv_bias,
                                   config.init_std, dtype));
    out_ = AddModule("c_proj",
                     std::make_unique<Linear>(q_width, c, config.out_bias,
                                              config.out_init_std, dtype));
  } else {
    q_ = AddModule("wq", std::make_unique<Linear>(c, q_width, config.qkv_bias,
                                                  config.init_std, dtype));
    k_ = AddModule("wk", std::make_unique<Linear>(c, kv_width, config.qkv_bias,
                                                  config.init_std, dtype));
    v_ = AddModule("wv", std::make_unique<Linear>(c, kv_width, config.qkv_bias,
                                                  config.init_std, dtype));
    out_ =
        AddModule("wo", std::make_unique<Linear>(q_width, c, config.out_bias,
                                                 config.out_init_std, dtype));
    if (config.qk_norm) {
      q_norm_ = AddModule("q_norm", std::make_unique<RmsNorm>(
                                        q_width, config.qk_norm_eps, dtype));
      k_norm_ = AddModule("k_norm", std::make_unique<RmsNorm>(
                                        kv_width, config.qk_norm_eps, dtype));
    }
  }
}

absl::StatusOr<CausalSelfAttention::LocalHeads>
CausalSelfAttention::ComputeLocalHeads() const {
  const int64_t h = config_.n_heads, kv = config_.kv_heads(),
                hd = config_.head_dim();
  LocalHeads l;
  const auto invalid = [&](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the projections' pieces do not split whole heads (", why, "; n_heads ",
        h, ", n_kv_heads ", kv, ", head_dim ", hd, ")"));
  };
  if (qkv_ != nullptr) {
    const int64_t width = qkv_->local_out_features(), units = width / hd;
    if (width % hd != 0 || units * h % (h + 2 * kv) != 0 ||
        units * kv % (h + 2 * kv) != 0) {
      return invalid(absl::StrCat("c_attn computes ", width, " features"));
    }
    l.h = units * h / (h + 2 * kv);
    l.kv = l.kv_proj = units * kv / (h + 2 * kv);
  } else {
    const int64_t q_width = q_->local_out_features(),
                  kv_width = k_->local_out_features();
    if (q_width % hd != 0 || kv_width % hd != 0 ||
        v_->local_out_features() != kv_width) {
      return invalid(absl::StrCat("q computes ", q_width, " features, k ",
                                  kv_width, ", v ", v_->local_out_features()));
    }
    l.h = q_width / hd;
    l.kv = l.kv_proj = kv_width / hd;
    // Fewer kv heads than ranks: every rank projects all of them and uses
    // the one its query heads share.
    if (!k_->weight()->has_piece() && l.h < h) {
      const int64_t group = h / kv;
      const int64_t first_q =
          q_->weight()->has_piece() ? q_->weight()->piece.offset[0] / hd : 0;
      l.kv_first = first_q / group;
      l.kv = (first_q + l.h - 1) / group - l.kv_first + 1;
    }
  }
  if (l.h == 0 || l.kv == 0 || l.h % l.kv != 0) {
    return invalid(absl::StrCat(l.h, " query heads over ", l.kv, " kv heads"));
  }
  return l;
}

absl::StatusOr<Tensor> CausalSelfAttention::ForwardImpl(const Tensor& x) {
  const int64_t c = config_.dim, hd = config_.head_dim();
  if (x.ndim() != 3 || x.dim(2) != c || x.dim(0) < 1 || x.dim(1) < 1 ||
      x.dim(1) > config_.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("x ", x.ToString(), " must be [B, T, ", c,
                     "] with 1 <= T <= ", config_.max_seq_len));
  }
  if (!IsFloatingPoint(x.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("x ", x.ToString(), " must be f32, bf16 or f16"));
  }
  FSDPP_ASSIGN_OR_RETURN(heads_, ComputeLocalHeads());
  const int64_t h = heads_.h, kv = heads_.kv;
  const int64_t b = x.dim(0), t = x.dim(1);
  const DType dtype = x.dtype();
  const Device device = x.device();

  // Projections, then heads to [B, heads, T, hd].
  FSDPP_ASSIGN_OR_RETURN(Tensor q,
                         EmptyActivation({b, h, t, hd}, dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor k,
                         EmptyActivation({b, kv, t, hd}, dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor v,
                         EmptyActivation({b, kv, t, hd}, dtype, device));
  if (qkv_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(Tensor qkv, qkv_->Forward(x));
    FSDPP_ASSIGN_OR_RETURN(Tensor qkv4, qkv.Reshape({b, t, h + 2 * kv, hd}));
    FSDPP_RETURN_IF_ERROR(SplitHeads(qkv4, 0, &q));
    FSDPP_RETURN_IF_ERROR(SplitHeads(qkv4, h, &k));
    FSDPP_RETURN_IF_ERROR(SplitHeads(qkv4, h + kv, &v));
  } else {
    const int64_t kv_proj = heads_.kv_proj;
    FSDPP_ASSIGN_OR_RETURN(Tensor q_flat, q_->Forward(x));
    FSDPP_ASSIGN_OR_RETURN(Tensor k_flat, k_->Forward(x));
    if (q_norm_ != nullptr) {
      if (q_flat.dim(-1) != q_norm_->dim() ||
          k_flat.dim(-1) != k_norm_->dim()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "CausalSelfAttention: qk_norm normalises whole projections (",
            q_norm_->dim(), " and ", k_norm_->dim(),
            " features); the projections here compute ", q_flat.dim(-1),
            " and ", k_flat.dim(-1),
            " (tensor parallelism does not split "
            "them)"));
      }
      FSDPP_ASSIGN_OR_RETURN(q_flat, q_norm_->Forward(q_flat));
      FSDPP_ASSIGN_OR_RETURN(k_flat, k_norm_->Forward(k_flat));
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor v_flat, v_->Forward(x));
    FSDPP_ASSIGN_OR_RETURN(Tensor q4, q_flat.Reshape({b, t, h, hd}));
    FSDPP_ASSIGN_OR_RETURN(Tensor k4, k_flat.Reshape({b, t, kv_proj, hd}));
    FSDPP_ASSIGN_OR_RETURN(Tensor v4, v_flat.Reshape({b, t, kv_proj, hd}));
    FSDPP_RETURN_IF_ERROR(SplitHeads(q4, 0, &q));
    FSDPP_RETURN_IF_ERROR(SplitHeads(k4, heads_.kv_first, &k));
    FSDPP_RETURN_IF_ERROR(SplitHeads(v4, heads_.kv_first, &v));
  }
  key_start_ = positions_ = Tensor();
  if (const DocumentMasks* docs = DocumentMasks::Active(); docs != nullptr) {
    if (!config_.fused_attention) {
      return absl::UnimplementedError(
          "CausalSelfAttention: document masking needs the fused attention "
          "(fused_attention = true)");
    }
    const Shape bt = {b, t};
    if (docs->key_start.shape() != bt || docs->positions.shape() != bt) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CausalSelfAttention: document masks ", docs->key_start.ToString(),
          " / ", docs->positions.ToString(),
          " must be [B, T] = ", ShapeToString(bt), " like the input"));
    }
    key_start_ = docs->key_start;
    positions_ = docs->positions;
  }
  ContextParallelCore* core = ContextParallelCore::Active();
  context_parallel_ = core != nullptr;
  if (core != nullptr) {
    if (!config_.fused_attention || key_start_.defined()) {
      return absl::UnimplementedError(
          "CausalSelfAttention: context parallelism needs the fused attention "
          "and takes document masks through its core, not DocumentMasks");
    }
    positions_ = core->positions();
    if (positions_.shape() != Shape{b, t}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CausalSelfAttention: the context-parallel positions ",
          positions_.ToString(), " must be [B, T] = [", b, ", ", t, "]"));
    }
  }
  if (config_.rope) {
    FSDPP_RETURN_IF_ERROR(
        ApplyRope(&q, rope_inv_freq_, /*backward=*/false, positions_));
    FSDPP_RETURN_IF_ERROR(
        ApplyRope(&k, rope_inv_freq_, /*backward=*/false, positions_));
  }
  q_heads_ = std::move(q);
  k_heads_ = std::move(k);
  v_heads_ = std::move(v);
  batch_ = b;
  seq_len_ = t;

  // The attention core, then heads merged back to [B, T, H hd] and the
  // output projection.
  FSDPP_ASSIGN_OR_RETURN(Tensor heads_out, config_.fused_attention
                                               ? AttendFused()
                                               : AttendUnfused());
  FSDPP_ASSIGN_OR_RETURN(Tensor merged,
                         EmptyActivation({b, t, h * hd}, dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor merged4, merged.Reshape({b, t, h, hd}));
  FSDPP_RETURN_IF_ERROR(MergeHeads(heads_out, 0, &merged4));
  FSDPP_ASSIGN_OR_RETURN(Tensor y, out_->Forward(merged));
  out_shape_ = y.shape();
  return y;
}

absl::StatusOr<Tensor> CausalSelfAttention::AttendFused() {
  const int64_t b = batch_, h = heads_.h, t = seq_len_, hd = config_.head_dim();
  const Device device = q_heads_.device();
  SelectiveRecompute* selective = SelectiveRecompute::Active();
  if (selective != nullptr && selective->replaying()) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<Tensor> out, selective->Replay(this));
    heads_out_ = out[0];
    lse_ = out[1];
    return heads_out_;
  }
  FSDPP_ASSIGN_OR_RETURN(heads_out_,
                         Tensor::Empty({b, h, t, hd}, q_heads_.dtype(), device,
                                       MemoryTag::kAttention));
  FSDPP_ASSIGN_OR_RETURN(lse_, Tensor::Empty({b, h, t}, DType::kF32, device,
                                             MemoryTag::kAttention));
  if (context_parallel_) {
    ContextParallelCore* core = ContextParallelCore::Active();
    if (core == nullptr) {
      return absl::FailedPreconditionError(
          "CausalSelfAttention: no context-parallel core installed");
    }
    FSDPP_RETURN_IF_ERROR(core->Forward(q_heads_, k_heads_, v_heads_, Scale(),
                                        &heads_out_, &lse_));
  } else {
    FSDPP_RETURN_IF_ERROR(CausalAttention(q_heads_, k_heads_, v_heads_, Scale(),
                                          &heads_out_, &lse_,
                                          KeyRange{OrNull(key_start_)}));
  }
  if (selective != nullptr) selective->Record(this, {heads_out_, lse_});
  return heads_out_;
}

absl::StatusOr<Tensor> CausalSelfAttention::AttendUnfused() {
  const int64_t b = batch_, h = heads_.h, kv = heads_.kv, t = seq_len_,
                hd = config_.head_dim(), rep = h / kv;
  const DType dtype = q_heads_.dtype();
  const Device device = q_heads_.device();
  const auto empty = [&](Shape shape, DType d) {
    return Tensor::Empty(std::move(shape), d, device, MemoryTag::kAttention);
  };
  // Scores and probabilities, grouped per kv head: [B, KV, rep T, T].
  FSDPP_ASSIGN_OR_RETURN(Tensor q_grouped,
                         q_heads_.Reshape({b, kv, rep * t, hd}));
  FSDPP_ASSIGN_OR_RETURN(Tensor scores, empty({b, h, t, t}, DType::kF32));
  FSDPP_ASSIGN_OR_RETURN(Tensor scores_grouped,
                         scores.Reshape({b, kv, rep * t, t}));
  MatmulOptions qkt;
  qkt.transpose_b = true;
  qkt.alpha = Scale();
  FSDPP_RETURN_IF_ERROR(Matmul(q_grouped, k_heads_, &scores_grouped, qkt));
  // f32 probabilities are saved as they are; bf16 ones get a saved copy.
  FSDPP_ASSIGN_OR_RETURN(Tensor probs32, empty({b, h, t, t}, DType::kF32));
  FSDPP_RETURN_IF_ERROR(Softmax(scores, &probs32, /*causal=*/true));
  scores = scores_grouped = Tensor();
  probs_ = probs32;
  if (dtype != DType::kF32) {
    FSDPP_ASSIGN_OR_RETURN(probs_, empty({b, h, t, t}, dtype));
    FSDPP_RETURN_IF_ERROR(Copy(probs32, &probs_));
  }
  probs32 = Tensor();

  // out = P V.
  FSDPP_ASSIGN_OR_RETURN(Tensor probs_grouped,
                         probs_.Reshape({b, kv, rep * t, t}));
  FSDPP_ASSIGN_OR_RETURN(Tensor heads_out,
                         EmptyTemporary({b, h, t, hd}, dtype, device));
  FSDPP_ASSIGN_OR_RETURN(Tensor heads_out_grouped,
                         heads_out.Reshape({b, kv, rep * t, hd}));
  FSDPP_RETURN_IF_ERROR(Matmul(probs_grouped, v_heads_, &heads_out_grouped));
  return heads_out;
}

float CausalSelfAttention::Scale() const {
  return 1.0f / std::sqrt(static_cast<float>(config_.head_dim()));
}

absl::StatusOr<Tensor> CausalSelfAttention::BackwardImpl(const Tensor& dy) {
  if (!q_heads_.defined()) return NoSavedForward(kind());
  const int64_t h = heads_.h, kv = heads_.kv, hd = config_.head_dim(),
                b = batch_, t = seq_len_;
  if (dy.shape() != out_shape_) {
    return absl::InvalidArgumentError(
        absl::StrCat("dy ", dy.ToString(), " must be ",
                     ShapeToString(out_shape_), " like the forward output"));
  }
  const DType dtype = q_heads_.dtype();
  const Device device = q_heads_.device();
  const auto empty = [&](Shape shape, DType d) {
    return EmptyTemporary(std::move(shape), d, device);
  };

  // Through the output projection and the head merge.
  FSDPP_ASSIGN_OR_RETURN(Tensor dmerged, out_->Backward(dy));
  FSDPP_ASSIGN_OR_RETURN(Tensor dmerged4, dmerged.Reshape({b, t, h, hd}));
  FSDPP_ASSIGN_OR_RETURN(Tensor dout, empty({b, h, t, hd}, dtype));
  FSDPP_RETURN_IF_ERROR(SplitHeads(dmerged4, 0, &dout));
  dmerged = dmerged4 = Tensor();

  // Through the attention core.
  FSDPP_ASSIGN_OR_RETURN(Tensor dq, empty({b, h, t, hd}, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor dk, empty({b, kv, t, hd}, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor dv, empty({b, kv, t, hd}, dtype));
  if (context_parallel_) {
    // The batch's core, installed over the backward as over the forward.
    ContextParallelCore* core = ContextParallelCore::Active();
    if (core == nullptr) {
      return absl::FailedPreconditionError(
          "CausalSelfAttention: the forward ran under a context-parallel "
          "core, the backward has none installed");
    }
    FSDPP_RETURN_IF_ERROR(core->Backward(q_heads_, k_heads_, v_heads_,
                                         heads_out_, lse_, dout, Scale(), &dq,
                                         &dk, &dv));
  } else if (config_.fused_attention) {
    FSDPP_RETURN_IF_ERROR(CausalAttentionBackward(
        q_heads_, k_heads_, v_heads_, heads_out_, lse_, dout, Scale(), &dq, &dk,
        &dv, KeyRange{OrNull(key_start_)}));
  } else {
    FSDPP_RETURN_IF_ERROR(UnfusedBackward(dout, &dq, &dk, &dv));
  }
  dout = Tensor();
  const Tensor positions = positions_;  // shared, outlives the release
  ReleaseOwnSavedTensors();

  if (config_.rope) {
    FSDPP_RETURN_IF_ERROR(
        ApplyRope(&dq, rope_inv_freq_, /*backward=*/true, positions));
    FSDPP_RETURN_IF_ERROR(
        ApplyRope(&dk, rope_inv_freq_, /*backward=*/true, positions));
  }

  // Heads back to the projections' layout, then through the projections
  // (children's backward in reverse registration order).
  if (qkv_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(Tensor dqkv,
                           empty({b, t, (h + 2 * kv) * hd}, dtype));
    FSDPP_ASSIGN_OR_RETURN(Tensor dqkv4, dqkv.Reshape({b, t, h + 2 * kv, hd}));
    FSDPP_RETURN_IF_ERROR(MergeHeads(dq, 0, &dqkv4));
    FSDPP_RETURN_IF_ERROR(MergeHeads(dk, h, &dqkv4));
    FSDPP_RETURN_IF_ERROR(MergeHeads(dv, h + kv, &dqkv4));
    return qkv_->Backward(dqkv);
  }
  // Into [B, T, n hd] at head `first` (zeros for the other heads).
  const auto merged = [&](const Tensor& heads, int64_t n,
                          int64_t first) -> absl::StatusOr<Tensor> {
    Tensor flat;
    if (n == heads.dim(1)) {
      FSDPP_ASSIGN_OR_RETURN(flat, empty({b, t, n * hd}, dtype));
    } else {
      FSDPP_ASSIGN_OR_RETURN(flat, Tensor::Zeros({b, t, n * hd}, dtype, device,
                                                 MemoryTag::kOther));
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor flat4, flat.Reshape({b, t, n, hd}));
    FSDPP_RETURN_IF_ERROR(MergeHeads(heads, first, &flat4));
    return flat;
  };
  FSDPP_ASSIGN_OR_RETURN(Tensor dv_flat,
                         merged(dv, heads_.kv_proj, heads_.kv_first));
  FSDPP_ASSIGN_OR_RETURN(Tensor dx, v_->Backward(dv_flat));
  FSDPP_ASSIGN_OR_RETURN(Tensor dk_flat,
                         merged(dk, heads_.kv_proj, heads_.kv_first));
  if (k_norm_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(dk_flat, k_norm_->Backward(dk_flat));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_k, k_->Backward(dk_flat));
  FSDPP_RETURN_IF_ERROR(Add(dx, dx_k, &dx));
  FSDPP_ASSIGN_OR_RETURN(Tensor dq_flat, merged(dq, h, 0));
  if (q_norm_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(dq_flat, q_norm_->Backward(dq_flat));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_q, q_->Backward(dq_flat));
  FSDPP_RETURN_IF_ERROR(Add(dx, dx_q, &dx));
  return dx;
}

absl::Status CausalSelfAttention::UnfusedBackward(const Tensor& dout,
                                                  Tensor* dq, Tensor* dk,
                                                  Tensor* dv) {
  const int64_t h = heads_.h, kv = heads_.kv, hd = config_.head_dim(),
                rep = h / kv, b = batch_, t = seq_len_;
  const DType dtype = q_heads_.dtype();
  const Device device = q_heads_.device();
  const auto empty = [&](Shape shape, DType d) {
    return Tensor::Empty(std::move(shape), d, device, MemoryTag::kAttention);
  };
  FSDPP_ASSIGN_OR_RETURN(Tensor dout_grouped,
                         dout.Reshape({b, kv, rep * t, hd}));
  FSDPP_ASSIGN_OR_RETURN(Tensor probs_grouped,
                         probs_.Reshape({b, kv, rep * t, t}));

  // out = P V: dP = dout V^T, dV = P^T dout (sums the heads sharing a kv head).
  FSDPP_ASSIGN_OR_RETURN(Tensor dprobs, empty({b, h, t, t}, DType::kF32));
  FSDPP_ASSIGN_OR_RETURN(Tensor dprobs_grouped,
                         dprobs.Reshape({b, kv, rep * t, t}));
  MatmulOptions abt;
  abt.transpose_b = true;
  FSDPP_RETURN_IF_ERROR(Matmul(dout_grouped, v_heads_, &dprobs_grouped, abt));
  MatmulOptions atb;
  atb.transpose_a = true;
  FSDPP_RETURN_IF_ERROR(Matmul(probs_grouped, dout_grouped, dv, atb));

  // Softmax backward in f32 (masked entries have P = 0, so dS = 0 there).
  Tensor probs32 = probs_;
  if (dtype != DType::kF32) {
    FSDPP_ASSIGN_OR_RETURN(probs32, empty({b, h, t, t}, DType::kF32));
    FSDPP_RETURN_IF_ERROR(Copy(probs_, &probs32));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor dscores32, empty({b, h, t, t}, DType::kF32));
  FSDPP_RETURN_IF_ERROR(SoftmaxBackward(probs32, dprobs, &dscores32));
  probs32 = dprobs = dprobs_grouped = probs_grouped = Tensor();
  Tensor dscores = dscores32;
  if (dtype != DType::kF32) {
    FSDPP_ASSIGN_OR_RETURN(dscores, empty({b, h, t, t}, dtype));
    FSDPP_RETURN_IF_ERROR(Copy(dscores32, &dscores));
  }
  dscores32 = Tensor();
  FSDPP_ASSIGN_OR_RETURN(Tensor dscores_grouped,
                         dscores.Reshape({b, kv, rep * t, t}));

  // S = scale Q K^T: dQ = scale dS K, dK = scale dS^T Q.
  FSDPP_ASSIGN_OR_RETURN(Tensor dq_grouped, dq->Reshape({b, kv, rep * t, hd}));
  MatmulOptions ab_scaled;
  ab_scaled.alpha = Scale();
  FSDPP_RETURN_IF_ERROR(
      Matmul(dscores_grouped, k_heads_, &dq_grouped, ab_scaled));
  FSDPP_ASSIGN_OR_RETURN(Tensor q_grouped,
                         q_heads_.Reshape({b, kv, rep * t, hd}));
  MatmulOptions atb_scaled;
  atb_scaled.transpose_a = true;
  atb_scaled.alpha = Scale();
  return Matmul(dscores_grouped, q_grouped, dk, atb_scaled);
}

}  // namespace nn
}  // namespace fsdpp
