// Distributed checkpoint save (plan, write, commit), AsyncSaver and Load;
// see checkpoint.h.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/boxes.h"
#include "checkpoint/coordinator.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/metadata.pb.h"
#include "checkpoint/reader.h"
#include "core/logging.h"
#include "core/memcpy.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "tensor/sharding.h"

namespace fsdpp {
namespace {

namespace pb = checkpoint_proto;

// Coordinator tags of the three exchanges of a save.
constexpr char kPlanTag[] = "plan";
constexpr char kWrittenTag[] = "written";
constexpr char kCommitTag[] = "commit";

// Pieces of at most this many bytes (or one CRC block, if larger) are
// checksummed and then written, so write() copies them from the L2 cache the
// CRC pass left them in.
constexpr uint64_t kWritePieceBytes = uint64_t{1} << 20;
// Writes at least this large go straight to write(); smaller ones are
// gathered into a buffer of kWriteBufferBytes.
constexpr size_t kDirectWriteBytes = size_t{256} << 10;
constexpr size_t kWriteBufferBytes = size_t{1} << 20;
// Chunks start at multiples of this many bytes of their file (zero padding in
// between), so every chunk is cache-line and element aligned.
constexpr uint64_t kChunkAlignment = 64;

std::string Quote(const std::string& key) {
  return absl::StrCat("'", absl::CHexEscape(key), "'");
}

std::string TempDirName(int64_t step) {
  return absl::StrCat(".step-", step, ".tmp");
}
std::string TrashDirName(int64_t step) {
  return absl::StrCat(".step-", step, ".trash");
}
std::string DataFileName(int rank) {
  return absl::StrCat("rank-", rank, ".data");
}

std::vector<int> MeshShape(const DeviceMesh& mesh) {
  std::vector<int> shape;
  for (const MeshAxis& axis : mesh.axes()) shape.push_back(axis.size);
  return shape;
}

// "f32[7, 5]".
std::string Describe(DType dtype, const Shape& shape) {
  return absl::StrCat(DTypeName(dtype), ShapeToString(shape));
}

absl::Status DecodeStatus(const pb::CommitResult& result) {
  if (result.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(result.code()),
                      result.message());
}

pb::CommitResult EncodeStatus(const absl::Status& status) {
  pb::CommitResult result;
  result.set_code(static_cast<int32_t>(status.code()));
  result.set_message(std::string(status.message()));
  return result;
}

// ------------------------------------------------------------------ plan

// One value this rank holds.
struct LocalItem {
  std::string key;
  EntryKind kind = EntryKind::kTensor;
  DType dtype = DType::kU8;
  Shape shape;
  Box box;
  Tensor tensor;                       // Tensors: the local piece.
  const std::string* bytes = nullptr;  // Byte values (valid during Save).
};

absl::StatusOr<std::vector<LocalItem>> LocalItems(const StateDict& state) {
  std::vector<LocalItem> items;
  for (const auto& [key, value] : state.items()) {
    LocalItem item;
    item.key = key;
    switch (value.kind) {
      case StateDict::Kind::kDTensor: {
        const DTensor& t = value.dtensor;
        for (const Placement& p : t.placements()) {
          if (p.is_partial()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "key ", Quote(key), ": cannot save a DTensor with placements ",
                PlacementsToString(t.placements()),
                " (reduce the Partial axes first)"));
          }
        }
        item.dtype = t.dtype();
        item.shape = t.shape();
        item.box = LocalBox(t.shape(), MeshShape(*t.mesh()),
                            t.mesh()->coordinate(), t.placements());
        item.tensor = t.local();
        if (item.tensor.shape() != item.box.shape) {
          return absl::InternalError(absl::StrCat(
              "key ", Quote(key), ": local ", item.tensor.ToString(),
              " does not match its box ", BoxToString(item.box)));
        }
        break;
      }
      case StateDict::Kind::kTensor:
        item.dtype = value.tensor.dtype();
        item.shape = value.tensor.shape();
        item.box = Box{Shape(item.shape.size(), 0), item.shape};
        item.tensor = value.tensor;
        break;
      case StateDict::Kind::kBytes:
        item.kind = EntryKind::kBytes;
        item.dtype = DType::kU8;
        item.shape = {static_cast<int64_t>(value.bytes.size())};
        item.box = Box{{0}, item.shape};
        item.bytes = &value.bytes;
        break;
    }
    absl::Status shape_ok = CheckShape(item.shape, DTypeSize(item.dtype));
    if (!shape_ok.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", Quote(key), ": ", shape_ok.message()));
    }
    items.push_back(std::move(item));
  }
  return items;
}

pb::RankPlan MakeRankPlan(const absl::StatusOr<std::vector<LocalItem>>& items) {
  pb::RankPlan plan;
  if (!items.ok()) {
    plan.set_error(std::string(items.status().message()));
    plan.set_error_code(static_cast<int32_t>(items.status().code()));
    return plan;
  }
  for (const LocalItem& item : *items) {
    pb::PlanItem* p = plan.add_items();
    p->set_key(item.key);
    p->set_kind(item.kind == EntryKind::kBytes ? pb::Entry::BYTES
                                               : pb::Entry::TENSOR);
    p->set_dtype(DTypeName(item.dtype));
    for (int64_t d : item.shape) p->add_shape(d);
    for (int64_t o : item.box.offset) p->add_offsets(o);
    for (int64_t s : item.box.shape) p->add_sizes(s);
    if (item.bytes != nullptr) p->set_value_crc32c(Crc32c(*item.bytes));
  }
  return plan;
}

// One box to write and the rank that writes it.
struct PlannedChunk {
  std::string key;
  Box box;
  int writer = 0;
};

struct PlannedEntry {
  EntryKind kind = EntryKind::kTensor;
  DType dtype = DType::kU8;
  Shape shape;
};

// The plan every rank derives from all ranks' RankPlans.
struct GlobalPlan {
  std::map<std::string, PlannedEntry> entries;
  std::vector<PlannedChunk> chunks;  // By key, then box.
};

