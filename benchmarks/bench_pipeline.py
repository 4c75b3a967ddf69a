"""The pipeline planner: its solve time, and its plans run on real unequal CPU ranks.

Part 1, planner time: synthetic profiles of 100 layers on 8 device kinds (uneven layers, speeds
1-3x apart, memory limits that force recomputation somewhere), GPipe and 1F1B, with and without
recompute choices; median of 3 solves.

Part 2, 2 machines x 2 device kinds = 4 local gloo ranks. The device kinds are CPU quotas
(cgroup v1, 5 ms period, root only): ``--fast-cores`` and ``--slow-cores`` of one core each,
every rank pinned so that no core is oversubscribed. The model is an MLP of unequal blocks.

1. Profile: every rank times each block on one micro-batch under its own quota
   (``profile_layers``, medians shared with ``gather_profiles``) and measures its links: an
   allreduce with its replica on the other machine, and a send/receive with its neighbour stage.
2. Plan: ``plan_pipeline`` (GPipe, ``--micro-batches``) and ``simulate``: the predicted step.
3. Run, on the same quotas: the plan; an even split (the same number of blocks per stage, the
   same device order); and pure data parallel over the 4 ranks with dynamic batches
   (``DynamicBatchController`` re-planning every 5 steps), each rank holding the whole model.
   Every run processes the same global batch per step and reports the median step after
   warm-up.

Usage: python benchmarks/bench_pipeline.py [--fast-cores 0.7] [--slow-cores 0.25]
       [--micro-batches 4] [--steps 30] [--skip-planner-time] [--timeline PATH]
"""

import argparse
import contextlib
import itertools
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.launch import run_ranks
from lab.throttle import CpuQuota, cpu_quota_unavailable
from hetero_comm.pipeline import (Cluster, DeviceKind, LayerProfile, build_pipeline, even_plan,
                                  evaluate_plan, format_plan, gather_profiles, plan_pipeline,
                                  plot_timeline, profile_layers, simulate)

# Unequal blocks: widths chosen so that block costs differ by up to ~16x.
WIDTHS = (512, 2048, 512, 512, 1024, 1024, 256, 2048, 2048, 512, 256, 256, 1024, 64)
CLASSES = 10
KINDS = ("fast", "slow")
MICRO_BATCH = 32


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(*blocks, nn.Linear(WIDTHS[-1], CLASSES))


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.01)


def batch(step: int, size: int, machine: int):
    generator = torch.Generator().manual_seed(1000 * step + machine)
    return (torch.randn(size, WIDTHS[0], generator=generator),
            torch.randint(0, CLASSES, (size,), generator=generator))


# ------------------------------------------------------------------ part 1: planner time
def synthetic_cluster(num_layers: int, num_devices: int, tight_memory: bool) -> Cluster:
    base = [1e-3 * (1 + (7 * l) % 11) for l in range(num_layers)]
    params = [4 * 2**20 * (1 + (3 * l) % 5) for l in range(num_layers)]
    output = [2**20 * (1 + l % 3) for l in range(num_layers)]
    saved = [2 * o for o in output]
    total = sum(params) * 4 / num_devices + sum(saved) * 8 / num_devices
    devices = tuple(DeviceKind(f"d{i}", LayerProfile(tuple(b * (1 + i % 3) for b in base),
                                                     tuple(2 * b * (1 + i % 3) for b in base),
                                                     tuple(output), tuple(saved), tuple(params),
                                                     2**20),
                               memory_bytes=total * (0.6 if i % 2 else 2.0) if tight_memory
                               else math.inf)
                    for i in range(num_devices))
    return Cluster(devices, 2, stage_bytes_per_s=10e9, sync_bytes_per_s=1.25e9)


def planner_time_table() -> str:
    lines = ["planner: 100 layers x 8 device kinds, 8 micro-batches, median of 3 solves",
             f"{'memory':<7} {'schedule':<9} {'recompute':<10} {'solve s':>8} {'step (model) ms':>16} "
             f"{'even split ms':>16} {'stages recomputing':>19}"]
    for tight, schedule, allow in itertools.product((False, True), ("gpipe", "1f1b"), (False, True)):
        cluster = synthetic_cluster(100, 8, tight)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            try:
                plan = plan_pipeline(cluster, 8, schedule, allow_recompute=allow)
            except ValueError:
                plan = None
            seconds.append(time.perf_counter() - start)
        split = even_plan(cluster, 8, schedule)
        fits = all(stage.predicted_memory_bytes <= cluster.device(stage.device).memory_bytes
                   for stage in split.stages)
        even = f"{split.predicted_step_s * 1e3:.1f}" + ("" if fits else " (no fit)")
        step = f"{plan.predicted_step_s * 1e3:.1f}" if plan else "no fit"
        recomputing = sum(s.recompute for s in plan.stages) if plan else 0
        lines.append(f"{'tight' if tight else 'ample':<7} {schedule:<9} {'allowed' if allow else 'off':<10} "
                     f"{statistics.median(seconds):>8.2f} {step:>16} {even:>16} {recomputing:>19}")
    return "\n".join(lines)


