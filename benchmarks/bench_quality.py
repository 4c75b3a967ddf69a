"""Is the one call as safe to try as DDP? Dense DDP against ``hetero_comm.compress`` on a matrix
of cells (issue 75): optimizers (AdamW, Adam, SGD with momentum, Nesterov, without momentum) x
schedules (cosine, linear decay, constant, constant after a warm-up, warm-up-stable-decay) x
models (the digits MLP, a CNN with BatchNorm, the ResNet with GroupNorm, the GRU, the small and
the large transformer) x ranks (2, 4, 8) x run lengths (100, 400, 2,000 steps), each from three
seeds. Not the full product: every value of every factor meets each optimizer family (Adam's
and SGD's), plus the cells that failed before (the issue's list). Gradient clipping at 1.0 where
the model's dense run uses it (the text models).

A cell trains dense and the one call from each seed, with the user's optimizer, rate and
schedule as given (the lab's hooks ``dense`` and ``recipe``), the same per-rank batch at every
number of ranks. It holds when the mean over seeds is within 2% of dense's loss (text) or 1
point of its accuracy (digits), at 16x or more; and the one call's spread over seeds (max -
min) is at most twice dense's, or 1% of the loss / 0.5 points where dense's is smaller.

``--held-out`` runs the cells that the matrix does not name (other models, schedules and
rates), fixed on 2026-12-07 before any tuning on the matrix and kept out of it.

Prints one table; ``--json PATH`` keeps every run (cell, seed, hook), and runs already there
are not run again, so the matrix can be run in parts (``--cells a,b``, ``--models``,
``--optimizers``) and the table printed over all of them (``--table``).

Usage: python benchmarks/bench_quality.py [--cells NAME,...] [--models mlp,cnn_bn]
       [--optimizers adamw,sgd] [--seeds 0,1,2] [--held-out] [--long] [--steps N] [--json PATH]
       [--rerun-one-call] [--variant '{"density": 0.25}']
       python benchmarks/bench_quality.py --json PATH --table
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

import torch

from bench_generality import cpu_model, train
from lab.training import TrainConfig
from hetero_comm.recipes import recipe_for

# The model's workload at 2 ranks (the global batch grows with the ranks).
MODELS = {
    "mlp": dict(model="mlp", hidden=256, global_batch=64),
    "mlp_wide": dict(model="mlp", hidden=512, global_batch=64),  # (held out)
    "cnn": dict(model="cnn", hidden=64, global_batch=64),  # (held out: no normalization)
    "cnn_bn": dict(model="cnn_bn", hidden=256, global_batch=64),  # 29K parameters
    "resnet": dict(model="resnet", hidden=256, global_batch=64),
    "gru": dict(model="gru", hidden=128, global_batch=32, clip_norm=1.0),
    "gpt": dict(model="gpt", hidden=128, global_batch=32, clip_norm=1.0),
    "gpt_large": dict(model="gpt", hidden=416, global_batch=32, clip_norm=1.0),
}
TEXT_MODELS = ("gru", "gpt", "gpt_large")
OPTIMIZERS = {
    "adamw": dict(optimizer="adamw", weight_decay=0.01),
    "adam": dict(optimizer="adam"),
    "sgd": dict(optimizer="sgd", momentum=0.9),
    "nesterov": dict(optimizer="sgd", momentum=0.9, nesterov=True),
    "sgd_plain": dict(optimizer="sgd", momentum=0.0),
}
FAMILY = {"adamw": "adam", "adam": "adam", "sgd": "sgd", "nesterov": "sgd", "sgd_plain": "sgd"}
WARMUP_STEPS = 30
SCHEDULES = {
    "cosine": dict(lr_warmup_steps=WARMUP_STEPS, lr_schedule="cosine"),
    "linear": dict(lr_warmup_steps=WARMUP_STEPS, lr_schedule="linear"),
    "constant": dict(lr_warmup_steps=0, lr_schedule="constant"),
    "warmup_constant": dict(lr_warmup_steps=WARMUP_STEPS, lr_schedule="constant"),
    "wsd": dict(lr_warmup_steps=WARMUP_STEPS, lr_schedule="wsd"),
    "step": dict(lr_warmup_steps=0, lr_schedule="step"),  # (held out)
}


def _cell(model, optimizer, schedule, lr, ranks, steps, why=""):
    return dict(model=model, optimizer=optimizer, schedule=schedule, lr=lr, ranks=ranks,
                steps=steps, why=why)


# name -> cell. "why" names the failure the issue listed where the cell reproduces one.
CELLS = {
    # the Adam family
    "mlp_adamw_constant_3e-3": _cell("mlp", "adamw", "constant", 3e-3, 2, 200,
                                     "the README's snippet at a constant rate: +29-70%"),
    "mlp_adamw_constant_1e-3": _cell("mlp", "adamw", "constant", 1e-3, 2, 200),
    "mlp_adamw_constant_2000": _cell("mlp", "adamw", "constant", 1e-3, 2, 2000),
    "mlp_adam_cosine": _cell("mlp", "adam", "cosine", 3e-3, 4, 400),
    "cnn_bn_adamw_warmup_constant": _cell("cnn_bn", "adamw", "warmup_constant", 3e-3, 2, 400),
    "cnn_bn_adam_linear_100": _cell("cnn_bn", "adam", "linear", 3e-3, 4, 100),
    "resnet_adamw_constant": _cell("resnet", "adamw", "constant", 3e-3, 4, 400,
                                   "AdamW at a constant rate on the ResNet: -0.8 to -2.0 points"),
    "resnet_adamw_cosine_8_100": _cell("resnet", "adamw", "cosine", 3e-3, 8, 100,
                                       "100 steps at 8 ranks: -14 to -17 points"),
    "gru_adamw_wsd": _cell("gru", "adamw", "wsd", 3e-3, 2, 400),
    "gpt_adamw_linear": _cell("gpt", "adamw", "linear", 3e-3, 2, 400),
    "gpt_adam_constant_8": _cell("gpt", "adam", "constant", 1e-3, 8, 400),
    "gpt_large_adamw_cosine_8": _cell("gpt_large", "adamw", "cosine", 3e-4, 8, 204,
                                      "the large transformer at 8 ranks, 204 steps: +5.9%"),
    # the SGD family
    "mlp_sgd_constant": _cell("mlp", "sgd", "constant", 0.05, 2, 400,
                              "SGD on the MLP: 0.1 to 2.7 points below over seeds"),
    "mlp_sgd_cosine_2000": _cell("mlp", "sgd", "cosine", 0.05, 2, 2000),
    "mlp_sgd_plain_linear": _cell("mlp", "sgd_plain", "linear", 0.1, 4, 400),
    "mlp_sgd_warmup_constant_8_100": _cell("mlp", "sgd", "warmup_constant", 0.05, 8, 100),
    "cnn_bn_sgd_constant": _cell("cnn_bn", "sgd", "constant", 0.05, 2, 300,
                                 "SGD on a CNN with BatchNorm: -4.8 to +0.2 points"),
    "cnn_bn_nesterov_wsd": _cell("cnn_bn", "nesterov", "wsd", 0.05, 2, 400),
    "resnet_sgd_constant": _cell("resnet", "sgd", "constant", 0.05, 4, 400,
                                 "SGD at a constant rate on the ResNet at 4 ranks: -7.4 to -12.8"),
    "resnet_nesterov_cosine": _cell("resnet", "nesterov", "cosine", 0.05, 2, 400),
    "resnet_sgd_linear_200": _cell("resnet", "sgd", "linear", 0.05, 4, 200,
                                   "found on 2026-12-07: the ResNet with SGD in 200 steps"),
    "resnet_nesterov_cosine_200": _cell("resnet", "nesterov", "cosine", 0.05, 4, 200,
                                        "found on 2026-12-07: the ResNet with SGD in 200 steps"),
    "gru_sgd_cosine": _cell("gru", "sgd", "cosine", 1.0, 2, 400,
                            "SGD on the GRU: +2.3 to +10.6%"),
    "gpt_sgd_cosine": _cell("gpt", "sgd", "cosine", 0.3, 2, 400,
                            "SGD on the transformer: +7 to +21%"),
}
# Fixed before tuning (models, schedules and rates the matrix does not name); never tuned on.
HELD_OUT = {
    "held_cnn_adamw_step": _cell("cnn", "adamw", "step", 2e-3, 2, 300),
    "held_mlp_wide_adam_constant": _cell("mlp_wide", "adam", "constant", 5e-4, 4, 300),
    "held_cnn_sgd_step": _cell("cnn", "sgd", "step", 0.03, 2, 300),
    "held_gru_adamw_constant": _cell("gru", "adamw", "constant", 5e-3, 2, 300),
    "held_resnet_nesterov_linear": _cell("resnet", "nesterov", "linear", 0.03, 4, 200),
    "held_cnn_bn_adamw_cosine_8": _cell("cnn_bn", "adamw", "cosine", 2e-3, 8, 200),
}
LONG_MODELS = ("gpt_large",)  # run only with --long (a run takes 10-30 minutes here)
MAX_LOSS_GAP_PERCENT = 2.0
MAX_ACCURACY_DROP_POINTS = 1.0
MIN_COMPRESSION = 16.0
# dense's own spread below these: the one call's may reach them
SPREAD_FLOOR_PERCENT, SPREAD_FLOOR_POINTS = 1.0, 0.5


def options_of(cell: dict, seed: int) -> dict:
    """The lab's run options of ``cell`` from ``seed``."""
    options = dict(MODELS[cell["model"]], **OPTIMIZERS[cell["optimizer"]],
                   **SCHEDULES[cell["schedule"]], lr=cell["lr"], workers=cell["ranks"],
                   seed=seed, max_steps=cell["steps"], epochs=100_000)
    options["global_batch"] = options["global_batch"] // 2 * cell["ranks"]
    options["lr_warmup_steps"] = min(options["lr_warmup_steps"], cell["steps"] // 4)
    return options


def run_key(name: str, cell: dict, seed: int, hook: str) -> str:
    return f"{name}|{cell['steps']}|{seed}|{hook}"


def source_commit() -> Optional[str]:
    """The checkout's commit (with ``+`` where its tracked files differ from it), or None."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None
    changed = git("diff", "--quiet", "HEAD", "--", "hetero_comm", "benchmarks",
                  ":(exclude)benchmarks/results").returncode != 0
    return head.stdout.strip() + ("+" if changed else "")


def variant_settings(cell: dict, changes: dict) -> dict:
    """The one call's recipe for the cell's optimizer (as the lab builds it) with ``changes`` to
    its settings (the lower-level state's keyword arguments), for trying a change to the
    recipes on the matrix."""
    config = TrainConfig(hook="recipe", **options_of(cell, seed=0))
    optimizer, _ = config.make_optimizer([torch.nn.Parameter(torch.zeros(1))], cell["steps"])
    return dict(recipe_for(optimizer).settings, **changes)


def run_cells(cells: Dict[str, dict], seeds: List[int], records: dict,
              json_path: Optional[str], variant: Optional[dict] = None) -> None:
    """Train every (cell, seed, hook) not yet in ``records``, saving after each run; with
    ``variant``, the one call's runs are the recipe with those changes (the lower-level state
    and ``prepare_optimizer``, as the one call sets them up)."""
    for name, cell in cells.items():
        for seed in seeds:
            for hook in ("dense", "recipe"):
                key = run_key(name, cell, seed, hook)
                if key in records:
                    continue
                print(f"  {name}, seed {seed}, {hook} ...", file=sys.stderr, flush=True)
                if hook == "recipe" and variant is not None:
                    run = train(dict(options_of(cell, seed), prepare_optimizer=True), "sparse",
                                variant_settings(cell, variant))
                else:
                    run = train(options_of(cell, seed), hook)
                run.pop("curve", None)
                records[key] = dict(run, cell=cell, seed=seed, hook=hook, commit=source_commit(),
                                    **({"variant": variant} if hook == "recipe" and variant else {}),
                                    date=datetime.datetime.now(datetime.timezone.utc)
                                    .isoformat(timespec="seconds"), machine=cpu_model())
                if json_path:
                    with open(json_path, "w") as f:
                        json.dump(records, f, indent=1)


def summarize(name: str, cell: dict, records: dict) -> Optional[dict]:
    """The cell's means, gaps, spreads and verdict over the seeds both hooks ran."""
    seeds = sorted({r["seed"] for key, r in records.items()
                    if key.startswith(f"{name}|{cell['steps']}|")})
    pairs = [(records.get(run_key(name, cell, s, "dense")),
              records.get(run_key(name, cell, s, "recipe"))) for s in seeds]
    pairs = [(d, r) for d, r in pairs if d is not None and r is not None]
    if not pairs:
        return None
    text = cell["model"] in TEXT_MODELS
    diverged = [hook for hook, index in (("dense", 0), ("one call", 1))
                if any(pair[index]["diverged"] for pair in pairs)]
    summary = dict(name=name, cell=cell, seeds=len(pairs), text=text, diverged=diverged)
    if diverged:
        return dict(summary, verdict=f"not yet ({' and '.join(diverged)} diverged)")

    def metric(run):
        return run["loss"] if text else 100 * run["accuracy"]

    dense = [metric(d) for d, _ in pairs]
    recipe = [metric(r) for _, r in pairs]
    gaps = [100 * (r / d - 1) if text else r - d for d, r in zip(dense, recipe)]
    mean_dense, mean_recipe = statistics.mean(dense), statistics.mean(recipe)
    gap = 100 * (mean_recipe / mean_dense - 1) if text else mean_recipe - mean_dense
    compression = statistics.mean(r["compression"] for _, r in pairs)
    dense_spread, recipe_spread = max(dense) - min(dense), max(recipe) - min(recipe)
    floor = SPREAD_FLOOR_PERCENT / 100 * mean_dense if text else SPREAD_FLOOR_POINTS
    spread_ok = recipe_spread <= max(2 * dense_spread, floor)
    misses = [what for what, missed in (
        ("quality", gap > MAX_LOSS_GAP_PERCENT if text else gap < -MAX_ACCURACY_DROP_POINTS),
        ("compression", compression < MIN_COMPRESSION),
        ("spread", len(pairs) > 1 and not spread_ok)) if missed]
    return dict(summary, dense=mean_dense, recipe=mean_recipe, gap=gap, gaps=gaps,
                dense_spread=dense_spread, recipe_spread=recipe_spread, compression=compression,
                verdict=f"not yet ({', '.join(misses)})" if misses else "ok")


def table(cells: Dict[str, dict], records: dict) -> str:
    lines = ["| cell | model | optimizer | schedule | lr | ranks | steps | seeds | dense | one call | "
             "gap (mean; per seed) | spread: dense, one call | compression | verdict | "
             "failed before |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cell in cells.items():
        s = summarize(name, cell, records)
        if s is None:
            continue
        head = (f"| {name} | {cell['model']} | {cell['optimizer']} | {cell['schedule']} | "
                f"{cell['lr']:g} | {cell['ranks']} | {cell['steps']} | {s['seeds']} |")
        if s["diverged"]:
            lines.append(f"{head} | | | | | {s['verdict']} | {cell['why']} |")
            continue
        unit, fmt = ("%", "{:.3f}") if s["text"] else (" pts", "{:.1f}%")
        per_seed = ", ".join(f"{g:+.1f}" for g in s["gaps"])
        spread = (f"{100 * s['dense_spread'] / s['dense']:.1f}%, {100 * s['recipe_spread'] / s['dense']:.1f}%"
                  if s["text"] else f"{s['dense_spread']:.1f}, {s['recipe_spread']:.1f} pts")
        lines.append(f"{head} {fmt.format(s['dense'])} | {fmt.format(s['recipe'])} | "
                     f"{s['gap']:+.1f}{unit}; {per_seed} | {spread} | {s['compression']:.1f}x | "
                     f"{s['verdict']} | {cell['why']} |")
    lines.append("")
    for title, names in (("matrix", [n for n in cells if n in CELLS]),
                         ("held-out", [n for n in cells if n in HELD_OUT])):
        verdicts = [s["verdict"] for s in (summarize(n, cells[n], records) for n in names) if s]
        if verdicts:
            lines.append(f"{title}: {verdicts.count('ok')} of {len(verdicts)} cells run hold (loss within "
                         f"{MAX_LOSS_GAP_PERCENT:g}% / accuracy within {MAX_ACCURACY_DROP_POINTS:g} point, "
                         f"{MIN_COMPRESSION:g}x or more, spread at most twice dense's or "
                         f"{SPREAD_FLOOR_PERCENT:g}% / {SPREAD_FLOOR_POINTS:g} points)")
    return "\n".join(lines)


def chosen_cells(args) -> Dict[str, dict]:
    cells = dict(HELD_OUT) if args.held_out else dict(CELLS)
    if args.cells:
        names = args.cells.split(",")
        unknown = [n for n in names if n not in CELLS and n not in HELD_OUT]
        if unknown:
            raise SystemExit(f"unknown cells {unknown}; known: {', '.join([*CELLS, *HELD_OUT])}")
        cells = {n: {**CELLS, **HELD_OUT}[n] for n in names}
    if args.models:
        cells = {n: c for n, c in cells.items() if c["model"] in args.models.split(",")}
    if args.optimizers:
        cells = {n: c for n, c in cells.items() if c["optimizer"] in args.optimizers.split(",")}
    if not args.long and not args.cells:
        cells = {n: c for n, c in cells.items() if c["model"] not in LONG_MODELS}
    if args.steps:
        cells = {n: dict(c, steps=args.steps) for n, c in cells.items()}
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", help="cell names, comma-separated (default: every cell)")
    parser.add_argument("--models", help="only cells of these models")
    parser.add_argument("--optimizers", help="only cells of these optimizers")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--held-out", action="store_true", help="the held-out cells instead")
    parser.add_argument("--long", action="store_true",
                        help=f"include the cells of {', '.join(LONG_MODELS)} (10-30 min a run)")
    parser.add_argument("--steps", type=int, help="every cell this many steps (a smoke run)")
    parser.add_argument("--json", help="keep every run here; runs already in it are not run again")
    parser.add_argument("--table", action="store_true", help="run nothing: the table of --json")
    parser.add_argument("--variant", type=json.loads,
                        help="a JSON dict of changes to the recipe's settings (e.g. "
                             "'{\"density\": 0.25}'): the one call's runs are that variant; "
                             "keep them in their own --json")
    parser.add_argument("--rerun-one-call", action="store_true",
                        help="run the one call again in the chosen cells (after a change to the "
                             "recipes; dense's runs are kept)")
    args = parser.parse_args()
    cells = chosen_cells(args)
    records = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            records = json.load(f)
    if args.rerun_one_call and not args.table:
        seeds = [int(s) for s in args.seeds.split(",")]
        for name, cell in cells.items():
            for seed in seeds:
                records.pop(run_key(name, cell, seed, "recipe"), None)
    if not args.table:
        run_cells(cells, [int(s) for s in args.seeds.split(",")], records, args.json,
                  args.variant)
    if args.table and not (args.cells or args.models or args.optimizers or args.held_out):
        cells = {**CELLS, **HELD_OUT}
    print(f"# python {' '.join(sys.argv)}  ({cpu_model()}, {os.cpu_count()} cores)")
    print(table(cells, records))


if __name__ == "__main__":
    main()
