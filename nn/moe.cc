// Mixture of experts; see moe.h.
#include "nn/moe.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"
#include "nn/layer_util.h"
#include "tensor/ops.h"

namespace fsdpp {
namespace nn {
namespace {

absl::Status CpuOnly(const Tensor& x) {
  if (x.device().is_cpu()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("MoE: runs on the CPU only for now (its routing and "
                   "combine are host loops); got input on ",
                   x.device().ToString()));
}

// Calls fn(e, first, n) for each group e of `sizes` (count of them) that
// has rows: n rows from row `first` of the grouped order.
absl::Status ForEachGroup(
    const int64_t* sizes, int64_t count,
    const std::function<absl::Status(int64_t, int64_t, int64_t)>& fn) {
  int64_t first = 0;
  for (int64_t e = 0; e < count; ++e) {
    if (sizes[e] > 0) FSDPP_RETURN_IF_ERROR(fn(e, first, sizes[e]));
    first += sizes[e];
  }
  return absl::OkStatus();
}

// `v` as an i64 activation on `device` (the CPU, or meta: no values).
absl::StatusOr<Tensor> I64Activation(const std::vector<int64_t>& v,
                                     Device device) {
  FSDPP_ASSIGN_OR_RETURN(
      Tensor t, Tensor::Empty({static_cast<int64_t>(v.size())}, DType::kI64,
                              device, MemoryTag::kActivations));
  if (!t.is_meta()) std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

// One token's scores from its router logits, in double (Forward and
// Backward compute the same values; none is rounded to f32, so that
// 1 - s keeps its precision for a dominant expert).
void Scores(const float* logits, int64_t num_e, MoeScoring scoring, double* s) {
  if (scoring == MoeScoring::kSoftmax) {
    const double mx = *std::max_element(logits, logits + num_e);
    double sum = 0.0;
    for (int64_t e = 0; e < num_e; ++e) {
      s[e] = std::exp(double{logits[e]} - mx);
      sum += s[e];
    }
    for (int64_t e = 0; e < num_e; ++e) s[e] /= sum;
  } else {
    for (int64_t e = 0; e < num_e; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-double{logits[e]}));
    }
  }
}

}  // namespace

absl::Status ValidateMoeOptions(const MoeOptions& o) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("MoE options: ", what));
  };
  if (o.dim < 1) return bad(absl::StrCat("dim must be >= 1, got ", o.dim));
  if (o.hidden < 1) {
    return bad(absl::StrCat("hidden must be >= 1, got ", o.hidden));
  }
  if (o.num_experts < 1) {
    return bad(absl::StrCat("num_experts must be >= 1, got ", o.num_experts));
  }
  if (o.top_k < 1 || o.top_k > o.num_experts) {
    return bad(absl::StrCat("top_k must be in [1, num_experts = ",
                            o.num_experts, "], got ", o.top_k));
  }
  if (!(o.route_scale > 0.0f) || !std::isfinite(o.route_scale)) {
    return bad(absl::StrCat("route_scale must be finite and > 0, got ",
                            o.route_scale));
  }
  if (o.shared_hidden < 0) {
    return bad(
        absl::StrCat("shared_hidden must be >= 0, got ", o.shared_hidden));
  }
  if (!(o.aux_loss_coef >= 0.0f) || !std::isfinite(o.aux_loss_coef)) {
    return bad(absl::StrCat("aux_loss_coef must be finite and >= 0, got ",
                            o.aux_loss_coef));
  }
  if (o.aux_loss_coef > 0.0f && o.scoring != MoeScoring::kSoftmax) {
    return bad(
        "aux_loss_coef needs softmax scoring (sigmoid routers balance "
        "with the expert bias)");
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------ GroupedExperts

GroupedExperts::GroupedExperts(int64_t num_experts, int64_t dim, int64_t hidden,
                               float init_std, float down_init_std, DType dtype)
    : Module("GroupedExperts"), num_experts_(num_experts), dim_(dim) {
  gate_proj_ = AddParameter("gate_proj", {num_experts, hidden, dim},
                            InitSpec::Normal(init_std), dtype);
  up_proj_ = AddParameter("up_proj", {num_experts, hidden, dim},
                          InitSpec::Normal(init_std), dtype);
  down_proj_ = AddParameter("down_proj", {num_experts, dim, hidden},
                            InitSpec::Normal(down_init_std), dtype);
}

absl::StatusOr<Tensor> GroupedExperts::ExpertMatrix(const Tensor& w,
                                                    int64_t e) {
  FSDPP_ASSIGN_OR_RETURN(Tensor one, w.Narrow(e, 1));
  return one.Reshape({w.dim(1), w.dim(2)});
}

absl::StatusOr<Tensor> GroupedExperts::ForwardImpl(const Tensor& x) {
  if (!x.is_meta()) FSDPP_RETURN_IF_ERROR(CpuOnly(x));
  const std::vector<int64_t> sizes = std::move(pending_sizes_);
  pending_sizes_.clear();
  FSDPP_ASSIGN_OR_RETURN(Tensor rows, AsRows(x, dim_, "input"));
  const int64_t local = local_experts();
  if (static_cast<int64_t>(sizes.size()) != local) {
    return absl::FailedPreconditionError(
        absl::StrCat("GroupedExperts: SetGroupSizes gave ", sizes.size(),
                     " sizes for ", local, " experts"));
  }
  int64_t total = 0;
  for (int64_t n : sizes) {
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("GroupedExperts: negative group size ", n));
    }
    total += n;
  }
  if (total != rows.dim(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GroupedExperts: group sizes sum to ", total,
                     " but the input has ", rows.dim(0), " rows"));
  }
  const DType dtype = x.dtype();
  const int64_t m = rows.dim(0), hidden = local_hidden();
  FSDPP_ASSIGN_OR_RETURN(Tensor wg, CastTo(gate_proj_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor wu, CastTo(up_proj_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor wd, CastTo(down_proj_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor a,
                         EmptyActivation({m, hidden}, dtype, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor b,
                         EmptyActivation({m, hidden}, dtype, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor p,
                         EmptyTemporary({m, hidden}, dtype, x.device()));
  FSDPP_ASSIGN_OR_RETURN(Tensor y,
                         EmptyActivation({m, dim_}, dtype, x.device()));
  MatmulOptions nt;
  nt.transpose_b = true;
  FSDPP_RETURN_IF_ERROR(
      ForEachGroup(sizes.data(), local,
                   [&](int64_t e, int64_t first, int64_t n) -> absl::Status {
                     FSDPP_ASSIGN_OR_RETURN(Tensor xe, rows.Narrow(first, n));
                     FSDPP_ASSIGN_OR_RETURN(Tensor ae, a.Narrow(first, n));
                     FSDPP_ASSIGN_OR_RETURN(Tensor be, b.Narrow(first, n));
                     FSDPP_ASSIGN_OR_RETURN(Tensor pe, p.Narrow(first, n));
                     FSDPP_ASSIGN_OR_RETURN(Tensor ye, y.Narrow(first, n));
                     FSDPP_ASSIGN_OR_RETURN(Tensor wge, ExpertMatrix(wg, e));
                     FSDPP_ASSIGN_OR_RETURN(Tensor wue, ExpertMatrix(wu, e));
                     FSDPP_ASSIGN_OR_RETURN(Tensor wde, ExpertMatrix(wd, e));
                     FSDPP_RETURN_IF_ERROR(Matmul(xe, wge, &ae, nt));
                     FSDPP_RETURN_IF_ERROR(Matmul(xe, wue, &be, nt));
                     FSDPP_RETURN_IF_ERROR(Silu(ae, &pe));
                     FSDPP_RETURN_IF_ERROR(Mul(pe, be, &pe));
                     FSDPP_RETURN_IF_ERROR(Matmul(pe, wde, &ye, nt));
                     return absl::OkStatus();
                   }));
  saved_x_ = rows;
  saved_gate_ = a;
  saved_up_ = b;
  FSDPP_ASSIGN_OR_RETURN(saved_sizes_, I64Activation(sizes, x.device()));
  Shape out_shape = x.shape();
  return y.Reshape(std::move(out_shape));
}

absl::StatusOr<Tensor> GroupedExperts::BackwardImpl(const Tensor& dy) {
  if (!saved_x_.defined()) return NoSavedForward(kind());
  const Tensor x = saved_x_, a = saved_gate_, b = saved_up_;
  // On meta tensors the groups' matmuls have nothing to do (and the sizes
  // no values).
  const int64_t groups = x.is_meta() ? 0 : local_experts();
  const int64_t* sizes = saved_sizes_.data<int64_t>();
  const DType dtype = x.dtype();
  const int64_t m = x.dim(0), hidden = local_hidden();
  FSDPP_ASSIGN_OR_RETURN(Tensor dy_rows, AsRows(dy, dim_, "dy"));
  if (dy_rows.dim(0) != m || dy.dtype() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("GroupedExperts: dy ", dy.ToString(),
                     " does not match the forward's ", x.ToString()));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor wg, CastTo(gate_proj_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor wu, CastTo(up_proj_->data, dtype));
  FSDPP_ASSIGN_OR_RETURN(Tensor wd, CastTo(down_proj_->data, dtype));
  // Each expert's gradient matrices are written once, by its group's dW
  // (an empty group's zeroed below): a new gradient need not be zeroed first.
  FSDPP_ASSIGN_OR_RETURN(GradSink g_gate,
                         GradSink::ForWrite(gate_proj_, dtype, true));
  FSDPP_ASSIGN_OR_RETURN(GradSink g_up,
                         GradSink::ForWrite(up_proj_, dtype, true));
  FSDPP_ASSIGN_OR_RETURN(GradSink g_down,
                         GradSink::ForWrite(down_proj_, dtype, true));
  // dW (+)= dY^T X into a sink.
  const auto dw_options = [](const GradSink& sink) {
    MatmulOptions options;
    options.transpose_a = true;
    options.beta = sink.accumulate() ? 1.0f : 0.0f;
    return options;
  };
  // p = silu(a) * b again (down's input), dp = dy W_down per group.
  FSDPP_ASSIGN_OR_RETURN(Tensor p,
                         EmptyTemporary({m, hidden}, dtype, x.device()));
  FSDPP_RETURN_IF_ERROR(Silu(a, &p));
  FSDPP_RETURN_IF_ERROR(Mul(p, b, &p));
  FSDPP_ASSIGN_OR_RETURN(Tensor dp,
                         EmptyTemporary({m, hidden}, dtype, x.device()));
  FSDPP_RETURN_IF_ERROR(ForEachGroup(
      sizes, groups, [&](int64_t e, int64_t first, int64_t n) -> absl::Status {
        FSDPP_ASSIGN_OR_RETURN(Tensor dye, dy_rows.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor pe, p.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor dpe, dp.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor wde, ExpertMatrix(wd, e));
        FSDPP_ASSIGN_OR_RETURN(Tensor gde, ExpertMatrix(*g_down.target(), e));
        FSDPP_RETURN_IF_ERROR(Matmul(dye, wde, &dpe));
        FSDPP_RETURN_IF_ERROR(Matmul(dye, pe, &gde, dw_options(g_down)));
        return absl::OkStatus();
      }));
  // d up = dp * silu(a); d gate = SiluBackward(a, dp * b) (as SwiGlu).
  Tensor db = p;  // p's memory is free again
  FSDPP_RETURN_IF_ERROR(Silu(a, &db));
  FSDPP_RETURN_IF_ERROR(Mul(dp, db, &db));
  FSDPP_RETURN_IF_ERROR(Mul(dp, b, &dp));
  FSDPP_RETURN_IF_ERROR(SiluBackward(a, dp, &dp));
  const Tensor& da = dp;
  FSDPP_ASSIGN_OR_RETURN(Tensor dx,
                         EmptyTemporary({m, dim_}, dtype, x.device()));
  MatmulOptions accumulate;
  accumulate.beta = 1.0f;
  FSDPP_RETURN_IF_ERROR(ForEachGroup(
      sizes, groups, [&](int64_t e, int64_t first, int64_t n) -> absl::Status {
        FSDPP_ASSIGN_OR_RETURN(Tensor xe, x.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor dae, da.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor dbe, db.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor dxe, dx.Narrow(first, n));
        FSDPP_ASSIGN_OR_RETURN(Tensor wge, ExpertMatrix(wg, e));
        FSDPP_ASSIGN_OR_RETURN(Tensor wue, ExpertMatrix(wu, e));
        FSDPP_ASSIGN_OR_RETURN(Tensor gge, ExpertMatrix(*g_gate.target(), e));
        FSDPP_ASSIGN_OR_RETURN(Tensor gue, ExpertMatrix(*g_up.target(), e));
        FSDPP_RETURN_IF_ERROR(Matmul(dae, xe, &gge, dw_options(g_gate)));
        FSDPP_RETURN_IF_ERROR(Matmul(dbe, xe, &gue, dw_options(g_up)));
        FSDPP_RETURN_IF_ERROR(Matmul(dae, wge, &dxe));
        FSDPP_RETURN_IF_ERROR(Matmul(dbe, wue, &dxe, accumulate));
        return absl::OkStatus();
      }));
  for (int64_t e = 0; e < groups; ++e) {
    if (sizes[e] > 0) continue;
    for (GradSink* g : {&g_gate, &g_up, &g_down}) {
      if (g->accumulate()) continue;
      FSDPP_ASSIGN_OR_RETURN(Tensor empty, ExpertMatrix(*g->target(), e));
      FSDPP_RETURN_IF_ERROR(Zero(&empty));
    }
  }
  FSDPP_RETURN_IF_ERROR(g_gate.Commit());
  FSDPP_RETURN_IF_ERROR(g_up.Commit());
  FSDPP_RETURN_IF_ERROR(g_down.Commit());
  ReleaseOwnSavedTensors();
  Shape in_shape = dy.shape();
  return dx.Reshape(std::move(in_shape));
}

// ----------------------------------------------------------------------- MoE

MoE::MoE(const MoeOptions& options) : Module("MoE"), options_(options) {
  CHECK_OK(ValidateMoeOptions(options));
  gate_ =
      AddModule("gate", std::make_unique<Linear>(
                            options.dim, options.num_experts,
                            /*bias=*/false, options.init_std, options.dtype));
  experts_ = AddModule(
      "experts", std::make_unique<GroupedExperts>(
                     options.num_experts, options.dim, options.hidden,
                     options.init_std, options.down_init_std, options.dtype));
  if (options.shared_hidden > 0) {
    shared_ =
        AddModule("shared_experts",
                  std::make_unique<SwiGlu>(
                      options.dim, options.shared_hidden, options.init_std,
                      options.down_init_std, options.dtype));
  }
  if (options.expert_bias) {
    expert_bias_ = AddParameter("expert_bias", {options.num_experts},
                                InitSpec::Zeros(), DType::kF32);
    expert_bias_->requires_grad = false;
  }
  stats_.tokens.assign(options.num_experts, 0);
  load_.assign(options.num_experts, 0);
}

MoE::Stats MoE::TakeStats() {
  Stats out;
  out.tokens.assign(options_.num_experts, 0);
  std::swap(out, stats_);
  return out;
}

std::vector<int64_t> MoE::TakeLoad() {
  std::vector<int64_t> out(options_.num_experts, 0);
  std::swap(out, load_);
  return out;
}

std::vector<double> MoE::ExpertBiasUpdate(const std::vector<double>& load,
                                          double rate) {
  const double n = static_cast<double>(load.size());
  double mean = 0.0;
  for (double l : load) mean += l;
  mean /= n;
  std::vector<double> delta(load.size());
  double delta_mean = 0.0;
  for (size_t e = 0; e < load.size(); ++e) {
    delta[e] = load[e] < mean ? rate : (load[e] > mean ? -rate : 0.0);
    delta_mean += delta[e];
  }
  delta_mean /= n;
  for (double& d : delta) d -= delta_mean;
  return delta;
}

namespace {

// Even groups of `rows` over `num_e` experts: what a dry run assumes.
std::vector<int64_t> EvenSizes(int64_t rows, int64_t num_e) {
  std::vector<int64_t> sizes(num_e);
  for (int64_t e = 0; e < num_e; ++e) {
    sizes[e] = rows / num_e + (e < rows % num_e ? 1 : 0);
  }
  return sizes;
}

}  // namespace

MoE::EpRoute MoE::Route(const std::vector<int64_t>& all) const {
  const int64_t num_e = options_.num_experts, ranks = ep_->size(),
                q = ep_->rank(), local = num_e / ranks;
  EpRoute r;
  r.send_rows.assign(ranks, 0);
  r.recv_rows.assign(ranks, 0);
  r.local_sizes.assign(local, 0);
  for (int64_t d = 0; d < ranks; ++d) {
    for (int64_t l = 0; l < local; ++l) {
      r.send_rows[d] += all[q * num_e + d * local + l];
      r.recv_rows[d] += all[d * num_e + q * local + l];
      r.local_sizes[l] += all[d * num_e + q * local + l];
    }
  }
  // Where each (source, local expert) block starts among the received rows.
  std::vector<int64_t> start(ranks * local);
  int64_t at = 0;
  for (int64_t src = 0; src < ranks; ++src) {
    for (int64_t l = 0; l < local; ++l) {
      start[src * local + l] = at;
      at += all[src * num_e + q * local + l];
    }
  }
  r.from_received.reserve(at);
  for (int64_t l = 0; l < local; ++l) {
    for (int64_t src = 0; src < ranks; ++src) {
      const int64_t n = all[src * num_e + q * local + l];
      for (int64_t i = 0; i < n; ++i) {
        r.from_received.push_back(start[src * local + l] + i);
      }
    }
  }
  return r;
}

absl::StatusOr<Tensor> MoE::Gather(const Tensor& rows,
                                   const std::vector<int64_t>& index) {
  const int64_t n = static_cast<int64_t>(index.size());
  FSDPP_ASSIGN_OR_RETURN(Tensor ids,
                         Tensor::Empty({n}, DType::kI64, rows.device()));
  if (!ids.is_meta())
    std::copy(index.begin(), index.end(), ids.data<int64_t>());
  FSDPP_ASSIGN_OR_RETURN(
      Tensor out,
      EmptyTemporary({n, rows.dim(1)}, rows.dtype(), rows.device()));
  FSDPP_RETURN_IF_ERROR(Embedding(ids, rows, &out));
  return out;
}

absl::StatusOr<Tensor> MoE::Scatter(const Tensor& rows,
                                    const std::vector<int64_t>& index) {
  std::vector<int64_t> inverse(index.size());
  for (size_t i = 0; i < index.size(); ++i) inverse[index[i]] = i;
  return Gather(rows, inverse);
}

absl::StatusOr<Tensor> MoE::ThroughExperts(
    const Tensor& rows, const std::vector<int64_t>& all, MemoryTag tag,
    const std::function<absl::StatusOr<Tensor>(const EpRoute&, const Tensor&)>&
        run) {
  const int64_t c = options_.dim;
  const Device device = rows.device();
  const EpRoute r = Route(all);
  int64_t received_rows = 0;
  for (int64_t n : r.recv_rows) received_rows += n;
  FSDPP_ASSIGN_OR_RETURN(Tensor received, EmptyTemporary({received_rows, c},
                                                         rows.dtype(), device));
  FSDPP_RETURN_IF_ERROR(
      ep_->AllToAllRows(rows, r.send_rows, &received, r.recv_rows));
  FSDPP_ASSIGN_OR_RETURN(Tensor local_in, Gather(received, r.from_received));
  received = Tensor();
  FSDPP_ASSIGN_OR_RETURN(Tensor local_out, run(r, local_in));
  local_in = Tensor();
  FSDPP_ASSIGN_OR_RETURN(Tensor back, Scatter(local_out, r.from_received));
  local_out = Tensor();
  FSDPP_ASSIGN_OR_RETURN(
      Tensor out, Tensor::Empty({rows.dim(0), c}, rows.dtype(), device, tag));
  FSDPP_RETURN_IF_ERROR(
      ep_->AllToAllRows(back, r.recv_rows, &out, r.send_rows));
  return out;
}

absl::StatusOr<Tensor> MoE::RunExperts(const Tensor& grouped,
                                       const std::vector<int64_t>& sizes) {
  if (ep_ == nullptr) {
    experts_->SetGroupSizes(sizes);
    return experts_->Forward(grouped);
  }
  const int64_t num_e = options_.num_experts;
  FSDPP_ASSIGN_OR_RETURN(std::vector<int64_t> all, ep_->GatherSizes(sizes));
  if (grouped.is_meta()) all = EvenSizesOfEveryRank(grouped.dim(0));
  if (static_cast<int64_t>(all.size()) != ep_->size() * num_e) {
    return absl::InternalError(absl::StrCat(
        "MoE: expert parallelism gathered ", all.size(), " sizes for ",
        ep_->size(), " ranks of ", num_e, " experts"));
  }
  FSDPP_ASSIGN_OR_RETURN(saved_ep_sizes_, I64Activation(all, grouped.device()));
  return ThroughExperts(grouped, all, MemoryTag::kActivations,
                        [this](const EpRoute& r, const Tensor& local_in) {
                          experts_->SetGroupSizes(r.local_sizes);
                          return experts_->Forward(local_in);
                        });
}

absl::StatusOr<Tensor> MoE::RunExpertsBackward(const Tensor& d_out) {
  if (ep_ == nullptr) return experts_->Backward(d_out);
  std::vector<int64_t> all;
  if (d_out.is_meta()) {
    all = EvenSizesOfEveryRank(d_out.dim(0));
  } else {
    const int64_t* v = saved_ep_sizes_.data<int64_t>();
    all.assign(v, v + saved_ep_sizes_.numel());
  }
  return ThroughExperts(d_out, all, MemoryTag::kOther,
                        [this](const EpRoute&, const Tensor& d_local_out) {
                          return experts_->Backward(d_local_out);
                        });
}

std::vector<int64_t> MoE::EvenSizesOfEveryRank(int64_t rows) const {
  const std::vector<int64_t> even = EvenSizes(rows, options_.num_experts);
  std::vector<int64_t> all;
  for (int r = 0; r < ep_->size(); ++r) {
    all.insert(all.end(), even.begin(), even.end());
  }
  return all;
}

absl::StatusOr<Tensor> MoE::ForwardImpl(const Tensor& x) {
  if (!x.is_meta()) FSDPP_RETURN_IF_ERROR(CpuOnly(x));
  const bool meta = x.is_meta();
  const int64_t c = options_.dim, num_e = options_.num_experts,
                k = options_.top_k;
  FSDPP_ASSIGN_OR_RETURN(Tensor rows, AsRows(x, c, "input"));
  const int64_t n = rows.dim(0);
  // Sequences: the rows of [.., T, C] (one for [N, C]).
  const int64_t seq = x.ndim() >= 3 ? x.dim(x.ndim() - 2) : n;
  const int64_t num_seq = seq > 0 ? n / seq : 0;
  FSDPP_ASSIGN_OR_RETURN(Tensor logits_t, gate_->Forward(rows));
  const Device device = x.device();
  FSDPP_ASSIGN_OR_RETURN(
      Tensor topk_t,
      Tensor::Empty({n, k}, DType::kI64, device, MemoryTag::kActivations));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor position_t,
      Tensor::Empty({n, k}, DType::kI64, device, MemoryTag::kActivations));
  FSDPP_ASSIGN_OR_RETURN(
      Tensor order_t,
      Tensor::Empty({n * k}, DType::kI64, device, MemoryTag::kActivations));
  FSDPP_ASSIGN_OR_RETURN(Tensor counts_t,
                         Tensor::Empty({num_seq, num_e}, DType::kI64, device,
                                       MemoryTag::kActivations));
  std::vector<int64_t> sizes(num_e, 0);
  std::vector<float> weights;
  last_aux_loss_ = 0.0f;
  if (meta) {
    // No values: the groups as even as they can be (the sizes change no
    // allocation, which is of n k rows whatever the routing).
    sizes = EvenSizes(n * k, num_e);
  } else {
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> logits, logits_t.ToFloats());
    std::vector<float> bias(num_e, 0.0f);
    if (expert_bias_ != nullptr) {
      FSDPP_ASSIGN_OR_RETURN(bias, expert_bias_->data.ToFloats());
    }
    // Scores, the k chosen experts and their weights.
    std::vector<double> scores(n * num_e);
    int64_t* topk = topk_t.data<int64_t>();
    weights.resize(n * k);
    std::vector<int64_t> pick(num_e);
    for (int64_t t = 0; t < n; ++t) {
      double* s = &scores[t * num_e];
      Scores(&logits[t * num_e], num_e, options_.scoring, s);
      std::iota(pick.begin(), pick.end(), 0);
      std::partial_sort(pick.begin(), pick.begin() + k, pick.end(),
                        [&](int64_t i, int64_t j) {
                          const double si = s[i] + bias[i], sj = s[j] + bias[j];
                          return si > sj || (si == sj && i < j);
                        });
      double chosen = 0.0;
      for (int64_t j = 0; j < k; ++j) chosen += s[pick[j]];
      for (int64_t j = 0; j < k; ++j) {
        topk[t * k + j] = pick[j];
        const double w =
            options_.normalize_top_k ? s[pick[j]] / chosen : s[pick[j]];
        weights[t * k + j] = static_cast<float>(w * options_.route_scale);
      }
    }
    // The assignments grouped by expert (tokens in order within each).
    int64_t* counts = counts_t.data<int64_t>();
    std::fill(counts, counts + num_seq * num_e, 0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        ++sizes[topk[t * k + j]];
        ++counts[(t / seq) * num_e + topk[t * k + j]];
      }
    }
    std::vector<int64_t> next(num_e, 0);
    for (int64_t e = 1; e < num_e; ++e) next[e] = next[e - 1] + sizes[e - 1];
    int64_t* position = position_t.data<int64_t>();
    int64_t* order = order_t.data<int64_t>();
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = next[topk[t * k + j]]++;
        position[t * k + j] = row;
        order[row] = t;
      }
    }
    // The auxiliary loss: each sequence's balance, their mean.
    if (options_.aux_loss_coef > 0.0f && num_seq > 0) {
      double aux = 0.0;
      for (int64_t q = 0; q < num_seq; ++q) {
        for (int64_t e = 0; e < num_e; ++e) {
          double p_sum = 0.0;
          for (int64_t t = q * seq; t < (q + 1) * seq; ++t) {
            p_sum += scores[t * num_e + e];
          }
          aux += static_cast<double>(counts[q * num_e + e]) / (seq * k) *
                 (p_sum / seq);
        }
      }
      last_aux_loss_ =
          static_cast<float>(options_.aux_loss_coef * num_e * aux / num_seq);
    }
  }

  FSDPP_ASSIGN_OR_RETURN(Tensor grouped,
                         EmptyTemporary({n * k, c}, x.dtype(), device));
  FSDPP_RETURN_IF_ERROR(Embedding(order_t, rows, &grouped));
  FSDPP_ASSIGN_OR_RETURN(Tensor out, RunExperts(grouped, sizes));

  // y[t] = sum_j w_j out[position(t, j)] (+ shared(x)), in f32.
  Tensor y_t;
  if (meta) {
    FSDPP_ASSIGN_OR_RETURN(y_t, EmptyActivation(x.shape(), x.dtype(), device));
  } else {
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> out_f, out.ToFloats());
    const int64_t* position = position_t.data<int64_t>();
    std::vector<float> y(n * c, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      float* yt = &y[t * c];
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const float* o = &out_f[position[t * k + j] * c];
        for (int64_t i = 0; i < c; ++i) yt[i] += w * o[i];
      }
    }
    FSDPP_ASSIGN_OR_RETURN(y_t,
                           Tensor::FromFloats(x.shape(), y, x.dtype(), device,
                                              MemoryTag::kActivations));
  }
  if (shared_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(Tensor shared_out, shared_->Forward(rows));
    FSDPP_ASSIGN_OR_RETURN(Tensor shared_view, shared_out.Reshape(x.shape()));
    FSDPP_RETURN_IF_ERROR(Add(y_t, shared_view, &y_t));
  }

  saved_out_ = out;
  saved_logits_ = logits_t;
  saved_topk_ = topk_t;
  saved_position_ = position_t;
  saved_order_ = order_t;
  saved_counts_ = counts_t;
  FSDPP_ASSIGN_OR_RETURN(saved_aux_, Tensor::Empty({1}, DType::kF32, device,
                                                   MemoryTag::kActivations));
  if (!meta) saved_aux_.data<float>()[0] = last_aux_loss_;
  return y_t;
}

