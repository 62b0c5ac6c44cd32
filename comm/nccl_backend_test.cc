// NcclProcessGroup on two GPUs, ranks as threads (rank r on cuda:r) sharing an
// InMemoryStore: every op for f32 and bf16 (and the integer dtypes where
// they reduce) at counts 1, 7 and 1001, checked exactly against a host
// reference; user streams and events; and the fault paths (a rank that never
// joins, an op one rank never issues). Skips, visibly, with fewer than two
// GPUs. The one-rank test (every reduction at world size 1, FSDP's layout on a
// single GPU) needs one.
#include "comm/nccl_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "core/dtype.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

constexpr int kSize = 2;
constexpr absl::Duration kWait = absl::Seconds(60);
const int64_t kCounts[] = {1, 7, 1001};

NcclOptions TestOptions() {
  NcclOptions o;
  o.timeout = absl::Seconds(60);
  return o;
}

class NcclBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() < kSize) GTEST_SKIP() << "needs 2 CUDA devices";
    RegisterCudaAllocators();
  }
};

// Runs fn(rank, group) on kSize thread ranks, rank r on cuda:r.
void RunRanks(const std::function<void(int, NcclProcessGroup&)>& fn,
              const std::string& name = "g",
              NcclOptions options = TestOptions()) {
  InMemoryStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) {
    threads.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      auto group = NcclProcessGroup::Create(&store, r, kSize, name, r, options);
      ASSERT_TRUE(group.ok()) << group.status();
      fn(r, **group);
    });
  }
  for (auto& t : threads) t.join();
}

// Exactly representable test values (small integers, so f32/bf16 sums and
// maxima are exact whatever the reduction order); non-negative for u8.
double Value(int rank, int64_t i, DType dtype) {
  const double v = static_cast<double>((rank * 7 + i * 3) % 23 - 11);
  return dtype == DType::kU8 ? std::fabs(v) : v;
}

// The expected reduction of Value(r, i) over the ranks, rounded as the
// backend does (f32 accumulation, then the storage type).
double Reduced(int64_t i, ReduceOp op, DType dtype) {
  double acc = op == ReduceOp::kMax ? -1e30 : 0.0;
  for (int r = 0; r < kSize; ++r) {
    const double v = Value(r, i, dtype);
    acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
  }
  if (op != ReduceOp::kAvg) return acc;
  const float avg = static_cast<float>(acc) / static_cast<float>(kSize);
  if (dtype == DType::kBF16) return BFloat16ToFloat(FloatToBFloat16(avg));
  return avg;
}

