// The ckpt tool's commands; see ckpt_lib.h.
#include "tools/ckpt/ckpt_lib.h"

#include <sys/stat.h>

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "checkpoint/boxes.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/training/training_state.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "formats/safetensors/safetensors.h"
#include "models/config.h"
#include "models/hf_adapter.h"
#include "models/hf_directory.h"
#include "models/lora.h"
#include "models/transformer.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace ckpt {
namespace {

constexpr char kBytesKey[] = "fsdpp.bytes";
constexpr char kStepKey[] = "fsdpp.step";

constexpr char kUsage[] =
    "usage: ckpt inspect [--verify] DIR\n"
    "       ckpt convert CHECKPOINT_DIR OUT.safetensors\n"
    "       ckpt convert IN.safetensors ROOT [--step=N]\n"
    "       ckpt export CHECKPOINT_DIR OUT_DIR --format=hf|peft "
    "[--dtype=f32|bf16|f16]\n"
    "            [--max_shard_mb=N] [--model=NAME] [--tokenizer_dir=DIR]\n"
    "            [--base_model=hf:DIR]\n"
    "         a Hugging Face model directory (config.json, safetensors "
    "shards,\n"
    "         index); --model only for checkpoints without train/model;\n"
    "         --base_model: where frozen parameters come from when their\n"
    "         recorded source (model.init_from) has moved; a LoRA run's\n"
    "         checkpoint exports merged (hf) or its adapters alone (peft:\n"
    "         adapter_config.json, adapter_model.safetensors)\n"
    "       ckpt import HF_DIR ROOT [--model=NAME] [--step=N]\n"
    "         a Hugging Face model directory as checkpoint ROOT/step-N (the\n"
    "         model config.json describes, or the zoo's NAME checked against\n"
    "         it)\n";

// Fills `model` (materialised on the CPU) from a frozen record's source:
// "seed N" (the initialisation, bitwise the sharded one of the run) or
// "hf:DIR" (the base model the run started from).
absl::Status LoadFrozenSource(const std::string& source,
                              models::Transformer* model) {
  uint64_t seed = 0;
  if (absl::StartsWith(source, "seed ") &&
      absl::SimpleAtoi(source.substr(5), &seed)) {
    return model->InitWeights(seed);
  }
  if (absl::StartsWith(source, "hf:") && source.size() > 3) {
    FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::HfDirectory> base,
                           models::HfDirectory::Open(source.substr(3)));
    return models::ImportHfDirectory(*base, model);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the source \"", source, "\" is neither \"seed N\" nor \"hf:DIR\""));
}

// A LoRA model's adapters in PEFT's layout: adapter_config.json (the
// adapted modules by their full HF names) and adapter_model.safetensors
// ("base_model.model.<HF module>.lora_A.weight" [r, in] and lora_B [out,
// r]).
absl::StatusOr<std::vector<std::string>> ExportPeft(
    const models::Transformer& model, const models::LoraOptions& lora,
    const std::string& base, const std::string& out_dir,
    const HfExportOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(std::vector<models::HfNameEntry> mapping,
                         models::HfNameMapping(model.config()));
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<std::string> modules;
  for (const auto& [name, p] : model.NamedParameters()) {
    if (!models::IsLoraParameter(name)) continue;
    absl::StatusOr<std::string> peft = models::PeftAdapterName(mapping, name);
    if (!peft.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("export: ", peft.status().message()));
    }
    const std::string hf_module = models::PeftAdapterModule(*peft);
    if (modules.empty() || modules.back() != hf_module) {
      modules.push_back(hf_module);
    }
    FSDPP_ASSIGN_OR_RETURN(
        Tensor t, Tensor::Empty(p->data.shape(), options.dtype, Device::Cpu()));
    FSDPP_RETURN_IF_ERROR(Copy(p->data, &t));
    tensors.emplace_back(*peft, t);
  }
  FSDPP_RETURN_IF_ERROR(MakeDirs(out_dir));
  FSDPP_RETURN_IF_ERROR(WriteSafetensors(out_dir + "/adapter_model.safetensors",
                                         tensors, {{"format", "pt"}}));
  std::vector<std::string> quoted;
  for (const std::string& m : modules) quoted.push_back(JsonQuote(m));
  const bool gpt2 = model.config().family == models::ModelFamily::kGpt2;
  const std::string config = absl::StrCat(
      "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": \"CAUSAL_LM\",\n"
      "  \"r\": ",
      lora.rank, ",\n  \"lora_alpha\": ", absl::StrFormat("%.9g", lora.alpha),
      ",\n  \"lora_dropout\": ", absl::StrFormat("%.7g", lora.dropout),
      ",\n  \"bias\": \"none\",\n"
      "  \"fan_in_fan_out\": ",
      gpt2 ? "true" : "false", ",\n  \"target_modules\": [",
      absl::StrJoin(quoted, ", "), "],\n  \"base_model_name_or_path\": ",
      JsonQuote(absl::StartsWith(base, "hf:") ? base.substr(3) : ""),
      ",\n  \"inference_mode\": true\n}\n");
  FSDPP_RETURN_IF_ERROR(
      WriteFileDurably(out_dir + "/adapter_config.json", config));
  return std::vector<std::string>{"adapter_config.json",
                                  "adapter_model.safetensors"};
}

