// Auto-wrapping and the block-then-root plan; see auto_wrap.h.
#include "fsdp/auto_wrap.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace fsdpp {
namespace fsdp {
namespace {

// The module tree flattened in pre-order: a node's subtree is the index
// range [index, end), so "inside" is two comparisons.
class ModuleTree {
 public:
  struct Node {
    std::string name;
    Module* module = nullptr;
    int end = 0;   // One past the last node of the subtree.
    int post = 0;  // Post-order position.
    std::vector<int> children;
    std::set<Parameter*> used;  // Parameters the subtree uses.
  };

  explicit ModuleTree(Module* root) {
    Add(root, "");
    // Direct users: a node uses p directly if no child's subtree does.
    for (size_t i = 0; i < nodes_.size(); ++i) {
      std::set<Parameter*> below;
      for (int c : nodes_[i].children) {
        below.insert(nodes_[c].used.begin(), nodes_[c].used.end());
      }
      for (Parameter* p : nodes_[i].used) {
        if (below.count(p) == 0) users_[p].push_back(static_cast<int>(i));
      }
    }
  }

  const std::vector<Node>& nodes() const { return nodes_; }
  const Node& node(int i) const { return nodes_[i]; }
  // True if node `inner` is `outer` or in its subtree.
  bool Within(int inner, int outer) const {
    return outer <= inner && inner < nodes_[outer].end;
  }
  // The nodes that use `p` directly.
  const std::vector<int>& Users(Parameter* p) const { return users_.at(p); }
  // Node indices in post-order (children before parents, the root last).
  std::vector<int> PostOrder() const {
    std::vector<int> order(nodes_.size());
    for (size_t i = 0; i < nodes_.size(); ++i) order[nodes_[i].post] = i;
    return order;
  }

 private:
  int Add(Module* m, const std::string& name) {
    const int index = static_cast<int>(nodes_.size());
    nodes_.emplace_back();
    nodes_[index].name = name;
    nodes_[index].module = m;
    for (auto& [fqn, p] : m->UsedParameters()) nodes_[index].used.insert(p);
    for (const auto& [child_name, child] : m->children()) {
      const std::string child_fqn =
          child_name.empty()
              ? name
              : (name.empty() ? child_name : name + "." + child_name);
      const int c = Add(child.get(), child_fqn);
      nodes_[index].children.push_back(c);
    }
    nodes_[index].end = static_cast<int>(nodes_.size());
    nodes_[index].post = next_post_++;
    return index;
  }

  std::vector<Node> nodes_;
  std::map<Parameter*, std::vector<int>> users_;
  int next_post_ = 0;
};

int64_t Elements(const std::set<Parameter*>& params) {
  int64_t n = 0;
  for (Parameter* p : params) n += NumElements(p->shape);
  return n;
}

// Union-find over node indices.
class Groups {
 public:
  explicit Groups(size_t n) : parent_(n) {
    std::iota(parent_.begin(), parent_.end(), 0);
  }
  int Find(int x) {
    while (parent_[x] != x) x = parent_[x] = parent_[parent_[x]];
    return x;
  }
  void Union(int a, int b) { parent_[Find(a)] = Find(b); }

