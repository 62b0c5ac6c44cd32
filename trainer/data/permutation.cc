// Feistel-network permutation with cycle walking; see permutation.h.
#include "trainer/data/permutation.h"

#include "core/logging.h"
#include "core/rng.h"

namespace fsdpp {
namespace trainer {
namespace {

constexpr int kRounds = 6;

}  // namespace

Permutation::Permutation(uint64_t size, uint64_t seed, uint64_t stream)
    : size_(size), seed_(seed), stream_(stream) {
  CHECK(size < (uint64_t{1} << 62)) << "Permutation size " << size;
  int bits = 2;
  while ((uint64_t{1} << bits) < size) bits += 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
}

uint64_t Permutation::Encrypt(uint64_t value) const {
  uint64_t left = value >> half_bits_;
  uint64_t right = value & half_mask_;
  for (int round = 0; round < kRounds; ++round) {
    // Philox block index: the round in the high word, the half (< 2^31) low.
    const Philox4x32 random = PhiloxBlock(
        seed_, stream_, (static_cast<uint64_t>(round) << 32) | right);
    const uint64_t mixed =
        ((static_cast<uint64_t>(random.v[1]) << 32) | random.v[0]) & half_mask_;
    const uint64_t next_right = left ^ mixed;
    left = right;
    right = next_right;
  }
  return (left << half_bits_) | right;
}

uint64_t Permutation::operator()(uint64_t index) const {
  CHECK(index < size_) << "Permutation index " << index << " of " << size_;
  uint64_t value = index;
  do {
    value = Encrypt(value);
  } while (value >= size_);
  return value;
}

}  // namespace trainer
}  // namespace fsdpp
