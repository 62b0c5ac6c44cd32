// Device parsing and printing; see device.h.
#include "core/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdpp {

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  if (text == "cpu") return Cpu();
  if (text == "meta") return Meta();
  if (text == "cuda") return Cuda(0);
  constexpr absl::string_view kCudaPrefix = "cuda:";
  if (text.substr(0, kCudaPrefix.size()) == kCudaPrefix) {
    int index = -1;
    if (absl::SimpleAtoi(text.substr(kCudaPrefix.size()), &index) &&
        index >= 0) {
      return Cuda(index);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "bad device '", text, "' (expected cpu, meta, cuda or cuda:N)"));
}

std::string Device::ToString() const {
  switch (type_) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kMeta:
      return index_ == 0 ? "meta" : absl::StrCat("meta:", index_);
    case DeviceType::kCuda:
      return absl::StrCat("cuda:", index_);
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, const Device& device) {
  return os << device.ToString();
}

}  // namespace fsdpp
