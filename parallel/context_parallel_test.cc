// Ring attention on thread ranks over real Gloo against the unsplit fused
// attention on one process: cp = 2, 3, 4, with and without document masks,
// grouped-query heads, forward (out, lse) and backward (dq, dk, dv) within
// 1e-6 in f32 (bf16 to its rounding); uneven chunks and bad shapes are
// refused with clear errors.
#include "parallel/context_parallel.h"

#include <cstdint>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "core/logging.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"
#include "mesh/run_on_mesh.h"
#include "nn/attention.h"
#include "tensor/comm_buffer.h"
#include "tensor/ops.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace parallel {
namespace {

using testing_util::AllClose;
using testing_util::GatherRows;
using testing_util::PackedDocumentIds;
using testing_util::RandomTensor;
using testing_util::RelTol;
using testing_util::RunOnMesh;
using testing_util::Values;

Tensor Empty(const Shape& shape, DType dtype) {
  return *Tensor::Empty(shape, dtype, Device::Cpu());
}

struct Case {
  int cp;
  bool documents;
  DType dtype;
};

// Random q, k, v [B, H or KV, T, hd] and dout of the case's dtype, packed
// documents' key starts, and the unsplit fused attention's forward and
// backward (with the documents' masks when the case has them).
struct Unsplit {
  Tensor q, k, v, dout, starts, out, lse, dq, dk, dv;
};
Unsplit Reference(const Case& c, int64_t b, int64_t h, int64_t kv, int64_t hd,
                  int64_t t, float scale) {
  Unsplit u;
  u.q = RandomTensor({b, h, t, hd}, c.dtype, 1, -2, 2);
  u.k = RandomTensor({b, kv, t, hd}, c.dtype, 2, -2, 2);
  u.v = RandomTensor({b, kv, t, hd}, c.dtype, 3);
  u.dout = RandomTensor({b, h, t, hd}, c.dtype, 4);
  u.starts = Empty({b, t}, DType::kI32);
  Tensor positions = Empty({b, t}, DType::kI32);
  CHECK_OK(DocumentMask(PackedDocumentIds(b, t), 0, &u.starts, &positions));
  const KeyRange keys = c.documents ? KeyRange{&u.starts} : KeyRange{};
  u.out = Empty(u.q.shape(), c.dtype);
  u.lse = Empty({b, h, t}, DType::kF32);
  CHECK_OK(CausalAttention(u.q, u.k, u.v, scale, &u.out, &u.lse, keys));
  u.dq = Empty(u.q.shape(), c.dtype);
  u.dk = Empty(u.k.shape(), c.dtype);
  u.dv = Empty(u.k.shape(), c.dtype);
  CHECK_OK(CausalAttentionBackward(u.q, u.k, u.v, u.out, u.lse, u.dout, scale,
                                   &u.dq, &u.dk, &u.dv, keys));
  return u;
}

TEST(RingAttentionTest, EqualsTheUnsplitAttention) {
  for (const Case& c :
       {Case{2, false, DType::kF32}, Case{3, false, DType::kF32},
        Case{4, false, DType::kF32}, Case{2, true, DType::kF32},
        Case{3, true, DType::kF32}, Case{4, true, DType::kF32},
        Case{4, true, DType::kBF16}}) {
    SCOPED_TRACE(::testing::Message()
                 << "cp " << c.cp << " documents " << c.documents << " "
                 << DTypeName(c.dtype));
    const int64_t b = 2, h = 4, kv = 2, hd = 16, t = 2 * c.cp * 20;
    const float scale = 0.25f;
    const Unsplit u = Reference(c, b, h, kv, hd, t, scale);
    const Tensor &q = u.q, &k = u.k, &v = u.v, &dout = u.dout;
    const Tensor &starts = u.starts, &out = u.out, &lse = u.lse, &dq = u.dq,
                 &dk = u.dk, &dv = u.dv;
    const ContextLayout layout = *ContextLayout::Create(c.cp, t);
    const double tol = c.dtype == DType::kF32 ? 1e-6 : 4 * RelTol(c.dtype);
    RunOnMesh({{"cp", c.cp}}, [&](int rank, DeviceMesh& mesh) {
      SCOPED_TRACE(::testing::Message() << "rank " << rank);
      const std::vector<int64_t> mine = layout.Positions(rank);
      // This rank's document starts (global positions).
      Tensor doc_start = Empty({b, layout.local()}, DType::kI32);
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t i = 0; i < layout.local(); ++i) {
          doc_start.data<int32_t>()[r * layout.local() + i] =
              starts.data<int32_t>()[r * t + mine[i]];
        }
      }
      const Tensor* ds = c.documents ? &doc_start : nullptr;
      RingAttention ring(*mesh.Group("cp"), layout);
      const Tensor lq = GatherRows(q, mine), lk = GatherRows(k, mine),
                   lv = GatherRows(v, mine), ldout = GatherRows(dout, mine);
      Tensor lout = Empty(lq.shape(), c.dtype);
      Tensor llse = Empty({b, h, layout.local()}, DType::kF32);
      ASSERT_TRUE(ring.Forward(lq, lk, lv, scale, ds, &lout, &llse).ok());
      EXPECT_TRUE(
          AllClose(Values(lout), Values(GatherRows(out, mine)), tol, tol))
          << "out";
      // lse as [B, H, T, 1] rows to gather.
      const Tensor lse_rows = *lse.Reshape({b, h, t, 1});
      EXPECT_TRUE(AllClose(Values(llse), Values(GatherRows(lse_rows, mine)),
                           1e-6, 1e-6))
          << "lse";
      Tensor ldq = Empty(lq.shape(), c.dtype), ldk = Empty(lk.shape(), c.dtype),
             ldv = Empty(lk.shape(), c.dtype);
      ASSERT_TRUE(ring.Backward(lq, lk, lv, lout, llse, ldout, scale, ds, &ldq,
                                &ldk, &ldv)
                      .ok());
      EXPECT_TRUE(AllClose(Values(ldq), Values(GatherRows(dq, mine)), tol, tol))
          << "dq";
      EXPECT_TRUE(AllClose(Values(ldk), Values(GatherRows(dk, mine)), tol, tol))
          << "dk";
      EXPECT_TRUE(AllClose(Values(ldv), Values(GatherRows(dv, mine)), tol, tol))
          << "dv";
    });
  }
}

