// Runs the safetensors fuzz entry point (safetensors_fuzz.cc) over a
// deterministic corpus of 20000 mutations of valid files: byte flips, header
// JSON edits, truncations, insertions, deletions and header-length edits. No
// input may crash or trip the entry point's invariant CHECKs; each either
// opens or fails with InvalidArgument/DataLoss. A sample is also written to
// disk to check that Open (mmap) and FromBuffer agree.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "formats/safetensors/safetensors.h"
#include "formats/safetensors/safetensors_seeds.h"
#include "gtest/gtest.h"
#include "tensor/tensor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fsdpp {
namespace {

constexpr int kInputs = 20000;

std::string TempPath(absl::string_view name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

// Valid files covering every dtype, odd shapes, metadata, foreign dtypes and
// an empty file (formats/safetensors/safetensors_seeds.h).
std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  for (auto& [name, bytes] : SafetensorsSeeds(TempPath(""))) {
    seeds.push_back(std::move(bytes));
  }
  return seeds;
}

void SetHeaderLength(std::string* file, uint64_t n) {
  if (file->size() < 8) return;
  for (int i = 0; i < 8; ++i) (*file)[i] = static_cast<char>(n >> (8 * i));
}

uint64_t HeaderLength(const std::string& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0 && file.size() >= 8; --i) {
    n = (n << 8) | static_cast<unsigned char>(file[i]);
  }
  return n;
}

// One random edit; `rng` fixes the whole corpus.
void Mutate(std::string* file, std::mt19937_64* rng) {
  const std::string structural = "{}[]\":,0123456789-.e ";
  auto pick = [&](uint64_t n) { return n == 0 ? 0 : (*rng)() % n; };
  // Header bytes, when the length field is still sane.
  const uint64_t header = std::min<uint64_t>(
      HeaderLength(*file), file->size() >= 8 ? file->size() - 8 : 0);
  switch ((*rng)() % 9) {
    case 0:  // Flip random bits anywhere.
      if (!file->empty())
        (*file)[pick(file->size())] ^= static_cast<char>(1 + pick(255));
      break;
    case 1:  // Replace a header byte with a JSON-significant one.
      if (header > 0)
        (*file)[8 + pick(header)] = structural[pick(structural.size())];
      break;
    case 2:  // Change a digit in the header (offsets, shapes).
      for (int tries = 0; tries < 16 && header > 0; ++tries) {
        char& c = (*file)[8 + pick(header)];
        if (c >= '0' && c <= '9') {
          c = static_cast<char>('0' + pick(10));
          break;
        }
      }
      break;
    case 3:  // Truncate.
      file->resize(pick(file->size() + 1));
      break;
    case 4: {  // Edit the header length.
      const uint64_t n = HeaderLength(*file);
      const uint64_t choices[] = {0,
                                  n + 1,
                                  n - 1,
                                  n + 8,
                                  file->size(),
                                  file->size() - 8,
                                  (*rng)(),
                                  SafetensorsFile::kMaxHeaderBytes + 1,
                                  ~uint64_t{0}};
      SetHeaderLength(file, choices[pick(9)]);
      break;
    }
    case 5:  // Insert bytes.
      file->insert(pick(file->size() + 1),
                   std::string(1 + pick(8), static_cast<char>((*rng)())));
      break;
    case 6:  // Delete a range.
      if (!file->empty()) file->erase(pick(file->size()), 1 + pick(16));
      break;
    case 7:  // Append trailing bytes.
      file->append(1 + pick(16), static_cast<char>((*rng)()));
      break;
    case 8:  // Swap two header bytes.
      if (header > 1)
        std::swap((*file)[8 + pick(header)], (*file)[8 + pick(header)]);
      break;
  }
}

TEST(SafetensorsFuzzTest, MutatedFilesOpenOrFailCleanly) {
  const std::vector<std::string> seeds = Seeds();
  // The unmutated seeds all open.
  for (const std::string& seed : seeds) {
    ASSERT_TRUE(SafetensorsFile::FromBuffer(seed).ok());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(seed.data()),
                           seed.size());
  }
  std::mt19937_64 rng(20240601);
  std::map<absl::StatusCode, int> outcomes;
  const std::string disk_path = TempPath("fuzz_sample.safetensors");
  for (int i = 0; i < kInputs; ++i) {
    std::string input = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) Mutate(&input, &rng);

    ASSERT_EQ(LLVMFuzzerTestOneInput(
                  reinterpret_cast<const uint8_t*>(input.data()), input.size()),
              0);
    auto file = SafetensorsFile::FromBuffer(input, disk_path);
    const absl::StatusCode code = file.status().code();
    ++outcomes[code];
    ASSERT_TRUE(code == absl::StatusCode::kOk ||
                code == absl::StatusCode::kInvalidArgument ||
                code == absl::StatusCode::kDataLoss)
        << file.status();
    if (i % 100 == 0) {  // The mmap path agrees with the buffer path.
      std::ofstream(disk_path, std::ios::binary | std::ios::trunc) << input;
      auto opened = SafetensorsFile::Open(disk_path);
      ASSERT_EQ(opened.status(), file.status());
      if (opened.ok()) {
        ASSERT_EQ((*opened)->names(), (*file)->names());
      }
    }
  }
  // The corpus reaches both outcomes and both error kinds.
  EXPECT_GT(outcomes[absl::StatusCode::kOk], 500);
  EXPECT_GT(outcomes[absl::StatusCode::kInvalidArgument], 5000);
  EXPECT_GT(outcomes[absl::StatusCode::kDataLoss], 500);
  for (const auto& [code, count] : outcomes) {
    std::cout << absl::StatusCodeToString(code) << ": " << count << "\n";
  }
}

}  // namespace
}  // namespace fsdpp
