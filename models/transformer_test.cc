// Transformer: parameter names (the checkpoint / HF interface), init,
// loss and gradients (finite differences on the whole model), activation
// checkpointing (bitwise equal), hook order over the blocks, ignore_index,
// gradient accumulation, bf16, meta-device shape runs and argument errors.
// Numerical parity with an independent PyTorch model is in parity_test.
#include "models/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "nn/loss.h"
#include "nn/module.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace models {
namespace {

TransformerConfig Named(const std::string& name) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

std::unique_ptr<Transformer> Build(const TransformerConfig& c,
                                   TransformerOptions options = {},
                                   uint64_t seed = 7) {
  absl::StatusOr<std::unique_ptr<Transformer>> model =
      Transformer::Create(c, options);
  EXPECT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->ToEmpty(Device::Cpu()).ok());
  EXPECT_TRUE((*model)->InitWeights(seed).ok());
  return std::move(*model);
}

// Deterministic ids in [0, vocab) of shape [b, t] (i64).
Tensor Ids(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> v(b * t);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int64_t& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(vocab));
  }
  return *Tensor::FromInts({b, t}, v, DType::kI64);
}

std::vector<float> Floats(const Tensor& t) { return *t.ToFloats(); }

std::vector<std::string> Names(const Module& m) {
  std::vector<std::string> names;
  for (const auto& [name, p] : m.NamedParameters()) names.push_back(name);
  return names;
}

TEST(TransformerTest, Gpt2ParameterNames) {
  auto model = *Transformer::Create(Named("gpt2_debug"));
  std::vector<std::string> expected = {"wte.weight", "wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    for (const char* part :
         {"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.fc", "mlp.proj"}) {
      expected.push_back(absl::StrCat("h.", i, ".", part, ".weight"));
      expected.push_back(absl::StrCat("h.", i, ".", part, ".bias"));
    }
  }
  expected.push_back("ln_f.weight");
  expected.push_back("ln_f.bias");
  EXPECT_EQ(Names(*model), expected);
  EXPECT_EQ(model->lm_head()->weight(), model->token_embedding()->weight());
  EXPECT_EQ(model->blocks().size(), 2u);
  const std::map<std::string, Shape> shapes = {
      {"wte.weight", {512, 64}},
      {"wpe.weight", {128, 64}},
      {"h.0.attn.c_attn.weight", {192, 64}},
      {"h.1.mlp.fc.weight", {256, 64}},
      {"h.1.mlp.proj.weight", {64, 256}}};
  for (const auto& [name, p] : model->NamedParameters()) {
    if (shapes.count(name)) {
      EXPECT_EQ(p->shape, shapes.at(name)) << name;
    }
  }
}

TEST(TransformerTest, LlamaParameterNames) {
  TransformerConfig c = Named("llama_debug");
  c.tied_embeddings = false;
  auto model = *Transformer::Create(c);
  std::vector<std::string> expected = {"tok_embeddings.weight"};
  for (int i = 0; i < 2; ++i) {
    for (const char* part :
         {"attention_norm", "attention.wq", "attention.wk", "attention.wv",
          "attention.wo", "ffn_norm", "feed_forward.gate", "feed_forward.up",
          "feed_forward.down"}) {
      expected.push_back(absl::StrCat("layers.", i, ".", part, ".weight"));
    }
  }
  expected.push_back("norm.weight");
  expected.push_back("output.weight");
  EXPECT_EQ(Names(*model), expected);
  EXPECT_NE(model->lm_head()->weight(), model->token_embedding()->weight());
  EXPECT_EQ(model->position_embedding(), nullptr);
  const std::map<std::string, Shape> shapes = {
      {"layers.0.attention.wq.weight", {64, 64}},
      {"layers.0.attention.wk.weight", {32, 64}},
      {"layers.0.feed_forward.gate.weight", {192, 64}},
      {"layers.0.feed_forward.down.weight", {64, 192}},
      {"output.weight", {512, 64}}};
  for (const auto& [name, p] : model->NamedParameters()) {
    if (shapes.count(name)) {
      EXPECT_EQ(p->shape, shapes.at(name)) << name;
    }
  }
}