// The all-to-all style against the unsplit fused attention: each rank runs
// the same kernel on whole rows of 1 / cp of the heads, so the results are
// the unsplit ones exactly; cp 2 and 4, grouped-query heads, with and
// without document masks, f32 and bf16; heads that do not divide refused.
TEST(UlyssesAttentionTest, EqualsTheUnsplitAttentionExactly) {
  for (const Case& c :
       {Case{2, false, DType::kF32}, Case{4, false, DType::kF32},
        Case{2, true, DType::kF32}, Case{4, true, DType::kF32},
        Case{4, true, DType::kBF16}}) {
    SCOPED_TRACE(::testing::Message()
                 << "cp " << c.cp << " documents " << c.documents << " "
                 << DTypeName(c.dtype));
    const int64_t b = 2, h = 8, kv = 4, hd = 16, t = 2 * c.cp * 20;
    const float scale = 0.25f;
    const Unsplit u = Reference(c, b, h, kv, hd, t, scale);
    const Tensor &q = u.q, &k = u.k, &v = u.v, &dout = u.dout;
    const Tensor &starts = u.starts, &out = u.out, &lse = u.lse, &dq = u.dq,
                 &dk = u.dk, &dv = u.dv;
    const ContextLayout layout = *ContextLayout::Create(c.cp, t);
    RunOnMesh({{"cp", c.cp}}, [&](int rank, DeviceMesh& mesh) {
      SCOPED_TRACE(::testing::Message() << "rank " << rank);
      const std::vector<int64_t> mine = layout.Positions(rank);
      UlyssesAttention attention(*mesh.Group("cp"), layout);
      const Tensor* ks = c.documents ? &starts : nullptr;
      const Tensor lq = GatherRows(q, mine), lk = GatherRows(k, mine),
                   lv = GatherRows(v, mine), ldout = GatherRows(dout, mine);
      Tensor lout = Empty(lq.shape(), c.dtype);
      Tensor llse = Empty({b, h, layout.local()}, DType::kF32);
      absl::Status forward =
          attention.Forward(lq, lk, lv, scale, ks, &lout, &llse);
      ASSERT_TRUE(forward.ok()) << forward;
      EXPECT_EQ(Values(lout), Values(GatherRows(out, mine))) << "out";
      const Tensor lse_rows = *lse.Reshape({b, h, t, 1});
      EXPECT_EQ(Values(llse), Values(GatherRows(lse_rows, mine))) << "lse";
      Tensor ldq = Empty(lq.shape(), c.dtype), ldk = Empty(lk.shape(), c.dtype),
             ldv = Empty(lk.shape(), c.dtype);
      absl::Status backward = attention.Backward(lq, lk, lv, lout, llse, ldout,
                                                 scale, ks, &ldq, &ldk, &ldv);
      ASSERT_TRUE(backward.ok()) << backward;
      EXPECT_EQ(Values(ldq), Values(GatherRows(dq, mine))) << "dq";
      EXPECT_EQ(Values(ldk), Values(GatherRows(dk, mine))) << "dk";
      EXPECT_EQ(Values(ldv), Values(GatherRows(dv, mine))) << "dv";
      // Two key/value heads do not split over cp 4.
      if (c.cp == 4) {
        const Tensor q1 = *lq.Narrow(0, 1);
        Tensor o1 = Empty(q1.shape(), c.dtype);
        Tensor l1 = Empty({1, h, layout.local()}, DType::kF32);
        const Tensor kv2 =
            *Tensor::Zeros({1, 2, layout.local(), hd}, c.dtype, Device::Cpu());
        const absl::Status bad =
            attention.Forward(q1, kv2, kv2, scale, nullptr, &o1, &l1);
        EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(bad.message().find("8 query and 2 key/value heads on this "
                                     "rank must both be divisible"),
                  std::string::npos)
            << bad;
      }
    });
  }
}

