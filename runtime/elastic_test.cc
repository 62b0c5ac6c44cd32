#include "runtime/elastic.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

ElasticOptions Node(int id, int min_nodes = 1, int max_nodes = 2) {
  ElasticOptions o;
  o.node_id = id;
  o.nproc_per_node = 2;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.last_call = absl::Milliseconds(300);
  o.timeout = absl::Seconds(20);
  return o;
}

// Joins on a thread (the other node's launcher).
class JoinThread {
 public:
  explicit JoinThread(ElasticRendezvous* rdzv)
      : thread_([this, rdzv] { result_ = rdzv->Join(); }) {}
  absl::StatusOr<ElasticRound> Result() {
    thread_.join();
    return result_;
  }

 private:
  absl::StatusOr<ElasticRound> result_ = absl::UnknownError("not run");
  std::thread thread_;
};

// The restart request `node` sees within `within` (polled), or none.
std::optional<std::string> AwaitRestartRequest(ElasticRendezvous& node,
                                               absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  while (true) {
    absl::StatusOr<std::optional<std::string>> r = node.RestartRequested();
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok() || r->has_value() || absl::Now() >= deadline) {
      return r.ok() ? *r : std::nullopt;
    }
    absl::SleepFor(absl::Milliseconds(25));
  }
}

TEST(ElasticRendezvousTest, TwoNodesShrinkToOneAndGrowBack) {
  InMemoryStore store;
  ElasticRendezvous node0(&store, Node(0));
  auto node1 = std::make_unique<ElasticRendezvous>(&store, Node(1));

  // Round 0: both nodes (max_nodes reached: no last call).
  JoinThread join1(node1.get());
  absl::StatusOr<ElasticRound> r0 = node0.Join();
  absl::StatusOr<ElasticRound> r0_1 = join1.Result();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r0_1.ok()) << r0_1.status();
  EXPECT_EQ(r0->round, 0);
  EXPECT_THAT(r0->members, ElementsAre(0, 1));
  EXPECT_EQ(r0->world_size, 4);
  EXPECT_EQ(r0->group_rank, 0);
  EXPECT_EQ(r0->rank_offset, 0);
  EXPECT_EQ(r0_1->group_rank, 1);
  EXPECT_EQ(r0_1->rank_offset, 2);
  absl::StatusOr<std::optional<std::string>> none = node0.RestartRequested();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, std::nullopt);

  // Node 1 is lost; node 0's ranks fail, it asks for a restart and the next
  // round closes without node 1 after the last call.
  node1.reset();
  ASSERT_TRUE(node0.RequestRestart("fail: node 0: rank 0 exited").ok());
  ASSERT_TRUE(node0.RequestRestart("fail: a second reason").ok());
  EXPECT_THAT(*node0.RestartRequested(),
              Optional(std::string("fail: node 0: rank 0 exited")));
  const absl::Time start = absl::Now();
  absl::StatusOr<ElasticRound> r1 = node0.Join();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_EQ(r1->round, 1);
  EXPECT_THAT(r1->members, ElementsAre(0));
  EXPECT_EQ(r1->world_size, 2);
  EXPECT_EQ(*node0.RestartRequested(), std::nullopt);

  // Node 1 comes back while round 1 runs: it asks round 1 to restart and
  // waits in round 2, which node 0 joins when it sees the request.
  ElasticRendezvous back(&store, Node(1));
  JoinThread join_back(&back);
  ASSERT_THAT(AwaitRestartRequest(node0, absl::Seconds(10)),
              Optional(std::string("join: node 1 is waiting")));
  absl::StatusOr<ElasticRound> r2 = node0.Join();
  absl::StatusOr<ElasticRound> r2_1 = join_back.Result();
  ASSERT_TRUE(r2.ok()) << r2.status();
  ASSERT_TRUE(r2_1.ok()) << r2_1.status();
  EXPECT_EQ(r2->round, 2);
  EXPECT_EQ(r2_1->round, 2);
  EXPECT_THAT(r2->members, ElementsAre(0, 1));
  EXPECT_EQ(r2_1->world_size, 4);
  EXPECT_EQ(r2_1->rank_offset, 2);

  // Both finish; node 0 waits for node 1's mark.
  std::thread finish([&back] { ASSERT_TRUE(back.MarkFinished().ok()); });
  ASSERT_TRUE(node0.MarkFinished().ok());
  EXPECT_TRUE(node0.WaitAllFinished(absl::Seconds(10)).ok());
  finish.join();
}

