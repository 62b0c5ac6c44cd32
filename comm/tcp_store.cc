// TcpStore; see tcp_store.h.
//
// Wire format. Every message is a frame: u32 payload length, then the payload
// (at most kMaxFrameBytes). Integers are big-endian; a "str" is a u32 length
// followed by that many bytes. Requests start with an op byte:
//   SET    1  str key, str value           -> OK
//   GET    2  str key                      -> OK str value | NOT_FOUND
//   ADD    3  str key, i64 delta           -> OK i64 new value | ERROR
//   CHECK  4  u32 n, n x str key           -> OK, n bytes (1 = key present)
//   DELETE 5  str key                      -> OK
// Replies start with a status byte: OK 0, NOT_FOUND 1, ERROR 2 (followed by
// u32 absl::StatusCode and str message). A malformed request makes the server
// drop that connection.
#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "core/status.h"

namespace fsdpp {
namespace {

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kDelete = 5 };
enum Reply : uint8_t { kOk = 0, kNotFound = 1, kError = 2 };

constexpr uint32_t kMaxFrameBytes = 64u << 20;
constexpr size_t kReadChunkBytes = 64 << 10;
constexpr absl::Duration kMinPollBackoff = absl::Milliseconds(1);
// The least time a request/reply exchange gets, whatever the call's deadline.
constexpr absl::Duration kMinExchangeTime = absl::Milliseconds(100);
constexpr absl::Duration kMaxPollBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMinConnectBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxConnectBackoff = absl::Milliseconds(500);

// ---- Encoding -------------------------------------------------------------

void PutU8(std::string* out, uint8_t v) {
  out->push_back(static_cast<char>(v));
}

void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((v >> shift) & 0xFF));
  }
}

void PutI64(std::string* out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int shift = 56; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((u >> shift) & 0xFF));
  }
}

void PutStr(std::string* out, absl::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

uint32_t LoadU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Prepends the length header to `payload`.
std::string Frame(absl::string_view payload) {
  std::string frame;
  frame.reserve(4 + payload.size());
  PutU32(&frame, static_cast<uint32_t>(payload.size()));
  frame.append(payload.data(), payload.size());
  return frame;
}

// Reads fields from a payload; every getter returns false when the payload is
// too short.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  bool U8(uint8_t* v) {
    if (data_.empty()) return false;
    *v = static_cast<uint8_t>(data_[0]);
    data_.remove_prefix(1);
    return true;
  }
  bool U32(uint32_t* v) {
    if (data_.size() < 4) return false;
    *v = LoadU32(data_.data());
    data_.remove_prefix(4);
    return true;
  }
  bool I64(int64_t* v) {
    if (data_.size() < 8) return false;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<uint8_t>(data_[i]);
    *v = static_cast<int64_t>(u);
    data_.remove_prefix(8);
    return true;
  }
  bool Str(absl::string_view* s) {
    uint32_t n = 0;
    if (!U32(&n) || data_.size() < n) return false;
    *s = data_.substr(0, n);
    data_.remove_prefix(n);
    return true;
  }
  bool Bytes(size_t n, absl::string_view* s) {
    if (data_.size() < n) return false;
    *s = data_.substr(0, n);
    data_.remove_prefix(n);
    return true;
  }
  size_t remaining() const { return data_.size(); }
  bool done() const { return data_.empty(); }

 private:
  absl::string_view data_;
};

// ---- Requests and replies ------------------------------------------------

// Decodes a reply's status byte: kOk or kNotFound, the server's error for
// ERROR, and Internal for anything else.
absl::StatusOr<uint8_t> ReadReplyStatus(Reader* in, absl::string_view where) {
  uint8_t status = 0;
  if (!in->U8(&status)) {
    return absl::InternalError(
        absl::StrCat("tcp store ", where, ": empty reply"));
  }
  if (status == kOk || status == kNotFound) return status;
  uint32_t code = 0;
  absl::string_view message;
  if (status == kError && in->U32(&code) && in->Str(&message)) {
    const bool known =
        code > 0 &&
        code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);
    return absl::Status(known ? static_cast<absl::StatusCode>(code)
                              : absl::StatusCode::kInternal,
                        absl::StrCat("tcp store ", where, ": ", message));
  }
  return absl::InternalError(absl::StrCat("tcp store ", where,
                                          ": unexpected reply status ",
                                          static_cast<int>(status)));
}