# ------------------------------------------------------------------ part 2: real ranks
def _kind(rank: int, stage_kinds) -> str:
    return stage_kinds[rank % len(stage_kinds)]


def profile_worker(rank: int, world_size: int, stage_kinds):
    """Profile this rank's kind and its links; every rank returns the shared figures."""
    torch.manual_seed(0)
    model = make_model()
    sample = batch(0, MICRO_BATCH, 0)[0]
    profile = profile_layers(model, sample, repeats=5, warmup=2, min_sample_s=0.05,
                             optimizer=make_optimizer)
    profiles = gather_profiles(profile, _kind(rank, stage_kinds))
    num_stages = len(stage_kinds)
    stage = rank % num_stages
    replicas = [dist.new_group([s + m * num_stages for m in range(world_size // num_stages)])
                for s in range(num_stages)]
    # As DDP syncs: gradients copied into a 25 MB bucket, allreduced, copied back.
    gradients, payload = torch.randn(25 * 2**20 // 4), torch.empty(25 * 2**20 // 4)

    def bucket_sync():
        payload.copy_(gradients)
        dist.all_reduce(payload, group=replicas[stage])
        gradients.copy_(payload)

    sync = _timed(bucket_sync)
    neighbour = rank + 1 if stage % 2 == 0 else rank - 1
    activation = torch.zeros(MICRO_BATCH * max(WIDTHS))

    def exchange():
        if stage % 2 == 0:
            dist.send(activation, neighbour)
            dist.recv(activation, neighbour)
        else:
            dist.recv(activation, neighbour)
            dist.send(activation, neighbour)

    p2p = _timed(exchange) / 2
    sync_by_kind = [None] * world_size
    dist.all_gather_object(sync_by_kind, (_kind(rank, stage_kinds), payload.numel() * 4 / sync,
                                          activation.numel() * 4 / p2p))
    return profiles, sync_by_kind


def _timed(action, repeats: int = 7) -> float:
    action()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def pipeline_worker(rank: int, world_size: int, plan, steps: int):
    model = make_model()
    runner = build_pipeline(model, plan, nn.functional.cross_entropy)
    optimizer = make_optimizer(runner.module.parameters())
    groups = runner.groups
    size = plan.micro_batches * MICRO_BATCH
    durations = []
    for step in range(steps):
        x, y = batch(step, size, groups.machine)
        dist.barrier()
        start = time.perf_counter()
        runner.step(x if groups.is_first else None, y if groups.is_last else None)
        optimizer.step()
        optimizer.zero_grad()
        durations.append(time.perf_counter() - start)
    return durations


def data_parallel_worker(rank: int, world_size: int, global_batch: int, steps: int):
    from torch.nn.parallel import DistributedDataParallel
    from hetero_comm.hetero import DynamicBatchController, HeteroSampler
    from hetero_comm.hooks import AllreduceState, allreduce_hook

    model = DistributedDataParallel(make_model())
    sampler = HeteroSampler(global_batch * steps, global_batch, rank, world_size, seed=0)
    controller = DynamicBatchController(sampler, AllreduceState(), replan_every=5)
    controller.register_comm_hook(model, allreduce_hook)
    optimizer = make_optimizer(model.parameters())
    inputs, targets = batch(0, global_batch * steps, 0)
    controller.set_epoch(0)
    durations = []
    for indices in sampler:
        dist.barrier()
        start = time.perf_counter()
        with controller.step(len(indices)):
            nn.functional.cross_entropy(model(inputs[indices]), targets[indices]).backward()
        optimizer.step()
        optimizer.zero_grad()
        durations.append(time.perf_counter() - start)
    return durations, list(sampler.batch_sizes)


@contextlib.contextmanager
def quotas_for(rank_kinds, cores_of_kind):
    """One CPU quota per rank (its kind's cores); ranks pinned two to a core, a fast and a
    slow one together, so that no core is asked for more than it has."""
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(CpuQuota(cores_of_kind[kind])) for kind in rank_kinds]
        cpus = sorted(os.sched_getaffinity(0))

        def on_start(processes):
            for rank, (process, quota) in enumerate(zip(processes, groups)):
                quota.add(process.pid)
                os.sched_setaffinity(process.pid, {cpus[(rank + rank // 2) % 2 % len(cpus)]})

        yield on_start


def steady_median(durations, warmup: int) -> float:
    return statistics.median(durations[warmup:])


def measured_cluster(profiles, links, memory_bytes=math.inf) -> Cluster:
    """The cluster as profiled: per-kind layer costs, sync and neighbour bandwidth (medians)."""
    sync = {kind: statistics.median(s for k, s, _ in links if k == kind) for kind in KINDS}
    p2p = statistics.median(p for _, _, p in links)
    devices = tuple(DeviceKind(kind, profiles[kind], memory_bytes, sync_bytes_per_s=sync[kind])
                    for kind in KINDS)
    return Cluster(devices, machines=2, stage_bytes_per_s=p2p, sync_bytes_per_s=min(sync.values()),
                   state_bytes_per_param_byte=2.0)  # SGD: weights and gradients


def run_plan(plan, cores, steps: int, warmup: int) -> float:
    rank_kinds = [stage.device for stage in plan.stages] * 2
    with quotas_for(rank_kinds, cores) as on_start:
        durations = run_ranks(4, pipeline_worker, plan, steps, on_start=on_start, timeout=900)
    return max(steady_median(d, warmup) for d in durations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast-cores", type=float, default=0.7)
    parser.add_argument("--slow-cores", type=float, default=0.25)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-planner-time", action="store_true")
    parser.add_argument("--timeline", default="benchmarks/results/bench_pipeline_timeline.png")
    args = parser.parse_args()
    if not args.skip_planner_time:
        print(planner_time_table(), flush=True)
    reason = cpu_quota_unavailable()
    if reason:
        print(f"part 2 skipped: {reason}")
        return 0
    cores = {"fast": args.fast_cores, "slow": args.slow_cores}
    warmup = 5
    with quotas_for(KINDS * 2, cores) as on_start:
        profiles, links = run_ranks(4, profile_worker, KINDS, on_start=on_start, timeout=900)[0]
    cluster = measured_cluster(profiles, links)
    plan = plan_pipeline(cluster, args.micro_batches)
    even = evaluate_plan(cluster, even_plan(cluster, args.micro_batches,
                                            order=[s.device for s in plan.stages]))
    simulated = {name: simulate(cluster, p) for name, p in (("planned", plan), ("even", even))}
    print(f"\nfast = {args.fast_cores} core, slow = {args.slow_cores} core; 2 machines; "
          f"neighbour link {cluster.stage_bytes_per_s / 1e6:.0f} MB/s, sync link "
          + ", ".join(f"{d.name} {d.sync_bytes_per_s / 1e6:.0f} MB/s" for d in cluster.devices))
    print(format_plan(plan, simulated["planned"]))
    plot_timeline(plan, simulated["planned"], args.timeline)
    global_batch = 2 * args.micro_batches * MICRO_BATCH
    measured = {"planned": run_plan(plan, cores, args.steps, warmup),
                "even": run_plan(even, cores, args.steps, warmup)}
    with quotas_for(KINDS * 2, cores) as on_start:
        results = run_ranks(4, data_parallel_worker, global_batch, args.steps, on_start=on_start,
                            timeout=900)
    dp_step = max(steady_median(d, 2 * warmup) for d, _ in results)
    print(f"\nrun (global batch {global_batch} per step, median step after warm-up)")
    print(f"{'run':<34} {'measured ms':>12} {'simulated ms':>13} {'sim/measured':>13} "
          f"{'samples/s':>10} {'vs planned':>11}")
    rows = [("pipeline, planned (ILP)", measured["planned"], simulated["planned"].step_s),
            ("pipeline, even split", measured["even"], simulated["even"].step_s),
            (f"data parallel, dynamic batches {results[0][1]}", dp_step, None)]
    for name, step, predicted in rows:
        ratio = f"{predicted / step:.2f}" if predicted else ""
        predicted = f"{predicted * 1e3:.1f}" if predicted else ""
        print(f"{name:<34} {step * 1e3:>12.1f} {predicted:>13} {ratio:>13} "
              f"{global_batch / step:>10.0f} {step / measured['planned']:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
