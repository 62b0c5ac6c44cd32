// Rendezvous from a launcher's environment: who am I (rank, world size,
// local rank), where is the master's store (MASTER_ADDR:MASTER_PORT), and a
// TcpStore connected to it.
//
// Design: launchers are tried in a fixed order (torchrun, then OpenMPI, then
// Slurm), the first whose own variables appear wins, and that launcher's
// variables are then all required: nothing is defaulted, because a silently
// defaulted rank or world size hangs a job instead of failing it. Every
// missing, malformed or out-of-range variable is reported in one
// InvalidArgument message so a broken launch script is fixed in one go.
#ifndef FSDPP_COMM_RENDEZVOUS_H_
#define FSDPP_COMM_RENDEZVOUS_H_

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {

// This process's place in the job and where its store lives.
struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  // Rank and process count on this node.
  int local_rank = 0;
  int local_world_size = 1;
  // Host (name or IPv4 address) and port of rank 0's TcpStore.
  std::string master_addr;
  int master_port = 0;
  // The launcher the values came from: "torchrun", "openmpi" or "slurm".
  std::string source;
};

// Reads the rendezvous from the environment (through `getenv`, replaceable
// for tests):
//   torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//     MASTER_PORT; chosen if any of the first four is set.
//   openmpi: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}, MASTER_ADDR,
//     MASTER_PORT; chosen if any OMPI_COMM_WORLD_* above is set.
//   slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; local world size from
//     SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE (e.g. "4(x2),3": the
//     entry for node SLURM_NODEID when that is set, else the first); master
//     from MASTER_ADDR, else SLURM_LAUNCH_NODE_IPADDR; port from MASTER_PORT,
//     else SlurmPort(SLURM_JOB_ID, SLURM_STEP_ID or 0), so that `srun` alone
//     starts a job. Chosen if SLURM_PROCID or SLURM_NTASKS is set.
// InvalidArgument lists every missing, malformed or out-of-range variable of
// the chosen launcher; NotFound (listing what was looked for) if no launcher's
// variables are set at all.
absl::StatusOr<RendezvousInfo> RendezvousFromEnv(
    const std::function<const char*(const char*)>& getenv = ::getenv);

// The store port of Slurm job step (job_id, step_id) when MASTER_PORT is
// unset: in [10000, 30000), below Linux's ephemeral range, the same for every
// task of the step.
int SlurmPort(int job_id, int step_id);

// A TcpStore at info.master_addr:info.master_port, served by rank 0 and
// connected to by the others (retrying until `timeout`).
absl::StatusOr<std::unique_ptr<Store>> StoreFromRendezvous(
    const RendezvousInfo& info, absl::Duration timeout);

// The IPv4 address this rank's collectives listen on (GlooOptions::hostname):
//   FSDPP_SOCKET_IFNAME (or Gloo's GLOO_SOCKET_IFNAME) names the network
//     interface whose address to use (e.g. a node's "eth1" or a veth);
//   otherwise 127.0.0.1 when the job is one node (world size = local world
//     size);
//   otherwise the local address of the route to info.master_addr (the
//     interface the other nodes reach this one through).
// InvalidArgument naming the interface (and the ones there are) when it
// does not exist or has no IPv4 address; Unavailable when master_addr has no
// route.
absl::StatusOr<std::string> ListenAddress(
    const RendezvousInfo& info,
    const std::function<const char*(const char*)>& getenv = ::getenv);

// The IPv4 address of network interface `name`; InvalidArgument listing the
// interfaces with one when it has none.
absl::StatusOr<std::string> InterfaceAddress(const std::string& name);

}  // namespace fsdpp

#endif  // FSDPP_COMM_RENDEZVOUS_H_