TEST(TransformerTest, InitFollowsTheFamilies) {
  // 12 layers, so the residual std is 0.02 / sqrt(24) as in GPT-2 124M.
  TransformerConfig deep = Named("gpt2_debug");
  deep.n_layers = 12;
  auto gpt2 = Build(deep);
  for (const auto& [name, p] : gpt2->NamedParameters()) {
    const std::vector<float> v = Floats(p->data);
    double sum = 0, sum_sq = 0;
    for (float x : v) {
      sum += x;
      sum_sq += static_cast<double>(x) * x;
    }
    const double mean = sum / v.size();
    const double std = std::sqrt(sum_sq / v.size() - mean * mean);
    const bool norm = name.find("ln_") != std::string::npos;
    const bool bias =
        name.size() > 5 && name.substr(name.size() - 5) == ".bias";
    if (norm && !bias) {
      EXPECT_EQ(mean, 1.0) << name;
      EXPECT_EQ(std, 0.0) << name;
    } else if (bias) {
      EXPECT_EQ(sum_sq, 0.0) << name;
    } else {
      const bool residual = name.find("c_proj") != std::string::npos ||
                            name.find("mlp.proj") != std::string::npos;
      const double expected = residual ? 0.02 / std::sqrt(24.0) : 0.02;
      EXPECT_NEAR(std, expected, 0.04 * expected) << name;
      EXPECT_NEAR(mean, 0.0, 0.05 * expected) << name;
    }
  }

  auto llama = Build(Named("llama_debug"));
  for (const auto& [name, p] : llama->NamedParameters()) {
    const std::vector<float> v = Floats(p->data);
    if (p->shape.size() == 1) {
      for (float x : v) ASSERT_EQ(x, 1.0f) << name;
      continue;
    }
    EXPECT_EQ(p->init.kind, InitSpec::Kind::kTruncatedNormal) << name;
    float max_abs = 0;
    for (float x : v) max_abs = std::max(max_abs, std::fabs(x));
    EXPECT_LE(max_abs, 0.04f) << name;
    EXPECT_GT(max_abs, 0.03f) << name;
  }
}

TEST(TransformerTest, InitialLossIsNearLogVocab) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    auto model = Build(Named(name));
    const Tensor ids = Ids(2, 16, 512, 1);
    const Tensor targets = Ids(2, 16, 512, 2);
    absl::StatusOr<float> loss = model->ForwardLoss(ids, targets);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, std::log(512.0f), 0.05f) << name;
    EXPECT_EQ(model->last_target_count(), 32);
    ASSERT_TRUE(model->Backward().ok());
  }
}

// Central differences of the loss for the largest-gradient element of every
// parameter, with weights scaled up so the loss is far from flat.
void CheckGradientsByFiniteDifferences(const TransformerConfig& c,
                                       const TransformerOptions& options = {}) {
  SCOPED_TRACE(absl::StrCat(c.name, " loss chunk ", options.loss_chunk_tokens));
  absl::StatusOr<std::unique_ptr<Transformer>> created =
      Transformer::Create(c, options);
  ASSERT_TRUE(created.ok());
  Transformer& model = **created;
  for (auto& [name, p] : model.NamedParameters()) {
    p->init = p->shape.size() == 1 ? InitSpec::Uniform(0.5f, 1.5f)
                                   : InitSpec::Normal(0.2f);
  }
  ASSERT_TRUE(model.ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE(model.InitWeights(3).ok());
  const Tensor ids = Ids(2, 8, c.vocab_size, 11);
  std::vector<int64_t> t(16);
  for (int i = 0; i < 16; ++i) t[i] = i % 5 == 0 ? -100 : (i * 37) % 512;
  const Tensor targets = *Tensor::FromInts({2, 8}, t, DType::kI64);
  ASSERT_TRUE(model.ForwardLoss(ids, targets).ok());
  ASSERT_TRUE(model.Backward().ok());
  for (auto& [name, p] : model.NamedParameters()) {
    const std::vector<float> g = Floats(p->grad);
    int64_t worst = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(g.size()); ++i) {
      if (std::fabs(g[i]) > std::fabs(g[worst])) worst = i;
    }
    float* w = p->data.data<float>() + worst;
    const float original = *w;
    const float h = 1e-2f;
    const float up = original + h, down = original - h;
    *w = up;
    const double plus = *model.ForwardLoss(ids, targets);
    *w = down;
    const double minus = *model.ForwardLoss(ids, targets);
    *w = original;
    const double numeric =
        (plus - minus) / (static_cast<double>(up) - static_cast<double>(down));
    EXPECT_NEAR(g[worst], numeric, 2e-3 + 0.03 * std::fabs(numeric))
        << name << "[" << worst << "]";
  }
}

