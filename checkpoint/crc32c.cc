// CRC-32C: portable slicing-by-8 tables and the SSE4.2 crc32 instruction over
// three interleaved streams; see crc32c.h.
#include "checkpoint/crc32c.h"

#include <array>
#include <cstring>

namespace fsdpp {
namespace {

// The reflected Castagnoli polynomial.
constexpr uint32_t kPoly = 0x82F63B78u;

struct Tables {
  // t[k][b]: the CRC register contribution of byte b followed by k zero
  // bytes.
  uint32_t t[8][256];
};

constexpr Tables MakeTables() {
  Tables tables{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    tables.t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      const uint32_t prev = tables.t[k - 1][b];
      tables.t[k][b] = (prev >> 8) ^ tables.t[0][prev & 0xff];
    }
  }
  return tables;
}

constexpr Tables kTables = MakeTables();

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;  // Little-endian hosts only (as the file formats).
}

// a(x) * b(x) mod P(x) in the reflected representation (bit 31 is x^0).
// `a` must be non-zero.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31;
  uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod P(x) for k in [0, 68): enough for any 64-bit byte count.
constexpr int kPowers = 68;
const std::array<uint32_t, kPowers>& PowerTable() {
  static const std::array<uint32_t, kPowers> table = [] {
    std::array<uint32_t, kPowers> t{};
    uint32_t p = uint32_t{1} << 30;  // x^1.
    t[0] = p;
    for (int k = 1; k < kPowers; ++k) t[k] = p = MultModP(p, p);
    return t;
  }();
  return table;
}

// x^(8 * bytes) mod P(x): the operator that appends `bytes` zero bytes to a
// CRC register.
uint32_t ZerosOperator(uint64_t bytes) {
  const std::array<uint32_t, kPowers>& table = PowerTable();
  uint32_t p = uint32_t{1} << 31;  // x^0.
  int k = 3;                       // 8 bits per byte.
  while (bytes != 0) {
    if (bytes & 1) p = MultModP(table[k], p);
    bytes >>= 1;
    ++k;
  }
  return p;
}

#if defined(__x86_64__)
// Bytes per stream in one interleaved step of the hardware path.
constexpr size_t kStripe = 8192;

struct StripeOperators {
  uint32_t one = ZerosOperator(kStripe);
  uint32_t two = ZerosOperator(2 * kStripe);
};

const StripeOperators& Stripes() {
  static const StripeOperators ops;
  return ops;
}
#endif

}  // namespace

namespace crc32c_internal {

uint32_t ExtendPortable(uint32_t crc, const void* data, size_t size) {
  const auto& t = kTables.t;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    const uint64_t word = Load64(p);
    const uint32_t lo = static_cast<uint32_t>(word) ^ c;
    const uint32_t hi = static_cast<uint32_t>(word >> 32);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^
        t[4][lo >> 24] ^ t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^
        t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

#if defined(__x86_64__)
bool HardwareAvailable() {
  static const bool available = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return available;
}

__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc,
                                                          const void* data,
                                                          size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (size > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
    --size;
  }
  if (size >= 3 * kStripe) {
    const StripeOperators& ops = Stripes();
    while (size >= 3 * kStripe) {
      uint64_t c0 = c, c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStripe; i += 8) {
        c0 = __builtin_ia32_crc32di(c0, Load64(p + i));
        c1 = __builtin_ia32_crc32di(c1, Load64(p + kStripe + i));
        c2 = __builtin_ia32_crc32di(c2, Load64(p + 2 * kStripe + i));
      }
      // Registers are linear: the state after A B C is shift(A, 2 stripes)
      // ^ shift(B, 1 stripe) ^ C, with B and C started from zero.
      c = MultModP(ops.two, static_cast<uint32_t>(c0)) ^
          MultModP(ops.one, static_cast<uint32_t>(c1)) ^
          static_cast<uint32_t>(c2);
      p += 3 * kStripe;
      size -= 3 * kStripe;
    }
  }
  while (size >= 8) {
    c = __builtin_ia32_crc32di(c, Load64(p));
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}
#else
bool HardwareAvailable() { return false; }

uint32_t ExtendHardware(uint32_t crc, const void* data, size_t size) {
  return ExtendPortable(crc, data, size);
}
#endif

}  // namespace crc32c_internal

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  static const bool hardware = crc32c_internal::HardwareAvailable();
  return hardware ? crc32c_internal::ExtendHardware(crc, data, size)
                  : crc32c_internal::ExtendPortable(crc, data, size);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
  return MultModP(ZerosOperator(size_b), crc_a) ^ crc_b;
}

}  // namespace fsdpp
