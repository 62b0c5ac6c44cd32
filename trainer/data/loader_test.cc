// Tests of the data loader: input/target layout, disjoint coverage across
// data-parallel ranks, determinism, exact resumption through a serialized
// state, and the errors of Create and Restore (exact text).
#include "trainer/data/loader.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace trainer {
namespace {

// Tokens whose value is their position, so a row shows where it came from.
std::shared_ptr<const TokenStore> Positions(int64_t count) {
  std::vector<int32_t> tokens(count);
  std::iota(tokens.begin(), tokens.end(), 0);
  return TokenStore::FromVector(std::move(tokens));
}

std::unique_ptr<DataLoader> MakeLoader(int64_t tokens, LoaderOptions options,
                                       int64_t begin = 0) {
  auto loader = DataLoader::Create(Positions(begin + tokens), begin,
                                   begin + tokens, options);
  EXPECT_TRUE(loader.ok()) << loader.status();
  return loader.ok() ? *std::move(loader) : nullptr;
}

TEST(DataLoaderTest, TargetsAreInputsShiftedByOne) {
  LoaderOptions options;
  options.seq_len = 8;
  options.batch_size = 3;
  options.shuffle = false;
  // Range [100, 100 + 8 * 5 + 4): 5 windows, the 4-token tail unread.
  auto loader = MakeLoader(44, options, /*begin=*/100);
  EXPECT_EQ(loader->num_sequences(), 5);
  const Batch batch = loader->Next();
  ASSERT_EQ(batch.inputs.size(), 24u);
  for (int64_t row = 0; row < 3; ++row) {
    EXPECT_EQ(batch.windows[row], row);
    EXPECT_EQ(batch.epochs[row], 0);
    for (int64_t t = 0; t < 8; ++t) {
      EXPECT_EQ(batch.inputs[row * 8 + t], 100 + row * 8 + t);
      EXPECT_EQ(batch.targets[row * 8 + t], 100 + row * 8 + t + 1);
    }
  }
  // Windows 3, 4, then epoch 1 starts again at window 0.
  const Batch next = loader->Next();
  EXPECT_EQ(next.windows, (std::vector<int64_t>{3, 4, 0}));
  EXPECT_EQ(next.epochs, (std::vector<int64_t>{0, 0, 1}));
}

// For D = 1..4 and window counts divisible by D or not: within each epoch
// the ranks read disjoint windows, all reading the same number, and every
// input token position is read exactly once except those of the
// S mod D windows skipped that epoch.
TEST(DataLoaderTest, RanksReadDisjointWindowsCoveringTheEpoch) {
  constexpr int64_t kSeqLen = 4;
  for (int64_t sequences : {12, 13, 23}) {
    const int64_t tokens = sequences * kSeqLen + 1;
    for (int world = 1; world <= 4; ++world) {
      const int64_t per_rank = sequences / world;
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::vector<int> reads(sequences * kSeqLen, 0);
        for (int rank = 0; rank < world; ++rank) {
          LoaderOptions options;
          options.seq_len = kSeqLen;
          options.batch_size = 1;
          options.dp_rank = rank;
          options.dp_world = world;
          options.seed = 99;
          auto loader = MakeLoader(tokens, options);
          LoaderState state = loader->state();
          state.set_epoch(epoch);
          ASSERT_TRUE(loader->Restore(state).ok());
          for (int64_t i = 0; i < per_rank; ++i) {
            const Batch batch = loader->Next();
            ASSERT_EQ(batch.epochs[0], epoch);
            for (int32_t position : batch.inputs) ++reads[position];
          }
          // The epoch is over for every rank after the same count.
          EXPECT_EQ(loader->state().epoch(), epoch + 1);
          EXPECT_EQ(loader->state().position(), 0);
        }
        int64_t read_once = 0;
        for (int count : reads) {
          ASSERT_LE(count, 1) << "S=" << sequences << " D=" << world;
          read_once += count;
        }
        EXPECT_EQ(read_once, per_rank * world * kSeqLen)
            << "S=" << sequences << " D=" << world;
        if (sequences % world == 0) {
          EXPECT_EQ(read_once, sequences * kSeqLen);
        }
      }
    }
  }
}

TEST(DataLoaderTest, EpochsAreShuffledDifferently) {
  LoaderOptions options;
  options.seq_len = 4;
  options.batch_size = 50;
  options.seed = 1;
  auto loader = MakeLoader(50 * 4 + 1, options);
  const Batch epoch0 = loader->Next();
  const Batch epoch1 = loader->Next();
  EXPECT_EQ(epoch1.epochs[0], 1);
  EXPECT_NE(epoch0.windows, epoch1.windows);
  std::vector<int64_t> sorted = epoch0.windows;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> all(50);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sorted, all);
  EXPECT_NE(epoch0.windows, all);
}

TEST(DataLoaderTest, DeterministicGivenTheSeed) {
  LoaderOptions options;
  options.seq_len = 16;
  options.batch_size = 4;
  options.dp_rank = 1;
  options.dp_world = 3;
  options.seed = 2024;
  auto a = MakeLoader(10000, options);
  auto b = MakeLoader(10000, options);
  options.seed = 2025;
  auto c = MakeLoader(10000, options);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {  // Several epochs (208 slots / 12 a step).
    const Batch batch_a = a->Next();
    EXPECT_EQ(batch_a.inputs, b->Next().inputs);
    differs |= batch_a.inputs != c->Next().inputs;
  }
  EXPECT_TRUE(differs);
}

