// Tensor and Storage; see tensor.h.
#include "tensor/tensor.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/memcpy.h"
#include "core/status.h"

namespace fsdpp {

std::string ShapeToString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::shared_ptr<Storage>> Storage::Allocate(size_t bytes,
                                                           Device device,
                                                           MemoryTag tag) {
  if (device.is_meta()) {
    // No memory; on Device::DryRun() a dry run's accountant (if installed)
    // counts the bytes.
    Allocator* accountant = GetAllocator(device);
    if (accountant != nullptr) {
      FSDPP_RETURN_IF_ERROR(accountant->Allocate(bytes, tag).status());
    }
    return std::shared_ptr<Storage>(
        new Storage(nullptr, bytes, device, tag, accountant));
  }
  Allocator* allocator = GetAllocator(device);
  if (allocator == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no allocator for device ", device.ToString(),
        device.is_cuda() ? " (CUDA not built in or not initialised)" : ""));
  }
  FSDPP_ASSIGN_OR_RETURN(void* data, allocator->Allocate(bytes, tag));
  return std::shared_ptr<Storage>(
      new Storage(data, bytes, device, tag, allocator));
}

Storage::~Storage() {
  if (allocator_ != nullptr) allocator_->Deallocate(data_, bytes_, tag_);
}

absl::StatusOr<Tensor> Tensor::Empty(Shape shape, DType dtype, Device device,
                                     MemoryTag tag) {
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Tensor::Empty: negative dim in shape ", ShapeToString(shape)));
    }
  }
  const size_t bytes = NumElements(shape) * DTypeSize(dtype);
  FSDPP_ASSIGN_OR_RETURN(std::shared_ptr<Storage> storage,
                         Storage::Allocate(bytes, device, tag));
  return Tensor(std::move(storage), 0, std::move(shape), dtype, device);
}

absl::StatusOr<Tensor> Tensor::Zeros(Shape shape, DType dtype, Device device,
                                     MemoryTag tag) {
  FSDPP_ASSIGN_OR_RETURN(Tensor t, Empty(std::move(shape), dtype, device, tag));
  if (!t.is_meta())
    FSDPP_RETURN_IF_ERROR(ZeroBytes(t.raw_data(), device, t.nbytes()));
  return t;
}

namespace {

template <typename T>
void ConvertFromFloats(absl::Span<const float> in, void* out) {
  T* o = static_cast<T*>(out);
  for (size_t i = 0; i < in.size(); ++i) o[i] = FromFloat<T>(in[i]);
}

template <typename T>
void ConvertToFloats(const void* in, size_t n, float* out) {
  const T* p = static_cast<const T*>(in);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(ToFloat(p[i]));
}

}  // namespace

absl::StatusOr<Tensor> Tensor::FromFloats(Shape shape,
                                          absl::Span<const float> values,
                                          DType dtype, Device device,
                                          MemoryTag tag) {
  if (NumElements(shape) != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Tensor::FromFloats: ", values.size(),
                     " values for shape ", ShapeToString(shape)));
  }
  if (!IsFloatingPoint(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("Tensor::FromFloats: dtype ",
                                                   DTypeName(dtype),
                                                   " is not floating point"));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor host, Empty(shape, dtype, Device::Cpu(), tag));
  switch (dtype) {
    case DType::kF32:
      ConvertFromFloats<float>(values, host.raw_data());
      break;
    case DType::kBF16:
      ConvertFromFloats<BFloat16>(values, host.raw_data());
      break;
    default:
      ConvertFromFloats<Float16>(values, host.raw_data());
      break;
  }
  if (device.is_cpu()) return host;
  FSDPP_ASSIGN_OR_RETURN(Tensor out,
                         Empty(std::move(shape), dtype, device, tag));
  FSDPP_RETURN_IF_ERROR(CopyBytes(out.raw_data(), device, host.raw_data(),
                                  Device::Cpu(), host.nbytes()));
  return out;
}

absl::StatusOr<Tensor> Tensor::FromInts(Shape shape,
                                        absl::Span<const int64_t> values,
                                        DType dtype, Device device) {
  if (NumElements(shape) != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Tensor::FromInts: ", values.size(), " values for shape ",
                     ShapeToString(shape)));
  }
  if (dtype != DType::kI32 && dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Tensor::FromInts: dtype must be i32 or i64, not ", DTypeName(dtype)));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor host, Empty(shape, dtype, Device::Cpu()));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kI32) {
      host.data<int32_t>()[i] = static_cast<int32_t>(values[i]);
    } else {
      host.data<int64_t>()[i] = values[i];
    }
  }
  if (device.is_cpu()) return host;
  FSDPP_ASSIGN_OR_RETURN(Tensor out, Empty(std::move(shape), dtype, device));
  FSDPP_RETURN_IF_ERROR(CopyBytes(out.raw_data(), device, host.raw_data(),
                                  Device::Cpu(), host.nbytes()));
  return out;
}

