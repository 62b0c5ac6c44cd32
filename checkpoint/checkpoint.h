// Distributed checkpoints (DCP-style): every rank saves its own shards in
// parallel and loads whatever shards it needs now, at any world size or mesh.
//
// Layout: `<root>/step-<N>/` holds one data file per writing rank
// (`rank-<r>.data`: raw chunk bytes, each chunk 64-byte aligned) and
// `metadata.pb` (metadata.h), written by rank 0 last.
//
// Save, in three phases:
//  1. Plan. Every rank lists what it holds: each StateDict key with its
//     dtype, global shape and this rank's box (LocalBox of a DTensor, the
//     whole value otherwise). Rank 0 gathers the lists, and every rank
//     derives the same global plan from them: keys must agree on kind, dtype
//     and shape across ranks, distinct boxes must tile each shape, and each
//     box held by several ranks (replicas: Replicate axes, plain tensors,
//     byte values) gets one writer, chosen by hashing key and box over its
//     holders, so replicated values are written once and spread over ranks.
//  2. Write. Each rank writes its boxes into `<root>/.step-<N>.tmp/` with a
//     CRC-32C per chunk and per block, and fdatasyncs its file.
//  3. Commit. Rank 0 gathers what every rank wrote (or its error), writes
//     metadata.pb, fsyncs it and the directory, renames the directory to
//     `step-<N>` and fsyncs `<root>`, then tells every rank the outcome.
//     Only then is the checkpoint visible: a crash at any point leaves older
//     checkpoints intact and no `step-*` directory without its metadata.
//     Re-saving an existing step swaps the directories atomically
//     (RENAME_EXCHANGE). Rank 0 also removes stale `.step-*` directories left
//     by crashes when a save starts, and, with keep_last = K, older committed
//     checkpoints beyond the newest K (renamed to a `.step-*.trash` name
//     first, so a crash mid-delete never leaves a half-deleted `step-N`, then
//     deleted on a background thread: WaitForCheckpointCleanup).
//
// Coordination. A synchronous save gathers and broadcasts through
// SaveOptions::store when one is given, else through the mesh's collectives
// on the calling thread. AsyncSaver always uses the store: its phases 2-3 run
// on a background thread, and store operations cannot interleave with the
// collectives the training thread keeps issuing (a collective from that
// thread would join the groups' sequence out of order). Phase 1 and the copy
// of the local shards to host memory run on the caller's thread; that is the
// blocking time AsyncSaver reports. Every wait has a timeout, and a failure
// on any rank fails the save on every rank.
//
// Load needs no communication: each rank reads metadata.pb, computes the box
// it needs for each key (LocalBox of the target DTensor's placements on its
// mesh), and reads just the blocks of the overlapping chunks (reader.h).
// Ranks may see different I/O errors; callers that must agree should reduce
// the outcome themselves.
#ifndef FSDPP_CHECKPOINT_CHECKPOINT_H_
#define FSDPP_CHECKPOINT_CHECKPOINT_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/metadata.h"
#include "checkpoint/state_dict.h"
#include "comm/store.h"
#include "mesh/device_mesh.h"
#include "tensor/tensor.h"

namespace fsdpp {

struct SaveOptions {
  // The ranks that save together; each of them calls Save with the same
  // root and step. Null: this process saves alone.
  DeviceMesh* mesh = nullptr;
  // Coordination through this store (not owned; see the file comment).
  // Null: the mesh's collectives, on the calling thread. AsyncSaver needs a
  // store whenever the mesh has more than one rank.
  Store* store = nullptr;
  // Prefix of the store keys; distinct concurrent savers need distinct
  // prefixes.
  std::string store_prefix = "fsdpp/checkpoint";
  // Keep the newest `keep_last` committed checkpoints under the root (the
  // one just saved always stays); 0 keeps all.
  int keep_last = 0;
  // CRC block size (a power of two >= 8): the granularity of partial reads.
  uint64_t block_bytes = kDefaultBlockBytes;
  // Bound for every wait on other ranks.
  absl::Duration timeout = absl::Minutes(10);
  // Refuse to save inf or NaN: each float chunk is checked in the pass that
  // computes its checksums, and a non-finite value fails the save on every
  // rank before anything is committed, naming the key (FailedPrecondition).
  bool check_finite = false;
};

// What a save did, on one rank.
struct SaveResult {
  // `<root>/step-<N>`.
  std::string path;
  int64_t step = 0;
  // Chunk bytes written by this rank, and by all ranks.
  uint64_t bytes_written = 0;
  uint64_t total_bytes = 0;
  // How long the caller was blocked (the whole save when synchronous).
  absl::Duration blocking_time;
  // From the call until the commit was known.
  absl::Duration total_time;
};

// Saves `state` as `<root>/step-<step>` (step >= 0). Every rank of
// options.mesh must call it. Errors (the same on every rank when the ranks
// can still talk): InvalidArgument for inconsistent or unsaveable state
// (naming the key), the I/O error of the failing rank (naming it and the
// path), DeadlineExceeded naming ranks that did not answer.
absl::StatusOr<SaveResult> Save(const StateDict& state, const std::string& root,
                                int64_t step, const SaveOptions& options = {});

// A save running in the background (from AsyncSaver::Save).
class PendingSave {
 public:
  // The caller's blocking time (waiting for the previous save, planning,
  // staging).
  absl::Duration blocking_time() const { return blocking_time_; }
  // The step being saved.
  int64_t step() const { return step_; }
  // True once committed or failed.
  bool IsDone() const;
  // Blocks until committed or failed.
  absl::StatusOr<SaveResult> Wait() const;

