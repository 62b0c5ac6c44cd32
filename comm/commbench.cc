// commbench: collective bandwidth in the style of nccl-tests, with the same
// ops called directly on Gloo in the same run to show our overhead.
// --shared_memory puts our all-gathers and reduce-scatters on shared memory
// (comm/shm_collectives.h) against raw Gloo's TCP.
//
// Ranks are threads of this process over real Gloo (loopback TCP). For each
// size from --min_bytes to --max_bytes (doubling) it times all_gather,
// reduce_scatter and all_reduce through GlooProcessGroup, as blocking ops
// (async_op = false, the like of a raw Gloo call) and issued then waited for
// (async, issue + Work::Wait), and through Gloo directly on the same context
// (gloo::allgather, gloo::allreduce, and Gloo's ReduceScatterHalvingDoubling,
// the closest raw equivalent of our ring reduce-scatter), and prints time,
// algbw and busbw:
//   all_gather, reduce_scatter: busbw = algbw * (n - 1) / n
//   all_reduce:                 busbw = algbw * 2 (n - 1) / n
// where algbw = bytes / time and bytes is the full (gathered / reduced) size.
// The three are timed in rotating rounds; times are the medians.
//
//   bazel run -c opt //comm:commbench -- --world=2
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "comm/gloo_backend.h"
#include "comm/store.h"
#include "core/cli.h"
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
          "target measuring time per size and op (at least 5 iterations of "
          "each variant per round)");
ABSL_FLAG(int, rounds, 7,
          "rotating rounds of blocking, async and raw Gloo per size and op "
          "(medians)");
ABSL_FLAG(std::string, ops, "all_gather,reduce_scatter,all_reduce",
          "ops to run");
ABSL_FLAG(bool, shared_memory, false,
          "our group's all-gathers and reduce-scatters through shared memory "
          "(GlooOptions::shared_memory); raw Gloo stays on TCP");

namespace fsdpp {
namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op;
  int64_t bytes = 0;
  double blocking_us = 0, async_us = 0, raw_us = 0;
  // Medians over rounds of ours / raw in the same round.
  double blocking_ratio = 0, async_ratio = 0;
};

CollectiveOptions Async(bool async) {
  CollectiveOptions o;
  o.async_op = async;
  return o;
}

double BusFactor(const std::string& op, int n) {
  return op == "all_reduce" ? 2.0 * (n - 1) / n
                            : static_cast<double>(n - 1) / n;
}

// Times `iters` calls of fn (which runs one collective) on every rank after
// a barrier: the slowest rank's average in microseconds.
template <typename Fn>
double TimeIters(GlooProcessGroup& group, Fn& fn, int iters) {
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

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times our op blocking (`ours(false)`: async_op = false), our op issued
// then waited for (`ours(true)`) and `raw` side by side: after a warm-up of
// each, --rounds rounds that each time all three (rotating which goes first)
// for about `seconds` / rounds in all. Times are medians over rounds; the
// overheads are medians of the per-round ratios, so drift and bursts of a
// shared machine fall on both sides of each ratio alike.
template <typename Ours, typename Raw>
void TimeOps(GlooProcessGroup& group, Ours&& ours, Raw&& raw, double seconds,
             Row* row) {
  auto blocking = [&] { ours(false); };
  auto async = [&] { ours(true); };
  blocking();  // Warm-up (connections, buffers).
  async();
  raw();
  const auto t0 = Clock::now();
  blocking();
  async();
  raw();
  const double probe = std::chrono::duration<double>(Clock::now() - t0).count();
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  // Agree on the iteration count: rank 0's choice.
  float iters_f = static_cast<float>(
      std::clamp(seconds / rounds / std::max(probe, 1e-6), 5.0, 1000.0));
  Buffer b{&iters_f, 1, DType::kF32, Device::Cpu()};
  CHECK_OK((*group.Broadcast(b, 0))->Wait());
  const int iters = static_cast<int>(iters_f);
  std::vector<double> us[3], blocking_ratio, async_ratio;
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 3; ++k) {
      const int which = (r + k) % 3;
      if (which == 0) us[0].push_back(TimeIters(group, blocking, iters));
      if (which == 1) us[1].push_back(TimeIters(group, async, iters));
      if (which == 2) us[2].push_back(TimeIters(group, raw, iters));
    }
    blocking_ratio.push_back(us[0].back() / us[2].back());
    async_ratio.push_back(us[1].back() / us[2].back());
  }
  row->blocking_us = Median(us[0]);
  row->async_us = Median(us[1]);
  row->raw_us = Median(us[2]);
  row->blocking_ratio = Median(blocking_ratio);
  row->async_ratio = Median(async_ratio);
}

