"""Reads an exported Hugging Face model directory as transformers would and
checks it (hf_directory_test).

Independent of fsdpp's C++ code: the directory is read by hand (config.json,
model.safetensors.index.json, the shards) with parity.py's safetensors
reader, the hyperparameters come from config.json alone, and the loss is
computed by parity.py's float64 PyTorch GPT-2 / Llama or this file's
OLMoE (mixture of experts).

Usage:
  hf_dir_check.py DIR REFERENCE BATCH LOSS

DIR        the exported model directory.
REFERENCE  fsdpp's single-file export of the same model (HF names, f32).
BATCH      "ids" and "targets" (int64 [B, T], target -100 = ignored).
LOSS       fsdpp's loss on the batch.

Checks: every tensor of REFERENCE is in DIR under the same name with equal
values (and nothing else is); the index's total_size is the sum of the
tensors' bytes; the reference model's loss on DIR's weights equals LOSS
within 1e-5 relative. Exit status 1 on any failure.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity  # noqa: E402  (the reference models and reader)

TOLERANCE = 1e-5


def read_directory(path):
    """{name: tensor} of a model directory (one file or an index's shards)."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        tensors, _ = parity.read_safetensors(
            os.path.join(path, "model.safetensors"))
        return tensors, None
    with open(index_path) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        part, _ = parity.read_safetensors(os.path.join(path, shard))
        for name, tensor in part.items():
            if index["weight_map"].get(name) != shard:
                raise ValueError(f"{shard} holds {name}, which the index "
                                 f"puts elsewhere")
            tensors[name] = tensor
    return tensors, index


def hyperparameters(config):
    """parity.py's hyperparameters, from config.json as transformers reads
    it."""
    if config["model_type"] == "gpt2":
        return {
            "family": "gpt2",
            "n_layers": config["n_layer"],
            "n_heads": config["n_head"],
            "n_kv_heads": config["n_head"],
            "norm_eps": config.get("layer_norm_epsilon", 1e-5),
            "rope_theta": 0.0,
            "rope_scaling": None,
            "rope_layers": [],
            "tied": config.get("tie_word_embeddings", True),
        }
    if config["model_type"] == "llama":
        scaling = config.get("rope_scaling")
        return {
            "family": "llama",
            "n_layers": config["num_hidden_layers"],
            "n_heads": config["num_attention_heads"],
            "n_kv_heads": config.get("num_key_value_heads",
                                     config["num_attention_heads"]),
            "norm_eps": config.get("rms_norm_eps", 1e-6),
            "rope_theta": config.get("rope_theta", 10000.0),
            "rope_scaling": None if scaling is None else (
                scaling["factor"], scaling["low_freq_factor"],
                scaling["high_freq_factor"],
                scaling["original_max_position_embeddings"]),
            "rope_layers": [True] * config["num_hidden_layers"],
            "tied": config.get("tie_word_embeddings", False),
        }
    if config["model_type"] == "olmoe":
        if config.get("clip_qkv") is not None:
            raise ValueError("clip_qkv is not modelled")
        return {
            "family": "olmoe",
            "n_layers": config["num_hidden_layers"],
            "n_heads": config["num_attention_heads"],
            "n_kv_heads": config.get("num_key_value_heads",
                                     config["num_attention_heads"]),
            "norm_eps": config.get("rms_norm_eps", 1e-5),
            "rope_theta": config.get("rope_theta", 10000.0),
            "experts": config["num_experts"],
            "top_k": config["num_experts_per_tok"],
            "norm_topk_prob": config.get("norm_topk_prob", False),
            "tied": config.get("tie_word_embeddings", False),
            "qk_norm": True,
            "rope_scaling": None,
            "rope_layers": [True] * config["num_hidden_layers"],
        }
    raise ValueError(f"unknown model_type {config['model_type']}")


def olmoe_logits(w, ids, hp):
    """OLMoE as transformers' modeling_olmoe computes it, in float64: Llama
    with q / k RMSNorm over the whole projections before RoPE, and a sparse
    MoE block for the MLP (softmax over the router's logits, the top-k
    experts' probabilities, renormalised only with norm_topk_prob, weighting
    SwiGLU experts)."""

    def experts(w, p, h):
        c = h.shape[-1]
        rows = h.reshape(-1, c)
        probs = torch.softmax(rows @ w[p + "mlp.gate.weight"].t(), dim=-1)
        weights, chosen = torch.topk(probs, hp["top_k"], dim=-1)
        if hp["norm_topk_prob"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(rows)
        for e in range(hp["experts"]):
            e_p = p + "mlp.experts.%d." % e
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            if token.numel() == 0:
                continue
            r = rows[token]
            gate = F.silu(r @ w[e_p + "gate_proj.weight"].t())
            up = r @ w[e_p + "up_proj.weight"].t()
            y_e = (gate * up) @ w[e_p + "down_proj.weight"].t()
            out.index_add_(0, token, y_e * weights[token, slot].unsqueeze(-1))
        return out.view(h.shape)

    return parity.llama_logits(w, ids, hp, feed_forward=experts)


def main(directory, reference_path, batch_path, loss_text):
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    weights, index = read_directory(directory)
    reference, _ = parity.read_safetensors(reference_path)
    ok = True
    if set(weights) != set(reference):
        print("names differ: only in the directory",
              sorted(set(weights) - set(reference)), "only in the reference",
              sorted(set(reference) - set(weights)))
        return 1
    for name, tensor in reference.items():
        if tensor.shape != weights[name].shape or not torch.equal(
                tensor.to(torch.float64), weights[name].to(torch.float64)):
            print(f"{name}: values differ")
            ok = False
    if index is not None:
        total = sum(t.numel() * t.element_size() for t in weights.values())
        if index["metadata"]["total_size"] != total:
            print(f"index total_size {index['metadata']['total_size']} != "
                  f"{total}")
            ok = False
    print(f"{len(weights)} tensors, "
          f"{'1 file' if index is None else str(len(set(index['weight_map'].values()))) + ' shards'}"
          f", equal to the reference export")

    hp = hyperparameters(config)
    w = {name: t.to(torch.float64) for name, t in weights.items()}
    batch, _ = parity.read_safetensors(batch_path)
    ids, targets = batch["ids"], batch["targets"]
    if hp["family"] == "gpt2":
        logits = parity.gpt2_logits(w, ids, hp)
    elif hp["family"] == "olmoe":
        logits = olmoe_logits(w, ids, hp)
    else:
        logits = parity.llama_logits(w, ids, hp)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           targets.reshape(-1), ignore_index=-100).item()
    ours = float(loss_text)
    error = abs(ours - loss) / abs(loss)
    print(f"loss: fsdpp {ours:.9g}, reference on the exported weights "
          f"{loss:.9g}, relative error {error:.3g}")
    if error > TOLERANCE:
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