TEST(TransformerTest, GradientsMatchFiniteDifferences) {
  CheckGradientsByFiniteDifferences(Named("gpt2_debug"));
  CheckGradientsByFiniteDifferences(Named("llama_debug"));
  TransformerConfig smol_like = Named("llama_debug");
  smol_like.no_rope_every = 2;
  smol_like.name = "llama_debug_nope";
  CheckGradientsByFiniteDifferences(smol_like);
  TransformerOptions fused_head;
  fused_head.loss_chunk_tokens = 5;
  CheckGradientsByFiniteDifferences(Named("gpt2_debug"), fused_head);
  CheckGradientsByFiniteDifferences(Named("llama_debug"), fused_head);
}

std::map<std::string, std::vector<float>> Grads(const Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.NamedParameters()) out[name] = Floats(p->grad);
  return out;
}

// Every policy (full, every:2 on 2 blocks, selective) gives the losses and
// gradients of no checkpointing bitwise; the activations kept after forward
// order none > selective > every:2 > full.
TEST(TransformerTest, EveryCheckpointPolicyIsBitwiseEqual) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(name);
    std::vector<int64_t> kept;
    std::map<std::string, std::vector<float>> reference;
    float reference_loss = 0;
    for (const nn::CheckpointPolicy& policy :
         {nn::CheckpointPolicy::None(), nn::CheckpointPolicy::Selective(),
          nn::CheckpointPolicy::Every(2), nn::CheckpointPolicy::Full()}) {
      SCOPED_TRACE(policy.ToString());
      CpuAllocator fresh;  // exact counts from zero
      Allocator* previous = SetAllocator(&fresh);
      TransformerOptions options;
      options.activation_checkpointing = policy;
      auto model = Build(Named(name), options);
      const Tensor ids = Ids(2, 16, 512, 5);
      const Tensor targets = Ids(2, 16, 512, 6);
      const float loss = *model->ForwardLoss(ids, targets);
      kept.push_back(fresh.Stats().current_of(MemoryTag::kActivations) +
                     fresh.Stats().current_of(MemoryTag::kAttention));
      ASSERT_TRUE(model->Backward().ok());
      const auto grads = Grads(*model);
      model.reset();
      SetAllocator(previous);
      if (policy == nn::CheckpointPolicy::None()) {
        reference = grads;
        reference_loss = loss;
        continue;
      }
      EXPECT_EQ(loss, reference_loss);
      EXPECT_EQ(grads, reference);
    }
    EXPECT_GT(kept[0], kept[1]);
    EXPECT_GT(kept[1], kept[2]);
    EXPECT_GT(kept[2], kept[3]);
  }
}

TEST(TransformerTest, ActivationCheckpointingIsBitwiseEqual) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(name);
    auto plain = Build(Named(name));
    TransformerOptions options;
    options.activation_checkpointing = nn::CheckpointPolicy::Full();
    auto checkpointed = Build(Named(name), options);
    EXPECT_TRUE(checkpointed->activation_checkpointing().enabled());
    const Tensor ids = Ids(2, 16, 512, 5);
    const Tensor targets = Ids(2, 16, 512, 6);
    const float a = *plain->ForwardLoss(ids, targets);
    const float b = *checkpointed->ForwardLoss(ids, targets);
    EXPECT_EQ(a, b);
    ASSERT_TRUE(plain->Backward().ok());
    ASSERT_TRUE(checkpointed->Backward().ok());
    EXPECT_EQ(Grads(*plain), Grads(*checkpointed));

    // Toggling off again gives the same gradients once more.
    checkpointed->set_activation_checkpointing(nn::CheckpointPolicy::None());
    ASSERT_TRUE(checkpointed->ZeroGrad().ok());
    EXPECT_EQ(*checkpointed->ForwardLoss(ids, targets), a);
    ASSERT_TRUE(checkpointed->Backward().ok());
    EXPECT_EQ(Grads(*plain), Grads(*checkpointed));
  }
}

