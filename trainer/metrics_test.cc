#include "trainer/metrics.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

TEST(MetricsTest, UnigramLossIsTheEntropyOfTheRange) {
  // Tokens 1,1,2,2 in the range [1, 5): p = 1/2, 1/2 -> ln 2. Token 7 outside
  // the range does not count.
  auto store = TokenStore::FromVector({7, 1, 2, 1, 2, 7});
  EXPECT_NEAR(UnigramLoss(*store, 1, 5), std::log(2.0), 1e-12);
  // One token repeated: 0. Empty range: 0.
  auto same = TokenStore::FromVector({3, 3, 3});
  EXPECT_EQ(UnigramLoss(*same, 0, 3), 0.0);
  EXPECT_EQ(UnigramLoss(*same, 2, 2), 0.0);
  // 1/4, 1/4, 1/2.
  auto mixed = TokenStore::FromVector({0, 5, 9, 9});
  EXPECT_NEAR(UnigramLoss(*mixed, 0, 4),
              -(0.25 * std::log(0.25) * 2 + 0.5 * std::log(0.5)), 1e-12);
  // A loss mask leaves the context out: 5 and 9 trained, 1/2 each.
  auto masked = TokenStore::FromVector({0, 5, 9, 9}, {0, 1, 1, 0});
  EXPECT_NEAR(UnigramLoss(*masked, 0, 4), std::log(2.0), 1e-12);
  EXPECT_EQ(UnigramLoss(*masked, 0, 1), 0.0);
}

TEST(MetricsTest, ThroughputLeavesWarmupOut) {
  ThroughputMeter m;
  EXPECT_EQ(m.tokens_per_s(), 0);
  m.Add(2.0, 100, /*warmup=*/true);
  // Only warm-up so far: it is all there is.
  EXPECT_DOUBLE_EQ(m.tokens_per_s(), 50);
  EXPECT_EQ(m.measured_steps(), 1);
  m.Add(0.5, 100, false);
  m.Add(0.5, 100, false);
  EXPECT_DOUBLE_EQ(m.tokens_per_s(), 200);
  EXPECT_DOUBLE_EQ(m.mean_step_s(), 0.5);
  EXPECT_EQ(m.measured_steps(), 2);
}

TEST(MetricsTest, MemoryTableHasEveryComponentPerRank) {
  MemoryStats a, b;
  a.current[static_cast<int>(MemoryTag::kParams)] = 1 << 20;
  a.current[static_cast<int>(MemoryTag::kOptimizerState)] = 2 << 20;
  a.total_current = 3 << 20;
  a.total_peak = 5 << 20;
  a.reserved_bytes = 8 << 20;
  a.peak[static_cast<int>(MemoryTag::kActivations)] = 4 << 20;
  b.peak[static_cast<int>(MemoryTag::kAttention)] = 256 << 10;
  b.current[static_cast<int>(MemoryTag::kGrads)] = 512 << 10;
  b.total_current = 512 << 10;
  b.total_peak = 512 << 10;
  b.reserved_bytes = 512 << 10;
  const std::string table = FormatMemoryTable({a, b}, "At start:");
  std::vector<std::string> lines = absl::StrSplit(table, '\n');
  ASSERT_GE(lines.size(), 16u) << table;
  EXPECT_EQ(lines[0], "At start:");
  EXPECT_EQ(lines[1], "Component (MiB)             rank 0    rank 1");
  EXPECT_EQ(lines[3], "Parameters (sharded)          1.00      0.00");
  EXPECT_EQ(lines[4], "Gradients (sharded)           0.00      0.50");
  EXPECT_EQ(lines[5], "Optimizer state               2.00      0.00");
  EXPECT_EQ(lines[9], "Attention                     0.00      0.00");
  EXPECT_EQ(lines[11], "Total                         3.00      0.50");
  EXPECT_EQ(lines[12], "Peak (since start)            5.00      0.50");
  EXPECT_EQ(lines[13], "Held from the system          8.00      0.50");
  EXPECT_EQ(lines[14], "Peak activations              4.00      0.00");
  EXPECT_EQ(lines[15], "Peak attention                0.00      0.25");
}

