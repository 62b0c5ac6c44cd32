// ProcessGroup over real Gloo (loopback TCP), ranks as threads: every op x
// dtypes x world sizes 1..5 x counts that do and do not divide evenly,
// checked exactly against a local reference; concurrency, stream ordering and
// fault handling (a rank that never joins, a rank that dies mid-collective).
#include "comm/gloo_backend.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo_ranks.h"
#include "comm/store.h"
#include "core/allocator.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(60);

GlooOptions FastOptions() {
  GlooOptions o;
  o.timeout = absl::Seconds(30);
  return o;
}

// Runs fn(rank, group) on `size` thread ranks sharing one in-memory store.
void RunRanks(int size, const std::function<void(int, GlooProcessGroup&)>& fn,
              const std::string& name = "g",
              GlooOptions options = FastOptions()) {
  testing_util::RunGlooRanks(size, fn, name, options);
}

// Exactly representable test values (small integers, so f32/bf16/f16 sums
// and maxima are exact whatever the reduction order).
double Value(int rank, int64_t i) {
  return static_cast<double>((rank * 7 + i * 3) % 23 - 11);
}

// A host buffer of `count` elements of `dtype`.
struct HostBuffer {
  HostBuffer(int64_t count, DType dtype)
      : bytes(std::max<int64_t>(1, count) * DTypeSize(dtype)),
        buffer{bytes.data(), count, dtype, Device::Cpu()} {}
  void Set(int64_t i, double v) {
    switch (buffer.dtype) {
      case DType::kF32:
        reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(v);
        break;
      case DType::kBF16:
        reinterpret_cast<BFloat16*>(bytes.data())[i] =
            FloatToBFloat16(static_cast<float>(v));
        break;
      case DType::kF16:
        reinterpret_cast<Float16*>(bytes.data())[i] =
            FloatToFloat16(static_cast<float>(v));
        break;
      case DType::kI32:
        reinterpret_cast<int32_t*>(bytes.data())[i] = static_cast<int32_t>(v);
        break;
      case DType::kI64:
        reinterpret_cast<int64_t*>(bytes.data())[i] = static_cast<int64_t>(v);
        break;
      case DType::kU8:
        reinterpret_cast<uint8_t*>(bytes.data())[i] = static_cast<uint8_t>(v);
        break;
    }
  }
  double Get(int64_t i) const {
    switch (buffer.dtype) {
      case DType::kF32:
        return reinterpret_cast<const float*>(bytes.data())[i];
      case DType::kBF16:
        return BFloat16ToFloat(
            reinterpret_cast<const BFloat16*>(bytes.data())[i]);
      case DType::kF16:
        return Float16ToFloat(
            reinterpret_cast<const Float16*>(bytes.data())[i]);
      case DType::kI32:
        return reinterpret_cast<const int32_t*>(bytes.data())[i];
      case DType::kI64:
        return static_cast<double>(
            reinterpret_cast<const int64_t*>(bytes.data())[i]);
      case DType::kU8:
        return reinterpret_cast<const uint8_t*>(bytes.data())[i];
    }
    return 0;
  }
  std::vector<char> bytes;
  Buffer buffer;
};

// The expected result of reducing Value(r, i) over ranks, as the backend
// computes it (f32 accumulation; avg multiplies by 1/size in f32, then
// rounds to the storage type).
double Reduced(int size, int64_t i, ReduceOp op, DType dtype) {
  double acc = op == ReduceOp::kMax ? -1e30 : 0.0;
  for (int r = 0; r < size; ++r) {
    acc = op == ReduceOp::kMax ? std::max(acc, Value(r, i)) : acc + Value(r, i);
  }
  if (op != ReduceOp::kAvg) return acc;
  const float avg = static_cast<float>(acc) * (1.0f / static_cast<float>(size));
  if (dtype == DType::kBF16) return BFloat16ToFloat(FloatToBFloat16(avg));
  if (dtype == DType::kF16) return Float16ToFloat(FloatToFloat16(avg));
  return avg;
}

const int64_t kCounts[] = {0, 1, 7, 64, 1001};

// The all-gather and reduce-scatter tests run over both transports: TCP
// and shared memory (GlooOptions::shared_memory; the thread ranks share a
// host).
class GlooTransportTest : public ::testing::TestWithParam<bool> {
 protected:
  GlooOptions Options() const {
    GlooOptions o = FastOptions();
    o.shared_memory = GetParam();
    return o;
  }
  void Run(int size, const std::function<void(int, GlooProcessGroup&)>& fn,
           const std::string& name = "g") const {
    RunRanks(
        size,
        [&](int rank, GlooProcessGroup& group) {
          ASSERT_EQ(group.uses_shared_memory(), GetParam() && size > 1);
          fn(rank, group);
        },
        name, Options());
  }
};

INSTANTIATE_TEST_SUITE_P(Transports, GlooTransportTest,
                         ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SharedMemory" : "Tcp";
                         });

TEST_P(GlooTransportTest, AllGatherEveryDTypeAndSize) {
  for (int size = 1; size <= 5; ++size) {
    Run(size, [&](int rank, GlooProcessGroup& group) {
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64, DType::kU8}) {
        for (int64_t count : kCounts) {
          HostBuffer in(count, dtype), out(count * size, dtype);
          for (int64_t i = 0; i < count; ++i)
            in.Set(i, std::fabs(Value(rank, i)));
          auto work = group.AllGather(in.buffer, out.buffer);
          ASSERT_TRUE(work.ok()) << work.status();
          ASSERT_TRUE((*work)->Wait(kWait).ok());
          for (int r = 0; r < size; ++r) {
            for (int64_t i = 0; i < count; ++i) {
              ASSERT_EQ(out.Get(r * count + i), std::fabs(Value(r, i)))
                  << "size " << size << " " << DTypeName(dtype) << " count "
                  << count;
            }
          }
          // In place: the input already sits in the output at rank * count.
          HostBuffer io(count * size, dtype);
          for (int64_t i = 0; i < count; ++i)
            io.Set(rank * count + i, std::fabs(Value(rank, i)));
          Buffer slice = io.buffer;
          slice.data = io.bytes.data() + rank * count * DTypeSize(dtype);
          slice.count = count;
          ASSERT_TRUE((*group.AllGather(slice, io.buffer))->Wait(kWait).ok());
          for (int r = 0; r < size; ++r) {
            for (int64_t i = 0; i < count; ++i) {
              ASSERT_EQ(io.Get(r * count + i), std::fabs(Value(r, i)));
            }
          }
        }
      }
    });
  }
}

// FSDP's layout for AllGatherRuns: parameters of `rows` x `inner` elements
// (two of them `outer` = 3 blocks of rows), each starting on a multiple of
// 16 elements (gaps between them), rank r holding its chunk of every
// parameter's rows (none when a parameter has fewer rows than ranks). One
// parameter is 5 MiB of f32: more pieces than the shared memory has slots.
std::vector<std::vector<BufferRun>> ParamRuns(int size, int64_t* elements) {
  struct Param {
    int64_t outer, rows, inner;
  };
  const Param params[] = {{1, 7, 5},  {3, 5, 2},         {1, 1, 9},
                          {1, 64, 1}, {1, 5 << 10, 256}, {3, 2, 1}};
  std::vector<std::vector<BufferRun>> runs(size);
  int64_t start = 0;
  for (const Param& p : params) {
    const int64_t chunk = (p.rows + size - 1) / size;
    for (int r = 0; r < size; ++r) {
      const int64_t begin = std::min(p.rows, r * chunk);
      const int64_t length = std::min(p.rows, begin + chunk) - begin;
      for (int64_t o = 0; o < p.outer; ++o) {
        if (length > 0) {
          runs[r].push_back(
              {start + (o * p.rows + begin) * p.inner, length * p.inner});
        }
      }
    }
    start += (p.outer * p.rows * p.inner + 3 + 15) / 16 * 16;  // a gap
  }
  *elements = start;
  return runs;
}

