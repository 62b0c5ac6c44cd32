#include "formats/safetensors/safetensors_seeds.h"

#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "formats/safetensors/safetensors.h"
#include "tensor/tensor.h"

namespace fsdpp {

std::vector<std::pair<std::string, std::string>> SafetensorsSeeds(
    const std::string& scratch_dir) {
  std::mt19937_64 rng(3);
  auto random_tensor = [&](Shape shape, DType dtype) {
    Tensor t = *Tensor::Empty(std::move(shape), dtype, Device::Cpu());
    auto* p = static_cast<unsigned char*>(t.raw_data());
    for (size_t i = 0; i < t.nbytes(); ++i)
      p[i] = static_cast<unsigned char>(rng());
    return t;
  };
  const std::vector<std::vector<std::pair<std::string, Tensor>>> sets = {
      {{"w", random_tensor({3, 4}, DType::kF32)},
       {"b", random_tensor({4}, DType::kBF16)}},
      {{"ids", random_tensor({5}, DType::kI64)},
       {"mask", random_tensor({2, 3}, DType::kU8)},
       {"h", random_tensor({1, 3}, DType::kF16)},
       {"n", random_tensor({2}, DType::kI32)}},
      {{"scalar", random_tensor({}, DType::kF32)},
       {"empty", random_tensor({0}, DType::kI32)},
       {"empty2", random_tensor({3, 0}, DType::kBF16)}},
      {},
  };
  std::vector<std::pair<std::string, std::string>> seeds;
  for (size_t i = 0; i < sets.size(); ++i) {
    const std::string name = absl::StrCat("seed", i, ".safetensors");
    const std::string path = absl::StrCat(scratch_dir, "/", name);
    std::map<std::string, std::string> metadata;
    if (i % 2 == 1) metadata = {{"format", "pt"}, {"k\"\xc3\xa9", "v\n"}};
    CHECK_OK(WriteSafetensors(path, sets[i], metadata));
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    CHECK(in) << "cannot read back " << path;
    seeds.emplace_back(name, bytes.str());
  }
  // Foreign dtypes, unpadded header.
  const std::string header =
      R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"BOOL","shape":[2,1],"data_offsets":[16,18]}})";
  std::string foreign(8, '\0');
  for (int i = 0; i < 8; ++i) {
    foreign[i] =
        static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  }
  seeds.emplace_back("foreign.safetensors",
                     foreign + header + std::string(18, '\x5a'));
  return seeds;
}

}  // namespace fsdpp
