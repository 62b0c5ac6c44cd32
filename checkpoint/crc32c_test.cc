// CRC-32C against published vectors (the "123456789" check value and the
// RFC 3720 iSCSI vectors) on both the portable and the SSE4.2 paths, the two
// paths against each other on random buffers at every alignment, incremental
// extension and Crc32cCombine.
#include "checkpoint/crc32c.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdpp {
namespace {

using Extend = uint32_t (*)(uint32_t, const void*, size_t);

struct Vector {
  std::string data;
  uint32_t crc;
};

std::vector<Vector> KnownVectors() {
  std::string ascending(32, '\0'), descending(32, '\0');
  for (int i = 0; i < 32; ++i) {
    ascending[i] = static_cast<char>(i);
    descending[i] = static_cast<char>(31 - i);
  }
  return {
      {"", 0x00000000u},
      {"a", 0xC1D04330u},
      {"123456789", 0xE3069283u},
      {std::string(32, '\0'), 0x8A9136AAu},
      {std::string(32, '\xff'), 0x62A8AB43u},
      {ascending, 0x46DD794Eu},
      {descending, 0x113FDB5Cu},
  };
}

std::vector<std::pair<std::string, Extend>> Paths() {
  std::vector<std::pair<std::string, Extend>> paths = {
      {"portable", &crc32c_internal::ExtendPortable}};
  if (crc32c_internal::HardwareAvailable()) {
    paths.push_back({"sse4.2", &crc32c_internal::ExtendHardware});
  }
  return paths;
}

TEST(Crc32cTest, KnownVectorsOnEveryPath) {
  for (const auto& [name, extend] : Paths()) {
    for (const Vector& v : KnownVectors()) {
      EXPECT_EQ(extend(0, v.data.data(), v.data.size()), v.crc)
          << name << " on " << v.data.size() << " bytes";
    }
  }
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
}

TEST(Crc32cTest, HardwarePathIsUsedWhereAvailable) {
#if defined(__x86_64__)
  // Every x86-64 CPU this project targets has SSE4.2; make a silent fallback
  // visible.
  EXPECT_TRUE(crc32c_internal::HardwareAvailable());
#else
  GTEST_SKIP() << "no SSE4.2 path on this architecture";
#endif
}

TEST(Crc32cTest, PathsAgreeOnRandomBuffersAtEveryAlignment) {
  if (!crc32c_internal::HardwareAvailable()) GTEST_SKIP() << "no SSE4.2";
  std::mt19937_64 rng(7);
  std::string buffer(3 * 8192 * 3 + 64, '\0');
  for (char& c : buffer) c = static_cast<char>(rng());
  // Sizes around the 3 x 8 KiB interleave boundary and tiny ones.
  const size_t sizes[] = {0,
                          1,
                          7,
                          8,
                          9,
                          63,
                          1000,
                          3 * 8192 - 1,
                          3 * 8192,
                          3 * 8192 + 1,
                          6 * 8192 + 13,
                          buffer.size() - 8};
  for (size_t size : sizes) {
    for (size_t align = 0; align < 8; ++align) {
      const char* p = buffer.data() + align;
      const uint32_t seed = static_cast<uint32_t>(rng());
      EXPECT_EQ(crc32c_internal::ExtendHardware(seed, p, size),
                crc32c_internal::ExtendPortable(seed, p, size))
          << "size " << size << " align " << align;
    }
  }
}

TEST(Crc32cTest, ExtendAndCombineMatchOneShot) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::string data(rng() % 70000, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    const size_t split = data.empty() ? 0 : rng() % (data.size() + 1);
    const uint32_t whole = Crc32c(data);
    const uint32_t a = Crc32c(data.data(), split);
    const uint32_t b = Crc32c(data.data() + split, data.size() - split);
    EXPECT_EQ(Crc32cExtend(a, data.data() + split, data.size() - split), whole);
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - split), whole);
  }
  // Combining with an empty tail is the identity.
  EXPECT_EQ(Crc32cCombine(0xE3069283u, 0, 0), 0xE3069283u);
}

}  // namespace
}  // namespace fsdpp
