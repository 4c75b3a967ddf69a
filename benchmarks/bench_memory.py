"""The memory planner against no plan, full checkpointing and ``save_on_cpu``.

For each workload (a CNN and a transformer, trained with AdamW on one micro-batch per step):

1. Profile the blocks (``profile_memory``: times, what each saves, its peaks alone in each mode,
   the swap space's bandwidth: a file in ``--swap-directory`` on the CPU, pinned memory on CUDA).
2. Measure the unplanned step: peak bytes above the memory in use before the step (a
   ``MemoryMeter``: the allocator's peak on CUDA, the resident set's high-water mark on the CPU)
   and the median step time.
3. Budgets = each of ``--budget-share`` x that peak. Plans: the swap-or-recompute rule and the integer program's
   optimum (with and without swapping) at that budget, and the fastest of those and the program's
   next best as they ran (``tune_memory_plan``, ``--candidates``); the peers: full checkpointing
   (``torch.utils.checkpoint`` around every block) and ``torch.autograd.graph.save_on_cpu``.
4. Run each for ``--steps`` steps after ``--warmup``; print one table: measured peak, the
   planner's predicted peak and its error, median step time and its ratio to the unplanned.

The meter fixes glibc's mmap threshold (so that the resident set follows the live tensors),
which makes every large allocation fault its pages: the step times of that table are slower
than with glibc's default.

Every configuration runs in this one process, in turn, on the same model and batch.

``wide_transformer`` (0.4B parameters, for a GPU) is not in the default list.

Usage: python benchmarks/bench_memory.py [--workloads cnn,transformer[,wide_transformer]] [--steps 8]
       [--budget-share 0.5,0.65] [--swap-directory /tmp] [--device cpu] [--json PATH] [--candidates 3]
"""

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hetero_comm.memory import (MemoryMeter, apply_memory_plan, plan_memory, predict, profile_memory,
                                tune_memory_plan)


class CausalBlock(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, length, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.mlp(self.norm2(h))


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens, self.position = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(context, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.position[:tokens.shape[1]]


def transformer_workload(device, width=256, heads=4, blocks=4, batch=16):
    torch.manual_seed(0)
    vocab, context = 256, 256
    model = nn.Sequential(Embedding(vocab, width, context),
                          *[CausalBlock(width, heads) for _ in range(blocks)],
                          nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))).to(device)
    tokens = torch.randint(0, vocab, (batch, context), device=device)
    targets = torch.randint(0, vocab, (batch * context,), device=device)
    return model, tokens, targets


def wide_transformer_workload(device):
    """A GPU-sized transformer (0.4B parameters): the small one's step is a few milliseconds of
    kernel launches on a GPU, too short to hide any copy; here a block's compute per byte it saves
    is 8x the small one's (flops per token grow with width squared, saved bytes with width). Batch
    32, so that activations outweigh the 1.6 GB of gradients the step allocates too: at batch 8
    the gradients were two thirds of the peak and no plan could halve it (H200, 2026-11-27)."""
    return transformer_workload(device, width=2048, heads=16, blocks=8, batch=32)


def cnn_workload(device):
    torch.manual_seed(0)

    def conv(cin, cout, pool):
        layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        return nn.Sequential(*layers, *([nn.MaxPool2d(2)] if pool else []))

    model = nn.Sequential(conv(3, 64, False), conv(64, 64, True), conv(64, 128, False),
                          conv(128, 128, True), conv(128, 256, False), conv(256, 256, True),
                          nn.Sequential(nn.Flatten(), nn.Linear(256 * 4 * 4, 10))).to(device)
    images = torch.randn(64, 3, 32, 32, device=device)
    targets = torch.randint(0, 10, (64,), device=device)
    return model, images, targets


WORKLOADS = {"cnn": cnn_workload, "transformer": transformer_workload,
             "wide_transformer": wide_transformer_workload}  # the last for CUDA only