TEST_P(GlooTransportTest, AllGatherRunsFillsEveryRanksRuns) {
  for (int size : {1, 2, 3, 4}) {
    Run(size, [&](int rank, GlooProcessGroup& group) {
      int64_t elements = 0;
      const std::vector<std::vector<BufferRun>> runs =
          ParamRuns(size, &elements);
      HostBuffer out(elements, DType::kF32);
      if (!GetParam() || size == 1) {
        // Rank order only: TCP's ring (and one rank, which shares nothing).
        ASSERT_FALSE(group.AllGathersRuns());
        ASSERT_EQ(group.AllGatherRuns(out.buffer, runs).status().code(),
                  absl::StatusCode::kUnimplemented);
        return;
      }
      ASSERT_TRUE(group.AllGathersRuns());
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        HostBuffer buffer(elements, dtype);
        // The gaps hold -1 on every rank, and other ranks' runs -2 here.
        for (int64_t i = 0; i < elements; ++i) buffer.Set(i, -1);
        for (int r = 0; r < size; ++r) {
          for (const BufferRun& run : runs[r]) {
            for (int64_t i = run.offset; i < run.offset + run.count; ++i) {
              buffer.Set(i, r == rank ? std::fabs(Value(r, i)) : -2);
            }
          }
        }
        auto work = group.AllGatherRuns(buffer.buffer, runs);
        ASSERT_TRUE(work.ok()) << work.status();
        ASSERT_TRUE((*work)->Wait(kWait).ok());
        std::vector<int> owner(elements, -1);
        for (int r = 0; r < size; ++r) {
          for (const BufferRun& run : runs[r]) {
            for (int64_t i = run.offset; i < run.offset + run.count; ++i) {
              owner[i] = r;
            }
          }
        }
        for (int64_t i = 0; i < elements; ++i) {
          const double want =
              owner[i] < 0 ? -1.0 : std::fabs(Value(owner[i], i));
          ASSERT_EQ(buffer.Get(i), want)
              << "size " << size << " " << DTypeName(dtype) << " element " << i
              << " of rank " << owner[i];
        }
      }
    });
  }
}

TEST_P(GlooTransportTest, AllGatherRunsRejectsBadRunsAtIssue) {
  if (!GetParam()) GTEST_SKIP() << "runs go through shared memory only";
  Run(2, [&](int rank, GlooProcessGroup& group) {
    HostBuffer out(100, DType::kF32);
    auto code = [&](const std::vector<std::vector<BufferRun>>& runs) {
      return group.AllGatherRuns(out.buffer, runs).status();
    };
    const absl::Status overlap = code({{{0, 10}}, {{5, 10}}});
    EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(overlap.message(), HasSubstr("[0, 10) and [5, 15) overlap"));
    const absl::Status outside = code({{{0, 10}}, {{95, 10}}});
    EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(outside.message(),
                HasSubstr("rank 1's run [95, 105) is not inside the output's "
                          "100 elements"));
    EXPECT_EQ(code({{{0, -1}}, {}}).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(code({{{0, 10}}}).code(), absl::StatusCode::kInvalidArgument);
    // Rejected ops took no ticket: the next op runs.
    for (int64_t i = 0; i < 100; ++i) out.Set(i, rank == i / 50 ? i : -1);
    ASSERT_TRUE((*group.AllGatherRuns(out.buffer, {{{0, 50}}, {{50, 50}}}))
                    ->Wait(kWait)
                    .ok());
    for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(out.Get(i), i);
  });
}

// ReduceScatterSpans over ParamRuns' layout: rank q's chunk is every
// parameter's rows of rank q, as spans of this rank's gradient buffer, and
// some parameters are unused on some ranks (spans of zeros). Each element
// reduces the ranks' values at its place in the buffer, in f32, into an f32
// (widened from bf16) or a bf16 output.
TEST_P(GlooTransportTest, ReduceScatterSpansReducesEachRanksChunk) {
  for (int size : {1, 2, 3}) {
    Run(size, [&](int rank, GlooProcessGroup& group) {
      int64_t elements = 0;
      const std::vector<std::vector<BufferRun>> runs =
          ParamRuns(size, &elements);
      // Run j of every rank's chunk is unused on rank w when (j + w) % 3 == 0.
      auto unused = [](size_t j, int w) { return (j + w) % 3 == 0; };
      int64_t count = 0;
      for (const BufferRun& run : runs[rank]) count += run.count;
      if (!GetParam() || size == 1) {
        HostBuffer out(count, DType::kF32);
        ASSERT_FALSE(group.ReduceScattersSpans());
        ASSERT_EQ(
            group
                .ReduceScatterSpans(DType::kF32, {}, out.buffer, ReduceOp::kSum)
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
        return;
      }
      ASSERT_TRUE(group.ReduceScattersSpans());
      for (auto [dtype, out_dtype] : {std::pair{DType::kF32, DType::kF32},
                                      std::pair{DType::kBF16, DType::kF32},
                                      std::pair{DType::kBF16, DType::kBF16}}) {
        HostBuffer grads(elements, dtype);
        for (int64_t i = 0; i < elements; ++i) grads.Set(i, Value(rank, i));
        std::vector<std::vector<BufferSpan>> spans(size);
        for (int q = 0; q < size; ++q) {
          for (size_t j = 0; j < runs[q].size(); ++j) {
            const BufferRun& run = runs[q][j];
            spans[q].push_back(
                {unused(j, rank)
                     ? nullptr
                     : grads.bytes.data() + run.offset * DTypeSize(dtype),
                 run.count});
          }
        }
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          HostBuffer out(count, out_dtype);
          auto work = group.ReduceScatterSpans(dtype, spans, out.buffer, op);
          ASSERT_TRUE(work.ok()) << work.status();
          ASSERT_TRUE((*work)->Wait(kWait).ok());
          int64_t k = 0;
          for (size_t j = 0; j < runs[rank].size(); ++j) {
            const BufferRun& run = runs[rank][j];
            for (int64_t i = run.offset; i < run.offset + run.count; ++i) {
              float acc = op == ReduceOp::kMax ? -1e30f : 0.0f;
              for (int w = 0; w < size; ++w) {
                const float v = unused(j, w) ? 0.0f : Value(w, i);
                acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
              }
              if (op == ReduceOp::kAvg) acc *= 1.0f / static_cast<float>(size);
              if (out_dtype == DType::kBF16) {
                acc = BFloat16ToFloat(FloatToBFloat16(acc));
              }
              ASSERT_EQ(out.Get(k++), acc)
                  << "size " << size << " " << DTypeName(dtype) << " into "
                  << DTypeName(out_dtype) << " " << ReduceOpName(op)
                  << " element " << i;
            }
          }
        }
      }
      // Bad spans are rejected before the op takes its turn.
      HostBuffer out(count, DType::kF32);
      std::vector<std::vector<BufferSpan>> spans(size);
      for (int q = 0; q < size; ++q) {
        for (const BufferRun& run : runs[q]) {
          spans[q].push_back({nullptr, run.count});
        }
      }
      auto wrong = spans;
      wrong[rank].push_back({nullptr, 1});
      const absl::Status total =
          group
              .ReduceScatterSpans(DType::kF32, wrong, out.buffer,
                                  ReduceOp::kSum)
              .status();
      EXPECT_EQ(total.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(total.message(),
                  HasSubstr(absl::StrCat("this rank's spans hold ", count + 1,
                                         " elements, its output ", count)));
      wrong = spans;
      wrong[(rank + 1) % size].push_back({nullptr, -1});
      EXPECT_EQ(group
                    .ReduceScatterSpans(DType::kF32, wrong, out.buffer,
                                        ReduceOp::kSum)
                    .status()
                    .code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(
          group.ReduceScatterSpans(DType::kF32, {}, out.buffer, ReduceOp::kSum)
              .status()
              .code(),
          absl::StatusCode::kInvalidArgument);
      HostBuffer half(count, DType::kBF16);
      EXPECT_THAT(group
                      .ReduceScatterSpans(DType::kF32, spans, half.buffer,
                                          ReduceOp::kSum)
                      .status()
                      .message(),
                  HasSubstr("input is f32, output is bf16"));
      // Zeros from every rank after the rejected ops: they took no turn.
      ASSERT_TRUE((*group.ReduceScatterSpans(DType::kF32, spans, out.buffer,
                                             ReduceOp::kSum))
                      ->Wait(kWait)
                      .ok());
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(out.Get(i), 0.0);
    });
  }
}

TEST_P(GlooTransportTest, ReduceScatterUnevenChunks) {
  for (int size = 1; size <= 5; ++size) {
    Run(size, [&](int rank, GlooProcessGroup& group) {
      for (DType dtype :
           {DType::kF32, DType::kBF16, DType::kF16, DType::kI32}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          if (op == ReduceOp::kAvg && dtype == DType::kI32) continue;
          for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{7},
                            int64_t{64}, int64_t{1001}}) {
            const int64_t count = ReduceScatterCount(n, size, rank);
            const int64_t offset = ReduceScatterOffset(n, size, rank);
            HostBuffer in(n, dtype), out(count, dtype);
            for (int64_t i = 0; i < n; ++i) in.Set(i, Value(rank, i));
            auto work = group.ReduceScatter(in.buffer, out.buffer, op);
            ASSERT_TRUE(work.ok()) << work.status();
            ASSERT_TRUE((*work)->Wait(kWait).ok());
            for (int64_t i = 0; i < count; ++i) {
              ASSERT_EQ(out.Get(i), Reduced(size, offset + i, op, dtype))
                  << "size " << size << " " << DTypeName(dtype) << " "
                  << ReduceOpName(op) << " n " << n << " i " << i;
            }
          }
        }
      }
    });
  }
}

