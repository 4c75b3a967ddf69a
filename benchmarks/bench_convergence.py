"""Does compressed sync converge where people train? Final validation loss (and accuracy) of
every hook against dense, on several workloads and optimizers, at 2 to 16 gloo ranks.

Workloads:
* ``gpt_adamw``: a byte-level transformer (0.83M parameters) on real text (Python's pydoc
  topics), AdamW at 3e-3 with linear warm-up and a cosine schedule, clipping 1.0;
  ``gpt_adamw_0.001`` the same at 1e-3; ``gpt_large_adamw`` (1e-3) and
  ``gpt_large_adamw_0.0003`` the transformer at about ten times the size (width 416, 8.46M
  parameters, bench_generality's ``gpt_large``);
* ``digits_sgd_<lr>``: the digits MLP with SGD, momentum 0.9, at lr 0.02, 0.05 and 0.1;
* ``cnn_sgd``: the digits CNN (13.8K parameters), SGD lr 0.05, momentum 0.9, 12 epochs (at 4
  ranks 132 steps; at 6 the recipe fell 1.4-7 points behind there, docs/recipes.md "Not yet").

Rows ``recipe_adamw`` and ``recipe_sgd`` are the recipes as users run them: one call,
``hetero_comm.compress``, on the workload's DDP model and dense optimizer (rate and schedule
unchanged). ``recipe_sgd`` cuts a bucket that segments of 512 would cut into fewer than 150
into smaller segments (``min_segments_per_bucket``: 64 on the CNN); ``recipe_sgd_s512`` keeps
512 everywhere and ``recipe_sgd_s64`` sets 64 by hand (the lower-level state, prepared).

Each cell is the mean over seeds (initialisation, data order, and on digits the train/test split): three on the digits
workloads, where a point of accuracy is a few test images, and one on the transformer (2.5
minutes a run). A gap to dense is paired by seed, and its range over seeds is printed beside it.

Prints one table (final validation loss, accuracy, their difference to dense, bytes a rank
hands to collectives per step, compression: dense's bytes over those, and on the link: dense's
ring allreduce over what the row's collectives send over a rank's link, which differ for an
all-gather (W - 1 times its input) or an all-to-all; wall time) and writes a PNG of validation
loss against steps and against bytes (the mean curve over seeds).

Usage: python benchmarks/bench_convergence.py [--workloads gpt_adamw,digits_sgd_0.05]
       [--ranks 2,4] [--rows dense,sparse_1] [--seeds N] [--quick] [--out DIR]
       python benchmarks/bench_convergence.py --table DIR/bench_convergence.json
(the results file is rewritten after each run, so a long run stopped keeps its cells; --table
prints their table.)
--rows defaults to DEFAULT_ROWS; ``--help`` lists every row, the density sweep included.
"""

import argparse
import json
import math
import os
import sys
import time
from statistics import mean
from typing import List, Optional

from hetero_comm.hooks import DCT
from hetero_comm.hooks.segment_sparse import SIGN_LR_SCALE
from lab.training import TrainConfig, run_training

