"""What the recipe hooks add to a DDP step, against the allreduce they replace.

On one GPU (or the CPU), a 25.2M-parameter MLP (6 x Linear(2048, 2048), 101 MB of float32
gradient a step) trains with DDP, and each configuration gets the median of its timed steps
(forward, backward with the hook, optimizer; the device synchronised around each step; the
configurations take turns, ten rounds of a tenth of the steps each):

- ``allreduce``: DDP's own hook;
- ``no communication`` (SGD, momentum 0.9) and ``no communication, AdamW``: a hook that
  returns the bucket as it is (the compute alone, with each optimizer's step);
- ``AdamW recipe``, ``SGD recipe`` (momentum 0.9): ``hetero_comm.compress(ddp, optimizer)``,
  each recipe's added time taken against the "no communication" step with its own optimizer
  (AdamW's step costs more than SGD's, and that is not the hook's).
- ``SGD recipe, no watch``: the SGD recipe asked for its own density with ``ratio=``, which
  leaves out its gradient watch (the cost of the watch: the difference to ``SGD recipe``).

Two runs: world size 1 (NCCL on CUDA, gloo on the CPU), where the collective moves nothing
and a recipe's added time (its step minus "no communication") is its kernels' cost; and 2 gloo
ranks sharing the device, where the allreduce goes through the host, the path a GPU cluster
without NCCL between its sites takes. Each run also times a bare ``dist.all_reduce`` of the
same bytes. The table prints both and the ratio of a recipe's added time to the allreduce.

    python benchmarks/bench_hook_cost.py --device cuda [--json PATH]
    python benchmarks/bench_hook_cost.py --device cpu --width 512 --steps 5   # a quick check
    python benchmarks/bench_hook_cost.py --device cpu --width 64 --layers 16 --batch 8 \
        --bucket-mb 0.016 --steps 100    # buckets of ~4-8K values: the host's time per bucket
    python benchmarks/bench_hook_cost.py --device cuda --profile hook_profile.txt

``--profile PATH`` also profiles one steady step of each recipe at world size 1
(``torch.profiler``, CPU and CUDA activity) and writes the ops sorted by their own host time,
with the number of calls: where the added time goes. ``--trace PATH`` adds the AdamW recipe's
step as a Chrome trace (the host's launches against the device's kernels, gaps included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm
from hetero_comm.recipes import recipe_for
from lab.launch import run_ranks

CONFIGS = ("allreduce", "no communication", "no communication, AdamW", "AdamW recipe", "SGD recipe",
           "SGD recipe, no watch")
# the configuration each one's added time is measured against: the same optimizer, no hook work
BASELINES = {config: "no communication, AdamW" if "AdamW" in config else "no communication"
             for config in CONFIGS}


def _return_bucket(calls, bucket):
    calls.append(bucket.index())
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(config: str, device: torch.device, width: int, layers: int, group, bucket_mb: float,
           calls: list):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    ddp = DistributedDataParallel(model.to(device), process_group=group, bucket_cap_mb=bucket_mb)
    if "AdamW" in config:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    if config.startswith("no communication"):
        ddp.register_comm_hook(calls, _return_bucket)
    elif config.endswith("recipe"):
        hetero_comm.compress(ddp, optimizer, process_group=group)
    elif config.endswith("no watch"):  # the recipe's own density asked for: no gradient watch
        hetero_comm.compress(ddp, optimizer, process_group=group,
                             ratio=recipe_for(optimizer).nominal_ratio)
    return ddp, optimizer


def _step_ms(ddp, optimizer, batch, device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    ddp(batch).square().mean().backward()
    optimizer.step()
    _synchronize(device)
    return (time.perf_counter() - start) * 1e3


ROUNDS = 10


def _timed_steps(steps: int) -> int:
    """The steps each configuration is timed for: whole rounds."""
    return max(1, steps // ROUNDS) * ROUNDS


def _median_step_ms(built: dict, batch, device, warmup: int, steps: int) -> dict:
    """Each configuration's median step time: ``warmup`` steps each, then :data:`ROUNDS` turns
    in which every configuration runs a round's share of the steps, so that a slow spell of
    the machine falls on all of them alike."""
    for ddp, optimizer in built.values():
        for _ in range(warmup):
            _step_ms(ddp, optimizer, batch, device)
    times = {config: [] for config in built}
    per_round = _timed_steps(steps) // ROUNDS
    for _ in range(ROUNDS):
        for config, (ddp, optimizer) in built.items():
            times[config] += [_step_ms(ddp, optimizer, batch, device) for _ in range(per_round)]
    return {config: statistics.median(values) for config, values in times.items()}


def _median_allreduce_ms(numel: int, device, group, repeats: int) -> float:
    flat = torch.randn(numel, device=device)
    times = []
    for repeat in range(repeats + 3):
        _synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(flat, group=group)
        _synchronize(device)
        if repeat >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# runtime calls counted in a profiled step: kernel launches, copies, host synchronisations
RUNTIME_CALLS = {"launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                              "cuLaunchKernelEx"),
                 "copies": ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync"),
                 "host syncs": ("cudaDeviceSynchronize", "cudaStreamSynchronize",
                                "cudaEventSynchronize")}


def _profile_table(ddp, optimizer, batch, device, trace_path=None, rows: int = 40) -> dict:
    """One profiled step: its table (``rows`` rows by host time) and its count of each of
    :data:`RUNTIME_CALLS`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        optimizer.zero_grad(set_to_none=False)
        ddp(batch).square().mean().backward()
        optimizer.step()
        _synchronize(device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    averages = prof.key_averages()
    counts = {kind: sum(event.count for event in averages if event.key in names)
              for kind, names in RUNTIME_CALLS.items()}
    return dict(counts, table=averages.table(sort_by="self_cpu_time_total", row_limit=rows))


def measure_rank(rank, world_size, device_name, width, layers, batch_size, warmup, steps, nccl,
                 bucket_mb=25.0, profile=False, trace_path=None):
    """One rank's median step time per configuration and of a bare allreduce (ms)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", 0)  # the ranks share the first GPU
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(world_size)), backend="nccl") if nccl else None
    batch = torch.randn(batch_size, width, generator=torch.Generator().manual_seed(rank)).to(device)
    profiles, calls = {}, []
    built = {config: _build(config, device, width, layers, group, bucket_mb, calls)
             for config in CONFIGS}
    times = _median_step_ms(built, batch, device, warmup, steps)
    calls_per_step = len(calls) / (2 * (warmup + _timed_steps(steps)))  # the two "no communication" hooks'
    for config, (ddp, optimizer) in built.items():
        if profile and config != "allreduce":
            trace = trace_path if config == "AdamW recipe" else None
            profiles[config] = _profile_table(ddp, optimizer, batch, device, trace)
    del built
    numel = layers * (width * width + width)
    times["bare allreduce"] = _median_allreduce_ms(numel, device, group, steps)
    # DDP's buckets in a steady step (the "no communication" hook saw every step's)
    return {"parameters": numel, "times_ms": times, "profiles": profiles,
            "buckets": round(calls_per_step)}


def print_run(title: str, result: dict) -> dict:
    times = result["times_ms"]
    compute = times["no communication"]
    allreduce_in_step = times["allreduce"] - compute
    bare = times["bare allreduce"]
    print(f"\n{title}: {result['parameters'] / 1e6:.1f}M parameters, "
          f"{4 * result['parameters'] / 1e6:.0f} MB of float32 gradient a step")
    print(f"  bare dist.all_reduce of those bytes: {bare:.3f} ms; DDP's allreduce adds "
          f"{allreduce_in_step:.3f} ms to the step; {result['buckets']} DDP bucket(s) a step")
    print(f"  {'configuration':<23} {'step ms':>9} {'added ms':>9} {'added / bare allreduce':>23}"
          f" {'added ms a bucket':>18}")
    summary = {}
    for config in CONFIGS:
        added = times[config] - times[BASELINES[config]]
        ratio = added / bare if bare > 0 else float("nan")
        shown = "-" if config.startswith("no communication") else f"{ratio:.0%}"
        print(f"  {config:<23} {times[config]:>9.3f} {added:>9.3f} {shown:>23}"
              f" {added / result['buckets']:>18.3f}")
        summary[config] = {"step_ms": times[config], "added_ms": added, "added_over_allreduce": ratio}
    return summary


def print_runtime_calls(profiles: dict, buckets: int) -> None:
    """Each recipe's runtime calls a bucket beyond those of the same step without
    communication (one profiled step each)."""
    print(f"\n  runtime calls a bucket added by the recipe (one profiled step, {buckets} bucket(s))")
    print(f"  {'configuration':<23}" + "".join(f" {kind:>12}" for kind in RUNTIME_CALLS))
    for config, profiled in profiles.items():
        if "recipe" in config:
            baseline = profiles[BASELINES[config]]
            print(f"  {config:<23}" + "".join(f" {(profiled[kind] - baseline[kind]) / buckets:>12.1f}"
                                              for kind in RUNTIME_CALLS))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (the recipes "
                                                              "send the first step dense)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb (small buckets: the hooks' host time per bucket)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--profile", metavar="PATH", help="write a profile of one step of each "
                                                          "recipe at world size 1 to PATH")
    parser.add_argument("--trace", metavar="PATH", help="with --profile: also write a Chrome "
                        "trace of the AdamW recipe's profiled step to PATH")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 1
    backend = hetero_comm.kernel_backend(args.device)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"hook cost: torch {torch.__version__}, {where}, kernels {backend}; median of "
          f"{args.steps} steps after {args.warmup}; batch {args.batch}")
    shape = (args.device, args.width, args.layers, args.batch, args.warmup, args.steps)
    alone = "world size 1, NCCL" if args.device == "cuda" else "world size 1, gloo"
    runs = {alone: run_ranks(1, measure_rank, *shape, args.device == "cuda", args.bucket_mb,
                             bool(args.profile), args.trace)[0],
            "2 gloo ranks on one device": run_ranks(2, measure_rank, *shape, False, args.bucket_mb)[0]}
    profiles = {title: run.pop("profiles") for title, run in runs.items()}
    if args.profile:
        with open(args.profile, "w") as f:
            for config, profiled in profiles[alone].items():
                if "recipe" in config:
                    f.write(f"{config}, {alone}, one steady step ({where}):\n{profiled['table']}\n\n")
        print(f"saved {args.profile}")
        print_runtime_calls(profiles[alone], runs[alone]["buckets"])
    report = {"device": where, "torch": torch.__version__, "settings": vars(args),
              "runs": {title: dict(result, summary=print_run(title, result))
                       for title, result in runs.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
