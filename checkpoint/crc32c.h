// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
// every chunk and block in a checkpoint (as in iSCSI, ext4 and LevelDB).
//
// Two implementations give identical results: a portable slicing-by-8 table
// walk, and on x86-64 CPUs with SSE4.2 the crc32 instruction run over three
// interleaved streams (one instruction has a 3-cycle latency but issues every
// cycle), whose partial CRCs are joined with the same GF(2) polynomial
// arithmetic that Crc32cCombine uses. The hardware path is picked once at run
// time with __builtin_cpu_supports, so the binary runs on any x86-64.
#ifndef FSDPP_CHECKPOINT_CRC32C_H_
#define FSDPP_CHECKPOINT_CRC32C_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace fsdpp {

// CRC-32C of `crc`'s message followed by `data[0, size)`: start from 0 for a
// new message, Crc32cExtend(Crc32cExtend(0, a), b) == crc of a then b.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// CRC-32C of `data[0, size)`; Crc32c("123456789") == 0xE3069283.
inline uint32_t Crc32c(const void* data, size_t size) {
  return Crc32cExtend(0, data, size);
}
inline uint32_t Crc32c(absl::string_view data) {
  return Crc32cExtend(0, data.data(), data.size());
}

// The CRC-32C of A followed by B from crc(A), crc(B) and B's length, in
// O(log size_b) without touching the bytes.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b);

namespace crc32c_internal {

// The portable slicing-by-8 implementation of Crc32cExtend.
uint32_t ExtendPortable(uint32_t crc, const void* data, size_t size);
// True when this CPU has the SSE4.2 crc32 instruction (x86-64 only).
bool HardwareAvailable();
// The crc32-instruction implementation; only call when HardwareAvailable().
uint32_t ExtendHardware(uint32_t crc, const void* data, size_t size);

}  // namespace crc32c_internal
}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_CRC32C_H_
