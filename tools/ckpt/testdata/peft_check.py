"""Checks a LoRA run's two exports against each other in float64 PyTorch
(ckpt_test), independent of fsdpp's C++ code.

The base model directory and the merged one are read as transformers would
(models/testdata/hf_dir_check.py's reader and config.json parsing); the
adapter directory as PEFT would: adapter_config.json (r, lora_alpha,
target_modules, fan_in_fan_out) and adapter_model.safetensors
("base_model.model.<module>.lora_A.weight" [r, in], ".lora_B.weight"
[out, r]). The adapted model is the base with, for each target module,
W + (lora_alpha / r) B A added (transposed for GPT-2's Conv1D weights,
fan_in_fan_out); models/testdata/parity.py's float64 GPT-2 / Llama gives
the losses.

Usage:
  peft_check.py BASE MERGED ADAPTER BATCH LOSS

BASE     the base model's Hugging Face directory.
MERGED   `ckpt export --format=hf` of the LoRA run.
ADAPTER  `ckpt export --format=peft` of the LoRA run.
BATCH    "ids" and "targets" (int64 [B, T], target -100 = ignored).
LOSS     fsdpp's loss of the adapted model on the batch (f32).

Checks: the merged model's loss equals the base-plus-adapter loss within
1e-6 relative, both equal fsdpp's within 1e-5 (f32 against float64), and
the adapter changes the base's loss. Exit status 1 on any failure.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "models", "testdata"))
import hf_dir_check  # noqa: E402  (the directory reader, config.json)
import parity  # noqa: E402  (the float64 models, the safetensors reader)

MERGE_TOLERANCE = 1e-6
FSDPP_TOLERANCE = 1e-5
PREFIX = "base_model.model."


def loss_of(weights, hp, ids, targets):
    w = {name: t.to(torch.float64) for name, t in weights.items()}
    if hp["family"] == "gpt2":
        logits = parity.gpt2_logits(w, ids, hp)
    else:
        logits = parity.llama_logits(w, ids, hp)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           targets.reshape(-1), ignore_index=-100).item()


def adapted(base, adapter_dir):
    """The base weights with the adapter's B A added, as PEFT merges."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors, _ = parity.read_safetensors(
        os.path.join(adapter_dir, "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    out = {name: t.to(torch.float64) for name, t in base.items()}
    for module in config["target_modules"]:
        a = tensors.pop(PREFIX + module + ".lora_A.weight").to(torch.float64)
        b = tensors.pop(PREFIX + module + ".lora_B.weight").to(torch.float64)
        if a.shape[0] != config["r"] or b.shape[1] != config["r"]:
            raise ValueError(f"{module}: A {list(a.shape)}, B "
                             f"{list(b.shape)} for r = {config['r']}")
        delta = scale * (b @ a)  # [out, in]
        if config.get("fan_in_fan_out", False):
            delta = delta.t()  # Conv1D: [in, out]
        out[module + ".weight"] = out[module + ".weight"] + delta
    if tensors:
        raise ValueError(f"adapter tensors of no target module: "
                         f"{sorted(tensors)}")
    return out, len(config["target_modules"])


def main(base_dir, merged_dir, adapter_dir, batch_path, loss_text):
    with open(os.path.join(base_dir, "config.json")) as f:
        hp = hf_dir_check.hyperparameters(json.load(f))
    base, _ = hf_dir_check.read_directory(base_dir)
    merged, _ = hf_dir_check.read_directory(merged_dir)
    with_adapter, modules = adapted(base, adapter_dir)
    batch, _ = parity.read_safetensors(batch_path)
    ids, targets = batch["ids"], batch["targets"]
    base_loss = loss_of(base, hp, ids, targets)
    adapter_loss = loss_of(with_adapter, hp, ids, targets)
    merged_loss = loss_of(merged, hp, ids, targets)
    ours = float(loss_text)
    merge_error = abs(merged_loss - adapter_loss) / abs(adapter_loss)
    fsdpp_error = abs(ours - adapter_loss) / abs(adapter_loss)
    print(f"{modules} adapted modules; loss: base {base_loss:.9g}, base + "
          f"adapter {adapter_loss:.9g}, merged export {merged_loss:.9g} "
          f"(relative {merge_error:.3g}), fsdpp {ours:.9g} (relative "
          f"{fsdpp_error:.3g})")
    ok = merge_error <= MERGE_TOLERANCE and fsdpp_error <= FSDPP_TOLERANCE
    if abs(base_loss - adapter_loss) <= 1e-4 * abs(base_loss):
        print("the adapter does not change the loss")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 6:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
