"""``hetero-comm`` command line (also ``python -m hetero_comm``).

``hetero-comm demo`` trains the default model on scikit-learn's digits with N local worker
processes (gloo on 127.0.0.1) once per hook and reports accuracy, bytes and time per step and
per epoch. ``--slow-worker-cores`` makes the last worker slow for real (a cgroup CPU quota,
root only) and ``--batching dynamic`` gives each worker a batch proportional to its measured
speed.
"""

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import time
from typing import Dict, List, Optional

from .lab.data import DIGITS_MODELS
from .lab.registry import HOOKS, WEIGHTED_HOOKS
from .lab.throttle import cpu_quota_unavailable
from .lab.training import BATCHING, TrainConfig, run_training

# The demo's flags that set each hook's state (flag name = the state's argument).
HOOK_FLAGS = {"sparse": ("density", "segment_size", "selection"), "dct": ("keep_ratio", "bits")}


def _hook_list(text: str) -> List[str]:
    hooks = [h.strip() for h in text.split(",") if h.strip()]
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown or not hooks:
        raise argparse.ArgumentTypeError(f"unknown hook(s) {unknown or text!r}; choose from "
                                         f"{', '.join(HOOKS)} (comma-separated)")
    return hooks


def _number(kind):
    """Parse a flag's text as ``kind``; its range is checked by :meth:`TrainConfig.validate`
    (or the hook state it builds), the one place every setting is validated."""
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero-comm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train once per hook on local workers and compare",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--workers", type=_number(int), default=2, help="local worker processes")
    demo.add_argument("--hooks", type=_hook_list, default=None,
                      help=f"comma-separated, from: {','.join(HOOKS)} (default: all; with "
                           f"dynamic batching: {','.join(WEIGHTED_HOOKS)})")
    demo.add_argument("--epochs", type=_number(int), default=8)
    demo.add_argument("--density", type=_number(float), default=0.01,
                      help="segment_sparse_hook: fraction of segments sent")
    demo.add_argument("--segment-size", type=_number(int), default=256,
                      help="segment_sparse_hook: elements per segment")
    demo.add_argument("--keep-ratio", type=_number(float), default=0.125,
                      help="dct_quant_hook: fraction of DCT coefficients sent")
    demo.add_argument("--bits", type=int, choices=(8, 16, 32), default=8,
                      help="dct_quant_hook: integer width on the wire")
    demo.add_argument("--lr", type=_number(float), default=0.02, help="SGD learning rate")
    demo.add_argument("--momentum", type=_number(float), default=0.9, help="SGD momentum")
    demo.add_argument("--selection", choices=("current", "lagged"), default="current",
                      help="segment_sparse_hook: selection mode")
    demo.add_argument("--model", choices=DIGITS_MODELS, default="mlp",
                      help="mlp: 85K parameters; cnn: bound by compute (where a slow worker "
                           "shows most); cnn_wide: two convolutions and a wide linear layer")
    demo.add_argument("--slow-worker-cores", type=_number(float), default=None,
                      metavar="CORES", help="run the last worker under a CPU quota of this many "
                                            "cores (cgroup; needs root)")
    demo.add_argument("--batching", choices=BATCHING + ("both",), default="equal",
                      help="per-worker batch sizes: equal, proportional to measured speed "
                           "(re-planned every epoch), or one run of each")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="hetero_comm_demo", help="output directory")
    demo.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "demo":
        return 2
    try:
        runs = demo_runs(args)
    except ValueError as error:
        parser.error(str(error))
    if args.slow_worker_cores is not None:
        reason = cpu_quota_unavailable()
        if reason is not None:
            parser.error(f"argument --slow-worker-cores: {reason}")
        # Terminated mid-run, the quota's cgroup is still removed: SIGTERM unwinds.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return demo(args, runs)


def demo_runs(args) -> Dict[str, TrainConfig]:
    """The demo's runs by name (``hook`` or ``hook/batching``), each validated."""
    batchings = list(BATCHING) if args.batching == "both" else [args.batching]
    hooks = args.hooks or list(WEIGHTED_HOOKS if "dynamic" in batchings else HOOKS)
    runs = {}
    for hook, batching in itertools.product(hooks, batchings):
        config = TrainConfig(hook=hook, workers=args.workers, epochs=args.epochs,
                             global_batch=32 * args.workers, seed=args.seed, lr=args.lr,
                             momentum=args.momentum, model=args.model, batching=batching,
                             slow_worker_cores=args.slow_worker_cores,
                             hook_settings={flag: getattr(args, flag)
                                            for flag in HOOK_FLAGS.get(hook, ())})
        config.validate()
        runs[hook if len(batchings) == 1 else f"{hook}/{batching}"] = config
    return runs


