// A training run's state as one checkpoint, in one call each way: the
// counterpart of torch.distributed.checkpoint's get_state_dict(model,
// optimizers) / set_state_dict for FSDP-sharded parameters and AdamW.
//
//   TrainingState training;          // after FullyShard + AdamW::Create
//   FSDPP_ASSIGN_OR_RETURN(training,
//       TrainingState::Create(fsdp::ShardedParameters(&model), &adamw));
//   training.state().AddBytes("data/position", ...);   // anything else
//   training.Save(folder, step, save_options);          // every rank
//   training.Load(folder + "/step-N");                  // resume
//
// The state holds views of the live tensors (each sharded fp32 master as
// "model/<name>", each AdamW state tensor as "optim/<name>.exp_avg" /
// ".exp_avg_sq") and AdamW's step as the bytes "optim/step": a load writes
// the masters and moments in place, at any world size, and sets the step.
#ifndef FSDPP_CHECKPOINT_TRAINING_TRAINING_STATE_H_
#define FSDPP_CHECKPOINT_TRAINING_TRAINING_STATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/state_dict.h"
#include "fsdp/fully_shard.h"
#include "optim/adamw.h"

namespace fsdpp {

// Whether a state holds the frozen parameters' masters (requires_grad
// false; AdamW has no state for them).
enum class FrozenMasters {
  kSave,  // as "model/<name>" like the others
  // The ones the caller names as frozen left out: the caller re-creates
  // them from their source (the seed's initialisation, a base model) and
  // records that source (FrozenRecord), so a LoRA run's checkpoints hold the
  // adapters and their state only. Parameters without gradients that it
  // does not name (an MoE's expert bias, which the step moves itself) are
  // saved.
  kReference,
};

// "model/<name>" for every master (but `frozen_names` under kReference) and
// "optim/<name>" for every AdamW state tensor (initialising AdamW's state if
// needed): views, so a Load into the result writes in place. What
// TrainingState holds, for callers that keep their own step (the trainer's
// "train/step").
absl::StatusOr<StateDict> ModelAndOptimizerState(
    const std::vector<fsdp::ShardedParameter*>& params, AdamW& adamw,
    FrozenMasters frozen = FrozenMasters::kSave,
    const std::vector<std::string>& frozen_names = {});

// Where a checkpoint's unsaved frozen parameters come from, as the bytes
// "train/frozen": "source: <source>" then "frozen: <name>" per parameter,
// one per line. The source is "seed <N>" (the sharded initialisation) or a
// base model ("hf:<dir>"). Empty text: nothing frozen is referenced.
inline constexpr char kFrozenKey[] = "train/frozen";
struct FrozenRecord {
  std::string source;
  std::vector<std::string> names;

  bool empty() const { return names.empty(); }
  std::string ToString() const;
  // DataLoss naming `where` for text that is not a record.
  static absl::StatusOr<FrozenRecord> Parse(const std::string& text,
                                            const std::string& where);
};

class TrainingState {
 public:
  // `params` (fsdp::ShardedParameters of the model, or several models')
  // and `adamw` (not owned) must outlive the state.
  static absl::StatusOr<TrainingState> Create(
      const std::vector<fsdp::ShardedParameter*>& params, AdamW* adamw);

  // The StateDict: add other values (the data position, an RNG) before the
  // first Save or Load; every rank must hold the same keys.
  StateDict& state() { return state_; }

  // Saves `<folder>/step-<step>` (checkpoint/checkpoint.h Save) with AdamW's
  // current step; every rank of options.mesh calls it.
  absl::StatusOr<SaveResult> Save(const std::string& folder, int64_t step,
                                  const SaveOptions& options = {});
  // Loads `dir` into the live tensors and sets AdamW's step from it.
  // DataLoss when "optim/step" is not a step count.
  absl::StatusOr<LoadResult> Load(const std::string& dir,
                                  const LoadOptions& options = {});

 private:
  TrainingState(StateDict state, AdamW* adamw)
      : state_(std::move(state)), adamw_(adamw) {}

  StateDict state_;
  AdamW* adamw_;
};

}  // namespace fsdpp

#endif  // FSDPP_CHECKPOINT_TRAINING_TRAINING_STATE_H_
