// Key-value stores for rendezvous and coordination between ranks.
//
// Ranks meet through a Store: they publish addresses and ids under keys and
// wait for each other's keys. Three implementations share this interface:
// InMemoryStore (ranks are threads of one process; tests), FileStore (a
// directory on a filesystem every rank sees) and TcpStore (a small server
// hosted by rank 0 at MASTER_ADDR:MASTER_PORT). Every blocking call takes a
// timeout and fails with DeadlineExceeded naming the keys still missing, so a
// rank that never shows up is named instead of hanging everyone.
#ifndef FSDPP_COMM_STORE_H_
#define FSDPP_COMM_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fsdpp {

// Default bound for rendezvous waits.
inline constexpr absl::Duration kDefaultStoreTimeout = absl::Minutes(5);

class Store {
 public:
  virtual ~Store() = default;
  // Sets `key` to `value` (overwrites).
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // The value of `key`, waiting up to `timeout` for it to be set.
  virtual absl::StatusOr<std::string> Get(absl::string_view key,
                                          absl::Duration timeout) = 0;
  // Atomically adds `delta` to the integer at `key` (absent = 0) and returns
  // the new value. The value is stored as decimal text.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;
  // True if every key is set (does not wait).
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) = 0;
  // Removes `key` (no error if absent).
  virtual absl::Status Delete(absl::string_view key) = 0;

  // Waits until every key is set; DeadlineExceeded lists the missing keys.
  // The default polls Check with backoff.
  virtual absl::Status Wait(const std::vector<std::string>& keys,
                            absl::Duration timeout);
};

// A view of another store with every key prefixed by "<prefix>/": separates
// process groups, meshes and runs that share one store.
class PrefixStore final : public Store {
 public:
  // `base` is not owned and must outlive this store.
  PrefixStore(std::string prefix, Store* base)
      : prefix_(std::move(prefix)), base_(base) {}
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::Status Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;
  const std::string& prefix() const { return prefix_; }

 private:
  std::string Key(absl::string_view key) const;
  std::vector<std::string> Keys(const std::vector<std::string>& keys) const;
  std::string prefix_;
  Store* base_;
};

// A store in this process's memory: ranks run as threads sharing one object.
class InMemoryStore final : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::Status Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string, std::less<>> data_;
};

// DeadlineExceeded "<what>: timed out after <timeout> waiting for keys [..]".
absl::Status MissingKeysError(absl::string_view what,
                              const std::vector<std::string>& missing,
                              absl::Duration timeout);

// Parses the decimal integer stored by Add; InvalidArgument naming the key.
absl::StatusOr<int64_t> ParseCounter(absl::string_view key,
                                     absl::string_view value);

}  // namespace fsdpp

#endif  // FSDPP_COMM_STORE_H_