std::string Hex8(uint32_t v) {
  return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad8));
}

}  // namespace

absl::Status Inspect(const std::string& dir, bool verify, std::ostream& out) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                         CheckpointReader::Open(dir));
  const CheckpointMetadata& m = reader->metadata();
  size_t chunks = 0;
  for (const auto& [key, entry] : m.entries) chunks += entry.chunks.size();
  out << "checkpoint " << reader->dir() << "\n"
      << "  format version " << kCheckpointFormatVersion << ", step " << m.step
      << ", saved by " << m.world_size << " rank(s), crc block "
      << m.block_bytes << " bytes\n"
      << "  " << m.entries.size() << " keys, " << chunks << " chunks, "
      << m.TotalBytes() << " bytes in " << m.files.size() << " file(s)\n";
  std::map<int64_t, uint64_t> per_file;
  for (const auto& [key, entry] : m.entries) {
    for (const ChunkMetadata& c : entry.chunks) per_file[c.file] += c.length;
  }
  for (size_t f = 0; f < m.files.size(); ++f) {
    struct stat st;
    const std::string path = absl::StrCat(reader->dir(), "/", m.files[f]);
    const std::string on_disk = ::stat(path.c_str(), &st) == 0
                                    ? absl::StrCat(st.st_size, " bytes on disk")
                                    : std::string("MISSING");
    out << "  file " << m.files[f] << ": " << per_file[f]
        << " bytes of chunks, " << on_disk << "\n";
  }
  for (const auto& [key, entry] : m.entries) {
    out << "  " << absl::CHexEscape(key) << "  " << EntryKindName(entry.kind)
        << " " << DTypeName(entry.dtype) << ShapeToString(entry.shape) << "  "
        << entry.nbytes() << " bytes, " << entry.chunks.size() << " chunk(s)\n";
    for (const ChunkMetadata& c : entry.chunks) {
      out << "    " << BoxToString(c.box) << " -> " << m.files[c.file] << " @"
          << c.byte_offset << " +" << c.length << " crc32c " << Hex8(c.crc32c)
          << " (" << c.block_crc32c.size() << " block(s))\n";
    }
  }
  if (verify) {
    std::map<std::string, int64_t> non_finite;
    absl::Status status = reader->VerifyAll(&non_finite);
    if (!status.ok()) {
      out << "verify: FAILED: " << status << "\n";
      return status;
    }
    if (!non_finite.empty()) {
      // Intact bytes, but values no training can resume from.
      std::string keys;
      for (const auto& [key, count] : non_finite) {
        out << "non-finite: " << key << ": " << count
            << " value(s) are inf or NaN\n";
        absl::StrAppend(&keys, keys.empty() ? "" : ", ", key);
      }
      out << "verify: FAILED: " << non_finite.size()
          << " key(s) hold inf or NaN: " << keys << "\n";
      return absl::DataLossError(absl::StrCat(
          dir, ": ", non_finite.size(), " key(s) hold inf or NaN: ", keys));
    }
    out << "verify: OK (" << chunks << " chunks, " << reader->bytes_read()
        << " bytes checked, every float finite)\n";
  }
  return absl::OkStatus();
}

absl::Status ConvertToSafetensors(const std::string& dir,
                                  const std::string& path) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                         CheckpointReader::Open(dir));
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<std::string> byte_keys;
  for (const auto& [key, entry] : reader->metadata().entries) {
    if (entry.kind == EntryKind::kBytes) {
      FSDPP_ASSIGN_OR_RETURN(std::string value, reader->ReadBytes(key));
      FSDPP_ASSIGN_OR_RETURN(Tensor t,
                             Tensor::Empty({static_cast<int64_t>(value.size())},
                                           DType::kU8, Device::Cpu()));
      if (!value.empty()) std::memcpy(t.raw_data(), value.data(), value.size());
      tensors.emplace_back(key, std::move(t));
      byte_keys.push_back(JsonQuote(key));
    } else {
      FSDPP_ASSIGN_OR_RETURN(Tensor t, reader->ReadTensor(key));
      tensors.emplace_back(key, std::move(t));
    }
  }
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {kStepKey, absl::StrCat(reader->metadata().step)},
  };
  if (!byte_keys.empty()) {
    metadata[kBytesKey] = absl::StrCat("[", absl::StrJoin(byte_keys, ","), "]");
  }
  return WriteSafetensors(path, tensors, metadata);
}

