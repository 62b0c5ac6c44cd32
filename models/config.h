// Transformer shapes for the model zoo (GPT-2 and Llama families), their
// parameter counts and their training FLOPs per token.
//
// One plain struct describes every model; the family picks the layer kinds
// and parameter names (GPT-2: LayerNorm, learned positions, "h.{i}"; Llama:
// RmsNorm, RoPE, "layers.{i}"), the other fields pick sizes and options, so a
// new model is a new named config rather than new code. NumParameters and
// FlopsPerToken are analytic (no model is built) and are tested against the
// parameter count of the built model, so planners and MFU figures can use
// them for models too large to materialise.
#ifndef FSDPP_MODELS_CONFIG_H_
#define FSDPP_MODELS_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/kernels/rope.h"

namespace fsdpp {
namespace models {

// Which layer kinds and parameter names a Transformer uses.
enum class ModelFamily {
  kGpt2,   // LayerNorm, learned position embeddings, fused c_attn.
  kLlama,  // RmsNorm, rotary embeddings, separate wq/wk/wv/wo.
};

// The feed-forward block.
enum class Activation {
  kGelu,    // nn::Mlp: fc -> GELU (tanh) -> proj, both with biases.
  kSwiGlu,  // nn::SwiGlu: down(silu(gate(x)) * up(x)), no biases.
};

// Mixture-of-experts feed-forward blocks (nn::MoE) in place of the SwiGLU
// of the layers from first_layer on (DeepSeek's first_k_dense_replace: the
// ones before keep a dense SwiGLU of ffn_hidden). Llama family only.
struct MoeConfig {
  int64_t num_experts = 0;    // 0: a dense model
  int64_t top_k = 0;          // experts per token
  int64_t hidden = 0;         // each expert's SwiGLU width
  int64_t shared_hidden = 0;  // the shared experts' SwiGLU width (0: none)
  int64_t first_layer = 0;    // layers before it stay dense
  bool sigmoid = false;       // router scores: softmax (false) or sigmoid
  bool normalize_top_k = true;
  float route_scale = 1.0f;
  float aux_loss_coef = 0.0f;  // load balancing (softmax only)
  // Aux-loss-free balancing's selection bias (DeepSeek-V3), and the rate the
  // training step moves it by after each step, by the experts' loads over
  // every data-parallel rank (nn::MoE::ExpertBiasUpdate; 0: kept as
  // initialised or loaded; DeepSeek-V3 and torchtitan use 1e-3).
  bool expert_bias = false;
  float bias_update_rate = 0.0f;

  bool enabled() const { return num_experts > 0; }
};

// "gpt2" / "llama".
const char* ModelFamilyName(ModelFamily family);
// "gelu" / "swiglu".
const char* ActivationName(Activation activation);

// Shape and options of a decoder-only transformer.
struct TransformerConfig {
  std::string name;  // The ConfigByName key ("" for hand-made configs).
  ModelFamily family = ModelFamily::kGpt2;
  int64_t vocab_size = 0;  // Tokens the tokenizer produces.
  // The embedding table and LM head get padded_vocab_size() rows: vocab_size
  // rounded up to a multiple of this (1 = no padding; GPT-2 124M with 64 gives
  // 50304, as in nanoGPT). Padded logits take part in the softmax (they are
  // never targets, so training pushes them down), as in nanoGPT.
  int64_t vocab_pad_multiple = 1;
  int64_t context_length = 0;  // Longest sequence (GPT-2: wpe rows).
  int64_t dim = 0;             // Model width C.
  int64_t n_layers = 0;
  int64_t n_heads = 0;     // Query heads; head_dim = dim / n_heads.
  int64_t n_kv_heads = 0;  // Key/value heads (GQA); 0 means n_heads.
  int64_t ffn_hidden = 0;  // Hidden width of the feed-forward block.
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;  // Llama family only.
  // Llama family: Llama 3.1/3.2's RoPE frequency scaling (HF rope_scaling,
  // rope_type "llama3"); disabled by default.
  kernels::RopeScaling rope_scaling;
  // Llama family: when k > 0, layers k-1, 2k-1, ... (every k-th, 1-based)
  // use no rotary embedding (SmolLM3's NoPE layers, k = 4).
  int64_t no_rope_every = 0;
  bool tied_embeddings = true;  // LM head shares the token embedding table.
  // Llama family: OLMo-2 / OLMoE's q and k norms, RMSNorm (norm_eps) over
  // each token's whole q and k projections before RoPE
  // (nn::AttentionConfig::qk_norm).
  bool qk_norm = false;
  // Biases on the attention projections (q, k, v and output) and, in the
  // GPT-2 family, on the LayerNorms. The GELU MLP always has biases
  // (nn::Mlp has no switch), so kGelu requires bias = true; SwiGLU never has.
  bool bias = true;
  Activation activation = Activation::kGelu;
  float init_std = 0.02f;  // Std of the weight initialisation.
  MoeConfig moe;           // Mixture of experts (off by default).

