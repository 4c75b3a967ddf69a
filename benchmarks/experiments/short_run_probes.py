"""Probes of the SGD recipe on the quality matrix's cells, behind docs/design/one-call.md
("What it does not mend: the ResNet's short runs").

    python benchmarks/experiments/short_run_probes.py measure CELL [CELL ...]
        one run (seed 0) of the one call per cell; per quarter of the run (after the density
        warm-up), the median per step of: the share of the agreed importance's energy in the
        segments sent, the residual's norm over the gradient's, and the gradient's norm
    python benchmarks/experiments/short_run_probes.py rate CELL FACTOR
        the one call with momentum correction's rate factor times FACTOR, seeds 0-2, against
        dense's runs in benchmarks/results/bench_quality.json
    python benchmarks/experiments/short_run_probes.py step-units CELL
        the one call with each residual rescaled by the previous step's rate over this step's
        before it is encoded (error feedback kept in step units), seeds 0-2

Each patches the codec or the optimizer in the ranks' processes only.
"""

import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import bench_quality  # noqa: E402
from lab.launch import run_ranks  # noqa: E402
from lab.training import TrainConfig, train_rank  # noqa: E402

MATRIX_JSON = os.path.join(os.path.dirname(HERE), "results", "bench_quality.json")
CELLS = {**bench_quality.CELLS, **bench_quality.HELD_OUT}


def _measuring_worker(rank, world_size, config):
    """Train one rank, logging per bucket and step the sent share of the agreed importance's
    energy and the residual's and gradient's squared norms (rank 0's)."""
    from hetero_comm.hooks import _codec
    shares, norms = [], []
    pack, encode = _codec.BucketCodec.pack, _codec.BucketCodec.encode

    def logged_pack(self, residual, velocity, importance=None):
        agreed = (self.importance if importance is None else importance).double().square()
        sent = torch.topk(agreed, self.indices.numel()).values.sum() if self.indices.numel() else 0.0
        shares.append((residual.data_ptr(), float(sent), float(agreed.sum())))
        return pack(self, residual, velocity, importance)

    def logged_encode(self, residual, grad, *args):
        before = float(residual.double().square().sum())
        norms.append((residual.data_ptr(), before, float(grad.double().square().sum())))
        return encode(self, residual, grad, *args)

    _codec.BucketCodec.pack, _codec.BucketCodec.encode = logged_pack, logged_encode
    train_rank(rank, config)
    return dict(shares=shares, norms=norms) if rank == 0 else None


def _per_step(entries):
    """Sum each logged column over a step's buckets (a step begins at the first bucket's)."""
    steps, first = [], entries[0][0]
    for pointer, *values in entries:
        if pointer == first:
            steps.append([0.0] * len(values))
        steps[-1] = [a + b for a, b in zip(steps[-1], values)]
    return steps


def measure(names):
    print("| cell | share of energy sent | residual / gradient | gradient norm |")
    print("|---|---|---|---|")
    for name in names:
        config = TrainConfig(hook="recipe", **bench_quality.options_of(CELLS[name], seed=0))
        log = run_ranks(config.workers, _measuring_worker, config, timeout=3600)[0]
        shares = [sent / total if total else 0.0 for sent, total in _per_step(log["shares"])]
        norms = _per_step(log["norms"])
        ratios = [math.sqrt(r / g) if g else 0.0 for r, g in norms]
        grads = [math.sqrt(g) for _, g in norms]
        begin = 26  # past the dense step and the density warm-up
        quarters = [(begin + (len(grads) - begin) * q // 4, begin + (len(grads) - begin) * (q + 1) // 4)
                    for q in range(4)]

        def medians(values, digits):
            return " ".join(f"{statistics.median(values[a:b]):.{digits}f}" for a, b in quarters)
        print(f"| {name} | {medians(shares, 2)} | {medians(ratios, 1)} | {medians(grads, 2)} |",
              flush=True)


def _patched_worker(rank, world_size, config, change, value):
    """Train one rank with ``change`` ("rate" or "step-units") applied; rank 0's accuracy and
    test loss."""
    if change == "rate":
        from hetero_comm.hooks import _optimizer
        factor = _optimizer.momentum_correction_lr_scale
        _optimizer.momentum_correction_lr_scale = \
            lambda density, momentum, nesterov=False: factor(density, momentum, nesterov) * value
    else:
        from hetero_comm.hooks import _codec
        optimizers, rates = [], {}
        init = torch.optim.SGD.__init__

        def remembered_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            optimizers.append(self)
        torch.optim.SGD.__init__ = remembered_init
        encode = _codec.BucketCodec.encode

        def step_unit_encode(self, residual, *args):
            rate = optimizers[0].param_groups[0]["lr"]
            previous = rates.get(residual.data_ptr())
            if previous is not None and rate > 0 and previous != rate:
                residual.mul_(previous / rate)
            rates[residual.data_ptr()] = rate
            return encode(self, residual, *args)
        _codec.BucketCodec.encode = step_unit_encode
    record = train_rank(rank, config)
    return dict(accuracy=record["final_accuracy"]) if rank == 0 else None


def compare(name, change, value=None):
    cell = CELLS[name]
    with open(MATRIX_JSON) as f:
        records = json.load(f)
    gaps = []
    for seed in (0, 1, 2):
        config = TrainConfig(hook="recipe", **bench_quality.options_of(cell, seed))
        run = run_ranks(config.workers, _patched_worker, config, change, value, timeout=3600)[0]
        dense = records[bench_quality.run_key(name, cell, seed, "dense")]["accuracy"]
        gaps.append(100 * (run["accuracy"] - dense))
    label = f"{change} {value:g}" if value is not None else change
    print(f"{name}, {label}: gap to dense {sum(gaps) / 3:+.1f} points (per seed "
          f"{', '.join(f'{g:+.1f}' for g in gaps)})")


def main():
    kind, *args = sys.argv[1:] or ["help"]
    if kind == "measure" and args:
        measure(args)
    elif kind == "rate" and len(args) == 2:
        compare(args[0], "rate", float(args[1]))
    elif kind == "step-units" and len(args) == 1:
        compare(args[0], "step-units")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
