// Placement printing; see placement.h.
#include "tensor/placement.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdpp {

std::string Placement::ToString() const {
  switch (kind_) {
    case Kind::kShard:
      return absl::StrCat("S(", dim_, ")");
    case Kind::kReplicate:
      return "R";
    case Kind::kPartial:
      return absl::StrCat("P(", ReduceOpName(op_), ")");
  }
  return "?";
}

std::string PlacementsToString(const std::vector<Placement>& placements) {
  std::vector<std::string> parts;
  for (const Placement& p : placements) parts.push_back(p.ToString());
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace fsdpp
