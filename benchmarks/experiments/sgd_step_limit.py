"""A step limit for the SGD recipe, tried outside the library: after the hook, the handed
sum's norm is held to ``K`` times the median of the norms handed at the last ``WINDOW`` steps
(the sum is the same on every rank, so every rank scales alike). Clipping at dense's threshold
shrank the recipe's steps several-fold and that held the GRU and the large transformer at their
best rates (docs/design/recipes-sgd.md, "Dense's edge: what does not mend it"), but stopped the
short regression at moderate rates; a limit relative to the recipe's own typical norm only cuts
its bursts (the held-back velocity of segments that waited long), which is what diverged at
dense's edge on the regression (the same section).

Cases: the regression of ``teacher_regression.py`` (80 steps, constant rate) at lr 0.02 / 0.05
/ 0.1, and bench_generality's GRU (SGD, cosine, its clipping at 1.0 replaced by the limit) at lr
0.3 / 1 / 3. Each ``K`` of ``--limits`` (``none``: the recipe as it is, no clipping).
Results: ``benchmarks/results/sgd_step_limit.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/sgd_step_limit.py [--limits none,1,2,4] [--window 20]
       [--models regression,gru]
"""

import argparse
import math
import os
import statistics
import sys
import warnings

import torch

from lab.launch import run_ranks
from lab.training import TrainConfig, run_training
from teacher_regression import run_steps, set_up

_LIMIT_ENV = "HETERO_COMM_STEP_LIMIT"  # "K,WINDOW"; read by every rank (spawned: inherited)
_clip = torch.nn.utils.clip_grad_norm_
_norms = []


def _limited(parameters, max_norm, *args, **kwargs):
    """``clip_grad_norm_``'s place in the training loops: ignores their threshold and holds
    the norm to K times the median of the last WINDOW unclipped norms; returns the norm."""
    parameters = list(parameters)
    norm = float(_clip(parameters, float("inf")))
    k, window = (float(v) for v in os.environ[_LIMIT_ENV].split(","))
    recent = _norms[-int(window):]
    if len(recent) == int(window):
        hold_norm(parameters, norm, k * statistics.median(recent))
    _norms.append(norm)
    return torch.tensor(norm)


def hold_norm(parameters, norm: float, limit: float) -> None:
    """Scale the gradients whose total norm is ``norm`` down to ``limit`` if above it."""
    if math.isfinite(norm) and norm > limit:
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(limit / norm)


if os.environ.get(_LIMIT_ENV):  # in every spawned rank, which imports this module again
    torch.nn.utils.clip_grad_norm_ = _limited


def regression(rank, world_size, lr, limited):
    ddp, optimizer, teacher = set_up("sgd", lr, compressed=True)
    return run_steps(ddp, optimizer, teacher, rank, clip=1.0 if limited else None)[0]


def regression_row(worker, limited: bool) -> str:
    """The regression's loss at its last step at lr 0.02 / 0.05 / 0.1, ``worker`` on 2 ranks
    (a function of the script that patched the clipping, so the ranks import it)."""
    cells = []
    for lr in (0.02, 0.05, 0.1):
        losses = run_ranks(2, worker, lr, limited, timeout=600)[0]
        last = f"{losses[-1]:.3f}" if math.isfinite(losses[-1]) and len(losses) == 80 else "diverged"
        cells.append(f"lr {lr:g}: {last}")
    return ", ".join(cells)


def gru(lr: float, limited: bool) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_generality
    options = dict(bench_generality.MODELS["gru"], **bench_generality.OPTIMIZERS["sgd"], lr=lr, workers=2)
    options["clip_norm"] = 1.0 if limited else None  # the threshold itself is ignored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = run_training(TrainConfig(hook="recipe", **options), timeout=3600)
    return f"{record['epochs']['test_loss'][-1]:.3f} / {record['final_accuracy']:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="none,1,2,4")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--models", default="regression,gru")
    args = parser.parse_args()
    models = args.models.split(",")
    for limit in args.limits.split(","):
        limited = limit != "none"
        if limited:
            os.environ[_LIMIT_ENV] = f"{float(limit)},{args.window}"
        else:
            os.environ.pop(_LIMIT_ENV, None)
        name = "no limit" if not limited else f"K={limit}, window {args.window}"
        if "regression" in models:
            print(f"regression, {name}: {regression_row(regression, limited)}", flush=True)
        if "gru" in models:
            print(f"GRU, {name}: " + ", ".join(f"lr {lr:g}: {gru(lr, limited)}" for lr in (0.3, 1.0, 3.0)),
                  flush=True)


if __name__ == "__main__":
    main()
