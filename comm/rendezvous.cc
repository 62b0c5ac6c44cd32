// Rendezvous from launcher environment variables; see rendezvous.h.
#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "comm/tcp_store.h"
#include "core/status.h"

namespace fsdpp {
namespace {

using GetEnv = std::function<const char*(const char*)>;

constexpr const char* kTorchrunVars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK",
                                         "LOCAL_WORLD_SIZE"};
constexpr const char* kOpenMpiVars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr const char* kSlurmVars[] = {"SLURM_PROCID", "SLURM_NTASKS"};

template <size_t N>
bool AnySet(const GetEnv& getenv, const char* const (&names)[N]) {
  for (const char* name : names) {
    if (getenv(name) != nullptr) return true;
  }
  return false;
}

// Reads variables of one launcher, collecting every problem.
class EnvReader {
 public:
  EnvReader(const GetEnv& getenv, std::string source)
      : getenv_(getenv), source_(std::move(source)) {}

  bool IsSet(const char* name) const { return getenv_(name) != nullptr; }

  // The value of `name`, or nullopt (recording it as missing).
  std::optional<std::string> Str(const char* name) {
    const char* value = getenv_(name);
    if (value == nullptr) {
      missing_.push_back(name);
      return std::nullopt;
    }
    if (*value == '\0') {
      problems_.push_back(absl::StrCat(name, " is empty"));
      return std::nullopt;
    }
    return std::string(value);
  }

  // The integer value of `name`, or nullopt (recording why).
  std::optional<int> Int(const char* name) {
    const char* value = getenv_(name);
    if (value == nullptr) {
      missing_.push_back(name);
      return std::nullopt;
    }
    int v = 0;
    if (!absl::SimpleAtoi(value, &v)) {
      problems_.push_back(
          absl::StrCat(name, "='", value, "' is not an integer"));
      return std::nullopt;
    }
    return v;
  }

  void AddMissing(std::string what) { missing_.push_back(std::move(what)); }
  void AddProblem(std::string what) { problems_.push_back(std::move(what)); }

  // Checks lo <= value <= hi (`hi_inclusive`) or lo <= value < hi, when both
  // were read. `hi_name` names the variable `hi` came from ("" for a
  // constant).
  void CheckRange(const std::optional<int>& value, absl::string_view name,
                  int lo, const std::optional<int>& hi,
                  absl::string_view hi_name, bool hi_inclusive) {
    if (!value.has_value() || !hi.has_value()) return;
    const bool ok =
        *value >= lo && (hi_inclusive ? *value <= *hi : *value < *hi);
    if (!ok) {
      const std::string hi_text =
          hi_name.empty() ? absl::StrCat(*hi) : absl::StrCat(hi_name, "=", *hi);
      problems_.push_back(absl::StrCat(name, "=", *value, " is not in [", lo,
                                       ", ", hi_text,
                                       hi_inclusive ? "]" : ")"));
    }
  }

  // Checks value[name] >= lo (when the value was read).
  void CheckAtLeast(const std::optional<int>& value, absl::string_view name,
                    int lo) {
    if (value.has_value() && *value < lo) {
      problems_.push_back(
          absl::StrCat(name, "=", *value, " must be at least ", lo));
    }
  }

