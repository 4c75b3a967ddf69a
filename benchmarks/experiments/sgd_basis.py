"""Would the SGD recipe hold on models with normalization or recurrent layers (the ResNet and
GRU of ``bench_generality.py``, where it fell behind dense) if its segments were DCT
coefficients instead of runs of elements? A selected segment of coefficients touches every
element of its blocks, so no coordinate waits many steps for its turn.

Per case and seed: dense, the SGD recipe as users run it (``hetero_comm.compress``), and each
variant: the lower-level sparse hook with momentum correction (the optimizer prepared as
``compress`` does), in the DCT basis at a given density (``dct_0.1``), or the recipe with a
density warm-up (``warmup_30``: from 1 down to 8% over 30 steps). Prints one table of the means over
seeds (loss, accuracy, compression) and each variant's gaps to dense paired by seed.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/sgd_basis.py [--models resnet,gru] [--lrs 0.02,0.05]
       [--ranks 2] [--seeds 3] [--variants dct_0.1,warmup_30] [--out PATH.json]
"""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from lab.training import TrainConfig, run_training

BENCHMARKS = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_generality", BENCHMARKS / "bench_generality.py")
generality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generality)


# the SGD recipe's settings (momentum 0.9), as hetero_comm.recipe_for gives them
SGD_RECIPE = dict(density=0.08, segment_size=512, wire_dtype="int8", min_segments_per_bucket=150,
                  momentum=0.9)


def variant(name: str) -> dict:
    """``dct_<density>``: the DCT basis at that density; ``warmup_<steps>``: the recipe with
    its density falling from 1 over that many steps."""
    kind, value = name.split("_")
    if kind == "dct":
        return dict(density=float(value), segment_size=512, wire_dtype="int8", basis="dct",
                    momentum=0.9)
    if kind == "warmup":
        return dict(SGD_RECIPE, density_warmup_steps=int(value))
    raise ValueError(f"unknown variant {name!r}: dct_<density> or warmup_<steps>")


def run(options: dict, hook: str, settings: dict) -> dict:
    record = run_training(TrainConfig(hook=hook, hook_settings=settings, **options), timeout=3600)
    return dict(loss=record["epochs"]["test_loss"][-1], accuracy=record["final_accuracy"],
                compression=record["dense_bytes_per_step"] / record["bytes_per_step"])


def run_case(model: str, lr: float, ranks: int, seeds: int, variants) -> dict:
    """Every row of one case, each a list over seeds."""
    options = dict(generality.MODELS[model], **generality.OPTIMIZERS["sgd"], lr=lr, workers=ranks)
    options["global_batch"] = options["global_batch"] // 2 * ranks
    rows = {"dense": [], "recipe": [], **{name: [] for name in variants}}
    for seed in range(seeds):
        seeded = dict(options, seed=seed)
        rows["dense"].append(run(seeded, "dense", {}))
        rows["recipe"].append(run(seeded, "recipe", {}))
        for name in variants:
            rows[name].append(run(dict(seeded, prepare_optimizer=True), "sparse", variant(name)))
        print(f"  {model} lr {lr:g} {ranks} ranks seed {seed} done", file=sys.stderr, flush=True)
    return dict(model=model, lr=lr, ranks=ranks, seeds=seeds, rows=rows)


def table(cases) -> str:
    lines = ["| model | lr | ranks | seeds | row | val loss | val acc | loss gap % (range) | "
             "acc gap, points (range) | compression |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        dense = case["rows"]["dense"]
        for name, runs in case["rows"].items():
            loss_gaps = [100 * (r["loss"] / d["loss"] - 1) for r, d in zip(runs, dense)]
            acc_gaps = [100 * (r["accuracy"] - d["accuracy"]) for r, d in zip(runs, dense)]
            lines.append(
                f"| {case['model']} | {case['lr']:g} | {case['ranks']} | {case['seeds']} | {name} | "
                f"{statistics.mean(r['loss'] for r in runs):.3f} | "
                f"{100 * statistics.mean(r['accuracy'] for r in runs):.1f}% | "
                f"{statistics.mean(loss_gaps):+.1f} ({min(loss_gaps):+.1f}..{max(loss_gaps):+.1f}) | "
                f"{statistics.mean(acc_gaps):+.1f} ({min(acc_gaps):+.1f}..{max(acc_gaps):+.1f}) | "
                f"{statistics.mean(r['compression'] for r in runs):.1f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,gru")
    parser.add_argument("--lrs", default=None, help="default: bench_generality's SGD rates per model")
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", default="dct_0.1", help="dct_<density>, warmup_<steps>")
    parser.add_argument("--out", default=None, help="JSON of every run")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for name in variants:
        variant(name)  # a bad name fails before any run
    print("python " + " ".join(sys.argv), flush=True)
    cases = []
    for model in args.models.split(","):
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else generality.LRS[model, "sgd"]
        for lr in lrs:
            for ranks in (int(r) for r in args.ranks.split(",")):
                cases.append(run_case(model, lr, ranks, args.seeds, variants))
                if args.out:
                    Path(args.out).write_text(json.dumps(cases, indent=1))
    print(table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
