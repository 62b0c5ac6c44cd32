"""LoRA fine-tuning of GPT-2 in float64 PyTorch (recipe:lora_parity_test).

An independent reference for fsdpp's LoRA training: its own adapters (not
PEFT's), written from the LoRA paper's definition beside each frozen base
projection, y = x W + b + (alpha / r) dropout(x) A^T B^T, so autograd gives
A's and B's gradients; the dropout masks computed here from their keys
(Philox4x32-10, its own implementation; nn/dropout.h's rule); the GPT-2
forward is models/testdata/parity.py's (OpenAI / nanoGPT's definition,
Conv1D weights [in, out]); torch.optim.AdamW on the adapters alone, the
base frozen.

Usage:
  lora_reference.py BASE ADAPTERS BATCHES RESULTS

BASE      the base model in Hugging Face names and layout.
ADAPTERS  "<HF module>.lora_A" [r, in] and ".lora_B" [out, r], the initial
          values; __metadata__: r, alpha, lr, beta1, beta2, eps,
          weight_decay and the model's hyperparameters (parity.py's).
BATCHES   "ids" and "targets" int64 [steps, B, T], "row_keys" int64
          [steps, B] (each row's dropout key); __metadata__ of ADAPTERS
          also has "dropout" (PEFT's lora_dropout, applied to the adapter's
          input) and "key:<HF module>" (each layer's dropout key).
RESULTS   fsdpp's losses, comma-separated decimals in __metadata__'s
          "losses".

Prints each step's losses and their relative difference; exits 1 when any
exceeds 1e-6.
"""

import os
import sys

import struct

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "models", "testdata"))
import parity  # noqa: E402

TOLERANCE = 1e-6
MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF


def mul_hi_lo(a, b):
    """The high and low 32-bit words of a b for a constant a < 2^32 and an
    int64 tensor b of values < 2^32, without overflowing int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    high, low = a_hi * b, a_lo * b  # each < 2^48
    return ((high + (low >> 16)) >> 16,
            (((high & 0xFFFF) << 16) + low) & MASK32)


def philox_uniform(seed, stream, index):
    """Philox4x32-10 (Salmon et al., SC'11) as the uniform [0, 1) with 24
    bits of element `index` (an int64 tensor) of stream `stream` under
    `seed`: counter (index / 4, stream), key the seed, lane index % 4."""
    block = index // 4
    c = [block & MASK32, block >> 32,
         torch.full_like(block, stream & MASK32),
         torch.full_like(block, stream >> 32)]
    k0, k1 = seed & MASK32, seed >> 32
    for _ in range(10):
        hi0, lo0 = mul_hi_lo(0xD2511F53, c[0])
        hi1, lo1 = mul_hi_lo(0xCD9E8D57, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + 0x9E3779B9) & MASK32
        k1 = (k1 + 0xBB67AE85) & MASK32
    bits = torch.stack(c).gather(0, (index % 4).unsqueeze(0))[0]
    return (bits >> 8).to(torch.float64) / 16777216.0


def dropout(x, p, layer_key, row_keys):
    """Inverted dropout of x [B, T, F] whose element (b, t, f) is kept when
    the Philox uniform of (layer_key; row_keys[b]; t F + f) is >= p (p and
    the scale 1 / (1 - p) in f32, as fsdpp takes them)."""
    if p == 0:
        return x
    b, t, f = x.shape
    index = torch.arange(t * f, dtype=torch.int64)
    p32 = struct.unpack("f", struct.pack("f", p))[0]
    keep = torch.stack([philox_uniform(layer_key, key, index) >= p32
                        for key in row_keys]).reshape(b, t, f)
    scale = struct.unpack("f", struct.pack("f", 1.0 / (1.0 - p32)))[0]
    return x * keep.to(x.dtype) * scale


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
    p = float(meta.get("dropout", "0"))
    for step in range(batches["ids"].shape[0]):
        ids = batches["ids"][step].long()
        targets = batches["targets"][step].long()
        row_keys = [int(k) & MASK64 for k in batches["row_keys"][step]]

        def linear(w, module, x):
            y = parity.conv1d(w, module, x)
            if module not in modules:
                return y
            # PEFT's LoRA: B A dropout(x) scaled, beside the frozen base.
            x = dropout(x, p, int(meta["key:" + module]), row_keys)
            return y + scale * (x @ adapters[module + ".lora_A"].t()) @ \
                adapters[module + ".lora_B"].t()

        logits = parity.gpt2_logits(base, ids, hp, linear)
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
