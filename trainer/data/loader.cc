// DataLoader: windows, per-epoch permutation, strided rank assignment and
// the resumable position; see loader.h.
#include "trainer/data/loader.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "trainer/data/permutation.h"

namespace fsdpp {
namespace trainer {
namespace {

std::string Describe(int64_t sequences, int64_t seq_len, uint64_t seed,
                     bool shuffle) {
  return absl::StrCat(sequences, " sequences of ", seq_len, " tokens (seed ",
                      seed, shuffle ? ", shuffled)" : ", in order)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(
    std::shared_ptr<const TokenStore> store, int64_t begin, int64_t end,
    const LoaderOptions& options) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("data loader: no token store");
  }
  if (options.seq_len <= 0 || options.batch_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data loader: seq_len (", options.seq_len, ") and batch_size (",
        options.batch_size, ") must be positive"));
  }
  if (options.dp_world <= 0 || options.dp_rank < 0 ||
      options.dp_rank >= options.dp_world) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: rank ", options.dp_rank,
                     " is not in a data-parallel world of ", options.dp_world));
  }
  if (begin < 0 || begin > end || end > store->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: token range [", begin, ", ", end,
                     ") is not inside [0, ", store->size(), ")"));
  }
  const int64_t tokens = end - begin;
  const int64_t sequences = tokens > 0 ? (tokens - 1) / options.seq_len : 0;
  if (sequences < options.dp_world) {
    return absl::FailedPreconditionError(absl::StrCat(
        "data loader: ", tokens, " tokens make ", sequences, " sequences of ",
        options.seq_len, " + 1 tokens, fewer than the ", options.dp_world,
        " data-parallel ranks"));
  }
  std::unique_ptr<DataLoader> loader(new DataLoader());
  loader->store_ = std::move(store);
  loader->begin_ = begin;
  loader->options_ = options;
  loader->num_sequences_ = sequences;
  loader->slots_per_epoch_ = sequences / options.dp_world * options.dp_world;
  return loader;
}

int64_t DataLoader::WindowAt(int64_t epoch, int64_t slot) const {
  CHECK(slot >= 0 && slot < slots_per_epoch_)
      << "slot " << slot << " of " << slots_per_epoch_;
  if (!options_.shuffle) return slot;
  const Permutation permutation(static_cast<uint64_t>(num_sequences_),
                                options_.seed, static_cast<uint64_t>(epoch));
  return static_cast<int64_t>(permutation(static_cast<uint64_t>(slot)));
}

Batch DataLoader::Next() {
  const int64_t rows = options_.batch_size;
  const int64_t length = options_.seq_len;
  Batch batch;
  batch.batch_size = rows;
  batch.seq_len = length;
  batch.inputs.resize(rows * length);
  batch.targets.resize(rows * length);
  batch.windows.resize(rows);
  batch.epochs.resize(rows);
  std::vector<int32_t> window_tokens(length + 1);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t window = WindowAt(epoch_, position_ + options_.dp_rank);
    batch.windows[row] = window;
    batch.epochs[row] = epoch_;
    store_->Read(WindowStart(window), length + 1, window_tokens.data());
    std::copy_n(window_tokens.data(), length,
                batch.inputs.data() + row * length);
    int32_t* targets = batch.targets.data() + row * length;
    std::copy_n(window_tokens.data() + 1, length, targets);
    if (store_->has_loss_mask()) {
      const int64_t first = WindowStart(window) + 1;
      for (int64_t i = 0; i < length; ++i) {
        if (!store_->IsLossTarget(first + i)) targets[i] = kIgnoredTarget;
      }
    }
    position_ += options_.dp_world;
    if (position_ == slots_per_epoch_) {
      ++epoch_;
      position_ = 0;
    }
  }
  return batch;
}

int64_t DataLoader::LossTargetsAhead(int64_t batches) const {
  const int64_t length = options_.seq_len;
  const int64_t slots = batches * options_.batch_size * options_.dp_world;
  if (!store_->has_loss_mask()) return slots * length;
  // The slots Next() reads from here on, every rank's: position_ onwards,
  // across epoch ends as Next() goes.
  int64_t epoch = epoch_, position = position_, count = 0;
  for (int64_t k = 0; k < slots; ++k) {
    count += store_->CountLossTargets(
        WindowStart(WindowAt(epoch, position)) + 1, length);
    if (++position == slots_per_epoch_) {
      ++epoch;
      position = 0;
    }
  }
  return count;
}

LoaderState DataLoader::state() const {
  LoaderState state;
  state.set_epoch(epoch_);
  state.set_position(position_);
  state.set_seed(options_.seed);
  state.set_shuffle(options_.shuffle);
  state.set_num_sequences(num_sequences_);
  state.set_seq_len(options_.seq_len);
  return state;
}

absl::Status DataLoader::Restore(const LoaderState& state) {
  if (state.seed() != options_.seed || state.shuffle() != options_.shuffle ||
      state.num_sequences() != num_sequences_ ||
      state.seq_len() != options_.seq_len) {
    return absl::FailedPreconditionError(
        absl::StrCat("loader state is for ",
                     Describe(state.num_sequences(), state.seq_len(),
                              state.seed(), state.shuffle()),
                     " but this loader reads ",
                     Describe(num_sequences_, options_.seq_len, options_.seed,
                              options_.shuffle)));
  }
  if (state.epoch() < 0 || state.position() < 0 ||
      state.position() >= slots_per_epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "loader state epoch ", state.epoch(), " position ", state.position(),
        " is outside the ", slots_per_epoch_, " slots of an epoch for ",
        options_.dp_world, " data-parallel ranks"));
  }
  if (state.position() % options_.dp_world != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("loader state position ", state.position(),
                     " is not a multiple of the ", options_.dp_world,
                     " data-parallel ranks"));
  }
  epoch_ = state.epoch();
  position_ = state.position();
  return absl::OkStatus();
}

}  // namespace trainer
}  // namespace fsdpp