TEST_P(GlooTransportTest, LargeReduceScatterInPieces) {
  // Chunks of more than one ring message (1 MiB pieces) and, in f32, more
  // pieces than shared memory has slots; uneven split.
  const int64_t n = (3 << 20) + 7;
  Run(3, [&](int rank, GlooProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t count = ReduceScatterCount(n, 3, rank);
      const int64_t offset = ReduceScatterOffset(n, 3, rank);
      HostBuffer in(n, dtype), out(count, dtype);
      for (int64_t i = 0; i < n; ++i) in.Set(i, Value(rank, i));
      ASSERT_TRUE((*group.ReduceScatter(in.buffer, out.buffer, ReduceOp::kSum))
                      ->Wait(kWait)
                      .ok());
      for (int64_t i = 0; i < count; i += 997) {
        ASSERT_EQ(out.Get(i), Reduced(3, offset + i, ReduceOp::kSum, dtype))
            << i;
      }
      ASSERT_EQ(out.Get(count - 1),
                Reduced(3, offset + count - 1, ReduceOp::kSum, dtype));
    }
  });
}

// A bf16 / f16 input reduced into an f32 output (ReduceScatterWidens) gives
// the bits of an f32 input holding the same values, with sums that round.
TEST_P(GlooTransportTest, ReduceScatterWidensHalfInputs) {
  for (int size : {2, 3}) {
    Run(size, [&](int rank, GlooProcessGroup& group) {
      EXPECT_TRUE(group.ReduceScatterWidens());
      for (DType dtype : {DType::kBF16, DType::kF16}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          const int64_t n = 3001;
          const int64_t count = ReduceScatterCount(n, size, rank);
          HostBuffer half(n, dtype), wide(n, DType::kF32);
          for (int64_t i = 0; i < n; ++i) {
            half.Set(i, std::sin(rank * 1000.0 + i) * 100.0);
            wide.Set(i, half.Get(i));
          }
          HostBuffer from_half(count, DType::kF32),
              from_wide(count, DType::kF32);
          ASSERT_TRUE((*group.ReduceScatter(half.buffer, from_half.buffer, op))
                          ->Wait(kWait)
                          .ok());
          ASSERT_TRUE((*group.ReduceScatter(wide.buffer, from_wide.buffer, op))
                          ->Wait(kWait)
                          .ok());
          EXPECT_EQ(from_half.bytes, from_wide.bytes)
              << size << " " << DTypeName(dtype) << " " << ReduceOpName(op);
        }
      }
      // Only bf16 / f16 into f32.
      HostBuffer wide(8, DType::kF32), narrow(8 / size + 1, DType::kBF16);
      narrow.buffer.count = ReduceScatterCount(8, size, rank);
      absl::StatusOr<std::shared_ptr<Work>> w =
          group.ReduceScatter(wide.buffer, narrow.buffer, ReduceOp::kSum);
      ASSERT_FALSE(w.ok());
      EXPECT_NE(w.status().message().find("input is f32, output is bf16"),
                absl::string_view::npos)
          << w.status();
      HostBuffer half(8, DType::kBF16), f16(8 / size + 1, DType::kF16);
      f16.buffer.count = ReduceScatterCount(8, size, rank);
      EXPECT_FALSE(
          group.ReduceScatter(half.buffer, f16.buffer, ReduceOp::kSum).ok());
    });
  }
}