// More nodes than MAX: the members are the smallest ids, node 0 included,
// whatever the join order; the extra node waits for the next round.
TEST(ElasticRendezvousTest, MembersAreTheSmallestIds) {
  InMemoryStore store;
  ElasticOptions o2 = Node(2, 1, 2);
  o2.timeout = absl::Seconds(5);
  ElasticRendezvous node2(&store, o2);
  ElasticRendezvous node1(&store, Node(1, 1, 2));
  ElasticRendezvous node0(&store, Node(0, 1, 2));
  JoinThread j2(&node2);
  absl::SleepFor(absl::Milliseconds(50));
  JoinThread j1(&node1);
  absl::SleepFor(absl::Milliseconds(50));
  absl::StatusOr<ElasticRound> r0 = node0.Join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_THAT(r0->members, ElementsAre(0, 1));
  absl::StatusOr<ElasticRound> r1 = j1.Result();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->group_rank, 1);
  // Node 2 asks round 0 to restart (as soon as it sees the round closed
  // without it: on a loaded machine that may be a while after node 0's Join
  // returned) and waits in round 1 (nobody closes it here: it times out).
  EXPECT_THAT(AwaitRestartRequest(node0, absl::Seconds(4)),
              Optional(std::string("join: node 2 is waiting")));
  EXPECT_EQ(j2.Result().status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(ElasticRendezvousTest, WaitAllFinishedIsBounded) {
  InMemoryStore store;
  ElasticRendezvous node0(&store, Node(0, 1, 2));
  ElasticRendezvous node1(&store, Node(1, 1, 2));
  JoinThread join1(&node1);
  ASSERT_TRUE(node0.Join().ok());
  absl::StatusOr<ElasticRound> r1 = join1.Result();
  ASSERT_TRUE(r1.ok());
  ASSERT_TRUE(node0.MarkFinished().ok());
  const absl::Status s = node0.WaitAllFinished(absl::Milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("1 of 2 nodes finished"));
}

TEST(ElasticRendezvousTest, TooFewNodesIsAnErrorAfterTheTimeout) {
  InMemoryStore store;
  ElasticOptions o = Node(0, 2, 3);
  o.timeout = absl::Milliseconds(300);
  ElasticRendezvous node0(&store, o);
  absl::StatusOr<ElasticRound> r = node0.Join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(),
              HasSubstr("round 0: 1 of at least 2 nodes joined within"));
}

TEST(ElasticRendezvousTest, NodeWithoutNodeZeroTimesOut) {
  InMemoryStore store;
  ElasticOptions o = Node(1);
  o.timeout = absl::Milliseconds(200);
  ElasticRendezvous node1(&store, o);
  absl::StatusOr<ElasticRound> r = node1.Join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(),
              HasSubstr("round 0: node 0 did not close it"));
}

TEST(ElasticRendezvousTest, WaitsGiveUpWhenCancelled) {
  InMemoryStore store;
  std::atomic<bool> stop{false};
  ElasticOptions o = Node(1);
  o.cancelled = [&stop] { return stop.load(); };
  ElasticRendezvous node1(&store, o);  // Node 0 never comes.
  JoinThread join(&node1);
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time asked = absl::Now();
  stop = true;
  absl::StatusOr<ElasticRound> r = join.Result();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - asked, absl::Seconds(2));  // Not the 20 s timeout.

  InMemoryStore fresh;  // Node 0 alone, waiting for a second node.
  ElasticOptions h = Node(0, 2, 2);
  h.cancelled = [] { return true; };
  ElasticRendezvous node0(&fresh, h);
  EXPECT_EQ(node0.Join().status().code(), absl::StatusCode::kCancelled);
}

TEST(ElasticRendezvousTest, DuplicateNodeIdsAndRankCountsAreRefused) {
  {
    InMemoryStore store;
    ElasticRendezvous node0(&store, Node(0, 3, 3));
    ElasticOptions o = Node(1, 3, 3);
    o.timeout = absl::Seconds(1);
    ElasticRendezvous a(&store, o);
    ElasticRendezvous b(&store, o);
    JoinThread ja(&a);
    JoinThread jb(&b);
    absl::StatusOr<ElasticRound> r = node0.Join();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(),
                HasSubstr("two launchers joined as node 1"));
    // The others are left waiting for a close that never comes; they give up
    // at their timeout.
    EXPECT_FALSE(ja.Result().ok());
    EXPECT_FALSE(jb.Result().ok());
  }
  {
    InMemoryStore store;
    ElasticRendezvous node0(&store, Node(0));
    ElasticOptions o = Node(1);
    o.nproc_per_node = 3;
    o.timeout = absl::Seconds(1);
    ElasticRendezvous node1(&store, o);
    JoinThread j1(&node1);
    absl::StatusOr<ElasticRound> r = node0.Join();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(),
                HasSubstr("node 1 starts 3 ranks, node 0 starts 2"));
    EXPECT_FALSE(j1.Result().ok());
  }
}

}  // namespace
}  // namespace launch
}  // namespace fsdpp
