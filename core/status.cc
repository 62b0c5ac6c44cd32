// Status helpers; see status.h.
#include "core/status.h"

namespace fsdpp {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(context, ": ", status.message()));
}

}  // namespace fsdpp