def demo(args, runs: Dict[str, TrainConfig]) -> int:
    first = next(iter(runs.values()))
    os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        tqdm = None
    slow = (f", last worker limited to {args.slow_worker_cores} cores"
            if args.slow_worker_cores else "")
    print(f"hetero-comm demo: {args.workers} workers (gloo, 127.0.0.1){slow}, digits "
          f"{args.model.upper()}, {args.epochs} epochs, global batch {first.global_batch}, "
          f"SGD lr {args.lr} momentum {args.momentum}, runs: {', '.join(runs)}")
    records = {}
    for name, config in runs.items():
        bar = tqdm(total=args.epochs, desc=f"{name:9s}", unit="epoch") if tqdm else None

        def on_epoch(epoch, accuracy, bar=bar):
            if bar is not None:
                bar.update(epoch - bar.n)
                bar.set_postfix(test_acc=f"{accuracy:.3f}")

        started = time.perf_counter()
        try:
            record = run_training(config, on_epoch=on_epoch)
        except RuntimeError as error:
            if "non-finite gradient" not in str(error):
                raise
            # Training diverged: the hook said so; report it and go on with the next hook.
            record = {"diverged": str(error).splitlines()[-1]}
        finally:
            if bar is not None:
                bar.close()
        record["wall_seconds"] = time.perf_counter() - started
        record.update(hook=config.hook, batching=config.batching)
        records[name] = record
    print()
    print(format_table(records))
    json_path = os.path.join(args.out, "demo.json")
    with open(json_path, "w") as f:
        json.dump({hook: _jsonable(r) for hook, r in records.items()}, f, indent=1)
    print(f"\nnumbers: {json_path}")
    if not args.no_plot:
        print(f"plot:    {plot(records, os.path.join(args.out, 'demo.png'))}")
    return 0


def format_table(records: dict) -> str:
    rows = [("hook", "batching", "test accuracy", "bytes/step", "compression", "step time (ms)",
             "epoch time (s)", "batch per worker", "ranks identical")]
    for r in records.values():
        title = HOOKS[r["hook"]].title
        if "diverged" in r:
            rows.append((title, r["batching"], "diverged", "-", "-", "-", "-", "-", "-"))
            continue
        compression = r["dense_bytes_per_step"] / r["bytes_per_step"]
        step_ms = 1000 * statistics.median(r["history"]["seconds"])
        epoch_seconds = r["epochs"]["seconds"]
        epoch_s = statistics.median(epoch_seconds[1:] or epoch_seconds)
        rows.append((title, r["batching"], f"{100 * r['final_accuracy']:.1f}%",
                     f"{r['bytes_per_step']:,.0f}", f"{compression:.1f}x", f"{step_ms:.2f}",
                     f"{epoch_s:.3f}", "/".join(map(str, r["epochs"]["batch_sizes"][-1])),
                     "yes" if r["ranks_identical"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + ("\n\nbytes/step: what rank 0 handed to collectives per step, "
                               "averaged over the run (warm-up included); step time: median; "
                               "epoch time: median over the epochs after the first (training "
                               "only); batch per worker: in the last epoch, worker 0 first.")


def _jsonable(record: dict) -> dict:
    skip = {"final_parameters"}
    return {k: v for k, v in record.items() if k not in skip}


def plot(records: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for name, r in records.items():
        if "diverged" in r:
            continue
        label = HOOKS[r["hook"]].title + (f" ({r['batching']})" if "/" in name else "")
        h, e = r["history"], r["epochs"]
        window = max(1, len(h["loss"]) // 40)
        smooth = [sum(h["loss"][max(0, i - window + 1): i + 1]) / len(h["loss"][max(0, i - window + 1): i + 1])
                  for i in range(len(h["loss"]))]
        megabytes = [b / 1e6 for b in h["bytes"]]
        training_seconds = list(itertools.accumulate(e["seconds"]))
        axes[0][0].plot(h["step"], smooth, label=label)
        axes[0][1].plot(megabytes, smooth, label=label)
        axes[1][0].plot(training_seconds, e["test_accuracy"], marker="o", label=label)
        axes[1][1].plot([b / 1e6 for b in e["bytes"]], e["test_accuracy"], marker="o",
                        label=label)
    for ax, (x, y) in zip(sum(axes.tolist(), []), [("step", "training loss"),
                                                   ("MB sent by rank 0", "training loss"),
                                                   ("training seconds", "test accuracy"),
                                                   ("MB sent by rank 0", "test accuracy")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    for ax in axes[0][1], axes[1][1]:
        ax.set_xscale("log")
    for ax in axes[0]:
        ax.set_yscale("log")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    sys.exit(main())
