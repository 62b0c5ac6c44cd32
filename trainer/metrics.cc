#include "trainer/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/json_quote.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace fsdpp {
namespace trainer {

double UnigramLoss(const TokenStore& tokens, int64_t begin, int64_t end) {
  if (end <= begin) return 0;
  std::vector<int64_t> counts;
  double total = 0;
  std::vector<int32_t> chunk(1 << 16);
  for (int64_t at = begin; at < end;) {
    const int64_t n = std::min<int64_t>(chunk.size(), end - at);
    tokens.Read(at, n, chunk.data());
    for (int64_t i = 0; i < n; ++i) {
      if (!tokens.IsLossTarget(at + i)) continue;
      const int32_t t = chunk[i];
      if (t >= static_cast<int32_t>(counts.size())) counts.resize(t + 1, 0);
      ++counts[t];
      ++total;
    }
    at += n;
  }
  if (total == 0) return 0;
  double entropy = 0;
  for (int64_t c : counts) {
    if (c > 0) entropy -= (c / total) * std::log(c / total);
  }
  return entropy;
}

void ThroughputMeter::Add(double seconds, int64_t tokens, bool warmup) {
  if (warmup) {
    warm_seconds_ += seconds;
    warm_tokens_ += tokens;
    ++warm_steps_;
  } else {
    seconds_ += seconds;
    tokens_ += tokens;
    ++steps_;
  }
}

void ThroughputMeter::AddToLast(double seconds, bool warmup) {
  (warmup ? warm_seconds_ : seconds_) += seconds;
}

double ThroughputMeter::tokens_per_s() const {
  if (steps_ > 0) return seconds_ > 0 ? tokens_ / seconds_ : 0;
  return warm_seconds_ > 0 ? warm_tokens_ / warm_seconds_ : 0;
}

double ThroughputMeter::mean_step_s() const {
  if (steps_ > 0) return seconds_ / steps_;
  return warm_steps_ > 0 ? warm_seconds_ / warm_steps_ : 0;
}

int64_t ThroughputMeter::measured_steps() const {
  return steps_ > 0 ? steps_ : warm_steps_;
}

std::string FormatMemoryTable(const std::vector<MemoryStats>& per_rank,
                              const std::string& title) {
  struct Row {
    const char* label;
    MemoryTag tag;
  };
  static const Row kRows[] = {
      {"Parameters (sharded)", MemoryTag::kParams},
      {"Gradients (sharded)", MemoryTag::kGrads},
      {"Optimizer state", MemoryTag::kOptimizerState},
      {"Activations", MemoryTag::kActivations},
      {"Comm buffers", MemoryTag::kCommBuffers},
      {"Other", MemoryTag::kOther},
      {"Attention", MemoryTag::kAttention},
  };
  auto mib = [](int64_t bytes) {
    return absl::StrFormat("%10.2f", bytes / (1024.0 * 1024.0));
  };
  std::string header = absl::StrFormat("%-24s", "Component (MiB)");
  for (size_t r = 0; r < per_rank.size(); ++r) {
    absl::StrAppend(&header, absl::StrFormat("%10s", absl::StrCat("rank ", r)));
  }
  const std::string rule(header.size(), '-');
  std::string out = absl::StrCat(title, "\n", header, "\n", rule, "\n");
  for (const Row& row : kRows) {
    absl::StrAppend(&out, absl::StrFormat("%-24s", row.label));
    for (const MemoryStats& s : per_rank) {
      absl::StrAppend(&out, mib(s.current_of(row.tag)));
    }
    out += "\n";
  }
  absl::StrAppend(&out, rule, "\n", absl::StrFormat("%-24s", "Total"));
  for (const MemoryStats& s : per_rank)
    absl::StrAppend(&out, mib(s.total_current));
  absl::StrAppend(&out, "\n", absl::StrFormat("%-24s", "Peak (since start)"));
  for (const MemoryStats& s : per_rank)
    absl::StrAppend(&out, mib(s.total_peak));
  absl::StrAppend(&out, "\n", absl::StrFormat("%-24s", "Held from the system"));
  for (const MemoryStats& s : per_rank)
    absl::StrAppend(&out, mib(s.reserved_bytes));
  // Freed by the end of a step, so their current value says nothing there.
  for (const Row& row : {Row{"Peak activations", MemoryTag::kActivations},
                         Row{"Peak attention", MemoryTag::kAttention}}) {
    absl::StrAppend(&out, "\n", absl::StrFormat("%-24s", row.label));
    for (const MemoryStats& s : per_rank) {
      absl::StrAppend(&out, mib(s.peak_of(row.tag)));
    }
  }
  out += "\n";
  return out;
}

std::string FormatEta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrCat(s, "s");
}

std::string JsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  return absl::StrFormat("%.9g", value);
}

