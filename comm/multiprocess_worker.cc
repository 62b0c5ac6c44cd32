// A worker for the multi-process tests: real processes rendezvous through the
// environment (tools/launch or by hand) and the TCP store hosted by rank 0,
// then run collectives over Gloo.
//
//   --mode=ok   all_reduce, all_gather, reduce_scatter, barrier; checks the
//               results, prints "rank R: ok" and exits 0.
//   --mode=die  after one all_reduce, rank 1 exits with status 7 (a crash);
//               the other ranks' next all_reduce must fail naming rank 1
//               within the timeout: they print the error and exit 0 if it
//               does, 1 otherwise.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo_backend.h"
#include "comm/rendezvous.h"
#include "core/logging.h"
#include "core/status.h"

ABSL_FLAG(std::string, mode, "ok", "ok or die");

namespace fsdpp {
namespace {

absl::Status Check(bool condition, const std::string& what) {
  return condition ? absl::OkStatus() : absl::InternalError(what);
}

absl::Status Run() {
  FSDPP_ASSIGN_OR_RETURN(RendezvousInfo info, RendezvousFromEnv());
  SetLogPrefix(absl::StrCat("[rank ", info.rank, "] "));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Store> store,
                         StoreFromRendezvous(info, absl::Seconds(30)));
  GlooOptions options;
  options.timeout = absl::Seconds(30);
  options.heartbeat_interval = absl::Milliseconds(100);
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<GlooProcessGroup> group,
      GlooProcessGroup::Create(store.get(), info.rank, info.world_size, "world",
                               options));
  const int n = info.world_size, r = info.rank;
  std::vector<float> x(1001, r + 1.0f);
  Buffer xb{x.data(), static_cast<int64_t>(x.size()), DType::kF32,
            Device::Cpu()};
  FSDPP_ASSIGN_OR_RETURN(auto work, group->AllReduce(xb, ReduceOp::kSum));
  FSDPP_RETURN_IF_ERROR(work->Wait());
  FSDPP_RETURN_IF_ERROR(
      Check(x[1000] == n * (n + 1) / 2.0f, "all_reduce result"));

  if (absl::GetFlag(FLAGS_mode) == "die") {
    if (r == 1) {
      std::fflush(stdout);
      absl::SleepFor(absl::Milliseconds(200));
      _exit(7);
    }
    // Writing into the dead peer's closed socket raises SIGPIPE unless the
    // backend ignores it: rank 1 dies while rank 0 is still pushing a large
    // message into its socket, so that write is near certain, not a rare race.
    std::vector<float> big(8 << 20, 1.0f);
    Buffer bigb{big.data(), static_cast<int64_t>(big.size()), DType::kF32,
                Device::Cpu()};
    CollectiveOptions timeout;
    timeout.timeout = absl::Seconds(3);
    const absl::Time start = absl::Now();
    FSDPP_ASSIGN_OR_RETURN(work,
                           group->AllReduce(bigb, ReduceOp::kSum, timeout));
    absl::Status s = work->Wait();
    std::printf("rank %d: after rank 1 died: %s (%.1f s)\n", r,
                s.ToString().c_str(),
                absl::ToDoubleSeconds(absl::Now() - start));
    FSDPP_RETURN_IF_ERROR(Check(!s.ok(), "the op succeeded without rank 1"));
    FSDPP_RETURN_IF_ERROR(
        Check(s.message().find("ranks that did not answer: 1") !=
                  absl::string_view::npos,
              "the error does not name rank 1"));
    return absl::OkStatus();
  }

  std::vector<int64_t> mine(3, r), all(3 * n);
  FSDPP_ASSIGN_OR_RETURN(
      work,
      group->AllGather(Buffer{mine.data(), 3, DType::kI64, Device::Cpu()},
                       Buffer{all.data(), 3 * n, DType::kI64, Device::Cpu()}));
  FSDPP_RETURN_IF_ERROR(work->Wait());
  for (int i = 0; i < 3 * n; ++i) {
    FSDPP_RETURN_IF_ERROR(Check(all[i] == i / 3, "all_gather result"));
  }
  const int64_t total = 10;
  std::vector<float> in(total), out(ReduceScatterCount(total, n, r));
  for (int64_t i = 0; i < total; ++i) in[i] = static_cast<float>(i);
  FSDPP_ASSIGN_OR_RETURN(
      work,
      group->ReduceScatter(Buffer{in.data(), total, DType::kF32, Device::Cpu()},
                           Buffer{out.data(), static_cast<int64_t>(out.size()),
                                  DType::kF32, Device::Cpu()},
                           ReduceOp::kAvg));
  FSDPP_RETURN_IF_ERROR(work->Wait());
  const int64_t offset = ReduceScatterOffset(total, n, r);
  for (size_t i = 0; i < out.size(); ++i) {
    FSDPP_RETURN_IF_ERROR(Check(out[i] == static_cast<float>(offset + i),
                                "reduce_scatter result"));
  }
  FSDPP_ASSIGN_OR_RETURN(work, group->Barrier());
  FSDPP_RETURN_IF_ERROR(work->Wait());
  std::printf("rank %d: ok (world %d via %s)\n", r, n, info.source.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace fsdpp

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status s = fsdpp::Run();
  std::fflush(stdout);
  if (!s.ok()) {
    LOG(ERROR) << s;
    return 1;
  }
  return 0;
}
