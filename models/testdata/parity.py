"""Reference GPT-2 / Llama forward + backward in plain PyTorch (parity_test).

Written from the standard model definitions (GPT-2 as in OpenAI's release and
nanoGPT; Llama as in Hugging Face's LlamaModel), independently of fsdpp's C++
code: it only shares the Hugging Face tensor names and the safetensors format.
No transformers or safetensors package is used: files are read with struct +
json and turned into tensors with torch.frombuffer.

Usage:
  parity.py WEIGHTS BATCH RESULTS

WEIGHTS  the model in Hugging Face names and layout (GPT-2 Conv1D weights are
         [in, out]; Linear weights [out, in]).
BATCH    "ids" and "targets" (int64 [B, T], target -100 = ignored) and, in its
         __metadata__, the hyperparameters: family (gpt2 | llama), n_layers,
         n_heads, n_kv_heads, norm_eps, rope_theta, rope_layers (one 0/1 per
         layer, llama), rope_scaling (optional, llama: "factor,
         low_freq_factor,high_freq_factor,original_context" of Llama 3.1's
         "llama3" scaling) and tied (0/1).
RESULTS  fsdpp's "loss" (scalar), "logits" [B, T, V] and "grad.<name>" for
         every weight <name>.

The reference runs in float64 with autograd. For the loss, the logits and
every gradient it prints max |ours - reference| / max |reference| and fails
(exit status 1) when any exceeds the tolerance (1e-4, for fsdpp's f32).
"""

import json
import math
import struct
import sys

import torch
import torch.nn.functional as F

TOLERANCE = 1e-4

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


def read_safetensors(path):
    """Returns ({name: tensor}, metadata) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    data = blob[8 + header_len:]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = _DTYPES[entry["dtype"]]
        shape = entry["shape"]
        if end == begin:
            tensors[name] = torch.zeros(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype)
        tensors[name] = flat.reshape(shape).clone()
    return tensors, metadata


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v for [B, H, T, d] tensors."""
    t = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def conv1d(w, name, x):
    """GPT-2's Conv1D: y = x W + b with W stored [in, out]."""
    return x @ w[name + ".weight"] + w[name + ".bias"]