// A device buffer of `count` elements of `dtype` on cuda:`device`, written
// and read as doubles through synchronous copies.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, int64_t count, DType dtype)
      : device_(device),
        bytes_(std::max<int64_t>(1, count) * DTypeSize(dtype)),
        buffer_{nullptr, count, dtype, Device::Cuda(device)} {
    EXPECT_EQ(cudaSetDevice(device_), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&buffer_.data, bytes_), cudaSuccess);
  }
  ~DeviceBuffer() {
    cudaSetDevice(device_);
    cudaFree(buffer_.data);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  const Buffer& buffer() const { return buffer_; }
  // Elements [offset, offset + count) as a Buffer.
  Buffer Slice(int64_t offset, int64_t count) const {
    Buffer b = buffer_;
    b.data = static_cast<char*>(b.data) + offset * DTypeSize(b.dtype);
    b.count = count;
    return b;
  }

  void Upload(const std::vector<double>& values) {
    std::vector<char> host(bytes_);
    for (size_t i = 0; i < values.size(); ++i)
      Encode(host.data(), i, values[i]);
    ASSERT_EQ(cudaSetDevice(device_), cudaSuccess);
    ASSERT_EQ(
        cudaMemcpy(buffer_.data, host.data(), bytes_, cudaMemcpyHostToDevice),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  std::vector<double> Download() const {
    std::vector<char> host(bytes_);
    EXPECT_EQ(cudaSetDevice(device_), cudaSuccess);
    EXPECT_EQ(
        cudaMemcpy(host.data(), buffer_.data, bytes_, cudaMemcpyDeviceToHost),
        cudaSuccess);
    std::vector<double> values(buffer_.count);
    for (int64_t i = 0; i < buffer_.count; ++i) values[i] = Decode(host, i);
    return values;
  }

 private:
  void Encode(char* p, size_t i, double v) const {
    switch (buffer_.dtype) {
      case DType::kF32:
        reinterpret_cast<float*>(p)[i] = static_cast<float>(v);
        break;
      case DType::kBF16:
        reinterpret_cast<BFloat16*>(p)[i] =
            FloatToBFloat16(static_cast<float>(v));
        break;
      case DType::kF16:
        reinterpret_cast<Float16*>(p)[i] =
            FloatToFloat16(static_cast<float>(v));
        break;
      case DType::kI32:
        reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
        break;
      case DType::kI64:
        reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
        break;
      case DType::kU8:
        reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
        break;
    }
  }
  double Decode(const std::vector<char>& host, int64_t i) const {
    const char* p = host.data();
    switch (buffer_.dtype) {
      case DType::kF32:
        return reinterpret_cast<const float*>(p)[i];
      case DType::kBF16:
        return BFloat16ToFloat(reinterpret_cast<const BFloat16*>(p)[i]);
      case DType::kF16:
        return Float16ToFloat(reinterpret_cast<const Float16*>(p)[i]);
      case DType::kI32:
        return reinterpret_cast<const int32_t*>(p)[i];
      case DType::kI64:
        return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
      case DType::kU8:
        return reinterpret_cast<const uint8_t*>(p)[i];
    }
    return 0;
  }

  int device_;
  size_t bytes_;
  Buffer buffer_;
};

std::vector<double> Values(int rank, int64_t count, DType dtype) {
  std::vector<double> v(count);
  for (int64_t i = 0; i < count; ++i) v[i] = Value(rank, i, dtype);
  return v;
}

// Waits for an issued op; the issue error or the op's Status.
absl::Status Finish(absl::StatusOr<std::shared_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(kWait);
}

TEST_F(NcclBackendTest, AllGather) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (int64_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " count ", count));
        DeviceBuffer in(rank, count, dtype), out(rank, count * kSize, dtype);
        in.Upload(Values(rank, count, dtype));
        ASSERT_TRUE(Finish(group.AllGather(in.buffer(), out.buffer())).ok());
        std::vector<double> got = out.Download();
        for (int r = 0; r < kSize; ++r) {
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[r * count + i], Value(r, i, dtype));
          }
        }
        // In place: this rank's input already sits at rank * count.
        DeviceBuffer io(rank, count * kSize, dtype);
        std::vector<double> init(count * kSize, 99);
        for (int64_t i = 0; i < count; ++i) {
          init[rank * count + i] = Value(rank, i, dtype);
        }
        io.Upload(init);
        ASSERT_TRUE(
            Finish(group.AllGather(io.Slice(rank * count, count), io.buffer()))
                .ok());
        got = io.Download();
        for (int r = 0; r < kSize; ++r) {
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[r * count + i], Value(r, i, dtype));
          }
        }
      }
    }
  });
}

TEST_F(NcclBackendTest, ReduceScatterAnyCount) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kI32}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        if (op == ReduceOp::kAvg && dtype == DType::kI32) continue;
        // 8 divides evenly (no padding); the others leave a short last chunk.
        for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{1001}}) {
          SCOPED_TRACE(
              absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " n ", n));
          const int64_t count = ReduceScatterCount(n, kSize, rank);
          const int64_t offset = ReduceScatterOffset(n, kSize, rank);
          DeviceBuffer in(rank, n, dtype), out(rank, count, dtype);
          in.Upload(Values(rank, n, dtype));
          ASSERT_TRUE(
              Finish(group.ReduceScatter(in.buffer(), out.buffer(), op)).ok());
          std::vector<double> got = out.Download();
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[i], Reduced(offset + i, op, dtype)) << "i " << i;
          }
        }
      }
    }
  });
}

