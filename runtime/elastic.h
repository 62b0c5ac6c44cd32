// Elastic rendezvous of launchers (torchrun's `--nnodes=MIN:MAX`): the
// launchers of a job agree, round after round, on which nodes take part, over
// a Store that node 0's launcher hosts (the rendezvous endpoint,
// MASTER_ADDR:MASTER_PORT). Each round fixes the membership, and from it
// every node's group rank and the world size its ranks are started with.
//
// Design (all keys under "elastic/"):
//   * Joining round r: Add("r<r>/count", 1) gives the node a slot, and
//     Set("r<r>/slot<i>", "<node id> <nproc>") says who it is.
//   * Node 0 closes the round: as soon as max_nodes have joined, or once at
//     least min_nodes have and no one joined for `last_call`; fewer than
//     min_nodes after `timeout` is an error. It writes the members (the
//     max_nodes smallest node ids that joined, sorted, in "r<r>/members", so
//     node 0 is always in, as group rank 0, and its host serves the ranks'
//     store) and then "closed" = r.
//   * A node that joined after the round closed (it is not among the
//     members: a node that came back, or a slow one) asks the running round
//     to restart ("r<r>/restart" = "join ...") and joins r + 1: the job
//     grows at that restart. A launcher whose ranks failed does the same
//     with "fail ...", and every launcher of round r polls that key while
//     its ranks run, stops them when it appears and joins r + 1. A node that
//     is gone never joins again, so r + 1 closes without it after
//     `last_call`: the job shrinks.
//   * A round's nodes whose ranks all finished Add("r<r>/finished", 1); node
//     0 keeps serving the store until every member did (bounded).
// Node 0 itself must survive: its loss ends the job (the other launchers'
// store calls fail, and they say so), as with torchrun's c10d endpoint.
// Every store call has the store's own deadline; every wait here has
// `timeout` at most.
#ifndef FSDPP_RUNTIME_ELASTIC_H_
#define FSDPP_RUNTIME_ELASTIC_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store.h"

namespace fsdpp {
namespace launch {

struct ElasticOptions {
  // The node's identity (its --node_rank), unique in the job; node 0 hosts
  // the store and closes the rounds.
  int node_id = 0;
  // Ranks this node starts; every node must start the same number.
  int nproc_per_node = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  // A round closes this long after the last join once min_nodes are in.
  absl::Duration last_call = absl::Seconds(10);
  // Longest wait for a round to close (or, for node 0, to reach min_nodes).
  absl::Duration timeout = absl::Seconds(300);
  // Asked between polls while waiting: true gives up with Cancelled (the
  // launcher was told to stop). Unset: never.
  std::function<bool()> cancelled;
};

// One closed round, as this node sees it.
struct ElasticRound {
  int64_t round = 0;
  // Node ids of the members, ascending; group rank = index.
  std::vector<int> members;
  int group_rank = 0;
  int world_size = 0;
  // RANK of this node's local rank 0.
  int rank_offset = 0;
};

class ElasticRendezvous {
 public:
  // `store` (not owned) must outlive this; node 0's is the server's.
  ElasticRendezvous(Store* store, ElasticOptions options);

  // Joins the next round this node can be part of and returns it once
  // closed: the first open round, or, when that closes without this node,
  // the one after it (asking the running round to restart so the job grows).
  absl::StatusOr<ElasticRound> Join();

  // The reason a restart of the current round was asked for ("fail ..." or
  // "join ..."), or nullopt; an error when the store cannot be reached.
  absl::StatusOr<std::optional<std::string>> RestartRequested();

  // Asks every member of the current round to restart (the first reason
  // stays).
  absl::Status RequestRestart(const std::string& reason);

  // This node's ranks of the current round all finished.
  absl::Status MarkFinished();

  // Node 0: waits (up to `timeout`) until every member of the current round
  // marked itself finished, so the store outlives their last calls.
  absl::Status WaitAllFinished(absl::Duration timeout);

 private:
  std::string Key(int64_t round, const std::string& name) const;
  // Node 0: closes `round` by the rule above and publishes its members.
  absl::StatusOr<std::vector<int>> Close(int64_t round);
  // Reads the members published for `round`.
  absl::StatusOr<std::vector<int>> Members(int64_t round);

  Store* store_;
  ElasticOptions options_;
  int64_t round_ = -1;     // The current (last joined) round.
  int64_t members_n_ = 0;  // Its member count.
};

}  // namespace launch
}  // namespace fsdpp

#endif  // FSDPP_RUNTIME_ELASTIC_H_
