// Hugging Face interop for the model zoo: the mapping between our parameter
// names (models/transformer.h) and the names of the HF GPT-2 and Llama
// checkpoints, and safetensors export / import through it.
//
//   ours                           Hugging Face
//   wte.weight                     transformer.wte.weight
//   wpe.weight                     transformer.wpe.weight
//   h.{i}.ln_1.weight / .bias      transformer.h.{i}.ln_1.weight / .bias
//   h.{i}.attn.c_attn.weight  (T)  transformer.h.{i}.attn.c_attn.weight
//   h.{i}.attn.c_proj.weight  (T)  transformer.h.{i}.attn.c_proj.weight
//   h.{i}.ln_2.*                   transformer.h.{i}.ln_2.*
//   h.{i}.mlp.fc.weight       (T)  transformer.h.{i}.mlp.c_fc.weight
//   h.{i}.mlp.proj.weight     (T)  transformer.h.{i}.mlp.c_proj.weight
//   ln_f.*                         transformer.ln_f.*
//   tok_embeddings.weight          model.embed_tokens.weight
//   layers.{i}.attention_norm.weight  model.layers.{i}.input_layernorm.weight
//   layers.{i}.attention.wq/wk/wv/wo  model.layers.{i}.self_attn.q/k/v/o_proj
//   layers.{i}.ffn_norm.weight     model.layers.{i}.post_attention_layernorm
//   layers.{i}.feed_forward.gate/up/down  model.layers.{i}.mlp.gate/up/
//                                  down_proj
//   norm.weight                    model.norm.weight
//   output.weight / lm_head        lm_head.weight (untied models only)
// (biases follow their weights). Mixtures of experts are OLMoE's layout
// (model_type "olmoe": q / k norms, softmax top-k, no shared experts):
//   layers.{i}.attention.q_norm / k_norm  model.layers.{i}.self_attn.q_norm
//                                  / k_norm
//   layers.{i}.feed_forward.gate.weight   model.layers.{i}.mlp.gate.weight
//   layers.{i}.feed_forward.experts.gate_proj [E, H, C], slice e
//                                  model.layers.{i}.mlp.experts.{e}.gate_proj
//                                  .weight (up_proj, down_proj alike)
//
// Design choices:
//  * HF GPT-2 uses Conv1D layers whose weights are stored [in, out], the
//    transpose of our (and torch.nn.Linear's) [out, in]; the entries marked
//    (T) are transposed on export and import. Llama's q_proj / k_proj are
//    used as stored: HF permuted Meta's weights for its rotate_half RoPE,
//    which is the convention nn::CausalSelfAttention uses.
//  * Files hold the unpadded vocabulary (vocab_size rows, as HF expects);
//    import zeroes the padding rows of padded models.
//  * Tied models write no lm_head.weight (HF ties it on load). Import accepts
//    GPT-2 files whose names lack the "transformer." prefix (the hub's
//    model.safetensors), ignores lm_head.weight for tied models and GPT-2's
//    attention-mask buffers (".attn.bias", ".attn.masked_bias"), and rejects
//    every other unknown or missing tensor.
//  * Values are copied without rounding when dtypes agree and converted
//    (Copy) when the file's float dtype differs from the parameter's.
#ifndef FSDPP_MODELS_HF_ADAPTER_H_
#define FSDPP_MODELS_HF_ADAPTER_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/safetensors/safetensors.h"
#include "models/config.h"
#include "models/transformer.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {

// One parameter's names on both sides.
struct HfNameEntry {
  std::string ours;         // Our fully qualified parameter name.
  std::string hf;           // The Hugging Face tensor name.
  bool transpose = false;   // HF stores the 2-D weight transposed ([in, out]).
  bool vocab_rows = false;  // Dim 0 is the (padded) vocabulary.
  // >= 0: the HF tensor is slice `expert` of dim 0 of our stacked
  // parameter (an MoE's experts, one HF tensor each).
  int64_t expert = -1;
};