  // Used by AsyncSaver: a save of `step` whose caller was blocked for
  // `blocking_time`, and its outcome (once).
  PendingSave(int64_t step, absl::Duration blocking_time)
      : step_(step), blocking_time_(blocking_time) {}
  void Finish(absl::StatusOr<SaveResult> result);

 private:
  int64_t step_;
  absl::Duration blocking_time_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::optional<absl::StatusOr<SaveResult>> result_;
};

// Asynchronous saves: Save copies this rank's shards to host memory and
// returns; a background thread writes and commits them while training goes
// on. One save is in flight at a time: the next Save (and the destructor)
// first waits for the previous one. The host staging buffer is reused.
// Call it from one thread (the training thread).
class AsyncSaver {
 public:
  // Saves under `root` with `options` (a store is required when the mesh has
  // more than one rank: InvalidArgument otherwise).
  static absl::StatusOr<std::unique_ptr<AsyncSaver>> Create(
      std::string root, SaveOptions options);
  // Waits for the save in flight.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Waits for the previous save, plans this one with the other ranks,
  // stages this rank's shards and starts writing them in the background.
  // Errors of planning and staging are returned here; write and commit
  // errors by PendingSave::Wait, and again by the next Save (which then saves
  // nothing). Every rank must call it.
  absl::StatusOr<std::shared_ptr<PendingSave>> Save(const StateDict& state,
                                                    int64_t step);
  // Waits for the save in flight, if any; its result (OK without one).
  absl::Status Wait();

 private:
  AsyncSaver(std::string root, SaveOptions options)
      : root_(std::move(root)), options_(std::move(options)) {}

  std::string root_;
  SaveOptions options_;
  Tensor staging_;
  std::thread worker_;
  std::shared_ptr<PendingSave> pending_;
};

struct LoadOptions {
  // Strict: every key of the state must be in the checkpoint and vice versa.
  // Otherwise missing keys are left untouched and extra ones ignored (both
  // are reported). Kind, dtype and shape must match either way.
  bool strict = true;
  // Keys starting with one of these may be absent on either side even when
  // strict (they are still reported): per-rank values such as "rng/rank3",
  // which each rank loads only for itself.
  std::vector<std::string> optional_prefixes;
  // Refuse a checkpoint holding inf or NaN in what is loaded: every float
  // block is checked as it is read and verified; DataLoss naming the key.
  bool check_finite = false;
};

// What a load did, on one rank.
struct LoadResult {
  std::string path;
  int64_t step = 0;
  // State keys the checkpoint lacks; checkpoint keys the state lacks.
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
  // Bytes read from data files by this rank.
  uint64_t bytes_read = 0;
  absl::Duration time;
};

// Loads the committed checkpoint `checkpoint_dir` (a `step-N` directory)
// into `state`, in place: each DTensor receives its LocalBox under its own
// placements and mesh, plain tensors and byte values the whole value. A
// DTensor may also be loaded from an entry of the same elements in the same
// row-major order with one dim split in two (or two adjacent dims merged):
// the views tensor parallelism uses (GPT-2's fused c_attn [3 C, C] is
// [3, C, C] under tp), so checkpoints move between any (dp, tp) layouts. Every
// key is checked before anything is written. Errors: NotFound listing missing
// keys and InvalidArgument listing unexpected ones (strict), InvalidArgument
// naming the key and both shapes or dtypes on a mismatch, and the reader's
// errors (DataLoss / NotFound naming file and key).
absl::StatusOr<LoadResult> Load(StateDict* state,
                                const std::string& checkpoint_dir,
                                const LoadOptions& options = {});

// Blocks until this process has finished deleting the checkpoints that
// retention (keep_last) dropped and the ones re-saving replaced: a save
// renames them to `.step-<N>.trash` (atomically: they are gone from
// ListCheckpoints at once) and deletes them on a background thread, so Save
// returns once its own checkpoint is committed. DeadlineExceeded after
// `timeout`.
absl::Status WaitForCheckpointCleanup(
    absl::Duration timeout = absl::Minutes(5));

// "step-<step>".
std::string CheckpointDirName(int64_t step);

// Every `step-N` directory under `root`, by increasing step, and whether it
// is committed (holds metadata.pb; a directory without it is an interrupted
// copy or a damaged checkpoint, never loaded). NotFound if `root` is
// missing.
struct CheckpointDir {
  int64_t step = 0;
  std::string path;
  bool committed = false;
};
absl::StatusOr<std::vector<CheckpointDir>> ScanCheckpoints(
    const std::string& root);

// The committed checkpoints under `root` (directories `step-N` holding
// metadata.pb), by increasing step: (step, path). NotFound if `root` is
// missing.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> ListCheckpoints(
    const std::string& root);

// The path of the committed checkpoint with the largest step; NotFound when
// there is none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_CHECKPOINT_H_
