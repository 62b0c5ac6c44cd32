// Test helpers for optim: meshes whose process groups count the collectives
// issued through them, so tests can assert how much an API communicates
// (e.g. "exactly one all-reduce per sharding axis", "Step sends nothing") and
// how many bytes.
//
// Same setup as mesh/run_on_mesh.h RunOnMesh (thread ranks over real Gloo on
// loopback and one in-memory store) with the group factory wrapped, and one
// difference: no rank destroys its mesh before every rank has finished. A
// rank whose function sends nothing would otherwise tear its sockets down
// while a peer may still be completing Gloo's connection handshake, and the
// peer's DeviceMesh::Create then fails with "Connection closed by peer"
// (seen in about 1 of 20 runs of tests that never communicate).
#ifndef FSDPP_OPTIM_COUNTING_GROUPS_H_
#define FSDPP_OPTIM_COUNTING_GROUPS_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/gloo_backend.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "gtest/gtest.h"
#include "mesh/device_mesh.h"

namespace fsdpp {
namespace testing_util {

// Collectives issued on one group, by kind.
struct OpCounts {
  int all_gather = 0;
  int reduce_scatter = 0;
  int all_reduce = 0;
  int broadcast = 0;
  int all_to_all = 0;
  int all_to_all_v = 0;  // uneven all-to-alls (counted apart from even ones)
  int barrier = 0;
  int p2p = 0;  // point-to-point batches
  // All of them.
  int total() const {
    return all_gather + reduce_scatter + all_reduce + broadcast + all_to_all +
           all_to_all_v + barrier + p2p;
  }
};

// Payload bytes of the collectives issued on one group, by kind: an
// all-gather's output, a reduce-scatter's input, an all-reduce's buffer.
struct OpBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  // What an uneven all-to-all sends to the other ranks (its input less the
  // chunk it keeps).
  int64_t all_to_all_v_sent = 0;
  // What each rank sends with ring algorithms on `ranks` ranks: (n - 1) / n
  // of an all-gather's output or a reduce-scatter's input, twice that of an
  // all-reduce's buffer.
  double RingBytesSent(int ranks) const {
    const double f = ranks <= 1 ? 0.0 : (ranks - 1.0) / ranks;
    return f * (all_gather + reduce_scatter + 2.0 * all_reduce);
  }
};

// Forwards every op to `inner` and counts it (successfully issued or not).
class CountingProcessGroup final : public ProcessGroup {
 public:
  explicit CountingProcessGroup(std::unique_ptr<ProcessGroup> inner)
      : inner_(std::move(inner)) {}

  // The ops issued so far.
  OpCounts counts() const {
    OpCounts c;
    c.all_gather = all_gather_;
    c.reduce_scatter = reduce_scatter_;
    c.all_reduce = all_reduce_;
    c.broadcast = broadcast_;
    c.all_to_all = all_to_all_;
    c.all_to_all_v = all_to_all_v_;
    c.barrier = barrier_;
    c.p2p = p2p_;
    return c;
  }

  // The payload bytes so far.
  OpBytes bytes() const {
    OpBytes b;
    b.all_gather = all_gather_bytes_;
    b.reduce_scatter = reduce_scatter_bytes_;
    b.all_reduce = all_reduce_bytes_;
    b.all_to_all_v_sent = all_to_all_v_sent_;
    return b;
  }

  // ProcessGroup: every call is forwarded; collectives are counted first.
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  Device device() const override { return inner_->device(); }
  Stream* comm_stream() override { return inner_->comm_stream(); }