WORKLOADS = {
    **{name: dict(model="gpt", hidden=128, optimizer="adamw", lr=lr, weight_decay=0.01,
                  lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=4,
                  global_batch=32)
       for name, lr in (("gpt_adamw", 3e-3), ("gpt_adamw_0.001", 1e-3))},
    # the transformer at about ten times the parameters (8.46M; bench_generality's gpt_large)
    **{name: dict(model="gpt", hidden=416, optimizer="adamw", lr=lr, weight_decay=0.01,
                  lr_warmup_steps=30, lr_schedule="cosine", clip_norm=1.0, epochs=4,
                  global_batch=32)
       for name, lr in (("gpt_large_adamw", 1e-3), ("gpt_large_adamw_0.0003", 3e-4))},
    **{f"digits_sgd_{lr}": dict(model="mlp", optimizer="sgd", lr=lr, momentum=0.9, epochs=8,
                                global_batch=64) for lr in (0.02, 0.05, 0.1)},
    "cnn_sgd": dict(model="cnn", hidden=64, optimizer="sgd", lr=0.05, momentum=0.9, epochs=12,
                    global_batch=64),
}
# Seeds per cell when --seeds is not given.
SEEDS = {workload: 1 if workload.startswith("gpt_") else 3 for workload in WORKLOADS}
ROWS = {
    "dense": ("dense allreduce", "dense", {}),
    "fp16": ("torch fp16_compress", "fp16", {}),
    "powersgd_1": ("torch PowerSGD rank 1", "powersgd", dict(matrix_approximation_rank=1)),
    "powersgd_4": ("torch PowerSGD rank 4", "powersgd", dict(matrix_approximation_rank=4)),
    "sparse_10": ("segment_sparse 10%", "sparse", dict(density=0.1)),
    "sparse_3": ("segment_sparse 3%", "sparse", dict(density=0.03)),
    "sparse_1": ("segment_sparse 1%", "sparse", dict(density=0.01)),
    # Momentum correction (Deep Gradient Compression): the hook keeps the velocity and the
    # optimizer's momentum is off (TrainConfig does that when the hook has a momentum).
    "sparse_3_mc": ("segment_sparse 3% + momentum corr.", "sparse", dict(density=0.03, momentum=0.9)),
    "sparse_10_mc": ("segment_sparse 10% + momentum corr.", "sparse", dict(density=0.1, momentum=0.9)),
    "sparse_4_bf16_mc_s512": ("segment_sparse 4%, bfloat16, segments of 512 + momentum corr.", "sparse",
                              dict(density=0.04, momentum=0.9, wire_dtype="bfloat16", segment_size=512)),
    "sparse_6_bf16": ("segment_sparse 6%, bfloat16 wire", "sparse",
                      dict(density=0.06, wire_dtype="bfloat16")),
    "dct_8": ("dct_quant keep 1/8, 8 bit", "dct", dict(keep_ratio=0.125, bits=8)),
    "dct_16": ("dct_quant keep 1/16, 8 bit", "dct", dict(keep_ratio=0.0625, bits=8)),
    **{f"sparse_dct_{p}": (f"segment_sparse {p}% DCT basis", "sparse", dict(density=p / 100, basis="dct"))
       for p in (3, 10)},
    # DCT segments and the sign of the sum; TrainConfig gives AdamW betas (0, 0) with it.
    **{f"sparse_dct_sign_{p}": (f"segment_sparse {p}% DCT basis, sign", "sparse",
                                dict(density=p / 100, basis="dct", output="sign"))
       for p in (1, 2, 3)},
    **{f"sparse_dct_sign_{p}_bf16": (f"segment_sparse {p}% DCT basis, sign, bfloat16 wire", "sparse",
                                     dict(density=p / 100, basis="dct", output="sign",
                                          wire_dtype="bfloat16"))
       for p in (3, 5, 6)},
    "sparse_dct_sign_5_bf16_b128": ("segment_sparse 5% DCT blocks of 128, sign, bfloat16", "sparse",
                                    dict(density=0.05, basis=DCT(block_size=128), output="sign",
                                         wire_dtype="bfloat16")),
    # The int8 wire: a byte per value, so about twice bfloat16's density at the same bytes.
    **{f"sparse_dct_sign_{p}_int8_s512": (f"segment_sparse {p}% DCT basis, sign, int8, segments of 512",
                                          "sparse", dict(density=p / 100, basis="dct", output="sign",
                                                         wire_dtype="int8", segment_size=512))
       for p in (8, 10, 11, 15)},
    **{f"sparse_{p}_int8_mc_s512": (f"segment_sparse {p}%, int8, segments of 512 + momentum corr.", "sparse",
                                    dict(density=p / 100, momentum=0.9, wire_dtype="int8", segment_size=512))
       for p in (8,)},
    **{f"sparse_dct_{p}_int8_s512": (f"segment_sparse {p}% DCT basis, int8, segments of 512", "sparse",
                                     dict(density=p / 100, basis="dct", wire_dtype="int8", segment_size=512))
       for p in (8,)},
    # The recipes as users run them: hetero_comm.compress on the workload's DDP model and dense
    # optimizer (rate and schedule unchanged), which picks the recipe from the optimizer.
    "recipe_adamw": ("AdamW recipe: DCT-sign 10%, int8, segments of 512", "recipe", {}),
    "recipe_sgd": ("SGD recipe: 8%, int8, segments of 512 or 150 per bucket, momentum corr.",
                   "recipe", {}),
    # The one call asked for less compression (its rule for short runs, docs/recipes.md).
    **{f"recipe_ratio_{r}": (f"the one call at ratio={r}", "recipe", dict(ratio=r)) for r in (8, 16)},
    # The SGD recipe written out without min_segments_per_bucket, and with segments of 64 given
    # by hand (the size it picks for the CNN's one bucket), the dense optimizer handed to
    # state.prepare_optimizer (PREPARED).
    **{f"recipe_sgd_s{s}": (f"SGD recipe with segments of {s} everywhere", "sparse",
                            dict(density=0.08, momentum=0.9, wire_dtype="int8", segment_size=s))
       for s in (512, 64)},
    # The recipes written out with the int8 wire summed in two phases (127 steps a rank at any
    # number of ranks; the one call does so beyond 63 ranks), prepared as the one call does.
    "recipe_adamw_two_phase": ("AdamW recipe, int8 summed in two phases", "sparse",
                               dict(density=0.1, segment_size=512, wire_dtype="int8", basis="dct",
                                    output="sign", int8_sum="two_phase")),
    "recipe_sgd_two_phase": ("SGD recipe, int8 summed in two phases", "sparse",
                             dict(density=0.08, segment_size=512, wire_dtype="int8", momentum=0.9,
                                  min_segments_per_bucket=150, int8_sum="two_phase")),
    # The AdamW recipe at lower densities (toward 100x), each way of summing the int8 wire.
    **{f"recipe_adamw_{p}{suffix}": (f"AdamW recipe at {p}%{title}", "sparse",
                                     dict(density=p / 100, segment_size=512, wire_dtype="int8",
                                          basis="dct", output="sign", int8_sum=how))
       for p in (1, 3, 5) for suffix, title, how in (("", "", "allreduce"),
                                                  ("_two_phase", ", two phases", "two_phase"))},
    # DeMo (baseline written from the paper, benchmarks/lab/baselines.py): each rank's top_k
    # DCT components of every 64 values of its momentum, all-gathered as bfloat16 values and
    # one-byte positions (3 bytes each: 43x at 2, 85x at 1); signum at the AdamW recipe's
    # rate (RUN_LIKE_THE_RECIPE).
    **{f"demo_k{k}": (f"DeMo (baseline), top {k} of 64", "demo", dict(chunk=64, top_k=k))
       for k in (1, 2)},
}
PREPARED = {row for row, (_, hook, _) in ROWS.items() if row.startswith("recipe_") and hook != "recipe"}
ADAMW_ONLY = ({row for row, (_, hook, settings) in ROWS.items()
               if settings.get("output") == "sign" or hook == "demo"} | {"recipe_adamw"})
