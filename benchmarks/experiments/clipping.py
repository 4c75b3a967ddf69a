"""Gradient clipping (``torch.nn.utils.clip_grad_norm_`` between backward and step) with the
recipes, on the short regression of ``teacher_regression.py`` (MLP 32 -> 256 -> 256 -> 8, 80
steps of 32 rows per rank, 2 gloo ranks, cosine decay to 0): dense against
``hetero_comm.compress`` at each clipping threshold, with the median norm the clip saw (what
the hook handed the optimizer: for the AdamW recipe signs, for the SGD recipe the
momentum-corrected sum). With ``--gru``: also bench_generality's GRU language model (SGD,
momentum 0.9, 2 ranks, its clipping at 1.0) with and without that clipping, dense and the
recipe. Results: ``benchmarks/results/clipping.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/clipping.py [--thresholds none,1,5,20] [--gru 0.3]
"""

import argparse
import math
import os
import statistics
import sys
import warnings

from lab.launch import run_ranks
from lab.training import TrainConfig, run_training
from teacher_regression import run_steps, set_up

RATES = {"adamw": (3e-3, 1e-2), "sgd": (0.02, 0.05)}


def train(rank, world_size, optimizer_kind, lr, compressed, threshold):
    ddp, optimizer, teacher = set_up(optimizer_kind, lr, compressed)
    losses, norms = run_steps(ddp, optimizer, teacher, rank, cosine=True, clip=threshold)
    return losses[-1], statistics.median(norms) if norms else math.nan


def gru_runs(lr: float) -> None:
    """bench_generality's GRU workload with SGD at ``lr``, 2 ranks, with its clipping at 1.0
    and without."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_generality
    print(f"\nGRU language model (bench_generality), SGD lr {lr:g}, 2 ranks: test loss / accuracy")
    for clip in (1.0, None):
        row = []
        for hook in ("dense", "recipe"):
            options = dict(bench_generality.MODELS["gru"], **bench_generality.OPTIMIZERS["sgd"],
                           lr=lr, workers=2, clip_norm=clip)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record = run_training(TrainConfig(hook=hook, **options), timeout=3600)
            row.append(f"{hook} {record['epochs']['test_loss'][-1]:.3f} / {record['final_accuracy']:.1%}")
        print(f"clip {'none' if clip is None else f'{clip:g}':>4}: " + ", ".join(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thresholds", default="none,1,5,20")
    parser.add_argument("--gru", type=float, default=None, metavar="LR",
                        help="also the GRU language model with SGD at this rate")
    args = parser.parse_args()
    thresholds = [None if t == "none" else float(t) for t in args.thresholds.split(",")]
    print(f"{'optimizer':<9} {'lr':>6} {'clip':>5}  {'dense: last loss':>16} {'median norm':>11}"
          f"  {'recipe: last loss':>17} {'median norm':>11}")
    for optimizer_kind, rates in RATES.items():
        for lr in rates:
            for threshold in thresholds:
                row = []
                for compressed in (False, True):
                    last, norm = run_ranks(2, train, optimizer_kind, lr, compressed, threshold,
                                           timeout=600)[0]
                    row.append(f"{last:>{16 if not compressed else 17}.3f} {norm:>11.2f}")
                clip = "none" if threshold is None else f"{threshold:g}"
                print(f"{optimizer_kind:<9} {lr:>6g} {clip:>5}  " + "  ".join(row), flush=True)
    if args.gru is not None:
        gru_runs(args.gru)


if __name__ == "__main__":
    main()