// Like ReadReplyStatus, for requests whose only success is kOk.
absl::Status ExpectOk(Reader* in, absl::string_view where) {
  FSDPP_ASSIGN_OR_RETURN(const uint8_t status, ReadReplyStatus(in, where));
  if (status != kOk) {
    return absl::InternalError(
        absl::StrCat("tcp store ", where, ": unexpected NOT_FOUND reply"));
  }
  return absl::OkStatus();
}

// Internal error for a reply that does not parse.
absl::Status Malformed(absl::string_view where) {
  return absl::InternalError(
      absl::StrCat("tcp store ", where, ": malformed reply"));
}

// A request made of an op and one key.
std::string KeyRequest(Op op, absl::string_view key) {
  std::string req;
  PutU8(&req, op);
  PutStr(&req, key);
  return req;
}

// A CHECK request for `keys`.
std::string CheckRequest(const std::vector<std::string>& keys) {
  std::string req;
  PutU8(&req, kCheck);
  PutU32(&req, static_cast<uint32_t>(keys.size()));
  for (const std::string& key : keys) PutStr(&req, key);
  return req;
}

// ---- Sockets --------------------------------------------------------------

// Milliseconds for poll() covering `d` (rounded up; 0 if past).
int PollMillis(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return 0;
  const int64_t ms =
      absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

// Resolves an IPv4 address for `host`.
absl::StatusOr<sockaddr_in> Resolve(const std::string& host, int port) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    const std::string reason =
        rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc);
    if (result != nullptr) ::freeaddrinfo(result);
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", reason));
  }
  sockaddr_in addr;
  std::memcpy(&addr, result->ai_addr, sizeof(addr));
  ::freeaddrinfo(result);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

void SetNoDelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void CloseFd(int fd) {
  if (fd >= 0) ::close(fd);
}

// True if `fd` is connected to itself: connecting to an unused local port in
// the ephemeral range can pick that very port as the source and "succeed".
bool IsSelfConnected(int fd) {
  sockaddr_in local, peer;
  socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  return local.sin_port == peer.sin_port &&
         local.sin_addr.s_addr == peer.sin_addr.s_addr;
}

// One non-blocking connect attempt bounded by `deadline`; the connected
// socket, or the reason it failed.
absl::StatusOr<int> ConnectOnce(const std::string& host, int port,
                                absl::Time deadline) {
  FSDPP_ASSIGN_OR_RETURN(const sockaddr_in addr, Resolve(host, port));
  const int fd =
      ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  int err = 0;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) !=
      0) {
    err = errno;
    if (err == EINPROGRESS || err == EINTR) {
      pollfd pfd{fd, POLLOUT, 0};
      int rc;
      do {
        rc = ::poll(&pfd, 1, PollMillis(deadline - absl::Now()));
      } while (rc < 0 && errno == EINTR);
      if (rc < 0) {
        err = errno;
      } else if (rc == 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
          err = errno;
      }
    }
  }
  if (err == 0 && IsSelfConnected(fd)) err = ECONNREFUSED;
  if (err != 0) {
    CloseFd(fd);
    return absl::ErrnoToStatus(err, "connect");
  }
  SetNoDelay(fd);
  return fd;
}

}  // namespace

// ---- Server ---------------------------------------------------------------

