// A counter-based random permutation of [0, size): index -> position
// computed on demand in O(1) expected time and no memory.
//
// Design: a balanced Feistel network on the smallest even number of bits that
// covers `size` (so the domain is < 4 x size), with Philox (core/rng.h) keyed
// by the seed as round function and the stream selecting the permutation
// (the data loader uses the epoch). Values that land outside [0, size) are
// encrypted again ("cycle walking"), which keeps it a bijection of [0, size).
// Any element can be computed alone, so a rank reading every D-th element of
// an epoch never materialises the order and resuming needs only a counter.
#ifndef FSDPP_TRAINER_DATA_PERMUTATION_H_
#define FSDPP_TRAINER_DATA_PERMUTATION_H_

#include <cstdint>

namespace fsdpp {
namespace trainer {

// A pseudo-random bijection of [0, size) determined by (seed, stream).
class Permutation {
 public:
  // `size` must be < 2^62.
  Permutation(uint64_t size, uint64_t seed, uint64_t stream);

  // The image of `index` (< size).
  uint64_t operator()(uint64_t index) const;

  // The domain size.
  uint64_t size() const { return size_; }

 private:
  uint64_t Encrypt(uint64_t value) const;

  uint64_t size_;
  uint64_t seed_;
  uint64_t stream_;
  int half_bits_ = 0;
  uint64_t half_mask_ = 0;
};

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_PERMUTATION_H_
