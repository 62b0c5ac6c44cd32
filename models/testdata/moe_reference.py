"""A mixture-of-experts block in float64 PyTorch (models:moe_parity_test).

An independent reference for fsdpp's nn::MoE, written from the papers'
definitions rather than from fsdpp's code: every expert runs densely on
every token and a [tokens, experts] weight matrix that is zero off each
token's top-k combines them (fsdpp groups the tokens by expert and runs
each group alone), and autograd gives the gradients.

  scores  softmax (Switch / Mixtral / Qwen3-MoE) or sigmoid (DeepSeek-V3)
          of x Wr^T
  top-k   of scores + expert_bias (the bias selects, it never weighs)
  weights route_scale * s (/ the sum of the chosen s with "normalize")
  y       sum over the chosen e of weight * SwiGLU_e(x) + shared(x)
  aux     coef * E * sum_e f_e P_e: f_e the fraction of the N k assignments
          that chose e (no gradient), P_e the mean softmax probability

The scalar differentiated is L = sum(dy * y) + aux.

Usage:
  moe_reference.py CASE

CASE  a safetensors file with the input "x" [N, C], "dy" [N, C], the
      parameters under fsdpp's names ("gate.weight", "experts.gate_proj",
      ...), fsdpp's results "out.y", "out.dx", "grad.<name>" and, in
      __metadata__, the options (top_k, scoring, normalize, route_scale,
      aux_coef) and fsdpp's "aux" and "loss" as decimals.

Prints each compared quantity's relative difference (max |ours - ref| /
max |ref|, a scale below 1e-9 counting as 1e-9); exits 1 when any exceeds
1e-6.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from parity import read_safetensors  # noqa: E402

TOLERANCE = 1e-6
# Gradients below this are zero (a top-1 router that renormalises its
# weight gets none from the routing: w = s / s).
FLOOR = 1e-9


def relative_error(ours, reference):
    """max |ours - reference| / max(max |reference|, FLOOR)."""
    ours = ours.to(torch.float64)
    scale = max(reference.abs().max().item(), FLOOR)
    return (ours - reference).abs().max().item() / scale


def swiglu(x, gate, up, down):
    """down(silu(x gate^T) * x up^T), weights [out, in]."""
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(p, x, meta):
    num_experts = p["gate.weight"].shape[0]
    k = int(meta["top_k"])
    logits = x @ p["gate.weight"].T
    if meta["scoring"] == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    bias = p.get("expert_bias")
    select = scores + bias if bias is not None else scores
    chosen = torch.topk(select.detach(), k, dim=-1).indices
    mask = torch.zeros_like(scores).scatter(1, chosen, 1.0)
    kept = scores * mask
    if meta["normalize"] == "1":
        kept = kept / kept.sum(dim=-1, keepdim=True)
    weights = kept * float(meta["route_scale"])
    y = torch.zeros_like(x)
    for e in range(num_experts):
        out = swiglu(x, p["experts.gate_proj"][e], p["experts.up_proj"][e],
                     p["experts.down_proj"][e])
        y = y + weights[:, e:e + 1] * out
    if "shared_experts.gate.weight" in p:
        y = y + swiglu(x, p["shared_experts.gate.weight"],
                       p["shared_experts.up.weight"],
                       p["shared_experts.down.weight"])
    aux = torch.zeros((), dtype=torch.float64)
    coef = float(meta["aux_coef"])
    if coef > 0:
        fraction = mask.sum(dim=0) / (x.shape[0] * k)
        aux = coef * num_experts * (fraction * scores.mean(dim=0)).sum()
    return y, aux


def main(case_path):
    tensors, meta = read_safetensors(case_path)
    x = tensors["x"].to(torch.float64).requires_grad_(True)
    dy = tensors["dy"].to(torch.float64)
    params = {}
    for name, t in tensors.items():
        if name in ("x", "dy") or name.startswith(("out.", "grad.")):
            continue
        params[name] = t.to(torch.float64).requires_grad_(
            name != "expert_bias")
    y, aux = moe(params, x, meta)
    loss = (dy * y).sum() + aux
    loss.backward()

    rows = [("loss", relative_error(torch.tensor(float(meta["loss"])),
                                    loss.detach())),
            ("aux", abs(float(meta["aux"]) - aux.item())),
            ("y", relative_error(tensors["out.y"], y.detach())),
            ("dx", relative_error(tensors["out.dx"], x.grad))]
    for name in sorted(params):
        if name == "expert_bias":
            continue
        rows.append(("grad." + name,
                     relative_error(tensors["grad." + name],
                                    params[name].grad)))
    worst = 0.0
    for what, err in rows:
        print("%-32s %.3e" % (what, err))
        worst = max(worst, err)
    if worst > TOLERANCE:
        print("FAIL: %.3e > %.0e" % (worst, TOLERANCE))
        return 1
    print("OK: every difference <= %.0e" % TOLERANCE)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
