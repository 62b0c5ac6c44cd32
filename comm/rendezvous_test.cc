// Tests for RendezvousFromEnv (with a fake environment) and
// StoreFromRendezvous (over loopback).
#include "comm/rendezvous.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

using Env = std::map<std::string, std::string>;

absl::StatusOr<RendezvousInfo> FromEnv(const Env& env) {
  return RendezvousFromEnv([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(RendezvousTest, Torchrun) {
  absl::StatusOr<RendezvousInfo> info =
      FromEnv({{"RANK", "5"},
               {"WORLD_SIZE", "8"},
               {"LOCAL_RANK", "1"},
               {"LOCAL_WORLD_SIZE", "4"},
               {"MASTER_ADDR", "node0"},
               {"MASTER_PORT", "29500"},
               // Lower-priority launchers are ignored.
               {"OMPI_COMM_WORLD_RANK", "3"},
               {"SLURM_PROCID", "2"}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "node0");
  EXPECT_EQ(info->master_port, 29500);
  EXPECT_EQ(info->source, "torchrun");
}

TEST(RendezvousTest, TorchrunReportsEveryProblemAtOnce) {
  absl::StatusOr<RendezvousInfo> info = FromEnv(
      {{"RANK", "x"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(info.status().message(),
            "rendezvous (torchrun env): missing LOCAL_RANK, LOCAL_WORLD_SIZE, "
            "MASTER_PORT; RANK='x' is not an integer");
}

TEST(RendezvousTest, TorchrunEmptyAddress) {
  absl::StatusOr<RendezvousInfo> info = FromEnv({{"RANK", "0"},
                                                 {"WORLD_SIZE", "1"},
                                                 {"LOCAL_RANK", "0"},
                                                 {"LOCAL_WORLD_SIZE", "1"},
                                                 {"MASTER_ADDR", ""},
                                                 {"MASTER_PORT", "1"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(), HasSubstr("MASTER_ADDR is empty"));
}

TEST(RendezvousTest, RangeErrorsAreAllReported) {
  absl::StatusOr<RendezvousInfo> info = FromEnv({{"RANK", "4"},
                                                 {"WORLD_SIZE", "4"},
                                                 {"LOCAL_RANK", "-1"},
                                                 {"LOCAL_WORLD_SIZE", "2"},
                                                 {"MASTER_ADDR", "h"},
                                                 {"MASTER_PORT", "70000"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      info.status().message(),
      AllOf(HasSubstr("rendezvous (torchrun env)"),
            HasSubstr("RANK=4 is not in [0, WORLD_SIZE=4)"),
            HasSubstr("LOCAL_RANK=-1 is not in [0, LOCAL_WORLD_SIZE=2)"),
            HasSubstr("MASTER_PORT=70000 is not in [1, 65535]"),
            Not(HasSubstr("missing"))));

  info = FromEnv({{"RANK", "0"},
                  {"WORLD_SIZE", "0"},
                  {"LOCAL_RANK", "0"},
                  {"LOCAL_WORLD_SIZE", "0"},
                  {"MASTER_ADDR", "h"},
                  {"MASTER_PORT", "0"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(),
              AllOf(HasSubstr("WORLD_SIZE=0 must be at least 1"),
                    HasSubstr("MASTER_PORT=0 is not in [1, 65535]")));

  // More processes on a node than in the job.
  info = FromEnv({{"RANK", "0"},
                  {"WORLD_SIZE", "2"},
                  {"LOCAL_RANK", "0"},
                  {"LOCAL_WORLD_SIZE", "4"},
                  {"MASTER_ADDR", "h"},
                  {"MASTER_PORT", "1"}});
  EXPECT_THAT(info.status().message(),
              HasSubstr("LOCAL_WORLD_SIZE=4 is not in [1, WORLD_SIZE=2]"));
}

TEST(RendezvousTest, OpenMpi) {
  absl::StatusOr<RendezvousInfo> info =
      FromEnv({{"OMPI_COMM_WORLD_RANK", "3"},
               {"OMPI_COMM_WORLD_SIZE", "4"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"},
               {"MASTER_PORT", "1234"},
               {"SLURM_PROCID", "9"}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 1234);
  EXPECT_EQ(info->source, "openmpi");
}

TEST(RendezvousTest, OpenMpiMissingMaster) {
  absl::StatusOr<RendezvousInfo> info =
      FromEnv({{"OMPI_COMM_WORLD_RANK", "0"},
               {"OMPI_COMM_WORLD_SIZE", "2"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
               {"OMPI_COMM_WORLD_LOCAL_SIZE", "abc"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(info.status().message(),
            "rendezvous (openmpi env): missing MASTER_ADDR, MASTER_PORT; "
            "OMPI_COMM_WORLD_LOCAL_SIZE='abc' is not an integer");
}

TEST(RendezvousTest, SlurmWithNtasksPerNode) {
  absl::StatusOr<RendezvousInfo> info =
      FromEnv({{"SLURM_PROCID", "6"},
               {"SLURM_NTASKS", "8"},
               {"SLURM_LOCALID", "2"},
               {"SLURM_NTASKS_PER_NODE", "4"},
               {"SLURM_TASKS_PER_NODE", "99"},  // Lower priority.
               {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
               {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rank, 6);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "10.1.2.3");
  EXPECT_EQ(info->master_port, 29500);
  EXPECT_EQ(info->source, "slurm");
}

TEST(RendezvousTest, SlurmTasksPerNode) {
  Env env = {{"SLURM_PROCID", "0"},
             {"SLURM_NTASKS", "11"},
             {"SLURM_LOCALID", "0"},
             {"SLURM_TASKS_PER_NODE", "4(x2),3"},
             {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
             {"MASTER_ADDR", "master-host"},
             {"MASTER_PORT", "29500"}};
  absl::StatusOr<RendezvousInfo> info = FromEnv(env);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->local_world_size, 4);         // The first entry.
  EXPECT_EQ(info->master_addr, "master-host");  // MASTER_ADDR wins.

  env["SLURM_NODEID"] = "2";  // The third node runs 3 tasks.
  info = FromEnv(env);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->local_world_size, 3);

  env["SLURM_NODEID"] = "3";  // No such node.
  info = FromEnv(env);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(), HasSubstr("SLURM_TASKS_PER_NODE"));

  env.erase("SLURM_NODEID");
  env["SLURM_TASKS_PER_NODE"] = "4(2)";
  info = FromEnv(env);
  EXPECT_THAT(info.status().message(),
              HasSubstr("SLURM_TASKS_PER_NODE='4(2)' is not a list"));
}

TEST(RendezvousTest, SlurmMissingEverythingButProcId) {
  absl::StatusOr<RendezvousInfo> info = FromEnv({{"SLURM_PROCID", "0"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(info.status().message(),
            "rendezvous (slurm env): missing SLURM_NTASKS, SLURM_LOCALID, "
            "SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE), MASTER_ADDR (or "
            "SLURM_LAUNCH_NODE_IPADDR), MASTER_PORT (or SLURM_JOB_ID)");
}

TEST(RendezvousTest, SlurmPortFromTheJobAndStep) {
  Env env = {{"SLURM_PROCID", "1"},
             {"SLURM_NTASKS", "2"},
             {"SLURM_LOCALID", "1"},
             {"SLURM_TASKS_PER_NODE", "2"},
             {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"},
             {"SLURM_JOB_ID", "4711"},
             {"SLURM_STEP_ID", "2"}};
  absl::StatusOr<RendezvousInfo> info = FromEnv(env);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_port, SlurmPort(4711, 2));
  EXPECT_GE(info->master_port, 10000);
  EXPECT_LT(info->master_port, 30000);
  // Another step of the job, and another job, get other ports.
  EXPECT_NE(SlurmPort(4711, 2), SlurmPort(4711, 3));
  EXPECT_NE(SlurmPort(4711, 2), SlurmPort(4712, 2));
  EXPECT_EQ(SlurmPort(4711, 2), 10000 + (4711 * 31 + 2) % 20000);
  // The largest job ids stay in range.
  EXPECT_GE(SlurmPort(2147483647, 0), 10000);
  EXPECT_LT(SlurmPort(2147483647, 0), 30000);

  env["MASTER_PORT"] = "29500";  // MASTER_PORT wins.
  info = FromEnv(env);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_port, 29500);

  env.erase("MASTER_PORT");
  env["SLURM_JOB_ID"] = "x";
  info = FromEnv(env);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(info.status().message(),
              HasSubstr("SLURM_JOB_ID='x' is not an integer"));
}

TEST(RendezvousTest, NoLauncherSaysWhatWasLookedFor) {
  // MASTER_* alone does not pick a launcher.
  absl::StatusOr<RendezvousInfo> info =
      FromEnv({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(info.status().message(),
              AllOf(HasSubstr("RANK"), HasSubstr("OMPI_COMM_WORLD_RANK"),
                    HasSubstr("SLURM_PROCID"), HasSubstr("MASTER_PORT")));
}

TEST(RendezvousTest, DefaultReadsTheProcessEnvironment) {
  const char* names[] = {"RANK",        "WORLD_SIZE",
                         "LOCAL_RANK",  "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT"};
  const char* values[] = {"1", "2", "1", "2", "localhost", "29500"};
  for (int i = 0; i < 6; ++i) ::setenv(names[i], values[i], 1);
  absl::StatusOr<RendezvousInfo> info = RendezvousFromEnv();
  for (const char* name : names) ::unsetenv(name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->master_addr, "localhost");
  EXPECT_EQ(info->source, "torchrun");
}

TEST(RendezvousTest, StoreFromRendezvousConnectsRanks) {
  RendezvousInfo info0;
  info0.rank = 0;
  info0.world_size = 2;
  info0.master_addr = "127.0.0.1";
  info0.master_port = 0;  // Tests only: let rank 0 pick a free port.
  info0.source = "torchrun";
  absl::StatusOr<std::unique_ptr<Store>> store0 =
      StoreFromRendezvous(info0, absl::Seconds(5));
  ASSERT_TRUE(store0.ok()) << store0.status();
  auto* tcp0 = dynamic_cast<TcpStore*>(store0->get());
  ASSERT_NE(tcp0, nullptr);
  EXPECT_TRUE(tcp0->is_server());

  RendezvousInfo info1 = info0;
  info1.rank = 1;
  info1.master_port = tcp0->port();
  absl::StatusOr<std::unique_ptr<Store>> store1 =
      StoreFromRendezvous(info1, absl::Seconds(5));
  ASSERT_TRUE(store1.ok()) << store1.status();
  ASSERT_TRUE((*store1)->Set("rank1", "here").ok());
  absl::StatusOr<std::string> v = (*store0)->Get("rank1", absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
  store1->reset();

  store0->reset();

  // A rank whose server never comes up names the launcher and the address.
  // The port is bound but not listening, so connecting is refused.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  info1.master_port = ntohs(addr.sin_port);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Store>> late =
      StoreFromRendezvous(info1, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(late.ok());
  EXPECT_THAT(late.status().message(),
              AllOf(HasSubstr("rendezvous (torchrun, rank 1 of 2)"),
                    HasSubstr(absl::StrCat("127.0.0.1:", info1.master_port))));
  ::close(fd);
}

// The address the collectives listen on: an interface named by
// FSDPP_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME), loopback for one node, the
// route to the master for several.
TEST(RendezvousTest, ListenAddress) {
  auto env = [](const Env& e) {
    return [e](const char* name) -> const char* {
      auto it = e.find(name);
      return it == e.end() ? nullptr : it->second.c_str();
    };
  };
  RendezvousInfo one;
  one.world_size = one.local_world_size = 2;
  one.master_addr = "127.0.0.1";
  EXPECT_EQ(*ListenAddress(one, env({})), "127.0.0.1");
  EXPECT_EQ(*ListenAddress(one, env({{"FSDPP_SOCKET_IFNAME", "lo"}})),
            "127.0.0.1");
  EXPECT_EQ(*ListenAddress(one, env({{"GLOO_SOCKET_IFNAME", "lo"}})),
            "127.0.0.1");
  absl::Status bad =
      ListenAddress(one, env({{"FSDPP_SOCKET_IFNAME", "nosuch0"}})).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), AllOf(HasSubstr("FSDPP_SOCKET_IFNAME"),
                                   HasSubstr("'nosuch0'"), HasSubstr("lo")));
  // Two nodes: the local end of the route to the master (loopback here).
  RendezvousInfo two = one;
  two.world_size = 4;
  two.master_port = 29500;
  EXPECT_EQ(*ListenAddress(two, env({})), "127.0.0.1");
  two.master_addr = "no-such-host.invalid";
  EXPECT_EQ(ListenAddress(two, env({})).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fsdpp