// Picks the writer of `box` of `key` among its holders (ascending ranks).
int PickWriter(const std::string& key, const Box& box,
               const std::vector<int>& holders) {
  std::string id = key;
  for (int64_t o : box.offset) id.append(reinterpret_cast<const char*>(&o), 8);
  return holders[Crc32c(id) % holders.size()];
}

absl::StatusOr<GlobalPlan> MakeGlobalPlan(
    const std::vector<pb::RankPlan>& plans) {
  for (size_t r = 0; r < plans.size(); ++r) {
    if (!plans[r].error().empty() || plans[r].error_code() != 0) {
      return absl::Status(
          plans[r].error_code() != 0
              ? static_cast<absl::StatusCode>(plans[r].error_code())
              : absl::StatusCode::kUnknown,
          absl::StrCat("rank ", r, ": ", plans[r].error()));
    }
  }
  struct Holders {
    std::vector<int> ranks;
    uint32_t value_crc = 0;
  };
  struct Accumulated {
    PlannedEntry entry;
    int first_rank = 0;
    std::map<std::pair<Shape, Shape>, Holders> boxes;
  };
  std::map<std::string, Accumulated> all;
  for (size_t r = 0; r < plans.size(); ++r) {
    for (const pb::PlanItem& item : plans[r].items()) {
      PlannedEntry entry;
      entry.kind = item.kind() == pb::Entry::BYTES ? EntryKind::kBytes
                                                   : EntryKind::kTensor;
      FSDPP_ASSIGN_OR_RETURN(entry.dtype, ParseDType(item.dtype()));
      entry.shape.assign(item.shape().begin(), item.shape().end());
      auto [it, inserted] = all.try_emplace(item.key());
      Accumulated& acc = it->second;
      if (inserted) {
        acc.entry = entry;
        acc.first_rank = static_cast<int>(r);
      } else if (acc.entry.kind != entry.kind ||
                 acc.entry.dtype != entry.dtype ||
                 acc.entry.shape != entry.shape) {
        return absl::InvalidArgumentError(
            absl::StrCat("key ", Quote(item.key()), ": rank ", acc.first_rank,
                         " has ", EntryKindName(acc.entry.kind), " ",
                         Describe(acc.entry.dtype, acc.entry.shape), ", rank ",
                         r, " has ", EntryKindName(entry.kind), " ",
                         Describe(entry.dtype, entry.shape)));
      }
      Box box{Shape(item.offsets().begin(), item.offsets().end()),
              Shape(item.sizes().begin(), item.sizes().end())};
      if (IsEmptyBox(box)) continue;
      Holders& holders = acc.boxes[{box.offset, box.shape}];
      if (!holders.ranks.empty() && entry.kind == EntryKind::kBytes &&
          holders.value_crc != item.value_crc32c()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "key ", Quote(item.key()), ": ranks ", holders.ranks[0], " and ", r,
            " hold different byte values; a key is saved once, so per-rank "
            "values need per-rank keys"));
      }
      holders.value_crc = item.value_crc32c();
      holders.ranks.push_back(static_cast<int>(r));
    }
  }
  GlobalPlan plan;
  for (auto& [key, acc] : all) {
    std::vector<Box> boxes;
    for (const auto& [box, holders] : acc.boxes) {
      boxes.push_back(Box{box.first, box.second});
    }
    absl::Status tiling = CheckTiling(acc.entry.shape, boxes);
    if (!tiling.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key ", Quote(key), " (", Describe(acc.entry.dtype, acc.entry.shape),
          "): the ranks' boxes do not tile it: ", tiling.message()));
    }
    for (const auto& [box_key, holders] : acc.boxes) {
      Box box{box_key.first, box_key.second};
      const int writer = PickWriter(key, box, holders.ranks);
      plan.chunks.push_back(PlannedChunk{key, std::move(box), writer});
    }
    plan.entries.emplace(key, acc.entry);
  }
  return plan;
}

absl::StatusOr<std::vector<pb::RankPlan>> ParsePlans(
    const std::vector<std::string>& serialized) {
  std::vector<pb::RankPlan> plans(serialized.size());
  for (size_t r = 0; r < serialized.size(); ++r) {
    if (!plans[r].ParseFromString(serialized[r])) {
      return absl::DataLossError(
          absl::StrCat("checkpoint: rank ", r, "'s save plan does not decode"));
    }
  }
  return plans;
}

// ------------------------------------------------------------ directories

// Deletes directories that were renamed out of the way (old checkpoints
// dropped by retention, replaced ones) on a background thread, so a save
// returns once its checkpoint is committed instead of after unlinking
// gigabytes. Process-wide and never destroyed: a deletion cut short by the
// process exiting leaves a `.step-*.trash` directory that the next save
// removes (CleanStaleDirs), exactly like one left by a crash.
class TrashCollector {
 public:
  static TrashCollector& Get() {
    static auto* collector = new TrashCollector;
    return *collector;
  }

  void Add(std::string path) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(path));
    if (!worker_started_) {
      worker_started_ = true;
      std::thread([this] { Loop(); }).detach();
    }
    cv_.notify_all();
  }

  // Whether `path` is queued or being deleted.
  bool Pending(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::find(queue_.begin(), queue_.end(), path) != queue_.end() ||
           current_ == path;
  }

  absl::Status WaitIdle(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                      [this] { return queue_.empty() && current_.empty(); })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "checkpoint: old checkpoints still being deleted after ",
          absl::FormatDuration(timeout), " (", queue_.size(), " queued)"));
    }
    return absl::OkStatus();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      current_ = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      const absl::Status removed = RemoveTree(current_);
      LOG_IF(WARNING, !removed.ok())
          << "checkpoint: deleting an old checkpoint failed (the next save "
             "retries): "
          << removed;
      lock.lock();
      current_.clear();
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  std::string current_;
  bool worker_started_ = false;
};