TEST(TransformerTest, BlockHooksFireInOrderAndAgainWhenRecomputing) {
  auto model = Build(Named("gpt2_debug"));
  std::vector<std::string> events;
  for (size_t i = 0; i < model->blocks().size(); ++i) {
    Module* block = model->blocks()[i];
    block->AddPreForwardHook([&events, i](Module&) {
      events.push_back(absl::StrCat("F", i));
      return absl::OkStatus();
    });
    block->AddPreBackwardHook([&events, i](Module&) {
      events.push_back(absl::StrCat("B", i));
      return absl::OkStatus();
    });
  }
  const Tensor ids = Ids(1, 8, 512, 1);
  ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
  ASSERT_TRUE(model->Backward().ok());
  EXPECT_EQ(events, (std::vector<std::string>{"F0", "F1", "B1", "B0"}));
  events.clear();
  model->set_activation_checkpointing(nn::CheckpointPolicy::Full());
  ASSERT_TRUE(model->ForwardLoss(ids, ids).ok());
  ASSERT_TRUE(model->Backward().ok());
  EXPECT_EQ(events,
            (std::vector<std::string>{"F0", "F1", "F1", "B1", "F0", "B0"}));
}

TEST(TransformerTest, IgnoredTargetsAndGradientAccumulation) {
  auto model = Build(Named("llama_debug"));
  const Tensor ids = Ids(2, 8, 512, 3);
  std::vector<int64_t> none(16, -100);
  const Tensor ignored = *Tensor::FromInts({2, 8}, none, DType::kI64);
  EXPECT_EQ(*model->ForwardLoss(ids, ignored), 0.0f);
  EXPECT_EQ(model->last_target_count(), 0);
  ASSERT_TRUE(model->Backward().ok());
  for (const auto& [name, g] : Grads(*model)) {
    for (float x : g) ASSERT_EQ(x, 0.0f) << name;
  }

  const Tensor targets = Ids(2, 8, 512, 4);
  ASSERT_TRUE(model->ZeroGrad().ok());
  ASSERT_TRUE(model->ForwardLoss(ids, targets).ok());
  ASSERT_TRUE(model->Backward().ok());
  const auto once = Grads(*model);
  ASSERT_TRUE(model->ForwardLoss(ids, targets).ok());
  ASSERT_TRUE(model->Backward().ok());
  for (const auto& [name, g] : Grads(*model)) {
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_NEAR(g[i], 2.0f * once.at(name)[i],
                  1e-6f + 1e-5f * std::fabs(g[i]))
          << name;
    }
  }
}

// Packed documents with document masking train as the documents would one
// by one: rows of two documents each (GPT-2 with wpe, Llama with RoPE), the
// packed batch's mean loss and gradients against the documents run
// separately (each a batch of its own, its gradient scaled by its share of
// the tokens), to 1e-6; with full and selective activation checkpointing
// too (the recomputation sees the masks). Without masking the packed rows
// give another loss (the documents see each other).
TEST(TransformerTest, PackedDocumentsTrainLikeSeparateDocuments) {
  constexpr int64_t kEot = 3;
  const std::vector<std::vector<int64_t>> rows = {{10, 14}, {1, 23}};
  const int64_t t = 24, b = static_cast<int64_t>(rows.size());
  // Documents: kEot then tokens that are never kEot.
  std::vector<int64_t> ids = *Ids(b, t, 512, 21).ToInts();
  std::vector<int64_t> targets = *Ids(b, t, 512, 22).ToInts();
  for (int64_t r = 0; r < b; ++r) {
    int64_t start = 0;
    for (int64_t len : rows[r]) {
      for (int64_t i = start; i < start + len; ++i) {
        if (ids[r * t + i] == kEot) ids[r * t + i] = kEot + 1;
      }
      ids[r * t + start] = kEot;
      start += len;
    }
  }
  const Tensor packed_ids = *Tensor::FromInts({b, t}, ids, DType::kI64);
  const Tensor packed_targets = *Tensor::FromInts({b, t}, targets, DType::kI64);
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(name);
    // The documents one at a time.
    TransformerOptions options;
    options.document_eot_id = kEot;
    auto separate = Build(Named(name), options);
    double separate_loss = 0;
    for (int64_t r = 0; r < b; ++r) {
      int64_t start = 0;
      for (int64_t len : rows[r]) {
        const auto first = ids.begin() + r * t + start;
        const auto first_target = targets.begin() + r * t + start;
        const Tensor doc_ids = *Tensor::FromInts(
            {1, len}, std::vector<int64_t>(first, first + len), DType::kI64);
        const Tensor doc_targets = *Tensor::FromInts(
            {1, len}, std::vector<int64_t>(first_target, first_target + len),
            DType::kI64);
        const float share = static_cast<float>(len) / static_cast<float>(b * t);
        separate_loss += share * *separate->ForwardLoss(doc_ids, doc_targets);
        ASSERT_TRUE(separate->Backward(share).ok());
        start += len;
      }
    }
    const auto separate_grads = Grads(*separate);
    for (const nn::CheckpointPolicy& policy :
         {nn::CheckpointPolicy::None(), nn::CheckpointPolicy::Full(),
          nn::CheckpointPolicy::Selective()}) {
      SCOPED_TRACE(policy.ToString());
      options.activation_checkpointing = policy;
      auto packed = Build(Named(name), options);
      const float loss = *packed->ForwardLoss(packed_ids, packed_targets);
      ASSERT_TRUE(packed->Backward().ok());
      EXPECT_NEAR(loss, separate_loss, 1e-6);
      for (const auto& [param, g] : Grads(*packed)) {
        const std::vector<float>& want = separate_grads.at(param);
        for (size_t i = 0; i < g.size(); ++i) {
          ASSERT_NEAR(g[i], want[i], 1e-6) << param << " " << i;
        }
      }
    }
    auto unmasked = Build(Named(name));
    EXPECT_GT(std::fabs(*unmasked->ForwardLoss(packed_ids, packed_targets) -
                        separate_loss),
              1e-4);
  }
}