class TcpStore::Server {
 public:
  // Binds and listens on host:port, then starts the serving thread.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const std::string& host,
                                                       int port) {
    const std::string where = absl::StrCat(host, ":", port);
    auto fail = [&](absl::string_view what, int err, int fd) {
      CloseFd(fd);
      return absl::UnavailableError(absl::StrCat("tcp store server: cannot ",
                                                 what, " ", where, ": ",
                                                 std::strerror(err)));
    };
    absl::StatusOr<sockaddr_in> addr = Resolve(host, port);
    if (!addr.ok()) {
      return Annotate(addr.status(),
                      absl::StrCat("tcp store server at ", where));
    }
    // Listen on every interface (as torch's TCPStore does): MASTER_ADDR may
    // be a hostname that resolves to a loopback alias on rank 0's machine
    // while other nodes reach it through a real interface.
    addr->sin_addr.s_addr = htonl(INADDR_ANY);
    const int fd =
        ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return fail("create a socket for", errno, -1);
    const int one = 1;
    if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
      return fail("set SO_REUSEADDR for", errno, fd);
    }
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) !=
        0) {
      return fail("bind", errno, fd);
    }
    if (::listen(fd, SOMAXCONN) != 0) return fail("listen on", errno, fd);
    sockaddr_in bound;
    socklen_t len = sizeof(bound);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      return fail("get the bound port of", errno, fd);
    }
    const int wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake < 0) return fail("create an eventfd for", errno, fd);
    return std::unique_ptr<Server>(new Server(fd, wake, ntohs(bound.sin_port)));
  }

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Wakes the serving thread, waits for it and closes every socket.
  ~Server() {
    const uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(wake_fd_, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    // EAGAIN means the counter is already non-zero: the thread will wake.
    thread_.join();
    CloseFd(listen_fd_);
    CloseFd(wake_fd_);
  }

  int port() const { return port_; }

 private:
  // One client connection: bytes received but not yet handled, and reply
  // bytes not yet sent.
  struct Conn {
    int fd;
    std::string in;
    std::string out;
    size_t out_pos = 0;
  };

  Server(int listen_fd, int wake_fd, int port)
      : listen_fd_(listen_fd), wake_fd_(wake_fd), port_(port) {
    thread_ = std::thread([this] { Run(); });
  }

  void Run() {
    std::vector<Conn> conns;
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (const Conn& c : conns) {
        const short events = static_cast<short>(
            POLLIN | (c.out_pos < c.out.size() ? POLLOUT : 0));
        fds.push_back({c.fd, events, 0});
      }
      const int rc = ::poll(fds.data(), fds.size(), -1);
      if (rc < 0) {
        if (errno == EINTR) continue;
        LOG(ERROR) << "tcp store server on port " << port_
                   << ": poll failed: " << std::strerror(errno)
                   << "; shutting down";
        break;
      }
      if (fds[0].revents != 0) break;  // Shutdown requested.
      // Connections accepted below are polled from the next round on, so
      // only the first `polled` entries of `conns` line up with `fds`.
      const size_t polled = conns.size();
      if (fds[1].revents != 0) Accept(&conns);
      std::vector<bool> drop(conns.size(), false);
      for (size_t i = 0; i < polled; ++i) {
        const short revents = fds[i + 2].revents;
        if (revents == 0) continue;
        if (revents & POLLNVAL) {
          drop[i] = true;
          continue;
        }
        if (revents & (POLLIN | POLLHUP | POLLERR)) {
          drop[i] = !Receive(&conns[i]);
        }
        if (!drop[i] && conns[i].out_pos < conns[i].out.size()) {
          drop[i] = !Flush(&conns[i]);
        }
      }
      size_t kept = 0;
      for (size_t i = 0; i < conns.size(); ++i) {
        if (drop[i]) {
          CloseFd(conns[i].fd);
        } else {
          if (kept != i) conns[kept] = std::move(conns[i]);
          ++kept;
        }
      }
      conns.resize(kept);
    }
    for (const Conn& c : conns) CloseFd(c.fd);
  }

  void Accept(std::vector<Conn>* conns) {
    for (;;) {
      const int fd =
          ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        SetNoDelay(fd);
        conns->push_back(Conn{fd, {}, {}, 0});
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        LOG(WARNING) << "tcp store server on port " << port_
                     << ": accept failed: " << std::strerror(errno);
        // E.g. out of descriptors: back off instead of spinning on poll.
        absl::SleepFor(absl::Milliseconds(10));
      }
      return;
    }
  }

  // Reads what is available (one chunk, for fairness between clients) and
  // handles every complete request. False: drop the connection.
  bool Receive(Conn* c) {
    char buf[kReadChunkBytes];
    const ssize_t n = ::recv(c->fd, buf, sizeof(buf), 0);
    if (n < 0) {
      return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK;
    }
    if (n == 0) return false;  // The client disconnected.
    c->in.append(buf, static_cast<size_t>(n));
    size_t pos = 0;
    while (c->in.size() - pos >= 4) {
      const uint32_t len = LoadU32(c->in.data() + pos);
      if (len > kMaxFrameBytes) {
        LOG(WARNING) << "tcp store server on port " << port_
                     << ": dropping a client that sent a " << len
                     << "-byte frame";
        return false;
      }
      if (c->in.size() - pos - 4 < len) break;
      std::optional<std::string> reply =
          Handle(absl::string_view(c->in).substr(pos + 4, len));
      if (!reply.has_value()) {
        LOG(WARNING) << "tcp store server on port " << port_
                     << ": dropping a client that sent a malformed request";
        return false;
      }
      c->out += Frame(*reply);
      pos += 4 + len;
    }
    c->in.erase(0, pos);
    return true;
  }

  // Sends pending reply bytes until done or the socket is full. False: drop.
  bool Flush(Conn* c) {
    while (c->out_pos < c->out.size()) {
      const ssize_t n = ::send(c->fd, c->out.data() + c->out_pos,
                               c->out.size() - c->out_pos, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK;
      }
      c->out_pos += static_cast<size_t>(n);
    }
    c->out.clear();
    c->out_pos = 0;
    return true;
  }

  static std::string ErrorReply(const absl::Status& status) {
    std::string reply;
    PutU8(&reply, kError);
    PutU32(&reply, static_cast<uint32_t>(status.code()));
    PutStr(&reply, status.message());
    return reply;
  }

  // The reply payload for one request payload; nullopt if it is malformed.
  std::optional<std::string> Handle(absl::string_view request) {
    Reader in(request);
    uint8_t op = 0;
    if (!in.U8(&op)) return std::nullopt;
    std::string reply;
    switch (op) {
      case kSet: {
        absl::string_view key, value;
        if (!in.Str(&key) || !in.Str(&value) || !in.done()) return std::nullopt;
        data_[std::string(key)] = std::string(value);
        PutU8(&reply, kOk);
        return reply;
      }
      case kGet: {
        absl::string_view key;
        if (!in.Str(&key) || !in.done()) return std::nullopt;
        auto it = data_.find(key);
        if (it == data_.end()) {
          PutU8(&reply, kNotFound);
        } else {
          PutU8(&reply, kOk);
          PutStr(&reply, it->second);
        }
        return reply;
      }
      case kAdd: {
        absl::string_view key;
        int64_t delta = 0;
        if (!in.Str(&key) || !in.I64(&delta) || !in.done()) return std::nullopt;
        int64_t value = 0;
        auto it = data_.find(key);
        if (it != data_.end()) {
          absl::StatusOr<int64_t> current = ParseCounter(key, it->second);
          if (!current.ok()) return ErrorReply(current.status());
          value = *current;
        }
        if (__builtin_add_overflow(value, delta, &value)) {
          return ErrorReply(absl::OutOfRangeError(absl::StrCat(
              "adding ", delta, " to key '", key, "' overflows int64")));
        }
        data_[std::string(key)] = absl::StrCat(value);
        PutU8(&reply, kOk);
        PutI64(&reply, value);
        return reply;
      }
      case kCheck: {
        uint32_t n = 0;
        if (!in.U32(&n) || n > in.remaining() / 4) return std::nullopt;
        PutU8(&reply, kOk);
        for (uint32_t i = 0; i < n; ++i) {
          absl::string_view key;
          if (!in.Str(&key)) return std::nullopt;
          PutU8(&reply, data_.find(key) != data_.end() ? 1 : 0);
        }
        if (!in.done()) return std::nullopt;
        return reply;
      }
      case kDelete: {
        absl::string_view key;
        if (!in.Str(&key) || !in.done()) return std::nullopt;
        auto it = data_.find(key);
        if (it != data_.end()) data_.erase(it);
        PutU8(&reply, kOk);
        return reply;
      }
      default:
        return std::nullopt;
    }
  }

  const int listen_fd_;
  const int wake_fd_;
  const int port_;
  // Touched only by thread_.
  std::map<std::string, std::string, std::less<>> data_;
  std::thread thread_;
};

