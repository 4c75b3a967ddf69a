"""Issue 17 experiments (not part of the package): what should the optimizer see, when only a
few percent of the gradient crosses the wire each step? Pure-PyTorch DDP hooks with the
agreed top-k segment selection (segments of 256), on a workload of bench_convergence.py.
Modes (MODE):

* ``ef``: plain error feedback (what segment_sparse_hook does): a held-back segment delivers
  zero, then its accumulated sum at once. ``sign``: the same, delivering the sign of the sum.
* ``rate``: every rank also keeps the same dense estimate ``h`` of the per-step gradient;
  each step delivers ``h`` everywhere plus the agreed top-k of the residual, where the
  residual accumulates ``w_i g_i - h / W`` (so the cumulative delivery stays exact). A sent
  segment's ``h`` becomes the mean gradient over the steps since it was last sent.
* ``spread:R``: error feedback whose delivered sums go into a shared accumulator released at
  rate R per step (bursts spread over ~1/R steps).
* ``ef21`` / ``ef21m``: EF21 (Richtarik et al. 2021): every rank keeps ``h_i`` (its last sent
  value), sends the top-k of ``w_i g_i - h_i`` (of its local momentum for ``ef21m``), and the
  optimizer sees ``h = sum h_i``.
* ``onebit``: every coordinate every step as a scaled sign (1 bit plus a float per 256), with
  error feedback on each rank and again on the sum, as 1-bit Adam's compressed allreduce
  (simulated with an allreduce of the scaled signs).
* ``dct`` / ``dctsign``: segments of blockwise DCT coefficients (blocks of 64; a segment is one
  frequency of 256 consecutive blocks), delivering the sum or its sign.

Environment: ``DECAY`` (the residual decays by this factor per step, as DeMo's momentum;
default 1), ``BETA1`` (AdamW's beta1), ``OPTIONS`` (JSON overriding the workload's
TrainConfig fields, e.g. a plain SGD sign step), ``BALANCED`` (dct modes: the same number of
frequencies in every group). Results: benchmarks/results/predicted_ef_experiments.txt.

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/predicted_ef.py WORKLOAD MODE DENSITY [RANKS] [EPOCHS]
"""

import json
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_convergence import WORKLOADS  # noqa: E402

from lab import training  # noqa: E402
from lab.launch import run_ranks  # noqa: E402
from lab.training import TrainConfig  # noqa: E402

SEGMENT = 256


class PredictedState:
    def __init__(self, mode, density, world, smoothing=0.1):
        self.mode, self.density, self.world, self.smoothing = mode, density, world, smoothing
        self.buckets, self.sent = {}, 0
        self.decay = float(os.environ.get("DECAY", "1"))

    def segments(self, flat):
        pad = (-flat.numel()) % SEGMENT
        return torch.nn.functional.pad(flat, (0, pad)).view(-1, SEGMENT)


BLOCK = 64


def _dct_matrix(n):
    j = torch.arange(n, dtype=torch.float64)
    m = torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n)) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m.float()


DCT = _dct_matrix(BLOCK)


def _to_coefficients(flat, group):
    """(groups, BLOCK frequencies, group blocks): segment = one frequency of a group of blocks."""
    span = BLOCK * group
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % span))
    blocks = padded.view(-1, BLOCK) @ DCT.T
    return blocks.view(-1, group, BLOCK).transpose(1, 2).reshape(-1, group)


def _from_coefficients(coefficients, group, numel):
    blocks = coefficients.view(-1, BLOCK, group).transpose(1, 2).reshape(-1, BLOCK) @ DCT
    return blocks.reshape(-1)[:numel]


def dct_hook(state, bucket):
    grad = bucket.buffer()
    grad.div_(state.world)
    key = (bucket.index(), grad.numel())
    coefficients = _to_coefficients(grad, SEGMENT)
    b = state.buckets.setdefault(key, dict(residual=torch.zeros_like(coefficients)))
    residual = b["residual"]
    residual.mul_(state.decay).add_(coefficients)
    importance = residual.norm(dim=1)
    dist.all_reduce(importance)
    if os.environ.get("BALANCED"):  # the same number of frequencies in every group
        per_group = importance.view(-1, BLOCK)
        k = max(1, math.ceil(state.density * BLOCK))
        top = per_group.topk(k, dim=1).indices
        chosen = (top + BLOCK * torch.arange(per_group.shape[0]).unsqueeze(1)).reshape(-1)
    else:
        k = max(1, math.ceil(state.density * importance.numel()))
        chosen = importance.topk(k).indices
    packed = residual[chosen].clone()
    residual[chosen] = 0
    dist.all_reduce(packed)
    state.sent += 4 * (packed.numel() + importance.numel())
    out = torch.zeros_like(residual)
    out[chosen] = packed
    delivered = _from_coefficients(out, SEGMENT, grad.numel())
    grad.copy_(delivered.sign() if state.mode == "dctsign" else delivered)
    return _done(grad)


SCALE_CHUNK = 256


def _scaled_sign(flat):
    """sign(x) times the mean |x| of its chunk of SCALE_CHUNK elements (1 bit + a shared scale)."""
    chunks = flat.view(-1, SCALE_CHUNK)
    return (chunks.sign() * chunks.abs().mean(dim=1, keepdim=True)).view(-1)


