"""The demo: trains each workload (by default the digits MLP with SGD and a small transformer
with AdamW) with N local worker processes (gloo on 127.0.0.1) once per hook (by default dense
allreduce, ``hetero_comm.compress``'s recipe and torch's PowerSGD) and reports
validation loss, accuracy, bytes and time per step, as a table, a JSON file and a PNG.
``--slow-worker-cores`` makes the last worker slow for real (a cgroup CPU quota, root only) and
``--batching dynamic`` gives each worker a batch proportional to its measured speed.

Run ``make demo``, or ``.venv/bin/python benchmarks/demo.py --help`` after it.
"""

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
from typing import Dict, List, Optional

from lab.registry import HOOKS, WEIGHTED_HOOKS, make_hook
from lab.throttle import cpu_quota_unavailable
from lab.training import BATCHING, TrainConfig, run_training

# The demo's flags that set each hook's state (flag name = the state's argument).
HOOK_FLAGS = {"sparse": ("density", "segment_size"), "dct": ("keep_ratio", "bits"),
              "recipe": ("ratio",), "powersgd": ("matrix_approximation_rank",)}
DEFAULT_HOOKS = ("dense", "recipe", "powersgd")
# Each workload: a model, its dense optimizer and schedule (the convergence benchmark's), and
# the batch per worker.
WORKLOADS = {
    "mlp_sgd": dict(model="mlp", optimizer="sgd", lr=0.05, momentum=0.9, epochs=8),
    "mlp_adamw": dict(model="mlp", optimizer="adamw", lr=1e-3, weight_decay=0.01, epochs=8),
    "cnn_sgd": dict(model="cnn", hidden=64, optimizer="sgd", lr=0.05, momentum=0.9, epochs=12),
    "cnn_adamw": dict(model="cnn", hidden=64, optimizer="adamw", lr=1e-3, weight_decay=0.01,
                      epochs=6),
    "cnn_wide_sgd": dict(model="cnn_wide", optimizer="sgd", lr=0.02, momentum=0.9, epochs=4),
    "gpt_adamw": dict(model="gpt", hidden=128, optimizer="adamw", lr=3e-3, weight_decay=0.01,
                      lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=2,
                      batch_per_worker=16),
}
DEFAULT_WORKLOADS = ("mlp_sgd", "gpt_adamw")


def _names(kind: str, known):
    def parse(text: str) -> List[str]:
        names = [h.strip() for h in text.split(",") if h.strip()]
        unknown = [h for h in names if h not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {kind}(s) {unknown or text!r}; choose from "
                                             f"{', '.join(known)} (comma-separated)")
        return names
    return parse


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
    demo = argparse.ArgumentParser(prog="benchmarks/demo.py", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--workers", type=_number(int), default=2, help="local worker processes")
    demo.add_argument("--workloads", type=_names("workload", WORKLOADS),
                      default=list(DEFAULT_WORKLOADS),
                      help=f"comma-separated, from: {','.join(WORKLOADS)} (model_optimizer; the "
                           f"MLP has 85K parameters, the CNN is bound by compute, cnn_wide by "
                           f"the gradient exchange, gpt is a 0.8M-parameter transformer on text)")
    demo.add_argument("--hooks", type=_names("hook", HOOKS), default=None,
                      help=f"comma-separated, from: {','.join(HOOKS)} (default: "
                           f"{','.join(DEFAULT_HOOKS)}; with dynamic batching: "
                           f"{','.join(WEIGHTED_HOOKS)})")
    demo.add_argument("--epochs", type=_number(int), default=None,
                      help="epochs (default: each workload's own)")
    demo.add_argument("--lr", type=_number(float), default=None,
                      help="learning rate (default: each workload's own)")
    demo.add_argument("--ratio", type=_number(float), default=None,
                      help="recipe: target compression in [4, 256] (default: the recipe's own)")
    demo.add_argument("--powersgd-rank", dest="matrix_approximation_rank", type=_number(int),
                      default=4, help="powersgd: matrix approximation rank")
    demo.add_argument("--density", type=_number(float), default=0.01,
                      help="sparse (segment_sparse_hook, plain): fraction of segments sent")
    demo.add_argument("--segment-size", type=_number(int), default=256,
                      help="sparse: elements per segment")
    demo.add_argument("--keep-ratio", type=_number(float), default=0.125,
                      help="dct (dct_quant_hook): fraction of DCT coefficients sent")
    demo.add_argument("--bits", type=int, choices=(8, 16, 32), default=8,
                      help="dct: integer width on the wire")
    demo.add_argument("--slow-worker-cores", type=_number(float), default=None,
                      metavar="CORES", help="run the last worker under a CPU quota of this many "
                                            "cores (cgroup; needs root)")
    demo.add_argument("--batching", choices=BATCHING + ("both",), default="equal",
                      help="per-worker batch sizes: equal, proportional to measured speed "
                           "(re-planned every epoch), or one run of each")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="hetero_comm_demo", help="output directory")
    demo.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return demo


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    """The demo's runs by name (``workload/hook/batching``, each part only where the demo
    runs more than one), each validated."""
    batchings = list(BATCHING) if args.batching == "both" else [args.batching]
    hooks = args.hooks or list(WEIGHTED_HOOKS if "dynamic" in batchings else DEFAULT_HOOKS)
    for hook in HOOK_FLAGS:  # every hook's flags, also of hooks this run leaves out
        make_hook(hook, _hook_settings(args, hook))
    runs = {}
    for workload, hook, batching in itertools.product(args.workloads, hooks, batchings):
        settings = dict(WORKLOADS[workload])
        batch_per_worker = settings.pop("batch_per_worker", 32)
        for flag in ("epochs", "lr"):
            if getattr(args, flag) is not None:
                settings[flag] = getattr(args, flag)
        config = TrainConfig(hook=hook, workers=args.workers, global_batch=batch_per_worker * args.workers,
                             seed=args.seed, batching=batching,
                             slow_worker_cores=args.slow_worker_cores,
                             # torch's PowerSGD on gloo: one bucket (docs/design/hooks.md)
                             bucket_cap_mb=64 if hook == "powersgd" else None,
                             hook_settings=_hook_settings(args, hook),
                             **settings)
        config.validate()
        parts = [(workload, len(args.workloads)), (hook, 2), (batching, len(batchings))]
        runs["/".join(part for part, count in parts if count > 1)] = config
    return runs


