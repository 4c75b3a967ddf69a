"""Tensor-parallel MLP blocks on unequal CPU ranks: shards by speed, communication overlapped,
against ``torch.distributed.tensor.parallel`` (even shards, no overlap).

Two gloo ranks, each pinned to its own core under a CPU quota (cgroup v1, root only): rank 0
``--fast-cores``, rank 1 ``--slow-cores``. The model is the MLP blocks of a transformer: a stack
of ``--blocks`` pre-norm residual blocks ``x + fc2(gelu(fc1(norm(x))))`` (width ``--width``, 4x
hidden), on ``--rows`` token rows per step. Every configuration trains with SGD on the same
rows, in turn, on the same two ranks:

* ``torch TP``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (even).
* ``even``: :class:`TensorParallelMLP` with even shards, one chunk (no overlap).
* ``by speed``: shards from :func:`measure_speeds` (each rank times an unsplit block), one chunk.
* ``by speed + overlap``: the same with the chunk count from :func:`tune_chunks`.

For the last two, the parts run apart: *compute* = the slower rank's step with its shards as
plain local layers (no communication), *communication* = the step's allreduces alone (one of
rows x width per block forward, one backward). Hidden share = (compute + communication - step)
/ communication, the communication timed with the link idle between the blocks' allreduces as
the step's compute leaves it (a shaped link refills its burst in such gaps). Every
configuration and both parts are measured in turns (``--rounds``, ``--steps`` each), and each
figure is the median over the turns. Then each rank's CPU time (every thread, gloo's included)
is measured with the wall time of the same steps: CPU over wall time and quota is how busy the
rank was, and a rank busy all the step can only go faster with less work, not more overlap.

With ``--link RATE`` (e.g. ``1gbit``; root, network namespaces) each rank runs in its own
namespace and their traffic crosses a real rate-limited link (``RateLimitedNetwork``), as
between two machines; without it the ranks talk over loopback.

Usage: python benchmarks/bench_tensor_parallel.py [--fast-cores 1.0] [--slow-cores 0.5]
       [--width 512] [--blocks 4] [--rows 1024] [--steps 4] [--rounds 5] [--link 1gbit]
       [--quota-period-us 5000] [--chunks 1,2,4,8] [--json PATH]
"""

import argparse
import contextlib
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from lab.launch import run_ranks
from lab.throttle import CpuQuota, cpu_quota_unavailable
from hetero_comm.tensor_parallel import (measure_speeds, parallelize_mlps,
                                         shard_range, shard_sizes, tune_chunks)


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def make_model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual(width, 4 * width) for _ in range(blocks)])


def step_times(model, rows, steps: int, warmup: int = 1) -> tuple:
    """Median seconds of a forward, backward and SGD step (ranks start each step together), and
    the median CPU time of the same steps on this rank (every thread, gloo's included)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    wall, cpu = [], []
    for index in range(warmup + steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        model(rows).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def step_seconds(model, rows, steps: int, warmup: int = 1) -> float:
    """Median seconds of a step (:func:`step_times`)."""
    return step_times(model, rows, steps, warmup)[0]


def torch_tensor_parallel(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def local_shards(model, sizes):
    """The same model with this rank's shards as plain layers: its compute, no communication."""
    rank = dist.get_rank()
    for block in model:
        start, end = shard_range(sizes, rank)
        fc1, fc2 = block.mlp[0], block.mlp[2]
        block.mlp = nn.Sequential(nn.Linear(fc1.in_features, end - start), nn.GELU(),
                                  nn.Linear(end - start, fc2.out_features))
    return model


def communication_seconds(rows_shape, blocks: int, steps: int, chunks: int,
                          clock=time.perf_counter, gap_s: float = 0.0) -> float:
    """The step's allreduces alone, as the blocks issue them: per block one forward, in
    ``chunks``, and one backward, whole; only their own time is counted. ``gap_s``: the link
    idles that long before each block's allreduces, as the step's compute leaves it idle (a
    token-bucket shaper, the netlab's, refills its burst in such gaps, so back to back the
    allreduces would be slower than in the step). ``clock=time.process_time``: the CPU time
    they take (every thread of this rank, gloo's included)."""
    buffers = [(torch.randn(rows_shape), pieces) for pieces in (chunks, 1) for _ in range(blocks)]
    seconds = []
    for index in range(steps + 1):
        dist.barrier()
        total = 0.0
        for buffer, pieces in buffers:
            time.sleep(gap_s)
            start = clock()
            pending = [dist.all_reduce(part, async_op=True) for part in torch.tensor_split(buffer, pieces)]
            for work in pending:
                work.wait()
            total += clock() - start
        if index >= 1:
            seconds.append(total)
    return statistics.median(seconds)


