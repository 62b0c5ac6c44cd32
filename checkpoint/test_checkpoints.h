// Test helpers for the checkpoint tests: scratch directories under
// TEST_TMPDIR, deterministic tensors with random bit patterns (every bit
// matters, so comparisons are bitwise), and box slicing of reference tensors.
#ifndef FSDPP_CHECKPOINT_TEST_CHECKPOINTS_H_
#define FSDPP_CHECKPOINT_TEST_CHECKPOINTS_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "formats/file_util.h"
#include "mesh/device_mesh.h"
#include "tensor/dtensor.h"
#include "tensor/sharding.h"
#include "tensor/tensor.h"
#include "tensor/test_tensors.h"

namespace fsdpp {
namespace testing_util {

// An empty directory TEST_TMPDIR/<name> (removed and recreated).
inline std::string FreshDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
  CHECK_OK(RemoveTree(dir));
  CHECK_OK(MakeDirs(dir));
  return dir;
}

// A host tensor of `shape` whose bytes are random bits drawn from `seed`.
inline Tensor BitPattern(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = *Tensor::Empty(shape, dtype, Device::Cpu());
  std::mt19937_64 rng(seed);
  auto* p = static_cast<unsigned char*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i)
    p[i] = static_cast<unsigned char>(rng());
  return t;
}

// A host tensor whose 8-byte words hash (seed, word index): a fast,
// deterministic bit pattern for large tensors.
inline Tensor HashPattern(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = *Tensor::Empty(shape, dtype, Device::Cpu());
  char* p = static_cast<char*>(t.raw_data());
  const size_t n = t.nbytes();
  for (size_t i = 0; i < n; i += 8) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;  // SplitMix64.
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, n - i < 8 ? n - i : 8);
  }
  return t;
}

// A zero-filled host tensor.
inline Tensor ZerosLike(const Shape& shape, DType dtype) {
  return *Tensor::Zeros(shape, dtype, Device::Cpu());
}

// The part of `full` inside `box`, as a new host tensor.
inline Tensor Slice(const Tensor& full, const Box& box) {
  Tensor out = *Tensor::Empty(box.shape, full.dtype(), Device::Cpu());
  CHECK_OK(
      CopyBox(full, box.offset, &out, Shape(box.shape.size(), 0), box.shape));
  return out;
}

// Waits until every rank of `mesh` gets here. Thread ranks that do no
// collective of their own call it before returning, so no rank tears its
// mesh down while a peer is still connecting.
inline void Barrier(DeviceMesh& mesh) {
  absl::StatusOr<ProcessGroup*> group = mesh.FlatGroup();
  CHECK_OK(group.status());
  absl::StatusOr<std::shared_ptr<Work>> work = (*group)->Barrier();
  CHECK_OK(work.status());
  CHECK_OK((*work)->Wait());
}

// The axis sizes of `mesh`.
inline std::vector<int> MeshShapeOf(const DeviceMesh& mesh) {
  std::vector<int> shape;
  for (const MeshAxis& axis : mesh.axes()) shape.push_back(axis.size);
  return shape;
}

// This rank's box of a `shape` tensor under `placements` on `mesh`.
inline Box BoxOn(const Shape& shape, const DeviceMesh& mesh,
                 const std::vector<Placement>& placements) {
  return LocalBox(shape, MeshShapeOf(mesh), mesh.coordinate(), placements);
}

// A DTensor holding this rank's piece of `full` (a copy).
inline DTensor MakeDTensor(const Tensor& full, DeviceMesh* mesh,
                           const std::vector<Placement>& placements) {
  absl::StatusOr<DTensor> d =
      DTensor::FromLocal(Slice(full, BoxOn(full.shape(), *mesh, placements)),
                         mesh, placements, full.shape());
  CHECK_OK(d.status());
  return *d;
}

}  // namespace testing_util
}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_TEST_CHECKPOINTS_H_
