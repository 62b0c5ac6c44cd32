// CheckpointReader: verified reads of a committed checkpoint directory.
//
// Everything read is checked: a read of part of a chunk fetches the CRC
// blocks covering it (block_bytes pieces, 1 MiB by default) and compares
// each block's CRC-32C, so resharded loads read only the rows they need and
// still verify every byte they use. When the wanted rows are contiguous in
// the destination (host memory, whole trailing dims) they are read straight
// into it with preadv, with the partial edge blocks going to small scratch
// buffers for the check; otherwise they are read into a reused host staging
// tensor and copied with CopyBox. Reads go in ~1 MiB windows, each
// checksummed right after it arrives (while in cache); for spans of 4 or more
// windows a helper thread checksums window i while window i + 1 is read.
// Errors name the file and the key: DataLoss for checksum mismatches and
// truncated files, NotFound for missing files.
#ifndef FSDPP_CHECKPOINT_READER_H_
#define FSDPP_CHECKPOINT_READER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/metadata.h"
#include "formats/file_util.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"

namespace fsdpp {

class CheckpointReader {
 public:
  // Reads and validates `<dir>/metadata.pb` (see ParseMetadata). Data files
  // are opened on first use.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      std::string dir);

  // The checkpoint directory and its metadata.
  const std::string& dir() const { return dir_; }
  const CheckpointMetadata& metadata() const { return metadata_; }
  // The entry of `key`; NotFound if the checkpoint has none.
  absl::StatusOr<const EntryMetadata*> Entry(const std::string& key) const;

  // Copies the elements of `key` inside `box` (of the global tensor) into
  // `dst`, a tensor of shape box.shape and the entry's dtype on any device.
  // Reads only the blocks of the chunks that intersect `box`.
  absl::Status ReadBox(const std::string& key, const Box& box, Tensor* dst);
  // The whole tensor `key` as a new host tensor.
  absl::StatusOr<Tensor> ReadTensor(const std::string& key);
  // The whole byte value `key`.
  absl::StatusOr<std::string> ReadBytes(const std::string& key);
  // Reads every chunk of every entry and checks all checksums; the first
  // error. With `non_finite`, also counts the inf and NaN values of each
  // float key into it (keys without any are left out).
  absl::Status VerifyAll(std::map<std::string, int64_t>* non_finite = nullptr);
  // From now on ReadBox / ReadTensor refuse a float value that is inf or
  // NaN: DataLoss naming the key, the chunk and the count.
  void set_check_finite(bool check) { check_finite_ = check; }

  // Bytes read from data files so far (including block edges read only to
  // verify them).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  CheckpointReader(std::string dir, CheckpointMetadata metadata)
      : dir_(std::move(dir)), metadata_(std::move(metadata)) {}

  // Bytes [begin, end) of `chunk` (of `key`) into `out` (host memory),
  // reading and verifying the whole blocks that cover them.
  absl::Status ReadVerified(const std::string& key, const ChunkMetadata& chunk,
                            uint64_t begin, uint64_t end, char* out);
  // ReadVerified, then the finite check when it is on.
  absl::Status ReadChecked(const std::string& key, const ChunkMetadata& chunk,
                           uint64_t begin, uint64_t end, char* out);
  // The inf and NaN values among bytes [out, out + bytes) of `key`'s dtype.
  int64_t NonFinite(const std::string& key, const char* out,
                    uint64_t bytes) const;
  // The open descriptor of data file `file`.
  absl::StatusOr<int> FileFd(const std::string& key, int64_t file);
  std::string FilePath(int64_t file) const;
  // "key 'w' chunk [0, 0]+[4, 5]".
  std::string Describe(const std::string& key,
                       const ChunkMetadata& chunk) const;

  std::string dir_;
  CheckpointMetadata metadata_;
  std::map<int64_t, ScopedFd> fds_;
  std::map<int64_t, uint64_t> file_sizes_;
  std::map<DType, Tensor> staging_;
  std::string head_scratch_;
  std::string tail_scratch_;
  uint64_t bytes_read_ = 0;
  bool check_finite_ = false;
};

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_READER_H_
