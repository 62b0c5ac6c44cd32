// Loading, overriding and validating the trainer's TrainConfig (config.proto).
//
// A run's config is a text-format file (trainer/configs/*.textproto) plus
// command-line overrides ("--set training.steps=100"), checked against the
// world size before anything is built. Every problem is an absl::Status whose
// message names the place (file:line:column for the text, the dotted path for
// fields) and, where there is a closed set, the accepted values. Validation
// stops at the first problem, in the order of config.proto's sections.
//
// Paths in the config are taken as given (relative to the working
// directory); MakePathsAbsolute anchors them at the directory `bazel run`
// was invoked from, so relative paths mean what the user typed.
#ifndef FSDPP_TRAINER_CONFIG_H_
#define FSDPP_TRAINER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "models/config.h"
#include "recipe/layout.h"
#include "trainer/config.pb.h"

namespace fsdpp {
namespace trainer {

// Parses a text-format TrainConfig. `source` (a file name) starts every error
// message: InvalidArgument "SOURCE:LINE:COLUMN: PROBLEM" (1-based), unknown
// fields reported as 'unknown field "F" in SECTION (fields: ...)'.
absl::StatusOr<TrainConfig> ParseTrainConfig(absl::string_view text,
                                             absl::string_view source);

// Reads and parses the file at `path` (errors as ParseTrainConfig, plus the
// read error, e.g. NotFound).
absl::StatusOr<TrainConfig> LoadTrainConfig(const std::string& path);

// Applies one "SECTION.FIELD=VALUE" assignment (a dotted path to a scalar
// field, then the value as text: integers, numbers, true/false, or a string
// taken verbatim). InvalidArgument "--set ASSIGNMENT: PROBLEM" for a missing
// '=', an unknown path (listing the valid names at that level), a path that
// ends at a section or runs past a field, or a value of the wrong type.
absl::Status ApplyOverride(absl::string_view assignment, TrainConfig* config);

// ApplyOverride for each assignment in order; stops at the first error.
absl::Status ApplyOverrides(absl::Span<const std::string> assignments,
                            TrainConfig* config);

// What a valid config resolves to at a given world size.
struct ResolvedTrainConfig {
  models::TransformerConfig model;  // The named config with the overrides.
  // The run's layout: degrees (dp_shard inferred when the config says -1),
  // sharding, precision and the batch (seq_len the model's context length
  // when the config says 0; grad_accumulation = global_batch /
  // (data-parallel degree x micro_batch), the micro-batches of a step,
  // through the pipeline when pp > 1).
  recipe::Layout layout;
  // What the resolution took differently from the config and why (a
  // micro batch larger than a data-parallel rank's rows, pipeline
  // micro-batches raised to fill the pipeline), one line each, for the
  // trainer's header.
  std::vector<std::string> notes;
  int64_t tokens_per_step = 0;  // global_batch x seq_len.
  int32_t tokenizer_vocab_size = 0;
  // comm.timeout_s.
  absl::Duration comm_timeout = absl::Minutes(5);
};

// Checks `config` for a run on `world_size` ranks and resolves the derived
// values. InvalidArgument (NotFound for a missing dataset file) with a
// message that names the field; the checks include the layout's rules
// (recipe::Layout::Validate: divisibility, the pipeline's schedule and
// split, a sequence longer than the model's context), degrees whose product
// is not the world size, a global batch not divisible by (data-parallel
// degree x micro batch), a tokenizer with more ids than the model's
// vocabulary and a dataset file that does not exist.
absl::StatusOr<ResolvedTrainConfig> ResolveTrainConfig(
    const TrainConfig& config, int world_size);

// Whether the run's Gloo groups move their all-gathers and reduce-scatters
// through shared memory (comm.shared_memory, when every one of the
// `world_size` ranks is on this node): what the groups are told and what
// the memory plan assumes.
inline bool UsesSharedMemory(const TrainConfig& config, int ranks_per_node,
                             int world_size) {
  return config.comm().shared_memory() && ranks_per_node >= world_size;
}

// Whether data.dataset names a dataset compiled into the binary ("embedded",
// "embedded_chat") rather than a file.
inline bool IsEmbeddedDataset(absl::string_view dataset) {
  return dataset == "embedded" || dataset == "embedded_chat";
}

// ResolveTrainConfig(config, world_size).status().
absl::Status Validate(const TrainConfig& config, int world_size);

// Rewrites the relative paths in `config` (data.dataset unless "embedded",
// data.tokenizer_dir, checkpoint.folder, metrics.jsonl_path,
// metrics.trace_path; empty ones stay empty) as `base_directory`/path.
void MakePathsAbsolute(const std::string& base_directory, TrainConfig* config);

// The directory the user ran the program from: $BUILD_WORKING_DIRECTORY
// under `bazel run`, else the current directory.
std::string InvocationDirectory();

// `config` in text format, every field shown with its effective value
// (defaults included), for the run log.
std::string FormatTrainConfig(const TrainConfig& config);

}  // namespace trainer
}  // namespace fsdpp

#endif  // FSDPP_TRAINER_CONFIG_H_