// Document masking needs the fused attention; its id must be a token; a
// part without the embeddings needs the batch's ids before each forward.
TEST(TransformerTest, DocumentMaskingRefusesWhatItCannotMask) {
  TransformerOptions options;
  options.document_eot_id = 3;
  options.fused_attention = false;
  absl::Status s = Transformer::Create(Named("llama_debug"), options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs the fused attention"), std::string::npos)
      << s;
  options.fused_attention = true;
  options.embedding = false;
  options.first_block = 1;
  {
    auto part = Build(Named("llama_debug"), options);
    const Tensor hidden = *Tensor::Zeros({1, 8, Named("llama_debug").dim},
                                         DType::kF32, Device::Cpu());
    const absl::StatusOr<Tensor> out = part->Forward(hidden);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(out.status().message().find("SetBatch(ids) must precede each "
                                          "Forward"),
              std::string::npos)
        << out.status();
    ASSERT_TRUE(part->SetBatch(Ids(1, 8, 512, 3)).ok());
    EXPECT_TRUE(part->Forward(hidden).ok());
    // Used up by that forward.
    EXPECT_EQ(part->Forward(hidden).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  options.embedding = true;
  options.first_block = 0;
  options.document_eot_id = 512;
  s = Transformer::Create(Named("llama_debug"), options).status();
  EXPECT_NE(s.message().find("is not in the vocabulary of 512 tokens"),
            std::string::npos)
      << s;
}

// The LM head fused with the loss (chunks of 5 tokens over 2 x 9, ignored
// targets, two accumulated micro-batches scaled 0.5 each, on the device
// sum) against the unfused head: the same losses, counts and gradients (tied
// GPT-2 head, untied Llama head), with the count as the mean's divisor and
// with a normalizer (20: the sum of the 14 targets' losses / 20).
TEST(TransformerTest, FusedLossHeadMatchesTheUnfusedHead) {
  std::map<std::string, float> by_count;
  for (const double normalizer : {0.0, 20.0})
    for (const char* name : {"gpt2_debug", "llama_debug"}) {
      SCOPED_TRACE(absl::StrCat(name, " normalizer ", normalizer));
      TransformerOptions unfused_options;
      unfused_options.loss_chunk_tokens = 0;
      TransformerOptions fused_options;
      fused_options.loss_chunk_tokens = 5;
      auto unfused = Build(Named(name), unfused_options);
      auto fused = Build(Named(name), fused_options);
      const Tensor ids = Ids(2, 9, 512, 21);
      std::vector<int64_t> t(18);
      for (int i = 0; i < 18; ++i) t[i] = i % 4 == 2 ? -100 : (i * 53) % 512;
      const Tensor targets = *Tensor::FromInts({2, 9}, t, DType::kI64);
      std::vector<float> sums;
      for (Transformer* m : {unfused.get(), fused.get()}) {
        ASSERT_TRUE(m->mutable_loss()->set_normalizer(normalizer).ok());
        Tensor sum = *Tensor::Zeros({1}, DType::kF32, Device::Cpu());
        for (int micro = 0; micro < 2; ++micro) {
          ASSERT_TRUE(m->ForwardLossAccumulate(ids, targets, 0.5, &sum).ok());
          EXPECT_EQ(m->last_target_count(), 14);
          ASSERT_TRUE(m->Backward(0.5f).ok());
        }
        sums.push_back(Floats(sum)[0]);
      }
      EXPECT_TRUE(fused->lm_head()->last_forward_fused());
      EXPECT_FALSE(unfused->lm_head()->last_forward_fused());
      EXPECT_NEAR(sums[1], sums[0], 1e-6f * sums[0]);
      if (normalizer == 0) {
        by_count[name] = sums[0];
      } else {
        EXPECT_NEAR(sums[0], by_count.at(name) * 14 / 20, 1e-6f * sums[0]);
      }
      const auto a = Grads(*unfused), b = Grads(*fused);
      for (const auto& [param, g] : a) {
        const std::vector<float>& h = b.at(param);
        // With the count's 0.5 (a power of two) the two agree to rounding;
        // a normalizer's 0.35 rounds differently in the fused head's two
        // scalings, by an f32 ulp before the backward: within 1e-5 of the
        // gradient's largest element.
        float largest = 0;
        for (float x : g) largest = std::max(largest, std::fabs(x));
        const float slack = normalizer == 0 ? 1e-7f : 1e-5f * largest;
        for (size_t i = 0; i < g.size(); ++i) {
          ASSERT_NEAR(h[i], g[i], slack + 1e-5f * std::fabs(g[i])) << param;
        }
      }
      EXPECT_NEAR(*fused->ForwardLoss(ids, targets),
                  *unfused->ForwardLoss(ids, targets), 1e-6f * sums[0]);
      // A forward that fails before the head leaves it unarmed: the next
      // plain forward gives logits.
      EXPECT_FALSE(fused->ForwardLoss(Ids(2, 9, 100000, 1), targets).ok());
      absl::StatusOr<Tensor> logits = fused->Logits(ids);
      ASSERT_TRUE(logits.ok()) << logits.status();
      EXPECT_EQ(logits->ndim(), 3);
      // A loss set from outside (loss parallel's) turns the fused head off.
      fused->set_loss(std::make_unique<nn::CrossEntropyLoss>());
      ASSERT_TRUE(fused->ForwardLoss(ids, targets).ok());
      EXPECT_FALSE(fused->lm_head()->last_forward_fused());
      ASSERT_TRUE(fused->Backward().ok());
    }
}

TEST(TransformerTest, LogitsMatchTheTrainingForward) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    auto model = Build(Named(name));
    const Tensor ids = Ids(2, 16, 512, 9);
    absl::StatusOr<Tensor> logits = model->Logits(ids);
    ASSERT_TRUE(logits.ok()) << logits.status();
    EXPECT_EQ(logits->shape(), (Shape{2, 16, 512}));
    absl::StatusOr<Tensor> again = model->Forward(ids);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(Floats(*logits), Floats(*again));
    // Logits keeps nothing: a backward after it has nothing to use.
    ASSERT_TRUE(model->Logits(ids).ok());
    EXPECT_FALSE(model->Backward(*logits).ok());
  }
}

TEST(TransformerTest, EvalLossIsTheTrainingLossAndKeepsNothing) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    auto model = Build(Named(name));
    const Tensor ids = Ids(2, 16, 512, 9), targets = Ids(2, 16, 512, 4);
    absl::StatusOr<float> eval = model->EvalLoss(ids, targets);
    ASSERT_TRUE(eval.ok()) << eval.status();
    EXPECT_FALSE(model->Backward().ok()) << name;  // Nothing was kept.
    absl::StatusOr<float> train = model->ForwardLoss(ids, targets);
    ASSERT_TRUE(train.ok());
    EXPECT_EQ(*eval, *train) << name;
    absl::Status bad = model->EvalLoss(ids, Ids(2, 8, 512, 4)).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.message().find("must be [B, T] like the input"),
              absl::string_view::npos)
        << bad;
  }
}

