// The training data loader: packs a token range into fixed windows of
// seq_len + 1 tokens (inputs = the first seq_len, targets = the last seq_len,
// shifted by one), deals them to data-parallel ranks and batches them.
//
// Windows: window w of a range [begin, end) covers tokens
// [begin + w*L, begin + w*L + L + 1) for L = seq_len, so windows overlap by
// one token (llm.c's layout): every token in [begin, begin + S*L) is an input
// of exactly one window and every token in (begin, begin + S*L] a target of
// exactly one, S = (end - begin - 1) / L. The tail shorter than a window is
// never read.
//
// Order and ranks: epoch e visits the windows in the order of a counter-based
// permutation P_e (permutation.h, keyed by the seed, stream e; identity
// without shuffle). The epoch is a sequence of slots 0, 1, ..., U-1 with
// U = floor(S / D) * D for D data-parallel ranks, slot k holding window
// P_e(k); rank r reads slots r, r + D, r + 2D, ... ("every D-th sequence"),
// so in each epoch the ranks read disjoint windows, all ranks read the same
// number, and the S - U windows of the last slots are skipped that epoch
// (a different set each epoch). Each call to Next() gives every rank
// batch_size rows and advances the global position by batch_size * D slots;
// a batch may run across an epoch boundary.
//
// Loss masks: when the store has one (SFT data), a target that is not a
// loss target (a prompt token) is kIgnoredTarget in Batch::targets, and
// LossTargetsAhead counts what a step's batches train on over every rank.
//
// Resuming: the state (LoaderState) is the epoch and the global slot
// position, identical on all ranks. Restoring it in a fresh loader yields
// exactly the batches the saved loader would have produced next. Because the
// position counts global slots, a state can also be restored at another
// world size whose D divides the position.
#ifndef FSDPP_TRAINER_DATA_LOADER_H_
#define FSDPP_TRAINER_DATA_LOADER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/data/loader_state.pb.h"
#include "trainer/data/token_store.h"

namespace fsdpp {
namespace trainer {

// What a DataLoader reads and how.
struct LoaderOptions {
  int64_t seq_len = 0;     // Tokens per row of inputs (and of targets).
  int64_t batch_size = 1;  // Rows per batch on this rank (the micro batch).
  int dp_rank = 0;         // This rank in the data-parallel group.
  int dp_world = 1;        // Data-parallel ranks (replicate x shard).
  uint64_t seed = 0;       // Keys the per-epoch permutations.
  bool shuffle = true;     // False: windows in order every epoch.
};

// The target of a token that is not a loss target (the loss's
// ignore_index).
constexpr int32_t kIgnoredTarget = -100;

// One batch for one rank, rows row-major.
struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> inputs;  // batch_size x seq_len.
  // inputs shifted by one token; kIgnoredTarget where the store's loss
  // mask leaves the token out.
  std::vector<int32_t> targets;
  // Per row: the window index (in [0, num_sequences())) and the epoch it
  // was read in.
  std::vector<int64_t> windows;
  std::vector<int64_t> epochs;
};

// Deals windows of a token range to one data-parallel rank; see the file
// comment for the layout and order.
class DataLoader {
 public:
  // A loader over tokens [begin, end) of `store`. InvalidArgument for bad
  // options or range; FailedPrecondition when the range holds fewer windows
  // than there are data-parallel ranks.
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(
      std::shared_ptr<const TokenStore> store, int64_t begin, int64_t end,
      const LoaderOptions& options);

  // Windows in the range (S).
  int64_t num_sequences() const { return num_sequences_; }
  // Slots per epoch (U = floor(S / D) * D); each rank reads U / D of them.
  int64_t slots_per_epoch() const { return slots_per_epoch_; }
  // The window in slot `slot` (< slots_per_epoch()) of epoch `epoch`.
  int64_t WindowAt(int64_t epoch, int64_t slot) const;
  // The first token of window `window` within the store.
  int64_t WindowStart(int64_t window) const {
    return begin_ + window * options_.seq_len;
  }
  // The options it was created with.
  const LoaderOptions& options() const { return options_; }
  // Whether the store has a loss mask (SFT data: some targets ignored).
  bool masked() const { return store_->has_loss_mask(); }

  // This rank's next batch; advances the position.
  Batch Next();

  // The loss targets (targets that are not kIgnoredTarget) in the next
  // `batches` calls of Next() on every data-parallel rank together -- a
  // step's global count, the same on every rank, read from the store
  // without advancing. batches x batch_size x dp_world x seq_len without a
  // loss mask.
  int64_t LossTargetsAhead(int64_t batches) const;

  // The current position and stream identity.
  LoaderState state() const;

  // Continues from `state`. FailedPrecondition when it belongs to another
  // stream (seed, shuffle, window count or seq_len differ) or its position
  // is not a multiple of the data-parallel world size or is outside the
  // epoch; the loader is unchanged then.
  absl::Status Restore(const LoaderState& state);

  // Back to epoch 0, position 0 (used to rerun a validation pass).
  void Reset() {
    epoch_ = 0;
    position_ = 0;
  }

 private:
  DataLoader() = default;

  std::shared_ptr<const TokenStore> store_;
  int64_t begin_ = 0;
  LoaderOptions options_;
  int64_t num_sequences_ = 0;
  int64_t slots_per_epoch_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_LOADER_H_
