// commbench: collective bandwidth in the style of nccl-tests, with the same
// ops called directly on Gloo in the same run to show our overhead.
//
// Ranks are threads of this process over real Gloo (loopback TCP). For each
// size from --min_bytes to --max_bytes (doubling) it times all_gather,
// reduce_scatter and all_reduce through GlooProcessGroup (issue + Work::Wait)
// and through Gloo directly on the same context (gloo::allgather,
// gloo::allreduce, and Gloo's ReduceScatterHalvingDoubling, the closest raw
// equivalent of our ring reduce-scatter), and prints time, algbw and busbw:
//   all_gather, reduce_scatter: busbw = algbw * (n - 1) / n
//   all_reduce:                 busbw = algbw * 2 (n - 1) / n
// where algbw = bytes / time and bytes is the full (gathered / reduced) size.
//
//   bazel run -c opt //comm:commbench -- --world=2
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/logging.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/math.h"
#include "gloo/reduce_scatter.h"

ABSL_FLAG(int, world, 2, "number of ranks (threads)");
ABSL_FLAG(int64_t, min_bytes, 1024, "smallest message size");
ABSL_FLAG(int64_t, max_bytes, 256 << 20, "largest message size");
ABSL_FLAG(double, seconds_per_size, 0.3,
          "target measuring time per size and op");
ABSL_FLAG(std::string, ops, "all_gather,reduce_scatter,all_reduce",
          "ops to run");

namespace fsdpp {
namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op;
  int64_t bytes = 0;
  double ours_us = 0, raw_us = 0;
};

double BusFactor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n
                            : static_cast<double>(n - 1) / n;
}

// Times fn (which runs one collective) on every rank: the slowest rank's
// average, with a barrier before timing. Iteration count from a probe run.
template <typename Fn>
double TimeUs(GlooProcessGroup& group, Fn&& fn, double seconds) {
  fn();  // Warm-up (connections, buffers).
  const auto t0 = Clock::now();
  fn();
  const double probe = std::chrono::duration<double>(Clock::now() - t0).count();
  // Agree on the iteration count: rank 0's choice.
  float iters_f = static_cast<float>(
      std::clamp(seconds / std::max(probe, 1e-6), 3.0, 1000.0));
  Buffer b{&iters_f, 1, DType::kF32, Device::Cpu()};
  CHECK_OK((*group.Broadcast(b, 0))->Wait());
  const int iters = static_cast<int>(iters_f);
  CHECK_OK((*group.Barrier())->Wait());
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  float us = static_cast<float>(
      std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
      iters);
  Buffer t{&us, 1, DType::kF32, Device::Cpu()};
  CHECK_OK((*group.AllReduce(t, ReduceOp::kMax))->Wait());
  return us;
}

void RunRank(int rank, int world, InMemoryStore* store,
             std::vector<Row>* rows) {
  GlooOptions options;
  options.timeout = absl::Minutes(2);
  auto created = GlooProcessGroup::Create(store, rank, world, "bench", options);
  CHECK_OK(created.status());
  GlooProcessGroup& group = **created;
  const auto& context = group.gloo_context();
  const std::vector<std::string> ops =
      absl::StrSplit(absl::GetFlag(FLAGS_ops), ',');
  const double seconds = absl::GetFlag(FLAGS_seconds_per_size);
  uint32_t raw_tag = 1u << 30;  // Raw Gloo tags stay clear of the group's.
  for (int64_t bytes = absl::GetFlag(FLAGS_min_bytes);
       bytes <= absl::GetFlag(FLAGS_max_bytes); bytes *= 2) {
    const int64_t count = bytes / 4;  // f32 elements in the full buffer.
    const int64_t per_rank = count / world;
    if (per_rank == 0) continue;
    std::vector<float> full(per_rank * world, 1.0f), part(per_rank, 1.0f);
    for (const std::string& op : ops) {
      Row row;
      row.op = op;
      row.bytes = per_rank * world * 4;
      if (op == "all_gather") {
        Buffer in{part.data(), per_rank, DType::kF32, Device::Cpu()};
        Buffer out{full.data(), per_rank * world, DType::kF32, Device::Cpu()};
        row.ours_us = TimeUs(
            group, [&] { CHECK_OK((*group.AllGather(in, out))->Wait()); },
            seconds);
        row.raw_us = TimeUs(
            group,
            [&] {
              gloo::AllgatherOptions o(context);
              o.setInput(part.data(), per_rank);
              o.setOutput(full.data(), per_rank * world);
              o.setTag(raw_tag++);
              gloo::allgather(o);
            },
            seconds);
      } else if (op == "reduce_scatter") {
        Buffer in{full.data(), per_rank * world, DType::kF32, Device::Cpu()};
        Buffer out{part.data(), per_rank, DType::kF32, Device::Cpu()};
        row.ours_us = TimeUs(
            group,
            [&] {
              CHECK_OK((*group.ReduceScatter(in, out, ReduceOp::kSum))->Wait());
            },
            seconds);
        std::vector<int> recv(world, static_cast<int>(per_rank));
        std::vector<float> work(per_rank * world, 1.0f);
        gloo::ReduceScatterHalvingDoubling<float> algo(
            context, {work.data()}, static_cast<int>(per_rank * world), recv);
        row.raw_us = TimeUs(
            group, [&] { algo.run(); }, seconds);
      } else if (op == "all_reduce") {
        Buffer buf{full.data(), per_rank * world, DType::kF32, Device::Cpu()};
        row.ours_us = TimeUs(
            group,
            [&] { CHECK_OK((*group.AllReduce(buf, ReduceOp::kSum))->Wait()); },
            seconds);
        row.raw_us = TimeUs(
            group,
            [&] {
              gloo::AllreduceOptions o(context);
              o.setOutput(full.data(), per_rank * world);
              o.setReduceFunction(
                  static_cast<void (*)(void*, const void*, const void*,
                                       size_t)>(&gloo::sum<float>));
              o.setTag(raw_tag++);
              gloo::allreduce(o);
            },
            seconds);
      } else {
        LOG(FATAL) << "unknown op " << op;
      }
      if (rank == 0) rows->push_back(row);
    }
  }
}

int Main() {
  const int world = absl::GetFlag(FLAGS_world);
  InMemoryStore store;
  std::vector<Row> rows;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { RunRank(r, world, &store, &rows); });
  }
  for (auto& t : threads) t.join();
  std::printf("# commbench: %d ranks (threads) over Gloo TCP loopback, f32\n",
              world);
  std::printf("# %-14s %12s | %10s %9s %9s | %10s %9s %9s | %8s\n", "op",
              "bytes", "ours us", "algbw", "busbw", "gloo us", "algbw", "busbw",
              "overhead");
  for (const Row& row : rows) {
    auto gbps = [&](double us) { return row.bytes / us / 1e3; };
    const double bus = BusFactor(row.op, world);
    std::printf(
        "  %-14s %12lld | %10.1f %9.3f %9.3f | %10.1f %9.3f %9.3f | %7.1f%%\n",
        row.op.c_str(), static_cast<long long>(row.bytes), row.ours_us,
        gbps(row.ours_us), gbps(row.ours_us) * bus, row.raw_us,
        gbps(row.raw_us), gbps(row.raw_us) * bus,
        100.0 * (row.ours_us / row.raw_us - 1.0));
  }
  std::printf("# algbw and busbw in GB/s; overhead = ours / gloo - 1\n");
  return 0;
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return fsdpp::Main();
}
