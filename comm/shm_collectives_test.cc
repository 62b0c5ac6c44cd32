// SharedMemoryCollectives on thread ranks: who gets shared memory (all
// ranks agree, falling back together), nothing left in /dev/shm, ops in
// ticket order whatever thread runs them, a silent peer named at the
// deadline and the transport broken after it. The data paths over every
// dtype, size and world size are gloo_backend_test's (GlooTransportTest).
#include "comm/shm_collectives.h"

#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/store.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);

using Shm = std::unique_ptr<SharedMemoryCollectives>;

// Connects `size` thread ranks (rank r asks with wanted[r] and host key
// keys[r]) and runs fn(rank, transport) on each.
void RunRanks(int size, const std::vector<bool>& wanted,
              const std::vector<std::string>& keys,
              const std::function<void(int, Shm&)>& fn, InMemoryStore* store) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<Shm> shm = SharedMemoryCollectives::Connect(
          store, r, size, wanted[r], kTimeout, keys[r]);
      ASSERT_TRUE(shm.ok()) << shm.status();
      fn(r, *shm);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(SharedMemoryCollectivesTest, EveryRankMustAskAndShareTheHost) {
  struct Case {
    std::vector<bool> wanted;
    std::vector<std::string> keys;
    bool granted;
  };
  const Case cases[] = {
      {{true, true, true}, {"h", "h", "h"}, true},
      {{true, false, true}, {"h", "h", "h"}, false},
      {{true, true, true}, {"h", "h", "other"}, false},
      {{true, true, true}, {"h", "", "h"}, false},
  };
  for (const Case& c : cases) {
    InMemoryStore store;
    RunRanks(
        3, c.wanted, c.keys,
        [&](int, Shm& shm) { EXPECT_EQ(shm != nullptr, c.granted); }, &store);
  }
  // One rank alone has nobody to share with.
  InMemoryStore store;
  absl::StatusOr<Shm> alone =
      SharedMemoryCollectives::Connect(&store, 0, 1, true, kTimeout, "h");
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(*alone, nullptr);
  EXPECT_FALSE(SharedMemoryCollectives::HostKey().empty());
}

TEST(SharedMemoryCollectivesTest, SegmentsAreUnlinkedOnceMapped) {
  InMemoryStore store;
  RunRanks(
      2, {true, true}, {"h", "h"},
      [&](int, Shm& shm) { ASSERT_NE(shm, nullptr); }, &store);
  absl::StatusOr<std::string> token = store.Get("shm/token", kTimeout);
  ASSERT_TRUE(token.ok());
  for (int r = 0; r < 2; ++r) {
    const std::string path = absl::StrCat("/dev/shm/fsdpp-", *token, "-", r);
    EXPECT_NE(access(path.c_str(), F_OK), 0) << path << " is still there";
  }
}

TEST(SharedMemoryCollectivesTest, OpsRunInTicketOrderWhicheverThreadRunsThem) {
  // Each rank takes tickets 0 and 1; rank 0 starts ticket 1 first on
  // another thread, which must wait for ticket 0 so both ranks' ops pair up.
  InMemoryStore store;
  RunRanks(
      2, {true, true}, {"h", "h"},
      [&](int rank, Shm& shm) {
        ASSERT_NE(shm, nullptr);
        const uint64_t first = shm->Ticket(), second = shm->Ticket();
        std::vector<int> a = {rank * 10 + 1}, b = {rank * 10 + 2};
        std::vector<int> out_a(2), out_b(2);
        absl::Status sa, sb;
        auto gather = [&](uint64_t ticket, std::vector<int>* in,
                          std::vector<int>* out, absl::Status* s) {
          *s = shm->AllGather(ticket, in->data(), out->data(), sizeof(int),
                              kTimeout);
        };
        if (rank == 0) {
          std::thread later(gather, second, &b, &out_b, &sb);
          absl::SleepFor(absl::Milliseconds(50));
          gather(first, &a, &out_a, &sa);
          later.join();
        } else {
          gather(first, &a, &out_a, &sa);
          gather(second, &b, &out_b, &sb);
        }
        ASSERT_TRUE(sa.ok()) << sa;
        ASSERT_TRUE(sb.ok()) << sb;
        EXPECT_EQ(out_a, (std::vector<int>{1, 11}));
        EXPECT_EQ(out_b, (std::vector<int>{2, 12}));
      },
      &store);
}

TEST(SharedMemoryCollectivesTest, SilentPeerIsNamedAndBreaksTheTransport) {
  InMemoryStore store;
  RunRanks(
      3, {true, true, true}, {"h", "h", "h"},
      [&](int rank, Shm& shm) {
        ASSERT_NE(shm, nullptr);
        if (rank == 2) return;  // never gathers
        // Rank 0 takes three tickets: the third must fail at once after the
        // second's error, and the first is the one that times out.
        const uint64_t ticket = shm->Ticket();
        std::vector<float> in(3 << 18, 1.0f), out(3 * in.size());
        const absl::Time start = absl::Now();
        absl::Status s =
            shm->AllGather(ticket, in.data(), out.data(),
                           in.size() * sizeof(float), absl::Seconds(1));
        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_NE(s.message().find("rank 2 has not"), std::string::npos) << s;
        EXPECT_LT(absl::Now() - start, absl::Seconds(10));
        const absl::Status again = shm->ReduceScatter(
            shm->Ticket(), in.data(), sizeof(float), 3, kTimeout,
            [](int64_t, int64_t, const void* const*) {});
        EXPECT_EQ(again, s);
      },
      &store);
}

TEST(SharedMemoryCollectivesTest, BreakFailsTheOpWaitingForItsTurn) {
  InMemoryStore store;
  RunRanks(
      2, {true, true}, {"h", "h"},
      [&](int rank, Shm& shm) {
        ASSERT_NE(shm, nullptr);
        if (rank == 1) return;
        shm->Ticket();  // never runs
        const uint64_t waiting = shm->Ticket();
        std::thread breaker([&] {
          absl::SleepFor(absl::Milliseconds(50));
          shm->Break(absl::AbortedError("crashed"));
        });
        int in = 0, out[2];
        const absl::Status s =
            shm->AllGather(waiting, &in, out, sizeof(int), kTimeout);
        breaker.join();
        EXPECT_EQ(s, absl::AbortedError("crashed"));
      },
      &store);
}

}  // namespace
}  // namespace fsdpp
