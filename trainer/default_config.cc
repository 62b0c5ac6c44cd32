#include "trainer/default_config.h"

#include <cstddef>

namespace fsdpp {
namespace trainer {
namespace internal {

// Defined in the generated default_config_data.cc.
extern const char kDefaultConfigData[];
extern const size_t kDefaultConfigSize;

}  // namespace internal

absl::string_view DefaultConfigText() {
  return absl::string_view(internal::kDefaultConfigData,
                           internal::kDefaultConfigSize);
}

}  // namespace trainer
}  // namespace fsdpp
