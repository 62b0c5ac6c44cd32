// How many bytes each parallel layout moves in one training step (forward +
// backward of one micro-batch), counted on every mesh axis's process group
// (payload bytes: an all-gather's output, a reduce-scatter's input, an
// all-reduce's buffer) against the analytic figure from the model's shapes:
//
//   shard axis (FSDP over D):  all-gather  4 (P + P_resharded),
//                              reduce-scatter 4 P,
//     P = this rank's tensor-parallel parameter elements, P_resharded = those
//     of the blocks gathered again for backward (all but the last block);
//   tp axis (T ranks), A = B S C activation elements, N = B S rows:
//     without sequence parallelism, all-reduces of A: two per block forward
//     (attention and MLP outputs), two backward (their region inputs), the
//     embedding's output, the head's input gradient; with it, all-gathers
//     and reduce-scatters of A in their place (four of each per block, one
//     of each for the embedding and the head, plus GPT-2's position
//     embedding gradient) and all-reduces of the norms' gradients; kv
//     projections kept whole (fewer kv heads than ranks) all-reduce their
//     gradients; loss parallel all-reduces 3 N floats, gathered logits
//     all-gather B S V.
//
// The measured bytes must equal the analytic ones exactly (the debug configs
// divide evenly, so there is no padding). The test also prints, per layout,
// what each rank sends with ring algorithms: the commbench-style figure
// recorded in docs/PERFORMANCE.md for GPT-2 124M at W = 4.
#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/auto_wrap.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "models/config.h"
#include "models/gpt2/parallelize.h"
#include "models/llama/parallelize.h"
#include "models/transformer.h"
#include "optim/counting_groups.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

using models::ModelFamily;
using models::Transformer;
using models::TransformerConfig;

struct Layout {
  int dp = 1, tp = 1;
  bool sp = false;
  bool loss_parallel = true;
  int replicate = 1;  // HSDP: replicas of the [dp, tp] layout
  std::string Name() const {
    return absl::StrCat(
        replicate > 1 ? absl::StrCat("replicate", replicate, "x") : "", "dp",
        dp, "xtp", tp, sp ? "+sp" : "",
        tp > 1 && !loss_parallel ? " (gathered logits)" : "");
  }
};

// Payload bytes per axis.
struct LayoutBytes {
  testing_util::OpBytes shard, tp, replicate;
};

constexpr int64_t kF32 = 4;
constexpr int64_t kRows = 2, kSeq = 8;  // per data-parallel rank

// Tensor-parallel parameter elements of one block on one rank.
int64_t BlockElements(const TransformerConfig& c, int tp) {
  const bool gpt2 = c.family == ModelFamily::kGpt2;
  const int64_t C = c.dim, hd = c.head_dim(), H = c.n_heads, KV = c.kv_heads(),
                F = c.ffn_hidden;
  const int64_t norms = gpt2 ? 4 * C : 2 * C;
  const int64_t kv_local = KV % tp == 0 ? KV / tp : KV;  // else kept whole
  int64_t attn = H / tp * hd * C + 2 * kv_local * hd * C + C * H / tp * hd;
  int64_t mlp = (gpt2 ? 2 : 3) * C * (F / tp);
  if (gpt2) {
    attn += 3 * C / tp + C;  // c_attn bias (split), c_proj bias (whole)
    mlp += F / tp + C;       // fc bias (split), proj bias (whole)
  }
  return norms + attn + mlp;
}

// The root unit's elements on one rank: embeddings (tied head) and norm.
int64_t RootElements(const TransformerConfig& c, int tp) {
  const bool gpt2 = c.family == ModelFamily::kGpt2;
  int64_t n = c.padded_vocab_size() / tp * c.dim;  // token table (rows split)
  if (gpt2) n += c.context_length * c.dim + 2 * c.dim;  // wpe, ln_f
  if (!gpt2) n += c.dim;                                // norm
  if (!c.tied_embeddings) n += c.padded_vocab_size() / tp * c.dim;
  return n;
}

LayoutBytes Analytic(const TransformerConfig& c, const Layout& l, int64_t rows,
                     int64_t seq) {
  const bool gpt2 = c.family == ModelFamily::kGpt2;
  LayoutBytes b;
  const int64_t block = BlockElements(c, l.tp);
  const int64_t total = c.n_layers * block + RootElements(c, l.tp);
  // On a one-rank shard axis (f32 here) the parameters are views of the
  // masters: no all-gather; without replicas the gradients are cast into
  // their shards locally: no reduce-scatter.
  b.shard.all_gather =
      l.dp == 1 ? 0 : kF32 * (total + (c.n_layers - 1) * block);
  b.shard.reduce_scatter = l.dp == 1 && l.replicate == 1 ? 0 : kF32 * total;
  // HSDP: the replicas all-reduce each rank's reduce-scattered shard.
  if (l.replicate > 1) b.replicate.all_reduce = kF32 * total / l.dp;
  if (l.tp == 1) return b;
  const int64_t A = rows * seq * c.dim, N = rows * seq;
  if (!l.sp) {
    b.tp.all_reduce = kF32 * (c.n_layers * 4 * A + 2 * A);
  } else {
    const int64_t per_block = 4 * A;
    b.tp.all_gather = kF32 * (c.n_layers * per_block + 2 * A + (gpt2 ? A : 0));
    b.tp.reduce_scatter = kF32 * (c.n_layers * per_block + 2 * A);
    const int64_t norm = gpt2 ? 2 * c.dim : c.dim;
    b.tp.all_reduce = kF32 * (c.n_layers * 2 * norm + norm);
  }
  if (c.kv_heads() % l.tp != 0) {  // wk, wv kept whole: their gradients
    b.tp.all_reduce +=
        kF32 * c.n_layers * 2 * c.kv_heads() * c.head_dim() * c.dim;
  }
  if (l.loss_parallel) {
    b.tp.all_reduce += kF32 * 3 * N;
  } else {
    b.tp.all_gather += kF32 * N * c.padded_vocab_size();
  }
  return b;
}

