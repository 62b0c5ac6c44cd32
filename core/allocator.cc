// Tagged memory accounting and the CPU allocator; see allocator.h.
#include "core/allocator.h"

#include <cstdlib>
#include <mutex>
#include <new>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/logging.h"

namespace fsdpp {

const char* MemoryTagName(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::kParams:
      return "params";
    case MemoryTag::kGrads:
      return "grads";
    case MemoryTag::kOptimizerState:
      return "optimizer";
    case MemoryTag::kActivations:
      return "activations";
    case MemoryTag::kCommBuffers:
      return "comm";
    case MemoryTag::kOther:
      return "other";
    case MemoryTag::kAttention:
      return "attention";
  }
  return "?";
}

std::string MemoryStats::ToString() const {
  std::string out =
      absl::StrFormat("%-12s %14s %14s\n", "tag", "current MiB", "peak MiB");
  for (int i = 0; i < kNumMemoryTags; ++i) {
    absl::StrAppendFormat(&out, "%-12s %14.3f %14.3f\n",
                          MemoryTagName(static_cast<MemoryTag>(i)),
                          current[i] / 1048576.0, peak[i] / 1048576.0);
  }
  absl::StrAppendFormat(&out, "%-12s %14.3f %14.3f\n", "total",
                        total_current / 1048576.0, total_peak / 1048576.0);
  return out;
}

bool MemoryTracker::OnAllocate(size_t bytes, MemoryTag tag,
                               int64_t limit_bytes) {
  const int i = static_cast<int>(tag);
  std::lock_guard<std::mutex> lock(mu_);
  if (limit_bytes > 0 &&
      stats_.total_current + static_cast<int64_t>(bytes) > limit_bytes) {
    return false;
  }
  stats_.current[i] += static_cast<int64_t>(bytes);
  if (stats_.current[i] > stats_.peak[i]) stats_.peak[i] = stats_.current[i];
  stats_.total_current += static_cast<int64_t>(bytes);
  if (stats_.total_current > stats_.total_peak) {
    stats_.total_peak = stats_.total_current;
    stats_.at_peak = stats_.current;
  }
  ++stats_.num_allocations;
  ++stats_.total_allocations;
  return true;
}

void MemoryTracker::OnFree(size_t bytes, MemoryTag tag) {
  const int i = static_cast<int>(tag);
  std::lock_guard<std::mutex> lock(mu_);
  CHECK_GE(stats_.current[i], static_cast<int64_t>(bytes))
      << "freeing more " << MemoryTagName(tag) << " bytes than allocated";
  stats_.current[i] -= static_cast<int64_t>(bytes);
  stats_.total_current -= static_cast<int64_t>(bytes);
  --stats_.num_allocations;
}

void MemoryTracker::SetReserved(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.reserved_bytes = bytes;
}

void MemoryTracker::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  stats_.at_peak = stats_.current;
  stats_.total_peak = stats_.total_current;
}

MemoryStats MemoryTracker::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryStats stats = stats_;
  if (stats.reserved_bytes < stats.total_current) {
    stats.reserved_bytes = stats.total_current;
  }
  return stats;
}

absl::StatusOr<void*> CpuAllocator::Allocate(size_t bytes, MemoryTag tag) {
  if (bytes == 0) return nullptr;
  if (!tracker_.OnAllocate(bytes, tag, limit_bytes_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu: out of memory allocating ", bytes, " bytes for ",
                     MemoryTagName(tag), " (", tracker_.Stats().total_current,
                     " bytes in use, limit ", limit_bytes_, ")"));
  }
  // Round up: aligned_alloc wants a multiple of the alignment.
  void* ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (ptr == nullptr) {
    tracker_.OnFree(bytes, tag);
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu: out of memory allocating ", bytes, " bytes for ",
                     MemoryTagName(tag)));
  }
  return ptr;
}

void CpuAllocator::Deallocate(void* ptr, size_t bytes, MemoryTag tag) {
  if (ptr == nullptr) return;
  std::free(ptr);
  tracker_.OnFree(bytes, tag);
}

absl::StatusOr<void*> MetaAccountant::Allocate(size_t bytes, MemoryTag tag) {
  if (bytes > 0) tracker_.OnAllocate(bytes, tag);
  return nullptr;
}

void MetaAccountant::Deallocate(void*, size_t bytes, MemoryTag tag) {
  if (bytes > 0) tracker_.OnFree(bytes, tag);
}

namespace {

std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// The default CPU allocator: built once in static storage and never
// destroyed (storage may be freed through it until the process ends), and
// not a heap object, so a program that replaces it (SetAllocator) does not
// leak it.
Allocator* DefaultCpuAllocator() {
  alignas(CpuAllocator) static unsigned char storage[sizeof(CpuAllocator)];
  static CpuAllocator* allocator = new (storage) CpuAllocator();
  return allocator;
}

absl::flat_hash_map<Device, Allocator*>& Registry() {
  static auto* registry = new absl::flat_hash_map<Device, Allocator*>{
      {Device::Cpu(), DefaultCpuAllocator()}};
  return *registry;
}

}  // namespace

Allocator* GetAllocator(Device device) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(device);
  return it == Registry().end() ? nullptr : it->second;
}

Device StagingHost(Device device) {
  if (!device.is_meta()) return Device::Cpu();
  if (device == Device::DryRun() &&
      GetAllocator(Device::DryRunHost()) != nullptr) {
    return Device::DryRunHost();
  }
  return device;
}

ScopedMetaAccounting::ScopedMetaAccounting(MetaAccountant* accountant)
    : device_(accountant != nullptr ? accountant->device() : Device::DryRun()) {
  CHECK(accountant != nullptr);
  CHECK(device_.is_meta() && device_ != Device::Meta())
      << "a MetaAccountant counts a dry-run device, not " << device_;
  previous_ = SetAllocator(accountant);
}

ScopedMetaAccounting::~ScopedMetaAccounting() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (previous_ == nullptr) {
    Registry().erase(device_);
  } else {
    Registry()[device_] = previous_;
  }
}

Allocator* SetAllocator(Allocator* allocator) {
  CHECK(allocator != nullptr);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Allocator*& slot = Registry()[allocator->device()];
  Allocator* previous = slot;
  slot = allocator;
  return previous;
}

}  // namespace fsdpp
