// Verified checkpoint reads; see reader.h.
#include "checkpoint/reader.h"

#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/boxes.h"
#include "checkpoint/crc32c.h"
#include "core/status.h"

namespace fsdpp {
namespace {

// Window of VerifyAll reads.
constexpr uint64_t kVerifyWindowBytes = uint64_t{16} << 20;
// Reads are issued and checksummed this many bytes (or one block) at a time,
// so the CRC pass finds the data in the L2 cache.
constexpr uint64_t kReadWindowBytes = uint64_t{1} << 20;
// Spans of at least this many windows are checksummed by a helper thread
// while the next window is read.
constexpr uint64_t kPipelineMinWindows = 4;

std::string Quote(const std::string& key) {
  return absl::StrCat("'", absl::CHexEscape(key), "'");
}

// The buffers whose concatenation is the span of blocks ReadVerified reads,
// as (data, bytes) pairs in span order.
using SpanPieces = std::array<std::pair<char*, uint64_t>, 3>;

// The iovecs of span bytes [a, b).
std::vector<iovec> SliceSpan(const SpanPieces& pieces, uint64_t a, uint64_t b) {
  std::vector<iovec> iov;
  uint64_t at = 0;
  for (const auto& [p, n] : pieces) {
    const uint64_t lo = std::max(a, at), hi = std::min(b, at + n);
    if (lo < hi) iov.push_back({p + (lo - at), static_cast<size_t>(hi - lo)});
    at += n;
  }
  return iov;
}

// For long spans: a helper thread runs verify_window(i) (checksums window i)
// while this thread runs read_window(i + 1), so verification costs almost no
// extra time. Returns the first mismatch, else the first read error.
absl::Status PipelinedReadAndVerify(
    uint64_t windows, absl::FunctionRef<absl::Status(uint64_t)> read_window,
    absl::FunctionRef<absl::Status(uint64_t)> verify_window) {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t windows_read = 0;  // Guarded by mu.
  bool stop = false;          // Guarded by mu: no more windows will come.
  absl::Status verified;
  std::thread verifier([&] {
    for (uint64_t i = 0; i < windows; ++i) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return windows_read > i || stop; });
        if (windows_read <= i) return;
      }
      absl::Status status = verify_window(i);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        verified = std::move(status);
        stop = true;
        return;
      }
    }
  });
  absl::Status read;
  for (uint64_t i = 0; i < windows && read.ok(); ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stop) break;  // The verifier found a mismatch.
    }
    read = read_window(i);
    if (read.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      windows_read = i + 1;
    }
    cv.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  verifier.join();
  // A mismatch lies in data read before any read error.
  return verified.ok() ? read : verified;
}

// Reads and checksums windows [0, windows): read_window(i) then
// verify_window(i) in turn when there are few, else pipelined.
absl::Status ReadAndVerifyWindows(
    uint64_t windows, absl::FunctionRef<absl::Status(uint64_t)> read_window,
    absl::FunctionRef<absl::Status(uint64_t)> verify_window) {
  if (windows < kPipelineMinWindows) {
    for (uint64_t i = 0; i < windows; ++i) {
      FSDPP_RETURN_IF_ERROR(read_window(i));
      FSDPP_RETURN_IF_ERROR(verify_window(i));
    }
    return absl::OkStatus();
  }
  return PipelinedReadAndVerify(windows, read_window, verify_window);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  FSDPP_ASSIGN_OR_RETURN(CheckpointMetadata metadata, ReadMetadata(dir));
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(std::move(dir), std::move(metadata)));
}

absl::StatusOr<const EntryMetadata*> CheckpointReader::Entry(
    const std::string& key) const {
  auto it = metadata_.entries.find(key);
  if (it == metadata_.entries.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": the checkpoint has no key ", Quote(key)));
  }
  return &it->second;
}

std::string CheckpointReader::FilePath(int64_t file) const {
  return absl::StrCat(dir_, "/", metadata_.files[file]);
}

std::string CheckpointReader::Describe(const std::string& key,
                                       const ChunkMetadata& chunk) const {
  return absl::StrCat("key ", Quote(key), " chunk ", BoxToString(chunk.box));
}

absl::StatusOr<int> CheckpointReader::FileFd(const std::string& key,
                                             int64_t file) {
  auto it = fds_.find(file);
  if (it != fds_.end()) return it->second.get();
  const std::string path = FilePath(file);
  absl::StatusOr<ScopedFd> fd = OpenForRead(path);
  if (!fd.ok()) {
    return absl::Status(fd.status().code(),
                        absl::StrCat(fd.status().message(),
                                     " (data file of key ", Quote(key), ")"));
  }
  FSDPP_ASSIGN_OR_RETURN(const uint64_t size, FileSize(fd->get(), path));
  file_sizes_[file] = size;
  const int raw = fd->get();
  fds_.emplace(file, *std::move(fd));
  return raw;
}