// Removes `.step-*.tmp` and `.step-*.trash` directories (left by crashes),
// except trash this process is deleting in the background.
absl::Status CleanStaleDirs(const std::string& root) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root));
  for (const std::string& name : names) {
    if (absl::StartsWith(name, ".step-") &&
        (absl::EndsWith(name, ".tmp") || absl::EndsWith(name, ".trash"))) {
      const std::string path = absl::StrCat(root, "/", name);
      if (TrashCollector::Get().Pending(path)) continue;
      FSDPP_RETURN_IF_ERROR(RemoveTree(path));
    }
  }
  return absl::OkStatus();
}

// Deletes committed checkpoints beyond the newest `keep_last` (keeping
// `committed_step`).
absl::Status ApplyRetention(const std::string& root, int keep_last,
                            int64_t committed_step) {
  if (keep_last <= 0) return absl::OkStatus();
  FSDPP_ASSIGN_OR_RETURN(auto checkpoints, ListCheckpoints(root));
  int kept = 1;  // committed_step.
  bool removed = false;
  for (auto it = checkpoints.rbegin(); it != checkpoints.rend(); ++it) {
    if (it->first == committed_step) continue;
    if (kept < keep_last) {
      ++kept;
      continue;
    }
    // Rename first so a crash never leaves a half-deleted step-N; the
    // deletion itself runs in the background.
    const std::string trash = absl::StrCat(root, "/", TrashDirName(it->first));
    if (TrashCollector::Get().Pending(trash)) {
      FSDPP_RETURN_IF_ERROR(TrashCollector::Get().WaitIdle(absl::Minutes(10)));
    }
    FSDPP_RETURN_IF_ERROR(RemoveTree(trash));
    if (::rename(it->second.c_str(), trash.c_str()) != 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat(it->second, ": cannot rename to ", trash));
    }
    TrashCollector::Get().Add(trash);
    removed = true;
  }
  return removed ? SyncDir(root) : absl::OkStatus();
}

// Accumulates small writes into one buffer; large ones go straight through.
class BufferedWriter {
 public:
  BufferedWriter(int fd, std::string path) : fd_(fd), path_(std::move(path)) {
    buffer_.reserve(kWriteBufferBytes);
  }
  absl::Status Write(const char* data, size_t size) {
    position_ += size;
    if (size >= kDirectWriteBytes) {
      FSDPP_RETURN_IF_ERROR(Flush());
      return WriteAll(fd_, data, size, path_);
    }
    if (buffer_.size() + size > kWriteBufferBytes)
      FSDPP_RETURN_IF_ERROR(Flush());
    buffer_.append(data, size);
    return absl::OkStatus();
  }
  absl::Status Flush() {
    absl::Status status = WriteAll(fd_, buffer_.data(), buffer_.size(), path_);
    buffer_.clear();
    return status;
  }
  // Appends zero bytes up to the next multiple of kChunkAlignment.
  absl::Status Align() {
    static const char kZeros[kChunkAlignment] = {};
    const uint64_t pad =
        (kChunkAlignment - position_ % kChunkAlignment) % kChunkAlignment;
    return Write(kZeros, static_cast<size_t>(pad));
  }
  uint64_t position() const { return position_; }

 private:
  int fd_;
  std::string path_;
  std::string buffer_;
  uint64_t position_ = 0;
};

// ------------------------------------------------------------------- job

// One save on one rank: Plan (phase 1, caller's thread), optionally Stage,
// then WriteAndCommit (phases 2-3, any thread when coordinating by store).
class SaveJob {
 public:
  static absl::StatusOr<std::unique_ptr<SaveJob>> Plan(
      const StateDict& state, const std::string& root, int64_t step,
      const SaveOptions& options, std::unique_ptr<Coordinator> coordinator);

  // Copies this rank's chunks into `arena` (host memory, grown as needed),
  // so the state may change once this returns.
  absl::Status Stage(Tensor* arena);

  // Makes WriteAndCommit report `status` to the other ranks instead of
  // writing (after a failed Stage).
  void Fail(absl::Status status) { failure_ = std::move(status); }

  // Writes this rank's chunks and commits (rank 0) or learns the outcome.
  absl::StatusOr<SaveResult> WriteAndCommit();

 private:
  // A chunk this rank writes.
  struct MyChunk {
    std::string key;
    Box box;
    uint64_t length = 0;
    // The elements' dtype; byte values are u8 (never checked for finite).
    DType dtype = DType::kU8;
    const char* host = nullptr;  // Host bytes, or
    Tensor source;               // a tensor on another device.
  };

  SaveJob(std::string root, int64_t step, SaveOptions options,
          std::unique_ptr<Coordinator> coordinator)
      : root_(std::move(root)),
        step_(step),
        options_(std::move(options)),
        coordinator_(std::move(coordinator)) {}

  std::string TempDir() const {
    return absl::StrCat(root_, "/", TempDirName(step_));
  }
  std::string FinalDir() const {
    return absl::StrCat(root_, "/", CheckpointDirName(step_));
  }
  // Rank 0, phase 1: the directories for this save.
  absl::Status PrepareDirs();
  // Phase 2: this rank's data file.
  absl::Status WriteChunks(pb::RankWritten* written);
  // Rank 0, phase 3: metadata and rename. Returns the total bytes.
  absl::StatusOr<uint64_t> Commit(const std::vector<std::string>& written);
  // Rank 0, after the outcome is out: removes a replaced checkpoint and old
  // ones beyond keep_last (failures are logged: the save is committed).
  void Tidy();

  std::string root_;
  int64_t step_;
  SaveOptions options_;
  std::unique_ptr<Coordinator> coordinator_;
  GlobalPlan plan_;
  std::vector<MyChunk> chunks_;
  Tensor arena_;  // Staged bytes (keeps the staging storage alive).
  uint64_t bytes_written_ = 0;
  absl::Status failure_;
  bool replaced_ = false;  // The commit swapped out an older step-N.
};

