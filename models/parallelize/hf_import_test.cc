// ImportHfSharded: on FSDP 1, 2 and 3 ranks, HSDP 2 x 2 and FSDP 2 x TP 2
// every rank's masters equal its boxes of the exported model (bitwise;
// padded vocabulary rows zero), each rank reads only its boxes (bytes
// counted), one buffer at a time (memory accounting), and a mismatching
// directory is refused with nothing written; OLMoE's per-expert tensors
// land in the stacked experts' boxes (FSDP, HSDP, expert parallelism); a
// PEFT adapter lands in the
// sharded adapters' boxes (FSDP, FSDP x TP) or is refused whole.
#include "models/parallelize/hf_import.h"

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/logging.h"
#include "formats/file_util.h"
#include "formats/safetensors/safetensors.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mesh/run_on_mesh.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/parallelize/block_plan.h"
#include "models/parallelize/tensor_parallel_plan.h"
#include "models/transformer.h"
#include "nn/moe.h"
#include "parallel/expert_parallel.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace models {
namespace {

using ::testing::HasSubstr;

TransformerConfig PaddedConfig(const std::string& name) {
  absl::StatusOr<TransformerConfig> c = ConfigByName(name);
  EXPECT_TRUE(c.ok());
  c->vocab_size = 500;  // Rows 500..511 are padding.
  c->vocab_pad_multiple = 64;
  return *c;
}

// The reference model (seed 17) and its sharded export.
struct Exported {
  std::unique_ptr<Transformer> model;
  std::string dir;
};
Exported Export(const std::string& name) {
  Exported e;
  auto made = Transformer::Create(PaddedConfig(name));
  EXPECT_TRUE(made.ok());
  e.model = std::move(*made);
  EXPECT_TRUE(e.model->ToEmpty(Device::Cpu()).ok());
  EXPECT_TRUE(e.model->InitWeights(17).ok());
  const char* tmp = std::getenv("TEST_TMPDIR");
  e.dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "_hf");
  EXPECT_TRUE(RemoveTree(e.dir).ok());
  auto tensors = ExportHfTensors(*e.model);
  EXPECT_TRUE(tensors.ok());
  HfWriteOptions options;
  options.max_shard_bytes = 100 << 10;
  EXPECT_TRUE(
      WriteHfDirectory(e.dir, e.model->config(), *tensors, options).ok());
  return e;
}

// `box` of `t` (row-major, any shape holding the box) as a new tensor.
Tensor BoxOf(const Tensor& t, const Box& box) {
  Tensor out = *Tensor::Empty(box.shape, t.dtype(), Device::Cpu());
  EXPECT_TRUE(
      CopyBox(t, box.offset, &out, Shape(box.shape.size(), 0), box.shape).ok());
  return out;
}

// A model of `config` sharded on `mesh` (FSDP, HSDP on 2 axes; with `tp`,
// FSDP x TP on [dp, tp]), its masters randomly initialised.
std::unique_ptr<Transformer> Sharded(const TransformerConfig& config,
                                     DeviceMesh& mesh, bool tp,
                                     const LoraOptions* lora = nullptr) {
  auto made = Transformer::Create(config);
  CHECK_OK(made.status());
  Transformer* model = made->get();
  if (lora != nullptr) CHECK_OK(AddLoraAdapters(model, *lora).status());
  if (tp) {
    TensorParallelPlanOptions tpo;
    tpo.loss_parallel = false;
    CHECK_OK(ApplyTensorParallelPlan(model, config.family, "test", &mesh, tpo));
  }
  fsdp::FsdpPlanOptions options;
  options.shard.mesh = &mesh;
  if (tp) options.shard.tp_axis = "tp";
  CHECK_OK(ApplyBlockPlan(model, config.family, "test", options).status());
  CHECK_OK(fsdp::InitShardedWeights(model, 99));
  return std::move(*made);
}