// A model's split: rank r's runs are chunks r and 2 cp - 1 - r (one run
// where they meet, on the last rank), Local takes those columns of whole
// rows (keeping a host check's bound), and rows of another length are
// refused.
TEST(RingContextParallelTest, RunsAndLocalColumns) {
  const int cp = 3;
  const ContextLayout layout = *ContextLayout::Create(cp, 24);
  std::vector<int64_t> values(2 * 24);
  for (size_t i = 0; i < values.size(); ++i) values[i] = i;
  const Tensor whole = *Tensor::FromInts({2, 24}, values, DType::kI64);
  whole.MarkIdsCheckedBelow(100);
  RunOnMesh({{"cp", cp}}, [&](int rank, DeviceMesh& mesh) {
    RingContextParallel split(*mesh.Group("cp"), layout);
    using Run = nn::ContextParallel::Run;
    const std::vector<Run>& runs = split.runs();
    if (rank == cp - 1) {
      ASSERT_EQ(runs.size(), 1u);
      EXPECT_EQ(runs[0].start, 4 * rank);
      EXPECT_EQ(runs[0].length, 8);
    } else {
      ASSERT_EQ(runs.size(), 2u);
      EXPECT_EQ(runs[0].start, 4 * rank);
      EXPECT_EQ(runs[1].start, 4 * (2 * cp - 1 - rank));
      EXPECT_EQ(runs[1].length, 4);
    }
    EXPECT_EQ(split.local(), 8);
    const absl::StatusOr<Tensor> local = split.Local(whole);
    ASSERT_TRUE(local.ok()) << local.status();
    std::vector<int64_t> want;
    for (int64_t row = 0; row < 2; ++row) {
      for (int64_t p : layout.Positions(rank)) want.push_back(row * 24 + p);
    }
    EXPECT_EQ(*local->ToInts(), want);
    EXPECT_EQ(local->ids_checked_below(), 100);
    const Tensor short_rows =
        *Tensor::Zeros({2, 12}, DType::kI64, Device::Cpu());
    EXPECT_EQ(split.Local(short_rows).status().code(),
              absl::StatusCode::kInvalidArgument);
  });
}