absl::StatusOr<std::unique_ptr<SaveJob>> SaveJob::Plan(
    const StateDict& state, const std::string& root, int64_t step,
    const SaveOptions& options, std::unique_ptr<Coordinator> coordinator) {
  std::unique_ptr<SaveJob> job(
      new SaveJob(root, step, options, std::move(coordinator)));
  Coordinator& coord = *job->coordinator_;
  absl::StatusOr<std::vector<LocalItem>> items = LocalItems(state);
  absl::StatusOr<std::vector<std::string>> gathered =
      coord.Gather(kPlanTag, MakeRankPlan(items).SerializeAsString());
  std::string payload;
  if (coord.rank() == 0) {
    absl::Status status = gathered.status();
    std::vector<std::string> message;
    if (status.ok()) {
      absl::StatusOr<std::vector<pb::RankPlan>> plans = ParsePlans(*gathered);
      absl::StatusOr<GlobalPlan> plan =
          plans.ok() ? MakeGlobalPlan(*plans) : plans.status();
      status = plan.status();
      if (status.ok()) {
        job->plan_ = *std::move(plan);
        status = job->PrepareDirs();
      }
    }
    message.push_back(EncodeStatus(status).SerializeAsString());
    if (status.ok()) {
      message.insert(message.end(), gathered->begin(), gathered->end());
    }
    payload = PackStrings(message);
  } else if (!gathered.ok()) {
    return gathered.status();
  }
  FSDPP_ASSIGN_OR_RETURN(payload,
                         coord.Broadcast(kPlanTag, std::move(payload)));
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> message,
                         UnpackStrings(payload));
  pb::CommitResult verdict;
  if (message.empty() || !verdict.ParseFromString(message[0])) {
    return absl::DataLossError("checkpoint: rank 0's plan does not decode");
  }
  FSDPP_RETURN_IF_ERROR(DecodeStatus(verdict));
  if (!items.ok()) return items.status();  // Unreachable: rank 0 failed it.
  if (coord.rank() != 0) {
    message.erase(message.begin());
    FSDPP_ASSIGN_OR_RETURN(std::vector<pb::RankPlan> plans,
                           ParsePlans(message));
    FSDPP_ASSIGN_OR_RETURN(job->plan_, MakeGlobalPlan(plans));
  }
  // This rank's share: the chunks it was picked to write (it holds them).
  std::map<std::string, const LocalItem*> by_key;
  for (const LocalItem& item : *items) by_key[item.key] = &item;
  for (const PlannedChunk& chunk : job->plan_.chunks) {
    if (chunk.writer != coord.rank()) continue;
    const LocalItem& item = *by_key.at(chunk.key);
    MyChunk mine;
    mine.key = chunk.key;
    mine.box = chunk.box;
    mine.length = static_cast<uint64_t>(NumElements(chunk.box.shape)) *
                  DTypeSize(item.dtype);
    mine.dtype = item.bytes != nullptr ? DType::kU8 : item.dtype;
    if (item.bytes != nullptr) {
      mine.host = item.bytes->data();
    } else if (item.tensor.device().is_cpu()) {
      mine.host = static_cast<const char*>(item.tensor.raw_data());
      mine.source = item.tensor;  // Keeps the storage alive.
    } else {
      mine.source = item.tensor;
    }
    job->chunks_.push_back(std::move(mine));
  }
  return job;
}

absl::Status SaveJob::PrepareDirs() {
  FSDPP_RETURN_IF_ERROR(MakeDirs(root_));
  FSDPP_RETURN_IF_ERROR(CleanStaleDirs(root_));
  return MakeDirs(TempDir());
}

absl::Status SaveJob::Stage(Tensor* arena) {
  uint64_t total = 0;
  for (const MyChunk& c : chunks_) total += c.length;
  if (!arena->defined() || arena->nbytes() < total) {
    *arena = Tensor();  // Free the old buffer first.
    FSDPP_ASSIGN_OR_RETURN(
        *arena, Tensor::Empty({static_cast<int64_t>(total)}, DType::kU8,
                              Device::Cpu(), MemoryTag::kOther));
  }
  arena_ = *arena;
  char* out = static_cast<char*>(arena_.raw_data());
  for (MyChunk& c : chunks_) {
    if (c.host != nullptr) {
      std::memcpy(out, c.host, c.length);
    } else {
      FSDPP_RETURN_IF_ERROR(CopyBytes(out, Device::Cpu(), c.source.raw_data(),
                                      c.source.device(), c.length));
    }
    c.host = out;
    c.source = Tensor();
    out += c.length;
  }
  return absl::OkStatus();
}