testing_util::OpBytes Minus(const testing_util::OpBytes& a,
                            const testing_util::OpBytes& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.all_reduce - b.all_reduce};
}

std::string Ring(const LayoutBytes& b, const Layout& l) {
  const double mib = 1024.0 * 1024.0;
  return absl::StrFormat("shard %.2f MiB + tp %.2f MiB sent per rank",
                         b.shard.RingBytesSent(l.dp) / mib,
                         b.tp.RingBytesSent(l.tp) / mib);
}

// One forward + backward on `l`; rank 0's measured payload bytes.
LayoutBytes Measure(const std::string& config_name, const Layout& l) {
  LayoutBytes measured;
  std::vector<MeshAxis> axes = {{"dp", l.dp}, {"tp", l.tp}};
  if (l.replicate > 1) axes.insert(axes.begin(), {"replicate", l.replicate});
  testing_util::RunOnCountingMesh(axes, [&](int rank, DeviceMesh& mesh) {
    const TransformerConfig config = *models::ConfigByName(config_name);
    auto model = *Transformer::Create(config);
    const bool gpt2 = config.family == ModelFamily::kGpt2;
    fsdp::FsdpPlanOptions fsdp;
    fsdp.shard.mesh = &mesh;
    if (l.tp > 1) {
      models::TensorParallelPlanOptions o;
      o.sequence_parallel = l.sp;
      o.loss_parallel = l.loss_parallel;
      const absl::Status s =
          gpt2 ? models::gpt2::ApplyTensorParallel(model.get(), &mesh, o)
               : models::llama::ApplyTensorParallel(model.get(), &mesh, o);
      ASSERT_TRUE(s.ok()) << s;
      fsdp.shard.tp_axis = "tp";
    }
    // The tp axis of size 1 only exists for the mesh's shape here.
    if (l.tp == 1) fsdp.shard.tp_axis = "tp";
    absl::StatusOr<std::vector<fsdp::FsdpUnit*>> units =
        gpt2 ? models::gpt2::ApplyFsdp(model.get(), fsdp)
             : models::llama::ApplyFsdp(model.get(), fsdp);
    ASSERT_TRUE(units.ok()) << units.status();
    ASSERT_TRUE(fsdp::InitShardedWeights(model.get(), 5).ok());
    std::vector<int64_t> ids(kRows * kSeq);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = (i * 37 + 11) % 500;
    const Tensor x = *Tensor::FromInts({kRows, kSeq}, ids);
    const testing_util::OpBytes shard0 = testing_util::AxisBytes(mesh, "dp"),
                                tp0 = testing_util::AxisBytes(mesh, "tp");
    const testing_util::OpBytes replicate0 =
        l.replicate > 1 ? testing_util::AxisBytes(mesh, "replicate")
                        : testing_util::OpBytes{};
    ASSERT_TRUE(model->ForwardLoss(x, x).ok());
    ASSERT_TRUE(model->Backward().ok());
    if (rank == 0) {
      measured.shard = Minus(testing_util::AxisBytes(mesh, "dp"), shard0);
      measured.tp = Minus(testing_util::AxisBytes(mesh, "tp"), tp0);
      if (l.replicate > 1) {
        measured.replicate =
            Minus(testing_util::AxisBytes(mesh, "replicate"), replicate0);
      }
    }
  });
  return measured;
}

void ExpectEqual(const testing_util::OpBytes& got,
                 const testing_util::OpBytes& want, const std::string& what) {
  EXPECT_EQ(got.all_gather, want.all_gather) << what << " all-gather";
  EXPECT_EQ(got.reduce_scatter, want.reduce_scatter)
      << what << " reduce-scatter";
  EXPECT_EQ(got.all_reduce, want.all_reduce) << what << " all-reduce";
}

TEST(TpCommBytesTest, EveryLayoutMovesTheAnalyticBytes) {
  const std::vector<Layout> layouts = {
      {4, 1, false, true},    {2, 2, false, true},    {2, 2, true, true},
      {1, 4, false, true},    {1, 4, true, true},     {2, 2, false, false},
      {2, 1, false, true, 2}, {1, 2, false, true, 2}, {1, 2, true, true, 2}};
  for (const std::string config : {"gpt2_debug", "llama_debug"}) {
    const TransformerConfig c = *models::ConfigByName(config);
    for (const Layout& l : layouts) {
      const std::string what = absl::StrCat(config, " ", l.Name());
      const LayoutBytes got = Measure(config, l);
      const LayoutBytes want = Analytic(c, l, kRows, kSeq);
      ExpectEqual(got.shard, want.shard, what + " shard axis");
      ExpectEqual(got.tp, want.tp, what + " tp axis");
      ExpectEqual(got.replicate, want.replicate, what + " replicate axis");
      std::cout << what << ": " << Ring(got, l) << std::endl;
    }
  }
  // The analytic figures for GPT-2 124M (padded vocabulary), one sequence of
  // 256 tokens per data-parallel rank, for docs/PERFORMANCE.md.
  TransformerConfig big = *models::ConfigByName("gpt2_124m");
  big.vocab_pad_multiple = 64;
  for (const Layout& l : {Layout{4, 1}, Layout{2, 2}, Layout{2, 2, true},
                          Layout{1, 4}, Layout{1, 4, true}}) {
    std::cout << "gpt2_124m " << l.Name()
              << " (analytic, B 1 x 256): " << Ring(Analytic(big, l, 1, 256), l)
              << std::endl;
  }
}

}  // namespace
}  // namespace fsdpp
