"""Renders a training run's loss and throughput curves to a PNG.

Usage: plot.py METRICS.jsonl [MORE.jsonl ...] [--out PATH] [--title TEXT]

Input is the trainer's metrics JSONL file (see README.md for the schema).
Several files are overlaid, one colour per file, for comparing runs. Bad input
(missing or empty file, a line that is not JSON, no training lines, a field of
the wrong type) is reported on stderr as "plot: error: ..." with exit code 1.

Runs with Debian's /usr/bin/python3 and python3-matplotlib (tools/setup.sh).
"""

import argparse
import json
import math
import os
import sys

PROG = "plot"

# Figure size in pixels is FIG_INCHES * DPI: 1200 x 900. plot_test checks it.
FIG_INCHES = (12.0, 9.0)
DPI = 100


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit code 1."""


class Run:
    """The parsed contents of one metrics file."""

    def __init__(self, path):
        self.path = path
        self.label = os.path.basename(path)
        self.headers = []  # every {"kind": "run"} line, in file order
        self.train = []    # dicts with step, loss, tokens_per_s, mfu, warmup
        self.val = []      # (step, val_loss)
        self.restarts = 0  # times the step went back (a resume appending)
        self.earlier_runs = 0  # fresh runs before the last, not plotted


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(obj, name, check, what, where):
    if name not in obj:
        raise InputError(f'{where}: {obj["kind"]} line has no "{name}"')
    value = obj[name]
    if not check(value):
        raise InputError(
            f'{where}: "{name}" must be {what}, got {json.dumps(value)}')
    return value


def _drop_from(records, step, key):
    """Drops the records at or after `step` (superseded by a resumed run)."""
    return [r for r in records if key(r) < step]


def read_run(path):
    run = Run(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file")
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a metrics file")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}")
    if not data.strip():
        raise InputError(f"{path}: empty file (expected JSON lines)")

    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise InputError(f"{where}: not UTF-8 text")
        if not line:
            continue  # blank lines (e.g. a trailing newline) are harmless
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too long ints
            msg = e.msg if isinstance(e, json.JSONDecodeError) else (
                str(e) or "too deeply nested")
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise InputError(f"{where}: not JSON ({msg}): {shown}")
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object, got {line[:60]}")
        kind = obj.get("kind")
        if kind == "train":
            step = _field(obj, "step", _is_int, "an integer", where)
            rec = {
                "step": step,
                "loss": float(_field(obj, "loss", _is_number, "a number", where)),
                "tokens_per_s": float(
                    _field(obj, "tokens_per_s", _is_number, "a number", where)),
                "mfu": float(_field(obj, "mfu", _is_number, "a number", where)),
                "warmup": _field(obj, "warmup", lambda v: isinstance(v, bool),
                                 "true or false", where),
            }
            # A resumed run appends to the same file starting again from its
            # checkpoint's step: its lines replace the ones from that step on.
            if run.train and step <= run.train[-1]["step"]:
                run.restarts += 1
                run.train = _drop_from(run.train, step, lambda r: r["step"])
                run.val = _drop_from(run.val, step, lambda r: r[0])
            run.train.append(rec)
        elif kind == "val":
            step = _field(obj, "step", _is_int, "an integer", where)
            val_loss = _field(obj, "val_loss", _is_number, "a number", where)
            run.val.append((step, float(val_loss)))
        elif kind == "run":
            # A fresh run (start_step 0) appending to an older run's file
            # replaces all of it; a resumed one (start_step > 0) only the
            # lines from its step on (above).
            if obj.get("start_step") == 0 and run.train:
                run.earlier_runs += 1
                run.train, run.val, run.headers = [], [], []
                run.restarts = 0
            run.headers.append(obj)
        # "summary" and unknown kinds are ignored.

    if not run.train:
        raise InputError(
            f'{path}: no training lines (no line has "kind": "train")')
    return run


def _header_value(run, name, check):
    """The first header's value of `name` when it has the right type."""
    for h in run.headers:
        if name in h and check(h[name]):
            return h[name]
    return None