absl::Status SaveJob::WriteChunks(pb::RankWritten* written) {
  FSDPP_RETURN_IF_ERROR(failure_);
  if (chunks_.empty()) return absl::OkStatus();
  const std::string name = DataFileName(coordinator_->rank());
  const std::string path = absl::StrCat(TempDir(), "/", name);
  FSDPP_ASSIGN_OR_RETURN(ScopedFd fd, CreateExclusive(path));
  BufferedWriter writer(fd.get(), path);
  const uint64_t block = options_.block_bytes;
  const uint64_t piece_bytes =
      std::max(block, kWritePieceBytes / block * block);
  std::vector<char> bounce;
  written->add_files(name);
  for (const MyChunk& c : chunks_) {
    pb::WrittenChunk* record = written->add_chunks();
    record->set_key(c.key);
    pb::Chunk* chunk = record->mutable_chunk();
    for (int64_t o : c.box.offset) chunk->add_offsets(o);
    for (int64_t s : c.box.shape) chunk->add_sizes(s);
    chunk->set_file(0);
    FSDPP_RETURN_IF_ERROR(writer.Align());
    chunk->set_byte_offset(writer.position());
    chunk->set_length(c.length);
    std::vector<uint32_t> block_crcs;
    int64_t non_finite = 0;
    const uint64_t esize = DTypeSize(c.dtype);
    for (uint64_t at = 0; at < c.length; at += piece_bytes) {
      const uint64_t n = std::min(piece_bytes, c.length - at);
      const char* data = c.host + at;
      if (c.host == nullptr) {
        bounce.resize(n);
        FSDPP_RETURN_IF_ERROR(
            CopyBytes(bounce.data(), Device::Cpu(),
                      static_cast<const char*>(c.source.raw_data()) + at,
                      c.source.device(), n));
        data = bounce.data();
      }
      for (uint64_t b = 0; b < n; b += block) {
        const uint64_t len = std::min(block, n - b);
        block_crcs.push_back(Crc32c(data + b, len));
        // In the same pass, while the block is in cache (a piece and a
        // block hold whole elements: both are multiples of 8 bytes).
        if (options_.check_finite) {
          non_finite += CountNonFinite(data + b, len / esize, c.dtype);
        }
      }
      if (non_finite > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "key ", Quote(c.key), " holds ", non_finite,
            " non-finite value(s) in this rank's box ", BoxToString(c.box),
            " (and perhaps more after it): not saved, nothing committed"));
      }
      FSDPP_RETURN_IF_ERROR(writer.Write(data, n));
    }
    chunk->set_crc32c(CombineBlockCrcs(block_crcs, block, c.length));
    for (uint32_t crc : block_crcs) chunk->add_block_crc32c(crc);
    bytes_written_ += c.length;
  }
  FSDPP_RETURN_IF_ERROR(writer.Flush());
  if (::fdatasync(fd.get()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": fdatasync"));
  }
  return fd.Close(path);
}

absl::StatusOr<uint64_t> SaveJob::Commit(
    const std::vector<std::string>& written) {
  CheckpointMetadata metadata;
  metadata.step = step_;
  metadata.world_size = coordinator_->size();
  metadata.block_bytes = options_.block_bytes;
  for (const auto& [key, planned] : plan_.entries) {
    EntryMetadata& entry = metadata.entries[key];
    entry.kind = planned.kind;
    entry.dtype = planned.dtype;
    entry.shape = planned.shape;
  }
  for (size_t r = 0; r < written.size(); ++r) {
    pb::RankWritten w;
    if (!w.ParseFromString(written[r])) {
      return absl::DataLossError(
          absl::StrCat("checkpoint: rank ", r, "'s report does not decode"));
    }
    if (!w.error().empty() || w.error_code() != 0) {
      return absl::Status(w.error_code() != 0
                              ? static_cast<absl::StatusCode>(w.error_code())
                              : absl::StatusCode::kUnknown,
                          absl::StrCat("rank ", r, ": ", w.error()));
    }
    const int64_t first_file = static_cast<int64_t>(metadata.files.size());
    for (const std::string& file : w.files()) metadata.files.push_back(file);
    for (const pb::WrittenChunk& c : w.chunks()) {
      auto it = metadata.entries.find(c.key());
      if (it == metadata.entries.end()) {
        return absl::InternalError(absl::StrCat(
            "checkpoint: rank ", r, " wrote unplanned key ", Quote(c.key())));
      }
      ChunkMetadata chunk;
      chunk.box.offset.assign(c.chunk().offsets().begin(),
                              c.chunk().offsets().end());
      chunk.box.shape.assign(c.chunk().sizes().begin(),
                             c.chunk().sizes().end());
      chunk.file = first_file + c.chunk().file();
      chunk.byte_offset = c.chunk().byte_offset();
      chunk.length = c.chunk().length();
      chunk.crc32c = c.chunk().crc32c();
      chunk.block_crc32c.assign(c.chunk().block_crc32c().begin(),
                                c.chunk().block_crc32c().end());
      it->second.chunks.push_back(std::move(chunk));
    }
  }
  for (auto& [key, entry] : metadata.entries) {
    std::sort(entry.chunks.begin(), entry.chunks.end(),
              [](const ChunkMetadata& a, const ChunkMetadata& b) {
                return std::tie(a.box.offset, a.box.shape) <
                       std::tie(b.box.offset, b.box.shape);
              });
  }
  absl::Status valid = ValidateMetadata(metadata);
  if (!valid.ok()) {
    return absl::InternalError(
        absl::StrCat("checkpoint: the assembled metadata is inconsistent: ",
                     valid.message()));
  }
  const std::string temp = TempDir();
  FSDPP_RETURN_IF_ERROR(WriteFileDurably(
      absl::StrCat(temp, "/", kMetadataFileName), SerializeMetadata(metadata)));
  FSDPP_RETURN_IF_ERROR(SyncDir(temp));
  FSDPP_RETURN_IF_ERROR(RenameDir(temp, FinalDir(), &replaced_));
  // Committed once the rename is durable.
  FSDPP_RETURN_IF_ERROR(SyncDir(root_));
  return metadata.TotalBytes();
}

void SaveJob::Tidy() {
  absl::Status tidy;
  if (replaced_) {  // The replaced checkpoint, now under the temp name.
    const std::string trash = absl::StrCat(root_, "/", TrashDirName(step_));
    tidy = RemoveTree(trash);
    if (tidy.ok() && ::rename(TempDir().c_str(), trash.c_str()) != 0) {
      tidy = absl::ErrnoToStatus(
          errno, absl::StrCat(TempDir(), ": cannot rename to ", trash));
    }
    if (tidy.ok()) TrashCollector::Get().Add(trash);
  }
  if (tidy.ok()) tidy = ApplyRetention(root_, options_.keep_last, step_);
  if (!tidy.ok()) {
    LOG(WARNING) << "checkpoint " << FinalDir()
                 << " is committed, but tidying up failed: " << tidy;
  }
}

