// Dense tensors: shape + dtype + device over shared, accounted storage.
//
// A Tensor is a cheap handle (copying it shares the storage, like
// torch.Tensor). Only contiguous row-major layouts exist: views are slices
// along dim 0 (Narrow) and reshapes, which is all FSDP needs to carve
// parameters out of flat buffers. Every allocation goes through the device's
// Allocator with a MemoryTag, so memory per purpose is exact. Meta tensors
// carry shape and dtype but no storage and allocate nothing.
#ifndef FSDPP_TENSOR_TENSOR_H_
#define FSDPP_TENSOR_TENSOR_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/logging.h"

namespace fsdpp {

using Shape = std::vector<int64_t>;

// "[2, 3, 4]".
std::string ShapeToString(absl::Span<const int64_t> shape);
// Product of the dims (1 for a scalar shape []).
int64_t NumElements(absl::Span<const int64_t> shape);

// Owned device memory; frees itself through its allocator.
class Storage {
 public:
  // Allocates `bytes` on `device` under `tag`. Meta devices allocate nothing.
  static absl::StatusOr<std::shared_ptr<Storage>> Allocate(size_t bytes,
                                                           Device device,
                                                           MemoryTag tag);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  MemoryTag tag() const { return tag_; }

  // Ids checked on the host: every id held here lies in [0, bound) (0:
  // unchecked). See Tensor::MarkIdsCheckedBelow.
  int64_t ids_checked_below() const { return ids_checked_below_; }
  void set_ids_checked_below(int64_t bound) { ids_checked_below_ = bound; }

 private:
  Storage(void* data, size_t bytes, Device device, MemoryTag tag,
          Allocator* allocator)
      : data_(data),
        bytes_(bytes),
        device_(device),
        tag_(tag),
        allocator_(allocator) {}
  void* data_;
  size_t bytes_;
  Device device_;
  MemoryTag tag_;
  Allocator* allocator_;
  int64_t ids_checked_below_ = 0;
};

class Tensor {
 public:
  // An undefined tensor (no shape, no storage).
  Tensor() = default;

  // Uninitialised memory of `shape` on `device`.
  static absl::StatusOr<Tensor> Empty(Shape shape, DType dtype, Device device,
                                      MemoryTag tag = MemoryTag::kOther);
  // Zero-filled.
  static absl::StatusOr<Tensor> Zeros(Shape shape, DType dtype, Device device,
                                      MemoryTag tag = MemoryTag::kOther);
  // A host f32 tensor holding `values` (numel must match), converted to
  // `dtype` and placed on `device`.
  static absl::StatusOr<Tensor> FromFloats(Shape shape,
                                           absl::Span<const float> values,
                                           DType dtype = DType::kF32,
                                           Device device = Device::Cpu(),
                                           MemoryTag tag = MemoryTag::kOther);
  // A host tensor of integer ids (dtype i32 or i64).
  static absl::StatusOr<Tensor> FromInts(Shape shape,
                                         absl::Span<const int64_t> values,
                                         DType dtype = DType::kI32,
                                         Device device = Device::Cpu());

  bool defined() const { return defined_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension `d`; negative d counts from the end.
  int64_t dim(int d) const;
  int64_t numel() const { return NumElements(shape_); }
  size_t nbytes() const { return numel() * DTypeSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  MemoryTag tag() const;
  bool is_meta() const { return device_.is_meta(); }

  // Raw pointer to the first element (nullptr for meta or empty tensors).
  void* raw_data() const;
  template <typename T>
  T* data() const {
    CHECK(dtype_ == DTypeOf<T>::value)
        << "data<" << DTypeName(DTypeOf<T>::value) << ">() on a "
        << DTypeName(dtype_) << " tensor";
    return static_cast<T*>(raw_data());
  }

  // Rows [start, start + length) of dim 0, sharing storage.
  absl::StatusOr<Tensor> Narrow(int64_t start, int64_t length) const;
  // The same elements with another shape (one dim may be -1), sharing storage.
  absl::StatusOr<Tensor> Reshape(Shape shape) const;
  // A 1-D view of all elements.
  Tensor Flatten() const;

  // True when both views use the same storage.
  bool SharesStorageWith(const Tensor& other) const {
    return storage_ != nullptr && storage_ == other.storage_;
  }
  // Byte offset of this view in its storage.
  size_t storage_offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Copies the elements to a host vector, converted to float (any dtype).
  absl::StatusOr<std::vector<float>> ToFloats() const;
  // Copies the ids of an i32 or i64 tensor to a host vector (FromInts'
  // inverse); InvalidArgument for other dtypes.
  absl::StatusOr<std::vector<int64_t>> ToInts() const;

  // "f32[2, 3] cpu" (or "undefined").
  std::string ToString() const;

  // Records that the caller checked on the host that every id in this
  // tensor's storage lies in [0, bound) and will not write it again: a GPU
  // op taking the ids then skips its own range check (a device-to-host copy
  // of the ids) when bound is within the op's range. The trainer marks each
  // batch it copies to a GPU. i32 / i64 tensors only; bound > 0.
  void MarkIdsCheckedBelow(int64_t bound) const;
  // That bound (0: not checked).
  int64_t ids_checked_below() const {
    return storage_ ? storage_->ids_checked_below() : 0;
  }

 private:
  Tensor(std::shared_ptr<Storage> storage, size_t offset, Shape shape,
         DType dtype, Device device)
      : defined_(true),
        storage_(std::move(storage)),
        offset_(offset),
        shape_(std::move(shape)),
        dtype_(dtype),
        device_(device) {}

  bool defined_ = false;
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::Cpu();
};

// The keys each query row of an attention call attends to (tensor/ops.h
// CausalAttention): keys [lo[b, i], hi[b, i]) for query i of batch row b;
// lo and hi are i32 [B, T] on the call's device, each optional (lo default
// 0, hi default i + 1: causal), values clamped to [0, T].
struct KeyRange {
  const Tensor* lo = nullptr;
  const Tensor* hi = nullptr;
};

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_TENSOR_H_
