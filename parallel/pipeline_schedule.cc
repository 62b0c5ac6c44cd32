// Pipeline schedules and their simulation; see pipeline_schedule.h.
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace fsdpp {
namespace parallel {
namespace {

using Kind = PipelineAction::Kind;

PipelineAction F(int stage, int microbatch) {
  return {Kind::kForward, stage, microbatch};
}
PipelineAction B(int stage, int microbatch) {
  return {Kind::kBackward, stage, microbatch};
}

absl::Status CheckSizes(const char* name, int ranks, int virtual_stages,
                        int microbatches) {
  if (ranks < 1 || virtual_stages < 1 || microbatches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": ranks (", ranks, "), virtual stages (", virtual_stages,
        ") and micro-batches (", microbatches, ") must be >= 1"));
  }
  return absl::OkStatus();
}

PipelineSchedule Empty(std::string name, int ranks, int virtual_stages,
                       int microbatches) {
  PipelineSchedule s;
  s.name = std::move(name);
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.microbatches = microbatches;
  s.actions.resize(ranks);
  return s;
}

}  // namespace

std::string PipelineAction::ToString() const {
  return absl::StrCat(kind == Kind::kForward ? "F" : "B", stage, ".",
                      microbatch);
}

std::string PipelineSchedule::ToString() const {
  std::string out;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> names;
    for (const PipelineAction& a : actions[r]) names.push_back(a.ToString());
    absl::StrAppend(&out, "rank ", r, ": ", absl::StrJoin(names, " "), "\n");
  }
  return out;
}

int PipelineSchedule::PeakInFlight(int rank) const {
  int in_flight = 0, peak = 0;
  for (const PipelineAction& a : actions[rank]) {
    in_flight += a.kind == Kind::kForward ? 1 : -1;
    peak = std::max(peak, in_flight);
  }
  return peak;
}

absl::StatusOr<PipelineSchedule> GPipeSchedule(int ranks, int microbatches) {
  FSDPP_RETURN_IF_ERROR(CheckSizes("GPipe", ranks, 1, microbatches));
  PipelineSchedule s = Empty("GPipe", ranks, 1, microbatches);
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < microbatches; ++i) s.actions[r].push_back(F(r, i));
    for (int i = 0; i < microbatches; ++i) s.actions[r].push_back(B(r, i));
  }
  return s;
}

absl::StatusOr<PipelineSchedule> OneFOneBSchedule(int ranks, int microbatches) {
  FSDPP_RETURN_IF_ERROR(CheckSizes("1F1B", ranks, 1, microbatches));
  if (microbatches < ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("1F1B: ", microbatches, " micro-batches for ", ranks,
                     " pipeline ranks; it needs at least one per rank"));
  }
  PipelineSchedule s = Empty("1F1B", ranks, 1, microbatches);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - 1 - r, microbatches);
    const int steady = microbatches - warmup;
    std::vector<PipelineAction>& a = s.actions[r];
    for (int i = 0; i < warmup; ++i) a.push_back(F(r, i));
    for (int i = 0; i < steady; ++i) {
      a.push_back(F(r, warmup + i));
      a.push_back(B(r, i));
    }
    for (int i = steady; i < microbatches; ++i) a.push_back(B(r, i));
  }
  return s;
}