// Builds the sharded model on `mesh`, imports, and checks every master.
// With `ep` > 1 (a 1-D mesh, a mixture of experts) the experts are split
// over ep ranks first and each layer's experts sharded on the expert mesh
// [efsdp, ep], as the recipe does.
void ImportAndCheck(const Exported& e, DeviceMesh& mesh, bool tp, int ep = 1) {
  std::unique_ptr<DeviceMesh> expert_mesh;
  std::unique_ptr<parallel::ExpertParallel> expert_parallel;
  std::unique_ptr<Transformer> sharded;
  if (ep > 1) {
    absl::StatusOr<std::unique_ptr<DeviceMesh>> reshaped =
        mesh.Reshape({{"efsdp", mesh.size() / ep}, {"ep", ep}}, "experts");
    ASSERT_TRUE(reshaped.ok()) << reshaped.status();
    expert_mesh = std::move(*reshaped);
    expert_parallel = std::make_unique<parallel::ExpertParallel>(
        *expert_mesh->Group("ep"), absl::Seconds(60));
    auto made = Transformer::Create(e.model->config());
    ASSERT_TRUE(made.ok());
    sharded = std::move(*made);
    ASSERT_TRUE(parallel::ShardExperts(*sharded, expert_parallel.get()).ok());
    fsdp::FullyShardOptions experts;
    experts.mesh = expert_mesh.get();
    experts.ep_axis = "ep";
    for (nn::MoE* moe : sharded->moe_layers()) {
      ASSERT_TRUE(fsdp::FullyShard({moe->experts()}, experts).ok());
    }
    fsdp::FsdpPlanOptions options;
    options.shard.mesh = &mesh;
    ASSERT_TRUE(
        ApplyBlockPlan(sharded.get(), e.model->config().family, "test", options)
            .ok());
    ASSERT_TRUE(fsdp::InitShardedWeights(sharded.get(), 99).ok());
  } else {
    sharded = Sharded(e.model->config(), mesh, tp);
  }
  Transformer* model = sharded.get();

  absl::StatusOr<std::unique_ptr<HfDirectory>> dir = HfDirectory::Open(e.dir);
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<HfShardedImportStats> stats = ImportHfSharded(**dir, model);
  ASSERT_TRUE(stats.ok()) << stats.status();

  std::map<std::string, Parameter*> reference;
  for (const auto& [name, p] : e.model->NamedParameters()) reference[name] = p;
  uint64_t expected_bytes = 0;
  uint64_t largest = 0;
  for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model)) {
    SCOPED_TRACE(sp->name);
    const Box box = sp->master.local_box();
    // The reference, seen as the master's view, with the padded vocabulary
    // rows zeroed (they are not in the file).
    Tensor full = *reference.at(sp->name)->data.Reshape(sp->master.shape());
    Tensor want = BoxOf(full, box);
    if (sp->name == "wte.weight" || sp->name == "tok_embeddings.weight" ||
        sp->name == "output.weight") {
      const int64_t width = box.shape[1];
      for (int64_t r = 0; r < box.shape[0]; ++r) {
        if (box.offset[0] + r >= 500) {
          std::memset(static_cast<char*>(want.raw_data()) + r * width * 4, 0,
                      width * 4);
        }
      }
    }
    Tensor got =
        BoxOf(sp->master.local(), Box{Shape(box.shape.size(), 0), box.shape});
    EXPECT_TRUE(testing_util::BitwiseEqual(got, want));
    expected_bytes += want.nbytes();
    // A one-dim-split view is read one block at a time, stacked experts
    // one expert at a time.
    uint64_t buffer = want.nbytes();
    if ((sp->master.shape().size() > sp->shape.size() ||
         sp->name.find(".experts.") != std::string::npos) &&
        box.shape[0] > 0) {
      buffer /= box.shape[0];
    }
    largest = std::max(largest, buffer);
  }
  EXPECT_EQ(stats->bytes_read, expected_bytes);
  EXPECT_EQ(stats->largest_buffer_bytes, largest);
  EXPECT_GT(stats->tensors, 0);
}

class HfImportTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfImportTest, EveryRankReadsExactlyItsBoxes) {
  const Exported e = Export(GetParam());
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("FSDP ", world));
    testing_util::RunOnMesh({{"dp", world}}, [&](int, DeviceMesh& mesh) {
      ImportAndCheck(e, mesh, /*tp=*/false);
    });
  }
  SCOPED_TRACE("HSDP 2 x 2");
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 2}},
      [&](int, DeviceMesh& mesh) { ImportAndCheck(e, mesh, /*tp=*/false); });
}

TEST_P(HfImportTest, TensorParallelPiecesToo) {
  const Exported e = Export(GetParam());
  testing_util::RunOnMesh({{"dp", 2}, {"tp", 2}}, [&](int, DeviceMesh& mesh) {
    ImportAndCheck(e, mesh, /*tp=*/true);
  });
}

INSTANTIATE_TEST_SUITE_P(Models, HfImportTest,
                         ::testing::Values("gpt2_debug", "llama_debug"));