 private:
  std::vector<int> parent_;
};

// True if some parameter `tree` node `x` uses is used directly outside it.
bool Leaks(const ModuleTree& tree, int x) {
  for (Parameter* p : tree.node(x).used) {
    for (int u : tree.Users(p)) {
      if (!tree.Within(u, x)) return true;
    }
  }
  return false;
}

}  // namespace

WrapPredicate WrapModuleKinds(std::vector<std::string> kinds) {
  return [kinds = std::move(kinds)](const WrapCandidate& c) {
    return std::find(kinds.begin(), kinds.end(), c.module->kind()) !=
           kinds.end();
  };
}

WrapPredicate WrapMinParameters(int64_t min_parameters) {
  return [min_parameters](const WrapCandidate& c) {
    return c.unwrapped_parameters > 0 &&
           c.unwrapped_parameters >= min_parameters;
  };
}

absl::StatusOr<std::vector<WrapGroup>> PlanAutoWrap(
    Module* root, const WrapPredicate& predicate, TiedParameterPolicy tied) {
  if (root == nullptr) {
    return absl::InvalidArgumentError("PlanAutoWrap: null root");
  }
  if (!predicate) {
    return absl::InvalidArgumentError("PlanAutoWrap: empty predicate");
  }
  const ModuleTree tree(root);
  const int n = static_cast<int>(tree.nodes().size());

  // Ask the predicate bottom-up; `covered` = parameters under matched
  // modules strictly below a node.
  std::vector<bool> matched(n, false);
  std::vector<std::set<Parameter*>> covered(n);
  for (int i : tree.PostOrder()) {
    const ModuleTree::Node& node = tree.node(i);
    for (int c : node.children) {
      const std::set<Parameter*>& from =
          matched[c] ? tree.node(c).used : covered[c];
      covered[i].insert(from.begin(), from.end());
    }
    if (i == 0) continue;  // The root is always wrapped, last.
    WrapCandidate candidate;
    candidate.name = node.name;
    candidate.module = node.module;
    candidate.parameters = Elements(node.used);
    std::set<Parameter*> left;
    for (Parameter* p : node.used) {
      if (covered[i].count(p) == 0) left.insert(p);
    }
    candidate.unwrapped_parameters = Elements(left);
    matched[i] = predicate(candidate);
  }

  // Members of each group (by union-find representative).
  std::vector<std::vector<int>> groups;
  if (tied == TiedParameterPolicy::kLeaveToRoot) {
    for (int i : tree.PostOrder()) {
      if (matched[i] && !Leaks(tree, i)) groups.push_back({i});
    }
  } else {
    Groups uf(n);
    std::vector<bool> member = matched;
    std::vector<int> work;
    for (int i = 0; i < n; ++i) {
      if (matched[i]) work.push_back(i);
    }
    while (!work.empty()) {
      const int x = work.back();
      work.pop_back();
      for (Parameter* p : tree.node(x).used) {
        for (int u : tree.Users(p)) {
          if (tree.Within(u, x)) continue;
          uf.Union(x, u);
          if (!member[u]) {
            member[u] = true;
            work.push_back(u);
          }
        }
      }
    }
    std::map<int, std::vector<int>> by_rep;
    for (int i = 0; i < n; ++i) {
      if (member[i]) by_rep[uf.Find(i)].push_back(i);
    }
    for (auto& [rep, members] : by_rep) {
      // A group reaching the root is the root's business.
      if (std::find(members.begin(), members.end(), 0) != members.end()) {
        continue;
      }
      // Members inside other members are covered by them.
      std::vector<int> outermost;
      for (int m : members) {
        bool nested = false;
        for (int other : members) {
          if (other != m && tree.Within(m, other)) nested = true;
        }
        if (!nested) outermost.push_back(m);
      }
      groups.push_back(std::move(outermost));
    }
  }

  // Inner before outer: by the post-order position of the last member.
  auto last_post = [&](const std::vector<int>& g) {
    int post = 0;
    for (int m : g) post = std::max(post, tree.node(m).post);
    return post;
  };
  std::sort(groups.begin(), groups.end(),
            [&](const std::vector<int>& a, const std::vector<int>& b) {
              return last_post(a) < last_post(b);
            });

  std::vector<WrapGroup> plan;
  std::set<Parameter*> owned;
  for (const std::vector<int>& g : groups) {
    std::set<Parameter*> mine;
    for (int m : g) {
      for (Parameter* p : tree.node(m).used) {
        if (owned.count(p) == 0) mine.insert(p);
      }
    }
    if (mine.empty()) continue;
    owned.insert(mine.begin(), mine.end());
    WrapGroup group;
    for (int m : g) {
      group.modules.emplace_back(tree.node(m).name, tree.node(m).module);
    }
    plan.push_back(std::move(group));
  }
  return plan;
}

absl::StatusOr<std::vector<FsdpUnit*>> AutoWrap(
    Module* root, const WrapPredicate& predicate,
    const AutoWrapOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<WrapGroup> plan,
                         PlanAutoWrap(root, predicate, options.tied));
  std::vector<FsdpUnit*> units;
  for (const WrapGroup& group : plan) {
    std::vector<Module*> modules;
    std::vector<std::string> names;
    for (const auto& [name, m] : group.modules) {
      modules.push_back(m);
      names.push_back(name);
    }
    absl::StatusOr<FsdpUnit*> unit = FullyShard(modules, options.shard);
    if (!unit.ok()) {
      return Annotate(unit.status(),
                      absl::StrCat("AutoWrap: sharding [",
                                   absl::StrJoin(names, ", "), "]"));
    }
    units.push_back(*unit);
  }
  absl::StatusOr<FsdpUnit*> root_unit = FullyShard({root}, options.shard);
  if (!root_unit.ok()) {
    return Annotate(root_unit.status(), "AutoWrap: sharding the root");
  }
  units.push_back(*root_unit);
  return units;
}

absl::StatusOr<std::vector<Parameter*>> ExclusiveParameters(Module* root,
                                                            Module* module) {
  if (root == nullptr || module == nullptr) {
    return absl::InvalidArgumentError("ExclusiveParameters: null module");
  }
  const ModuleTree tree(root);
  int x = -1;
  for (size_t i = 0; i < tree.nodes().size() && x < 0; ++i) {
    if (tree.node(i).module == module) x = static_cast<int>(i);
  }
  if (x < 0) {
    return absl::NotFoundError(
        absl::StrCat("ExclusiveParameters: ", module->kind(),
                     " is not in the tree of ", root->kind()));
  }
  std::vector<Parameter*> out;
  for (auto& [fqn, p] : root->UsedParameters()) {
    if (tree.node(x).used.count(p) == 0) continue;
    bool exclusive = true;
    for (int u : tree.Users(p)) {
      if (!tree.Within(u, x)) exclusive = false;
    }
    if (exclusive) out.push_back(p);
  }
  return out;
}

absl::StatusOr<std::vector<FsdpUnit*>> ShardBlocksThenRoot(
    Module* root, const std::vector<Module*>& blocks,
    const FsdpPlanOptions& options) {
  if (root == nullptr) {
    return absl::InvalidArgumentError("ShardBlocksThenRoot: null root");
  }
  std::vector<FsdpUnit*> units;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("ShardBlocksThenRoot: block ", i, " is null"));
    }
    FullyShardOptions block_options = options.shard;
    if (i + 1 == blocks.size()) {
      block_options.reshard_after_forward =
          options.shard.reshard_after_forward &&
          options.reshard_last_block_after_forward;
    }
    absl::StatusOr<FsdpUnit*> unit = FullyShard({blocks[i]}, block_options);
    if (!unit.ok()) {
      return Annotate(unit.status(),
                      absl::StrCat("ShardBlocksThenRoot: block ", i));
    }
    units.push_back(*unit);
  }
  absl::StatusOr<FsdpUnit*> root_unit = FullyShard({root}, options.shard);
  if (!root_unit.ok()) {
    return Annotate(root_unit.status(), "ShardBlocksThenRoot: root");
  }
  units.push_back(*root_unit);
  return units;
}

}  // namespace fsdp
}  // namespace fsdpp