def run_steps(model, inputs, targets, forward, steps, warmup, meter):
    """Median peak bytes (above the step's start) and median seconds of ``steps`` AdamW steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks, seconds = [], []
    for index in range(warmup + steps):
        optimizer.zero_grad(set_to_none=True)
        meter.reset()
        start = time.perf_counter()
        logits = forward(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets).backward()
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        elapsed = time.perf_counter() - start
        peak = meter.added_peak_bytes()
        del logits
        optimizer.step()
        if index >= warmup:
            peaks.append(peak)
            seconds.append(elapsed)
    return statistics.median(peaks), statistics.median(seconds)


def full_checkpointing(model):
    def forward(inputs):
        for block in model:
            inputs = checkpoint(block, inputs, use_reentrant=False)
        return inputs
    return forward


def save_on_cpu(model):
    def forward(inputs):
        with torch.autograd.graph.save_on_cpu(pin_memory=inputs.device.type == "cuda"):
            return model(inputs)
    return forward


def bench_workload(name, args, device):
    model, inputs, targets = WORKLOADS[name](device)
    meter = MemoryMeter(device)
    profile = profile_memory(model, inputs, swap_directory=args.swap_directory)
    def run(forward):
        return run_steps(model, inputs, targets, forward, args.steps, args.warmup, meter)

    unplanned_peak, unplanned_s = run(model)
    rows = [dict(config="no plan", peak=unplanned_peak, seconds=unplanned_s,
                 predicted=predict(profile, ("keep",) * profile.num_blocks)[0], choices="")]
    for share in args.budget_share:
        for label, kwargs in (("rule", dict(method="rule")), ("optimal", {}),
                              ("optimal, no swap", dict(allow_swap=False))):
            label = f"{label} @{share:g}"
            try:
                plan = plan_memory(profile, share * unplanned_peak, **kwargs)
            except ValueError as error:
                rows.append(dict(config=label, error=str(error).split(";")[0]))
                continue
            with apply_memory_plan(model, plan, swap_directory=args.swap_directory):
                peak, seconds = run(model)
            rows.append(dict(config=label, peak=peak, seconds=seconds,
                             predicted=plan.predicted_peak_bytes, predicted_s=plan.predicted_step_s,
                             choices=" ".join(choice[0] for choice in plan.choices)))
        rows.append(tuned_row(model, inputs, targets, profile, share, share * unplanned_peak, run, args))
    for label, forward in (("full checkpointing", full_checkpointing(model)),
                           ("save_on_cpu", save_on_cpu(model))):
        peak, seconds = run(forward)
        rows.append(dict(config=label, peak=peak, seconds=seconds, predicted=None, choices=""))
    for row in rows:
        row.update(workload=name, unplanned_s=unplanned_s)
    return rows, profile


def tuned_row(model, inputs, targets, profile, share, budget, run, args):
    """``tune_memory_plan``: the model's best few plans run for a few steps each, the fastest
    that fits kept; then measured as every other row is. ``tuning_s``: what choosing cost."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets).backward()
        optimizer.step()

    label = f"measured best @{share:g}"
    start = time.perf_counter()
    try:
        tuned = tune_memory_plan(model, profile, budget, step, candidates=args.candidates,
                                 swap_directory=args.swap_directory)
    except ValueError as error:
        return dict(config=label, error=str(error).split(";")[0])
    tuning_s = time.perf_counter() - start
    with apply_memory_plan(model, tuned.plan, swap_directory=args.swap_directory):
        peak, seconds = run(model)
    return dict(config=label, peak=peak, seconds=seconds, predicted=tuned.plan.predicted_peak_bytes,
                predicted_s=tuned.plan.predicted_step_s, tuning_s=tuning_s, trials=len(tuned.trials),
                choices=" ".join(choice[0] for choice in tuned.plan.choices))


def print_table(rows, swap_bytes_per_s):
    print(f"{'workload':<12}{'configuration':<24}{'peak MiB':>9}{'/ none':>8}{'predicted':>10}"
          f"{'error':>7}{'step ms':>9}{'/ none':>8}  plan (k/s/r/p per block)")
    for row in rows:
        if "error" in row:
            print(f"{row['workload']:<12}{row['config']:<24}  {row['error']}")
            continue
        unplanned = next(r for r in rows if r["workload"] == row["workload"] and r["config"] == "no plan")
        predicted = "" if row["predicted"] is None else f"{row['predicted'] / 2**20:.1f}"
        error = "" if row["predicted"] is None else f"{(row['predicted'] / row['peak'] - 1) * 100:+.0f}%"
        print(f"{row['workload']:<12}{row['config']:<24}{row['peak'] / 2**20:>9.1f}"
              f"{row['peak'] / unplanned['peak']:>8.2f}{predicted:>10}{error:>7}"
              f"{row['seconds'] * 1e3:>9.1f}{row['seconds'] / unplanned['seconds']:>8.2f}  {row['choices']}"
              + (f"  ({row['trials']} plans run in {row['tuning_s']:.1f} s)" if "tuning_s" in row else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="cnn,transformer")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-share", default="0.5,0.65",
                        help="budgets as shares of the unplanned peak, comma-separated")
    parser.add_argument("--swap-directory", default=None)
    parser.add_argument("--candidates", type=int, default=3,
                        help="the integer program's best plans that tune_memory_plan runs (besides the "
                             "no-swap optimum and the swap-or-recompute rule)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.budget_share = [float(share) for share in args.budget_share.split(",")]
    device = torch.device(args.device)
    rows, bandwidths, profiles = [], {}, {}
    for name in args.workloads.split(","):
        workload_rows, profile = bench_workload(name, args, device)
        rows += workload_rows
        bandwidths[name] = profile.swap_bytes_per_s
        profiles[name] = dataclasses.asdict(profile)  # to test a changed cost model against these runs
    print(f"device {device}, {torch.get_num_threads()} threads; budgets (@) as shares of the "
          f"unplanned peak; swap space "
          + ", ".join(f"{n} {b / 1e9:.2f} GB/s" for n, b in bandwidths.items()))
    print_table(rows, bandwidths)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(rows=rows, swap_bytes_per_s=bandwidths, profiles=profiles), handle, indent=1)


if __name__ == "__main__":
    main()