void Tensor::MarkIdsCheckedBelow(int64_t bound) const {
  CHECK(dtype_ == DType::kI32 || dtype_ == DType::kI64)
      << "MarkIdsCheckedBelow on a " << DTypeName(dtype_) << " tensor";
  CHECK(bound > 0) << "MarkIdsCheckedBelow(" << bound << ")";
  if (storage_ != nullptr) storage_->set_ids_checked_below(bound);
}

int64_t Tensor::dim(int d) const {
  const int n = ndim();
  if (d < 0) d += n;
  CHECK(d >= 0 && d < n) << "dim " << d << " of a " << n << "-d tensor";
  return shape_[d];
}

MemoryTag Tensor::tag() const {
  return storage_ ? storage_->tag() : MemoryTag::kOther;
}

void* Tensor::raw_data() const {
  if (storage_ == nullptr || storage_->data() == nullptr) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

absl::StatusOr<Tensor> Tensor::Narrow(int64_t start, int64_t length) const {
  if (!defined_ || ndim() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Narrow: needs a tensor with at least one dim, got ", ToString()));
  }
  if (start < 0 || length < 0 || start + length > shape_[0]) {
    return absl::OutOfRangeError(
        absl::StrCat("Narrow: rows [", start, ", ", start + length,
                     ") out of range for ", ToString()));
  }
  Shape shape = shape_;
  shape[0] = length;
  const size_t row_bytes =
      NumElements(shape_) == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
  return Tensor(storage_, offset_ + start * row_bytes, std::move(shape), dtype_,
                device_);
}

absl::StatusOr<Tensor> Tensor::Reshape(Shape shape) const {
  if (!defined_) return absl::InvalidArgumentError("Reshape: undefined tensor");
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1 && infer < 0) {
      infer = static_cast<int>(i);
    } else if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Reshape: bad target shape ", ShapeToString(shape)));
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel() % known != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Reshape: cannot infer -1 in ", ShapeToString(shape),
                       " for ", ToString()));
    }
    shape[infer] = numel() / known;
  }
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Reshape: ", ShapeToString(shape), " has ", NumElements(shape),
        " elements, ", ToString(), " has ", numel()));
  }
  return Tensor(storage_, offset_, std::move(shape), dtype_, device_);
}

Tensor Tensor::Flatten() const {
  CHECK(defined_) << "Flatten of an undefined tensor";
  return Tensor(storage_, offset_, Shape{numel()}, dtype_, device_);
}

absl::StatusOr<std::vector<int64_t>> Tensor::ToInts() const {
  if (!defined_ || is_meta() ||
      (dtype_ != DType::kI32 && dtype_ != DType::kI64)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ToInts: needs i32 or i64 data, got ", ToString()));
  }
  std::vector<char> host(nbytes());
  FSDPP_RETURN_IF_ERROR(
      CopyBytes(host.data(), Device::Cpu(), raw_data(), device_, nbytes()));
  std::vector<int64_t> out(numel());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = dtype_ == DType::kI32
                 ? reinterpret_cast<const int32_t*>(host.data())[i]
                 : reinterpret_cast<const int64_t*>(host.data())[i];
  }
  return out;
}

absl::StatusOr<std::vector<float>> Tensor::ToFloats() const {
  if (!defined_ || is_meta()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ToFloats: no data in ", ToString()));
  }
  std::vector<char> host(nbytes());
  FSDPP_RETURN_IF_ERROR(
      CopyBytes(host.data(), Device::Cpu(), raw_data(), device_, nbytes()));
  std::vector<float> out(numel());
  switch (dtype_) {
    case DType::kF32:
      ConvertToFloats<float>(host.data(), out.size(), out.data());
      break;
    case DType::kBF16:
      ConvertToFloats<BFloat16>(host.data(), out.size(), out.data());
      break;
    case DType::kF16:
      ConvertToFloats<Float16>(host.data(), out.size(), out.data());
      break;
    case DType::kI32:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<float>(
            reinterpret_cast<const int32_t*>(host.data())[i]);
      }
      break;
    case DType::kI64:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<float>(
            reinterpret_cast<const int64_t*>(host.data())[i]);
      }
      break;
    case DType::kU8:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<float>(static_cast<uint8_t>(host[i]));
      }
      break;
  }
  return out;
}

std::string Tensor::ToString() const {
  if (!defined_) return "undefined";
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_), " ",
                      device_.ToString());
}

}  // namespace fsdpp