void RunRank(int rank, int world, InMemoryStore* store,
             std::vector<Row>* rows) {
  GlooOptions options;
  options.timeout = absl::Minutes(2);
  options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  auto created = GlooProcessGroup::Create(store, rank, world, "bench", options);
  CHECK_OK(created.status());
  CHECK_EQ((*created)->uses_shared_memory(), options.shared_memory);
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
        TimeOps(
            group,
            [&](bool async) {
              CHECK_OK((*group.AllGather(in, out, Async(async)))->Wait());
            },
            [&] {
              gloo::AllgatherOptions o(context);
              o.setInput(part.data(), per_rank);
              o.setOutput(full.data(), per_rank * world);
              o.setTag(raw_tag++);
              gloo::allgather(o);
            },
            seconds, &row);
      } else if (op == "reduce_scatter") {
        Buffer in{full.data(), per_rank * world, DType::kF32, Device::Cpu()};
        Buffer out{part.data(), per_rank, DType::kF32, Device::Cpu()};
        std::vector<int> recv(world, static_cast<int>(per_rank));
        std::vector<float> work(per_rank * world, 1.0f);
        gloo::ReduceScatterHalvingDoubling<float> algo(
            context, {work.data()}, static_cast<int>(per_rank * world), recv);
        TimeOps(
            group,
            [&](bool async) {
              CHECK_OK(
                  (*group.ReduceScatter(in, out, ReduceOp::kSum, Async(async)))
                      ->Wait());
            },
            [&] { algo.run(); }, seconds, &row);
      } else if (op == "all_reduce") {
        Buffer buf{full.data(), per_rank * world, DType::kF32, Device::Cpu()};
        TimeOps(
            group,
            [&](bool async) {
              CHECK_OK((*group.AllReduce(buf, ReduceOp::kSum, Async(async)))
                           ->Wait());
            },
            [&] {
              gloo::AllreduceOptions o(context);
              o.setOutput(full.data(), per_rank * world);
              o.setReduceFunction(
                  static_cast<void (*)(void*, const void*, const void*,
                                       size_t)>(&gloo::sum<float>));
              o.setTag(raw_tag++);
              gloo::allreduce(o);
            },
            seconds, &row);
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
  std::printf(
      "# commbench: %d ranks (threads), ours over %s, gloo over TCP "
      "loopback, f32\n",
      world,
      absl::GetFlag(FLAGS_shared_memory)
          ? "shared memory (all_gather, reduce_scatter; all_reduce: TCP)"
          : "Gloo TCP loopback");
  std::printf("# %-14s %10s | %9s %7s %7s | %9s | %9s %7s %7s | %8s %8s\n",
              "op", "bytes", "ours us", "algbw", "busbw", "async us", "gloo us",
              "algbw", "busbw", "overhead", "async");
  for (const Row& row : rows) {
    auto gbps = [&](double us) { return row.bytes / us / 1e3; };
    const double bus = BusFactor(row.op, world);
    std::printf(
        "  %-14s %10lld | %9.1f %7.3f %7.3f | %9.1f | %9.1f %7.3f %7.3f | "
        "%7.1f%% %7.1f%%\n",
        row.op.c_str(), static_cast<long long>(row.bytes), row.blocking_us,
        gbps(row.blocking_us), gbps(row.blocking_us) * bus, row.async_us,
        row.raw_us, gbps(row.raw_us), gbps(row.raw_us) * bus,
        100.0 * (row.blocking_ratio - 1.0), 100.0 * (row.async_ratio - 1.0));
  }
  std::printf(
      "# ours: blocking op (async_op = false); async: issue, then "
      "Work::Wait; times are medians over rounds, algbw and busbw in GB/s;\n"
      "# overhead (async): median over rounds of ours (async) / gloo in the "
      "same round, - 1\n");
  return 0;
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  fsdpp::ParseCommandLineOrExit(
      argc, argv,
      "usage: commbench [--world=N] [--min_bytes=B] [--max_bytes=B] "
      "[--ops=a,b] [--rounds=R] [--seconds_per_size=S]\n"
      "  Collectives on thread ranks over Gloo: blocking, async and raw Gloo "
      "in rotating rounds (nccl-tests style table).\n");
  return fsdpp::Main();
}