def _describe(run):
    """'gpt2-124m, world size 4' from the header(s), or None."""
    model = _header_value(run, "model", lambda v: isinstance(v, str))
    sizes = []
    for h in run.headers:
        ws = h.get("world_size")
        if _is_int(ws) and ws not in sizes:
            sizes.append(ws)
    parts = []
    if model:
        parts.append(model)
    if sizes:
        # A resume may reshard onto a different number of ranks.
        parts.append("world size " + "\u2192".join(str(s) for s in sizes))
    return ", ".join(parts) or None


def _title(runs, explicit):
    if explicit is not None:
        return explicit
    descs = []
    for run in runs:
        d = _describe(run) or run.label
        if d not in descs:
            descs.append(d)
    return " vs ".join(descs)


def _unique_labels(runs):
    """File names, with as many parent directories as needed to tell apart."""
    paths = [os.path.normpath(os.path.abspath(r.path)).split(os.sep) for r in runs]
    depth = 1
    while True:
        labels = [os.sep.join(p[-depth:]) for p in paths]
        longest = max(len(p) for p in paths)
        if len(set(labels)) == len(labels) or depth >= longest:
            break
        depth += 1
    for run, label in zip(runs, labels):
        run.label = label


def _finite(values):
    return [v for v in values if math.isfinite(v)]


def _fmt_rate(v):
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def render(runs, out_path, title):
    try:
        import matplotlib
    except ImportError:
        raise InputError(
            "matplotlib is not installed for /usr/bin/python3; run "
            "tools/setup.sh (Debian package python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import (EngFormatter, FuncFormatter, NullFormatter,
                                   PercentFormatter)

    fig, (ax_loss, ax_tps) = plt.subplots(
        2, 1, figsize=FIG_INCHES, dpi=DPI, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    multi = len(runs) > 1

    # Panel 1: loss.
    all_losses = []
    baselines = []  # (unigram loss, colour of the first run with it)
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        steps = [r["step"] for r in run.train]
        losses = [r["loss"] for r in run.train]
        all_losses += losses
        name = run.label if multi else "train"
        ax_loss.plot(steps, losses, color=color, linewidth=1.2,
                     label=f"{name} train" if multi else "train loss")
        if run.val:
            vs, vl = zip(*run.val)
            all_losses += vl
            ax_loss.plot(vs, vl, linestyle="none", marker="o", markersize=5,
                         markerfacecolor="white", markeredgecolor=color,
                         markeredgewidth=1.5,
                         label=f"{name} val" if multi else "val loss")
        unigram = _header_value(
            run, "unigram_loss", lambda v: _is_number(v) and math.isfinite(v))
        if unigram is not None and all(abs(b - unigram) > 1e-9 for b, _ in baselines):
            baselines.append((float(unigram), color))
    for value, color in baselines:
        ax_loss.axhline(value, linestyle="--", linewidth=1.0,
                        color=color if len(baselines) > 1 else "gray",
                        label=f"unigram baseline ({value:.3f})")
        all_losses.append(value)
    finite = _finite(all_losses)
    # Log scale when the loss falls by more than 4x (all of it visible);
    # linear otherwise, where a log axis would only squash the curve.
    if finite and min(finite) > 0 and max(finite) / min(finite) > 4:
        ax_loss.set_yscale("log")
        # Plain numbers (2, 3, 4, 6) instead of 2x10^0; the 2..9 ticks are
        # labelled too unless the loss spans more than about a decade and a half.
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax_loss.yaxis.set_major_formatter(plain)
        if max(finite) / min(finite) < 30:
            ax_loss.yaxis.set_minor_formatter(plain)
        else:
            ax_loss.yaxis.set_minor_formatter(NullFormatter())
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, which="major", alpha=0.3)
    ax_loss.legend(loc="upper right", fontsize="small")
    ax_loss.set_title("loss")

    # Panel 2: global tokens/s (warmup steps faded), MFU on the right in %.
    ax_mfu = ax_tps.twinx()
    handles = []
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        steps = [r["step"] for r in run.train]
        tps = [r["tokens_per_s"] for r in run.train]
        mfu = [100.0 * r["mfu"] for r in run.train]
        measured = [r for r in run.train if not r["warmup"]]
        # The whole curve faded, then the measured steps drawn over it solid.
        ax_tps.plot(steps, tps, color=color, alpha=0.3, linewidth=1.0)
        ax_tps.plot(steps, [r["tokens_per_s"] if not r["warmup"] else math.nan
                            for r in run.train], color=color, linewidth=1.4)
        warm = [r for r in run.train if r["warmup"]]
        if warm:
            ax_tps.plot([r["step"] for r in warm], [r["tokens_per_s"] for r in warm],
                        linestyle="none", marker="x", markersize=5, color=color,
                        alpha=0.4)
        mean = ""
        m_tps = _finite([r["tokens_per_s"] for r in measured])
        m_mfu = _finite([100.0 * r["mfu"] for r in measured])
        if m_tps:
            mean = f" (mean {_fmt_rate(sum(m_tps) / len(m_tps))} tokens/s"
            if m_mfu:
                mean += f", MFU {sum(m_mfu) / len(m_mfu):.1f}%"
            mean += ")"
        name = run.label if multi else "tokens/s"
        (h,) = ax_tps.plot([], [], color=color, linewidth=1.4,
                           label=f"{name}{mean}")
        handles.append(h)
        ax_mfu.plot(steps, mfu, color=color, linestyle=":", linewidth=1.2)
    if any(r["warmup"] for run in runs for r in run.train):
        handles.append(ax_tps.plot([], [], color="gray", alpha=0.3, marker="x",
                                   label="warmup (not averaged)")[0])
    handles.append(ax_mfu.plot([], [], color="gray", linestyle=":",
                               label="MFU (right axis)")[0])
    # MFU is proportional to tokens/s for a fixed model, so on equal scales
    # the two curves would lie on top of each other: the MFU axis gets more
    # headroom, which puts its curves below the tokens/s ones.
    top_tps = max(_finite([r["tokens_per_s"] for run in runs for r in run.train]),
                  default=0.0)
    top_mfu = max(_finite([100.0 * r["mfu"] for run in runs for r in run.train]),
                  default=0.0)
    ax_tps.set_ylim(0, 1.25 * top_tps if top_tps > 0 else 1.0)
    ax_mfu.set_ylim(0, 1.6 * top_mfu if top_mfu > 0 else 100.0)
    ax_tps.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax_mfu.yaxis.set_major_formatter(PercentFormatter(decimals=None))
    ax_tps.set_ylabel("tokens/s (global)")
    ax_mfu.set_ylabel("MFU")
    ax_tps.set_xlabel("step")
    ax_tps.grid(True, alpha=0.3)
    ax_tps.legend(handles=handles, loc="lower right", fontsize="small")
    ax_tps.set_title("throughput")

    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(out_path, dpi=DPI, format="png")
    except OSError as e:
        raise InputError(f"{out_path}: cannot write: {e.strerror or e}")
    finally:
        plt.close(fig)