absl::StatusOr<SaveResult> SaveJob::WriteAndCommit() {
  Coordinator& coord = *coordinator_;
  pb::RankWritten written;
  absl::Status wrote = WriteChunks(&written);
  if (!wrote.ok()) {
    written.Clear();
    written.set_error(std::string(wrote.message()));
    written.set_error_code(static_cast<int32_t>(wrote.code()));
  }
  absl::StatusOr<std::vector<std::string>> gathered =
      coord.Gather(kWrittenTag, written.SerializeAsString());
  std::string verdict;
  if (coord.rank() == 0) {
    absl::StatusOr<uint64_t> total =
        gathered.ok() ? Commit(*gathered) : gathered.status();
    pb::CommitResult result = EncodeStatus(total.status());
    if (total.ok()) {
      result.set_total_bytes(*total);
    } else {
      absl::Status removed = RemoveTree(TempDir());
      if (!removed.ok()) LOG(WARNING) << removed;
    }
    verdict = result.SerializeAsString();
  } else if (!gathered.ok()) {
    return gathered.status();
  }
  FSDPP_ASSIGN_OR_RETURN(verdict,
                         coord.Broadcast(kCommitTag, std::move(verdict)));
  pb::CommitResult result;
  if (!result.ParseFromString(verdict)) {
    return absl::DataLossError("checkpoint: rank 0's verdict does not decode");
  }
  FSDPP_RETURN_IF_ERROR(DecodeStatus(result));
  // The other ranks go on while rank 0 deletes what retention drops.
  if (coord.rank() == 0) Tidy();
  SaveResult out;
  out.path = FinalDir();
  out.step = step_;
  out.bytes_written = bytes_written_;
  out.total_bytes = result.total_bytes();
  return out;
}

absl::Status ValidateSaveOptions(int64_t step, const SaveOptions& options) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: negative step ", step));
  }
  const uint64_t b = options.block_bytes;
  if (b < 8 || b > (uint64_t{1} << 30) || (b & (b - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: block_bytes ", b, " is not a power of two in [8, 2^30]"));
  }
  if (options.keep_last < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: negative keep_last ", options.keep_last));
  }
  return absl::OkStatus();
}

int WorldSize(const SaveOptions& options) {
  return options.mesh == nullptr ? 1 : options.mesh->size();
}

absl::StatusOr<std::unique_ptr<Coordinator>> MakeCoordinator(
    const SaveOptions& options, bool background) {
  if (options.store != nullptr) {
    return MakeStoreCoordinator(
        options.store, options.store_prefix,
        options.mesh == nullptr ? 0 : options.mesh->rank(), WorldSize(options),
        options.timeout, {kPlanTag, kCommitTag});
  }
  if (WorldSize(options) == 1) return MakeLocalCoordinator();
  if (background) {
    return absl::InvalidArgumentError(
        "checkpoint: asynchronous saves over several ranks coordinate through "
        "a store; set SaveOptions::store");
  }
  return MakeCollectiveCoordinator(options.mesh, options.timeout);
}

}  // namespace

absl::StatusOr<SaveResult> Save(const StateDict& state, const std::string& root,
                                int64_t step, const SaveOptions& options) {
  const absl::Time start = absl::Now();
  FSDPP_RETURN_IF_ERROR(ValidateSaveOptions(step, options));
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                         MakeCoordinator(options, /*background=*/false));
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<SaveJob> job,
      SaveJob::Plan(state, root, step, options, std::move(coordinator)));
  FSDPP_ASSIGN_OR_RETURN(SaveResult result, job->WriteAndCommit());
  result.total_time = absl::Now() - start;
  result.blocking_time = result.total_time;
  return result;
}

// ------------------------------------------------------------- async save

bool PendingSave::IsDone() const {
  std::lock_guard<std::mutex> lock(mu_);
  return result_.has_value();
}

absl::StatusOr<SaveResult> PendingSave::Wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return result_.has_value(); });
  return *result_;
}

void PendingSave::Finish(absl::StatusOr<SaveResult> result) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    result_ = std::move(result);
  }
  cv_.notify_all();
}

absl::StatusOr<std::unique_ptr<AsyncSaver>> AsyncSaver::Create(
    std::string root, SaveOptions options) {
  FSDPP_RETURN_IF_ERROR(ValidateSaveOptions(0, options));
  if (options.store == nullptr && WorldSize(options) > 1) {
    return absl::InvalidArgumentError(
        "AsyncSaver: saves over several ranks coordinate through a store "
        "(collectives from the background thread could interleave with the "
        "training thread's); set SaveOptions::store");
  }
  return std::unique_ptr<AsyncSaver>(
      new AsyncSaver(std::move(root), std::move(options)));
}

AsyncSaver::~AsyncSaver() {
  absl::Status status = Wait();
  if (!status.ok()) LOG(ERROR) << "asynchronous checkpoint failed: " << status;
}

absl::Status AsyncSaver::Wait() {
  if (worker_.joinable()) worker_.join();
  if (pending_ == nullptr) return absl::OkStatus();
  std::shared_ptr<PendingSave> pending = std::move(pending_);
  return pending->Wait().status();
}

absl::StatusOr<std::shared_ptr<PendingSave>> AsyncSaver::Save(
    const StateDict& state, int64_t step) {
  const absl::Time start = absl::Now();
  FSDPP_RETURN_IF_ERROR(ValidateSaveOptions(step, options_));
  // A failed save is not forgotten: the caller learns of it here at the
  // latest (every rank alike: the commit's outcome is agreed), and decides.
  const int64_t previous_step = pending_ != nullptr ? pending_->step() : -1;
  absl::Status previous = Wait();
  if (!previous.ok()) {
    return Annotate(
        previous,
        absl::StrCat("the asynchronous checkpoint of step ", previous_step,
                     " failed; not saving step ", step));
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                         MakeCoordinator(options_, /*background=*/true));
  FSDPP_ASSIGN_OR_RETURN(
      std::unique_ptr<SaveJob> job,
      SaveJob::Plan(state, root_, step, options_, std::move(coordinator)));
  // A failed stage still takes part in the commit, so that every rank
  // learns about it instead of waiting for this rank's report.
  absl::Status staged = job->Stage(&staging_);
  if (!staged.ok()) job->Fail(staged);
  const absl::Duration blocking = absl::Now() - start;
  pending_ = std::make_shared<PendingSave>(step, blocking);
  worker_ = std::thread([job = std::shared_ptr<SaveJob>(std::move(job)),
                         pending = pending_, start, blocking] {
    absl::StatusOr<SaveResult> result = job->WriteAndCommit();
    if (result.ok()) {
      result->blocking_time = blocking;
      result->total_time = absl::Now() - start;
    }
    pending->Finish(std::move(result));
  });
  if (!staged.ok()) return staged;
  return pending_;
}