TEST_F(NcclBackendTest, AllReduce) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    for (DType dtype :
         {DType::kF32, DType::kBF16, DType::kI32, DType::kI64, DType::kU8}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        const bool is_float = IsFloatingPoint(dtype);
        if (op == ReduceOp::kAvg && !is_float) continue;
        if (dtype == DType::kU8 && op != ReduceOp::kMax) continue;
        for (int64_t count : kCounts) {
          SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op),
                                    " count ", count));
          DeviceBuffer b(rank, count, dtype);
          b.Upload(Values(rank, count, dtype));
          ASSERT_TRUE(Finish(group.AllReduce(b.buffer(), op)).ok());
          std::vector<double> got = b.Download();
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[i], Reduced(i, op, dtype)) << "i " << i;
          }
        }
      }
    }
  });
}

TEST_F(NcclBackendTest, Broadcast) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (int64_t count : kCounts) {
        for (int root = 0; root < kSize; ++root) {
          SCOPED_TRACE(
              absl::StrCat(DTypeName(dtype), " count ", count, " root ", root));
          DeviceBuffer b(rank, count, dtype);
          b.Upload(rank == root ? Values(root, count, dtype)
                                : std::vector<double>(count, 99));
          ASSERT_TRUE(Finish(group.Broadcast(b.buffer(), root)).ok());
          std::vector<double> got = b.Download();
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[i], Value(root, i, dtype));
          }
        }
      }
    }
  });
}

TEST_F(NcclBackendTest, AllToAll) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (int64_t per : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " per rank ", per));
        const int64_t count = per * kSize;
        // Element i of rank r's input is 10 * r + i / per (its chunk index).
        std::vector<double> values(count);
        for (int64_t i = 0; i < count; ++i) values[i] = 10 * rank + i / per;
        DeviceBuffer in(rank, count, dtype), out(rank, count, dtype);
        in.Upload(values);
        ASSERT_TRUE(Finish(group.AllToAll(in.buffer(), out.buffer())).ok());
        std::vector<double> got = out.Download();
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(got[i], 10 * (i / per) + rank) << "i " << i;
        }
        // In place.
        ASSERT_TRUE(Finish(group.AllToAll(in.buffer(), in.buffer())).ok());
        ASSERT_EQ(in.Download(), got);
      }
    }
  });
}

// Uneven chunks, zeros included: rank r sends (r + 2 * j) % 3 + extra
// elements to rank j; element i of that chunk is 16 * r + 4 * j + i % 4
// (exact in bf16). Then an op where rank 1 sends nothing at all.
TEST_F(NcclBackendTest, AllToAllV) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    auto split = [](int extra, int src, int dst) -> int64_t {
      if (extra < 0) return src == 1 ? 0 : 3 + dst;  // rank 1 sends nothing
      return (src + 2 * dst) % 3 + extra;
    };
    auto value = [](int src, int dst, int64_t i) {
      return 16.0 * src + 4.0 * dst + static_cast<double>(i % 4);
    };
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (int extra : {-1, 0, 1000}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " extra ", extra));
        std::vector<int64_t> in_splits, out_splits;
        std::vector<double> values;
        int64_t out_count = 0;
        for (int p = 0; p < kSize; ++p) {
          in_splits.push_back(split(extra, rank, p));
          out_splits.push_back(split(extra, p, rank));
          out_count += out_splits.back();
          for (int64_t i = 0; i < in_splits.back(); ++i) {
            values.push_back(value(rank, p, i));
          }
        }
        const int64_t in_count = static_cast<int64_t>(values.size());
        DeviceBuffer in(rank, in_count, dtype), out(rank, out_count, dtype);
        in.Upload(values);
        out.Upload(std::vector<double>(out_count, -1));
        ASSERT_TRUE(Finish(group.AllToAllV(in.buffer(), in_splits, out.buffer(),
                                           out_splits))
                        .ok());
        std::vector<double> got = out.Download();
        int64_t at = 0;
        for (int p = 0; p < kSize; ++p) {
          for (int64_t i = 0; i < out_splits[p]; ++i, ++at) {
            ASSERT_EQ(got[at], value(p, rank, i))
                << "from rank " << p << " element " << i;
          }
        }
      }
    }
  });
}