def default_out(path):
    root, ext = os.path.splitext(path)
    return (root if ext in (".jsonl", ".json", ".ndjson", ".log") else path) + ".png"


def main(argv):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plot loss and throughput from fsdpp trainer metrics "
                    "JSONL files (several files are overlaid).")
    parser.add_argument("inputs", nargs="+", metavar="METRICS.jsonl")
    parser.add_argument("--out", help="PNG to write (default: the first "
                        "input with its extension replaced by .png)")
    parser.add_argument("--title", help="figure title (default: model and "
                        "world size from the run header)")
    args = parser.parse_args(argv)

    try:
        runs = [read_run(p) for p in args.inputs]
        _unique_labels(runs)
        out = args.out or default_out(args.inputs[0])
        if os.path.isdir(out):
            raise InputError(f"{out}: is a directory; --out takes a file name")
        try:
            render(runs, out, _title(runs, args.title))
        except InputError:
            raise
        except Exception as e:  # matplotlib choking on extreme values
            raise InputError(f"cannot render {out}: {type(e).__name__}: {e}")
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    for run in runs:
        if run.earlier_runs:
            print(f"{PROG}: note: {run.path}: holds {run.earlier_runs} earlier "
                  f"run(s) before the last fresh start (start_step 0); "
                  f"plotting the last run only", file=sys.stderr)
        if run.restarts:
            print(f"{PROG}: note: {run.path}: step went back {run.restarts} "
                  f"time(s) (resumed run); later lines replace earlier ones",
                  file=sys.stderr)
    n = sum(len(r.train) for r in runs)
    print(f"{PROG}: wrote {out} ({len(runs)} run(s), {n} training steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