def _hook_settings(args, hook: str) -> dict:
    """The settings ``hook``'s flags give (flags left at ``None`` give none)."""
    return {flag: getattr(args, flag) for flag in HOOK_FLAGS.get(hook, ())
            if getattr(args, flag) is not None}


def demo(args, runs: Dict[str, TrainConfig]) -> int:
    os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        tqdm = None
    slow = (f", last worker limited to {args.slow_worker_cores} cores"
            if args.slow_worker_cores else "")
    print(f"demo: {args.workers} workers (gloo, 127.0.0.1){slow}; "
          f"workloads {', '.join(args.workloads)}; runs: {', '.join(runs)}")
    records = {}
    for name, config in runs.items():
        bar = tqdm(total=config.epochs, desc=f"{name:18s}", unit="epoch") if tqdm else None

        def on_epoch(epoch, accuracy, bar=bar):
            if bar is not None:
                bar.update(epoch - bar.n)
                bar.set_postfix(test_acc=f"{accuracy:.3f}")

        started = time.perf_counter()
        try:
            record = run_training(config, on_epoch=on_epoch)
        finally:
            if bar is not None:
                bar.close()
        if not math.isfinite(record["epochs"]["test_loss"][-1]):
            # Training diverged (the hooks hand a non-finite gradient on as NaN, as DDP does):
            # report it and go on with the next hook.
            record = {"diverged": "the loss became NaN or infinite"}
        record["wall_seconds"] = time.perf_counter() - started
        record.update(hook=config.hook, batching=config.batching, workload=workload_of(config))
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


def workload_of(config: TrainConfig) -> str:
    return f"{config.model}_{config.optimizer}"


def format_table(records: dict) -> str:
    rows = [("workload", "hook", "batching", "val loss", "val accuracy", "bytes/step",
             "compression", "step time (ms)", "epoch time (s)", "batch per worker",
             "ranks identical")]
    for r in records.values():
        title = HOOKS[r["hook"]].title
        if "diverged" in r:
            rows.append((r["workload"], title, r["batching"], "diverged", *["-"] * 7))
            continue
        compression = r["dense_bytes_per_step"] / r["bytes_per_step"]
        step_ms = 1000 * statistics.median(r["history"]["seconds"])
        epoch_seconds = r["epochs"]["seconds"]
        epoch_s = statistics.median(epoch_seconds[1:] or epoch_seconds)
        rows.append((r["workload"], title, r["batching"], f"{r['epochs']['test_loss'][-1]:.3f}",
                     f"{100 * r['final_accuracy']:.1f}%", f"{r['bytes_per_step']:,.0f}",
                     f"{compression:.1f}x", f"{step_ms:.2f}", f"{epoch_s:.3f}",
                     "/".join(map(str, r["epochs"]["batch_sizes"][-1])),
                     "yes" if r["ranks_identical"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + ("\n\nval loss / accuracy: on held-out data after the last epoch "
                               "(for text: per next byte); bytes/step: what rank 0 handed to "
                               "collectives per step, averaged over the run (warm-up included); "
                               "step time: median; epoch time: median over the epochs after the "
                               "first (training only); batch per worker: in the last epoch, "
                               "worker 0 first.")


def _jsonable(record: dict) -> dict:
    skip = {"final_parameters"}
    return {k: v for k, v in record.items() if k not in skip}


def plot(records: dict, path: str) -> str:
    """Per workload (a row): validation loss against steps and against megabytes sent."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in records.values()})
    figure, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, workload in zip(axes, workloads):
        for r in records.values():
            if r["workload"] != workload or "diverged" in r:
                continue
            label = HOOKS[r["hook"]].title + (f" ({r['batching']})" if r["batching"] != "equal" else "")
            e = r["epochs"]
            row[0].plot(e["step"], e["test_loss"], marker="o", label=label)
            row[1].plot([b / 1e6 for b in e["bytes"]], e["test_loss"], marker="o", label=label)
        for ax, x in zip(row, ("step", "MB sent by rank 0 (log)")):
            ax.set_xlabel(x)
            ax.set_ylabel(f"{workload}: validation loss")
            ax.grid(alpha=0.3)
        row[1].set_xscale("log")
        row[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    sys.exit(main())