// Point-to-point: sends and receives of every size between the two ranks,
// a batched exchange (each sends to the other and receives from it in one
// op), and a collective after them.
TEST_F(NcclBackendTest, PointToPoint) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    const int peer = 1 - rank;
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (int64_t count : kCounts) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " count ", count));
        DeviceBuffer b(rank, count, dtype);
        if (rank == 0) {
          b.Upload(Values(0, count, dtype));
          ASSERT_TRUE(Finish(group.Send(b.buffer(), 1)).ok());
        } else {
          b.Upload(std::vector<double>(count, 99));
          ASSERT_TRUE(Finish(group.Recv(b.buffer(), 0)).ok());
          std::vector<double> got = b.Download();
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(got[i], Value(0, i, dtype));
          }
        }
        DeviceBuffer out(rank, count, dtype), in(rank, count, dtype);
        out.Upload(Values(rank, count, dtype));
        ASSERT_TRUE(Finish(group.BatchP2P({P2POp::Send(out.buffer(), peer),
                                           P2POp::Recv(in.buffer(), peer)}))
                        .ok());
        std::vector<double> got = in.Download();
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(got[i], Value(peer, i, dtype));
        }
      }
    }
    DeviceBuffer b(rank, 4, DType::kF32);
    b.Upload(Values(rank, 4, DType::kF32));
    ASSERT_TRUE(Finish(group.AllReduce(b.buffer(), ReduceOp::kSum)).ok());
  });
}

TEST_F(NcclBackendTest, BarrierStreamsAndEvents) {
  RunRanks([](int rank, NcclProcessGroup& group) {
    EXPECT_EQ(group.device(), Device::Cuda(rank));
    ASSERT_TRUE(Finish(group.Barrier()).ok());
    // An op on the caller's stream, ordered after an event of another one.
    auto side = CudaStream::Create(rank, "side");
    auto producer = CudaStream::Create(rank, "producer");
    ASSERT_TRUE(side.ok() && producer.ok());
    DeviceBuffer b(rank, 1001, DType::kF32);
    b.Upload(Values(rank, 1001, DType::kF32));
    CollectiveOptions o;
    o.stream = side->get();
    o.after = (*producer)->Record();
    auto work = group.AllReduce(b.buffer(), ReduceOp::kSum, o);
    ASSERT_TRUE(work.ok()) << work.status();
    ASSERT_TRUE((*work)->Wait(kWait).ok());
    EXPECT_TRUE((*work)->IsCompleted());
    // Its event orders a CUDA stream, on the device (the raw CUDA event) or
    // through the generic Event interface.
    auto* event = dynamic_cast<NcclWorkEvent*>((*work)->event().get());
    ASSERT_NE(event, nullptr);
    ASSERT_NE(event->cuda_event(), nullptr);
    (*producer)->WaitEvent(event->cuda_event());
    (*producer)->WaitEvent((*work)->event());
    EXPECT_TRUE((*producer)->Synchronize(kWait).ok());
    std::vector<double> got = b.Download();
    for (int64_t i = 0; i < 1001; ++i) {
      ASSERT_EQ(got[i], Reduced(i, ReduceOp::kSum, DType::kF32));
    }
    // A CPU stream is refused at issue, naming the op and the group.
    CpuStream cpu("cpu");
    o.stream = &cpu;
    o.after = nullptr;
    absl::StatusOr<std::shared_ptr<Work>> bad =
        group.AllReduce(b.buffer(), ReduceOp::kSum, o);
    ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("all_reduce on group 'g' (rank " +
                                          std::to_string(rank) +
                                          " of 2): NCCL ops need a CudaStream"),
              absl::string_view::npos)
        << bad.status();
    // So is a host buffer.
    std::vector<float> host(4);
    Buffer cpu_buffer{host.data(), 4, DType::kF32, Device::Cpu()};
    EXPECT_EQ(group.AllReduce(cpu_buffer, ReduceOp::kSum).status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(Finish(group.Barrier()).ok());
    EXPECT_TRUE(group.status().ok());
  });
}