absl::Status CheckpointReader::ReadVerified(const std::string& key,
                                            const ChunkMetadata& chunk,
                                            uint64_t begin, uint64_t end,
                                            char* out) {
  if (begin > end || end > chunk.length) {
    return absl::InternalError(
        absl::StrCat("ReadVerified: bytes [", begin, ", ", end, ") outside ",
                     Describe(key, chunk), " of ", chunk.length, " bytes"));
  }
  if (begin == end) return absl::OkStatus();
  const uint64_t block = metadata_.block_bytes;
  const uint64_t span_begin = begin / block * block;
  const uint64_t span_end =
      std::min(chunk.length, NumBlocks(end, block) * block);
  head_scratch_.resize(begin - span_begin);
  tail_scratch_.resize(span_end - end);
  FSDPP_ASSIGN_OR_RETURN(const int fd, FileFd(key, chunk.file));
  const std::string path = FilePath(chunk.file);
  // The span is the concatenation of three pieces: the head of the first
  // block (scratch), the wanted bytes, the tail of the last block (scratch).
  const SpanPieces pieces = {{{head_scratch_.data(), head_scratch_.size()},
                              {out, end - begin},
                              {tail_scratch_.data(), tail_scratch_.size()}}};
  // Reads span bytes [w, w_end) (a window).
  auto read_window = [&](uint64_t w, uint64_t w_end) -> absl::Status {
    FSDPP_ASSIGN_OR_RETURN(
        const uint64_t got,
        PreadFully(fd, SliceSpan(pieces, w - span_begin, w_end - span_begin),
                   chunk.byte_offset + w, path));
    bytes_read_ += got;
    if (got < w_end - w) {
      return absl::DataLossError(absl::StrCat(
          path, ": truncated: ", Describe(key, chunk), " needs bytes [",
          chunk.byte_offset + span_begin, ", ", chunk.byte_offset + span_end,
          ") but the file has ", file_sizes_[chunk.file], " bytes"));
    }
    return absl::OkStatus();
  };
  // Checks the blocks of a window that has been read.
  auto verify_window = [&](uint64_t w, uint64_t w_end) -> absl::Status {
    for (uint64_t b = w / block; b * block < w_end; ++b) {
      const uint64_t b_end = std::min(chunk.length, (b + 1) * block);
      uint32_t crc = 0;
      for (const iovec& v :
           SliceSpan(pieces, b * block - span_begin, b_end - span_begin)) {
        crc = Crc32cExtend(crc, v.iov_base, v.iov_len);
      }
      if (crc != chunk.block_crc32c[b]) {
        const uint64_t at = chunk.byte_offset + b * block;
        return absl::DataLossError(absl::StrCat(
            path, ": checksum mismatch in ", Describe(key, chunk), " block ", b,
            " (file bytes [", at, ", ", chunk.byte_offset + b_end,
            ")): stored 0x", absl::Hex(chunk.block_crc32c[b], absl::kZeroPad8),
            ", computed 0x", absl::Hex(crc, absl::kZeroPad8)));
      }
    }
    return absl::OkStatus();
  };
  // Windows of about 1 MiB: each is checksummed while still in cache.
  const uint64_t window = std::max(block, kReadWindowBytes / block * block);
  const uint64_t windows = NumBlocks(span_end - span_begin, window);
  auto window_begin = [&](uint64_t i) { return span_begin + i * window; };
  auto window_end = [&](uint64_t i) {
    return std::min(span_end, span_begin + (i + 1) * window);
  };
  return ReadAndVerifyWindows(
      windows,
      [&](uint64_t i) { return read_window(window_begin(i), window_end(i)); },
      [&](uint64_t i) {
        return verify_window(window_begin(i), window_end(i));
      });
}

