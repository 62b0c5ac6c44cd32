#include "comm/heartbeat.h"

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr absl::Duration kInterval = absl::Milliseconds(20);

// An in-memory store whose reads can be made to fail as a TcpStore's do
// when its server is gone.
class BreakableStore final : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override {
    return store_.Set(key, value);
  }
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override {
    if (broken_) {
      return absl::UnavailableError(
          "tcp store 10.0.0.1:29500: the server closed the connection");
    }
    return store_.Get(key, timeout);
  }
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override {
    return store_.Add(key, delta);
  }
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override {
    return store_.Check(keys);
  }
  absl::Status Delete(absl::string_view key) override {
    return store_.Delete(key);
  }
  std::atomic<bool> broken_{false};

 private:
  InMemoryStore store_;
};

TEST(HeartbeatTest, PeerThatReachedTheOpIsFine) {
  BreakableStore store;
  Heartbeat me(&store, 0, 2, "g", kInterval);
  Heartbeat peer(&store, 1, 2, "g", kInterval);
  peer.MarkStarted(5);
  EXPECT_EQ(me.DiagnosePeers(5), "every peer is alive and has reached this op");
}

TEST(HeartbeatTest, NamesPeersByWhatTheyDid) {
  BreakableStore store;
  Heartbeat me(&store, 0, 4, "g", kInterval);
  Heartbeat behind(&store, 1, 4, "g", kInterval);  // Started nothing.
  Heartbeat stopped(&store, 2, 4, "g", kInterval);
  stopped.MarkStarted(5);
  stopped.Stop();
  // Rank 3 never joined.
  EXPECT_EQ(me.DiagnosePeers(5),
            "ranks that did not answer: 1 (alive, has not reached this op; "
            "last started #-1), 2 (heartbeat stopped: process dead or stuck), "
            "3 (no heartbeat)");
}

TEST(HeartbeatTest, UnreachableStoreIsTheDiagnosis) {
  BreakableStore store;
  Heartbeat me(&store, 0, 2, "g", kInterval);
  Heartbeat peer(&store, 1, 2, "g", kInterval);
  store.broken_ = true;
  const absl::Time start = absl::Now();
  const std::string diagnosis = me.DiagnosePeers(5);
  EXPECT_THAT(diagnosis,
              StartsWith("the store cannot be reached, so no peer can be "
                         "checked"));
  EXPECT_THAT(diagnosis, HasSubstr("10.0.0.1:29500"));
  // Said at once, without waiting beats for peers it cannot see.
  EXPECT_LT(absl::Now() - start, 3 * kInterval);
}

}  // namespace
}  // namespace fsdpp