absl::StatusOr<PipelineSchedule> Interleaved1F1BSchedule(int ranks,
                                                         int virtual_stages,
                                                         int microbatches) {
  FSDPP_RETURN_IF_ERROR(
      CheckSizes("Interleaved1F1B", ranks, virtual_stages, microbatches));
  if (microbatches % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Interleaved1F1B: ", microbatches,
        " micro-batches must be a multiple of the ", ranks,
        " pipeline ranks (they go through each rank's stages in groups)"));
  }
  const int p = ranks, v = virtual_stages, total = microbatches * v;
  PipelineSchedule s = Empty("Interleaved1F1B", p, v, microbatches);
  // The k-th forward (or backward) of a rank: its micro-batch and chunk.
  const auto microbatch = [&](int k) { return k / (p * v) * p + k % p; };
  const auto chunk = [&](int k, bool forward) {
    const int c = k % (p * v) / p;
    return forward ? c : v - 1 - c;
  };
  for (int r = 0; r < p; ++r) {
    const int warmup = microbatches == p
                           ? total
                           : std::min(total, (p - 1 - r) * 2 + (v - 1) * p);
    const int steady = total - warmup;
    std::vector<PipelineAction>& a = s.actions[r];
    auto forward = [&](int k) {
      a.push_back(F(chunk(k, true) * p + r, microbatch(k)));
    };
    auto backward = [&](int k) {
      a.push_back(B(chunk(k, false) * p + r, microbatch(k)));
    };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < steady; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = steady; k < total; ++k) backward(k);
  }
  return s;
}

absl::Status ValidateSchedule(const PipelineSchedule& s) {
  if (static_cast<int>(s.actions.size()) != s.ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.name, ": ", s.actions.size(), " action lists for ",
                     s.ranks, " ranks"));
  }
  // (kind, stage, micro-batch) -> position on its rank.
  std::map<std::tuple<int, int, int>, int> seen;
  for (int r = 0; r < s.ranks; ++r) {
    for (size_t j = 0; j < s.actions[r].size(); ++j) {
      const PipelineAction& a = s.actions[r][j];
      if (a.stage < 0 || a.stage >= s.stages() || a.microbatch < 0 ||
          a.microbatch >= s.microbatches) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.name, ": rank ", r, " runs ", a.ToString(), " out of range"));
      }
      if (s.RankOf(a.stage) != r) {
        return absl::InvalidArgumentError(
            absl::StrCat(s.name, ": rank ", r, " runs ", a.ToString(),
                         " of a stage rank ", s.RankOf(a.stage), " holds"));
      }
      const auto key =
          std::make_tuple(static_cast<int>(a.kind), a.stage, a.microbatch);
      if (!seen.emplace(key, static_cast<int>(j)).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.name, ": rank ", r, " runs ", a.ToString(), " twice"));
      }
      if (a.kind == Kind::kBackward) {
        auto f = seen.find(std::make_tuple(static_cast<int>(Kind::kForward),
                                           a.stage, a.microbatch));
        if (f == seen.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat(s.name, ": rank ", r, " runs ", a.ToString(),
                           " before its forward"));
        }
      }
    }
  }
  const size_t want = 2 * static_cast<size_t>(s.stages()) * s.microbatches;
  if (seen.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.name, ": ", seen.size(), " actions, expected ", want,
                     " (a forward and a backward per stage and micro-batch)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PipelineSimulation> Simulate(const PipelineSchedule& s,
                                            double forward_time,
                                            double backward_time) {
  FSDPP_RETURN_IF_ERROR(ValidateSchedule(s));
  if (!(forward_time > 0) || !(backward_time > 0)) {
    return absl::InvalidArgumentError(
        "Simulate: forward and backward times must be > 0");
  }
  std::map<std::tuple<int, int, int>, double> done;  // -> finish time
  const auto finished = [&](Kind k, int stage, int mb, double* t) {
    auto it = done.find(std::make_tuple(static_cast<int>(k), stage, mb));
    if (it == done.end()) return false;
    *t = std::max(*t, it->second);
    return true;
  };
  std::vector<size_t> next(s.ranks, 0);
  std::vector<double> free_at(s.ranks, 0.0);
  double busy = 0, makespan = 0;
  size_t remaining = 0;
  for (const auto& list : s.actions) remaining += list.size();
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      while (next[r] < s.actions[r].size()) {
        const PipelineAction& a = s.actions[r][next[r]];
        double start = free_at[r];
        bool ready = true;
        if (a.kind == Kind::kForward) {
          if (a.stage > 0) {
            ready = finished(Kind::kForward, a.stage - 1, a.microbatch, &start);
          }
        } else {
          ready = finished(Kind::kForward, a.stage, a.microbatch, &start);
          if (ready && a.stage + 1 < s.stages()) {
            ready =
                finished(Kind::kBackward, a.stage + 1, a.microbatch, &start);
          }
        }
        if (!ready) break;
        const double d =
            a.kind == Kind::kForward ? forward_time : backward_time;
        free_at[r] = start + d;
        busy += d;
        makespan = std::max(makespan, free_at[r]);
        done[std::make_tuple(static_cast<int>(a.kind), a.stage, a.microbatch)] =
            free_at[r];
        ++next[r];
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      std::vector<std::string> waiting;
      for (int r = 0; r < s.ranks; ++r) {
        if (next[r] < s.actions[r].size()) {
          waiting.push_back(absl::StrCat("rank ", r, " at ",
                                         s.actions[r][next[r]].ToString()));
        }
      }
      return absl::FailedPreconditionError(
          absl::StrCat(s.name, " deadlocks: ", absl::StrJoin(waiting, ", ")));
    }
  }
  PipelineSimulation sim;
  sim.makespan = makespan;
  sim.bubble = makespan > 0 ? 1.0 - busy / (s.ranks * makespan) : 0.0;
  return sim;
}