def onebit_hook(state, bucket):
    """1-bit compressed allreduce with error feedback on both sides, as 1-bit Adam's: every
    rank sends the scaled sign of its residual; the averaged result is compressed again (the
    second stage, identical everywhere) with its own residual. Simulated with an allreduce of
    the scaled signs (the bytes are counted as the two 1-bit stages would send)."""
    grad = bucket.buffer()
    grad.div_(state.world)
    key = (bucket.index(), grad.numel())
    span = SCALE_CHUNK * state.world
    padded = torch.nn.functional.pad(grad, (0, (-grad.numel()) % span))
    b = state.buckets.setdefault(key, dict(local=torch.zeros_like(padded), shared=torch.zeros_like(padded)))
    b["local"].add_(padded)
    sent = _scaled_sign(b["local"])
    b["local"] -= sent
    dist.all_reduce(sent)
    b["shared"] += sent
    out = _scaled_sign(b["shared"])
    b["shared"] -= out
    state.sent += 2 * padded.numel() // 8 + 2 * 4 * padded.numel() // SCALE_CHUNK
    grad.copy_(out[: grad.numel()])
    return _done(grad)


def predicted_hook(state, bucket):
    grad = bucket.buffer()
    world = state.world
    grad.div_(world)
    key = (bucket.index(), grad.numel())
    b = state.buckets.get(key)
    if b is None:  # first step: dense, and the estimate starts at the summed gradient
        dist.all_reduce(grad)
        state.sent += 4 * grad.numel()
        count = math.ceil(grad.numel() / SEGMENT)
        b = state.buckets[key] = dict(
            residual=torch.zeros(count * SEGMENT), h=state.segments(grad.clone()).clone(),
            mine=state.segments(grad.clone() / world).clone(), step=0,
            last=torch.zeros(count), velocity=torch.zeros(count * SEGMENT))
        return _done(grad)
    b["step"] += 1
    h, residual, mine = b["h"], b["residual"].view(-1, SEGMENT), b["mine"]
    local = state.segments(grad)
    if state.mode in ("ef", "rate", "sign") or state.mode.startswith("spread"):
        residual.mul_(state.decay).add_(local)
        if state.mode == "rate":
            residual -= h / world
        source = residual
    else:  # ef21: the difference to what this rank last sent
        if state.mode == "ef21m":
            velocity = b["velocity"].view(-1, SEGMENT)
            velocity.mul_(1 - state.smoothing).add_(local, alpha=state.smoothing)
            local = velocity
        source = local - mine
    importance = source.norm(dim=1)
    dist.all_reduce(importance)
    k = max(1, math.ceil(state.density * importance.numel()))
    chosen = importance.topk(k).indices
    packed = source[chosen].clone()
    dist.all_reduce(packed)
    state.sent += 4 * (packed.numel() + importance.numel())
    if state.mode in ("ef", "rate", "sign") or state.mode.startswith("spread"):
        residual[chosen] = 0
    if state.mode.startswith("spread"):  # global accumulator released at a fixed rate
        release = float(state.mode.split(":")[1])
        held = b.setdefault("held", torch.zeros_like(h))
        held[chosen] += packed
        out = held * release
        held -= out
    elif state.mode in ("ef", "sign"):
        out = torch.zeros_like(h)
        out[chosen] = packed.sign() if state.mode == "sign" else packed
    elif state.mode == "rate":
        out = h.clone()
        out[chosen] += packed
        waited = (b["step"] - b["last"][chosen]).clamp(min=1).unsqueeze(1)
        h[chosen] += packed / waited
        b["last"][chosen] = float(b["step"])
    else:
        mine[chosen] = (mine[chosen] + source[chosen])
        h[chosen] += packed
        out = h
    grad.copy_(out.reshape(-1)[: grad.numel()])
    return _done(grad)


def _done(grad):
    fut = torch.futures.Future()
    fut.set_result(grad)
    return fut


def _worker(rank, world, config, mode, density):
    if "BETA1" in os.environ:
        adamw = torch.optim.AdamW
        torch.optim.AdamW = lambda *a, **k: adamw(*a, **dict(k, betas=(float(os.environ["BETA1"]), 0.999)))
    if mode != "dense":
        hook = dct_hook if mode.startswith("dct") else onebit_hook if mode == "onebit" else predicted_hook
        training.make_hook = lambda name, settings: (PredictedState(mode, density, world), hook)
    record = training.train_rank(rank, config)
    return record if rank == 0 else None


def main():
    workload, mode, density = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ranks = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    options = dict(WORKLOADS[workload])
    options["global_batch"] = options["global_batch"] // 2 * ranks
    if len(sys.argv) > 5:
        options["epochs"] = int(sys.argv[5])
    options.update(json.loads(os.environ.get("OPTIONS", "{}")))
    config = TrainConfig(hook="dense", workers=ranks, **options)
    record = run_ranks(ranks, _worker, config, mode, density, timeout=7200)[0]
    losses = " ".join(f"{v:.3f}" for v in record["epochs"]["test_loss"])
    print(f"{workload} {ranks} ranks {mode} {density}: val loss {losses} "
          f"acc {100 * record['final_accuracy']:.1f}")


if __name__ == "__main__":
    main()
