// Tests for the Store implementations. The same contract tests run against
// InMemoryStore, FileStore and TcpStore; every "rank" gets its own handle
// (the shared InMemoryStore, its own FileStore on the same directory, or its
// own TcpStore client of one server), as separate processes would. Timeouts
// are short and every blocking call is bounded so a bug fails instead of
// hanging.
#include "comm/store.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/file_store.h"
#include "comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kShort = absl::Milliseconds(100);
constexpr absl::Duration kLong = absl::Seconds(5);
// Upper bound for any call given kShort: generous for a loaded machine.
constexpr absl::Duration kHang = absl::Seconds(5);
constexpr int kRanks = 8;

// A fresh, not yet existing directory under TEST_TMPDIR.
std::string FreshDir(absl::string_view tag) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/store_test_", ::getpid(),
                      "_", counter++, "_", tag);
}

enum class Kind { kInMemory, kFile, kTcp };

std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kInMemory:
      return "InMemory";
    case Kind::kFile:
      return "File";
    case Kind::kTcp:
      return "Tcp";
  }
  return "Unknown";
}

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    switch (GetParam()) {
      case Kind::kInMemory:
        owned_.push_back(std::make_unique<InMemoryStore>());
        break;
      case Kind::kFile:
        dir_ = FreshDir("contract");
        break;
      case Kind::kTcp:
        break;
    }
    // Handle 0 is "rank 0" (the TcpStore server); 1..kRanks are clients.
    for (int i = 0; i <= kRanks; ++i) handles_.push_back(NewHandle());
  }

  Store* NewHandle() {
    switch (GetParam()) {
      case Kind::kInMemory:
        return owned_[0].get();
      case Kind::kFile: {
        absl::StatusOr<std::unique_ptr<FileStore>> s = FileStore::Create(dir_);
        EXPECT_TRUE(s.ok()) << s.status();
        owned_.push_back(std::move(*s));
        return owned_.back().get();
      }
      case Kind::kTcp: {
        const bool server = owned_.empty();
        absl::StatusOr<std::unique_ptr<TcpStore>> s =
            TcpStore::Create("127.0.0.1", server ? 0 : port_, server, kLong);
        EXPECT_TRUE(s.ok()) << s.status();
        if (server) port_ = (*s)->port();
        owned_.push_back(std::move(*s));
        return owned_.back().get();
      }
    }
    return nullptr;
  }

  void TearDown() override {
    // Clients before the server.
    while (!owned_.empty()) owned_.pop_back();
  }

  Store& store() { return *handles_[0]; }
  Store& rank(int i) { return *handles_[i]; }

  std::string dir_;
  int port_ = 0;
  std::vector<std::unique_ptr<Store>> owned_;
  std::vector<Store*> handles_;
};

TEST_P(StoreTest, SetGetOverwrite) {
  ASSERT_TRUE(store().Set("a/b:c", "v1").ok());
  absl::StatusOr<std::string> v = rank(1).Get("a/b:c", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v1");

  ASSERT_TRUE(rank(2).Set("a/b:c", "v2").ok());
  v = store().Get("a/b:c", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v2");

  // Binary and empty values survive unchanged.
  const std::string binary("x\0y\xff\n", 5);
  ASSERT_TRUE(rank(3).Set("bin", binary).ok());
  ASSERT_TRUE(rank(3).Set("empty", "").ok());
  v = rank(4).Get("bin", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, binary);
  v = rank(4).Get("empty", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "");
}

TEST_P(StoreTest, LargeValue) {
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(rank(1).Set("big", big).ok());
  absl::StatusOr<std::string> v = rank(2).Get("big", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(*v == big);
}

TEST_P(StoreTest, GetBlocksUntilAnotherRankSets) {
  std::thread setter([this] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(rank(1).Set("late", "here").ok());
  });
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v = rank(2).Get("late", kLong);
  const absl::Duration elapsed = absl::Now() - start;
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
  EXPECT_LT(elapsed, kHang);
}

TEST_P(StoreTest, WaitBlocksUntilEveryKeyIsSet) {
  std::thread setter([this] {
    absl::SleepFor(absl::Milliseconds(30));
    EXPECT_TRUE(rank(1).Set("w1", "1").ok());
    absl::SleepFor(absl::Milliseconds(30));
    EXPECT_TRUE(rank(1).Set("w2", "2").ok());
  });
  const absl::Status s = rank(2).Wait({"w1", "w2"}, kLong);
  setter.join();
  EXPECT_TRUE(s.ok()) << s;
  absl::StatusOr<bool> both = rank(3).Check({"w1", "w2"});
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(*both);
}

TEST_P(StoreTest, AddCountsFromManyThreads) {
  constexpr int kIncrements = 100;
  std::vector<std::vector<int64_t>> seen(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([this, r, &seen] {
      Store& s = rank(r + 1);
      for (int i = 0; i < kIncrements; ++i) {
        absl::StatusOr<int64_t> v = s.Add("counter", 1);
        ASSERT_TRUE(v.ok()) << v.status();
        seen[r].push_back(*v);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // Every increment returned a distinct value: 1..total, each exactly once.
  std::vector<int64_t> all;
  for (const auto& v : seen) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kRanks * kIncrements));
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], int64_t(i) + 1);
  absl::StatusOr<std::string> v = store().Get("counter", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, absl::StrCat(kRanks * kIncrements));
}

TEST_P(StoreTest, AddNegativeAndNonInteger) {
  absl::StatusOr<int64_t> v = rank(1).Add("n", 5);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 5);
  v = rank(2).Add("n", -7);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, -2);
  v = rank(2).Add("n", 0);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, -2);

  ASSERT_TRUE(rank(1).Set("text", "abc").ok());
  v = rank(2).Add("text", 1);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("text"));
}