TEST_P(GlooTransportTest, LargeAllGatherInPieces) {
  // More pieces than shared memory has slots, the last one partial, in
  // place and not; then ops of both kinds back to back on two streams.
  const int64_t count = (5 << 18) + 3;  // f32: 5 MiB + 12 bytes a rank
  Run(3, [&](int rank, GlooProcessGroup& group) {
    HostBuffer in(count, DType::kF32), out(3 * count, DType::kF32);
    for (int64_t i = 0; i < count; ++i) in.Set(i, std::fabs(Value(rank, i)));
    ASSERT_TRUE((*group.AllGather(in.buffer, out.buffer))->Wait(kWait).ok());
    for (int r = 0; r < 3; ++r) {
      for (int64_t i = 0; i < count; i += 1009) {
        ASSERT_EQ(out.Get(r * count + i), std::fabs(Value(r, i))) << r << i;
      }
      ASSERT_EQ(out.Get(r * count + count - 1), std::fabs(Value(r, count - 1)));
    }
    CpuStream side("side");
    std::vector<HostBuffer> gathered, reduced;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 6; ++i) {
      CollectiveOptions o;
      if (i % 2) o.stream = &side;
      gathered.emplace_back(3 * 1000, DType::kF32);
      reduced.emplace_back(ReduceScatterCount(3000, 3, rank), DType::kF32);
    }
    for (int i = 0; i < 6; ++i) {
      CollectiveOptions o;
      if (i % 2) o.stream = &side;
      Buffer mine = gathered[i].buffer;
      mine.data = gathered[i].bytes.data() + rank * 1000 * sizeof(float);
      mine.count = 1000;
      for (int64_t j = 0; j < 1000; ++j) {
        gathered[i].Set(rank * 1000 + j, rank + i);
      }
      works.push_back(*group.AllGather(mine, gathered[i].buffer, o));
      works.push_back(*group.ReduceScatter(
          gathered[i].buffer, reduced[i].buffer, ReduceOp::kSum, o));
    }
    for (auto& w : works) ASSERT_TRUE(w->Wait(kWait).ok()) << w->description();
    for (int i = 0; i < 6; ++i) {
      for (int r = 0; r < 3; ++r) {
        ASSERT_EQ(gathered[i].Get(r * 1000 + 999), r + i);
      }
      // Each rank's chunk of the gathered buffer summed over 3 ranks.
      ASSERT_EQ(reduced[i].Get(0), 3.0 * (rank + i));
    }
  });
}

// Values whose sums round: the reduce-scatter's order shows in the bits,
// and both transports must give the ring's (the same model on one host or
// several: trainer/multinode_test.sh).
TEST(GlooBackendTest, TransportsReduceToTheSameBits) {
  for (int size = 3; size <= 5; ++size) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t n = 1001;
      std::vector<std::vector<char>> results[2];
      for (int shm = 0; shm < 2; ++shm) {
        results[shm].resize(size);
        GlooOptions o = FastOptions();
        o.shared_memory = shm == 1;
        RunRanks(
            size,
            [&](int rank, GlooProcessGroup& group) {
              ASSERT_EQ(group.uses_shared_memory(), shm == 1);
              HostBuffer in(n, dtype),
                  out(ReduceScatterCount(n, size, rank), dtype);
              for (int64_t i = 0; i < n; ++i) {
                in.Set(i, std::sin(rank * 1000.0 + i) * 1000.0 + 0.1 * rank);
              }
              ASSERT_TRUE(
                  (*group.ReduceScatter(in.buffer, out.buffer, ReduceOp::kSum))
                      ->Wait(kWait)
                      .ok());
              results[shm][rank] = out.bytes;
            },
            "g", o);
      }
      for (int rank = 0; rank < size; ++rank) {
        EXPECT_EQ(results[0][rank], results[1][rank])
            << "size " << size << " " << DTypeName(dtype) << " rank " << rank;
      }
    }
  }
}

TEST(GlooBackendTest, AllReduceBroadcastAllToAllBarrier) {
  for (int size = 1; size <= 5; ++size) {
    RunRanks(size, [&](int rank, GlooProcessGroup& group) {
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          if (op == ReduceOp::kAvg && dtype == DType::kI64) continue;
          for (int64_t count : kCounts) {
            HostBuffer b(count, dtype);
            for (int64_t i = 0; i < count; ++i) b.Set(i, Value(rank, i));
            ASSERT_TRUE((*group.AllReduce(b.buffer, op))->Wait(kWait).ok());
            for (int64_t i = 0; i < count; ++i) {
              ASSERT_EQ(b.Get(i), Reduced(size, i, op, dtype))
                  << "all_reduce size " << size << " " << DTypeName(dtype)
                  << " " << ReduceOpName(op) << " count " << count;
            }
          }
        }
        for (int root = 0; root < size; ++root) {
          HostBuffer b(33, dtype);
          for (int64_t i = 0; i < 33; ++i)
            b.Set(i, rank == root ? Value(root, i) : 99);
          ASSERT_TRUE((*group.Broadcast(b.buffer, root))->Wait(kWait).ok());
          for (int64_t i = 0; i < 33; ++i) ASSERT_EQ(b.Get(i), Value(root, i));
        }
        for (int64_t per : {1, 5}) {
          const int64_t count = per * size;
          HostBuffer in(count, dtype), out(count, dtype);
          // Chunk j of rank r holds 100 * r + j.
          for (int64_t i = 0; i < count; ++i) in.Set(i, 10 * rank + i / per);
          ASSERT_TRUE(
              (*group.AllToAll(in.buffer, out.buffer))->Wait(kWait).ok());
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(out.Get(i), 10 * (i / per) + rank)
                << "all_to_all size " << size;
          }
          // In place.
          ASSERT_TRUE(
              (*group.AllToAll(in.buffer, in.buffer))->Wait(kWait).ok());
          for (int64_t i = 0; i < count; ++i) ASSERT_EQ(in.Get(i), out.Get(i));
        }
      }
      ASSERT_TRUE((*group.Barrier())->Wait(kWait).ok());
    });
  }
}

// AllToAllV's test patterns: elements rank `src` sends rank `dst`.
int64_t Split(int pattern, int src, int dst, int size) {
  switch (pattern) {
    case 0:  // Uneven, with zeros.
      return (src + 2 * dst) % 3;
    case 1:  // The last rank sends nothing at all (not even to itself).
      return src == size - 1 ? 0 : (src + 2 * dst) % 3 + 1;
    case 2:  // Nothing anywhere.
      return 0;
    default:  // Larger chunks of unrelated sizes.
      return (src * 37 + dst * 101) % 500;
  }
}

// Element `i` of the chunk `src` sends `dst`, exact in every dtype tested
// (bf16 keeps 8 significant bits).
double Encoded(DType dtype, int src, int dst, int64_t i) {
  if (dtype == DType::kBF16) return src * 16 + dst * 4 + i % 4;
  return src * 10000 + dst * 1000 + i;
}