def slowest_rank(seconds: float) -> float:
    """The largest of every rank's ``seconds``: a tensor-parallel step waits for the slowest."""
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def every_rank(value: float) -> list:
    """``value`` from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def measure_in_turns(measures: dict, rounds: int) -> dict:
    """Each measure's median over ``rounds`` turns, every turn taking the measures one after
    another: a drift of the machine's speed during the run moves all of them alike (measured
    in phases instead, the compute-alone time moved 322-349 ms between runs)."""
    samples = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_rank(rank, world_size, args):
    torch.manual_seed(1)
    rows = torch.randn(args.rows, args.width)
    hidden = 4 * args.width
    candidates = args.chunks or (1, 2, 4, 8)
    torch_tp = torch_tensor_parallel(make_model(args.width, args.blocks))
    even = make_model(args.width, args.blocks)
    parallelize_mlps(even)
    probe = make_model(args.width, 1)[0].mlp
    speeds = measure_speeds(probe, rows)
    sizes = shard_sizes(hidden, speeds, multiple=16)
    split = {}  # name: (model, chunks)
    for name, tuned in (("by speed", False), ("by speed + overlap", True)):
        model = make_model(args.width, args.blocks)
        parallelize_mlps(model, speeds=speeds, multiple=16)
        split[name] = (model, tune_chunks(model, rows, candidates=candidates) if tuned else 1)
    compute = local_shards(make_model(args.width, args.blocks), sizes)
    steps = args.steps
    # the compute between two of the step's allreduce groups: the link idles that long
    gap = slowest_rank(step_seconds(compute, rows, 2)) / (2 * args.blocks)
    measures = {
        "torch TP": lambda: step_seconds(torch_tp, rows, steps),
        "even": lambda: step_seconds(even, rows, steps),
        "compute": lambda: slowest_rank(step_seconds(compute, rows, steps)),
        "back to back": lambda: communication_seconds(rows.shape, args.blocks, steps, 1),
        "communication CPU": lambda: slowest_rank(communication_seconds(
            rows.shape, args.blocks, steps, 1, clock=time.process_time, gap_s=gap)),
    }
    for name, (model, chunks) in split.items():
        measures[name] = functools.partial(step_seconds, model, rows, steps)
        measures[chunks] = functools.partial(communication_seconds, rows.shape, args.blocks, steps,
                                             chunks, gap_s=gap)
    measured = measure_in_turns(measures, args.rounds)
    # Wall and CPU time of the same steps, each rank's: CPU over wall time and quota is how
    # busy the rank was (the quota lets a few percent more through).
    cpu = {}
    for name, model in (("compute", compute), *((name, model) for name, (model, _) in split.items())):
        samples = [step_times(model, rows, steps) for _ in range(args.rounds)]
        cpu[name] = dict(step=statistics.median(wall for wall, _ in samples),
                         cpu=every_rank(statistics.median(used for _, used in samples)))
    return dict(steps={name: measured[name] for name in ("torch TP", "even", *split)},
                speeds=speeds, sizes=sizes, compute=measured["compute"],
                split={name: dict(chunks=chunks, communication=measured[chunks])
                       for name, (_, chunks) in split.items()},
                communication_back_to_back=measured["back to back"], gap_s=gap,
                communication_cpu=measured["communication CPU"], step_cpu=cpu,
                rounds=args.rounds)


@contextlib.contextmanager
def quotas(cores, period_us):
    """Rank r under a quota of ``cores[r]``, pinned to its own core."""
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(CpuQuota(share, period_us)) for share in cores]
        cpus = sorted(os.sched_getaffinity(0))

        def on_start(processes):
            for rank, (process, quota) in enumerate(zip(processes, groups)):
                quota.add(process.pid)
                os.sched_setaffinity(process.pid, {cpus[rank % len(cpus)]})

        yield on_start


PORT = 29511


def worker() -> None:
    """One rank inside a namespace of the rate-limited network; rank 0 prints its results."""
    args = argparse.Namespace(**json.loads(os.environ["HC_ARGS"]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}",
                            rank=rank, world_size=2, timeout=datetime.timedelta(minutes=10))
    result = bench_rank(rank, 2, args)
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as multiprocessing's children do: gloo's thread destructors can abort an exit


def run_over_link(args, cores) -> dict:
    """Both ranks in namespaces joined by links shaped to ``args.link``; rank 0's results."""
    from lab.netlab import RateLimitedNetwork
    argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    env = dict(HC_ARGS=json.dumps(vars(args)), PYTHONPATH=os.pathsep.join(sys.path))
    with tempfile.TemporaryFile("w+") as output, contextlib.ExitStack() as stack:
        groups = [stack.enter_context(CpuQuota(share, args.quota_period_us)) for share in cores]
        net = stack.enter_context(RateLimitedNetwork(2, args.link))
        cpus = sorted(os.sched_getaffinity(0))
        processes = []
        for rank in range(2):
            process = net.popen(rank, argv, env=dict(env, RANK=rank, MASTER_ADDR=net.address(0)),
                                stdout=output if rank == 0 else subprocess.DEVNULL)
            groups[rank].add(process.pid)  # ip netns exec and env exec: the pid is python's
            os.sched_setaffinity(process.pid, {cpus[rank % len(cpus)]})
            processes.append(process)
        for process in processes:
            if process.wait(timeout=1800) != 0:
                raise RuntimeError(f"a rank exited with code {process.returncode}")
        output.seek(0)
        lines = [line for line in output.read().splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def print_table(result, args) -> None:
    steps, torch_tp = result["steps"], result["steps"]["torch TP"]
    link = f"a {args.link} link" if args.link else "loopback"
    print(f"2 gloo ranks over {link}: rank 0 {args.fast_cores} core, rank 1 {args.slow_cores} core; "
          f"{args.blocks} MLP blocks {args.width} -> {4 * args.width} -> {args.width}, {args.rows} rows")
    print(f"measured speeds {[round(s, 2) for s in result['speeds']]} -> hidden shards "
          f"{list(result['sizes'])}")
    print(f"{'configuration':<22}{'chunks':>7}{'step ms':>9}{'vs torch TP':>13}")
    for name, seconds in steps.items():
        chunks = result["split"][name]["chunks"] if name in result["split"] else ""
        print(f"{name:<22}{chunks:>7}{seconds * 1e3:>9.1f}{torch_tp / seconds:>12.2f}x")
    compute = result["compute"]
    for name, split in result["split"].items():
        communication = split["communication"]
        hidden = (compute + communication - steps[name]) / communication
        print(f"{name}: compute alone {compute * 1e3:.1f} ms + communication alone "
              f"{communication * 1e3:.1f} ms ({split['chunks']} chunks) = "
              f"{(compute + communication) * 1e3:.1f} ms; step {steps[name] * 1e3:.1f} ms: "
              f"{hidden * 100:.0f}% of the communication hidden")
    # A rank under a quota of q cores runs at most q seconds of CPU a second: its CPU time over
    # the step's time and its quota is how busy it was.
    print("CPU time of rank 0, 1 in the same steps (the share of its quota it used):")
    for name, used in result["step_cpu"].items():
        busy = ", ".join(f"{c * 1e3:.1f} ms ({c / q / used['step']:.0%})"
                         for c, q in zip(used["cpu"], (args.fast_cores, args.slow_cores)))
        print(f"  {name + ' alone' if name == 'compute' else name}, step {used['step'] * 1e3:.1f} ms: {busy}")
    print(f"communication alone with the link idle {result['gap_s'] * 1e3:.0f} ms before each "
          f"block's allreduces, as in the step; back to back it takes "
          f"{result['communication_back_to_back'] * 1e3:.1f} ms (1 chunk)")
    cpu = result["communication_cpu"]
    print(f"the communication alone (1 chunk) keeps a rank's CPU busy {cpu * 1e3:.1f} ms a step "
          f"(the most of the ranks): time its compute cannot have, however it overlaps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast-cores", type=float, default=1.0)
    parser.add_argument("--slow-cores", type=float, default=0.5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and turn")
    parser.add_argument("--rounds", type=int, default=5,
                        help="turns: every configuration measured once in each, the median taken")
    parser.add_argument("--quota-period-us", type=int, default=5000,
                        help="the CPU quota's period: a throttled rank runs, then pauses, within it")
    parser.add_argument("--link", default=None, help="e.g. 1gbit: a rate-limited link between the ranks")
    parser.add_argument("--chunks", type=lambda text: tuple(int(c) for c in text.split(",")),
                        default=None, help="the chunk counts tune_chunks tries (default 1,2,4,8)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    reason = cpu_quota_unavailable()
    if reason is not None:
        raise SystemExit(f"this benchmark throttles a rank with a CPU quota: {reason}")
    cores = (args.fast_cores, args.slow_cores)
    if args.link:
        result = run_over_link(args, cores)
    else:
        with quotas(cores, args.quota_period_us) as on_start:
            result = run_ranks(2, bench_rank, args, timeout=1800, on_start=on_start)[0]
    print_table(result, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1, default=str)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