// ---- Client ---------------------------------------------------------------

class TcpStore::Client {
 public:
  // Connects to host:port, retrying with backoff until `timeout` has passed.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& host, int port, absl::Duration timeout) {
    const std::string where = absl::StrCat(host, ":", port);
    const absl::Time deadline = absl::Now() + timeout;
    absl::Duration backoff = kMinConnectBackoff;
    int attempts = 0;
    for (;;) {
      ++attempts;
      absl::StatusOr<int> fd = ConnectOnce(host, port, deadline);
      if (fd.ok()) {
        return std::unique_ptr<Client>(new Client(*fd, where, timeout));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "tcp store: could not connect to ", where, " within ",
            absl::FormatDuration(timeout), " (", attempts,
            " attempts; last error: ", fd.status().message(), ")"));
      }
      absl::SleepFor(std::min(backoff, deadline - now));
      backoff = std::min(backoff * 2, kMaxConnectBackoff);
    }
  }

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() { CloseFd(fd_); }

  // Sends one request payload and returns the reply payload. After any
  // failure the connection is closed and later calls fail at once.
  // `call_deadline` bounds the whole call: the wait for the connection
  // while another thread's exchange holds it (a heartbeat write to a server
  // that went unreachable holds it until io_timeout) and the exchange (given
  // at least kMinExchangeTime, and at most io_timeout). An exchange cut
  // short leaves the connection broken (as any failed exchange does).
  absl::StatusOr<std::string> RoundTrip(
      absl::string_view request,
      absl::Time call_deadline = absl::InfiniteFuture()) {
    if (request.size() > kMaxFrameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp store ", where_, ": request of ", request.size(),
                       " bytes exceeds the ", kMaxFrameBytes, "-byte limit"));
    }
    std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
    if (call_deadline == absl::InfiniteFuture()) {
      lock.lock();
    } else if (!lock.try_lock_until(absl::ToChronoTime(call_deadline))) {
      return absl::DeadlineExceededError(absl::StrCat(
          "tcp store ", where_,
          ": the connection stayed busy with another request (the server "
          "may be unreachable)"));
    }
    if (!broken_.ok()) return broken_;
    // A call whose deadline is (nearly) past still gets a short exchange
    // (a zero-timeout Get checks once): cutting a healthy exchange short
    // would break the connection.
    const absl::Time now = absl::Now();
    const absl::Time deadline = std::min(
        now + io_timeout_, std::max(call_deadline, now + kMinExchangeTime));
    absl::StatusOr<std::string> reply = Exchange(request, deadline);
    if (!reply.ok()) {
      CloseFd(fd_);
      fd_ = -1;
      broken_ = absl::UnavailableError(absl::StrCat(
          "tcp store ", where_,
          ": connection lost earlier: ", reply.status().message()));
      return absl::Status(
          reply.status().code(),
          absl::StrCat("tcp store ", where_, ": ", reply.status().message()));
    }
    return reply;
  }

 private:
  Client(int fd, std::string where, absl::Duration io_timeout)
      : fd_(fd), where_(std::move(where)), io_timeout_(io_timeout) {}

  // One request/reply exchange. Messages do not name the server: RoundTrip
  // adds it.
  absl::StatusOr<std::string> Exchange(absl::string_view request,
                                       absl::Time deadline) {
    const std::string frame = Frame(request);
    FSDPP_RETURN_IF_ERROR(SendAll(frame, deadline));
    char header[4];
    FSDPP_RETURN_IF_ERROR(RecvExact(header, sizeof(header), deadline));
    const uint32_t len = LoadU32(header);
    if (len > kMaxFrameBytes) {
      return absl::InternalError(
          absl::StrCat("reply frame of ", len, " bytes is too big"));
    }
    std::string reply(len, '\0');
    FSDPP_RETURN_IF_ERROR(RecvExact(reply.data(), len, deadline));
    return reply;
  }

  // Waits until fd_ is ready for `events` or `deadline` passes.
  absl::Status WaitFor(short events, absl::Time deadline,
                       absl::string_view what) {
    for (;;) {
      pollfd pfd{fd_, events, 0};
      const int rc = ::poll(&pfd, 1, PollMillis(deadline - absl::Now()));
      if (rc > 0) return absl::OkStatus();
      if (rc == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat("no progress ", what, " within ",
                         absl::FormatDuration(io_timeout_)));
      }
      if (errno != EINTR) {
        return absl::UnavailableError(
            absl::StrCat("poll failed: ", std::strerror(errno)));
      }
    }
  }

  absl::Status SendAll(absl::string_view data, absl::Time deadline) {
    size_t done = 0;
    while (done < data.size()) {
      FSDPP_RETURN_IF_ERROR(WaitFor(POLLOUT, deadline, "sending a request"));
      const ssize_t n =
          ::send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return absl::UnavailableError(
            absl::StrCat("send failed: ", std::strerror(errno),
                         " (is rank 0 still alive?)"));
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status RecvExact(char* data, size_t size, absl::Time deadline) {
    size_t done = 0;
    while (done < size) {
      FSDPP_RETURN_IF_ERROR(WaitFor(POLLIN, deadline, "receiving a reply"));
      const ssize_t n = ::recv(fd_, data + done, size - done, 0);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return absl::UnavailableError(
            absl::StrCat("receive failed: ", std::strerror(errno),
                         " (is rank 0 still alive?)"));
      }
      if (n == 0) {
        return absl::UnavailableError(
            "the server closed the connection (is rank 0 still alive?)");
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  std::timed_mutex mu_;
  int fd_;  // -1 once broken.
  const std::string where_;
  const absl::Duration io_timeout_;
  absl::Status broken_;
};

// ---- TcpStore -------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TcpStore>> TcpStore::Create(
    std::string host, int port, bool is_server, absl::Duration timeout) {
  if (host.empty()) return absl::InvalidArgumentError("tcp store: empty host");
  if (port < 0 || port > 65535 || (port == 0 && !is_server)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp store: invalid port ", port, " for ", host,
                     is_server ? " (want 0..65535)" : " (want 1..65535)"));
  }
  std::unique_ptr<Server> server;
  if (is_server) {
    FSDPP_ASSIGN_OR_RETURN(server, Server::Start(host, port));
    port = server->port();
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Client> client,
                         Client::Connect(host, port, timeout));
  return std::unique_ptr<TcpStore>(new TcpStore(
      std::move(host), port, std::move(server), std::move(client)));
}

