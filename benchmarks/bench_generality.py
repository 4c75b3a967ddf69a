"""Do the recipes hold on models they were not tuned on? Dense against the one-call recipe
(issue 34, "Proof: Generality") on a small residual CNN on the digits (``resnet``), a
byte-level GRU language model on the transformer's text (``gru``) and bench_convergence's
transformer at 10x its size (``gpt_large``: width 416, 8.46M parameters), with AdamW and with SGD
(momentum 0.9; ``sgd_nesterov``: Nesterov's), at several learning rates and at 2 and 4 gloo ranks; ``resnet_cosine`` is the
ResNet with the others' warm-up and cosine schedule.

Each case trains the model twice from the same seed: dense allreduce, and the recipe for its
optimizer as a user runs it: ``hetero_comm.compress`` on the DDP model and the dense optimizer,
rate and schedule (the lab's hook ``"recipe"``; cases measured before it ran the same recipe
written out, which ``tests/test_compress.py`` shows trains bitwise alike). The global batch grows with the ranks (the same per-rank
batch). The ResNet (38K parameters) trains 20 epochs at a constant rate; the GRU (165K
parameters) and the large transformer 4 epochs with a warm-up of 30 steps, a cosine schedule
and clipping 1.0 (as ``bench_convergence.py``'s transformer). One seed per case, or ``--seeds N``
(seeds 0..N-1; the table shows the means, and the gaps' range over seeds paired by seed).

Prints one table: final validation loss and accuracy of both, the recipe's loss gap (%) and
accuracy gap (points) to dense, its compression (dense bytes per step / bytes per step), and
a verdict: "ok" within 2% loss and 1 point accuracy of dense at 25x or more, else "not yet"
with what it missed.

``--baselines powersgd_1,demo_k2`` also trains the peers from each seed, beside the recipe:
torch's PowerSGD at rank 1 (one bucket, as bench_convergence runs it) and DeMo (the lab's
baseline written from its paper, top 2 of every 64 DCT components; AdamW only, at the AdamW
recipe's rate and decay, as bench_convergence runs it). Their loss and accuracy gaps to dense
and their compression (and, where counted, compression on the link) go in one more column.

``--json PATH`` keeps every case's record; cases already in that file are not run again, so a
sweep can be run in parts and the table printed over all of them (``--fresh`` ignores the file).

Usage: python benchmarks/bench_generality.py [--models resnet,gru,gpt_large] [--optimizers adamw,sgd]
       [--lrs 1e-3,3e-3] [--ranks 2,4] [--epochs N] [--seeds N] [--ratio R] [--json PATH] [--fresh]
       [--baselines powersgd_1,demo_k2] [--quick]
       python benchmarks/bench_generality.py --json PATH --table   (the table only)
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional

from hetero_comm.hooks.segment_sparse import SIGN_LR_SCALE
from lab.training import TrainConfig, run_training

OPTIMIZERS = {  # the dense optimizer's settings, as the user has them
    "adamw": dict(optimizer="adamw", weight_decay=0.01),
    "sgd": dict(optimizer="sgd", momentum=0.9),
    "sgd_nesterov": dict(optimizer="sgd", momentum=0.9, nesterov=True),
}
# Per model: its workload at 2 ranks (global_batch scales with the ranks) and its default rates.
MODELS = {
    "resnet": dict(model="resnet", hidden=256, epochs=20, global_batch=64),  # 38K parameters
    # the same with a warm-up and a cosine schedule, as the GRU and the transformer have
    "resnet_cosine": dict(model="resnet", hidden=256, epochs=20, global_batch=64,
                          lr_warmup_steps=30, lr_schedule="cosine"),
    "gru": dict(model="gru", hidden=128, epochs=4, global_batch=32, lr_warmup_steps=30,
                lr_schedule="cosine", clip_norm=1.0),  # 165K parameters
    # bench_convergence's transformer at width 416: 8.46M parameters, 10.1x its 0.83M
    "gpt_large": dict(model="gpt", hidden=416, epochs=4, global_batch=32, lr_warmup_steps=30,
                      lr_schedule="cosine", clip_norm=1.0),
}
LRS = {
    ("resnet", "adamw"): (1e-3, 3e-3, 1e-2),
    ("resnet", "sgd"): (0.02, 0.05, 0.1),
    ("resnet_cosine", "adamw"): (1e-3, 3e-3, 1e-2),
    ("resnet_cosine", "sgd"): (0.02, 0.05, 0.1),
    ("gru", "adamw"): (1e-3, 3e-3, 1e-2),
    ("gru", "sgd"): (0.3, 1.0, 3.0),
    ("gpt_large", "adamw"): (3e-4, 1e-3, 3e-3),
    ("gpt_large", "sgd"): (0.1, 0.3, 1.0),
}
LRS.update({(model, "sgd_nesterov"): rates for (model, optimizer), rates in list(LRS.items())
            if optimizer == "sgd"})
# Peers trained beside the recipe with --baselines: title, the lab's hook, its settings.
BASELINES = {
    "powersgd_1": ("PowerSGD 1", "powersgd", dict(matrix_approximation_rank=1)),
    "demo_k2": ("DeMo 2/64", "demo", dict(chunk=64, top_k=2)),
}
MAX_LOSS_GAP_PERCENT = 2.0
MAX_ACCURACY_DROP_POINTS = 1.0
MIN_COMPRESSION = 25.0


def train(options: dict, hook: str, settings: Optional[dict] = None) -> dict:
    """One run with ``hook`` ("dense", "recipe" or a baseline's, with its ``settings``). A run
    whose final loss is not finite is recorded as diverged."""
    config = TrainConfig(hook=hook, **options) if settings is None else \
        TrainConfig(hook=hook, hook_settings=settings, **options)
    began = time.perf_counter()
    record = run_training(config, timeout=3600)  # a non-finite gradient reaches the loss as NaN
    loss = record["epochs"]["test_loss"][-1]
    return dict(diverged=not math.isfinite(loss), loss=loss, accuracy=record["final_accuracy"],
                steps=record["steps"], bytes_per_step=record["bytes_per_step"],
                dense_bytes_per_step=record["dense_bytes_per_step"],
                compression=record["dense_bytes_per_step"] / record["bytes_per_step"],
                link_compression=(record["dense_link_bytes_per_step"] / record["link_bytes_per_step"]
                                  if record["link_bytes_per_step"] else None),
                ranks_identical=record["ranks_identical"], curve=record["epochs"],
                wall_seconds=time.perf_counter() - began)


def baseline_options(name: str, options: dict) -> Optional[dict]:
    """The run options of baseline ``name`` for a case's ``options``; None where it does not
    apply (DeMo steps by a sign: AdamW only)."""
    hook = BASELINES[name][1]
    if hook == "powersgd":  # torch's hook with several buckets can issue collectives out of order on gloo
        return dict(options, bucket_cap_mb=64)
    if options["optimizer"] != "adamw":
        return None
    return dict(options, lr=options["lr"] * SIGN_LR_SCALE,
                weight_decay=options["weight_decay"] / SIGN_LR_SCALE)


def run_case(model: str, optimizer: str, lr: float, ranks: int, epochs: Optional[int],
             quick: bool, seeds: int = 1, ratio: Optional[float] = None,
             baselines: tuple = ()) -> dict:
    """Dense and the recipe (and ``baselines``, names in :data:`BASELINES`) from each of
    ``seeds`` seeds (0, 1, ...); with several, ``dense``, ``recipe_run`` and each baseline's
    run hold their means and ``per_seed`` every run. ``ratio``: the recipe at
    ``compress(ratio=...)`` instead of its own."""
    options = dict(MODELS[model], **OPTIMIZERS[optimizer], lr=lr, workers=ranks)
    options["global_batch"] = options["global_batch"] // 2 * ranks
    if epochs is not None:
        options["epochs"] = epochs
    if quick:
        options.update(epochs=1, max_steps=10, lr_warmup_steps=0)
    recipe_options = dict(options, hook_settings=dict(ratio=ratio)) if ratio else options
    case = dict(model=model, optimizer=optimizer, lr=lr, ranks=ranks, ratio=ratio, options=options,
                recipe="hetero_comm.compress", command="python " + " ".join(sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    applying = {name: baseline_options(name, options) for name in baselines}
    applying = {name: settings for name, settings in applying.items() if settings is not None}
    runs = [dict(seed=seed, dense=train(dict(options, seed=seed), "dense"),
                 recipe_run=train(dict(recipe_options, seed=seed), "recipe"),
                 baselines={name: train(dict(baseline, seed=seed), BASELINES[name][1], BASELINES[name][2])
                            for name, baseline in applying.items()})
            for seed in range(seeds)]
    if baselines:
        case["baselines_asked"] = list(baselines)
    if seeds == 1:
        case.update(dense=runs[0]["dense"], recipe_run=runs[0]["recipe_run"])
        if applying:
            case["baselines"] = runs[0]["baselines"]
    else:
        case.update(seeds=seeds, per_seed=runs, dense=mean_run([r["dense"] for r in runs]),
                    recipe_run=mean_run([r["recipe_run"] for r in runs]))
        if applying:
            case["baselines"] = {name: mean_run([r["baselines"][name] for r in runs]) for name in applying}
    case.update(judge(case["dense"], case["recipe_run"]))
    return case


def mean_run(runs: List[dict]) -> dict:
    """One record for several seeds' runs: diverged if any did, else the mean loss, accuracy and
    compression (on the link too, where every run counted it); the summed wall time."""
    wall = sum(run["wall_seconds"] for run in runs)
    if any(run["diverged"] for run in runs):
        return dict(diverged=True, wall_seconds=wall)
    links = [run.get("link_compression") for run in runs]
    return dict(diverged=False, wall_seconds=wall,
                link_compression=statistics.mean(links) if None not in links else None,
                **{field: statistics.mean(run[field] for run in runs)
                   for field in ("loss", "accuracy", "compression")})


def seed_gaps(case: dict) -> str:
    """The range over seeds of the loss gap (%) and accuracy gap (points), paired by seed."""
    pairs = [(r["dense"], r["recipe_run"]) for r in case.get("per_seed", ())
             if not (r["dense"]["diverged"] or r["recipe_run"]["diverged"])]
    if len(pairs) < 2:
        return ""
    loss = [100 * (recipe["loss"] / dense["loss"] - 1) for dense, recipe in pairs]
    accuracy = [100 * (recipe["accuracy"] - dense["accuracy"]) for dense, recipe in pairs]
    return (f"{min(loss):+.1f}..{max(loss):+.1f}% / "
            f"{min(accuracy):+.1f}..{max(accuracy):+.1f} points")


def judge(dense: dict, recipe: dict) -> Dict[str, object]:
    if dense["diverged"] or recipe["diverged"]:
        which = " and ".join(name for name, run in (("dense", dense), ("recipe", recipe))
                             if run["diverged"])
        return dict(loss_gap_percent=None, accuracy_gap_points=None,
                    verdict=f"not yet ({which} diverged)")
    loss_gap = 100 * (recipe["loss"] / dense["loss"] - 1)
    accuracy_gap = 100 * (recipe["accuracy"] - dense["accuracy"])
    misses = [what for what, missed in (("loss", loss_gap > MAX_LOSS_GAP_PERCENT),
                                        ("accuracy", accuracy_gap < -MAX_ACCURACY_DROP_POINTS),
                                        ("compression", recipe["compression"] < MIN_COMPRESSION))
              if missed]
    return dict(loss_gap_percent=loss_gap, accuracy_gap_points=accuracy_gap,
                verdict=f"not yet ({', '.join(misses)})" if misses else "ok")


def key(case: dict) -> tuple:
    return (case["model"], case["optimizer"], float(case["lr"]), int(case["ranks"]),
            int(case["options"]["epochs"]), int(case.get("seeds", 1)), float(case.get("ratio") or 0),
            tuple(case.get("baselines_asked", ())))


def baselines_cell(case: dict) -> str:
    """Each baseline's loss gap (%) and accuracy gap (points) to dense, and its compression (and
    on the link, where it was counted: an all-gather sends W - 1 times what a rank hands in)."""
    dense, parts = case["dense"], []
    for name, run in case.get("baselines", {}).items():
        title = BASELINES[name][0]
        if run["diverged"] or dense["diverged"]:
            parts.append(f"{title}: diverged" if run["diverged"] else f"{title}: {run['compression']:.0f}x")
            continue
        link = run.get("link_compression")
        compression = f"{run['compression']:.0f}x" + (f", {link:.0f}x on the link" if link else "")
        parts.append(f"{title}: {100 * (run['loss'] / dense['loss'] - 1):+.1f}% / "
                     f"{100 * (run['accuracy'] - dense['accuracy']):+.1f} ({compression})")
    return "; ".join(parts)


def cell(run: dict) -> str:
    if run["diverged"]:
        return "diverged | "
    return f"{run['loss']:.3f} | {100 * run['accuracy']:.1f}%"


def table(cases: List[dict]) -> str:
    lines = ["| model | optimizer | lr | ranks | epochs | seeds | dense val loss | dense val acc | "
             "recipe val loss | recipe val acc | loss gap % | acc gap, points | compression | verdict | "
             "gaps over seeds | wall s (dense, recipe) | baselines: loss gap / acc gap (compression) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cases, key=key):
        dense, recipe = c["dense"], c["recipe_run"]
        c = dict(c, **judge(dense, recipe))  # by this script's thresholds, not the file's
        gaps = ("|" if c["loss_gap_percent"] is None else
                f"{c['loss_gap_percent']:+.1f} | {c['accuracy_gap_points']:+.1f}")
        compression = "" if recipe["diverged"] else f"{recipe['compression']:.1f}x"
        if c.get("ratio"):
            compression += f" (ratio={c['ratio']:g})"
        lines.append(f"| {c['model']} | {c['optimizer']} | {c['lr']:g} | {c['ranks']} | {c['options']['epochs']} | "
                     f"{c.get('seeds', 1)} | {cell(dense)} | "
                     f"{cell(recipe)} | {gaps} | {compression} | {c['verdict']} | {seed_gaps(c)} | "
                     f"{dense['wall_seconds']:.0f}, {recipe['wall_seconds']:.0f} | {baselines_cell(c)} |")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"of: {', '.join(MODELS)}")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"of: {', '.join(OPTIMIZERS)}")
    parser.add_argument("--lrs", default=None,
                        help="comma-separated learning rates for every model and optimizer "
                             "(default: LRS, per model and optimizer)")
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per case (0, 1, ...): the table shows their means")
    parser.add_argument("--baselines", default="",
                        help=f"peers trained beside the recipe, of: {', '.join(BASELINES)}")
    parser.add_argument("--ratio", type=float, default=None,
                        help="the recipe at compress(ratio=RATIO) instead of its own (a separate case)")
    parser.add_argument("--json", default=None, help="records of every case (read first, then extended)")
    parser.add_argument("--fresh", action="store_true", help="ignore cases already in --json")
    parser.add_argument("--quick", action="store_true", help="10 steps per run (a smoke test)")
    parser.add_argument("--table", action="store_true", help="run nothing: the table of --json's cases")
    args = parser.parse_args()
    for name, chosen, known in (("models", args.models, MODELS), ("optimizers", args.optimizers, OPTIMIZERS)):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1; got {args.seeds}")
    unknown = set(args.baselines.split(",")) - set(BASELINES) if args.baselines else set()
    if unknown:
        parser.error(f"--baselines: unknown {', '.join(sorted(unknown))}; known: {', '.join(BASELINES)}")
    if args.table and not (args.json and os.path.exists(args.json)):
        parser.error("--table needs --json with cases in it")
    return args


def run_sweep(args: argparse.Namespace, cases: List[dict]) -> None:
    """Run every case the arguments name that ``cases`` lacks, appending each (and saving the
    list to ``--json`` after each, so a sweep cut short keeps what it measured)."""
    done = {key(c) for c in cases}
    baselines = tuple(sorted(args.baselines.split(","))) if args.baselines else ()
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            lrs = [float(lr) for lr in args.lrs.split(",")] if args.lrs else LRS[model, optimizer]
            for lr in lrs:
                for ranks in (int(r) for r in args.ranks.split(",")):
                    epochs = 1 if args.quick else args.epochs or MODELS[model]["epochs"]
                    if (model, optimizer, float(lr), ranks, epochs, args.seeds, args.ratio or 0.0,
                            baselines) in done:
                        print(f"  kept: {model}, {optimizer}, lr {lr:g}, {ranks} ranks", file=sys.stderr)
                        continue
                    case = run_case(model, optimizer, lr, ranks, args.epochs, args.quick, args.seeds,
                                    args.ratio, baselines)
                    cases.append(case)
                    print(f"  done: {model}, {optimizer}, lr {lr:g}, {ranks} ranks: {case['verdict']} "
                          f"({case['dense']['wall_seconds']:.0f} s + {case['recipe_run']['wall_seconds']:.0f} s)",
                          file=sys.stderr, flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(cases, f, indent=1)


def main() -> int:
    args = parse_args()
    cases: List[dict] = []
    if args.json and os.path.exists(args.json) and not args.fresh:
        with open(args.json) as f:
            cases = json.load(f)
    print("python " + " ".join(sys.argv))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {cpu_model()}; "
          f"{os.cpu_count()} logical CPUs", flush=True)
    if not args.table:
        run_sweep(args, cases)
    measured = sorted({c["date"][:16] for c in cases})
    if args.table:
        print("cases measured by: " + "; ".join(dict.fromkeys(c["command"] for c in cases)))
    if measured:
        print(f"cases measured {measured[0]} .. {measured[-1]} UTC, the seeds each case names "
              f"(several: their means; gaps over seeds paired by seed); ok = within "
              f"{MAX_LOSS_GAP_PERCENT:g}% loss and {MAX_ACCURACY_DROP_POINTS:g} point accuracy of "
              f"dense at >= {MIN_COMPRESSION:g}x (a recipe below dense loss or above its accuracy is within)")
    print(table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