// ------------------------------------------------------------------- load

absl::Status WaitForCheckpointCleanup(absl::Duration timeout) {
  return TrashCollector::Get().WaitIdle(timeout);
}

std::string CheckpointDirName(int64_t step) {
  return absl::StrCat("step-", step);
}

absl::StatusOr<std::vector<CheckpointDir>> ScanCheckpoints(
    const std::string& root) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root));
  std::vector<CheckpointDir> out;
  for (const std::string& name : names) {
    int64_t step;
    if (!absl::StartsWith(name, "step-") ||
        !absl::SimpleAtoi(name.substr(5), &step) ||
        CheckpointDirName(step) != name) {
      continue;
    }
    const std::string path = absl::StrCat(root, "/", name);
    out.push_back(
        {step, path, PathExists(absl::StrCat(path, "/", kMetadataFileName))});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointDir& a, const CheckpointDir& b) {
              return a.step < b.step;
            });
  return out;
}

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> ListCheckpoints(
    const std::string& root) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<CheckpointDir> all, ScanCheckpoints(root));
  std::vector<std::pair<int64_t, std::string>> out;
  for (const CheckpointDir& d : all) {
    if (d.committed) out.emplace_back(d.step, d.path);
  }
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  FSDPP_ASSIGN_OR_RETURN(auto checkpoints, ListCheckpoints(root));
  if (checkpoints.empty()) {
    return absl::NotFoundError(
        absl::StrCat(root, ": no committed checkpoint (step-N)"));
  }
  return checkpoints.back().second;
}

