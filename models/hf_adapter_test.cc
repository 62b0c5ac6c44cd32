// HF adapter: the mapping covers every parameter once, export writes HF
// names / shapes / Conv1D transposes and unpadded vocabularies, import is the
// exact inverse (also from prefix-less GPT-2 files, bf16 files and with HF's
// extra buffers), and malformed files are rejected with useful errors.
#include "models/hf_adapter.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/device.h"
#include "core/dtype.h"
#include "formats/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/transformer.h"
#include "nn/module.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {
namespace {

using Tensors = std::vector<std::pair<std::string, Tensor>>;

TransformerConfig Named(const std::string& name) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

std::unique_ptr<Transformer> Build(const TransformerConfig& c, uint64_t seed) {
  auto model = *Transformer::Create(c);
  EXPECT_TRUE(model->ToEmpty(Device::Cpu()).ok());
  EXPECT_TRUE(model->InitWeights(seed).ok());
  return model;
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::map<std::string, std::vector<float>> Values(const Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.NamedParameters()) {
    out[name] = *p->data.ToFloats();
  }
  return out;
}

TEST(HfAdapterTest, MappingCoversEveryParameterOnce) {
  TransformerConfig untied = Named("llama_debug");
  untied.tied_embeddings = false;
  TransformerConfig biased = Named("llama_debug");
  biased.bias = true;
  TransformerConfig padded = Named("gpt2_debug");
  padded.vocab_size = 500;
  padded.vocab_pad_multiple = 64;
  for (const TransformerConfig& c :
       {Named("gpt2_debug"), Named("llama_debug"), untied, biased, padded,
        Named("smollm3_3b")}) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<std::vector<HfNameEntry>> mapping = HfNameMapping(c);
    ASSERT_TRUE(mapping.ok()) << mapping.status();
    auto model = *Transformer::Create(c);
    std::vector<std::string> ours, theirs;
    for (const HfNameEntry& e : *mapping) ours.push_back(e.ours);
    std::vector<std::string> expected;
    for (const auto& [name, p] : model->NamedParameters()) {
      expected.push_back(name);
    }
    EXPECT_EQ(ours, expected);
    std::set<std::string> hf;
    for (const HfNameEntry& e : *mapping) hf.insert(e.hf);
    EXPECT_EQ(hf.size(), mapping->size());
  }
}