TEST(MetricsTest, EtaAndJsonNumbers) {
  EXPECT_EQ(FormatEta(9.4), "9s");
  EXPECT_EQ(FormatEta(245), "4m05s");
  EXPECT_EQ(FormatEta(7380), "2h03m");
  EXPECT_EQ(FormatEta(-1), "?");
  EXPECT_EQ(FormatEta(std::nan("")), "?");
  EXPECT_EQ(JsonNumber(0.25), "0.25");
  EXPECT_EQ(JsonNumber(std::nan("")), "null");
  EXPECT_EQ(JsonNumber(std::numeric_limits<double>::infinity()), "null");
}

TEST(MetricsTest, JsonlAppendsLinesAndCreatesTheDirectory) {
  const std::string dir =
      std::string(std::getenv("TEST_TMPDIR")) + "/jsonl/sub";
  const std::string path = dir + "/m.jsonl";
  {
    auto w = JsonlWriter::Open(path);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Write("{\"a\":1}").ok());
  }
  {
    auto w = JsonlWriter::Open(path);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("{\"b\":2}").ok());
  }
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), "{\"a\":1}\n{\"b\":2}\n");
  auto bad = JsonlWriter::Open("/proc/no/such/dir/m.jsonl");
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(DirName("a/b/c.jsonl"), "a/b");
  EXPECT_EQ(DirName("c.jsonl"), "");
  EXPECT_EQ(DirName("/c"), "/");
}

// Every record kind's line, field by field in order; NaN as null; the loss
// scale only with f16.
TEST(MetricsTest, RecordsAsJsonLines) {
  RunRecord run;
  run.model = "gpt2_\"debug\"";
  run.world_size = 2;
  run.params = 3;
  run.trainable_params = 2;
  run.tokens_per_step = 4;
  run.steps = 5;
  run.start_step = 1;
  run.unigram_loss = 0.5;
  run.peak_tflops_per_rank = 0.25;
  run.flops_per_token = 8;
  EXPECT_EQ(ToJson(run),
            "{\"kind\":\"run\",\"model\":\"gpt2_\\\"debug\\\"\","
            "\"world_size\":2,\"params\":3,\"trainable_params\":2,"
            "\"tokens_per_step\":4,\"steps\":5,"
            "\"start_step\":1,\"unigram_loss\":0.5,\"peak_tflops_per_rank\":"
            "0.25,\"flops_per_token\":8}");
  TrainRecord train;
  train.step = 7;
  train.loss = 2;
  train.grad_norm = std::nan("");
  train.warmup = true;
  EXPECT_EQ(ToJson(train),
            "{\"kind\":\"train\",\"step\":7,\"loss\":2,\"lr\":0,"
            "\"grad_norm\":null,\"tokens_per_s\":0,\"tokens_per_s_per_rank\":0,"
            "\"tflops_per_rank\":0,\"mfu\":0,\"step_time_s\":0,"
            "\"exposed_comm_s\":0,\"elapsed_s\":0,\"warmup\":true}");
  train.has_loss_scale = true;
  train.loss_scale = 1024;
  train.skipped = true;
  EXPECT_TRUE(absl::EndsWith(ToJson(train),
                             ",\"warmup\":true,\"loss_scale\":1024,"
                             "\"skipped\":true}"))
      << ToJson(train);
  EXPECT_EQ(ToJson(ValidationRecord{9, 1.5}),
            "{\"kind\":\"val\",\"step\":9,\"val_loss\":1.5}");
  SummaryRecord summary;
  summary.steps = 10;
  summary.val_loss = std::nan("");
  EXPECT_EQ(ToJson(summary),
            "{\"kind\":\"summary\",\"steps\":10,\"loss\":0,\"val_loss\":null,"
            "\"tokens_per_s\":0,\"tokens_per_s_per_rank\":0,"
            "\"tflops_per_rank\":0,\"mfu\":0,\"exposed_comm_s_per_step\":0,"
            "\"step_time_s\":0}");
  // On a GPU: the host syncs over the run.
  summary.step_time_s = 0.25;
  summary.host_syncs = 3;
  const std::string gpu = ToJson(summary);
  EXPECT_NE(gpu.find("\"step_time_s\":0.25,\"host_syncs\":3}"),
            std::string::npos)
      << gpu;
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
