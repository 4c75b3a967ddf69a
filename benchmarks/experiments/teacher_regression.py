"""The one call on a short regression it was not tuned on: an MLP (32 -> 256 -> 256 -> 8, GELU;
75K parameters, one DDP bucket) fits a random linear teacher (targets of variance about 32) in
80 steps of 32 rows per rank, 2 gloo ranks. Dense against ``hetero_comm.compress``, with AdamW and
with SGD (momentum 0.9), at several learning rates, at a constant rate and under a cosine decay
to 0 over the 80 steps, at the recipe's own compression or at the ratios asked for. Prints the training loss every 10 steps and at the end; a run whose loss
becomes NaN or infinite is reported as diverged (the hook hands a non-finite bucket on as NaN,
as DDP's allreduce does).
Results: ``benchmarks/results/teacher_regression.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/teacher_regression.py [--optimizers adamw,sgd]
       [--schedules constant,cosine] [--ratios 8,16] [--no-dense]
"""

import argparse
import math
import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm
from lab.launch import run_ranks

STEPS = 80
RATES = {"adamw": (1e-3, 3e-3, 1e-2), "sgd": (0.02, 0.05)}


def model_and_teacher():
    """The MLP to train (drawn from seed 0) and the linear teacher (seed 1); the experiments
    on this regression share them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 8))
    torch.manual_seed(1)
    teacher = nn.Linear(32, 8)
    teacher.weight.data.normal_()
    return model, teacher


def step_loss(ddp, teacher, step: int, rank: int) -> torch.Tensor:
    """The loss of this rank's 32 rows of ``step``."""
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
    return nn.functional.mse_loss(ddp(x), teacher(x).detach())


def set_up(optimizer_kind: str, lr: float, compressed: bool, ratio=None):
    """The DDP model, its dense optimizer (AdamW, or SGD with momentum 0.9), through
    ``hetero_comm.compress`` (at ``ratio``) or not, and the teacher."""
    model, teacher = model_and_teacher()
    ddp = DistributedDataParallel(model)
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=lr) if optimizer_kind == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9))
    if compressed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the small model's own warnings
            hetero_comm.compress(ddp, optimizer, ratio=ratio)
    return ddp, optimizer, teacher


def run_steps(ddp, optimizer, teacher, rank: int, cosine: bool = False, clip=None):
    """``STEPS`` steps, stopping at a non-finite loss; ``cosine``: the rate decays to 0 over
    them; ``clip``: ``clip_grad_norm_`` at that threshold before each step. Returns the
    losses and the norms the clip saw."""
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS) if cosine else None
    losses, norms = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a diverging run's NaN bucket warns
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = step_loss(ddp, teacher, step, rank)
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                break
            loss.backward()
            if clip is not None:
                norms.append(float(nn.utils.clip_grad_norm_(ddp.parameters(), clip)))
            optimizer.step()
            if decay is not None:
                decay.step()
    return losses, norms


def train(rank, world_size, optimizer_kind, lr, compressed, schedule, ratio=None):
    ddp, optimizer, teacher = set_up(optimizer_kind, lr, compressed, ratio)
    return run_steps(ddp, optimizer, teacher, rank, cosine=schedule == "cosine")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--schedules", default="constant,cosine")
    parser.add_argument("--ratios", default="", help="compress(ratio=...) for each, instead of "
                                                     "the recipe's own (e.g. 8,16)")
    parser.add_argument("--no-dense", action="store_true", help="only the compressed runs")
    args = parser.parse_args()
    runs = ([] if args.no_dense else [(False, None)]) + (
        [(True, float(r)) for r in args.ratios.split(",")] if args.ratios else [(True, None)])
    print(f"{'optimizer':<7} {'lr':>6} {'schedule':<9} {'run':<11} "
          + " ".join(f"{f'step {s}':>8}" for s in range(0, STEPS, 10)) + f" {'last':>8}")
    for optimizer_kind in args.optimizers.split(","):
        for schedule in args.schedules.split(","):
            for lr in RATES[optimizer_kind]:
                for compressed, ratio in runs:
                    losses = run_ranks(2, train, optimizer_kind, lr, compressed, schedule, ratio,
                                       timeout=600)[0]
                    shown = [losses[s] if s < len(losses) else float("nan")
                             for s in range(0, STEPS, 10)]
                    last = losses[-1]
                    ending = "diverged" if last != last or abs(last) == float("inf") else f"{last:.2f}"
                    name = ("dense" if not compressed else "recipe" if ratio is None
                            else f"ratio {ratio:g}")
                    print(f"{optimizer_kind:<7} {lr:>6g} {schedule:<9} {name:<11} "
                          + " ".join(f"{value:>8.2f}" for value in shown) + f" {ending:>8}",
                          flush=True)


if __name__ == "__main__":
    main()
