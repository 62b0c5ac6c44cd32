// How a DTensor is laid out along one mesh axis: Shard(dim), Replicate, or
// Partial(op) (each rank holds a term of a pending reduction).
#ifndef FSDPP_TENSOR_PLACEMENT_H_
#define FSDPP_TENSOR_PLACEMENT_H_

#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdpp {

class Placement {
 public:
  enum class Kind { kShard, kReplicate, kPartial };

  static Placement Shard(int dim) {
    return Placement(Kind::kShard, dim, ReduceOp::kSum);
  }
  static Placement Replicate() {
    return Placement(Kind::kReplicate, -1, ReduceOp::kSum);
  }
  static Placement Partial(ReduceOp op = ReduceOp::kSum) {
    return Placement(Kind::kPartial, -1, op);
  }

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  bool is_partial() const { return kind_ == Kind::kPartial; }
  // The sharded tensor dim (Shard only).
  int dim() const { return dim_; }
  // The pending reduction (Partial only).
  ReduceOp reduce_op() const { return op_; }

  // "S(0)", "R", "P(sum)".
  std::string ToString() const;

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind_ == b.kind_ &&
           (a.kind_ != Kind::kShard || a.dim_ == b.dim_) &&
           (a.kind_ != Kind::kPartial || a.op_ == b.op_);
  }
  friend bool operator!=(const Placement& a, const Placement& b) {
    return !(a == b);
  }

 private:
  Placement(Kind kind, int dim, ReduceOp op)
      : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int dim_;
  ReduceOp op_;
};

// "[S(0), R]".
std::string PlacementsToString(const std::vector<Placement>& placements);

}  // namespace fsdpp

#endif  // FSDPP_TENSOR_PLACEMENT_H_
