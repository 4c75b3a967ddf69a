"""Where a recipe's host time per bucket goes: ``cProfile`` of 300 steps of a DDP model with
buckets of 4-8K values (bench_hook_cost's small-bucket model) at world size 1 (gloo), the
recipe registered by ``hetero_comm.compress``. Prints each of the hook's parts (the two
``dist.all_reduce`` calls, the codec's kernels, the rest of the hook's Python) in microseconds
per bucket and as a share of the hook's time. The profiler's own cost inflates every Python
call, so read the shares, not the absolute figures.

    PYTHONPATH=benchmarks python benchmarks/experiments/hook_profile.py [--optimizer sgd|adamw]

``--unprofiled`` runs the steps (3,000) without cProfile, for a sampling profiler outside:
``py-spy record -f raw -o out.txt -- python benchmarks/experiments/hook_profile.py --unprofiled``.
"""

import argparse
import cProfile
import os
import pstats

import torch
import torch.distributed as dist

from hook_floor import small_bucket_step  # (this script's folder is on the path when run)
from lab.launch import free_port

STEPS = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--unprofiled", action="store_true",
                        help="3000 steps without cProfile (for py-spy or perf outside)")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    step, _ = small_bucket_step(args.optimizer, "recipe")
    for _ in range(20):
        step()
    if args.unprofiled:
        for _ in range(10 * STEPS):
            step()
        dist.destroy_process_group()
        return
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(STEPS):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, _, tottime, cumtime, _)

    def cumulative(name_part: str, file_part: str = "") -> tuple:
        found = [(value[0], value[3]) for (file, _, name), value in stats.items()
                 if name_part == name and file_part in file]
        return sum(c for c, _ in found), sum(t for _, t in found)

    buckets, hook = cumulative("segment_sparse_hook")
    parts = {"the hook, in all": hook,
             "dist.all_reduce (importance and wire)": cumulative("all_reduce", "distributed_c10d")[1],
             "  of which the collective's own call": cumulative("<built-in method torch._C._distributed_c10d.allreduce>")[1],
             "the codec's kernels (torch.ops.hetero_comm)": sum(
                 value[3] for (file, _, name), value in stats.items() if "hetero_comm." in name and file == "~")}
    print(f"{args.optimizer} recipe, world size 1: {buckets / STEPS:.0f} buckets a step, {STEPS} steps profiled")
    for part, seconds in parts.items():
        print(f"  {part:<46} {1e6 * seconds / buckets:7.1f} us a bucket  {seconds / hook:6.0%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