// AllToAllV against its definition: every pattern on 1..4 ranks, all four
// issued at once (async) before any is waited for, then once blocking.
TEST(GlooBackendTest, AllToAllVUnevenSplits) {
  for (int size = 1; size <= 4; ++size) {
    RunRanks(size, [&](int rank, GlooProcessGroup& group) {
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI64}) {
        struct Op {
          std::vector<int64_t> in_splits, out_splits;
          std::unique_ptr<HostBuffer> in, out;
          std::shared_ptr<Work> work;
        };
        std::vector<Op> ops(4);
        for (int pattern = 0; pattern < 4; ++pattern) {
          Op& op = ops[pattern];
          int64_t in_count = 0, out_count = 0;
          for (int p = 0; p < size; ++p) {
            op.in_splits.push_back(Split(pattern, rank, p, size));
            op.out_splits.push_back(Split(pattern, p, rank, size));
            in_count += op.in_splits.back();
            out_count += op.out_splits.back();
          }
          op.in = std::make_unique<HostBuffer>(in_count, dtype);
          op.out = std::make_unique<HostBuffer>(out_count, dtype);
          int64_t at = 0;
          for (int p = 0; p < size; ++p) {
            for (int64_t i = 0; i < op.in_splits[p]; ++i) {
              op.in->Set(at++, Encoded(dtype, rank, p, i));
            }
          }
          for (int64_t i = 0; i < out_count; ++i) op.out->Set(i, -1);
          auto work = group.AllToAllV(op.in->buffer, op.in_splits,
                                      op.out->buffer, op.out_splits);
          ASSERT_TRUE(work.ok()) << work.status();
          op.work = *work;
        }
        for (int pattern = 0; pattern < 4; ++pattern) {
          Op& op = ops[pattern];
          ASSERT_TRUE(op.work->Wait(kWait).ok()) << op.work->description();
          int64_t at = 0;
          for (int p = 0; p < size; ++p) {
            for (int64_t i = 0; i < op.out_splits[p]; ++i, ++at) {
              ASSERT_EQ(op.out->Get(at), Encoded(dtype, p, rank, i))
                  << "size " << size << " " << DTypeName(dtype) << " pattern "
                  << pattern << " from rank " << p << " element " << i;
            }
          }
        }
        // Blocking: complete on return.
        Op& op = ops[0];
        for (int64_t i = 0; i < op.out->buffer.count; ++i) op.out->Set(i, -1);
        CollectiveOptions blocking;
        blocking.async_op = false;
        auto work = group.AllToAllV(op.in->buffer, op.in_splits, op.out->buffer,
                                    op.out_splits, blocking);
        ASSERT_TRUE(work.ok()) << work.status();
        ASSERT_TRUE((*work)->IsCompleted());
        ASSERT_TRUE((*work)->Wait(kWait).ok());
        int64_t at = 0;
        for (int p = 0; p < size; ++p) {
          for (int64_t i = 0; i < op.out_splits[p]; ++i, ++at) {
            ASSERT_EQ(op.out->Get(at), Encoded(dtype, p, rank, i));
          }
        }
      }
    });
  }
}

// Split sizes that disagree between two ranks (0 sends 1 two elements, 1
// expects one): both fail with InvalidArgument naming the other, at once (not
// at the timeout), which breaks the group on them as any failed op does (the
// next op fails fast with the same error); the third rank gets its data.
TEST(GlooBackendTest, AllToAllVDisagreeingSplitsFailBothRanks) {
  std::vector<absl::Status> results(3);
  RunRanks(
      3,
      [&](int rank, GlooProcessGroup& group) {
        std::vector<int64_t> in_splits = {1, 1, 1}, out_splits = {1, 1, 1};
        if (rank == 0) in_splits[1] = 2;
        HostBuffer in(rank == 0 ? 4 : 3, DType::kF32), out(3, DType::kF32);
        for (int64_t i = 0; i < in.buffer.count; ++i) in.Set(i, 10 * rank + i);
        const absl::Time start = absl::Now();
        auto work =
            group.AllToAllV(in.buffer, in_splits, out.buffer, out_splits);
        ASSERT_TRUE(work.ok()) << work.status();
        results[rank] = (*work)->Wait(kWait);
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
        if (rank == 2) {
          // From rank 0: its chunk for 2 is element 3 (after 1, then 2).
          EXPECT_EQ(out.Get(0), 3);
          EXPECT_EQ(out.Get(1), 12);
          EXPECT_EQ(out.Get(2), 22);
        } else {
          const absl::Status next = (*group.Barrier())->Wait(kWait);
          EXPECT_EQ(next, results[rank]);
        }
      },
      "a2av_mismatch");
  EXPECT_TRUE(absl::IsInvalidArgument(results[0])) << results[0];
  EXPECT_NE(results[0].message().find("all_to_all_v #0 on group "
                                      "'a2av_mismatch' (rank 0 of 3"),
            absl::string_view::npos)
      << results[0];
  EXPECT_NE(results[0].message().find(
                "rank 1 expects 1 elements, input_splits[1] is 2"),
            absl::string_view::npos)
      << results[0];
  EXPECT_TRUE(absl::IsInvalidArgument(results[1])) << results[1];
  EXPECT_NE(results[1].message().find(
                "rank 0 sends 2 elements, output_splits[0] is 1"),
            absl::string_view::npos)
      << results[1];
  EXPECT_TRUE(results[2].ok()) << results[2];
}

TEST(GlooBackendTest, AllToAllVBadArgumentsAreRejectedAtIssue) {
  RunRanks(2, [](int rank, GlooProcessGroup& group) {
    HostBuffer in(12, DType::kF32), out(12, DType::kF32);
    auto expect_invalid = [&](absl::StatusOr<std::shared_ptr<Work>> w,
                              const std::string& what) {
      ASSERT_FALSE(w.ok()) << what;
      EXPECT_TRUE(absl::IsInvalidArgument(w.status())) << w.status();
      EXPECT_EQ(w.status().message(),
                absl::StrCat("all_to_all_v on group 'g' (rank ", rank,
                             " of 2): ", what));
    };
    expect_invalid(group.AllToAllV(in.buffer, {12}, out.buffer, {6, 6}),
                   "input_splits has 1 entries, the group has 2 ranks");
    expect_invalid(group.AllToAllV(in.buffer, {6, 6}, out.buffer, {4, 4, 4}),
                   "output_splits has 3 entries, the group has 2 ranks");
    expect_invalid(group.AllToAllV(in.buffer, {-1, 13}, out.buffer, {6, 6}),
                   "input_splits[0] is negative (-1)");
    expect_invalid(group.AllToAllV(in.buffer, {5, 5}, out.buffer, {6, 6}),
                   "input_splits sum to 10 but input has 12 elements");
    expect_invalid(group.AllToAllV(in.buffer, {6, 6}, out.buffer, {6, 7}),
                   "output_splits sum to 13 but output has 12 elements");
    std::vector<int64_t> keep = {6, 6}, other = {6, 6};
    keep[rank] = 5;
    keep[1 - rank] = 7;
    expect_invalid(group.AllToAllV(in.buffer, keep, out.buffer, other),
                   absl::StrCat("input_splits[", rank, "] (5) and output_",
                                "splits[", rank, "] (6) differ: both size the ",
                                "chunk this rank keeps"));
    HostBuffer bf16(12, DType::kBF16);
    expect_invalid(group.AllToAllV(in.buffer, {6, 6}, bf16.buffer, {6, 6}),
                   "input is f32, output is bf16");
    // Overlapping: the same buffer, or two slices of one.
    expect_invalid(group.AllToAllV(in.buffer, {6, 6}, in.buffer, {6, 6}),
                   "input and output overlap (they must be distinct buffers)");
    HostBuffer big(20, DType::kF32);
    Buffer first = big.buffer, second = big.buffer;
    first.count = 12;
    second.data = big.bytes.data() + 8 * sizeof(float);
    second.count = 12;
    expect_invalid(group.AllToAllV(first, {6, 6}, second, {6, 6}),
                   "input and output overlap (they must be distinct buffers)");
    // Adjacent slices do not overlap, and an empty buffer overlaps nothing:
    // both are valid ops (issued on both ranks alike).
    second.data = big.bytes.data() + 8 * sizeof(float);
    first.count = 8;
    second.count = 8;
    ASSERT_TRUE(
        (*group.AllToAllV(first, {4, 4}, second, {4, 4}))->Wait(kWait).ok());
    Buffer empty = in.buffer;
    empty.count = 0;
    ASSERT_TRUE(
        (*group.AllToAllV(empty, {0, 0}, empty, {0, 0}))->Wait(kWait).ok());
    ASSERT_TRUE((*group.Barrier())->Wait(kWait).ok());
  });
}