TEST_F(NcclBackendTest, RankThatNeverJoinsIsNamed) {
  InMemoryStore store;
  NcclOptions o;
  o.timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  auto group = NcclProcessGroup::Create(&store, 0, 2, "lonely", 0, o);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(group.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(group.status().message(),
            "group 'lonely' (rank 0 of 2): ranks [1] did not join within "
            "500ms");
}

TEST_F(NcclBackendTest, OpOneRankNeverIssuesTimesOutNamingIt) {
  NcclOptions o = TestOptions();
  o.timeout = absl::Seconds(5);
  o.heartbeat_interval = absl::Milliseconds(100);
  std::atomic<bool> rank0_done{false};
  absl::Status result, again, broken;
  absl::Duration elapsed;
  RunRanks(
      [&](int rank, NcclProcessGroup& group) {
        // Everyone issues one op, so the communicator is connected.
        ASSERT_TRUE(Finish(group.Barrier()).ok());
        if (rank == 1) {  // Alive (beating) but never issues all_reduce #1.
          const absl::Time until = absl::Now() + kWait;
          while (!rank0_done && absl::Now() < until) {
            absl::SleepFor(absl::Milliseconds(10));
          }
          return;
        }
        DeviceBuffer b(rank, 1000, DType::kF32);
        CollectiveOptions co;
        co.timeout = absl::Seconds(1);
        const absl::Time start = absl::Now();
        result = Finish(group.AllReduce(b.buffer(), ReduceOp::kSum, co));
        elapsed = absl::Now() - start;
        // The group stays broken: later ops fail fast with the same error.
        again = Finish(group.Barrier());
        broken = group.status();
        rank0_done = true;
      },
      "stuck", o);
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_LT(elapsed, absl::Seconds(10));
  EXPECT_NE(result.message().find(
                "all_reduce #1 on group 'stuck' (rank 0 of 2, 1000 x f32 on "
                "cuda:0, sum) failed (timeout 1s)"),
            absl::string_view::npos)
      << result;
  EXPECT_NE(result.message().find("communicator aborted"),
            absl::string_view::npos)
      << result;
  EXPECT_NE(
      result.message().find("ranks that did not answer: 1 (alive, has not "
                            "reached this op; last started #0)"),
      absl::string_view::npos)
      << result;
  EXPECT_EQ(again.message(), result.message());
  EXPECT_EQ(broken.message(), result.message());
}

// A one-rank group (one GPU): every reduction is the identity, for every
// element. Outputs start as a sentinel so an element an op leaves unwritten
// shows. Counts include FSDP's segment of a gpt2_debug block (49984), where
// NCCL 2.28's one-rank ncclAvg left the last elements unwritten.
TEST(NcclOneRankTest, ReductionsAreTheIdentity) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  RegisterCudaAllocators();
  InMemoryStore store;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto group = NcclProcessGroup::Create(&store, 0, 1, "one", 0, TestOptions());
  ASSERT_TRUE(group.ok()) << group.status();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{41088},
                        int64_t{49984}, int64_t{1} << 20}) {
        SCOPED_TRACE(
            absl::StrCat(DTypeName(dtype), " ", ReduceOpName(op), " n ", n));
        const std::vector<double> values = Values(0, n, dtype);
        DeviceBuffer in(0, n, dtype), out(0, n, dtype), both(0, n, dtype);
        in.Upload(values);
        out.Upload(std::vector<double>(n, 99.0));
        ASSERT_TRUE(
            Finish((*group)->ReduceScatter(in.buffer(), out.buffer(), op))
                .ok());
        both.Upload(values);
        ASSERT_TRUE(Finish((*group)->AllReduce(both.buffer(), op)).ok());
        const std::vector<double> scattered = out.Download();
        const std::vector<double> reduced = both.Download();
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(scattered[i], values[i]) << "reduce_scatter element " << i;
          ASSERT_EQ(reduced[i], values[i]) << "all_reduce element " << i;
        }
      }
    }
  }
}

// A one-rank AllToAllV is a copy of the whole input (and an empty one does
// nothing).
TEST(NcclOneRankTest, AllToAllVIsACopy) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  RegisterCudaAllocators();
  InMemoryStore store;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto group = NcclProcessGroup::Create(&store, 0, 1, "one", 0, TestOptions());
  ASSERT_TRUE(group.ok()) << group.status();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}}) {
    const std::vector<double> values = Values(0, n, DType::kF32);
    DeviceBuffer in(0, n, DType::kF32), out(0, n, DType::kF32);
    in.Upload(values);
    ASSERT_TRUE(
        Finish((*group)->AllToAllV(in.buffer(), {n}, out.buffer(), {n})).ok());
    ASSERT_EQ(out.Download(), values) << "n " << n;
  }
}

}  // namespace
}  // namespace fsdpp