TcpStore::TcpStore(std::string host, int port, std::unique_ptr<Server> server,
                   std::unique_ptr<Client> client)
    : host_(std::move(host)),
      port_(port),
      server_(std::move(server)),
      client_(std::move(client)) {}

TcpStore::~TcpStore() = default;

std::string TcpStore::Where() const { return absl::StrCat(host_, ":", port_); }

absl::StatusOr<std::string> TcpStore::Call(const std::string& request,
                                           absl::Time call_deadline) {
  return client_->RoundTrip(request, call_deadline);
}

absl::Status TcpStore::Set(absl::string_view key, absl::string_view value) {
  std::string req = KeyRequest(kSet, key);
  PutStr(&req, value);
  FSDPP_ASSIGN_OR_RETURN(const std::string reply, Call(req));
  Reader in(reply);
  FSDPP_RETURN_IF_ERROR(ExpectOk(&in, Where()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> TcpStore::Get(absl::string_view key,
                                          absl::Duration timeout) {
  const std::string req = KeyRequest(kGet, key);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = kMinPollBackoff;
  for (;;) {
    FSDPP_ASSIGN_OR_RETURN(const std::string reply, Call(req, deadline));
    Reader in(reply);
    FSDPP_ASSIGN_OR_RETURN(const uint8_t status, ReadReplyStatus(&in, Where()));
    if (status == kOk) {
      absl::string_view value;
      if (!in.Str(&value) || !in.done()) return Malformed(Where());
      return std::string(value);
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return MissingKeysError(absl::StrCat("tcp store get at ", Where()),
                              {std::string(key)}, timeout);
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxPollBackoff);
  }
}

absl::StatusOr<int64_t> TcpStore::Add(absl::string_view key, int64_t delta) {
  std::string req = KeyRequest(kAdd, key);
  PutI64(&req, delta);
  FSDPP_ASSIGN_OR_RETURN(const std::string reply, Call(req));
  Reader in(reply);
  FSDPP_RETURN_IF_ERROR(ExpectOk(&in, Where()));
  int64_t value = 0;
  if (!in.I64(&value) || !in.done()) return Malformed(Where());
  return value;
}

absl::StatusOr<bool> TcpStore::Check(const std::vector<std::string>& keys) {
  FSDPP_ASSIGN_OR_RETURN(const std::string reply, Call(CheckRequest(keys)));
  Reader in(reply);
  FSDPP_RETURN_IF_ERROR(ExpectOk(&in, Where()));
  absl::string_view present;
  if (!in.Bytes(keys.size(), &present) || !in.done()) return Malformed(Where());
  return std::all_of(present.begin(), present.end(),
                     [](char c) { return c != 0; });
}

absl::Status TcpStore::Delete(absl::string_view key) {
  FSDPP_ASSIGN_OR_RETURN(const std::string reply,
                         Call(KeyRequest(kDelete, key)));
  Reader in(reply);
  FSDPP_RETURN_IF_ERROR(ExpectOk(&in, Where()));
  return absl::OkStatus();
}

absl::Status TcpStore::Wait(const std::vector<std::string>& keys,
                            absl::Duration timeout) {
  const std::string req = CheckRequest(keys);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = kMinPollBackoff;
  for (;;) {
    FSDPP_ASSIGN_OR_RETURN(const std::string reply, Call(req));
    Reader in(reply);
    FSDPP_RETURN_IF_ERROR(ExpectOk(&in, Where()));
    absl::string_view present;
    if (!in.Bytes(keys.size(), &present) || !in.done()) {
      return Malformed(Where());
    }
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (present[i] == 0) missing.push_back(keys[i]);
    }
    if (missing.empty()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return MissingKeysError(absl::StrCat("tcp store wait at ", Where()),
                              missing, timeout);
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxPollBackoff);
  }
}

}  // namespace fsdpp