// Blocking ops (async_op = false) are complete when the call returns, with
// the same results as async ones, and still run after the work queued before
// them on their stream.
TEST(GlooBackendTest, BlockingOpsAreCompleteOnReturnAndOrdered) {
  CollectiveOptions blocking;
  blocking.async_op = false;
  for (int size : {1, 2, 3}) {
    RunRanks(size, [&](int rank, GlooProcessGroup& group) {
      // A large async all-gather first, then blocking ops behind it.
      const int64_t per = 1 << 18;
      HostBuffer mine(per, DType::kF32), all(per * size, DType::kF32);
      for (int64_t i = 0; i < per; ++i) mine.Set(i, Value(rank, i));
      std::shared_ptr<Work> gather = *group.AllGather(mine.buffer, all.buffer);
      HostBuffer sum(17, DType::kBF16);
      for (int64_t i = 0; i < 17; ++i) sum.Set(i, Value(rank, i));
      std::shared_ptr<Work> reduce =
          *group.AllReduce(sum.buffer, ReduceOp::kSum, blocking);
      EXPECT_TRUE(reduce->IsCompleted());
      EXPECT_TRUE(gather->IsCompleted());
      ASSERT_TRUE(reduce->Wait(absl::ZeroDuration()).ok());
      ASSERT_TRUE(gather->Wait(absl::ZeroDuration()).ok());
      for (int64_t i = 0; i < 17; ++i) {
        ASSERT_EQ(sum.Get(i), Reduced(size, i, ReduceOp::kSum, DType::kBF16));
      }
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < per; i += 997) {
          ASSERT_EQ(all.Get(r * per + i), Value(r, i));
        }
      }
      // Every op, blocking.
      const int64_t n = 10 * size + 3;  // Uneven chunks.
      HostBuffer in(n, DType::kF32);
      for (int64_t i = 0; i < n; ++i) in.Set(i, Value(rank, i));
      const int64_t count = ReduceScatterCount(n, size, rank);
      const int64_t offset = ReduceScatterOffset(n, size, rank);
      HostBuffer out(count, DType::kF32);
      std::shared_ptr<Work> rs =
          *group.ReduceScatter(in.buffer, out.buffer, ReduceOp::kMax, blocking);
      EXPECT_TRUE(rs->IsCompleted());
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(out.Get(i),
                  Reduced(size, offset + i, ReduceOp::kMax, DType::kF32));
      }
      HostBuffer b(9, DType::kI64);
      for (int64_t i = 0; i < 9; ++i) b.Set(i, rank == 0 ? Value(0, i) : 99);
      EXPECT_TRUE((*group.Broadcast(b.buffer, 0, blocking))->IsCompleted());
      for (int64_t i = 0; i < 9; ++i) ASSERT_EQ(b.Get(i), Value(0, i));
      HostBuffer a(2 * size, DType::kF32), a_out(2 * size, DType::kF32);
      for (int64_t i = 0; i < 2 * size; ++i) a.Set(i, 10 * rank + i / 2);
      EXPECT_TRUE(
          (*group.AllToAll(a.buffer, a_out.buffer, blocking))->IsCompleted());
      for (int64_t i = 0; i < 2 * size; ++i) {
        ASSERT_EQ(a_out.Get(i), 10 * (i / 2) + rank);
      }
      std::shared_ptr<Work> barrier = *group.Barrier(blocking);
      EXPECT_TRUE(barrier->IsCompleted());
      EXPECT_TRUE(barrier->Wait(absl::ZeroDuration()).ok());
    });
  }
}

// Point-to-point: every dtype and size (zero too) from rank 0 to rank 1,
// several transfers between a pair matched in order, a ring exchange (each
// rank sends to its successor and receives from its predecessor in one batch)
// and collectives of the whole group after transfers between two of its
// ranks only (they must not disturb the collectives' order).
TEST(GlooBackendTest, PointToPointTransfers) {
  RunRanks(3, [&](int rank, GlooProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32,
                        DType::kI64, DType::kU8}) {
      for (int64_t n : kCounts) {
        HostBuffer b(n, dtype);
        if (rank == 0) {
          for (int64_t i = 0; i < n; ++i) b.Set(i, std::abs(Value(5, i)));
          ASSERT_TRUE((*group.Send(b.buffer, 1))->Wait(kWait).ok());
        } else if (rank == 1) {
          ASSERT_TRUE((*group.Recv(b.buffer, 0))->Wait(kWait).ok());
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(b.Get(i), std::abs(Value(5, i)))
                << DTypeName(dtype) << " n " << n << " [" << i << "]";
          }
        }
      }
    }
    // Three sends 0 -> 2 issued before the receives are posted: matched in
    // order.
    std::vector<HostBuffer> bufs;
    bufs.reserve(3);  // Each buffer points into its own bytes.
    for (int k = 0; k < 3; ++k) bufs.emplace_back(5, DType::kI32);
    if (rank == 0) {
      std::vector<std::shared_ptr<Work>> works;
      for (int k = 0; k < 3; ++k) {
        for (int i = 0; i < 5; ++i) bufs[k].Set(i, 10 * k + i);
        works.push_back(*group.Send(bufs[k].buffer, 2));
      }
      for (auto& w : works) ASSERT_TRUE(w->Wait(kWait).ok());
    } else if (rank == 2) {
      for (int k = 0; k < 3; ++k) {
        ASSERT_TRUE((*group.Recv(bufs[k].buffer, 0))->Wait(kWait).ok());
        for (int i = 0; i < 5; ++i) ASSERT_EQ(bufs[k].Get(i), 10 * k + i);
      }
    }
    // Tagged: two sends 0 -> 1 with tags 7 then 3, each on its own stream
    // (the second issued while the first still waits for its receiver),
    // received tag 3 first: each receive gets its tag's message.
    {
      HostBuffer a(6, DType::kI32), b(6, DType::kI32);
      if (rank == 0) {
        for (int i = 0; i < 6; ++i) {
          a.Set(i, 70 + i);
          b.Set(i, 30 + i);
        }
        CpuStream s1("tag7"), s2("tag3");
        CollectiveOptions o1, o2;
        o1.stream = &s1;
        o2.stream = &s2;
        std::shared_ptr<Work> w7 =
            *group.BatchP2P({P2POp::Send(a.buffer, 1, /*tag=*/7)}, o1);
        std::shared_ptr<Work> w3 =
            *group.BatchP2P({P2POp::Send(b.buffer, 1, /*tag=*/3)}, o2);
        ASSERT_TRUE(w3->Wait(kWait).ok());
        ASSERT_TRUE(w7->Wait(kWait).ok());
      } else if (rank == 1) {
        ASSERT_TRUE(
            (*group.BatchP2P({P2POp::Recv(b.buffer, 0, 3)}))->Wait(kWait).ok());
        ASSERT_TRUE(
            (*group.BatchP2P({P2POp::Recv(a.buffer, 0, 7)}))->Wait(kWait).ok());
        for (int i = 0; i < 6; ++i) {
          ASSERT_EQ(a.Get(i), 70 + i);
          ASSERT_EQ(b.Get(i), 30 + i);
        }
      }
      EXPECT_EQ(group
                    .BatchP2P({P2POp::Recv(a.buffer, (rank + 1) % 3,
                                           P2POp::kMaxP2PTag + 1)})
                    .status()
                    .code(),
                absl::StatusCode::kInvalidArgument);
    }
    // Ring: send to the next rank, receive from the previous, together.
    HostBuffer out(9, DType::kF32), in(9, DType::kF32);
    for (int i = 0; i < 9; ++i) out.Set(i, Value(rank, i));
    const int next = (rank + 1) % 3, prev = (rank + 2) % 3;
    ASSERT_TRUE((*group.BatchP2P({P2POp::Send(out.buffer, next),
                                  P2POp::Recv(in.buffer, prev)}))
                    ->Wait(kWait)
                    .ok());
    for (int i = 0; i < 9; ++i) ASSERT_EQ(in.Get(i), Value(prev, i));
    // A collective of all three after transfers that involved two.
    HostBuffer sum(4, DType::kF32);
    for (int i = 0; i < 4; ++i) sum.Set(i, Value(rank, i));
    ASSERT_TRUE(
        (*group.AllReduce(sum.buffer, ReduceOp::kSum))->Wait(kWait).ok());
    for (int i = 0; i < 4; ++i) {
      ASSERT_EQ(sum.Get(i), Reduced(3, i, ReduceOp::kSum, DType::kF32));
    }
  });
}

