// A process group that moves no data, for dry runs (plan/dry_run.h): every
// op completes at once and is recorded (kind, group, ranks, bytes), so the
// sharding code runs unchanged on meta tensors while a planner learns which
// collectives one step issues. Its device is Device::DryRun(). It also
// allocates, on that device, the scratch the real backend would: Gloo's
// (comm/gloo_backend.h GlooScratch: the reduce-scatter's per-stream chunk
// buffers, held and grown, and the f32 staging of bf16 reductions for the
// op's duration). NCCL's scratch lives on the GPU only while an op runs and
// is not modelled. An all-to-all's in-place staging is not seen either
// (meta buffers have no addresses to compare); FSDP issues none.
#ifndef FSDPP_PLAN_SIMULATED_GROUP_H_
#define FSDPP_PLAN_SIMULATED_GROUP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "core/stream.h"

namespace fsdpp {
namespace plan {

// One collective a simulated rank issued.
struct SimulatedOp {
  std::string kind;   // "all_gather", "reduce_scatter", "all_reduce", ...
  std::string group;  // the group's name (e.g. "train/shard")
  int group_size = 1;
  // Bytes of this rank's input and output buffers (all-gather: the shard in,
  // the whole out; reduce-scatter: the whole in, the shard out; all-reduce
  // and broadcast: the buffer both ways; all-to-all (even or not): the
  // buffers; point-to-point: sent and received).
  int64_t in_bytes = 0;
  int64_t out_bytes = 0;
};

// The ops of one dry run, in issue order; shared by every group of a mesh.
class SimulatedOpLog {
 public:
  void Add(SimulatedOp op);
  std::vector<SimulatedOp> ops() const;
  void Clear();

 private:
  mutable std::mutex mu_;
  std::vector<SimulatedOp> ops_;
};

// Whose memory behaviour a simulated group reproduces: Gloo over TCP,
// Gloo with its all-gathers and reduce-scatters through shared memory
// (GlooOptions::shared_memory granted: no ring buffers held), or NCCL.
enum class SimulatedBackend { kGloo, kGlooSharedMemory, kNccl };

class SimulatedProcessGroup final : public ProcessGroup {
 public:
  SimulatedProcessGroup(std::string name, int rank, int size,
                        SimulatedOpLog* log,
                        SimulatedBackend backend = SimulatedBackend::kGloo);
  ~SimulatedProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  Device device() const override { return Device::DryRun(); }
  Stream* comm_stream() override { return &stream_; }

  absl::StatusOr<std::shared_ptr<Work>> AllGather(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  // As the backend it stands for: Gloo through shared memory only. Recorded
  // as "all_gather": this rank's runs in, every rank's out.
  bool AllGathersRuns() const override {
    return backend_ == SimulatedBackend::kGlooSharedMemory;
  }
  absl::StatusOr<std::shared_ptr<Work>> AllGatherRuns(
      const Buffer& output, const std::vector<std::vector<BufferRun>>& runs,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatter(
      const Buffer& input, const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  // As the backend it stands for: Gloo through shared memory only. Recorded
  // as "reduce_scatter", with the scratch of a one-buffer input.
  bool ReduceScattersSpans() const override {
    return backend_ == SimulatedBackend::kGlooSharedMemory;
  }
  absl::StatusOr<std::shared_ptr<Work>> ReduceScatterSpans(
      DType dtype, const std::vector<std::vector<BufferSpan>>& spans,
      const Buffer& output, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  // As the backend it stands for: Gloo widens, NCCL does not.
  bool ReduceScatterWidens() const override {
    return backend_ != SimulatedBackend::kNccl;
  }
  absl::StatusOr<std::shared_ptr<Work>> AllReduce(
      const Buffer& buffer, ReduceOp op,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Broadcast(
      const Buffer& buffer, int root,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> AllToAll(
      const Buffer& input, const Buffer& output,
      const CollectiveOptions& options = {}) override;
  // Recorded as "all_to_all_v" with the buffers' bytes, as AllToAll (this
  // rank's own chunk included); Gloo's exchange needs no scratch.
  absl::StatusOr<std::shared_ptr<Work>> AllToAllV(
      const Buffer& input, const std::vector<int64_t>& input_splits,
      const Buffer& output, const std::vector<int64_t>& output_splits,
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> Barrier(
      const CollectiveOptions& options = {}) override;
  absl::StatusOr<std::shared_ptr<Work>> BatchP2P(
      const std::vector<P2POp>& ops,
      const CollectiveOptions& options = {}) override;

 private:
  // Records the op and returns its (completed) Work.
  std::shared_ptr<Work> Done(const char* kind, int64_t in_bytes,
                             int64_t out_bytes);
  // Gloo's scratch for an op on `options`' stream: the held area grown to
  // `held`, then `transient` bytes allocated and freed.
  absl::Status Scratch(const CollectiveOptions& options, int64_t held,
                       int64_t transient);

  std::string name_;
  int rank_, size_;
  SimulatedOpLog* log_;
  SimulatedBackend backend_;
  CpuStream stream_;
  std::mutex mu_;
  std::map<const Stream*, int64_t> held_;  // per stream, bytes
};

// A factory for DeviceMesh making SimulatedProcessGroups that record into
// `log` (not owned).
ProcessGroupFactory SimulatedGroupFactory(
    SimulatedOpLog* log, SimulatedBackend backend = SimulatedBackend::kGloo);

}  // namespace plan
}  // namespace fsdpp

#endif  // FSDPP_PLAN_SIMULATED_GROUP_H_