absl::StatusOr<Tensor> MoE::BackwardImpl(const Tensor& dy) {
  if (!saved_out_.defined()) return NoSavedForward(kind());
  const int64_t c = options_.dim, num_e = options_.num_experts,
                k = options_.top_k;
  const int64_t n = saved_topk_.dim(0);
  const int64_t num_seq = saved_counts_.dim(0);
  const int64_t seq = num_seq > 0 ? n / num_seq : 0;
  FSDPP_ASSIGN_OR_RETURN(Tensor dy_rows, AsRows(dy, c, "dy"));
  if (dy_rows.dim(0) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE: dy ", dy.ToString(),
                     " does not match the forward's ", n, " tokens"));
  }
  const DType dtype = saved_out_.dtype();
  const Device device = saved_out_.device();
  const bool meta = saved_out_.is_meta();

  // The shared experts first (the children's reverse order).
  Tensor dx;
  if (shared_ != nullptr) {
    FSDPP_ASSIGN_OR_RETURN(dx, shared_->Backward(dy_rows));
  }

  // Per token: d out[position(t, j)] = w_j dy[t] and d w_j = <dy[t],
  // out[position(t, j)]>; then d logits, through the weights (and their
  // normalisation) to the chosen scores, plus the auxiliary loss's, then
  // through softmax / sigmoid. d aux / d p_te = coef E f_qe / (T S) for
  // token t of sequence q (S sequences of T tokens), f_qe = counts_qe /
  // (T k); shifted by the constant coef / (T S) (f's mean over the experts
  // is 1 / E), which softmax's backward ignores: small exact differences, so
  // the aux-only router gradient keeps its precision.
  std::vector<float> d_out, d_logits;
  if (!meta) {
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> logits, saved_logits_.ToFloats());
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> dy_f, dy_rows.ToFloats());
    FSDPP_ASSIGN_OR_RETURN(std::vector<float> out_f, saved_out_.ToFloats());
    const int64_t* topk = saved_topk_.data<int64_t>();
    const int64_t* position = saved_position_.data<int64_t>();
    const int64_t* counts = saved_counts_.data<int64_t>();
    for (int64_t i = 0; i < num_seq * num_e; ++i) {
      stats_.tokens[i % num_e] += counts[i];
      load_[i % num_e] += counts[i];
    }
    stats_.aux_loss_sum += saved_aux_.data<float>()[0];
    ++stats_.backwards;
    const bool aux =
        options_.aux_loss_coef > 0.0f && num_seq > 0 && adds_aux_gradient_;
    d_out.resize(n * k * c);
    d_logits.assign(n * num_e, 0.0f);
    std::vector<double> s(num_e), d_score(num_e), d_weight(k);
    for (int64_t t = 0; t < n; ++t) {
      Scores(&logits[t * num_e], num_e, options_.scoring, s.data());
      const int64_t* chosen_e = &topk[t * k];
      double chosen = 0.0;
      for (int64_t j = 0; j < k; ++j) chosen += s[chosen_e[j]];
      const float* g = &dy_f[t * c];
      for (int64_t j = 0; j < k; ++j) {
        const float w = static_cast<float>((options_.normalize_top_k
                                                ? s[chosen_e[j]] / chosen
                                                : s[chosen_e[j]]) *
                                           options_.route_scale);
        const int64_t row = position[t * k + j];
        const float* o = &out_f[row * c];
        float* d = &d_out[row * c];
        double dot = 0.0;
        for (int64_t i = 0; i < c; ++i) {
          d[i] = w * g[i];
          dot += double{g[i]} * o[i];
        }
        d_weight[j] = dot;
      }
      // w_j = rs s_j / S: d s_l = rs / S (d w_l - sum_j d w_j s_j / S), in a
      // form that is exactly 0 for top-1 (s / S = 1).
      std::fill(d_score.begin(), d_score.end(), 0.0);
      double mean_dw = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        mean_dw += d_weight[j] * (s[chosen_e[j]] / chosen);
      }
      for (int64_t j = 0; j < k; ++j) {
        d_score[chosen_e[j]] +=
            options_.normalize_top_k
                ? options_.route_scale / chosen * (d_weight[j] - mean_dw)
                : options_.route_scale * d_weight[j];
      }
      float* dl = &d_logits[t * num_e];
      if (options_.scoring == MoeScoring::kSoftmax) {
        double dot = 0.0;
        for (int64_t e = 0; e < num_e; ++e) {
          if (aux) {
            const int64_t q = t / seq;
            d_score[e] += double{options_.aux_loss_coef} * aux_loss_scale_ *
                          (static_cast<double>(num_e) * counts[q * num_e + e] /
                               (seq * k) -
                           1.0) /
                          (seq * num_seq);
          }
          dot += d_score[e] * s[e];
        }
        for (int64_t e = 0; e < num_e; ++e) {
          dl[e] = static_cast<float>(s[e] * (d_score[e] - dot));
        }
      } else {
        for (int64_t e = 0; e < num_e; ++e) {
          // s' = s (1 - s), 1 - s = sigmoid(-logit) without cancellation.
          const double rest =
              1.0 / (1.0 + std::exp(double{logits[t * num_e + e]}));
          dl[e] = static_cast<float>(d_score[e] * s[e] * rest);
        }
      }
    }
  }
  Tensor d_out_t, d_logits_t;
  if (meta) {
    FSDPP_ASSIGN_OR_RETURN(d_out_t, Tensor::Empty({n * k, c}, dtype, device));
    FSDPP_ASSIGN_OR_RETURN(d_logits_t,
                           Tensor::Empty({n, num_e}, dtype, device));
  } else {
    FSDPP_ASSIGN_OR_RETURN(
        d_out_t, Tensor::FromFloats({n * k, c}, d_out, dtype, device));
    FSDPP_ASSIGN_OR_RETURN(
        d_logits_t, Tensor::FromFloats({n, num_e}, d_logits, dtype, device));
  }
  FSDPP_ASSIGN_OR_RETURN(Tensor d_grouped, RunExpertsBackward(d_out_t));
  d_out_t = Tensor();
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_routed,
                         Tensor::Zeros({n, c}, dtype, device));
  FSDPP_RETURN_IF_ERROR(EmbeddingBackward(saved_order_, d_grouped, &dx_routed));
  ReleaseOwnSavedTensors();
  FSDPP_ASSIGN_OR_RETURN(Tensor dx_gate, gate_->Backward(d_logits_t));
  FSDPP_RETURN_IF_ERROR(Add(dx_routed, dx_gate, &dx_routed));
  if (dx.defined()) FSDPP_RETURN_IF_ERROR(Add(dx_routed, dx, &dx_routed));
  Shape in_shape = dy.shape();
  return dx_routed.Reshape(std::move(in_shape));
}

}  // namespace nn
}  // namespace fsdpp
