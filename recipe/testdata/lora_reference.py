"""LoRA fine-tuning of GPT-2 in float64 PyTorch (recipe:lora_parity_test).

An independent reference for fsdpp's LoRA training: its own adapters (not
PEFT's), written from the LoRA paper's definition as a merged weight, W_eff =
W + (alpha / r) B A, so autograd gives A's and B's gradients; the GPT-2
forward is models/testdata/parity.py's (OpenAI / nanoGPT's definition,
Conv1D weights [in, out]); torch.optim.AdamW on the adapters alone, the
base frozen.

Usage:
  lora_reference.py BASE ADAPTERS BATCHES RESULTS

BASE      the base model in Hugging Face names and layout.
ADAPTERS  "<HF module>.lora_A" [r, in] and ".lora_B" [out, r], the initial
          values; __metadata__: r, alpha, lr, beta1, beta2, eps,
          weight_decay and the model's hyperparameters (parity.py's).
BATCHES   "ids" and "targets" int64 [steps, B, T].
RESULTS   fsdpp's losses, comma-separated decimals in __metadata__'s
          "losses".

Prints each step's losses and their relative difference; exits 1 when any
exceeds 1e-6.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "models", "testdata"))
import parity  # noqa: E402

TOLERANCE = 1e-6


def main(base_path, adapters_path, batches_path, results_path):
    torch.set_default_dtype(torch.float64)
    base, _ = parity.read_safetensors(base_path)
    base = {k: v.to(torch.float64) for k, v in base.items()}
    init, meta = parity.read_safetensors(adapters_path)
    hp = parity.hyperparameters(meta)
    scale = float(meta["alpha"]) / float(meta["r"])
    modules = sorted({k[:-len(".lora_A")] for k in init if k.endswith(".lora_A")})
    adapters = {}
    for m in modules:
        for part in ("lora_A", "lora_B"):
            t = init[m + "." + part].to(torch.float64).clone()
            adapters[m + "." + part] = t.requires_grad_(True)
    opt = torch.optim.AdamW(list(adapters.values()), lr=float(meta["lr"]),
                            betas=(float(meta["beta1"]), float(meta["beta2"])),
                            eps=float(meta["eps"]),
                            weight_decay=float(meta["weight_decay"]))
    batches, _ = parity.read_safetensors(batches_path)
    _, results = parity.read_safetensors(results_path)
    ours = torch.tensor([float(v) for v in results["losses"].split(",")])
    worst = 0.0
    for step in range(batches["ids"].shape[0]):
        w = dict(base)
        for m in modules:
            delta = scale * adapters[m + ".lora_B"] @ adapters[m + ".lora_A"]
            # Conv1D stores [in, out]: the delta [out, in] transposed.
            w[m + ".weight"] = base[m + ".weight"] + delta.t()
        ids = batches["ids"][step].long()
        targets = batches["targets"][step].long()
        logits = parity.gpt2_logits(w, ids, hp)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               targets.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        diff = abs(ours[step].item() - loss.item()) / abs(loss.item())
        worst = max(worst, diff)
        print("step %d: loss fsdpp %.9f reference %.9f rel %.3g" %
              (step + 1, ours[step].item(), loss.item(), diff))
    print("worst relative loss difference %.3g (bound %g)" % (worst, TOLERANCE))
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
