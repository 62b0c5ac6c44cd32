// Caching allocator; see caching_allocator.h.
#include "core/caching_allocator.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/logging.h"

namespace fsdpp {

namespace {

class CpuRaw final : public RawAllocator {
 public:
  Device device() const override { return Device::Cpu(); }
  void* Alloc(size_t bytes) override {
    return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  }
  void Free(void* ptr) override { std::free(ptr); }
};

}  // namespace

std::unique_ptr<RawAllocator> CpuRawAllocator() {
  return std::make_unique<CpuRaw>();
}

CachingAllocator::CachingAllocator(std::unique_ptr<RawAllocator> raw)
    : raw_(std::move(raw)) {
  CHECK(raw_ != nullptr);
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  EmptyCacheLocked();
}

size_t CachingAllocator::RoundSize(size_t bytes) {
  constexpr size_t kGranule = 512;
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

absl::StatusOr<void*> CachingAllocator::Allocate(size_t bytes, MemoryTag tag) {
  if (bytes == 0) return nullptr;
  const size_t size = RoundSize(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* ptr = nullptr;
  auto it = free_blocks_.lower_bound(size);
  if (it != free_blocks_.end() && it->first <= 2 * size) {
    ptr = it->second;
    block_sizes_[ptr] = it->first;
    cached_ -= static_cast<int64_t>(it->first);
    free_blocks_.erase(it);
  } else {
    ptr = raw_->Alloc(size);
    if (ptr == nullptr && !free_blocks_.empty()) {
      EmptyCacheLocked();
      ptr = raw_->Alloc(size);
    }
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat(device().ToString(), ": out of memory allocating ",
                       bytes, " bytes for ", MemoryTagName(tag), " (",
                       tracker_.Stats().total_current, " bytes allocated, ",
                       reserved_, " reserved)"));
    }
    block_sizes_[ptr] = size;
    reserved_ += static_cast<int64_t>(size);
    tracker_.SetReserved(reserved_);
  }
  tracker_.OnAllocate(bytes, tag);
  return ptr;
}

void CachingAllocator::Deallocate(void* ptr, size_t bytes, MemoryTag tag) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = block_sizes_.find(ptr);
  CHECK(it != block_sizes_.end()) << "freeing unknown pointer " << ptr;
  free_blocks_.emplace(it->second, ptr);
  cached_ += static_cast<int64_t>(it->second);
  block_sizes_.erase(it);
  tracker_.OnFree(bytes, tag);
}

void CachingAllocator::EmptyCache() {
  std::lock_guard<std::mutex> lock(mu_);
  EmptyCacheLocked();
}

void CachingAllocator::EmptyCacheLocked() {
  for (auto& [size, ptr] : free_blocks_) {
    raw_->Free(ptr);
    reserved_ -= static_cast<int64_t>(size);
  }
  free_blocks_.clear();
  cached_ = 0;
  tracker_.SetReserved(reserved_);
}

int64_t CachingAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

}  // namespace fsdpp