  // OK, or one InvalidArgument naming every problem.
  absl::Status Finish() const {
    if (missing_.empty() && problems_.empty()) return absl::OkStatus();
    std::vector<std::string> parts;
    if (!missing_.empty()) {
      parts.push_back(absl::StrCat("missing ", absl::StrJoin(missing_, ", ")));
    }
    parts.insert(parts.end(), problems_.begin(), problems_.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous (", source_, " env): ", absl::StrJoin(parts, "; ")));
  }

 private:
  const GetEnv& getenv_;
  std::string source_;
  std::vector<std::string> missing_;
  std::vector<std::string> problems_;
};

// Parses SLURM_TASKS_PER_NODE ("4(x2),3") and returns the task count of node
// `node`; nullopt if malformed or there is no such node.
std::optional<int> SlurmTasksOnNode(absl::string_view spec, int node) {
  int first_node = 0;
  for (absl::string_view entry : absl::StrSplit(spec, ',')) {
    int repeat = 1;
    absl::string_view count_text = entry;
    const size_t paren = entry.find('(');
    if (paren != absl::string_view::npos) {
      count_text = entry.substr(0, paren);
      absl::string_view rest = entry.substr(paren);
      if (!absl::ConsumePrefix(&rest, "(x") ||
          !absl::ConsumeSuffix(&rest, ")") ||
          !absl::SimpleAtoi(rest, &repeat) || repeat < 1) {
        return std::nullopt;
      }
    }
    int count = 0;
    if (!absl::SimpleAtoi(count_text, &count) || count < 1) return std::nullopt;
    if (node >= first_node && node - first_node < repeat) return count;
    first_node += repeat;
  }
  return std::nullopt;
}

}  // namespace

int SlurmPort(int job_id, int step_id) {
  const int64_t mix = static_cast<int64_t>(job_id) * 31 + step_id;
  return 10000 + static_cast<int>(mix % 20000);
}

namespace {

// The part shared by every launcher: the range checks. `port` is
// MASTER_PORT's value unless the launcher derived it (Slurm).
absl::StatusOr<RendezvousInfo> Finish(
    EnvReader& env, const char* rank_name, const std::optional<int>& rank,
    const char* size_name, const std::optional<int>& size,
    const char* local_rank_name, const std::optional<int>& local_rank,
    const std::string& local_size_name, const std::optional<int>& local_size,
    const std::optional<std::string>& addr, const std::optional<int>& port,
    const char* source) {
  env.CheckAtLeast(size, size_name, 1);
  env.CheckRange(rank, rank_name, 0, size, size_name, false);
  env.CheckRange(local_size, local_size_name, 1, size, size_name, true);
  env.CheckRange(local_rank, local_rank_name, 0, local_size, local_size_name,
                 false);
  env.CheckRange(port, "MASTER_PORT", 1, 65535, "", true);
  FSDPP_RETURN_IF_ERROR(env.Finish());
  RendezvousInfo info;
  info.rank = *rank;
  info.world_size = *size;
  info.local_rank = *local_rank;
  info.local_world_size = *local_size;
  info.master_addr = *addr;
  info.master_port = *port;
  info.source = source;
  return info;
}

absl::StatusOr<RendezvousInfo> FromTorchrun(const GetEnv& getenv) {
  EnvReader env(getenv, "torchrun");
  const std::optional<int> rank = env.Int("RANK");
  const std::optional<int> size = env.Int("WORLD_SIZE");
  const std::optional<int> local_rank = env.Int("LOCAL_RANK");
  const std::optional<int> local_size = env.Int("LOCAL_WORLD_SIZE");
  const std::optional<std::string> addr = env.Str("MASTER_ADDR");
  return Finish(env, "RANK", rank, "WORLD_SIZE", size, "LOCAL_RANK", local_rank,
                "LOCAL_WORLD_SIZE", local_size, addr, env.Int("MASTER_PORT"),
                "torchrun");
}

absl::StatusOr<RendezvousInfo> FromOpenMpi(const GetEnv& getenv) {
  EnvReader env(getenv, "openmpi");
  const std::optional<int> rank = env.Int("OMPI_COMM_WORLD_RANK");
  const std::optional<int> size = env.Int("OMPI_COMM_WORLD_SIZE");
  const std::optional<int> local_rank = env.Int("OMPI_COMM_WORLD_LOCAL_RANK");
  const std::optional<int> local_size = env.Int("OMPI_COMM_WORLD_LOCAL_SIZE");
  const std::optional<std::string> addr = env.Str("MASTER_ADDR");
  return Finish(env, "OMPI_COMM_WORLD_RANK", rank, "OMPI_COMM_WORLD_SIZE", size,
                "OMPI_COMM_WORLD_LOCAL_RANK", local_rank,
                "OMPI_COMM_WORLD_LOCAL_SIZE", local_size, addr,
                env.Int("MASTER_PORT"), "openmpi");
}

absl::StatusOr<RendezvousInfo> FromSlurm(const GetEnv& getenv) {
  EnvReader env(getenv, "slurm");
  const std::optional<int> rank = env.Int("SLURM_PROCID");
  const std::optional<int> size = env.Int("SLURM_NTASKS");
  const std::optional<int> local_rank = env.Int("SLURM_LOCALID");

  std::optional<int> local_size;
  std::string local_size_name = "SLURM_NTASKS_PER_NODE";
  if (env.IsSet("SLURM_NTASKS_PER_NODE")) {
    local_size = env.Int("SLURM_NTASKS_PER_NODE");
  } else if (env.IsSet("SLURM_TASKS_PER_NODE")) {
    local_size_name = "SLURM_TASKS_PER_NODE";
    const std::optional<std::string> spec = env.Str("SLURM_TASKS_PER_NODE");
    std::optional<int> node = 0;
    if (env.IsSet("SLURM_NODEID")) node = env.Int("SLURM_NODEID");
    if (spec.has_value() && node.has_value()) {
      local_size = SlurmTasksOnNode(*spec, *node);
    }
    if (spec.has_value() && node.has_value() && !local_size.has_value()) {
      env.AddProblem(absl::StrCat(
          "SLURM_TASKS_PER_NODE='", *spec,
          "' is not a list like '4(x2),3' covering SLURM_NODEID=", *node));
    }
  } else {
    env.AddMissing("SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE)");
  }

  std::optional<std::string> addr;
  if (env.IsSet("MASTER_ADDR")) {
    addr = env.Str("MASTER_ADDR");
  } else if (env.IsSet("SLURM_LAUNCH_NODE_IPADDR")) {
    addr = env.Str("SLURM_LAUNCH_NODE_IPADDR");
  } else {
    env.AddMissing("MASTER_ADDR (or SLURM_LAUNCH_NODE_IPADDR)");
  }

  // Slurm sets no port: one derived from the job and step ids, the same in
  // every task of a step and different for the steps and jobs that may
  // share a node, unless MASTER_PORT says otherwise.
  std::optional<int> port;
  if (env.IsSet("MASTER_PORT")) {
    port = env.Int("MASTER_PORT");
  } else if (env.IsSet("SLURM_JOB_ID")) {
    const std::optional<int> job = env.Int("SLURM_JOB_ID");
    std::optional<int> step = 0;
    if (env.IsSet("SLURM_STEP_ID")) step = env.Int("SLURM_STEP_ID");
    env.CheckAtLeast(job, "SLURM_JOB_ID", 0);
    env.CheckAtLeast(step, "SLURM_STEP_ID", 0);
    if (job.has_value() && step.has_value() && *job >= 0 && *step >= 0) {
      port = SlurmPort(*job, *step);
    }
  } else {
    env.AddMissing("MASTER_PORT (or SLURM_JOB_ID)");
  }
  return Finish(env, "SLURM_PROCID", rank, "SLURM_NTASKS", size,
                "SLURM_LOCALID", local_rank, local_size_name, local_size, addr,
                port, "slurm");
}

}  // namespace

absl::StatusOr<RendezvousInfo> RendezvousFromEnv(const GetEnv& getenv) {
  if (AnySet(getenv, kTorchrunVars)) return FromTorchrun(getenv);
  if (AnySet(getenv, kOpenMpiVars)) return FromOpenMpi(getenv);
  if (AnySet(getenv, kSlurmVars)) return FromSlurm(getenv);
  return absl::NotFoundError(
      "rendezvous: no launcher environment found; looked for torchrun "
      "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
      "MASTER_PORT), OpenMPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, "
      "OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE, MASTER_ADDR, "
      "MASTER_PORT) and Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, "
      "SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE, MASTER_ADDR or "
      "SLURM_LAUNCH_NODE_IPADDR, MASTER_PORT or SLURM_JOB_ID)");
}

absl::StatusOr<std::unique_ptr<Store>> StoreFromRendezvous(
    const RendezvousInfo& info, absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<TcpStore>> store = TcpStore::Create(
      info.master_addr, info.master_port, info.rank == 0, timeout);
  if (!store.ok()) {
    return Annotate(store.status(),
                    absl::StrCat("rendezvous (", info.source, ", rank ",
                                 info.rank, " of ", info.world_size, ")"));
  }
  return std::unique_ptr<Store>(std::move(*store));
}

absl::StatusOr<std::string> InterfaceAddress(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::InternalError(
        absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::string found;
  std::set<std::string> with_ipv4;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    with_ipv4.insert(a->ifa_name);
    if (name == a->ifa_name && found.empty()) {
      char text[INET_ADDRSTRLEN] = {};
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      found = text;
    }
  }
  freeifaddrs(list);
  if (found.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "network interface '", name,
        "' does not exist or has no IPv4 address (interfaces with one: ",
        absl::StrJoin(with_ipv4, ", "), ")"));
  }
  return found;
}

