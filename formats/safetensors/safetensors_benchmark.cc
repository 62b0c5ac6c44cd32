// Safetensors file I/O with a few hundred tensors: WriteSafetensors (atomic
// write with fsync and rename) and SafetensorsFile::Open (mmap + strict
// header validation) followed by a Load of every tensor. Reports bytes of
// tensor data per second. Files go to a fresh directory under $TEST_TMPDIR
// (or /tmp), removed when each benchmark function returns.
//
//   bazel run -c opt //formats/safetensors:safetensors_benchmark
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "core/logging.h"
#include "formats/safetensors/safetensors.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace {

constexpr int64_t kElementsPerTensor = 4096;  // 16 KiB of f32 each.

// A fresh scratch directory, removed (with the files named through File)
// when this object dies.
class ScratchDir {
 public:
  ScratchDir() {
    const char* root = std::getenv("TEST_TMPDIR");
    std::string pattern =
        absl::StrCat(root != nullptr && *root != '\0' ? root : "/tmp",
                     "/safetensors_benchmark.XXXXXX");
    CHECK(mkdtemp(pattern.data()) != nullptr) << "mkdtemp " << pattern;
    path_ = pattern;
  }
  ~ScratchDir() {
    for (const std::string& file : files_) std::remove(file.c_str());
    rmdir(path_.c_str());
  }
  // A path inside the directory, removed with it.
  std::string File(const std::string& name) {
    files_.push_back(absl::StrCat(path_, "/", name));
    return files_.back();
  }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

// `count` f32 tensors named like a transformer's parameters.
std::vector<std::pair<std::string, Tensor>> MakeTensors(int64_t count) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<float> values(kElementsPerTensor);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < kElementsPerTensor; ++j) {
      values[j] = static_cast<float>((i + j) % 97);
    }
    absl::StatusOr<Tensor> t = Tensor::FromFloats({64, 64}, values);
    CHECK_OK(t.status());
    tensors.emplace_back(absl::StrCat("h.", i / 12, ".p", i % 12, ".weight"),
                         *std::move(t));
  }
  return tensors;
}

int64_t DataBytes(int64_t count) {
  return count * kElementsPerTensor * static_cast<int64_t>(sizeof(float));
}

// Arg: number of tensors.
void BM_WriteSafetensors(benchmark::State& state) {
  const auto tensors = MakeTensors(state.range(0));
  ScratchDir scratch;
  const std::string path = scratch.File("write.safetensors");
  for (auto _ : state) {
    CHECK_OK(WriteSafetensors(path, tensors, {{"format", "pt"}}));
  }
  state.SetBytesProcessed(state.iterations() * DataBytes(state.range(0)));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_WriteSafetensors)->Arg(300)->UseRealTime();

// Arg: number of tensors.
void BM_OpenAndLoadSafetensors(benchmark::State& state) {
  const auto tensors = MakeTensors(state.range(0));
  ScratchDir scratch;
  const std::string path = scratch.File("read.safetensors");
  CHECK_OK(WriteSafetensors(path, tensors, {{"format", "pt"}}));
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::Open(path);
    CHECK_OK(file.status());
    CHECK_EQ((*file)->size(), tensors.size());
    for (const auto& entry : tensors) {
      absl::StatusOr<Tensor> t = (*file)->Load(entry.first);
      CHECK_OK(t.status());
      benchmark::DoNotOptimize(t->raw_data());
    }
  }
  state.SetBytesProcessed(state.iterations() * DataBytes(state.range(0)));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_OpenAndLoadSafetensors)->Arg(300)->UseRealTime();

}  // namespace
}  // namespace fsdpp