// OLMoE's experts (one HF tensor each) into the stacked masters' boxes:
// FSDP 1, 2 and 3 (uneven rows of experts), HSDP 2 x 2, and expert
// parallelism (ep 2 on 2 ranks, ep 2 x efsdp 2 on 4).
TEST(HfImportExpertsTest, EveryRankReadsItsExperts) {
  const Exported e = Export("olmoe_debug");
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("FSDP ", world));
    testing_util::RunOnMesh({{"dp", world}}, [&](int, DeviceMesh& mesh) {
      ImportAndCheck(e, mesh, /*tp=*/false);
    });
  }
  testing_util::RunOnMesh(
      {{"replicate", 2}, {"shard", 2}},
      [&](int, DeviceMesh& mesh) { ImportAndCheck(e, mesh, /*tp=*/false); });
  for (int world : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("ep 2 on ", world));
    testing_util::RunOnMesh({{"dp", world}}, [&](int, DeviceMesh& mesh) {
      ImportAndCheck(e, mesh, /*tp=*/false, /*ep=*/2);
    });
  }
}

// One rank alone (so the process's accounting is its own): the memory the
// import allocates at once is its one read buffer.
TEST(HfImportMemoryTest, PeakIsOneReadBuffer) {
  const Exported e = Export("gpt2_debug");
  testing_util::RunOnMesh({{"dp", 1}}, [&](int, DeviceMesh& mesh) {
    std::unique_ptr<Transformer> made = Sharded(e.model->config(), mesh, false);
    absl::StatusOr<std::unique_ptr<HfDirectory>> dir = HfDirectory::Open(e.dir);
    ASSERT_TRUE(dir.ok());
    Allocator* cpu = GetAllocator(Device::Cpu());
    const MemoryStats before = cpu->Stats();
    cpu->ResetPeak();
    absl::StatusOr<HfShardedImportStats> stats =
        ImportHfSharded(**dir, made.get());
    ASSERT_TRUE(stats.ok()) << stats.status();
    const MemoryStats after = cpu->Stats();
    const int64_t grew = after.total_peak - before.total_current;
    EXPECT_LE(grew, static_cast<int64_t>(stats->largest_buffer_bytes));
    EXPECT_EQ(after.total_current, before.total_current);
    // And far below the model itself.
    EXPECT_LT(4 * stats->largest_buffer_bytes, stats->bytes_read);
  });
}

TEST(HfImportErrorsTest, AMismatchWritesNothing) {
  const Exported gpt2 = Export("gpt2_debug");
  const Exported llama = Export("llama_debug");
  testing_util::RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    std::unique_ptr<Transformer> made =
        Sharded(gpt2.model->config(), mesh, false);
    std::vector<Tensor> before;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(made.get())) {
      before.push_back(BoxOf(sp->master.local(),
                             Box{Shape(sp->master.local().shape().size(), 0),
                                 sp->master.local().shape()}));
    }
    absl::StatusOr<std::unique_ptr<HfDirectory>> dir =
        HfDirectory::Open(llama.dir);
    ASSERT_TRUE(dir.ok());
    absl::StatusOr<HfShardedImportStats> stats =
        ImportHfSharded(**dir, made.get());
    EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        stats.status().message(),
        HasSubstr("model_type is \"llama\", the model has family gpt2"));
    size_t i = 0;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(made.get())) {
      const Tensor& now = sp->master.local();
      EXPECT_TRUE(testing_util::BitwiseEqual(now, before[i])) << sp->name;
      ++i;
    }
  });
}

// LoRA r 4 on every projection of the blocks.
LoraOptions AllProjections(const TransformerConfig& config) {
  LoraOptions lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.targets =
      config.family == ModelFamily::kGpt2
          ? std::vector<std::string>{"c_attn", "c_proj", "fc", "proj"}
          : std::vector<std::string>{"wq",   "wk", "wv",  "wo",
                                     "gate", "up", "down"};
  return lora;
}

