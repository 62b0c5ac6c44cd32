// The embedded default run of `bazel run //trainer:train`
// (trainer/configs/default.textproto compiled into the binary).
#ifndef FSDPP_TRAINER_DEFAULT_CONFIG_H_
#define FSDPP_TRAINER_DEFAULT_CONFIG_H_

#include "absl/strings/string_view.h"

namespace fsdpp {
namespace trainer {

// The text of trainer/configs/default.textproto.
absl::string_view DefaultConfigText();

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DEFAULT_CONFIG_H_
