// A tensor's elements as the Buffer the collectives and point-to-point
// transfers take (comm/process_group.h): its data, element count, dtype and
// device. The tensor must be contiguous and outlive the op.
#ifndef FSDPP_TENSOR_COMM_BUFFER_H_
#define FSDPP_TENSOR_COMM_BUFFER_H_

#include "comm/process_group.h"
#include "tensor/tensor.h"

namespace fsdpp {

inline Buffer AsBuffer(const Tensor& t) {
  return Buffer{t.raw_data(), t.numel(), t.dtype(), t.device()};
}

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_COMM_BUFFER_H_