TEST(TransformerTest, PaddedVocabularyRunsAndIsNeverPredictedAsTarget) {
  TransformerConfig c = Named("gpt2_debug");
  c.vocab_size = 500;
  c.vocab_pad_multiple = 64;
  auto model = Build(c);
  EXPECT_EQ(model->token_embedding()->weight()->shape, (Shape{512, 64}));
  const Tensor ids = Ids(2, 8, 500, 1);
  ASSERT_TRUE(model->ForwardLoss(ids, Ids(2, 8, 500, 2)).ok());
  ASSERT_TRUE(model->Backward().ok());
}

TEST(TransformerTest, Bf16ParametersTrackF32) {
  for (const char* name : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(name);
    auto f32 = Build(Named(name));
    TransformerOptions options;
    options.param_dtype = DType::kBF16;
    auto bf16 = Build(Named(name), options);
    for (const auto& [n, p] : bf16->NamedParameters()) {
      ASSERT_EQ(p->data.dtype(), DType::kBF16) << n;
    }
    const Tensor ids = Ids(2, 16, 512, 5);
    const Tensor targets = Ids(2, 16, 512, 6);
    const float a = *f32->ForwardLoss(ids, targets);
    absl::StatusOr<float> b = bf16->ForwardLoss(ids, targets);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NEAR(*b, a, 0.02f * a);
    ASSERT_TRUE(bf16->Backward().ok());
  }
}

