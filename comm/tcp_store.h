// TcpStore: a Store served over TCP by one rank (rank 0, at
// MASTER_ADDR:MASTER_PORT) to every rank, including itself.
//
// Design: the server is one thread running poll() over the listening socket,
// an eventfd (written by the destructor to stop it) and every client socket;
// the key-value map is touched only by that thread, so it needs no lock. Each
// client keeps one connection and exchanges one request and one reply at a
// time under a mutex. Messages are length-prefixed binary frames (see
// tcp_store.cc for the layout). The server never blocks on a key: GET and
// CHECK answer at once and the client polls with exponential backoff
// (1 ms .. 50 ms) until its own deadline, so no wait can outlive its timeout
// on the server side. Every client socket operation polls first with a
// deadline; errors name host:port. A connection that failed (timeout, reset,
// server gone) is closed and every later call fails fast with Unavailable
// rather than reconnecting: the keys lived in the server, so there is nothing
// to reconnect to.
#ifndef FSDPP_COMM_TCP_STORE_H_
#define FSDPP_COMM_TCP_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {

class TcpStore final : public Store {
 public:
  // With `is_server`, starts a server listening on `port` of every interface
  // and connects to it at `host` (an IPv4 address or a name resolved with
  // getaddrinfo; `port` 0 picks a free port, see port()). Without, connects to
  // the server at `host`:`port`, retrying with backoff while it is not up yet.
  // Fails after `timeout` with DeadlineExceeded naming host:port. `timeout`
  // also bounds every later request/reply exchange with the server.
  static absl::StatusOr<std::unique_ptr<TcpStore>> Create(
      std::string host, int port, bool is_server, absl::Duration timeout);

  // Disconnects; a server also stops serving, and its clients' pending and
  // later calls fail with Unavailable.
  ~TcpStore() override;

  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::Status Delete(absl::string_view key) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

  // The server's host as given to Create.
  const std::string& host() const { return host_; }
  // The server's port: the one actually bound when Create was given port 0.
  int port() const { return port_; }
  // Whether this store hosts the server.
  bool is_server() const { return server_ != nullptr; }

 private:
  class Server;
  class Client;

  TcpStore(std::string host, int port, std::unique_ptr<Server> server,
           std::unique_ptr<Client> client);

  // Sends a request payload, returns the reply payload.
  absl::StatusOr<std::string> Call(
      const std::string& request,
      absl::Time call_deadline = absl::InfiniteFuture());
  // "host:port", for messages.
  std::string Where() const;

  std::string host_;
  int port_;
  // Declared before client_ so the client disconnects first.
  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace fsdpp

#endif  // FSDPP_COMM_TCP_STORE_H_