  // vocab_size rounded up to a multiple of vocab_pad_multiple.
  int64_t padded_vocab_size() const;
  // n_kv_heads, or n_heads when it is 0.
  int64_t kv_heads() const { return n_kv_heads == 0 ? n_heads : n_kv_heads; }
  int64_t head_dim() const { return n_heads == 0 ? 0 : dim / n_heads; }
  // Whether layer `layer` (0-based) applies rotary embeddings.
  bool UsesRope(int64_t layer) const;
  // Whether layer `layer` (0-based) has a mixture of experts.
  bool UsesMoe(int64_t layer) const {
    return moe.enabled() && layer >= moe.first_layer;
  }
};

// OK when `config` describes a buildable model: positive sizes, n_heads
// dividing dim, n_kv_heads dividing n_heads, even head_dim for RoPE,
// vocab_pad_multiple >= 1, bias = true with kGelu, and a mixture of experts
// only in the Llama family with 1 <= top_k <= num_experts, hidden > 0,
// shared_hidden >= 0, 0 <= first_layer <= n_layers, route_scale > 0 and an
// aux loss only with softmax scores. InvalidArgument naming the config and
// the problem otherwise.
absl::Status ValidateConfig(const TransformerConfig& config);

// The checkpoint key (a byte value) under which the trainer keeps
// ModelConfigJson of the run's model.
inline constexpr char kModelConfigKey[] = "train/model";

// Every field of `config` as one JSON object (what a checkpoint keeps so that
// tools can rebuild the model without the run's config file).
std::string ModelConfigJson(const TransformerConfig& config);

// The config ModelConfigJson wrote, validated (ValidateConfig).
// InvalidArgument naming `where` and the field that is missing or malformed.
absl::StatusOr<TransformerConfig> ParseModelConfigJson(
    absl::string_view json, const std::string& where);

// The names ConfigByName accepts, in a stable order.
std::vector<std::string> ConfigNames();

// A named config:
//   gpt2_debug   2 layers, dim 64, 4 heads, vocab 512, ctx 128
//   gpt2_124m    12 / 768 / 12 heads, vocab 50257, ctx 1024
//   gpt2_350m    24 / 1024 / 16       (GPT-2 medium)
//   gpt2_774m    36 / 1280 / 20       (GPT-2 large)
//   gpt2_1558m   48 / 1600 / 25       (GPT-2 XL)
//   llama_debug  2 layers, dim 64, 4 heads, 2 kv heads, ffn 192, vocab 512,
//                ctx 128, tied
//   llama_1b     Llama-3.2-1B: 16 / 2048 / 32 heads, 8 kv, ffn 8192,
//                vocab 128256, tied, theta 500000, ctx 131072, "llama3"
//                RoPE scaling (factor 32, low 1, high 4, original 8192)
//   smollm3_3b   SmolLM3-3B: 36 / 2048 / 16 heads, 4 kv, ffn 11008,
//                vocab 128256, tied, theta 5e6, ctx 65536, no RoPE in
//                every 4th layer
//   llama3_8b    Llama-3-8B: 32 / 4096 / 32 heads, 8 kv, ffn 14336,
//                vocab 128256, untied, theta 500000, ctx 8192
//   llama3_70b   Llama-3-70B: 80 / 8192 / 64 heads, 8 kv, ffn 28672,
//                vocab 128256, untied, theta 500000, ctx 8192 (for the
//                planner; training it needs far more than one machine)
//   moe_debug    llama_debug with a mixture of 8 experts of width 96, top-2
//                (as many active feed-forward weights as llama_debug's
//                SwiGLU of 192), softmax router, aux loss 0.01
//   olmoe_1b_7b  OLMoE-1B-7B: 16 / 2048 / 16 heads, 64 experts of width
//                1024, top-8 unnormalised, aux loss 0.01, vocab 50304,
//                untied, theta 10000, ctx 4096 (6.9B parameters, 1.3B
//                active; without OLMoE's q / k norms)
// GPT-2 configs have ffn 4 dim, eps 1e-5, biases and no vocab padding (set
// vocab_pad_multiple = 64 for 50304). Llama configs have no biases and
// RmsNorm eps 1e-5 (SmolLM3: 1e-6). Of the RoPE scalings only "llama3" is
// modelled (Llama-3-8B and SmolLM3-3B use none). NotFound listing the known
// names for anything else.
absl::StatusOr<TransformerConfig> ConfigByName(const std::string& name);

// Parameters of the model Transformer builds from `config` (each tied
// parameter once), computed from the shapes alone.
int64_t NumParameters(const TransformerConfig& config);
// Of those, the ones a token uses: with a mixture of experts, the router,
// top_k experts and the shared ones of each such layer (and all the rest);
// NumParameters for a dense model.
int64_t NumActiveParameters(const TransformerConfig& config);

// Training FLOPs per token at sequence length `seq_len` (forward + backward,
// 2 FLOPs per multiply-add, backward = 2 x forward):
//
//   6 * N_matmul + 12 * n_layers * seq_len * (n_heads * head_dim)
//
// N_matmul counts the weights that take part in matmuls: per layer the q, k,
// v and output projections (GQA-aware: k and v are kv_heads * head_dim wide)
// and the MLP (2 matrices for GELU, 3 for SwiGLU; a mixture of experts'
// router, top_k experts and shared experts), plus the LM head
// (padded_vocab_size x dim, counted even when tied to the embedding). It
// leaves out embedding lookups, position embeddings, norms and biases. The
// second term is the attention core (Q K^T and P V: 2 matmuls x 2 FLOPs x 3
// for training, per head dim, per key position), counted for the full
// T x T score matrix as in PaLM and nanoGPT, although causality would skip
// half of it.
double FlopsPerToken(const TransformerConfig& config, int64_t seq_len);

// The formula of the FSDP2 SmolLM3 write-up (get_model_flops_per_token), for
// comparison: 6 x (qkv + scores + output + out-proj + 3 x mlp) x n_layers
// with qkv = dim x 3 n_heads head_dim (GQA ignored), scores = output =
// n_heads x seq_len x head_dim, out-proj = n_heads head_dim x dim and
// mlp = dim x ffn_hidden (three matrices, whatever the activation). It leaves
// out the LM head and overcounts k and v under GQA.
double FlopsPerTokenSeedFormula(const TransformerConfig& config,
                                int64_t seq_len);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_CONFIG_H_