TEST(TransformerTest, MetaForwardChecksShapesWithoutMemory) {
  for (const char* name : {"gpt2_124m", "llama_1b"}) {
    SCOPED_TRACE(name);
    const int64_t before = GetAllocator(Device::Cpu())->Stats().total_current;
    auto model = *Transformer::Create(Named(name));
    const Tensor ids = *Tensor::Empty({2, 16}, DType::kI64, Device::Meta());
    absl::StatusOr<Tensor> logits = model->Forward(ids);
    ASSERT_TRUE(logits.ok()) << logits.status();
    EXPECT_TRUE(logits->is_meta());
    EXPECT_EQ(logits->shape(), (Shape{2, 16, Named(name).padded_vocab_size()}));
    model->ReleaseSavedTensors();
    EXPECT_EQ(GetAllocator(Device::Cpu())->Stats().total_current, before);
  }
}

// Pipeline parts: chained forward gives the whole model's logits and
// chained backward its gradients, bitwise (the tied embedding's two copies
// add up to the whole model's gradient up to summation order), with the
// whole model's names and initial values; bad parts are refused.
TEST(TransformerTest, PartsChainToTheWholeModel) {
  for (const std::string name : {"gpt2_debug", "llama_debug"}) {
    SCOPED_TRACE(name);
    TransformerConfig c = Named(name);
    c.n_layers = 4;
    std::unique_ptr<Transformer> whole = Build(c);
    TransformerOptions first, middle, last;
    first.num_blocks = 1;
    first.head = false;
    middle.first_block = 1;
    middle.num_blocks = 2;
    middle.embedding = middle.head = false;
    last.first_block = 3;
    last.embedding = false;
    std::vector<std::unique_ptr<Transformer>> parts;
    for (const TransformerOptions& o : {first, middle, last}) {
      parts.push_back(Build(c, o));
      EXPECT_FALSE(parts.back()->is_whole());
    }
    EXPECT_TRUE(whole->is_whole());
    EXPECT_EQ(parts[1]->first_block(), 1);
    EXPECT_EQ(parts[1]->token_embedding(), nullptr);
    EXPECT_EQ(parts[1]->lm_head(), nullptr);
    EXPECT_EQ(parts[2]->token_embedding() != nullptr, c.tied_embeddings);

    // Every part parameter is the whole model's, with the same values.
    std::map<std::string, Parameter*> all;
    for (auto& [n, p] : whole->NamedParameters()) all[n] = p;
    std::map<std::string, int> seen;
    for (const auto& part : parts) {
      for (auto& [n, p] : part->NamedParameters()) {
        ASSERT_TRUE(all.count(n)) << n;
        EXPECT_EQ(Floats(p->data), Floats(all[n]->data)) << n;
        ++seen[n];
      }
    }
    EXPECT_EQ(seen.size(), all.size());

    const Tensor ids = Ids(2, 8, c.vocab_size, 3);
    const Tensor targets = Ids(2, 8, c.vocab_size, 4);
    auto or1 = whole->ForwardLoss(ids, targets);
    ASSERT_TRUE(or1.ok()) << or1.status();
    float loss = *std::move(or1);
    ASSERT_TRUE(whole->Backward().ok());
    auto or2 = parts[0]->Forward(ids);
    ASSERT_TRUE(or2.ok()) << or2.status();
    Tensor h = *std::move(or2);
    EXPECT_EQ(h.shape(), (Shape{2, 8, c.dim}));
    EXPECT_EQ(parts[1]->ForwardLoss(h, targets).status().code(),
              absl::StatusCode::kFailedPrecondition);
    auto or4 = parts[1]->Forward(h);
    ASSERT_TRUE(or4.ok()) << or4.status();
    h = *std::move(or4);
    auto or5 = parts[2]->ForwardLoss(h, targets);
    ASSERT_TRUE(or5.ok()) << or5.status();
    float part_loss = *std::move(or5);
    EXPECT_EQ(part_loss, loss);
    // Backward by hand through the chain, as a pipeline runs it.
    auto or6 = parts[2]->mutable_loss()->Backward(1);
    ASSERT_TRUE(or6.ok()) << or6.status();
    Tensor dlogits = *std::move(or6);
    auto or7 = parts[2]->Module::Backward(dlogits);
    ASSERT_TRUE(or7.ok()) << or7.status();
    Tensor d = *std::move(or7);
    EXPECT_EQ(d.shape(), (Shape{2, 8, c.dim}));
    auto or8 = parts[1]->Module::Backward(d);
    ASSERT_TRUE(or8.ok()) << or8.status();
    d = *std::move(or8);
    auto or9 = parts[0]->Module::Backward(d);
    ASSERT_TRUE(or9.ok()) << or9.status();
    d = *std::move(or9);
    EXPECT_FALSE(d.defined());
    const std::string tied =
        c.family == ModelFamily::kGpt2 ? "wte.weight" : "tok_embeddings.weight";
    for (const auto& part : parts) {
      for (auto& [n, p] : part->NamedParameters()) {
        if (c.tied_embeddings && n == tied) continue;
        EXPECT_EQ(Floats(p->grad), Floats(all[n]->grad)) << n;
      }
    }
    if (c.tied_embeddings) {
      std::vector<float> sum =
          Floats(parts[0]->token_embedding()->weight()->grad);
      const std::vector<float> head =
          Floats(parts[2]->token_embedding()->weight()->grad);
      const std::vector<float> ref = Floats(all[tied]->grad);
      for (size_t i = 0; i < sum.size(); ++i) {
        EXPECT_NEAR(sum[i] + head[i], ref[i], 1e-6f * (1 + std::fabs(ref[i])))
            << i;
      }
    }
  }
  TransformerConfig c = Named("gpt2_debug");
  TransformerOptions bad;
  bad.first_block = 1;
  bad.num_blocks = 2;
  EXPECT_EQ(Transformer::Create(c, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = {};
  bad.num_blocks = 0;
  bad.embedding = bad.head = false;
  EXPECT_EQ(Transformer::Create(c, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  TransformerOptions later;
  later.first_block = 1;
  later.embedding = false;
  auto or10 = Transformer::Create(c, later);
  ASSERT_TRUE(or10.ok()) << or10.status();
  std::unique_ptr<Transformer> part = *std::move(or10);
  EXPECT_EQ(part->blocks().size(), 1u);
  ASSERT_TRUE((part->ToEmpty(Device::Cpu())).ok());
  const absl::Status wrong = part->Forward(Ids(2, 8, c.vocab_size, 3)).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("part from block 1"), std::string::npos)
      << wrong;
}

TEST(TransformerTest, RejectsBadArguments) {
  auto model = Build(Named("gpt2_debug"));
  const Tensor too_long = Ids(1, 129, 512, 1);
  EXPECT_EQ(model->ForwardLoss(too_long, too_long).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Tensor flat = *Tensor::FromInts({4}, {1, 2, 3, 4}, DType::kI64);
  EXPECT_EQ(model->Forward(flat).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Tensor ids = Ids(2, 4, 512, 1);
  EXPECT_EQ(model->ForwardLoss(ids, Ids(1, 8, 512, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Tensor out_of_range = *Tensor::FromInts({1, 2}, {1, 512}, DType::kI64);
  EXPECT_FALSE(model->Forward(out_of_range).ok());

  TransformerOptions ints;
  ints.param_dtype = DType::kI32;
  EXPECT_EQ(Transformer::Create(Named("gpt2_debug"), ints).status().code(),
            absl::StatusCode::kInvalidArgument);
  TransformerConfig bad = Named("llama_debug");
  bad.n_kv_heads = 3;
  EXPECT_EQ(Transformer::Create(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