TEST(DataLoaderTest, ResumesExactlyFromASerializedState) {
  for (int world : {1, 2, 3}) {
    for (int64_t saved_after : {0, 1, 7, 25}) {  // 25 crosses epochs.
      std::vector<std::unique_ptr<DataLoader>> original, resumed;
      for (int rank = 0; rank < world; ++rank) {
        LoaderOptions options;
        options.seq_len = 8;
        options.batch_size = 2;
        options.dp_rank = rank;
        options.dp_world = world;
        options.seed = 5;
        original.push_back(MakeLoader(8 * 61 + 3, options));
        resumed.push_back(MakeLoader(8 * 61 + 3, options));
      }
      for (int64_t step = 0; step < saved_after; ++step) {
        for (auto& loader : original) loader->Next();
      }
      // Ranks agree on the state; it goes through its wire format.
      const std::string saved = original[0]->state().SerializeAsString();
      for (auto& loader : original) {
        EXPECT_EQ(loader->state().SerializeAsString(), saved);
      }
      LoaderState state;
      ASSERT_TRUE(state.ParseFromString(saved));
      for (auto& loader : resumed) ASSERT_TRUE(loader->Restore(state).ok());
      for (int64_t step = 0; step < 40; ++step) {
        for (int rank = 0; rank < world; ++rank) {
          const Batch expected = original[rank]->Next();
          const Batch actual = resumed[rank]->Next();
          ASSERT_EQ(actual.inputs, expected.inputs)
              << "world " << world << " saved after " << saved_after << " step "
              << step << " rank " << rank;
          ASSERT_EQ(actual.targets, expected.targets);
          ASSERT_EQ(actual.epochs, expected.epochs);
        }
      }
    }
  }
}

TEST(DataLoaderTest, ResetRestartsTheStream) {
  LoaderOptions options;
  options.seq_len = 4;
  options.batch_size = 3;
  options.shuffle = false;
  auto loader = MakeLoader(101, options);
  const Batch first = loader->Next();
  loader->Next();
  loader->Reset();
  EXPECT_EQ(loader->Next().inputs, first.inputs);
}

TEST(DataLoaderTest, CreateErrors) {
  LoaderOptions options;
  options.seq_len = 128;
  options.dp_world = 4;
  auto too_few = DataLoader::Create(Positions(400), 0, 400, options);
  EXPECT_EQ(too_few.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(too_few.status().message(),
            "data loader: 400 tokens make 3 sequences of 128 + 1 tokens, "
            "fewer than the 4 data-parallel ranks");
  options.dp_rank = 4;
  EXPECT_EQ(
      DataLoader::Create(Positions(400), 0, 400, options).status().message(),
      "data loader: rank 4 is not in a data-parallel world of 4");
  options = LoaderOptions();
  EXPECT_EQ(
      DataLoader::Create(Positions(400), 0, 400, options).status().message(),
      "data loader: seq_len (0) and batch_size (1) must be positive");
  options.seq_len = 4;
  EXPECT_EQ(
      DataLoader::Create(Positions(400), 10, 500, options).status().message(),
      "data loader: token range [10, 500) is not inside [0, 400)");
  EXPECT_EQ(DataLoader::Create(nullptr, 0, 0, options).status().message(),
            "data loader: no token store");
}

TEST(DataLoaderTest, RestoreErrors) {
  LoaderOptions options;
  options.seq_len = 4;
  options.dp_world = 4;
  options.seed = 3;
  auto loader = MakeLoader(4 * 30 + 1, options);  // 30 windows, 28 slots.
  LoaderState other = loader->state();
  other.set_seed(4);
  EXPECT_EQ(loader->Restore(other).message(),
            "loader state is for 30 sequences of 4 tokens (seed 4, shuffled) "
            "but this loader reads 30 sequences of 4 tokens (seed 3, "
            "shuffled)");
  LoaderState unaligned = loader->state();
  unaligned.set_position(6);
  EXPECT_EQ(loader->Restore(unaligned).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(loader->Restore(unaligned).message(),
            "loader state position 6 is not a multiple of the 4 data-parallel "
            "ranks");
  LoaderState outside = loader->state();
  outside.set_position(28);
  EXPECT_EQ(loader->Restore(outside).message(),
            "loader state epoch 0 position 28 is outside the 28 slots of an "
            "epoch for 4 data-parallel ranks");
  EXPECT_EQ(loader->state().position(), 0);  // Unchanged by failures.
}

// The position counts global slots, so a state saved at world size 2 (at a
// position divisible by 4) continues the same global stream at world size 4.
TEST(DataLoaderTest, StateCarriesOverToAnotherWorldSize) {
  constexpr int64_t kTokens = 4 * 40 + 1;  // 40 windows.
  LoaderOptions options;
  options.seq_len = 4;
  options.seed = 11;
  // One rank reading everything defines the global order.
  auto global = MakeLoader(kTokens, options);
  std::vector<int64_t> order;
  for (int i = 0; i < 40; ++i) order.push_back(global->Next().windows[0]);
  options.dp_world = 2;
  auto two = MakeLoader(kTokens, options);
  for (int i = 0; i < 4; ++i) two->Next();  // 8 slots consumed.
  const LoaderState state = two->state();
  ASSERT_EQ(state.position(), 8);
  for (int rank = 0; rank < 4; ++rank) {
    options.dp_world = 4;
    options.dp_rank = rank;
    auto four = MakeLoader(kTokens, options);
    ASSERT_TRUE(four->Restore(state).ok());
    EXPECT_EQ(four->Next().windows[0], order[8 + rank]);
    EXPECT_EQ(four->Next().windows[0], order[12 + rank]);
  }
}

}  // namespace
}  // namespace trainer
}  // namespace fsdpp