TEST(HfAdapterTest, HfNames) {
  const std::vector<HfNameEntry> gpt2_mapping =
      *HfNameMapping(Named("gpt2_debug"));
  std::map<std::string, HfNameEntry> gpt2;
  for (const HfNameEntry& e : gpt2_mapping) {
    gpt2[e.ours] = e;
  }
  EXPECT_EQ(gpt2.at("wte.weight").hf, "transformer.wte.weight");
  EXPECT_EQ(gpt2.at("h.1.attn.c_attn.weight").hf,
            "transformer.h.1.attn.c_attn.weight");
  EXPECT_TRUE(gpt2.at("h.1.attn.c_attn.weight").transpose);
  EXPECT_FALSE(gpt2.at("h.1.attn.c_attn.bias").transpose);
  EXPECT_EQ(gpt2.at("h.0.mlp.fc.weight").hf, "transformer.h.0.mlp.c_fc.weight");
  EXPECT_TRUE(gpt2.at("h.0.mlp.proj.weight").transpose);
  EXPECT_EQ(gpt2.at("h.0.mlp.proj.bias").hf, "transformer.h.0.mlp.c_proj.bias");
  EXPECT_EQ(gpt2.at("ln_f.bias").hf, "transformer.ln_f.bias");
  EXPECT_FALSE(gpt2.at("wpe.weight").transpose);

  TransformerConfig untied = Named("llama_debug");
  untied.tied_embeddings = false;
  const std::vector<HfNameEntry> llama_mapping = *HfNameMapping(untied);
  std::map<std::string, std::string> llama;
  for (const HfNameEntry& e : llama_mapping) {
    EXPECT_FALSE(e.transpose) << e.ours;
    llama[e.ours] = e.hf;
  }
  EXPECT_EQ(llama.at("tok_embeddings.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(llama.at("layers.1.attention_norm.weight"),
            "model.layers.1.input_layernorm.weight");
  EXPECT_EQ(llama.at("layers.0.attention.wk.weight"),
            "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(llama.at("layers.0.attention.wo.weight"),
            "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(llama.at("layers.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(llama.at("layers.0.feed_forward.gate.weight"),
            "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(llama.at("layers.0.feed_forward.down.weight"),
            "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(llama.at("norm.weight"), "model.norm.weight");
  EXPECT_EQ(llama.at("output.weight"), "lm_head.weight");
}

TEST(HfAdapterTest, NonCanonicalLayoutsAreUnimplemented) {
  TransformerConfig c = Named("gpt2_debug");
  c.n_kv_heads = 2;
  EXPECT_EQ(HfNameMapping(c).status().code(), absl::StatusCode::kUnimplemented);
  c = Named("llama_debug");
  c.bias = true;
  c.activation = Activation::kGelu;
  EXPECT_EQ(HfNameMapping(c).status().code(), absl::StatusCode::kUnimplemented);
  // Mixtures of experts unlike OLMoE's: refused, naming the differences.
  c = Named("moe_debug");
  c.moe.shared_hidden = 32;
  const absl::Status moe = HfNameMapping(c).status();
  EXPECT_EQ(moe.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(moe.message().find("OLMoE's layout, and this mixture differs from "
                               "it: no q / k norms, shared experts"),
            std::string::npos)
      << moe;
  // q / k norms are OLMoE's: a dense model with them has no HF layout here.
  c = Named("llama_debug");
  c.qk_norm = true;
  EXPECT_EQ(HfNameMapping(c).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(HfNameMapping(Named("olmoe_debug")).ok());
}

TEST(HfAdapterTest, ExportTransposesConv1DWeights) {
  auto model = Build(Named("gpt2_debug"), 1);
  absl::StatusOr<Tensors> exported = ExportHfTensors(*model);
  ASSERT_TRUE(exported.ok()) << exported.status();
  std::map<std::string, Tensor> by_name(exported->begin(), exported->end());
  EXPECT_EQ(by_name.size(), model->NamedParameters().size());
  const Tensor& c_attn = by_name.at("transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(c_attn.shape(), (Shape{64, 192}));
  EXPECT_EQ(by_name.at("transformer.h.0.mlp.c_fc.weight").shape(),
            (Shape{64, 256}));
  EXPECT_EQ(by_name.at("transformer.h.0.mlp.c_proj.weight").shape(),
            (Shape{256, 64}));
  const std::vector<float> ours =
      *model->blocks()[0]->attn()->NamedParameters()[0].second->data.ToFloats();
  const std::vector<float> theirs = *c_attn.ToFloats();
  for (int64_t out = 0; out < 192; ++out) {
    for (int64_t in = 0; in < 64; ++in) {
      ASSERT_EQ(theirs[in * 192 + out], ours[out * 64 + in]);
    }
  }
  EXPECT_EQ(by_name.count("lm_head.weight"), 0u);
}

TEST(HfAdapterTest, RoundTripIsExact) {
  TransformerConfig untied = Named("llama_debug");
  untied.tied_embeddings = false;
  for (const TransformerConfig& c :
       {Named("gpt2_debug"), Named("llama_debug"), untied}) {
    SCOPED_TRACE(c.name);
    auto source = Build(c, 1);
    auto target = Build(c, 2);
    const std::string path = TempPath(c.name + ".safetensors");
    ASSERT_TRUE(ExportSafetensors(*source, path).ok());
    ASSERT_NE(Values(*source), Values(*target));
    const absl::Status imported = ImportSafetensors(path, target.get());
    ASSERT_TRUE(imported.ok()) << imported;
    EXPECT_EQ(Values(*source), Values(*target));
    auto file = *SafetensorsFile::Open(path);
    EXPECT_EQ(file->metadata().at("format"), "pt");
    EXPECT_EQ(file->Contains("lm_head.weight"), !c.tied_embeddings);
  }
}

TEST(HfAdapterTest, PaddedVocabularyIsUnpaddedInFiles) {
  TransformerConfig c = Named("gpt2_debug");
  c.vocab_size = 500;
  c.vocab_pad_multiple = 64;
  auto source = Build(c, 1);
  auto target = Build(c, 2);
  const std::string path = TempPath("padded.safetensors");
  ASSERT_TRUE(ExportSafetensors(*source, path).ok());
  auto file = *SafetensorsFile::Open(path);
  EXPECT_EQ(file->Info("transformer.wte.weight")->shape, (Shape{500, 64}));
  ASSERT_TRUE(ImportSafetensors(path, target.get()).ok());
  const std::vector<float> src =
      *source->token_embedding()->weight()->data.ToFloats();
  const std::vector<float> dst =
      *target->token_embedding()->weight()->data.ToFloats();
  for (int64_t i = 0; i < 512 * 64; ++i) {
    ASSERT_EQ(dst[i], i < 500 * 64 ? src[i] : 0.0f) << i;
  }
}

TEST(HfAdapterTest, ImportsHubStyleGpt2FilesAndConvertsDtypes) {
  auto source = Build(Named("gpt2_debug"), 1);
  Tensors tensors = *ExportHfTensors(*source);
  // Hub style: no "transformer." prefix, bf16 values, attention-mask buffers.
  Tensors hub;
  for (auto& [name, t] : tensors) {
    Tensor bf16 = *Tensor::Empty(t.shape(), DType::kBF16, Device::Cpu());
    ASSERT_TRUE(Copy(t, &bf16).ok());
    hub.emplace_back(name.substr(std::string("transformer.").size()), bf16);
  }
  hub.emplace_back("h.0.attn.bias", *Tensor::Zeros({1, 1, 128, 128},
                                                   DType::kF32, Device::Cpu()));
  const std::string path = TempPath("hub.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, hub).ok());
  auto target = Build(Named("gpt2_debug"), 2);
  const absl::Status imported = ImportSafetensors(path, target.get());
  ASSERT_TRUE(imported.ok()) << imported;
  const auto src = Values(*source);
  for (const auto& [name, values] : Values(*target)) {
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_NEAR(values[i], src.at(name)[i],
                  std::fabs(src.at(name)[i]) * (1.0f / 256))
          << name;
    }
  }
}

TEST(HfAdapterTest, RejectsMissingUnknownAndMisshapenTensors) {
  auto model = Build(Named("llama_debug"), 1);
  Tensors tensors = *ExportHfTensors(*model);
  const std::string path = TempPath("bad.safetensors");

  Tensors missing(tensors.begin() + 1, tensors.end());
  ASSERT_TRUE(WriteSafetensors(path, missing).ok());
  absl::Status s = ImportSafetensors(path, model.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(s.message(), "model.embed_tokens.weight")) << s;

  Tensors unknown = tensors;
  unknown.emplace_back("model.layers.9.mlp.up_proj.weight",
                       *Tensor::FromFloats({1}, {1.0f}));
  ASSERT_TRUE(WriteSafetensors(path, unknown).ok());
  s = ImportSafetensors(path, model.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "model.layers.9.mlp.up_proj"))
      << s;

  // A tied model ignores an lm_head.weight.
  Tensors with_head = tensors;
  with_head.emplace_back("lm_head.weight", tensors[0].second);
  ASSERT_TRUE(WriteSafetensors(path, with_head).ok());
  EXPECT_TRUE(ImportSafetensors(path, model.get()).ok());

  Tensors misshapen = tensors;
  misshapen[1].second = *Tensor::Zeros({3}, DType::kF32, Device::Cpu());
  ASSERT_TRUE(WriteSafetensors(path, misshapen).ok());
  s = ImportSafetensors(path, model.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "expected [64]")) << s;

  Tensors ints = tensors;
  ints[1].second = *Tensor::Zeros({64}, DType::kI32, Device::Cpu());
  ASSERT_TRUE(WriteSafetensors(path, ints).ok());
  EXPECT_EQ(ImportSafetensors(path, model.get()).code(),
            absl::StatusCode::kInvalidArgument);

  auto meta = *Transformer::Create(Named("llama_debug"));
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  EXPECT_EQ(ImportSafetensors(path, meta.get()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ExportHfTensors(*meta).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(HfAdapterTest, ExportsGradientsUnderHfNames) {
  auto model = Build(Named("gpt2_debug"), 1);
  EXPECT_EQ(ExportHfTensors(*model, HfExportSource::kGradients).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const Tensor ids = *Tensor::FromInts({1, 4}, {1, 2, 3, 4}, DType::kI64);
  ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
  ASSERT_TRUE(model->Backward().ok());
  absl::StatusOr<Tensors> grads =
      ExportHfTensors(*model, HfExportSource::kGradients);
  ASSERT_TRUE(grads.ok()) << grads.status();
  std::map<std::string, Tensor> by_name(grads->begin(), grads->end());
  const Tensor& g = by_name.at("transformer.h.1.mlp.c_fc.weight");
  EXPECT_EQ(g.shape(), (Shape{64, 256}));
  const std::vector<float> ours =
      *model->blocks()[1]->mlp()->NamedParameters()[0].second->grad.ToFloats();
  const std::vector<float> theirs = *g.ToFloats();
  for (int64_t out = 0; out < 256; ++out) {
    for (int64_t in = 0; in < 64; ++in) {
      ASSERT_EQ(theirs[in * 256 + out], ours[out * 64 + in]);
    }
  }
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
