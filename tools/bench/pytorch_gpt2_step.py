"""The PyTorch peer of fsdpp's GPT-2 124M training step (vs_pytorch.sh).

An independent GPT-2 small written from the published architecture (as in
OpenAI's release and nanoGPT): vocabulary
padded to 50304, 12 layers, 12 heads, width 768, context 1024, GELU-tanh,
LayerNorm with bias, tied embeddings. One step = forward, cross-entropy,
backward, gradient-norm clipping at 1.0 and AdamW (lr 6e-4, weight decay 0.1
on matrices only, betas 0.9/0.95) -- what fsdpp's trainer does with the
gpt2_124m config.

Usage:
  pytorch_gpt2_step.py --dtype=f32|bf16 [--batch=4] [--seq=256]
                       [--threads=2] [--steps=6] [--warmup=2]
                       [--device=cpu|cuda] [--variant=eager|sdpa|compile]

--variant: "eager" (the default) is the explicit masked softmax nanoGPT falls
back to and AdamW's default (for-each) implementation, what PyTorch 1.13
has; "sdpa" is the fair GPU peer: F.scaled_dot_product_attention(is_causal)
(flash / cuDNN attention) and AdamW(fused=True) (PyTorch >= 2.0); "compile"
is "sdpa" under torch.compile. A variant this PyTorch lacks prints
{"variant", "error"} and exits 3.

bf16 runs under torch.autocast(cpu, bfloat16) with f32 master weights (the
PyTorch counterpart of fsdpp's param_dtype bf16 / reduce_dtype f32); on
--device=cuda under torch.autocast(cuda, bfloat16), the step timed up to a
device synchronize (tests/cuda_train_test's peer on a GPU). Prints
one JSON line: {"variant", "dtype", "device", "torch", "median_step_s",
"step_s": [...], "loss"}.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, LAYERS, HEADS, WIDTH, CONTEXT = 50304, 12, 12, 768, 1024


class Block(nn.Module):

  def __init__(self, sdpa):
    super().__init__()
    self.sdpa = sdpa
    self.ln_1 = nn.LayerNorm(WIDTH)
    self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
    self.c_proj = nn.Linear(WIDTH, WIDTH)
    self.ln_2 = nn.LayerNorm(WIDTH)
    self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
    self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH)

  def attention(self, x):
    b, t, c = x.shape
    q, k, v = self.c_attn(x).split(WIDTH, dim=2)
    shape = (b, t, HEADS, c // HEADS)
    q, k, v = (y.view(shape).transpose(1, 2) for y in (q, k, v))
    if self.sdpa:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // HEADS))
    mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = F.softmax(scores, dim=-1) @ v
    return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

  def forward(self, x):
    x = x + self.attention(self.ln_1(x))
    h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
    return x + self.mlp_proj(h)


class Gpt2(nn.Module):

  def __init__(self, sdpa=False):
    super().__init__()
    self.wte = nn.Embedding(VOCAB, WIDTH)
    self.wpe = nn.Embedding(CONTEXT, WIDTH)
    self.blocks = nn.ModuleList(Block(sdpa) for _ in range(LAYERS))
    self.ln_f = nn.LayerNorm(WIDTH)
    for name, p in self.named_parameters():
      if p.dim() == 2:
        std = 0.02
        if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
          std = 0.02 / math.sqrt(2 * LAYERS)
        nn.init.normal_(p, 0.0, std)

  def forward(self, ids, targets):
    pos = torch.arange(ids.shape[1], device=ids.device)
    x = self.wte(ids) + self.wpe(pos)
    for block in self.blocks:
      x = block(x)
    logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
    return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dtype", choices=["f32", "bf16"], required=True)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
  parser.add_argument("--variant", choices=["eager", "sdpa", "compile"],
                      default="eager")
  args = parser.parse_args()
  fast = args.variant != "eager"
  missing = None
  if fast and not hasattr(F, "scaled_dot_product_attention"):
    missing = "F.scaled_dot_product_attention needs PyTorch >= 2.0"
  if args.variant == "compile" and not hasattr(torch, "compile"):
    missing = "torch.compile needs PyTorch >= 2.0"
  if missing:
    print(json.dumps({"variant": args.variant, "torch": torch.__version__,
                      "error": missing}))
    sys.exit(3)
  torch.set_num_threads(args.threads)
  torch.manual_seed(1337)
  model = Gpt2(sdpa=fast).to(args.device)
  decay = [p for p in model.parameters() if p.dim() >= 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  adamw_options = {"fused": True} if fast and args.device == "cuda" else {}
  optimizer = torch.optim.AdamW(
      [{"params": decay, "weight_decay": 0.1},
       {"params": no_decay, "weight_decay": 0.0}],
      lr=6e-4, betas=(0.9, 0.95), eps=1e-8, **adamw_options)
  forward = torch.compile(model) if args.variant == "compile" else model
  generator = torch.Generator().manual_seed(7)
  times, loss = [], float("nan")
  for step in range(args.warmup + args.steps):
    ids = torch.randint(0, 50257, (args.batch, args.seq), generator=generator)
    targets = torch.randint(0, 50257, (args.batch, args.seq),
                            generator=generator)
    ids, targets = ids.to(args.device), targets.to(args.device)
    if args.device == "cuda":
      torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(args.device, dtype=torch.bfloat16,
                        enabled=args.dtype == "bf16"):
      out = forward(ids, targets)
    out.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = out.item()
    elapsed = time.perf_counter() - start
    if step >= args.warmup:
      times.append(elapsed)
  print(json.dumps({"variant": args.variant, "dtype": args.dtype,
                    "device": args.device, "torch": torch.__version__,
                    "median_step_s": statistics.median(times),
                    "step_s": times, "loss": loss}))


if __name__ == "__main__":
  main()