// A Llama attention layer (GQA, RoPE) on each rank's rows under a
// RingAttentionCore against the layer on the whole sequence: the rows'
// outputs and input gradients equal, and the parameter gradients summed
// over the cp ranks equal the whole layer's (1e-5, f32); with and without
// document masks (RoPE then at the positions within the documents).
TEST(RingAttentionTest, LayerOnItsRowsEqualsTheWholeLayer) {
  for (bool documents : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "documents " << documents);
    const int cp = 2;
    const int64_t b = 2, t = 48, c = 32;
    const nn::AttentionConfig config =
        nn::AttentionConfig::Llama(c, 4, 2, t, 10000.0f);
    const Tensor x = RandomTensor({b, t, c}, DType::kF32, 11);
    const Tensor dy = RandomTensor({b, t, c}, DType::kF32, 12);
    Tensor starts = Empty({b, t}, DType::kI32);
    Tensor doc_positions = Empty({b, t}, DType::kI32);
    ASSERT_TRUE(
        DocumentMask(PackedDocumentIds(b, t), 0, &starts, &doc_positions).ok());
    const ContextLayout layout = *ContextLayout::Create(cp, t);
    RunOnMesh({{"cp", cp}}, [&](int rank, DeviceMesh& mesh) {
      SCOPED_TRACE(::testing::Message()
                   << "rank " << rank << " documents " << documents);
      auto make = [&] {
        auto layer = *nn::CausalSelfAttention::Create(config);
        EXPECT_TRUE(layer->ToEmpty(Device::Cpu()).ok());
        EXPECT_TRUE(layer->InitWeights(5).ok());
        return layer;
      };
      // The whole layer (every rank computes it).
      auto whole = make();
      nn::DocumentMasks masks{starts, doc_positions};
      Tensor y, dx;
      {
        nn::DocumentMasks::Scope scope(documents ? &masks : nullptr);
        y = *whole->Forward(x);
        dx = *whole->Backward(dy);
      }
      // This rank's rows ([B, T, C] as [B, 1, T, C] to gather along T).
      const std::vector<int64_t> mine = layout.Positions(rank);
      auto rows = [&](const Tensor& full) {
        return *GatherRows(*full.Reshape({b, 1, t, c}), mine)
                    .Reshape({b, layout.local(), c});
      };
      Tensor positions = *layout.PositionsTensor(rank, b, Device::Cpu());
      Tensor doc_start;
      if (documents) {
        doc_start = Empty({b, layout.local()}, DType::kI32);
        for (int64_t r = 0; r < b; ++r) {
          for (int64_t i = 0; i < layout.local(); ++i) {
            doc_start.data<int32_t>()[r * layout.local() + i] =
                starts.data<int32_t>()[r * t + mine[i]];
            positions.data<int32_t>()[r * layout.local() + i] =
                doc_positions.data<int32_t>()[r * t + mine[i]];
          }
        }
      }
      ProcessGroup* group = *mesh.Group("cp");
      RingAttention ring(group, layout);
      RingAttentionCore core(&ring, positions, doc_start);
      auto split = make();
      Tensor y_rows, dx_rows;
      {
        nn::ContextParallelCore::Scope scope(&core);
        absl::StatusOr<Tensor> out = split->Forward(rows(x));
        ASSERT_TRUE(out.ok()) << out.status();
        y_rows = *out;
        absl::StatusOr<Tensor> back = split->Backward(rows(dy));
        ASSERT_TRUE(back.ok()) << back.status();
        dx_rows = *back;
      }
      EXPECT_TRUE(AllClose(Values(y_rows), Values(rows(y)), 1e-5, 1e-5)) << "y";
      EXPECT_TRUE(AllClose(Values(dx_rows), Values(rows(dx)), 1e-5, 1e-5))
          << "dx";
      const auto whole_params = whole->NamedParameters();
      const auto split_params = split->NamedParameters();
      ASSERT_EQ(whole_params.size(), split_params.size());
      for (size_t p = 0; p < split_params.size(); ++p) {
        Tensor grad = split_params[p].second->grad;
        ASSERT_TRUE((*group->AllReduce(AsBuffer(grad), ReduceOp::kSum))
                        ->Wait(absl::Minutes(1))
                        .ok());
        EXPECT_TRUE(AllClose(Values(grad), Values(whole_params[p].second->grad),
                             1e-5, 1e-5))
            << split_params[p].first;
      }
    });
  }
}

TEST(RingAttentionTest, RefusesUnevenChunksAndBadShapes) {
  absl::StatusOr<ContextLayout> uneven = ContextLayout::Create(3, 100);
  EXPECT_EQ(uneven.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(uneven.status().message().find(
                "must be a positive multiple of 2 x cp = 6"),
            std::string::npos)
      << uneven.status();
  EXPECT_FALSE(ContextLayout::Create(0, 8).ok());
  const ContextLayout layout = *ContextLayout::Create(2, 16);
  EXPECT_EQ(layout.Positions(1),
            (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  RunOnMesh({{"cp", 2}}, [&](int rank, DeviceMesh& mesh) {
    RingAttention ring(*mesh.Group("cp"), layout);
    const Tensor q = RandomTensor({1, 2, 6, 8}, DType::kF32, 1);  // L is 8
    Tensor out = Empty(q.shape(), DType::kF32);
    Tensor lse = Empty({1, 2, 6}, DType::kF32);
    const absl::Status s = ring.Forward(q, q, q, 1.0f, nullptr, &out, &lse);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rank;
    EXPECT_NE(s.message().find("with L = 8 (this rank's rows)"),
              std::string::npos)
        << s;
  });
}

}  // namespace
}  // namespace parallel
}  // namespace fsdpp