absl::Status CheckpointReader::ReadBox(const std::string& key, const Box& box,
                                       Tensor* dst) {
  FSDPP_ASSIGN_OR_RETURN(const EntryMetadata* entry, Entry(key));
  const size_t n = entry->shape.size();
  bool inside = box.offset.size() == n && box.shape.size() == n;
  for (size_t d = 0; inside && d < n; ++d) {
    inside = box.offset[d] >= 0 && box.shape[d] >= 0 &&
             box.offset[d] + box.shape[d] <= entry->shape[d];
  }
  if (!inside || dst->dtype() != entry->dtype || dst->shape() != box.shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReadBox: key ", Quote(key), " is ", DTypeName(entry->dtype),
        ShapeToString(entry->shape), "; cannot read box ", BoxToString(box),
        " into ", dst->ToString()));
  }
  if (IsEmptyBox(box)) return absl::OkStatus();
  const size_t esize = DTypeSize(entry->dtype);
  for (const ChunkMetadata& chunk : entry->chunks) {
    const Box common = Intersect(chunk.box, box);
    if (IsEmptyBox(common)) continue;
    // Rows [lo, hi) of dim 0 of the chunk hold the common box.
    int64_t lo = 0, hi = 1, row_elements = 1;
    if (n > 0) {
      lo = common.offset[0] - chunk.box.offset[0];
      hi = lo + common.shape[0];
      for (size_t d = 1; d < n; ++d) row_elements *= chunk.box.shape[d];
    }
    const uint64_t row_bytes = static_cast<uint64_t>(row_elements) * esize;
    const uint64_t begin = static_cast<uint64_t>(lo) * row_bytes;
    const uint64_t end = static_cast<uint64_t>(hi) * row_bytes;
    bool contiguous = dst->device().is_cpu();
    for (size_t d = 1; contiguous && d < n; ++d) {
      contiguous = common.shape[d] == chunk.box.shape[d] &&
                   common.shape[d] == box.shape[d];
    }
    if (contiguous) {
      const int64_t dst_row = n > 0 ? common.offset[0] - box.offset[0] : 0;
      char* out = static_cast<char*>(dst->raw_data()) + dst_row * row_bytes;
      FSDPP_RETURN_IF_ERROR(ReadChecked(key, chunk, begin, end, out));
      continue;
    }
    const int64_t count = static_cast<int64_t>((end - begin) / esize);
    Tensor& staging = staging_[entry->dtype];
    if (!staging.defined() || staging.numel() < count) {
      FSDPP_ASSIGN_OR_RETURN(
          staging, Tensor::Empty({count}, entry->dtype, Device::Cpu()));
    }
    FSDPP_RETURN_IF_ERROR(ReadChecked(key, chunk, begin, end,
                                      static_cast<char*>(staging.raw_data())));
    Shape rows_shape = chunk.box.shape;
    Shape src_offset(n, 0);
    if (n > 0) rows_shape[0] = hi - lo;
    for (size_t d = 1; d < n; ++d) {
      src_offset[d] = common.offset[d] - chunk.box.offset[d];
    }
    Shape dst_offset(n, 0);
    for (size_t d = 0; d < n; ++d)
      dst_offset[d] = common.offset[d] - box.offset[d];
    FSDPP_ASSIGN_OR_RETURN(Tensor narrowed, staging.Narrow(0, count));
    FSDPP_ASSIGN_OR_RETURN(Tensor rows, narrowed.Reshape(rows_shape));
    FSDPP_RETURN_IF_ERROR(
        CopyBox(rows, src_offset, dst, dst_offset, common.shape));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> CheckpointReader::ReadTensor(const std::string& key) {
  FSDPP_ASSIGN_OR_RETURN(const EntryMetadata* entry, Entry(key));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty(entry->shape, entry->dtype, Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(
      ReadBox(key, Box{Shape(entry->shape.size(), 0), entry->shape}, &t));
  return t;
}

absl::StatusOr<std::string> CheckpointReader::ReadBytes(
    const std::string& key) {
  FSDPP_ASSIGN_OR_RETURN(const EntryMetadata* entry, Entry(key));
  if (entry->kind != EntryKind::kBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir_, ": key ", Quote(key), " is a tensor, not a byte value"));
  }
  std::string value(static_cast<size_t>(entry->shape[0]), '\0');
  for (const ChunkMetadata& chunk : entry->chunks) {
    FSDPP_RETURN_IF_ERROR(ReadVerified(key, chunk, 0, chunk.length,
                                       value.data() + chunk.box.offset[0]));
  }
  return value;
}

int64_t CheckpointReader::NonFinite(const std::string& key, const char* out,
                                    uint64_t bytes) const {
  const DType dtype = metadata_.entries.at(key).dtype;
  return CountNonFinite(out, static_cast<int64_t>(bytes / DTypeSize(dtype)),
                        dtype);
}

absl::Status CheckpointReader::ReadChecked(const std::string& key,
                                           const ChunkMetadata& chunk,
                                           uint64_t begin, uint64_t end,
                                           char* out) {
  FSDPP_RETURN_IF_ERROR(ReadVerified(key, chunk, begin, end, out));
  if (!check_finite_) return absl::OkStatus();
  if (const int64_t n = NonFinite(key, out, end - begin); n > 0) {
    return absl::DataLossError(absl::StrCat(
        dir_, ": ", Describe(key, chunk), " holds ", n,
        " non-finite value(s) (inf or NaN) in the part read: the checkpoint "
        "was saved from a diverged or damaged state"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::VerifyAll(
    std::map<std::string, int64_t>* non_finite) {
  const uint64_t window = std::max(
      metadata_.block_bytes,
      kVerifyWindowBytes / metadata_.block_bytes * metadata_.block_bytes);
  std::string buffer;
  for (const auto& [key, entry] : metadata_.entries) {
    for (const ChunkMetadata& chunk : entry.chunks) {
      for (uint64_t at = 0; at < chunk.length; at += window) {
        const uint64_t end = std::min(chunk.length, at + window);
        buffer.resize(end - at);
        FSDPP_RETURN_IF_ERROR(ReadVerified(key, chunk, at, end, buffer.data()));
        // The window is whole elements (a multiple of the block size).
        if (non_finite != nullptr && entry.kind == EntryKind::kTensor) {
          if (const int64_t n = NonFinite(key, buffer.data(), end - at)) {
            (*non_finite)[key] += n;
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdpp
