// Device memory allocation with exact, tagged accounting.
//
// Every byte a tensor or buffer holds is allocated through an Allocator with a
// MemoryTag, so "how much memory do params / grads / optimizer state /
// activations / comm buffers take on this rank" is read off the accounting
// (MemoryStats), not estimated. Counts are the bytes requested, exactly; a
// caching allocator's extra (rounding, cached blocks) is reported separately
// as `reserved_bytes`.
#ifndef FSDPP_CORE_ALLOCATOR_H_
#define FSDPP_CORE_ALLOCATOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "core/device.h"

namespace fsdpp {

// What an allocation is for.
enum class MemoryTag : uint8_t {
  kParams,
  kGrads,
  kOptimizerState,
  kActivations,
  kCommBuffers,
  kOther,
  // The attention core's own memory: the saved probabilities and the score
  // workspace of the unfused path, the saved output and log-sum-exp of the
  // fused one (q, k and v are kActivations in both).
  kAttention,
};
inline constexpr int kNumMemoryTags = 7;

// "params", "grads", "optimizer", "activations", "comm", "other",
// "attention".
const char* MemoryTagName(MemoryTag tag);

// Current and peak bytes, per tag and in total.
struct MemoryStats {
  std::array<int64_t, kNumMemoryTags> current{};
  std::array<int64_t, kNumMemoryTags> peak{};
  // Per tag, the live bytes at the moment the total peaked (what made up
  // total_peak; the per-tag peaks above need not coincide).
  std::array<int64_t, kNumMemoryTags> at_peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;
  // Bytes held from the device (>= total_current for caching allocators).
  int64_t reserved_bytes = 0;
  int64_t num_allocations = 0;    // Live allocations.
  int64_t total_allocations = 0;  // Allocations ever made (never reset).

  int64_t current_of(MemoryTag tag) const {
    return current[static_cast<int>(tag)];
  }
  int64_t peak_of(MemoryTag tag) const { return peak[static_cast<int>(tag)]; }
  // A multi-line table: tag, current, peak (MiB and bytes).
  std::string ToString() const;
};

// Thread-safe exact accounting shared by the allocators.
class MemoryTracker {
 public:
  // Counts an allocation. With `limit_bytes` > 0 it is refused (returns
  // false, counts nothing) when the total would exceed the limit.
  bool OnAllocate(size_t bytes, MemoryTag tag, int64_t limit_bytes = 0);
  void OnFree(size_t bytes, MemoryTag tag);
  void SetReserved(int64_t bytes);
  // Peaks restart from the current values.
  void ResetPeak();
  MemoryStats Stats() const;

 private:
  mutable std::mutex mu_;
  MemoryStats stats_;
};

// Allocates memory on one device. Implementations are thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // `bytes` may be 0 (returns nullptr, counts nothing). Returns
  // ResourceExhausted naming the device, size and tag when out of memory.
  virtual absl::StatusOr<void*> Allocate(size_t bytes, MemoryTag tag) = 0;
  // `bytes` and `tag` must be those given to Allocate.
  virtual void Deallocate(void* ptr, size_t bytes, MemoryTag tag) = 0;
  virtual MemoryStats Stats() const = 0;
  virtual void ResetPeak() = 0;
};

// Host memory, 64-byte aligned (one cache line / one AVX-512 vector).
class CpuAllocator final : public Allocator {
 public:
  // `limit_bytes` (0 = none) makes Allocate fail past that many live bytes:
  // used to emulate a device budget and to test out-of-memory paths.
  explicit CpuAllocator(int64_t limit_bytes = 0) : limit_bytes_(limit_bytes) {}
  Device device() const override { return Device::Cpu(); }
  absl::StatusOr<void*> Allocate(size_t bytes, MemoryTag tag) override;
  void Deallocate(void* ptr, size_t bytes, MemoryTag tag) override;
  MemoryStats Stats() const override { return tracker_.Stats(); }
  void ResetPeak() override { tracker_.ResetPeak(); }

 private:
  const int64_t limit_bytes_;
  MemoryTracker tracker_;
};

// Counts what a dry run's tensors would hold (plan/): while one is installed
// for Device::DryRun() (ScopedMetaAccounting), every tensor on that device
// reports its bytes and tag here as a real allocation would, and holds no
// memory. Allocate always returns nullptr.
class MetaAccountant final : public Allocator {
 public:
  // Counts the tensors of `device` (DryRun() or DryRunHost()).
  explicit MetaAccountant(Device device = Device::DryRun()) : device_(device) {}
  Device device() const override { return device_; }
  absl::StatusOr<void*> Allocate(size_t bytes, MemoryTag tag) override;
  void Deallocate(void* ptr, size_t bytes, MemoryTag tag) override;
  MemoryStats Stats() const override { return tracker_.Stats(); }
  void ResetPeak() override { tracker_.ResetPeak(); }

 private:
  Device device_;
  MemoryTracker tracker_;
};

// Installs `accountant` (not owned) for its device while alive, and
// puts back what was there (normally nothing) when destroyed. Dry-run
// tensors made meanwhile report to it until they are freed, so it must
// outlive them.
class ScopedMetaAccounting {
 public:
  explicit ScopedMetaAccounting(MetaAccountant* accountant);
  ~ScopedMetaAccounting();
  ScopedMetaAccounting(const ScopedMetaAccounting&) = delete;
  ScopedMetaAccounting& operator=(const ScopedMetaAccounting&) = delete;

 private:
  Device device_;
  Allocator* previous_;
};

// The allocator for `device`: the process-wide CPU allocator, or the one
// registered for a CUDA device. Meta has none (nullptr), nor has DryRun()
// unless a MetaAccountant is installed; a CUDA device has none when CUDA
// support is not built in.
Allocator* GetAllocator(Device device);

// Where host-side staging for a tensor on `device` lives (an initialiser's
// values before their copy to the device): the CPU for a real device; in a
// dry run (plan/), DryRunHost() while a MetaAccountant counts it (a GPU's
// plan, host memory apart), else DryRun() itself (the CPU's plan, one
// memory); Meta() for Meta().
Device StagingHost(Device device);

// Installs `allocator` (not owned; must outlive its use) for its device,
// replacing the previous one, which is returned. Used by the CUDA runtime and
// by tests that need a fresh accounting.
Allocator* SetAllocator(Allocator* allocator);

}  // namespace fsdpp

#endif  // FSDPP_CORE_ALLOCATOR_H_