absl::StatusOr<std::vector<StageBlocks>> SplitStages(
    int blocks, int stages, const std::vector<int>& cuts) {
  if (stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("SplitStages: ", stages, " stages; at least one"));
  }
  if (blocks < stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("SplitStages: ", blocks, " blocks cannot fill ", stages,
                     " stages (each needs at least one block)"));
  }
  std::vector<int> first;  // The first block of each stage.
  if (cuts.empty()) {
    const int base = blocks / stages, extra = blocks % stages;
    for (int s = 0, b = 0; s < stages; ++s) {
      first.push_back(b);
      b += base + (s < extra ? 1 : 0);
    }
  } else {
    if (static_cast<int>(cuts.size()) != stages - 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("SplitStages: ", cuts.size(), " cut points for ", stages,
                       " stages; give ", stages - 1,
                       " (the first block of stages 1 .. ", stages - 1, ")"));
    }
    first.push_back(0);
    for (size_t i = 0; i < cuts.size(); ++i) {
      if (cuts[i] <= first.back() || cuts[i] >= blocks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SplitStages: cut point ", i, " (block ", cuts[i],
            ") must be after ", first.back(), " and before ", blocks,
            " so that every stage keeps at least one block"));
      }
      first.push_back(cuts[i]);
    }
  }
  std::vector<StageBlocks> out(stages);
  for (int s = 0; s < stages; ++s) {
    out[s].first = first[s];
    out[s].count = (s + 1 < stages ? first[s + 1] : blocks) - first[s];
    out[s].embedding = s == 0;
    out[s].head = s + 1 == stages;
  }
  return out;
}

absl::StatusOr<PipelineSchedule> MakePipelineSchedule(const std::string& name,
                                                      int ranks,
                                                      int virtual_stages,
                                                      int microbatches) {
  if (name == "interleaved") {
    if (virtual_stages < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline schedule 'interleaved' needs pp_virtual_stages >= 2, got ",
          virtual_stages));
    }
    return Interleaved1F1BSchedule(ranks, virtual_stages, microbatches);
  }
  if (name != "gpipe" && name != "1f1b") {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline schedule '", name,
                     "' is not one of gpipe, 1f1b, interleaved"));
  }
  if (virtual_stages != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline schedule '", name,
                     "' runs one stage per rank; pp_virtual_stages is ",
                     virtual_stages, " (use 'interleaved')"));
  }
  return name == "gpipe" ? GPipeSchedule(ranks, microbatches)
                         : OneFOneBSchedule(ranks, microbatches);
}

}  // namespace parallel
}  // namespace fsdpp
