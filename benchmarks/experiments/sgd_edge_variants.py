"""The SGD recipe near dense's largest stable rate, and what does not mend it.

On the short regression of ``teacher_regression.py`` (MLP 32 -> 256 -> 256 -> 8, 80 steps of 32
rows per rank, 2 gloo ranks, SGD with momentum 0.9) the SGD recipe diverges at lr 0.05, where
dense trains. Each variant below changes one thing of the recipe (8% of the segments, int8
wire, momentum correction clearing the sent velocity, 2.1x the rate inside the step) and
prints the training loss every 10 steps and at the end:

- ``recipe``: the recipe as ``compress`` sets it up;
- ``lr scale 1`` / ``lr scale 1.5``: the step at that multiple of the rate instead of 2.1;
- ``density warm-up 20``: the density falls from 1 to 8% over the first 20 steps;
- ``no momentum correction``: the hook sums gradients, the optimizer keeps its momentum;
- ``keep if sent again``: a segment sent at two steps in a row keeps its velocity (momentum
  SGD's own update there), others are cleared as in the recipe;
- ``keep always, lr scale 1``: the velocity is never cleared (momentum SGD's update, late);
- ``dct basis``: segments of DCT coefficients, as the AdamW recipe cuts them;
- ``density 16%``: twice the segments (about half the compression).

The two ``keep`` variants replace the hook's clearing (``restart_sent_velocity``) in each
rank's process; nothing else is patched. Results: ``benchmarks/results/sgd_edge_variants.txt``.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/sgd_edge_variants.py [--lrs 0.02,0.05,0.1]
"""

import argparse
import math
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

from hetero_comm.hooks import SegmentSparseState, segment_sparse
from lab.launch import run_ranks
from hetero_comm.recipes import recipe_for
from teacher_regression import STEPS, model_and_teacher, run_steps

VARIANTS = {  # name: (changes to the recipe's settings, lr scale or None, velocity clearing)
    "dense": None,
    "recipe": ({}, None, "clear"),
    "lr scale 1": ({}, 1.0, "clear"),
    "lr scale 1.5": ({}, 1.5, "clear"),
    "density warm-up 20": (dict(density_warmup_steps=20), None, "clear"),
    "no momentum correction": (dict(momentum=0.0), None, "clear"),
    "keep if sent again": ({}, None, "keep if sent again"),
    "keep always, lr scale 1": ({}, 1.0, "keep always"),
    "dct basis": (dict(basis="dct"), None, "clear"),
    "density 16%": (dict(density=0.16), None, "clear"),
}


def _patch_clearing(mode: str) -> None:
    """Replace the hook's clearing of the sent velocity in this process."""
    if mode == "clear":
        return
    clear, sent_before = segment_sparse.restart_sent_velocity, {}

    def restart(state, plan_bucket, indices, segments):
        previous = sent_before.get(id(plan_bucket))
        sent_before[id(plan_bucket)] = indices.clone()
        if mode == "keep always":
            return
        if previous is not None:
            indices = indices[~torch.isin(indices, previous)]
        clear(state, plan_bucket, indices, segments)

    segment_sparse.restart_sent_velocity = restart


def train(rank, world_size, lr, variant):
    model, teacher = model_and_teacher()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    if VARIANTS[variant] is not None:
        changes, lr_scale, clearing = VARIANTS[variant]
        _patch_clearing(clearing)
        settings = dict(recipe_for(optimizer).settings, **changes)
        if not settings.get("momentum"):
            settings.pop("momentum", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = SegmentSparseState(**settings)
        ddp.register_comm_hook(state, segment_sparse.segment_sparse_hook)
        state.prepare_optimizer(optimizer, lr_scale=lr_scale)
    return run_steps(ddp, optimizer, teacher, rank)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", default="0.02,0.05,0.1")
    args = parser.parse_args()
    print(f"{'variant':<24} {'lr':>5} " + " ".join(f"{f'step {s}':>8}" for s in range(0, STEPS, 10))
          + f" {'last':>8}")
    for variant in VARIANTS:
        for lr in (float(v) for v in args.lrs.split(",")):
            losses = run_ranks(2, train, lr, variant, timeout=600)[0]
            shown = [losses[s] if s < len(losses) else math.nan for s in range(0, STEPS, 10)]
            last = f"{losses[-1]:.2f}" if math.isfinite(losses[-1]) else "diverged"
            print(f"{variant:<24} {lr:>5g} " + " ".join(f"{v:>8.2f}" for v in shown) + f" {last:>8}",
                  flush=True)


if __name__ == "__main__":
    main()