// A send whose receiver never posts, and a receive from a rank that died,
// fail after their timeout naming the op and the peer (the dead one named as
// such); a peer outside the group or the rank itself is refused at issue.
TEST(GlooBackendTest, PointToPointFailuresNameThePeer) {
  GlooOptions o = FastOptions();
  o.heartbeat_interval = absl::Milliseconds(100);
  std::vector<absl::Status> results(3);
  RunRanks(
      3,
      [&](int rank, GlooProcessGroup& group) {
        HostBuffer b(4096, DType::kF32);
        ASSERT_TRUE(
            (*group.AllReduce(b.buffer, ReduceOp::kSum))->Wait(kWait).ok());
        EXPECT_EQ(group.Send(b.buffer, rank).status().code(),
                  absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(group.Recv(b.buffer, 3).status().code(),
                  absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(group.BatchP2P({}).status().code(),
                  absl::StatusCode::kInvalidArgument);
        CollectiveOptions co;
        co.timeout = absl::Seconds(1);
        if (rank == 2) {
          group.SimulateCrash();
          return;
        }
        if (rank == 0) {  // Rank 1 never receives; rank 2 is dead.
          results[0] = (*group.Recv(b.buffer, 2, co))->Wait(kWait);
        } else {
          const absl::Time start = absl::Now();
          results[1] = (*group.Recv(b.buffer, 0, co))->Wait(kWait);
          EXPECT_LT(absl::Now() - start, absl::Seconds(10));
        }
      },
      "p2p_faulty", o);
  EXPECT_FALSE(results[0].ok());
  EXPECT_NE(results[0].message().find("p2p #0 on group 'p2p_faulty' (rank 0 "
                                      "of 3: recv 4096 x f32 on cpu from 2)"),
            absl::string_view::npos)
      << results[0];
  EXPECT_NE(results[0].message().find("receive from rank 2"),
            absl::string_view::npos)
      << results[0];
  EXPECT_NE(results[0].message().find("2 (heartbeat stopped"),
            absl::string_view::npos)
      << results[0];
  EXPECT_FALSE(results[1].ok());
  EXPECT_NE(results[1].message().find("receive from rank 0"),
            absl::string_view::npos)
      << results[1];
}

// What a reduce-scatter holds after it (Gloo's ring buffers over TCP,
// nothing through shared memory) is what GlooReduceScatterScratch tells the
// planner: the two ranks' share of a fresh allocator's comm buffers.
TEST_P(GlooTransportTest, ReduceScatterHoldsWhatThePlannerCounts) {
  CpuAllocator fresh;
  Allocator* previous = SetAllocator(&fresh);
  const int64_t n = 4001;
  Run(2, [&](int rank, GlooProcessGroup& group) {
    HostBuffer in(n, DType::kF32),
        out(ReduceScatterCount(n, 2, rank), DType::kF32);
    ASSERT_TRUE((*group.ReduceScatter(in.buffer, out.buffer, ReduceOp::kSum))
                    ->Wait(kWait)
                    .ok());
  });
  // The peak: both ranks' held buffers, alive until both groups are gone.
  SetAllocator(previous);
  EXPECT_EQ(fresh.Stats().peak_of(MemoryTag::kCommBuffers),
            2 * GlooReduceScatterScratch(n, DType::kF32, DType::kF32, 2001, 2,
                                         GetParam())
                    .held);
}

TEST_P(GlooTransportTest, BadArgumentsAreRejectedAtIssue) {
  Run(2, [](int rank, GlooProcessGroup& group) {
    HostBuffer in(4, DType::kF32), out(7, DType::kF32);
    absl::StatusOr<std::shared_ptr<Work>> w =
        group.AllGather(in.buffer, out.buffer);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(
        w.status().message(),
        absl::StrCat("all_gather on group 'g' (rank ", rank,
                     " of 2): output has 7 elements, expected input count 4 "
                     "x 2 ranks"));
    HostBuffer rs_out(2, DType::kF32);
    w = group.ReduceScatter(out.buffer, rs_out.buffer, ReduceOp::kSum);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find(rank == 0 ? "chunk of 7 has 4"
                                                  : "chunk of 7 has 3"),
              absl::string_view::npos)
        << w.status();
    HostBuffer ints(4, DType::kI32);
    w = group.AllReduce(ints.buffer, ReduceOp::kAvg);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("avg needs a float dtype, not i32"),
              absl::string_view::npos);
    EXPECT_FALSE(group.Broadcast(in.buffer, 2).ok());
    Buffer meta = in.buffer;
    meta.device = Device::Meta();
    w = group.AllReduce(meta, ReduceOp::kSum);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(
        w.status().message().find("buffer is on meta, the group works on cpu"),
        absl::string_view::npos);
    // A stream that is not a CpuStream: rejected before the op takes its
    // place in shared memory's order.
    class OtherStream final : public Stream {
     public:
      Device device() const override { return Device::Cpu(); }
      const std::string& name() const override { return name_; }
      std::shared_ptr<Event> Record() override { return nullptr; }
      void WaitEvent(std::shared_ptr<Event>) override {}
      absl::Status Synchronize(absl::Duration) override {
        return absl::OkStatus();
      }
      absl::Status status() const override { return absl::OkStatus(); }

     private:
      std::string name_ = "other";
    } other;
    CollectiveOptions elsewhere;
    elsewhere.stream = &other;
    HostBuffer gathered(8, DType::kF32);
    w = group.AllGather(in.buffer, gathered.buffer, elsewhere);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("need a CpuStream, not other"),
              absl::string_view::npos)
        << w.status();
    HostBuffer two(4, DType::kF32);
    w = group.ReduceScatter(gathered.buffer, two.buffer, ReduceOp::kSum,
                            elsewhere);
    ASSERT_FALSE(w.ok());
    // Valid ops still match up across ranks after the rejected ones.
    ASSERT_TRUE((*group.Barrier())->Wait(kWait).ok());
    for (int64_t i = 0; i < 4; ++i) in.Set(i, rank + 1);
    ASSERT_TRUE(
        (*group.AllGather(in.buffer, gathered.buffer))->Wait(kWait).ok());
    EXPECT_EQ(gathered.Get(0), 1.0);
    EXPECT_EQ(gathered.Get(4), 2.0);
  });
}