// `model`'s adapters as PEFT saves them into `dir` (all of them, or all
// but `skip`), with r and lora_alpha `r` and 8.
void WritePeft(const Transformer& model, const std::string& dir, int64_t r,
               const std::string& skip = "") {
  auto mapping = HfNameMapping(model.config());
  ASSERT_TRUE(mapping.ok());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, p] : model.NamedParameters()) {
    if (!IsLoraParameter(name) || name == skip) continue;
    tensors.emplace_back(*PeftAdapterName(*mapping, name), p->data);
  }
  ASSERT_TRUE(RemoveTree(dir).ok());
  ASSERT_TRUE(MakeDirs(dir).ok());
  ASSERT_TRUE(
      WriteSafetensors(dir + "/adapter_model.safetensors", tensors).ok());
  ASSERT_TRUE(
      WriteFileAtomically(dir + "/adapter_config.json",
                          absl::StrCat("{\"peft_type\": \"LORA\", \"r\": ", r,
                                       ", \"lora_alpha\": 8}"))
          .ok());
}

// A PEFT adapter into sharded adapters: at FSDP 2 and FSDP 2 x TP 2 each
// rank's adapter masters are its boxes of the reference's, bitwise; a file
// missing one adapter or of another r is refused with nothing written.
TEST_P(HfImportTest, PeftAdaptersIntoTheirBoxes) {
  const Exported e = Export(GetParam());
  const TransformerConfig& config = e.model->config();
  const LoraOptions lora = AllProjections(config);
  auto reference = Transformer::Create(config);
  ASSERT_TRUE(reference.ok());
  ASSERT_TRUE(AddLoraAdapters(reference->get(), lora).ok());
  for (auto& [name, p] : (*reference)->NamedParameters()) {
    if (IsLoraParameter(name)) p->init = InitSpec::Uniform(-1.0f, 1.0f);
  }
  ASSERT_TRUE((*reference)->ToEmpty(Device::Cpu()).ok());
  ASSERT_TRUE((*reference)->InitWeights(23).ok());
  const std::string adapter = e.dir + "_adapter";
  WritePeft(**reference, adapter, lora.rank);
  std::map<std::string, Parameter*> want;
  for (const auto& [name, p] : (*reference)->NamedParameters()) {
    want[name] = p;
  }
  for (bool tp : {false, true}) {
    SCOPED_TRACE(tp ? "FSDP 2 x TP 2" : "FSDP 2");
    const std::vector<MeshAxis> axes =
        tp ? std::vector<MeshAxis>{{"dp", 2}, {"tp", 2}}
           : std::vector<MeshAxis>{{"dp", 2}};
    testing_util::RunOnMesh(axes, [&](int, DeviceMesh& mesh) {
      std::unique_ptr<Transformer> model = Sharded(config, mesh, tp, &lora);
      absl::StatusOr<HfShardedImportStats> stats =
          ImportPeftAdapterSharded(adapter, lora, model.get());
      ASSERT_TRUE(stats.ok()) << stats.status();
      int64_t adapters = 0;
      for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model.get())) {
        if (!IsLoraParameter(sp->name)) continue;
        ++adapters;
        const Box box = sp->master.local_box();
        Tensor full = *want.at(sp->name)->data.Reshape(sp->master.shape());
        EXPECT_TRUE(testing_util::BitwiseEqual(
            BoxOf(sp->master.local(),
                  Box{Shape(box.shape.size(), 0), box.shape}),
            BoxOf(full, box)))
            << sp->name;
      }
      EXPECT_EQ(stats->tensors, adapters);
    });
  }
  // Refusals, before anything is written.
  const std::string first = lora.targets[0] == "c_attn"
                                ? "h.0.attn.c_attn.lora_B.weight"
                                : "layers.0.attention.wq.lora_B.weight";
  const std::string missing = e.dir + "_adapter_missing";
  WritePeft(**reference, missing, lora.rank, first);
  const std::string other_r = e.dir + "_adapter_r8";
  WritePeft(**reference, other_r, 8);
  testing_util::RunOnMesh({{"dp", 2}}, [&](int, DeviceMesh& mesh) {
    std::unique_ptr<Transformer> model = Sharded(config, mesh, false, &lora);
    std::vector<Tensor> before;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model.get())) {
      before.push_back(BoxOf(sp->master.local(),
                             Box{Shape(sp->master.local().shape().size(), 0),
                                 sp->master.local().shape()}));
    }
    absl::Status s =
        ImportPeftAdapterSharded(missing, lora, model.get()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("for ", first)));
    s = ImportPeftAdapterSharded(other_r, lora, model.get()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(),
                HasSubstr("r 8, lora_alpha 8, but model.lora has rank 4"));
    size_t i = 0;
    for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model.get())) {
      EXPECT_TRUE(testing_util::BitwiseEqual(sp->master.local(), before[i++]))
          << sp->name;
    }
  });
}

}  // namespace
}  // namespace models
}  // namespace fsdpp