absl::StatusOr<std::string> ConvertFromSafetensors(const std::string& path,
                                                   const std::string& root,
                                                   int64_t step) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         SafetensorsFile::Open(path));
  std::set<std::string> byte_keys;
  auto it = file->metadata().find(kBytesKey);
  if (it != file->metadata().end()) {
    absl::StatusOr<Json> json = ParseJson(it->second);
    if (!json.ok() || !json->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": metadata '", kBytesKey, "' is not a JSON array of names"));
    }
    for (const Json& name : json->array_value()) {
      if (!name.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": metadata '", kBytesKey, "' holds a non-string"));
      }
      byte_keys.insert(name.string_value());
    }
  }
  if (step < 0) {
    step = 0;
    auto s = file->metadata().find(kStepKey);
    if (s != file->metadata().end() && !absl::SimpleAtoi(s->second, &step)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad '", kStepKey, "' metadata ", s->second));
    }
  }
  StateDict state;
  for (const std::string& name : file->names()) {
    if (byte_keys.count(name) != 0) {
      FSDPP_ASSIGN_OR_RETURN(absl::Span<const char> bytes, file->Bytes(name));
      FSDPP_RETURN_IF_ERROR(
          state.AddBytes(name, std::string(bytes.data(), bytes.size())));
      continue;
    }
    absl::StatusOr<Tensor> t = file->Load(name);
    if (!t.ok()) return Annotate(t.status(), path);
    FSDPP_RETURN_IF_ERROR(state.AddTensor(name, *std::move(t)));
  }
  FSDPP_ASSIGN_OR_RETURN(SaveResult saved, Save(state, root, step));
  return saved.path;
}

