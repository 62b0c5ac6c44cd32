// Sharded initialisation from a Hugging Face directory; see hf_import.h.
#include "models/parallelize/hf_import.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "formats/file_util.h"
#include "formats/json.h"
#include "formats/safetensors/safetensors.h"
#include "fsdp/fully_shard.h"
#include "models/hf_adapter.h"
#include "models/lora.h"
#include "tensor/ops.h"
#include "tensor/sharding.h"

namespace fsdpp {
namespace models {
namespace {

// How a master's box maps onto the parameter: directly (the master has the
// parameter's shape) or through a view that splits dim 0 in two
// ([k, rows / k, ...]: GPT-2's c_attn under tensor parallelism).
enum class Layout { kDirect, kSplitDim0 };

absl::StatusOr<Layout> LayoutOf(const fsdp::ShardedParameter& sp) {
  const Shape& view = sp.master.shape();
  const Shape& ours = sp.shape;
  if (view == ours) return Layout::kDirect;
  if (view.size() == ours.size() + 1 && view[0] * view[1] == ours[0] &&
      std::equal(view.begin() + 2, view.end(), ours.begin() + 1)) {
    return Layout::kSplitDim0;
  }
  return absl::UnimplementedError(
      absl::StrCat("HF import: ", sp.name, "'s master is a ",
                   ShapeToString(view), " view of its ", ShapeToString(ours),
                   " parameter, a layout this reader does not handle"));
}

}  // namespace

absl::StatusOr<HfShardedImportStats> ImportHfSharded(const HfDirectory& dir,
                                                     Transformer* model) {
  FSDPP_RETURN_IF_ERROR(dir.CheckConfig(model->config()));
  FSDPP_ASSIGN_OR_RETURN(std::vector<HfImportItem> items,
                         PlanHfImport(dir, *model));
  // A parameter's items: one, or one per expert of a stacked parameter (in
  // expert order).
  std::map<std::string, std::vector<const HfImportItem*>> by_name;
  for (const HfImportItem& item : items) {
    by_name[item.entry.ours].push_back(&item);
  }
  const std::vector<fsdp::ShardedParameter*> sharded =
      fsdp::ShardedParameters(model);
  // LoRA's adapters are not the base model's: they keep their
  // initialisation (B zero).
  std::vector<fsdp::ShardedParameter*> params;
  for (fsdp::ShardedParameter* sp : sharded) {
    if (!IsLoraParameter(sp->name)) params.push_back(sp);
  }
  if (sharded.empty()) {
    return absl::FailedPreconditionError(
        "HF import: the model is not sharded (fsdp::FullyShard first; "
        "models::ImportHfDirectory loads an unsharded one)");
  }
  std::vector<Layout> layouts;
  for (const fsdp::ShardedParameter* sp : params) {
    if (by_name.count(sp->name) == 0) {
      return absl::InternalError(absl::StrCat(
          "HF import: no tensor planned for sharded parameter ", sp->name));
    }
    FSDPP_ASSIGN_OR_RETURN(Layout layout, LayoutOf(*sp));
    layouts.push_back(layout);
  }

  HfShardedImportStats stats;
  for (size_t i = 0; i < params.size(); ++i) {
    fsdp::ShardedParameter* sp = params[i];
    const std::vector<const HfImportItem*>& its = by_name.at(sp->name);
    const HfImportItem& item = *its.front();
    const Box box = sp->master.local_box();
    Tensor* local = sp->master.mutable_local();
    const auto annotate = [&](const absl::Status& s) {
      return Annotate(s, absl::StrCat("HF import of ", sp->name, " from ",
                                      item.file->path()));
    };
    // One box of the parameter (of `shape`, as `from` names it) at a time
    // into `dst`, a [rows, ...] slice of the local master.
    const auto read_into = [&](const HfImportItem& from, const Shape& shape,
                               const Box& part, Tensor* dst) -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(Tensor buffer, ReadHfBox(from, shape, part));
      stats.bytes_read += buffer.nbytes();
      stats.largest_buffer_bytes =
          std::max<uint64_t>(stats.largest_buffer_bytes, buffer.nbytes());
      return Copy(buffer, dst);
    };
    if (box.shape[0] == 0) {
      stats.tensors += its.size();
      continue;  // This rank holds none of it (the rows ran out).
    }
    if (item.entry.expert >= 0) {
      // A stacked parameter [E, ...]: each of this rank's experts (rows of
      // dim 0) is its own HF tensor, read as the box of the other dims.
      if (layouts[i] != Layout::kDirect ||
          static_cast<int64_t>(its.size()) != sp->shape[0]) {
        return annotate(absl::InternalError(absl::StrCat(
            its.size(), " HF tensors for the ", sp->shape[0], " experts of a ",
            ShapeToString(sp->master.shape()), " master")));
      }
      const Shape one(sp->shape.begin() + 1, sp->shape.end());
      Box part;
      part.offset.assign(box.offset.begin() + 1, box.offset.end());
      part.shape.assign(box.shape.begin() + 1, box.shape.end());
      for (int64_t k = 0; k < box.shape[0]; ++k) {
        const HfImportItem& expert = *its[box.offset[0] + k];
        FSDPP_ASSIGN_OR_RETURN(Tensor row, local->Narrow(k, 1));
        FSDPP_ASSIGN_OR_RETURN(Tensor dst, row.Reshape(part.shape));
        FSDPP_RETURN_IF_ERROR(annotate(read_into(expert, one, part, &dst)));
      }
      stats.tensors += its.size();
      continue;
    }
    if (layouts[i] == Layout::kDirect) {
      // The local tensor may hold padding rows past the box (FSDP's uneven
      // last shard): they stay as they are (zeros).
      FSDPP_ASSIGN_OR_RETURN(Tensor dst, local->Narrow(0, box.shape[0]));
      FSDPP_RETURN_IF_ERROR(annotate(read_into(item, sp->shape, box, &dst)));
    } else {
      // [k, rows / k, ...]: one box of the parameter per block of dim 0. The
      // local tensor is [k', r', rest...] (r' may include FSDP's padding
      // rows past the box's): block k's rows start at row k r' of its
      // [k' r', rest...] reshape.
      const Shape& local_shape = local->shape();
      const int64_t block_rows = sp->master.shape()[1];
      Shape merged(local_shape.begin() + 1, local_shape.end());
      merged[0] = local_shape[0] * local_shape[1];
      FSDPP_ASSIGN_OR_RETURN(Tensor rows, local->Reshape(merged));
      for (int64_t k = 0; k < box.shape[0]; ++k) {
        Box part;
        part.offset.assign(box.offset.begin() + 1, box.offset.end());
        part.shape.assign(box.shape.begin() + 1, box.shape.end());
        part.offset[0] += (box.offset[0] + k) * block_rows;
        FSDPP_ASSIGN_OR_RETURN(Tensor dst,
                               rows.Narrow(k * local_shape[1], box.shape[1]));
        FSDPP_RETURN_IF_ERROR(annotate(read_into(item, sp->shape, part, &dst)));
      }
    }
    ++stats.tensors;
  }
  return stats;
}

absl::StatusOr<HfShardedImportStats> ImportPeftAdapterSharded(
    const std::string& dir, const LoraOptions& lora, Transformer* model) {
  const std::string config_path = dir + "/adapter_config.json";
  const std::string tensors_path = dir + "/adapter_model.safetensors";
  const auto bad = [&](const std::string& path, const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA adapter ", path, ": ", what));
  };
  FSDPP_ASSIGN_OR_RETURN(std::string text,
                         ReadFileToString(config_path, "PEFT adapter config"));
  absl::StatusOr<Json> config = ParseJson(text);
  if (!config.ok())
    return bad(config_path, std::string(config.status().message()));
  const Json* type = config->Find("peft_type");
  if (type != nullptr &&
      (!type->is_string() || type->string_value() != "LORA")) {
    return bad(config_path, "peft_type is not \"LORA\"");
  }
  const Json* r = config->Find("r");
  const Json* alpha = config->Find("lora_alpha");
  if (r == nullptr || !r->is_int64() || alpha == nullptr ||
      !alpha->is_number()) {
    return bad(config_path,
               "needs an integer \"r\" and a number "
               "\"lora_alpha\"");
  }
  if (r->int64_value() != lora.rank ||
      static_cast<float>(alpha->number_value()) != lora.alpha) {
    return bad(config_path,
               absl::StrCat("r ", r->int64_value(), ", lora_alpha ",
                            alpha->number_value(), ", but model.lora has rank ",
                            lora.rank, ", alpha ", lora.alpha));
  }
  FSDPP_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         SafetensorsFile::Open(tensors_path));
  FSDPP_ASSIGN_OR_RETURN(std::vector<HfNameEntry> mapping,
                         HfNameMapping(model->config()));