# Rows stepping by a sign at the rate and decay the one call gives the AdamW recipe (its
# SIGN_LR_SCALE times the workload's rate, the decay divided by it), so that the comparison is
# of what is sent, not of the rate.
RUN_LIKE_THE_RECIPE = {row for row, (_, hook, _) in ROWS.items() if hook == "demo"}
SGD_ONLY = {row for row, (_, _, settings) in ROWS.items() if settings.get("momentum")} | {"recipe_sgd"}
# Without --rows: the peers, and every hetero_comm mode at 30x or more (the plain sparse hook,
# the DCT hook, the two recipes, and the SGD recipe without its minimum of segments); the rest
# is the density sweep.
DEFAULT_ROWS = ("dense", "fp16", "powersgd_1", "powersgd_4", "sparse_1", "dct_16", "recipe_adamw",
                "recipe_sgd", "recipe_sgd_s512")


def run(workload: str, ranks: int, row: str, quick: bool, epochs: Optional[int] = None,
        seed: int = 0) -> Optional[dict]:
    title, hook, settings = ROWS[row]
    options = dict(WORKLOADS[workload])
    if row in ADAMW_ONLY and options["optimizer"] != "adamw":
        return None
    if row in SGD_ONLY and options["optimizer"] != "sgd":  # momentum correction replaces SGD's
        return None
    options["global_batch"] = options["global_batch"] // 2 * ranks  # the same per-rank batch
    if epochs is not None:
        options["epochs"] = epochs
    if quick:
        options["epochs"] = 1
    if row in RUN_LIKE_THE_RECIPE:
        options["lr"] *= SIGN_LR_SCALE
        options["weight_decay"] /= SIGN_LR_SCALE
    if hook == "powersgd":
        # On gloo, torch's powerSGD_hook with several buckets lets ranks issue collectives in
        # different orders (a "collective mismatch" abort, seen at 4 ranks): one bucket.
        options["bucket_cap_mb"] = 64
    config = TrainConfig(hook=hook, hook_settings=settings, workers=ranks, seed=seed,
                         prepare_optimizer=row in PREPARED, **options)
    began = time.perf_counter()
    record = run_training(config, timeout=3600)
    loss = record["epochs"]["test_loss"][-1]
    if not math.isfinite(loss):  # the hooks hand a non-finite gradient on as NaN, as DDP does
        return dict(workload=workload, ranks=ranks, row=row, title=title, seed=seed, diverged=True)
    return dict(workload=workload, ranks=ranks, row=row, title=title, seed=seed, diverged=False,
                loss=loss, accuracy=record["final_accuracy"],
                bytes_per_step=record["bytes_per_step"],
                compression=record["dense_bytes_per_step"] / record["bytes_per_step"],
                link_compression=(record["dense_link_bytes_per_step"] / record["link_bytes_per_step"]
                                  if record["link_bytes_per_step"] else None),
                wall_seconds=time.perf_counter() - began, curve=record["epochs"],
                ranks_identical=record["ranks_identical"])