absl::StatusOr<std::string> ListenAddress(const RendezvousInfo& info,
                                          const GetEnv& getenv) {
  for (const char* var : {"FSDPP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* name = getenv(var);
    if (name != nullptr && name[0] != '\0') {
      absl::StatusOr<std::string> address = InterfaceAddress(name);
      if (!address.ok()) return Annotate(address.status(), var);
      return address;
    }
  }
  if (info.world_size == info.local_world_size) return std::string("127.0.0.1");
  // The local end of the route to the master: a UDP "connect" sends
  // nothing, it only picks the route and the source address.
  addrinfo hints = {};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* resolved = nullptr;
  const std::string port =
      absl::StrCat(info.master_port > 0 ? info.master_port : 9);
  if (getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, &resolved) !=
          0 ||
      resolved == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve MASTER_ADDR '", info.master_addr,
                     "' to pick this node's address; set FSDPP_SOCKET_IFNAME"));
  }
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  std::string out;
  if (fd >= 0 && connect(fd, resolved->ai_addr, resolved->ai_addrlen) == 0) {
    sockaddr_in local = {};
    socklen_t length = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
      out = text;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(resolved);
  if (out.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no route to MASTER_ADDR '", info.master_addr,
                     "' to pick this node's address; set FSDPP_SOCKET_IFNAME"));
  }
  return out;
}

}  // namespace fsdpp
