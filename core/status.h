// Status helpers missing from Debian's Abseil LTS (20220623).
//
// FSDPP_RETURN_IF_ERROR(expr) returns a non-OK absl::Status from the enclosing
// function; FSDPP_ASSIGN_OR_RETURN(lhs, expr) unwraps an absl::StatusOr or
// returns its error. Both keep the original message and add no allocation on
// success.
#ifndef FSDPP_CORE_STATUS_H_
#define FSDPP_CORE_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define FSDPP_STATUS_CONCAT_INNER(a, b) a##b
#define FSDPP_STATUS_CONCAT(a, b) FSDPP_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status) and returns it if it is not OK.
#define FSDPP_RETURN_IF_ERROR(expr)                                    \
  do {                                                                 \
    ::absl::Status fsdpp_status_ = (expr);                             \
    if (ABSL_PREDICT_FALSE(!fsdpp_status_.ok())) return fsdpp_status_; \
  } while (0)

// `lhs` is assigned the value of `rexpr` (an absl::StatusOr<T>), or the
// enclosing function returns its status. `lhs` may declare a variable:
//   FSDPP_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(...));
#define FSDPP_ASSIGN_OR_RETURN(lhs, rexpr) \
  FSDPP_ASSIGN_OR_RETURN_IMPL(             \
      FSDPP_STATUS_CONCAT(fsdpp_statusor_, __COUNTER__), lhs, rexpr)

#define FSDPP_ASSIGN_OR_RETURN_IMPL(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) {               \
    return std::move(statusor).status();                  \
  }                                                       \
  lhs = std::move(statusor).value()

namespace fsdpp {

// Returns `status` with `context` prepended to its message ("context: msg"),
// keeping the code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace fsdpp

#endif  // FSDPP_CORE_STATUS_H_