// The mapping for every parameter of the model built from `config`, in our
// parameter order (a stacked expert parameter: one entry per expert).
// Unimplemented for layouts HF's GPT-2 / Llama / OLMoE cannot hold (GPT-2
// family without GELU, biases or with GQA; Llama family without SwiGLU, q /
// k norms without experts; mixtures of experts unlike OLMoE's: without q /
// k norms, with sigmoid scores, an expert bias, shared experts, a route
// scale or dense layers first).
absl::StatusOr<std::vector<HfNameEntry>> HfNameMapping(
    const TransformerConfig& config);

// PEFT's name of a LoRA adapter's tensor (models/lora.h): our
// "<module>.lora_A.weight" (or lora_B) -> "base_model.model.<HF module>
// .lora_A.weight", the HF module being the one of the module's base weight
// in `mapping` (PEFT's adapters keep nn.Linear's [r, in] and [out, r] even
// on GPT-2's Conv1D, so the tensors are ours as they are). NotFound for a
// name that is not an adapter's or whose module has no HF name.
absl::StatusOr<std::string> PeftAdapterName(
    const std::vector<HfNameEntry>& mapping, const std::string& ours);
// The HF module of a PEFT adapter tensor's name
// ("base_model.model.<module>.lora_A.weight"), or "" for another name.
std::string PeftAdapterModule(const std::string& peft_name);

// The HF shape of the parameter `entry` names, whose shape is `ours`:
// vocabulary rows unpadded to `vocab`, Conv1D weights transposed, an
// expert's slice without the expert dim.
Shape HfShape(const HfNameEntry& entry, const Shape& ours, int64_t vocab);

// What ExportHfTensors reads from each parameter.
enum class HfExportSource { kValues, kGradients };

// Every parameter's value (or gradient) as a host tensor under its HF name,
// in HF layout: Conv1D weights transposed, vocabulary rows unpadded. The
// parameters (or gradients) must be materialised: FailedPrecondition naming
// the parameter otherwise.
absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> ExportHfTensors(
    const Transformer& model, HfExportSource source = HfExportSource::kValues);

// Writes ExportHfTensors(model) to `path` (safetensors, metadata
// {"format": "pt"}).
absl::Status ExportSafetensors(const Transformer& model,
                               const std::string& path);

// Where an import finds HF tensors by name: one safetensors file, or the
// shards of a model directory (models/hf_directory.h).
class HfTensorSource {
 public:
  virtual ~HfTensorSource() = default;
  // The file holding tensor `name`, or null when there is none.
  virtual const SafetensorsFile* Find(const std::string& name) const = 0;
  // Every tensor name the source holds.
  virtual std::vector<std::string> names() const = 0;
  // The path, for messages.
  virtual std::string where() const = 0;
};

// One parameter's tensor in a source: its names and the file holding it.
struct HfImportItem {
  HfNameEntry entry;
  std::string name;  // In the file ("transformer." dropped for hub GPT-2).
  const SafetensorsFile* file = nullptr;
};

// Checks that `source` holds exactly `model`'s parameters (shapes as HF's,
// float dtypes) and says where each is, in parameter order. NotFound lists
// missing tensors, InvalidArgument unknown ones or a shape / dtype mismatch.
// For a pipeline stage's part (Transformer::is_whole false) the source must
// still hold the whole model's tensors, but only the part's are planned (and
// their shapes checked). Nothing is read but the headers.
absl::StatusOr<std::vector<HfImportItem>> PlanHfImport(
    const HfTensorSource& source, const Transformer& model);

// Loads the HF-named tensors of `source` into `model`'s parameters, which
// must be materialised (ToEmpty). Shapes must match HF's exactly; float
// dtypes are converted. Every check (PlanHfImport, materialised, unsharded)
// runs before the first parameter is written, so on those errors `model` is
// untouched.
absl::Status ImportHfTensors(const HfTensorSource& source, Transformer* model);

// ImportHfTensors from the safetensors file `path`.
absl::Status ImportSafetensors(const std::string& path, Transformer* model);

}  // namespace models
}  // namespace fsdpp

#endif  // FSDPP_MODELS_HF_ADAPTER_H_