  // Plan: every adapter of this model in the file with its shape.
  struct Item {
    fsdp::ShardedParameter* sp;
    std::string name;
  };
  std::vector<Item> items;
  std::set<std::string> planned;
  for (fsdp::ShardedParameter* sp : fsdp::ShardedParameters(model)) {
    if (!IsLoraParameter(sp->name)) continue;
    FSDPP_ASSIGN_OR_RETURN(std::string name,
                           PeftAdapterName(mapping, sp->name));
    absl::StatusOr<SafetensorsTensorInfo> info = file->Info(name);
    if (!info.ok()) {
      return bad(tensors_path, absl::StrCat("no ", name, " for ", sp->name,
                                            " (this model's adapter)"));
    }
    if (info->shape != sp->shape) {
      return bad(tensors_path,
                 absl::StrCat(name, " is ", ShapeToString(info->shape),
                              ", the model's ", sp->name, " ",
                              ShapeToString(sp->shape)));
    }
    if (sp->master.shape().size() < sp->shape.size()) {
      return absl::UnimplementedError(
          absl::StrCat("LoRA adapter import: ", sp->name, "'s master is a ",
                       ShapeToString(sp->master.shape()), " view of its ",
                       ShapeToString(sp->shape), " parameter"));
    }
    items.push_back({sp, name});
    planned.insert(name);
  }
  if (items.empty()) {
    return absl::FailedPreconditionError(
        "LoRA adapter import: the model has no sharded adapters "
        "(models::AddLoraAdapters and fsdp::FullyShard first)");
  }
  if (model->is_whole()) {
    for (const std::string& name : file->names()) {
      if (PeftAdapterModule(name).empty()) continue;
      if (planned.count(name) == 0) {
        return bad(tensors_path,
                   absl::StrCat(name,
                                " adapts a module the model's LoRA "
                                "targets do not"));
      }
    }
  }