def gpt2_logits(w, ids, hp, linear=conv1d):
    """`linear(w, module, x)` computes each projection (module: its HF name,
    e.g. "transformer.h.0.attn.c_attn"); Conv1D by default."""
    b, t = ids.shape
    n_heads = hp["n_heads"]
    eps = hp["norm_eps"]
    wte = w["transformer.wte.weight"]
    c = wte.shape[1]
    x = wte[ids] + w["transformer.wpe.weight"][torch.arange(t)]
    for i in range(hp["n_layers"]):
        p = "transformer.h.%d." % i
        h = F.layer_norm(x, (c,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = linear(w, p + "attn.c_attn", h)
        q, k, v = qkv.split(c, dim=2)
        q, k, v = [z.view(b, t, n_heads, c // n_heads).transpose(1, 2)
                   for z in (q, k, v)]
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + linear(w, p + "attn.c_proj", y)
        h = F.layer_norm(x, (c,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        h = F.gelu(linear(w, p + "mlp.c_fc", h), approximate="tanh")
        x = x + linear(w, p + "mlp.c_proj", h)
    x = F.layer_norm(x, (c,), w["transformer.ln_f.weight"],
                     w["transformer.ln_f.bias"], eps)
    head = wte if hp["tied"] else w["lm_head.weight"]
    return x @ head.t()


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama3_scaled(inv_freq, scaling):
    """Llama 3.1's rope_type "llama3": long wavelengths slowed by `factor`,
    short ones kept, the band between interpolated (in float64 here)."""
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    slow = wavelength > original / low
    fast = wavelength < original / high
    s = (original / wavelength - low) / (high - low)
    between = (1 - s) * inv_freq / factor + s * inv_freq
    return torch.where(slow, inv_freq / factor,
                       torch.where(fast, inv_freq, between))


def apply_rope(x, theta, scaling=None):
    """Hugging Face Llama RoPE on x [B, H, T, d] at positions 0..T-1."""
    t, d = x.shape[2], x.shape[3]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def llama_logits(w, ids, hp, feed_forward=None):
    """Llama's logits; with hp["qk_norm"] (OLMoE) q and k are RMS-normalised
    over their whole projections before RoPE; `feed_forward(w, prefix, h)`
    replaces the SwiGLU MLP (OLMoE's experts)."""
    b, t = ids.shape
    n_heads, n_kv = hp["n_heads"], hp["n_kv_heads"]
    eps = hp["norm_eps"]
    embed = w["model.embed_tokens.weight"]
    c = embed.shape[1]
    d = c // n_heads
    x = embed[ids]
    for i in range(hp["n_layers"]):
        p = "model.layers.%d." % i
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = h @ w[p + "self_attn.q_proj.weight"].t()
        k = h @ w[p + "self_attn.k_proj.weight"].t()
        if hp.get("qk_norm", False):
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q.view(b, t, n_heads, d)
        k = k.view(b, t, n_kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].t()).view(b, t, n_kv, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if hp["rope_layers"][i]:
            q = apply_rope(q, hp["rope_theta"], hp["rope_scaling"])
            k = apply_rope(k, hp["rope_theta"], hp["rope_scaling"])
        # Grouped-query attention: query head j reads kv head j // (H / KV).
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + y @ w[p + "self_attn.o_proj.weight"].t()
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if feed_forward is not None:
            x = x + feed_forward(w, p, h)
            continue
        gate = F.silu(h @ w[p + "mlp.gate_proj.weight"].t())
        up = h @ w[p + "mlp.up_proj.weight"].t()
        x = x + (gate * up) @ w[p + "mlp.down_proj.weight"].t()
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = embed if hp["tied"] else w["lm_head.weight"]
    return x @ head.t()


def hyperparameters(metadata):
    hp = {
        "family": metadata["family"],
        "n_layers": int(metadata["n_layers"]),
        "n_heads": int(metadata["n_heads"]),
        "n_kv_heads": int(metadata["n_kv_heads"]),
        "norm_eps": float(metadata["norm_eps"]),
        "rope_theta": float(metadata["rope_theta"]),
        "tied": metadata["tied"] == "1",
    }
    # "factor,low_freq_factor,high_freq_factor,original_context" or absent.
    scaling = metadata.get("rope_scaling", "")
    hp["rope_scaling"] = (tuple(float(v) for v in scaling.split(","))
                          if scaling else None)
    hp["rope_layers"] = [flag == "1"
                         for flag in metadata.get("rope_layers", "").split(",")
                         if flag]
    return hp


def relative_error(ours, reference):
    """max |ours - reference| / max |reference| (0 when both are all zero)."""
    ours = ours.to(torch.float64)
    scale = reference.abs().max().item()
    diff = (ours - reference).abs().max().item()
    if scale == 0.0:
        return diff
    return diff / scale


def main(weights_path, batch_path, results_path):
    weights, _ = read_safetensors(weights_path)
    batch, metadata = read_safetensors(batch_path)
    results, _ = read_safetensors(results_path)
    hp = hyperparameters(metadata)

    params = {name: t.to(torch.float64).requires_grad_(True)
              for name, t in weights.items()}
    ids = batch["ids"].to(torch.int64)
    targets = batch["targets"].to(torch.int64)
    if hp["family"] == "gpt2":
        logits = gpt2_logits(params, ids, hp)
    elif hp["family"] == "llama":
        logits = llama_logits(params, ids, hp)
    else:
        sys.stderr.write("parity.py: unknown family %r\n" % hp["family"])
        return 2
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           targets.reshape(-1), ignore_index=-100)
    loss.backward()

    rows = [("loss", relative_error(results["loss"].reshape(()),
                                    loss.detach())),
            ("logits", relative_error(results["logits"], logits.detach()))]
    for name in sorted(params):
        grad_name = "grad." + name
        if grad_name not in results:
            sys.stderr.write("parity.py: results lack %s\n" % grad_name)
            return 1
        rows.append((grad_name, relative_error(results[grad_name],
                                               params[name].grad)))
    extra = sorted(set(results) - {"loss", "logits"} -
                   {"grad." + name for name in params})
    if extra:
        sys.stderr.write("parity.py: unexpected results %s\n" % extra)
        return 1

    print("%s: loss ours %.8f reference %.8f" %
          (hp["family"], results["loss"].item(), loss.item()))
    width = max(len(name) for name, _ in rows)
    print("%-*s  max rel err" % (width, "tensor"))
    failed = 0
    for name, err in rows:
        bad = not err <= TOLERANCE
        failed += bad
        print("%-*s  %.3e%s" % (width, name, err, "  FAIL" if bad else ""))
    worst = max(rows, key=lambda row: row[1])
    print("worst: %s %.3e (tolerance %.0e), %d of %d tensors failed" %
          (worst[0], worst[1], TOLERANCE, failed, len(rows)))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.stderr.write(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
