"""Reference for optim/adamw_test: torch.optim.AdamW on given params/grads.

Usage: adamw_reference.py INPUT OUTPUT

INPUT is whitespace-separated text written by the test:
  steps lr_1 .. lr_steps
  beta1 beta2 eps weight_decay
  nparams
  then per param: name decay(0/1) ndim dim_1 .. dim_ndim,
                  numel initial values, then numel grad values per step.
OUTPUT gets one line per tensor: "<name> <param|exp_avg|exp_avg_sq> v...",
values as Python reprs of the f32 results (exact).

Params with decay 0 go to a second param group with weight_decay 0, the
usual no-decay group. The learning rate of step t is set on every group
before step t, as an LR scheduler would. Exits 77 (and says why) when torch
cannot be imported, so the test can skip visibly.
"""
import sys


def main():
    try:
        import torch
    except Exception as e:  # pylint: disable=broad-except
        print("torch unavailable: %r" % (e,), file=sys.stderr)
        return 77
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        tokens = f.read().split()
    pos = 0

    def take(n=1):
        nonlocal pos
        out = tokens[pos:pos + n]
        pos += n
        return out

    steps = int(take()[0])
    lrs = [float(x) for x in take(steps)]
    beta1, beta2, eps, weight_decay = (float(x) for x in take(4))
    nparams = int(take()[0])
    params, decay_flags, grads = [], [], []
    for _ in range(nparams):
        name, decay, ndim = take(3)
        shape = [int(x) for x in take(int(ndim))]
        numel = 1
        for d in shape:
            numel *= d
        p = torch.tensor([float(x) for x in take(numel)],
                         dtype=torch.float32).reshape(shape)
        g = [torch.tensor([float(x) for x in take(numel)],
                          dtype=torch.float32).reshape(shape)
             for _ in range(steps)]
        params.append((name, torch.nn.Parameter(p)))
        decay_flags.append(decay == "1")
        grads.append(g)

    decayed = [p for (_, p), d in zip(params, decay_flags) if d]
    not_decayed = [p for (_, p), d in zip(params, decay_flags) if not d]
    groups = []
    if decayed:
        groups.append({"params": decayed, "weight_decay": weight_decay})
    if not_decayed:
        groups.append({"params": not_decayed, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=lrs[0], betas=(beta1, beta2), eps=eps,
                            foreach=False)
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        for (_, p), g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()

    with open(sys.argv[2], "w") as f:
        for name, p in params:
            state = opt.state[p]
            for kind, t in (("param", p.detach()), ("exp_avg", state["exp_avg"]),
                            ("exp_avg_sq", state["exp_avg_sq"])):
                values = " ".join(repr(float(v)) for v in t.reshape(-1).tolist())
                f.write("%s %s %s\n" % (name, kind, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