def cells(results: list) -> list:
    """One cell per workload, ranks and row, over its seeds: the means of the seeds that finished,
    each seed's loss and accuracy (to pair with dense's), and the mean validation curve."""
    grouped = {}
    for r in results:
        grouped.setdefault((r["workload"], r["ranks"], r["row"]), []).append(r)
    out = []
    for (workload, ranks, row), runs in grouped.items():
        finished = [r for r in runs if not r["diverged"]]
        cell = dict(workload=workload, ranks=ranks, row=row, title=runs[0]["title"], seeds=len(runs),
                    diverged=len(runs) - len(finished), by_seed={r["seed"]: r for r in finished})
        if finished:
            for key in ("loss", "accuracy", "bytes_per_step", "compression", "wall_seconds"):
                cell[key] = mean(r[key] for r in finished)
            # (results files from before the link was counted have no link_compression)
            link = [r.get("link_compression") for r in finished]
            cell["link_compression"] = mean(link) if None not in link else None
            first = finished[0]["curve"]
            # Every seed evaluates at the same steps (the split's sizes do not depend on the seed).
            assert all(r["curve"]["step"] == first["step"] for r in finished), (workload, row)
            cell["curve"] = dict(step=first["step"], bytes=first["bytes"],
                                 test_loss=[mean(values) for values in
                                            zip(*(r["curve"]["test_loss"] for r in finished))])
        out.append(cell)
    return out


def compact(value: float, spec: str) -> str:
    """value in spec, or in two significant digits where a blown-up run would print a dozen."""
    if abs(value) < 1e4:
        return format(value, spec)
    return format(value, "+.1e" if spec.startswith("+") else ".1e")


def paired_gap(cell: dict, dense: Optional[dict], gap) -> str:
    """The mean over seeds of gap(run, dense run of the same seed), with its range over seeds."""
    if dense is None:
        return ""
    gaps = [gap(run, dense["by_seed"][seed]) for seed, run in cell["by_seed"].items()
            if seed in dense["by_seed"]]
    if not gaps:
        return ""
    text = compact(mean(gaps), "+.1f")
    return text if len(gaps) == 1 else f"{text} ({compact(min(gaps), '+.1f')}..{compact(max(gaps), '+.1f')})"


