// libFuzzer-style entry point for the safetensors reader.
//
// Feeds the input to SafetensorsFile::FromBuffer (the same validation as Open,
// without touching the disk) and, when it opens, exercises every accessor and
// CHECKs the invariants a validated file promises: byte ranges inside the
// buffer, Load/LoadRows returning exactly the mapped bytes. Any violation
// aborts, which is what a fuzzer reports. Errors must be InvalidArgument or
// DataLoss and name the buffer. Built with g++ into safetensors_fuzz_test; the
// same file links into a real libFuzzer binary under clang -fsanitize=fuzzer.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "formats/safetensors/safetensors.h"

namespace fsdpp {
namespace {

constexpr char kName[] = "fuzz";

void CheckTensor(const SafetensorsFile& file, const std::string& name,
                 size_t buffer_size) {
  absl::StatusOr<SafetensorsTensorInfo> info = file.Info(name);
  CHECK(info.ok()) << info.status();
  CHECK_LE(info->begin, info->end);
  CHECK_LE(info->end, buffer_size);
  absl::StatusOr<absl::Span<const char>> bytes = file.Bytes(name);
  CHECK(bytes.ok()) << bytes.status();
  CHECK_EQ(bytes->size(), info->end - info->begin);
  CHECK_EQ(static_cast<uint64_t>(NumElements(info->shape)) * info->element_size,
           bytes->size());

  absl::StatusOr<Tensor> loaded = file.Load(name);
  if (!info->dtype.has_value()) {
    CHECK(loaded.status().code() == absl::StatusCode::kUnimplemented)
        << loaded.status();
    return;
  }
  CHECK(loaded.ok()) << loaded.status();
  CHECK(loaded->shape() == info->shape);
  CHECK_EQ(loaded->nbytes(), bytes->size());
  CHECK(bytes->empty() ||
        std::memcmp(loaded->raw_data(), bytes->data(), bytes->size()) == 0);
  CHECK(file.Load(name, Device::Meta()).ok());

  if (info->shape.empty()) {
    CHECK(!file.LoadRows(name, 0, 1).ok());
    return;
  }
  const int64_t rows = info->shape[0];
  absl::StatusOr<Tensor> tail = file.LoadRows(name, rows / 2, rows);
  CHECK(tail.ok()) << tail.status();
  const size_t row_bytes = rows == 0 ? 0 : bytes->size() / rows;
  CHECK_EQ(tail->nbytes(), row_bytes * (rows - rows / 2));
  CHECK(tail->nbytes() == 0 ||
        std::memcmp(tail->raw_data(), bytes->data() + row_bytes * (rows / 2),
                    tail->nbytes()) == 0);
  CHECK(!file.LoadRows(name, 0, rows + 1).ok());
}

}  // namespace
}  // namespace fsdpp

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fsdpp::SafetensorsFile;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBuffer(
          std::string(reinterpret_cast<const char*>(data), size), fsdpp::kName);
  if (!file.ok()) {
    CHECK(file.status().code() == absl::StatusCode::kInvalidArgument ||
          file.status().code() == absl::StatusCode::kDataLoss)
        << file.status();
    CHECK(absl::StartsWith(file.status().message(),
                           absl::StrCat(fsdpp::kName, ": ")))
        << file.status();
    return 0;
  }
  const std::vector<std::string> names = (*file)->names();
  CHECK_EQ(names.size(), (*file)->size());
  for (size_t i = 0; i < names.size(); ++i) {
    CHECK(!names[i].empty());
    CHECK(i == 0 || names[i - 1] < names[i]);
    fsdpp::CheckTensor(**file, names[i], size);
  }
  return 0;
}
