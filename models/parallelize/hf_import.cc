// Sharded initialisation from a Hugging Face directory; see hf_import.h.
#include "models/parallelize/hf_import.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "fsdp/fully_shard.h"
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
  std::map<std::string, const HfImportItem*> by_name;
  for (const HfImportItem& item : items) by_name[item.entry.ours] = &item;
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
    const HfImportItem& item = *by_name.at(sp->name);
    const Box box = sp->master.local_box();
    Tensor* local = sp->master.mutable_local();
    const auto annotate = [&](const absl::Status& s) {
      return Annotate(s, absl::StrCat("HF import of ", sp->name, " from ",
                                      item.file->path()));
    };
    // One box of the parameter at a time into `dst`, a [rows, ...] slice of
    // the local master.
    const auto read_into = [&](const Box& part, Tensor* dst) -> absl::Status {
      FSDPP_ASSIGN_OR_RETURN(Tensor buffer, ReadHfBox(item, sp->shape, part));
      stats.bytes_read += buffer.nbytes();
      stats.largest_buffer_bytes =
          std::max<uint64_t>(stats.largest_buffer_bytes, buffer.nbytes());
      return Copy(buffer, dst);
    };
    if (box.shape[0] == 0) {
      ++stats.tensors;
      continue;  // This rank holds none of it (the rows ran out).
    }
    if (layouts[i] == Layout::kDirect) {
      // The local tensor may hold padding rows past the box (FSDP's uneven
      // last shard): they stay as they are (zeros).
      FSDPP_ASSIGN_OR_RETURN(Tensor dst, local->Narrow(0, box.shape[0]));
      FSDPP_RETURN_IF_ERROR(annotate(read_into(box, &dst)));
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
        FSDPP_RETURN_IF_ERROR(annotate(read_into(part, &dst)));
      }
    }
    ++stats.tensors;
  }
  return stats;
}

}  // namespace models
}  // namespace fsdpp