namespace {

std::string KeyList(const std::vector<std::string>& keys) {
  std::vector<std::string> quoted;
  for (size_t i = 0; i < keys.size() && i < 20; ++i) {
    quoted.push_back(Quote(keys[i]));
  }
  if (keys.size() > 20)
    quoted.push_back(absl::StrCat("... (", keys.size(), " in all)"));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

// When `fine` is `coarse` with dim `*dim` split in two (fine[dim] x
// fine[dim + 1] = coarse[dim], the other dims equal), sets *dim.
bool SplitOf(const Shape& coarse, const Shape& fine, int* dim) {
  if (fine.size() != coarse.size() + 1) return false;
  for (size_t d = 0; d < coarse.size(); ++d) {
    bool ok = fine[d] * fine[d + 1] == coarse[d];
    for (size_t e = 0; ok && e < d; ++e) ok = fine[e] == coarse[e];
    for (size_t e = d + 1; ok && e < coarse.size(); ++e) {
      ok = fine[e + 1] == coarse[e];
    }
    if (ok) {
      *dim = static_cast<int>(d);
      return true;
    }
  }
  return false;
}

// True when a DTensor of `shape` can be loaded from an entry of `stored`
// (equal, or one a split of the other).
bool LoadableShape(const Shape& stored, const Shape& shape) {
  int dim = 0;
  return stored == shape || SplitOf(stored, shape, &dim) ||
         SplitOf(shape, stored, &dim);
}

// Reads `box` of a tensor of `shape` from an entry of `stored` shape, one
// dim of which is split or merged relative to `shape` (LoadableShape), into
// `local` (box.shape): block by block of the split dim, each block a box of
// the entry read into a scratch tensor and copied into place.
absl::Status ReadReshapedBox(CheckpointReader* reader, const std::string& key,
                             const Shape& stored, const Shape& shape,
                             const Box& box, Tensor* local) {
  int dim = 0;
  const bool merged = SplitOf(shape, stored, &dim);  // shape is the coarse
  if (!merged && !SplitOf(stored, shape, &dim)) {
    return absl::InternalError("ReadReshapedBox: shapes are not a split");
  }
  if (IsEmptyBox(box)) return absl::OkStatus();
  // Reads `stored_box` of the entry into `local` at `local_offset`, where
  // it is the sub-box `local_sub_shape` (the same elements).
  auto read = [&](const Box& stored_box, const Shape& local_sub_shape,
                  const Shape& local_offset) -> absl::Status {
    FSDPP_ASSIGN_OR_RETURN(Tensor scratch,
                           Tensor::Empty(stored_box.shape, local->dtype(),
                                         local->device(), MemoryTag::kOther));
    FSDPP_RETURN_IF_ERROR(reader->ReadBox(key, stored_box, &scratch));
    FSDPP_ASSIGN_OR_RETURN(Tensor as_local, scratch.Reshape(local_sub_shape));
    return CopyBox(as_local, Shape(local_sub_shape.size(), 0), local,
                   local_offset, local_sub_shape);
  };
  if (merged) {
    // The state is coarse: its dim `dim` = blocks x inner of the entry's.
    const int64_t inner = stored[dim + 1];
    const int64_t lo = box.offset[dim], hi = lo + box.shape[dim];
    for (int64_t i = lo / inner; i * inner < hi; ++i) {
      const int64_t a = std::max(lo, i * inner),
                    b = std::min(hi, (i + 1) * inner);
      Box fine;
      for (int d = 0; d < static_cast<int>(box.offset.size()); ++d) {
        if (d == dim) {
          fine.offset.push_back(i);
          fine.shape.push_back(1);
          fine.offset.push_back(a - i * inner);
          fine.shape.push_back(b - a);
        } else {
          fine.offset.push_back(box.offset[d]);
          fine.shape.push_back(box.shape[d]);
        }
      }
      Shape sub = box.shape, at(box.shape.size(), 0);
      sub[dim] = b - a;
      at[dim] = a - lo;
      FSDPP_RETURN_IF_ERROR(read(fine, sub, at));
    }
    return absl::OkStatus();
  }
  // The state is fine: its dims `dim`, `dim + 1` are the entry's dim `dim`.
  const int64_t inner = shape[dim + 1];
  for (int64_t i = 0; i < box.shape[dim]; ++i) {
    const int64_t block = box.offset[dim] + i;
    Box coarse;
    for (int d = 0; d < static_cast<int>(box.offset.size()); ++d) {
      if (d == dim) {
        coarse.offset.push_back(block * inner + box.offset[dim + 1]);
        coarse.shape.push_back(box.shape[dim + 1]);
        ++d;
      } else {
        coarse.offset.push_back(box.offset[d]);
        coarse.shape.push_back(box.shape[d]);
      }
    }
    Shape sub = box.shape, at(box.shape.size(), 0);
    sub[dim] = 1;
    at[dim] = i;
    FSDPP_RETURN_IF_ERROR(read(coarse, sub, at));
  }
  return absl::OkStatus();
}

// The state's view of one item: kind, dtype and global shape.
absl::Status CheckCompatible(const std::string& key,
                             const StateDict::Item& item,
                             const EntryMetadata& entry) {
  const bool is_bytes = item.kind == StateDict::Kind::kBytes;
  if (is_bytes != (entry.kind == EntryKind::kBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", Quote(key), ": the checkpoint holds a ",
        EntryKindName(entry.kind), ", the state a ", StateKindName(item.kind)));
  }
  if (is_bytes) return absl::OkStatus();
  const DType dtype = item.kind == StateDict::Kind::kDTensor
                          ? item.dtensor.dtype()
                          : item.tensor.dtype();
  const Shape& shape = item.kind == StateDict::Kind::kDTensor
                           ? item.dtensor.shape()
                           : item.tensor.shape();
  const bool shape_ok = item.kind == StateDict::Kind::kDTensor
                            ? LoadableShape(entry.shape, shape)
                            : shape == entry.shape;
  if (!shape_ok || dtype != entry.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", Quote(key), ": ", !shape_ok ? "shape" : "dtype",
        " mismatch: the checkpoint has ", Describe(entry.dtype, entry.shape),
        ", the state has ", Describe(dtype, shape)));
  }
  if (item.kind == StateDict::Kind::kDTensor) {
    for (const Placement& p : item.dtensor.placements()) {
      if (p.is_partial()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "key ", Quote(key), ": cannot load into a DTensor with placements ",
            PlacementsToString(item.dtensor.placements())));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoadResult> Load(StateDict* state,
                                const std::string& checkpoint_dir,
                                const LoadOptions& options) {
  const absl::Time start = absl::Now();
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                         CheckpointReader::Open(checkpoint_dir));
  reader->set_check_finite(options.check_finite);
  const CheckpointMetadata& metadata = reader->metadata();
  LoadResult result;
  result.path = reader->dir();
  result.step = metadata.step;
  auto optional = [&](const std::string& key) {
    for (const std::string& prefix : options.optional_prefixes) {
      if (absl::StartsWith(key, prefix)) return true;
    }
    return false;
  };
  std::vector<std::string> missing, unexpected;  // Strict violations.
  for (const auto& [key, item] : state->items()) {
    if (metadata.entries.count(key) != 0) continue;
    result.missing_keys.push_back(key);
    if (!optional(key)) missing.push_back(key);
  }
  for (const auto& [key, entry] : metadata.entries) {
    if (state->Find(key) != nullptr) continue;
    result.unexpected_keys.push_back(key);
    if (!optional(key)) unexpected.push_back(key);
  }
  if (options.strict && !missing.empty()) {
    return absl::NotFoundError(absl::StrCat(
        checkpoint_dir,
        ": the checkpoint lacks keys of the state: ", KeyList(missing)));
  }
  if (options.strict && !unexpected.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        checkpoint_dir,
        ": the checkpoint has keys the state lacks: ", KeyList(unexpected)));
  }
  for (const auto& [key, item] : state->items()) {
    auto it = metadata.entries.find(key);
    if (it == metadata.entries.end()) continue;
    absl::Status ok = CheckCompatible(key, item, it->second);
    if (!ok.ok()) return Annotate(ok, checkpoint_dir);
  }
  for (const auto& [key, entry] : metadata.entries) {
    StateDict::Item* item = state->FindMutable(key);
    if (item == nullptr) continue;
    switch (item->kind) {
      case StateDict::Kind::kDTensor: {
        const DTensor& t = item->dtensor;
        const Box box = LocalBox(t.shape(), MeshShape(*t.mesh()),
                                 t.mesh()->coordinate(), t.placements());
        if (t.shape() == entry.shape) {
          FSDPP_RETURN_IF_ERROR(
              reader->ReadBox(key, box, item->dtensor.mutable_local()));
        } else {
          FSDPP_ASSIGN_OR_RETURN(
              Tensor local, item->dtensor.mutable_local()->Reshape(box.shape));
          FSDPP_RETURN_IF_ERROR(ReadReshapedBox(reader.get(), key, entry.shape,
                                                t.shape(), box, &local));
        }
        break;
      }
      case StateDict::Kind::kTensor:
        FSDPP_RETURN_IF_ERROR(
            reader->ReadBox(key, Box{Shape(entry.shape.size(), 0), entry.shape},
                            &item->tensor));
        break;
      case StateDict::Kind::kBytes: {
        FSDPP_ASSIGN_OR_RETURN(item->bytes, reader->ReadBytes(key));
        break;
      }
    }
  }
  result.bytes_read = reader->bytes_read();
  result.time = absl::Now() - start;
  return result;
}

}  // namespace fsdpp