namespace {

// The directory of GPT-2 BPE files of a run whose train/config (text
// format, as the trainer wrote it) uses data.tokenizer "gpt2"; "" otherwise.
std::string Gpt2TokenizerDirOf(const std::string& train_config) {
  // One field per line, as FormatTrainConfig writes them.
  bool gpt2 = false;
  std::string dir;
  for (absl::string_view line : absl::StrSplit(train_config, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line == "tokenizer: \"gpt2\"") gpt2 = true;
    if (absl::ConsumePrefix(&line, "tokenizer_dir: \"") &&
        absl::ConsumeSuffix(&line, "\"")) {
      dir = std::string(line);
    }
  }
  if (!gpt2) return "";
  return dir.empty() ? "/usr/local/share/fsdpp/gpt2" : dir;
}

// The model config a checkpoint records, or the zoo's `model_name` for one
// that does not.
absl::StatusOr<models::TransformerConfig> CheckpointModelConfig(
    CheckpointReader& reader, const std::string& model_name) {
  const auto& entries = reader.metadata().entries;
  if (entries.count(models::kModelConfigKey) != 0) {
    if (!model_name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          reader.dir(), " records its model (", models::kModelConfigKey,
          "); --model applies only to checkpoints without it"));
    }
    FSDPP_ASSIGN_OR_RETURN(std::string json,
                           reader.ReadBytes(models::kModelConfigKey));
    return models::ParseModelConfigJson(
        json, absl::StrCat(reader.dir(), ":", models::kModelConfigKey));
  }
  if (model_name.empty()) {
    return absl::NotFoundError(
        absl::StrCat(reader.dir(), " does not record its model (no ",
                     models::kModelConfigKey,
                     ": written before fsdpp kept it); pass --model=NAME (",
                     absl::StrJoin(models::ConfigNames(), ", "), ")"));
  }
  return models::ConfigByName(model_name);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExportHf(
    const std::string& dir, const std::string& out_dir,
    const HfExportOptions& options) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                         CheckpointReader::Open(dir));
  FSDPP_ASSIGN_OR_RETURN(const models::TransformerConfig config,
                         CheckpointModelConfig(*reader, options.model));
  // Header checks first (the HF layout exists for this model).
  FSDPP_RETURN_IF_ERROR(models::HfConfigJson(config, options.dtype).status());
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> model,
                         models::Transformer::Create(config));
  const auto& entries = reader->metadata().entries;
  const bool peft = options.format == "peft";
  if (!peft && options.format != "hf") {
    return absl::InvalidArgumentError(absl::StrCat(
        "export format \"", options.format, "\" is not hf or peft"));
  }
  std::optional<models::LoraOptions> lora;
  if (entries.count(models::kLoraKey) != 0) {
    FSDPP_ASSIGN_OR_RETURN(const std::string text,
                           reader->ReadBytes(models::kLoraKey));
    if (!text.empty()) {
      FSDPP_ASSIGN_OR_RETURN(lora, models::ParseLoraJson(text, dir));
      FSDPP_RETURN_IF_ERROR(
          models::AddLoraAdapters(model.get(), *lora).status());
    }
  }
  if (peft && !lora.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is not a LoRA run's checkpoint (no ",
                     models::kLoraKey, "): export it with --format=hf"));
  }
  FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
  FrozenRecord frozen;
  if (entries.count(kFrozenKey) != 0) {
    FSDPP_ASSIGN_OR_RETURN(const std::string text,
                           reader->ReadBytes(kFrozenKey));
    FSDPP_ASSIGN_OR_RETURN(frozen, FrozenRecord::Parse(text, dir));
  }
  const std::set<std::string> frozen_names(frozen.names.begin(),
                                           frozen.names.end());
  std::vector<std::string> missing;
  for (const auto& [name, p] : model->NamedParameters()) {
    if (entries.count("model/" + name) == 0 && !frozen_names.count(name)) {
      missing.push_back("model/" + name);
    }
  }
  if (!missing.empty()) {
    return absl::NotFoundError(
        absl::StrCat(dir, " lacks the model's parameters ",
                     absl::StrJoin(missing, ", "), " (is it a checkpoint of ",
                     config.name.empty() ? "this model" : config.name, "?)"));
  }
  if (!frozen.empty() && !peft) {
    FSDPP_RETURN_IF_ERROR(Annotate(
        LoadFrozenSource(
            options.base_model.empty() ? frozen.source : options.base_model,
            model.get()),
        absl::StrCat(dir, ": its frozen parameters (", kFrozenKey, ")")));
  }
  for (const auto& [name, p] : model->NamedParameters()) {
    const std::string key = "model/" + name;
    if (frozen_names.count(name) || (peft && !models::IsLoraParameter(name))) {
      continue;
    }
    FSDPP_ASSIGN_OR_RETURN(Tensor t, reader->ReadTensor(key));
    if (t.numel() != p->data.numel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir, ": ", key, " is ", ShapeToString(t.shape()), ", the model's ",
          name, " is ", ShapeToString(p->data.shape())));
    }
    // Tensor-parallel checkpoints may hold a view with one dim split in two
    // (the same elements in the same order).
    FSDPP_ASSIGN_OR_RETURN(t, t.Reshape(p->data.shape()));
    FSDPP_RETURN_IF_ERROR(Copy(t, &p->data));
  }
  if (peft) return ExportPeft(*model, *lora, frozen.source, out_dir, options);
  if (lora.has_value()) {
    FSDPP_RETURN_IF_ERROR(models::MergeLoraAdapters(model.get()).status());
  }
  FSDPP_ASSIGN_OR_RETURN(auto tensors, models::ExportHfTensors(*model));
  models::HfWriteOptions wo;
  wo.dtype = options.dtype;
  wo.max_shard_bytes = options.max_shard_bytes;
  std::string tokenizer_dir = options.tokenizer_dir;
  if (tokenizer_dir.empty() && entries.count("train/config") != 0) {
    FSDPP_ASSIGN_OR_RETURN(const std::string train_config,
                           reader->ReadBytes("train/config"));
    tokenizer_dir = Gpt2TokenizerDirOf(train_config);
  }
  if (!tokenizer_dir.empty()) {
    // HF's GPT-2 tokenizer files are OpenAI's, renamed.
    for (const auto& [ours, theirs] :
         {std::pair<std::string, std::string>{"encoder.json", "vocab.json"},
          std::pair<std::string, std::string>{"vocab.bpe", "merges.txt"}}) {
      FSDPP_ASSIGN_OR_RETURN(
          std::string contents,
          ReadFileToString(tokenizer_dir + "/" + ours, "GPT-2 tokenizer file"));
      wo.extra_files.emplace_back(theirs, std::move(contents));
    }
  }
  return models::WriteHfDirectory(out_dir, config, tensors, wo);
}

