"""Memory plans of bench_memory's workloads measured in turns, for a machine whose speed drifts.

bench_memory.py runs each configuration's steps back to back, so a neighbour's load that
comes and goes can move one row by 20% against another. Here every plan runs ``--steps``
AdamW steps per round, the plans take turns for ``--rounds`` rounds, and the table shows each
plan's median peak (above the step's start) and median step time against the first plan.

A plan is one letter per block: ``k`` keep, ``s`` swap, ``r`` recompute, ``p`` partial
(:data:`hetero_comm.memory.CHOICES`); ``full`` checkpoints every block with torch's own
``checkpoint`` (bench_memory's peer).

Usage: PYTHONPATH=benchmarks python benchmarks/experiments/interleaved_plans.py --workload transformer
       --plans kkkkkk,krrrkk,prprkk,full [--rounds 5] [--steps 3]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_memory  # noqa: E402  (the benchmark's workloads and step loop)
from hetero_comm.memory import MemoryMeter, MemoryPlan, apply_memory_plan, chain_blocks  # noqa: E402

LETTERS = {"k": "keep", "s": "swap", "r": "recompute", "p": "partial"}


def measure(model, inputs, targets, plan_text, args, meter):
    if plan_text == "full":
        return bench_memory.run_steps(model, inputs, targets, bench_memory.full_checkpointing(model),
                                      args.steps, 1, meter)
    names, _ = chain_blocks(model)
    if len(plan_text) != len(names) or set(plan_text) - set(LETTERS):
        raise SystemExit(f"plan {plan_text!r}: one of k/s/r/p per block ({len(names)} blocks)")
    plan = MemoryPlan(names, tuple(LETTERS[letter] for letter in plan_text), 0.0, 0.0, 0.0, 0.0)
    with apply_memory_plan(model, plan, swap_directory=args.swap_directory):
        return bench_memory.run_steps(model, inputs, targets, model, args.steps, 1, meter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(bench_memory.WORKLOADS))
    parser.add_argument("--plans", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--swap-directory", default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model, inputs, targets = bench_memory.WORKLOADS[args.workload](device)
    meter = MemoryMeter(device)
    plans = args.plans.split(",")
    samples = {plan: [] for plan in plans}
    for _ in range(args.rounds):
        for plan in plans:
            samples[plan].append(measure(model, inputs, targets, plan, args, meter))
    medians = {plan: (statistics.median(p for p, _ in runs), statistics.median(s for _, s in runs))
               for plan, runs in samples.items()}
    spread = {plan: (min(s for _, s in runs), max(s for _, s in runs)) for plan, runs in samples.items()}
    base_peak, base_s = medians[plans[0]]
    print(f"{args.workload} on {device}, {torch.get_num_threads()} threads, {args.rounds} rounds of "
          f"{args.steps} steps; ratios against {plans[0]}")
    print(f"{'plan':<10}{'peak MiB':>10}{'peak /':>8}{'step ms':>9}{'step /':>8}{'rounds min-max ms':>20}")
    for plan, (peak, seconds) in medians.items():
        low, high = spread[plan]
        print(f"{plan:<10}{peak / 2**20:>10.1f}{peak / base_peak:>8.2f}{seconds * 1e3:>9.0f}"
              f"{seconds / base_s:>8.3f}{low * 1e3:>12.0f}-{high * 1e3:.0f}")


if __name__ == "__main__":
    main()