TEST(GlooBackendTest, ConcurrentGroupsAndStreams) {
  // Two groups over the same store and ranks, ops interleaved on two streams
  // of each group: sequence tags keep them apart.
  InMemoryStore store;
  const int size = 3;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto a = GlooProcessGroup::Create(&store, r, size, "a", FastOptions());
      auto b = GlooProcessGroup::Create(&store, r, size, "b", FastOptions());
      ASSERT_TRUE(a.ok() && b.ok());
      CpuStream side("side");
      std::vector<HostBuffer> bufs;
      for (int i = 0; i < 8; ++i) bufs.emplace_back(1000, DType::kF32);
      std::vector<std::shared_ptr<Work>> works;
      for (int i = 0; i < 8; ++i) {
        for (int64_t j = 0; j < 1000; ++j) bufs[i].Set(j, r + i);
        CollectiveOptions o;
        if (i % 2) o.stream = &side;
        GlooProcessGroup& g = i % 3 ? **a : **b;
        works.push_back(*g.AllReduce(bufs[i].buffer, ReduceOp::kSum, o));
      }
      for (auto& w : works)
        ASSERT_TRUE(w->Wait(kWait).ok()) << w->description();
      for (int i = 0; i < 8; ++i) {
        ASSERT_EQ(bufs[i].Get(999), 0 + 1 + 2 + 3.0 * i);
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST_P(GlooTransportTest, OpsWaitForTheirEventAndOverlapHostWork) {
  Run(2, [](int rank, GlooProcessGroup& group) {
    const int64_t count = 8 << 20;  // 32 MiB per rank.
    HostBuffer in(count, DType::kF32), out(2 * count, DType::kF32);
    for (int64_t i = 0; i < count; i += 4096) in.Set(i, rank + 1);
    CpuStream producer("producer");
    std::atomic<bool> release{false};
    producer.Enqueue([&] {
      while (!release) absl::SleepFor(absl::Milliseconds(1));
      return absl::OkStatus();
    });
    CollectiveOptions o;
    o.after = producer.Record();
    const absl::Time issued = absl::Now();
    auto work = group.AllGather(in.buffer, out.buffer, o);
    ASSERT_TRUE(work.ok());
    EXPECT_LT(absl::Now() - issued,
              absl::Seconds(1));  // Issue is asynchronous.
    // The op cannot start before the producer's event.
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_FALSE((*work)->IsCompleted());
    // Host computation runs while the gather is queued / in flight.
    double acc = 0;
    for (int i = 0; i < 1000000; ++i) acc += std::sqrt(static_cast<double>(i));
    EXPECT_GT(acc, 0);
    release = true;
    ASSERT_TRUE((*work)->Wait(kWait).ok());
    EXPECT_EQ(out.Get(0), 1.0);
    EXPECT_EQ(out.Get(count), 2.0);
    // The caller's stream can wait on the work's event.
    CpuStream consumer("consumer");
    consumer.WaitEvent((*work)->event());
    EXPECT_TRUE(consumer.Synchronize(kWait).ok());
  });
}

TEST(GlooBackendTest, RankThatNeverJoinsIsNamed) {
  InMemoryStore store;
  GlooOptions o;
  o.timeout = absl::Milliseconds(500);
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(3);
  const absl::Time start = absl::Now();
  for (int r = 0; r < 3; ++r) {  // Rank 3 of 4 never comes.
    threads.emplace_back([&, r] {
      results[r] = GlooProcessGroup::Create(&store, r, 4, "lonely", o).status();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(results[r].message(),
              absl::StrCat("group 'lonely' (rank ", r,
                           " of 4): ranks [3] did not join within 500ms"));
  }
}

TEST(GlooBackendTest, RankThatDiesMidCollectiveIsNamed) {
  GlooOptions o = FastOptions();
  o.heartbeat_interval = absl::Milliseconds(100);
  std::vector<absl::Status> results(3);
  RunRanks(
      3,
      [&](int rank, GlooProcessGroup& group) {
        HostBuffer b(1000, DType::kF32);
        // One successful op so everyone is connected and beating.
        ASSERT_TRUE(
            (*group.AllReduce(b.buffer, ReduceOp::kSum))->Wait(kWait).ok());
        if (rank == 2) {
          group.SimulateCrash();
          results[2] =
              (*group.AllReduce(b.buffer, ReduceOp::kSum))->Wait(kWait);
          return;
        }
        CollectiveOptions co;
        co.timeout = absl::Seconds(1);
        const absl::Time start = absl::Now();
        results[rank] =
            (*group.AllReduce(b.buffer, ReduceOp::kSum, co))->Wait(kWait);
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
        // The group stays broken: later ops fail fast with the same error,
        // blocking ones too (complete on return).
        absl::Status again = (*group.Barrier())->Wait(kWait);
        EXPECT_EQ(again.message(), results[rank].message());
        CollectiveOptions blocking;
        blocking.async_op = false;
        std::shared_ptr<Work> work = *group.Barrier(blocking);
        EXPECT_TRUE(work->IsCompleted());
        EXPECT_EQ(work->Wait(absl::ZeroDuration()).message(),
                  results[rank].message());
      },
      "faulty", o);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[r].ok());
    EXPECT_NE(results[r].message().find(absl::StrCat(
                  "all_reduce #1 on group 'faulty' (rank ", r, " of 3")),
              absl::string_view::npos)
        << results[r];
    EXPECT_NE(results[r].message().find(
                  "ranks that did not answer: 2 (heartbeat stopped"),
              absl::string_view::npos)
        << results[r];
  }
  EXPECT_EQ(results[2].code(), absl::StatusCode::kAborted);
}

// A peer that dies while this rank writes to it must give an error, not kill
// this process with SIGPIPE (the multi-process die test hit that race). Run in
// a child with SIGPIPE reset to its default: after Create, a write into a
// socket whose other end is closed fails with EPIPE instead of killing it.
TEST(GlooBackendDeathTest, DeadPeerSocketDoesNotKillTheProcess) {
  EXPECT_EXIT(
      {
        signal(SIGPIPE, SIG_DFL);
        InMemoryStore store;
        auto group = GlooProcessGroup::Create(&store, 0, 1, "pipe");
        if (!group.ok()) _exit(2);
        int fds[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) _exit(3);
        close(fds[1]);
        const char byte = 1;
        const bool epipe = write(fds[0], &byte, 1) < 0 && errno == EPIPE;
        _exit(epipe ? 0 : 4);
      },
      testing::ExitedWithCode(0), "");
}

// A SIGPIPE handler the program installed itself is kept.
TEST(GlooBackendDeathTest, ProgramsOwnSigpipeHandlerIsKept) {
  EXPECT_EXIT(
      {
        signal(
            SIGPIPE, +[](int) { _exit(5); });
        InMemoryStore store;
        auto group = GlooProcessGroup::Create(&store, 0, 1, "pipe");
        if (!group.ok()) _exit(2);
        raise(SIGPIPE);
        _exit(0);
      },
      testing::ExitedWithCode(5), "");
}

}  // namespace
}  // namespace fsdpp