absl::StatusOr<std::string> ImportHf(const std::string& hf_dir,
                                     const std::string& root,
                                     const std::string& model_name,
                                     int64_t step) {
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::HfDirectory> dir,
                         models::HfDirectory::Open(hf_dir));
  FSDPP_ASSIGN_OR_RETURN(const std::string config_json,
                         dir->RequireConfigJson());
  models::TransformerConfig config;
  if (model_name.empty()) {
    FSDPP_ASSIGN_OR_RETURN(
        config, models::ConfigFromHfJson(dir->config_json(), "hf",
                                         absl::StrCat(hf_dir, "/config.json")));
  } else {
    FSDPP_ASSIGN_OR_RETURN(config, models::ConfigByName(model_name));
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<models::Transformer> model,
                         models::Transformer::Create(config));
  FSDPP_RETURN_IF_ERROR(model->ToEmpty(Device::Cpu()));
  FSDPP_RETURN_IF_ERROR(models::ImportHfDirectory(*dir, model.get()));
  StateDict state;
  for (const auto& [name, p] : model->NamedParameters()) {
    FSDPP_RETURN_IF_ERROR(state.AddTensor("model/" + name, p->data));
  }
  FSDPP_RETURN_IF_ERROR(
      state.AddBytes(models::kModelConfigKey, models::ModelConfigJson(config)));
  FSDPP_ASSIGN_OR_RETURN(SaveResult saved,
                         Save(state, root, step < 0 ? 0 : step));
  return saved.path;
}

const char* Usage() { return kUsage; }

int Run(const std::vector<std::string>& args, const Flags& flags,
        std::ostream& out, std::ostream& err) {
  auto usage = [&](const std::string& problem) {
    err << "ckpt: " << problem << "\n" << kUsage;
    return 2;
  };
  if (args.empty()) return usage("no command");
  const std::string command = args[0];
  absl::Status status;
  if (command == "inspect") {
    if (flags.step != -1) return usage("--step applies to convert");
    if (args.size() != 2) return usage("inspect takes one directory");
    status = Inspect(args[1], flags.verify, out);
  } else if (command == "convert") {
    const int64_t step = flags.step;
    if (flags.verify) return usage("--verify applies to inspect");
    if (step < -1) return usage(absl::StrCat("bad --step ", step));
    if (args.size() != 3) return usage("convert takes SRC and DST");
    if (IsDirectory(args[1])) {
      if (step >= 0)
        return usage("--step applies to safetensors -> checkpoint");
      status = ConvertToSafetensors(args[1], args[2]);
      if (status.ok()) out << "wrote " << args[2] << "\n";
    } else {
      absl::StatusOr<std::string> dir =
          ConvertFromSafetensors(args[1], args[2], step);
      status = dir.status();
      if (dir.ok()) out << "wrote " << *dir << "\n";
    }
  } else if (command == "import") {
    if (flags.verify) return usage("--verify applies to inspect");
    if (flags.step < -1) return usage(absl::StrCat("bad --step ", flags.step));
    if (args.size() != 3) return usage("import takes HF_DIR and ROOT");
    absl::StatusOr<std::string> saved =
        ImportHf(args[1], args[2], flags.model, flags.step);
    status = saved.status();
    if (saved.ok()) out << "wrote " << *saved << "\n";
  } else if (command == "export") {
    if (flags.verify || flags.step != -1) {
      return usage("--verify and --step do not apply to export");
    }
    if (args.size() != 3) return usage("export takes CHECKPOINT_DIR OUT_DIR");
    if (flags.format != "hf" && flags.format != "peft") {
      return usage(absl::StrCat("export needs --format=hf or peft (got \"",
                                flags.format, "\")"));
    }
    HfExportOptions options;
    options.model = flags.model;
    options.tokenizer_dir = flags.tokenizer_dir;
    options.base_model = flags.base_model;
    options.format = flags.format;
    absl::StatusOr<DType> dtype = ParseDType(flags.dtype);
    if (!dtype.ok() || !IsFloatingPoint(*dtype)) {
      return usage(
          absl::StrCat("--dtype=", flags.dtype, " is not f32, bf16 or f16"));
    }
    options.dtype = *dtype;
    if (flags.max_shard_mb <= 0) {
      return usage(absl::StrCat("--max_shard_mb=", flags.max_shard_mb,
                                " must be positive"));
    }
    options.max_shard_bytes = static_cast<uint64_t>(flags.max_shard_mb) << 20;
    absl::StatusOr<std::vector<std::string>> files =
        ExportHf(args[1], args[2], options);
    status = files.status();
    if (files.ok()) {
      out << "wrote " << args[2] << ": " << absl::StrJoin(*files, ", ") << "\n";
    }
  } else {
    return usage(absl::StrCat("unknown command '", command, "'"));
  }
  if (!status.ok()) {
    err << "ckpt: " << status << "\n";
    return 1;
  }
  return 0;
}

}  // namespace ckpt
}  // namespace fsdpp