  absl::StatusOr<std::shared_ptr<Work>> AllGather(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override {
    ++all_gather_;
    all_gather_bytes_ += static_cast<int64_t>(output.nbytes());
    return inner_->AllGather(input, output, options);
  }
  bool AllGathersRuns() const override { return inner_->AllGathersRuns(); }
  // Counted as an all-gather of the runs' bytes.
  absl::StatusOr<std::shared_ptr<Work>> AllGatherRuns(
      const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
      const CollectiveOptions& options = {}) override {
    ++all_gather_;
    all_gather_bytes_ +=
        ElementsIn(runs) * static_cast<int64_t>(DTypeSize(output.dtype));
    return inner_->AllGatherRuns(output, runs, options);
  }
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatter(
      const Buffer& input, const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override {
    ++reduce_scatter_;
    reduce_scatter_bytes_ += static_cast<int64_t>(input.nbytes());
    return inner_->ReduceScatter(input, output, op, options);
  }
  bool ReduceScattersSpans() const override {
    return inner_->ReduceScattersSpans();
  }
  // Counted as a reduce-scatter of the spans' bytes.
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatterSpans(
      DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
      const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override {
    ++reduce_scatter_;
    reduce_scatter_bytes_ +=
        ElementsIn(spans) * static_cast<int64_t>(DTypeSize(dtype));
    return inner_->ReduceScatterSpans(dtype, spans, output, op, options);
  }
  bool ReduceScatterWidens() const override {
    return inner_->ReduceScatterWidens();
  }
  absl::StatusOr<std::shared_ptr<Work>> AllReduce(
      const Buffer& buffer, ReduceOp op,
      const CollectiveOptions& options = {}) override {
    ++all_reduce_;
    all_reduce_bytes_ += static_cast<int64_t>(buffer.nbytes());
    return inner_->AllReduce(buffer, op, options);
  }
  absl::StatusOr<std::shared_ptr<Work>> Broadcast(
      const Buffer& buffer, int root,
      const CollectiveOptions& options = {}) override {
    ++broadcast_;
    return inner_->Broadcast(buffer, root, options);
  }
  absl::StatusOr<std::shared_ptr<Work>> AllToAll(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override {
    ++all_to_all_;
    return inner_->AllToAll(input, output, options);
  }
  // Counted, and once issued, the bytes it sends to other ranks.
  absl::StatusOr<std::shared_ptr<Work>> AllToAllV(
      const Buffer& input, const std::vector<int64_t>& input_splits,
      const Buffer& output, const std::vector<int64_t>& output_splits,
      const CollectiveOptions& options = {}) override {
    ++all_to_all_v_;
    absl::StatusOr<std::shared_ptr<Work>> work =
        inner_->AllToAllV(input, input_splits, output, output_splits, options);
    if (work.ok()) {
      for (size_t r = 0; r < input_splits.size(); ++r) {
        if (static_cast<int>(r) == inner_->rank()) continue;
        all_to_all_v_sent_ +=
            input_splits[r] * static_cast<int64_t>(DTypeSize(input.dtype));
      }
    }
    return work;
  }
  absl::StatusOr<std::shared_ptr<Work>> Barrier(
      const CollectiveOptions& options = {}) override {
    ++barrier_;
    return inner_->Barrier(options);
  }
  absl::StatusOr<std::shared_ptr<Work>> BatchP2P(
      const std::vector<P2POp>& ops,
      const CollectiveOptions& options = {}) override {
    ++p2p_;
    return inner_->BatchP2P(ops, options);
  }

 private:
  std::unique_ptr<ProcessGroup> inner_;
  std::atomic<int> all_gather_{0}, reduce_scatter_{0}, all_reduce_{0},
      broadcast_{0}, all_to_all_{0}, all_to_all_v_{0}, barrier_{0}, p2p_{0};
  std::atomic<int64_t> all_gather_bytes_{0}, reduce_scatter_bytes_{0},
      all_reduce_bytes_{0}, all_to_all_v_sent_{0};
};

// The counts of the group along `axis` of `mesh` (built by
// RunOnCountingMesh).
inline OpCounts AxisCounts(const DeviceMesh& mesh, const std::string& axis) {
  absl::StatusOr<ProcessGroup*> group = mesh.Group(axis);
  EXPECT_TRUE(group.ok()) << group.status();
  if (!group.ok()) return {};
  auto* counting = dynamic_cast<CountingProcessGroup*>(*group);
  EXPECT_NE(counting, nullptr) << axis << " is not a counting group";
  return counting != nullptr ? counting->counts() : OpCounts{};
}

// The payload bytes of the group along `axis` of `mesh` (built by
// RunOnCountingMesh).
inline OpBytes AxisBytes(const DeviceMesh& mesh, const std::string& axis) {
  absl::StatusOr<ProcessGroup*> group = mesh.Group(axis);
  EXPECT_TRUE(group.ok()) << group.status();
  if (!group.ok()) return {};
  auto* counting = dynamic_cast<CountingProcessGroup*>(*group);
  EXPECT_NE(counting, nullptr) << axis << " is not a counting group";
  return counting != nullptr ? counting->bytes() : OpBytes{};
}

// Collectives issued on every axis group of `mesh` together.
inline int TotalOps(const DeviceMesh& mesh) {
  int total = 0;
  for (const MeshAxis& a : mesh.axes())
    total += AxisCounts(mesh, a.name).total();
  return total;
}

// RunOnMesh with counting groups: builds the mesh `axes` on world =
// product(sizes) thread ranks and calls fn(rank, mesh) on each once every
// rank's mesh is connected; meshes are destroyed once every fn returned.
inline void RunOnCountingMesh(const std::vector<MeshAxis>& axes,
                              const std::function<void(int, DeviceMesh&)>& fn,
                              absl::Duration timeout = absl::Seconds(60)) {
  int world = 1;
  for (const MeshAxis& a : axes) world *= a.size;
  InMemoryStore store;
  GlooOptions options;
  options.timeout = timeout;
  const ProcessGroupFactory gloo = GlooGroupFactory(&store, options);
  const ProcessGroupFactory counting =
      [&gloo](const std::string& name, int rank,
              int size) -> absl::StatusOr<std::unique_ptr<ProcessGroup>> {
    absl::StatusOr<std::unique_ptr<ProcessGroup>> inner =
        gloo(name, rank, size);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<ProcessGroup>(
        new CountingProcessGroup(*std::move(inner)));
  };
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  // Blocks until `target` arrivals in total (a reusable thread barrier).
  auto arrive_and_wait = [&](int target) {
    std::unique_lock<std::mutex> lock(mu);
    ++arrived;
    cv.notify_all();
    cv.wait(lock, [&] { return arrived >= target; });
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto mesh = DeviceMesh::Create(axes, r, world, counting);
      arrive_and_wait(world);
      if (mesh.ok()) {
        fn(r, **mesh);
      } else {
        ADD_FAILURE() << "rank " << r << ": " << mesh.status();
      }
      arrive_and_wait(2 * world);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_OPTIM_COUNTING_GROUPS_H_