TEST_P(StoreTest, Check) {
  absl::StatusOr<bool> c = rank(1).Check({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(*c);
  c = rank(1).Check({"x"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(*c);
  ASSERT_TRUE(rank(2).Set("x", "1").ok());
  c = rank(1).Check({"x"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(*c);
  c = rank(1).Check({"x", "y"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(*c);
}

TEST_P(StoreTest, Delete) {
  ASSERT_TRUE(rank(1).Set("gone", "1").ok());
  ASSERT_TRUE(rank(2).Delete("gone").ok());
  absl::StatusOr<bool> c = rank(1).Check({"gone"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(*c);
  EXPECT_TRUE(rank(2).Delete("gone").ok());  // Absent: no error.
  absl::StatusOr<std::string> v = rank(3).Get("gone", kShort);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  // A deleted counter restarts from zero.
  ASSERT_TRUE(rank(1).Add("cnt", 3).ok());
  ASSERT_TRUE(rank(1).Delete("cnt").ok());
  absl::StatusOr<int64_t> n = rank(2).Add("cnt", 1);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1);
}

TEST_P(StoreTest, PrefixStoresAreIsolated) {
  PrefixStore a("g1", &rank(1));
  PrefixStore b("g2", &rank(2));
  ASSERT_TRUE(a.Set("k", "from a").ok());
  absl::StatusOr<bool> c = b.Check({"k"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(*c);
  ASSERT_TRUE(b.Set("k", "from b").ok());
  absl::StatusOr<std::string> v = a.Get("k", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "from a");
  v = b.Get("k", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "from b");
  // The base store sees the prefixed key.
  v = store().Get("g1/k", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "from a");

  absl::StatusOr<int64_t> n = a.Add("n", 2);
  ASSERT_TRUE(n.ok()) << n.status();
  n = b.Add("n", 5);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 5);

  ASSERT_TRUE(a.Delete("k").ok());
  v = b.Get("k", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "from b");

  const absl::Status s = b.Wait({"only_in_a"}, kShort);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("g2/only_in_a"));
}

TEST_P(StoreTest, GetTimesOutNamingTheKey) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v = rank(1).Get("rank7/addr", kShort);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(v.status().message(), HasSubstr("rank7/addr"));
  EXPECT_GE(elapsed, kShort - absl::Milliseconds(5));
  EXPECT_LT(elapsed, kHang);
}

TEST_P(StoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  ASSERT_TRUE(rank(1).Set("present", "1").ok());
  const absl::Time start = absl::Now();
  const absl::Status s =
      rank(2).Wait({"present", "absent1", "absent2"}, kShort);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("[absent1, absent2]"));
  EXPECT_GE(elapsed, kShort - absl::Milliseconds(5));
  EXPECT_LT(elapsed, kHang);
}

TEST_P(StoreTest, ZeroTimeoutChecksOnce) {
  ASSERT_TRUE(rank(1).Set("now", "1").ok());
  absl::StatusOr<std::string> v = rank(2).Get("now", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "1");
  v = rank(2).Get("never", absl::ZeroDuration());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  // The store still works afterwards (a zero timeout checks, it does not
  // cut the exchange short).
  ASSERT_TRUE(rank(2).Set("after", "2").ok());
  EXPECT_EQ(*rank(1).Get("after", absl::Seconds(5)), "2");
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest,
                         ::testing::Values(Kind::kInMemory, Kind::kFile,
                                           Kind::kTcp),
                         KindName);

// ---- FileStore specifics --------------------------------------------------

TEST(FileStoreTest, EncodesKeysReversiblyAndFlat) {
  EXPECT_EQ(FileStore::EncodeKey("a/b:c%"), "k.a%2Fb%3Ac%25");
  EXPECT_EQ(FileStore::EncodeKey(""), "k.");
  EXPECT_EQ(FileStore::EncodeKey("Az09_.-"), "k.Az09_.-");
  // Distinct keys never share a file, even ones that look encoded.
  EXPECT_NE(FileStore::EncodeKey("a/b"), FileStore::EncodeKey("a%2Fb"));

  absl::StatusOr<std::unique_ptr<FileStore>> s =
      FileStore::Create(FreshDir("encode"));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->Set("a/b", "slash").ok());
  ASSERT_TRUE((*s)->Set("a%2Fb", "percent").ok());
  absl::StatusOr<std::string> v = (*s)->Get("a/b", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "slash");
  v = (*s)->Get("a%2Fb", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "percent");
  // The key is a file named by its encoding directly in the directory.
  EXPECT_EQ(::access(absl::StrCat((*s)->dir(), "/k.a%2Fb").c_str(), F_OK), 0);
}

TEST(FileStoreTest, CreatesMissingParents) {
  const std::string dir = FreshDir("nested") + "/x/y/z";
  absl::StatusOr<std::unique_ptr<FileStore>> s = FileStore::Create(dir);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE((*s)->Set("k", "v").ok());
}

TEST(FileStoreTest, RejectsAPathThatIsAFile) {
  const std::string dir = FreshDir("notadir");
  ASSERT_TRUE(FileStore::Create(dir).ok());
  const std::string file = dir + "/plain_file";
  std::ofstream(file) << "x";
  absl::StatusOr<std::unique_ptr<FileStore>> s = FileStore::Create(file);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr(file));
  s = FileStore::Create(file + "/below");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr(file));
  s = FileStore::Create("");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FileStoreTest, TooLongKeyIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<FileStore>> s =
      FileStore::Create(FreshDir("long"));
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string key(FileStore::kMaxFileNameBytes, 'k');
  EXPECT_EQ((*s)->Set(key, "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->Get(key, kShort).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- TcpStore specifics ---------------------------------------------------

// A loopback port that is bound but not listening: connecting is refused and
// nobody else can take the port while `fd` is open.
int ReserveDeadPort(int* fd) {
  *fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(::bind(*fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::getsockname(*fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  return ntohs(addr.sin_port);
}

TEST(TcpStoreTest, ConnectingToNobodyFailsWithinTimeoutNamingHostPort) {
  int fd = -1;
  const int port = ReserveDeadPort(&fd);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<TcpStore>> s =
      TcpStore::Create("127.0.0.1", port, false, absl::Milliseconds(200));
  const absl::Duration elapsed = absl::Now() - start;
  ::close(fd);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.status().message(),
              HasSubstr(absl::StrCat("127.0.0.1:", port)));
  EXPECT_GE(elapsed, absl::Milliseconds(190));
  EXPECT_LT(elapsed, kHang);
}

TEST(TcpStoreTest, ClientConnectsToAServerThatStartsLater) {
  int fd = -1;
  const int port = ReserveDeadPort(&fd);
  absl::StatusOr<std::unique_ptr<TcpStore>> client;
  std::thread connecting(
      [&] { client = TcpStore::Create("127.0.0.1", port, false, kLong); });
  absl::SleepFor(absl::Milliseconds(50));
  ::close(fd);  // Frees the port for the server.
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("127.0.0.1", port, true, kLong);
  connecting.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Set("hello", "world").ok());
  absl::StatusOr<std::string> v = (*server)->Get("hello", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "world");
  client->reset();
}

TEST(TcpStoreTest, ServerDestroyedWhileClientWaits) {
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("127.0.0.1", 0, true, kLong);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  absl::StatusOr<std::unique_ptr<TcpStore>> client =
      TcpStore::Create("127.0.0.1", port, false, kLong);
  ASSERT_TRUE(client.ok()) << client.status();

  absl::Status waited;
  absl::Duration elapsed;
  std::thread waiter([&] {
    const absl::Time start = absl::Now();
    waited = (*client)->Get("never", absl::Seconds(30)).status();
    elapsed = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(100));
  server->reset();
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
  EXPECT_THAT(waited.message(), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  EXPECT_LT(elapsed, kHang);
  // Later calls fail at once too.
  const absl::Time start = absl::Now();
  const absl::Status again = (*client)->Set("k", "v");
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_LT(absl::Now() - start, kHang);
}

TEST(TcpStoreTest, LocalhostAndPortZero) {
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("localhost", 0, true, kLong);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->is_server());
  EXPECT_GT((*server)->port(), 0);
  absl::StatusOr<std::unique_ptr<TcpStore>> client =
      TcpStore::Create("localhost", (*server)->port(), false, kLong);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE((*client)->is_server());
  ASSERT_TRUE((*server)->Set("k", "v").ok());
  absl::StatusOr<std::string> v = (*client)->Get("k", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
  client->reset();
}

TEST(TcpStoreTest, SecondServerOnABusyPortFailsNamingIt) {
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("127.0.0.1", 0, true, kLong);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  absl::StatusOr<std::unique_ptr<TcpStore>> second =
      TcpStore::Create("127.0.0.1", port, true, kLong);
  EXPECT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrCat("127.0.0.1:", port)));
}

TEST(TcpStoreTest, BadArguments) {
  EXPECT_EQ(TcpStore::Create("", 1234, false, kShort).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpStore::Create("127.0.0.1", -1, true, kShort).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpStore::Create("127.0.0.1", 0, false, kShort).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TcpStore::Create("127.0.0.1", 70000, false, kShort).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TcpStoreTest, MalformedClientIsDroppedOthersKeepWorking) {
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("127.0.0.1", 0, true, kLong);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>((*server)->port()));
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // A frame of 2 bytes holding an unknown op, sent in two pieces (a partial
  // read on the server side).
  const char part1[] = {0, 0};
  const char part2[] = {0, 2, 99, 1};
  ASSERT_EQ(::send(fd, part1, sizeof(part1), MSG_NOSIGNAL), 2);
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_EQ(::send(fd, part2, sizeof(part2), MSG_NOSIGNAL), 4);
  // The server closes the connection: recv sees EOF or a reset, not a reply
  // and not the 5 s receive timeout.
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[16];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << n << " " << errno;
  ::close(fd);
  ASSERT_TRUE((*server)->Set("still", "fine").ok());
  absl::StatusOr<std::string> v = (*server)->Get("still", kLong);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "fine");
}

// A server that accepts but never answers (a node cut off): a Get with a
// short timeout (a heartbeat diagnosis) gives up at its own deadline, both
// when it is the only request and when another thread's request holds the
// connection until the I/O timeout.
TEST(TcpStoreTest, GetDoesNotWaitBehindAStuckRequestPastItsTimeout) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
            0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t length = sizeof(addr);
  ASSERT_EQ(
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length), 0);
  // Alone: the exchange itself gives up at the Get's deadline.
  {
    absl::StatusOr<std::unique_ptr<TcpStore>> alone = TcpStore::Create(
        "127.0.0.1", ntohs(addr.sin_port), false, absl::Seconds(30));
    ASSERT_TRUE(alone.ok()) << alone.status();
    const absl::Time start = absl::Now();
    EXPECT_EQ((*alone)->Get("x", absl::Milliseconds(200)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
  absl::StatusOr<std::unique_ptr<TcpStore>> client = TcpStore::Create(
      "127.0.0.1", ntohs(addr.sin_port), false, absl::Seconds(3));
  ASSERT_TRUE(client.ok()) << client.status();
  std::thread stuck([&] { EXPECT_FALSE((*client)->Set("k", "v").ok()); });
  absl::SleepFor(absl::Milliseconds(100));  // the Set holds the connection
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v =
      (*client)->Get("heartbeat/1", absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("stayed busy"), std::string::npos)
      << v.status();
  stuck.join();
  ::close(listener);
}

TEST(TcpStoreTest, ManyClientsConnectConcurrently) {
  absl::StatusOr<std::unique_ptr<TcpStore>> server =
      TcpStore::Create("127.0.0.1", 0, true, kLong);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  constexpr int kClients = 16;
  std::vector<std::thread> threads;
  for (int r = 1; r <= kClients; ++r) {
    threads.emplace_back([r, port] {
      absl::StatusOr<std::unique_ptr<TcpStore>> c =
          TcpStore::Create("127.0.0.1", port, false, kLong);
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE((*c)->Set(absl::StrCat("rank", r), "up").ok());
      std::vector<std::string> keys;
      for (int i = 1; i <= kClients; ++i)
        keys.push_back(absl::StrCat("rank", i));
      const absl::Status s = (*c)->Wait(keys, kLong);
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (std::thread& t : threads) t.join();
  absl::StatusOr<bool> all = (*server)->Check({"rank1", "rank16"});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(*all);
}

}  // namespace
}  // namespace fsdpp
