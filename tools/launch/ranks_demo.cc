// A program that starts as one rank of a launched job through mesh/ranks.h's
// RunAsLaunchedRank (launch_test runs it under the launcher): every rank
// all-reduces rank + 1 over the world and prints the sum.
#include <cstdio>
#include <memory>

#include "absl/status/status.h"
#include "comm/process_group.h"
#include "core/status.h"
#include "mesh/device_mesh.h"
#include "mesh/ranks.h"

int main() {
  const absl::Status status = fsdpp::RunAsLaunchedRank(
      {{"dp", -1}}, [](int rank, fsdpp::DeviceMesh& mesh) -> absl::Status {
        FSDPP_ASSIGN_OR_RETURN(fsdpp::ProcessGroup * world, mesh.FlatGroup());
        float value = static_cast<float>(rank + 1);
        FSDPP_ASSIGN_OR_RETURN(
            std::shared_ptr<fsdpp::Work> work,
            world->AllReduce(fsdpp::Buffer{&value, 1, fsdpp::DType::kF32,
                                           fsdpp::Device::Cpu()},
                             fsdpp::ReduceOp::kSum));
        FSDPP_RETURN_IF_ERROR(work->Wait(absl::Seconds(30)));
        std::printf("rank %d of %d: sum %g\n", rank, mesh.size(), value);
        return absl::OkStatus();
      });
  if (!status.ok()) {
    std::fprintf(stderr, "ranks_demo: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
