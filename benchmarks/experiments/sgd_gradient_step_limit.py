"""A step limit for the SGD recipe referenced to the raw gradients, tried outside the library.

The limit of ``sgd_step_limit.py`` followed the recipe's own handed norms, which grow as a run
destabilises (benchmarks/NOTES.md, "A step limit relative to the recipe's own norms"). Here the
reference is what dense momentum SGD would step: each rank's gradient before the hook (a
tensor hook on every parameter), its squared norm averaged over the ranks (one scalar
allreduce a step), ``r = sqrt(mean ||g_i||^2)``, and ``n = m n + r`` (``m = 0.9``, the runs'
momentum: the norm dense's velocity reaches when successive gradients point the same way).
After the hook the handed sum's norm is held to ``K n`` (every rank computes the same ``n``, and
the handed sum is the same on every rank, so every rank scales alike). The first step (before
the tensor hooks exist) is not limited.

Cases: the regression of ``teacher_regression.py`` (80 steps, constant rate) at lr 0.02 / 0.05
/ 0.1; bench_generality's GRU (SGD, cosine, its clipping at 1.0 replaced by the limit) at lr
0.3 / 1 / 3; its ResNet at 4 ranks, lr 0.1 (constant rate), seeds 0..S-1. Each ``K`` of
``--limits`` (``none``: the recipe as it is, not clipped).
Results: ``benchmarks/results/sgd_gradient_step_limit.txt``.

Usage: python benchmarks/experiments/sgd_gradient_step_limit.py [--limits none,0.5,1,2]
       [--models regression,gru,resnet] [--seeds 2]
"""

import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist

from lab.training import TrainConfig, run_training
from sgd_step_limit import hold_norm, regression_row
from teacher_regression import run_steps, set_up

_LIMIT_ENV = "HETERO_COMM_GRADIENT_STEP_LIMIT"  # "K"; read by every rank (spawned: inherited)
MOMENTUM = 0.9
_clip = torch.nn.utils.clip_grad_norm_
_state = dict(hooked=False, squared=0.0, reference=0.0)


def _add_squared_norm(gradient: torch.Tensor) -> None:
    _state["squared"] += float(gradient.detach().double().pow(2).sum())


def _limited(parameters, max_norm, *args, **kwargs):
    """``clip_grad_norm_``'s place in the training loops: ignores their threshold and holds
    the handed sum's norm to K times the dense velocity's bound; returns the norm."""
    parameters = list(parameters)
    norm = float(_clip(parameters, float("inf")))
    if not _state["hooked"]:
        for parameter in parameters:
            if parameter.requires_grad:
                parameter.register_hook(_add_squared_norm)
        _state["hooked"] = True
        return torch.tensor(norm)
    squared = torch.tensor([_state["squared"]], dtype=torch.float64)
    _state["squared"] = 0.0
    dist.all_reduce(squared)
    gradient_norm = math.sqrt(float(squared) / dist.get_world_size())
    _state["reference"] = MOMENTUM * _state["reference"] + gradient_norm
    hold_norm(parameters, norm, float(os.environ[_LIMIT_ENV]) * _state["reference"])
    return torch.tensor(norm)


if os.environ.get(_LIMIT_ENV):  # in every spawned rank, which imports this module again
    torch.nn.utils.clip_grad_norm_ = _limited


def regression(rank, world_size, lr, limited):
    ddp, optimizer, teacher = set_up("sgd", lr, compressed=True)
    return run_steps(ddp, optimizer, teacher, rank, clip=1.0 if limited else None)[0]


def bench_generality_run(model: str, lr: float, ranks: int, seed: int, limited: bool):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_generality
    options = dict(bench_generality.MODELS[model], **bench_generality.OPTIMIZERS["sgd"], lr=lr,
                   workers=ranks, seed=seed)
    options["global_batch"] = options["global_batch"] // 2 * ranks
    # The threshold itself is ignored; a value makes the training loop call the limit.
    options["clip_norm"] = 1.0 if limited else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_training(TrainConfig(hook="recipe", **options), timeout=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="none,0.5,1,2")
    parser.add_argument("--models", default="regression,gru,resnet")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    models = args.models.split(",")
    for limit in args.limits.split(","):
        limited = limit != "none"
        if limited:
            os.environ[_LIMIT_ENV] = str(float(limit))
        else:
            os.environ.pop(_LIMIT_ENV, None)
        name = "no limit" if not limited else f"K={limit}"
        if "regression" in models:
            print(f"regression, {name}: {regression_row(regression, limited)}", flush=True)
        if "gru" in models:
            cells = []
            for lr in (0.3, 1.0, 3.0):
                record = bench_generality_run("gru", lr, 2, 0, limited)
                cells.append(f"lr {lr:g}: {record['epochs']['test_loss'][-1]:.3f} / "
                             f"{record['final_accuracy']:.1%}")
            print(f"GRU, {name}: " + ", ".join(cells), flush=True)
        if "resnet" in models:
            records = [bench_generality_run("resnet", 0.1, 4, seed, limited) for seed in range(args.seeds)]
            accuracies = [r["final_accuracy"] for r in records]
            print(f"ResNet 4 ranks lr 0.1, {name}: accuracy " +
                  " / ".join(f"{a:.1%}" for a in accuracies) +
                  f" (mean {sum(accuracies) / len(accuracies):.1%})", flush=True)


if __name__ == "__main__":
    main()
