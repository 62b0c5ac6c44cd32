// The valid safetensors files that fuzzing starts from: every dtype, odd
// shapes (scalar, empty), __metadata__ with escapes, an empty file, and a
// file with foreign dtypes (F64, BOOL) and an unpadded header. Shared by
// safetensors_fuzz_test (deterministic mutations) and checkpoint/fuzz's
// write_seeds (the libFuzzer corpus).
#ifndef FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_SEEDS_H_
#define FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_SEEDS_H_

#include <string>
#include <utility>
#include <vector>

namespace fsdpp {

// (file name, file bytes) of each seed. Written with WriteSafetensors under
// `scratch_dir` (which must exist) and read back; CHECK-fails if writing
// fails (a broken test setup, not an input).
std::vector<std::pair<std::string, std::string>> SafetensorsSeeds(
    const std::string& scratch_dir);

}  // namespace fsdpp

#endif  // FSDPP_FORMATS_SAFETENSORS_SAFETENSORS_SEEDS_H_
