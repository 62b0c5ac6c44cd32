// The ckpt tool's commands; see ckpt_lib.h.
#include "tools/ckpt/ckpt_lib.h"

#include <sys/stat.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/boxes.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "checkpoint/state_dict.h"
#include "core/status.h"
#include "formats/json.h"
#include "formats/safetensors/safetensors.h"

namespace fsdpp {
namespace ckpt {
namespace {

constexpr char kBytesKey[] = "fsdpp.bytes";
constexpr char kStepKey[] = "fsdpp.step";

constexpr char kUsage[] =
    "usage: ckpt inspect [--verify] DIR\n"
    "       ckpt convert CHECKPOINT_DIR OUT.safetensors\n"
    "       ckpt convert IN.safetensors ROOT [--step=N]\n";

std::string Hex8(uint32_t v) {
  return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad8));
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

absl::Status Inspect(const std::string& dir, bool verify, std::ostream& out) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
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
    absl::Status status = reader->VerifyAll();
    if (!status.ok()) {
      out << "verify: FAILED: " << status << "\n";
      return status;
    }
    out << "verify: OK (" << chunks << " chunks, " << reader->bytes_read()
        << " bytes checked)\n";
  }
  return absl::OkStatus();
}

absl::Status ConvertToSafetensors(const std::string& dir,
                                  const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                   CheckpointReader::Open(dir));
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<std::string> byte_keys;
  for (const auto& [key, entry] : reader->metadata().entries) {
    if (entry.kind == EntryKind::kBytes) {
      ASSIGN_OR_RETURN(std::string value, reader->ReadBytes(key));
      ASSIGN_OR_RETURN(Tensor t,
                       Tensor::Empty({static_cast<int64_t>(value.size())},
                                     DType::kU8, Device::Cpu()));
      if (!value.empty()) std::memcpy(t.raw_data(), value.data(), value.size());
      tensors.emplace_back(key, std::move(t));
      byte_keys.push_back(JsonQuote(key));
    } else {
      ASSIGN_OR_RETURN(Tensor t, reader->ReadTensor(key));
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
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
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
      ASSIGN_OR_RETURN(absl::Span<const char> bytes, file->Bytes(name));
      RETURN_IF_ERROR(
          state.AddBytes(name, std::string(bytes.data(), bytes.size())));
      continue;
    }
    absl::StatusOr<Tensor> t = file->Load(name);
    if (!t.ok()) return Annotate(t.status(), path);
    RETURN_IF_ERROR(state.AddTensor(name, *std::move(t)));
  }
  ASSIGN_OR_RETURN(SaveResult saved, Save(state, root, step));
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
