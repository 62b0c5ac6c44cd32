// Where a tensor or buffer lives: the host (cpu), a GPU (cuda:N) or nowhere
// (meta: shape and dtype only, zero bytes, used to build models before
// sharding them).
#ifndef FSDPP_CORE_DEVICE_H_
#define FSDPP_CORE_DEVICE_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdpp {

enum class DeviceType : uint8_t { kCpu, kCuda, kMeta };

// A device: type plus index (the GPU ordinal; always 0 for cpu and meta).
class Device {
 public:
  constexpr Device() = default;
  constexpr Device(DeviceType type, int index) : type_(type), index_(index) {}

  static constexpr Device Cpu() { return Device(DeviceType::kCpu, 0); }
  static constexpr Device Cuda(int index) {
    return Device(DeviceType::kCuda, index);
  }
  static constexpr Device Meta() { return Device(DeviceType::kMeta, 0); }
  // A meta device that stands for the real one in a dry run (plan/): its
  // tensors hold no memory either, but a MetaAccountant counts them, while
  // those on Meta() (placeholders that are meta in a real run too) stay
  // uncounted.
  static constexpr Device DryRun() { return Device(DeviceType::kMeta, 1); }
  // The host's stand-in in a dry run that counts host memory apart (FSDP's
  // offloaded state when the device is a GPU).
  static constexpr Device DryRunHost() { return Device(DeviceType::kMeta, 2); }

  // Parses "cpu", "meta", "cuda" (= cuda:0) and "cuda:N".
  static absl::StatusOr<Device> Parse(absl::string_view text);

  DeviceType type() const { return type_; }
  int index() const { return index_; }
  bool is_cpu() const { return type_ == DeviceType::kCpu; }
  bool is_cuda() const { return type_ == DeviceType::kCuda; }
  bool is_meta() const { return type_ == DeviceType::kMeta; }

  // "cpu", "cuda:1", "meta", "meta:1" (DryRun()).
  std::string ToString() const;

  friend bool operator==(const Device& a, const Device& b) {
    return a.type_ == b.type_ && a.index_ == b.index_;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const Device& d) {
    return H::combine(std::move(h), d.type_, d.index_);
  }

 private:
  DeviceType type_ = DeviceType::kCpu;
  int index_ = 0;
};

std::ostream& operator<<(std::ostream& os, const Device& device);

}  // namespace fsdpp

#endif  // FSDPP_CORE_DEVICE_H_