  HfShardedImportStats stats;
  for (const Item& item : items) {
    fsdp::ShardedParameter* sp = item.sp;
    const Box box = sp->master.local_box();
    ++stats.tensors;
    if (box.shape.empty() || box.shape[0] == 0) continue;
    const auto annotate = [&](const absl::Status& s) {
      return Annotate(s, absl::StrCat("LoRA adapter import of ", sp->name,
                                      " from ", tensors_path));
    };
    absl::StatusOr<Tensor> loaded = file->Load(item.name);
    if (!loaded.ok()) return annotate(loaded.status());
    stats.bytes_read += loaded->nbytes();
    stats.largest_buffer_bytes =
        std::max<uint64_t>(stats.largest_buffer_bytes, loaded->nbytes());
    Tensor* local = sp->master.mutable_local();
    // The whole tensor in the master's dtype and view ([3, C, r] for
    // GPT-2's fused c_attn under tensor parallelism), then this rank's box.
    absl::StatusOr<Tensor> whole =
        Tensor::Empty(sp->master.shape(), local->dtype(), Device::Cpu());
    if (!whole.ok()) return annotate(whole.status());
    absl::StatusOr<Tensor> flat = loaded->Reshape(sp->master.shape());
    if (!flat.ok()) return annotate(flat.status());
    FSDPP_RETURN_IF_ERROR(annotate(Copy(*flat, &*whole)));
    FSDPP_RETURN_IF_ERROR(annotate(CopyBox(
        *whole, box.offset, local, Shape(box.shape.size(), 0), box.shape)));
  }
  return stats;
}

}  // namespace models
}  // namespace fsdpp
