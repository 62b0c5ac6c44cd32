// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// Output for element i is a pure function of (seed, stream id, i): the key is
// the 64-bit seed, the 128-bit counter is (i / lanes, stream id). So any slice
// [a, b) of a tensor can be generated alone (a rank initialising only its
// shard) and equals the same slice of the whole tensor, bitwise, at any world
// size. Use one stream id per tensor. The functions are FSDPP_HOST_DEVICE so a
// CUDA kernel produces the same integers; float results match across devices
// up to the device's log/cos for normals.
#ifndef FSDPP_CORE_RNG_H_
#define FSDPP_CORE_RNG_H_

#include <cmath>
#include <cstdint>

#include "core/macros.h"

namespace fsdpp {

struct Philox4x32 {
  uint32_t v[4];
};

FSDPP_INLINE void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi,
                                uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// The Philox4x32 block function with 10 rounds.
FSDPP_INLINE Philox4x32 Philox4x32_10(Philox4x32 counter, uint32_t key0,
                                      uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
  uint32_t* c = counter.v;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(kMul0, c[0], &hi0, &lo0);
    PhiloxMulHiLo(kMul1, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ key0;
    const uint32_t n2 = hi0 ^ c[3] ^ key1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// The 4 random words of block `block` of stream `stream` under `seed`.
FSDPP_INLINE Philox4x32 PhiloxBlock(uint64_t seed, uint64_t stream,
                                    uint64_t block) {
  Philox4x32 counter = {
      {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
       static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return Philox4x32_10(counter, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// 32 random bits for element i (block i/4, lane i%4).
FSDPP_INLINE uint32_t RandomBits(uint64_t seed, uint64_t stream, uint64_t i) {
  return PhiloxBlock(seed, stream, i / 4).v[i % 4];
}

// Uniform in [0, 1) with 24 random bits (exactly representable in f32).
FSDPP_INLINE float UniformFromBits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// Element i of a uniform [0, 1) sequence.
FSDPP_INLINE float RandomUniform(uint64_t seed, uint64_t stream, uint64_t i) {
  return UniformFromBits(RandomBits(seed, stream, i));
}

// Element i of a standard normal sequence: Box-Muller on lanes (2k, 2k+1) of
// block i/2, k = i%2, computed in double and rounded once to float.
FSDPP_INLINE float RandomNormal(uint64_t seed, uint64_t stream, uint64_t i) {
  const Philox4x32 block = PhiloxBlock(seed, stream, i / 2);
  const int k = static_cast<int>(i % 2) * 2;
  // u1 in (0, 1] so log(u1) is finite; u2 in [0, 1).
  const double u1 =
      (static_cast<double>(block.v[k]) + 1.0) * (1.0 / 4294967296.0);
  const double u2 = static_cast<double>(block.v[k + 1]) * (1.0 / 4294967296.0);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  return static_cast<float>(sqrt(-2.0 * log(u1)) * cos(kTwoPi * u2));
}

// Fills out[j] = lo + (hi - lo) * uniform(offset + j) for j in [0, n).
void FillUniform(uint64_t seed, uint64_t stream, uint64_t offset, int64_t n,
                 float lo, float hi, float* out);

// Fills out[j] = mean + std * normal(offset + j) for j in [0, n).
void FillNormal(uint64_t seed, uint64_t stream, uint64_t offset, int64_t n,
                float mean, float std, float* out);

// Like FillNormal, but values beyond `bound` standard deviations are replaced
// by the next value of a fallback sequence of the same element (a truncated
// normal, as GPT/Llama-style init uses). `bound` must be >= 1.
void FillTruncatedNormal(uint64_t seed, uint64_t stream, uint64_t offset,
                         int64_t n, float mean, float std, float bound,
                         float* out);

}  // namespace fsdpp

#endif  // FSDPP_CORE_RNG_H_