def table(results: list) -> str:
    all_cells = cells(results)
    dense = {(c["workload"], c["ranks"]): c for c in all_cells if c["row"] == "dense"}
    lines = ["| workload | ranks | hook | seeds | val loss | vs dense, % | val acc | vs dense, points | "
             "bytes/step | compression | on the link | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in all_cells:
        seeds = str(c["seeds"]) if not c["diverged"] else f"{c['seeds']}, {c['diverged']} diverged"
        prefix = f"| {c['workload']} | {c['ranks']} | {c['title']} | {seeds} |"
        if c["diverged"] == c["seeds"]:
            lines.append(f"{prefix} diverged | | | | | | | |")
            continue
        base = dense.get((c["workload"], c["ranks"]))
        loss_gap = paired_gap(c, base, lambda run, ref: 100 * (run["loss"] / ref["loss"] - 1))
        acc_gap = paired_gap(c, base, lambda run, ref: 100 * (run["accuracy"] - ref["accuracy"]))
        link = "-" if c["link_compression"] is None else f"{c['link_compression']:.1f}x"
        lines.append(f"{prefix} {compact(c['loss'], '.3f')} | {loss_gap} | {100 * c['accuracy']:.1f}% | {acc_gap} | "
                     f"{c['bytes_per_step']:,.0f} | {c['compression']:.1f}x | {link} | "
                     f"{c['wall_seconds']:.0f} |")
    return "\n".join(lines)


def plot(results: list, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_cells = [c for c in cells(results) if "curve" in c]
    panels = sorted({(c["workload"], c["ranks"]) for c in all_cells})
    rows = list(dict.fromkeys(c["row"] for c in all_cells))  # a row keeps its colour in every panel
    figure, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7.5), squeeze=False)
    labels = {}
    for column, (workload, ranks) in enumerate(panels):
        top = 0.0
        for c in all_cells:
            if (c["workload"], c["ranks"]) != (workload, ranks):
                continue
            curve, colour = c["curve"], f"C{rows.index(c['row']) % 10}"
            line, = axes[0][column].plot(curve["step"], curve["test_loss"], marker="o", color=colour)
            axes[1][column].plot([b / 1e6 for b in curve["bytes"]], curve["test_loss"], marker="o", color=colour)
            labels.setdefault(c["title"], line)
            if c["row"] == "dense":
                top = 1.5 * max(curve["test_loss"])
        for axis in axes[:, column]:
            if top:  # a run that blows up would flatten the others
                axis.set_ylim(0.0, top)
        axes[0][column].set(title=f"{workload}, {ranks} ranks", xlabel="step", ylabel="val loss (mean over seeds)")
        axes[1][column].set(xlabel="MB sent by rank 0", ylabel="val loss (mean over seeds)", xscale="log")
    figure.legend(list(labels.values()), list(labels), loc="lower center", ncol=4, fontsize=8)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def seeds_of(option: Optional[str], workload: str) -> List[int]:
    """The seeds to run: 0..N-1 for a count, the listed seeds for a list, else the workload's default."""
    if option is None:
        return list(range(SEEDS[workload]))
    if "," in option:
        return [int(seed) for seed in option.split(",") if seed]  # "2," is seed 2 alone
    return list(range(int(option)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"of: {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help="one epoch per run")
    parser.add_argument("--epochs", type=int, default=None, help="override every workload's epochs")
    parser.add_argument("--seeds", default=None,
                        help="N for seeds 0..N-1 per cell, or a list such as 1,2 or 2, (default: SEEDS, 1 for "
                             "the transformer, 3 elsewhere)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--table", metavar="JSON[,JSON...]",
                        help="run nothing: the table of results files, their runs merged (seeds run apart)")
    args = parser.parse_args()
    if args.table:
        runs = []
        for path in args.table.split(","):
            with open(path) as f:
                runs.extend(json.load(f))
        print(table(runs))
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    saved = os.path.join(args.out, "bench_convergence.json")
    for workload in args.workloads.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for row in args.rows.split(","):
                for seed in seeds_of(args.seeds, workload):
                    result = run(workload, ranks, row, args.quick, args.epochs, seed)
                    if result is not None:
                        results.append(result)
                        with open(saved, "w") as f:  # kept as it goes: a long run stopped keeps its cells
                            json.dump(results, f, indent=1)
                    print(f"  done: {workload}, {ranks} ranks, {row}, seed {seed}", file=sys.stderr, flush=True)
    print(table(results))
    print(f"plot: {plot(results, os.path.join(args.out, 'bench_convergence.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
