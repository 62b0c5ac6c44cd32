// Whole-file reads and atomic writes with errors as absl::Status, for the
// data pipeline and the config loader.
//
// Writes go to "<path>.tmp.<pid>" and are renamed over `path`, so a reader
// never sees a half-written file (a crash leaves the old file or none).
#ifndef FSDPP_TRAINER_DATA_FILE_UTIL_H_
#define FSDPP_TRAINER_DATA_FILE_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fsdpp {
namespace trainer {

// The contents of `path`. NotFound when it does not exist, FailedPrecondition
// when it is not a regular file, other errors as "cannot read <what> "path":
// <strerror>". `what` names the file's role in messages ("config file").
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             absl::string_view what = "file");

// Writes `contents` to `path` atomically (temporary file, then rename).
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents,
                                 absl::string_view what = "file");

// True when `path` names an existing regular file (symlinks followed).
bool IsRegularFile(const std::string& path);

// True when `path` names an existing directory (symlinks followed).
bool IsDirectory(const std::string& path);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_DATA_FILE_UTIL_H_
