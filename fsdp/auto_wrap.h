// Auto-wrapping: FullyShard applied bottom-up to every module a predicate
// picks, then to the root (FSDP1's auto_wrap_policy, done with FSDP2's
// per-module fully_shard), and the block-then-root plan that the per-model
// FSDP plans (models/<name>/parallelize.h) are made of.
//
// The predicate sees modules in post-order (children before parents), with
// the parameter count of the subtree and the count not yet taken by a
// matched module below, so a size policy wraps the smallest subtrees that
// reach the threshold, as FSDP1's size_based_auto_wrap_policy does.
//
// Tied parameters: a unit owns its parameters, and a module outside the unit
// cannot read them (they are resharded after the unit's forward). So a
// matched module whose parameters are also used outside its subtree (a GPT-2
// token embedding and the LM head sharing wte.weight) cannot be a unit on its
// own. Two policies:
//   kGroup        the module joins one unit with every module outside it that
//                 uses one of its parameters, transitively (matched or not):
//                 {wte, lm_head} become one unit hooked on both, whose
//                 parameters are gathered for each and whose gradients are
//                 reduced once, after the last of them ran backward.
//   kLeaveToRoot  the module is not wrapped; its parameters fall to the
//                 nearest wrapped ancestor (usually the root), which also
//                 holds every other user. This is FSDP2's recipe (embeddings
//                 and head in the root unit).
// A group that would contain the root is dropped (the root takes it all).
#ifndef FSDPP_FSDP_AUTO_WRAP_H_
#define FSDPP_FSDP_AUTO_WRAP_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "fsdp/fully_shard.h"
#include "nn/module.h"

namespace fsdpp {
namespace fsdp {

// A module offered to a wrap predicate.
struct WrapCandidate {
  std::string name;  // Fully qualified from the root.
  Module* module = nullptr;
  // Elements of the parameters the subtree uses (a tied one once).
  int64_t parameters = 0;
  // Of those, the elements no matched module below this one uses.
  int64_t unwrapped_parameters = 0;
};

// Whether a module becomes (part of) a unit. Never asked about the root.
using WrapPredicate = std::function<bool(const WrapCandidate&)>;

// Matches modules whose kind() is one of `kinds` ("TransformerBlock"):
// FSDP1's transformer_auto_wrap_policy.
WrapPredicate WrapModuleKinds(std::vector<std::string> kinds);

// Matches modules with at least `min_parameters` elements not already under
// a matched module below them: FSDP1's size_based_auto_wrap_policy.
WrapPredicate WrapMinParameters(int64_t min_parameters);

// What to do with a matched module whose parameters are used outside it.
enum class TiedParameterPolicy { kGroup, kLeaveToRoot };

struct AutoWrapOptions {
  // Options of every unit (the root's too).
  FullyShardOptions shard;
  TiedParameterPolicy tied = TiedParameterPolicy::kGroup;
};

// One unit-to-be of an auto-wrap plan: the modules of one FullyShard call.
struct WrapGroup {
  std::vector<std::pair<std::string, Module*>> modules;  // (fqn, module)
};

// The groups AutoWrap would shard, in application order (inner before
// outer), the root excluded; changes nothing. Groups whose modules use no
// parameter left over by earlier groups are dropped (an empty unit would
// only add collectives).
absl::StatusOr<std::vector<WrapGroup>> PlanAutoWrap(
    Module* root, const WrapPredicate& predicate, TiedParameterPolicy tied);

// Applies FullyShard to every group of PlanAutoWrap, then to `root`;
// returns the units in that order (root last). Errors from FullyShard
// (e.g. a module already sharded) are returned naming the group.
absl::StatusOr<std::vector<FsdpUnit*>> AutoWrap(Module* root,
                                                const WrapPredicate& predicate,
                                                const AutoWrapOptions& options);

// The parameters `module` (in `root`'s tree) uses that no module outside its
// subtree uses: what a unit or gradient bucket rooted at `module` can own
// alone. In `root`'s NamedParameters order, shared ones once. NotFound if
// `module` is not in the tree.
absl::StatusOr<std::vector<Parameter*>> ExclusiveParameters(Module* root,
                                                            Module* module);

// Options of the per-model FSDP plans.
struct FsdpPlanOptions {
  // Options of every unit; shard.reshard_after_forward applies to the blocks
  // (the root is never resharded after forward).
  FullyShardOptions shard;
  // Whether the last block reshards after forward too. False is FSDP2's
  // recommendation: backward starts with it, so resharding would only make
  // its pre-backward all-gather again at once.
  bool reshard_last_block_after_forward = false;
};

// Shards each of `blocks` as one unit, in order, then `root` (everything
// else: embeddings, final norm, head, and so tied weights together); returns
// the blocks' units then the root's.
absl::StatusOr<std::vector<FsdpUnit*>> ShardBlocksThenRoot(
    Module* root, const std::vector<Module*>& blocks,
    const FsdpPlanOptions& options);

}  // namespace fsdp
}  // namespace fsdpp

#endif  // FSDPP_FSDP_AUTO_WRAP_H_