absl::StatusOr<std::unique_ptr<JsonlWriter>> JsonlWriter::Open(
    const std::string& path) {
  const std::string dir = DirName(path);
  if (!dir.empty()) FSDPP_RETURN_IF_ERROR(MakeDirs(dir));
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("metrics: cannot open ", path,
                     " for appending: ", std::strerror(errno)));
  }
  return std::unique_ptr<JsonlWriter>(new JsonlWriter(path, f));
}

JsonlWriter::~JsonlWriter() { std::fclose(file_); }

absl::Status JsonlWriter::Write(const std::string& json) {
  if (std::fputs(json.c_str(), file_) < 0 || std::fputc('\n', file_) < 0 ||
      std::fflush(file_) != 0) {
    return absl::DataLossError(absl::StrCat("metrics: writing ", path_,
                                            " failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

namespace {

// A JSON object built field by field, in order.
class JsonObject {
 public:
  explicit JsonObject(absl::string_view kind) {
    absl::StrAppend(&text_, "{\"kind\":", JsonQuote(kind));
  }
  JsonObject& Add(absl::string_view key, double value) {
    return Raw(key, JsonNumber(value));
  }
  JsonObject& Add(absl::string_view key, int64_t value) {
    return Raw(key, absl::StrCat(value));
  }
  JsonObject& Add(absl::string_view key, bool value) {
    return Raw(key, value ? "true" : "false");
  }
  JsonObject& Add(absl::string_view key, const std::string& value) {
    return Raw(key, JsonQuote(value));
  }
  JsonObject& Add(absl::string_view key, const std::vector<int64_t>& values) {
    return Raw(key, absl::StrCat("[", absl::StrJoin(values, ","), "]"));
  }
  std::string Done() const { return absl::StrCat(text_, "}"); }

 private:
  JsonObject& Raw(absl::string_view key, absl::string_view json) {
    absl::StrAppend(&text_, ",", JsonQuote(key), ":", json);
    return *this;
  }
  std::string text_;
};

}  // namespace

std::string ToJson(const RunRecord& r) {
  return JsonObject("run")
      .Add("model", r.model)
      .Add("world_size", int64_t{r.world_size})
      .Add("params", r.params)
      .Add("trainable_params", r.trainable_params)
      .Add("tokens_per_step", r.tokens_per_step)
      .Add("steps", r.steps)
      .Add("start_step", r.start_step)
      .Add("unigram_loss", r.unigram_loss)
      .Add("peak_tflops_per_rank", r.peak_tflops_per_rank)
      .Add("flops_per_token", r.flops_per_token)
      .Done();
}

std::string ToJson(const TrainRecord& r) {
  JsonObject o("train");
  o.Add("step", r.step)
      .Add("loss", r.loss)
      .Add("lr", r.lr)
      .Add("grad_norm", r.grad_norm)
      .Add("tokens_per_s", r.tokens_per_s)
      .Add("tokens_per_s_per_rank", r.tokens_per_s_per_rank)
      .Add("tflops_per_rank", r.tflops_per_rank)
      .Add("mfu", r.mfu)
      .Add("step_time_s", r.step_time_s)
      .Add("exposed_comm_s", r.exposed_comm_s)
      .Add("elapsed_s", r.elapsed_s)
      .Add("warmup", r.warmup);
  if (r.has_loss_scale) {
    o.Add("loss_scale", r.loss_scale).Add("skipped", r.skipped);
  }
  if (r.host_syncs >= 0) o.Add("host_syncs", r.host_syncs);
  if (!r.expert_tokens.empty()) {
    o.Add("aux_loss", r.aux_loss).Add("expert_tokens", r.expert_tokens);
  }
  return o.Done();
}

std::string ToJson(const ValidationRecord& r) {
  return JsonObject("val")
      .Add("step", r.step)
      .Add("val_loss", r.val_loss)
      .Done();
}

std::string ToJson(const ProfileRecord& r) {
  return JsonObject("profile")
      .Add("op", r.op)
      .Add("category", r.category)
      .Add("steps", r.steps)
      .Add("calls_per_step", r.calls_per_step)
      .Add("self_ms_per_step", r.self_ms_per_step)
      .Add("total_ms_per_step", r.total_ms_per_step)
      .Add("share_of_step", r.share_of_step)
      .Done();
}

std::string ToJson(const SummaryRecord& r) {
  JsonObject o("summary");
  o.Add("steps", r.steps)
      .Add("loss", r.loss)
      .Add("val_loss", r.val_loss)
      .Add("tokens_per_s", r.tokens_per_s)
      .Add("tokens_per_s_per_rank", r.tokens_per_s_per_rank)
      .Add("tflops_per_rank", r.tflops_per_rank)
      .Add("mfu", r.mfu)
      .Add("exposed_comm_s_per_step", r.exposed_comm_s_per_step)
      .Add("step_time_s", r.step_time_s);
  if (r.host_syncs >= 0) o.Add("host_syncs", r.host_syncs);
  return o.Done();
}

}  // namespace trainer
}  // namespace fsdpp
