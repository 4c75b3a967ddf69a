"""How far the recipes' host time per bucket is from its floor on the CPU, at world size 1
(gloo): where a bucket's time goes inside a DDP step, and what each irreducible part costs on
its own. The model is bench_hook_cost's small-bucket one (16 layers of 64 x 64, buckets of
4-8K values); the recipe is registered by ``hetero_comm.compress``.

    PYTHONPATH=benchmarks python benchmarks/experiments/hook_floor.py [--steps 2100]

Prints, per recipe, the hook's time a bucket split into the codec's kernel calls (timed as
the hook times them), the ``dist.all_reduce`` calls (issue only: the hook waits for them
elsewhere) and the rest (the hook's Python and its waits); then what a bucket adds to the step against a
hook that hands the bucket back, for DDP's own allreduce, for the least a Python hook can do
with the codec and an exchange per bucket (its three kernel calls and two collectives a
bucket, pipelined, and nothing else: no plan, statistics or checks) and for the recipe (which
shares an exchange among consecutive small buckets, so it can come out below that); then the
parts alone: a gloo allreduce issued
and waited for, a kernel call on a 64-value bucket (the call's own cost), a
``torch.futures.Future`` made and completed, and the codec's three kernels on one bucket
called again and again, on 11 buckets in turn (as a step meets them), and with 4 MB copied
between calls (their data out of the caches). Medians of several rounds; this machine's
speed drifts between runs, so compare figures of one run.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import hetero_comm
import hetero_comm.hooks._codec as codec_module
from hetero_comm._backend import kernel_backend
from hetero_comm._layout import num_segments
from lab.launch import free_port


def per_bucket_split(optimizer_name: str, steps: int) -> dict:
    """Microseconds a bucket: the hook's time and its parts, over ``steps`` steps."""
    step, state = small_bucket_step(optimizer_name, "recipe")
    spent = {"hook": 0.0, "allreduce": 0.0, "buckets": 0}
    plain_all_reduce, plain_run = dist.all_reduce, type(state).run

    def timed_all_reduce(*args, **kwargs):
        began = time.perf_counter()
        try:
            return plain_all_reduce(*args, **kwargs)
        finally:
            spent["allreduce"] += time.perf_counter() - began

    def timed_run(self, bucket, send):
        began = time.perf_counter()
        try:
            return plain_run(self, bucket, send)
        finally:
            spent["hook"] += time.perf_counter() - began
            spent["buckets"] += 1

    for _ in range(20):
        step()
    counters = state.statistics.counters
    kernels_before = counters["encode_seconds"] + counters["decode_seconds"]
    spent.update(hook=0.0, allreduce=0.0, buckets=0)
    codec_module.dist.all_reduce, type(state).run = timed_all_reduce, timed_run
    try:
        for _ in range(steps):
            step()
    finally:
        codec_module.dist.all_reduce, type(state).run = plain_all_reduce, plain_run
    kernels = counters["encode_seconds"] + counters["decode_seconds"] - kernels_before
    scale = 1e6 / spent["buckets"]
    return dict(hook=spent["hook"] * scale, kernels=kernels * scale,
                allreduce=spent["allreduce"] * scale,
                rest=(spent["hook"] - kernels - spent["allreduce"]) * scale)


RETURNED_BUCKETS = [0]  # buckets the "returned" hook has handed back


def small_bucket_step(optimizer_name: str, hook_kind: str):
    """One training step of the small-bucket model with ``hook_kind``: "returned" (the
    bucket handed back), "allreduce" (DDP's own), "least" (:func:`least_exchange_hook`) or
    "recipe"; and the recipe's state (None for the others)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(16)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.016)
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=1e-4) if optimizer_name == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9))
    state = None
    if hook_kind == "recipe":
        state = hetero_comm.compress(ddp, optimizer)
    elif hook_kind == "least":
        ddp.register_comm_hook(None, least_exchange_hook(hetero_comm.recipes.recipe_for(optimizer).settings))
    elif hook_kind == "returned":
        def returned(_, bucket):
            RETURNED_BUCKETS[0] += 1
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future
        ddp.register_comm_hook(None, returned)
    batch = torch.randn(8, 64)

    def step():
        optimizer.zero_grad(set_to_none=False)
        ddp(batch).square().mean().backward()
        optimizer.step()
    return step, state


def least_exchange_hook(settings: dict):
    """A DDP hook that does only what an exchange per bucket cannot do without: per bucket the
    codec's encode and the importance's allreduce, then the previous bucket's pack and wire
    allreduce, and the unpack of every wire that has arrived (all at the last bucket). No
    plan, warm-up, statistics, non-finite or settings checks: the bound on the hook's Python
    when every bucket is exchanged alone."""
    state = hetero_comm.hooks.SegmentSparseState(**settings)
    codecs, agreeing, summing = {}, [], []

    def hook(_, bucket):
        grad, last = bucket.buffer(), bucket.is_last()
        entry = codecs.get(bucket.index())
        if entry is None or entry[0].numel != grad.numel():  # (DDP's first step lays out others)
            numel, segment = grad.numel(), state.segment_size_for(grad.numel())
            block = state.dct_block_size if state.basis == "dct" else 0
            count = (num_segments(numel, segment) if not block
                     else num_segments(num_segments(numel, block), segment) * block)
            entry = codecs[bucket.index()] = (
                codec_module.BucketCodec(state, numel, state.segments_to_send(count, 10**6), segment,
                                         count, grad.device),
                torch.zeros(numel), torch.zeros(numel) if state.momentum else None)
        codec, residual, velocity = entry
        codec.encode(residual, grad, 1.0, velocity, state.momentum, state.nesterov)
        delivered = torch.futures.Future()
        agreeing.append((entry, grad, delivered, dist.all_reduce(codec.importance, async_op=True)))
        finishing = agreeing[:] if last else agreeing[:-1]
        del agreeing[:len(finishing)]
        for (codec, residual, velocity), grad, future, work in finishing:
            work.wait()
            codec.pack(residual, velocity)
            summing.append((codec, grad, future, dist.all_reduce(codec.wire, async_op=True)))
        waiting = []
        for codec, grad, future, work in summing:
            if last or work.is_completed():
                work.wait()
                codec.unpack(codec.wire, codec.scale, grad)
                future.set_result(grad)
            else:
                waiting.append((codec, grad, future, work))
        summing[:] = waiting
        return delivered

    return hook


ROUNDS = 30


def added_per_bucket(optimizer_name: str, steps: int) -> dict:
    """Microseconds a bucket each hook adds to the step against the bucket handed back (the
    configurations taking turns in :data:`ROUNDS` short rounds, so that the machine's drift
    meets each alike; the median round)."""
    kinds = ("returned", "allreduce", "least", "recipe")
    stepping = {kind: small_bucket_step(optimizer_name, kind)[0] for kind in kinds}
    for step in stepping.values():
        for _ in range(20):
            step()
    rounds = {kind: [] for kind in kinds}
    RETURNED_BUCKETS[0] = 0
    per_round = max(1, steps // ROUNDS)
    for _ in range(ROUNDS):
        for kind, step in stepping.items():
            began = time.perf_counter()
            for _ in range(per_round):
                step()
            rounds[kind].append((time.perf_counter() - began) / per_round)
    median = {kind: statistics.median(times) for kind, times in rounds.items()}
    buckets = RETURNED_BUCKETS[0] / (ROUNDS * per_round)
    return {kind: (median[kind] - median["returned"]) * 1e6 / buckets for kind in kinds[1:]}


def median_us(call, calls: int = 2000, rounds: int = 5) -> float:
    """The median over ``rounds`` of the mean time of ``calls`` calls, in microseconds."""
    for _ in range(100):
        call()
    means = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - began) / calls)
    return statistics.median(means) * 1e6


def collective_costs() -> dict:
    importance = torch.rand(264)
    in_flight = []

    def issue():  # waited for ten at a time, as the pipelined hook waits later
        in_flight.append(dist.all_reduce(importance, async_op=True))
        if len(in_flight) == 10:
            for work in in_flight:
                work.wait()
            in_flight.clear()

    def made_and_completed():
        torch.futures.Future().set_result(importance)

    return {"gloo allreduce of 264 float32: issue (waited for every tenth)": median_us(issue, 1000),
            "gloo allreduce of 264 float32: issue and wait": median_us(
                lambda: dist.all_reduce(importance, async_op=True).wait(), 1000),
            "torch.futures.Future() and set_result": median_us(made_and_completed)}


def kernel_costs(optimizer_name: str) -> dict:
    """The codec's three calls a bucket, warm, on 11 buckets in turn, and cold."""
    torch.manual_seed(0)
    state = hetero_comm.hooks.SegmentSparseState(**hetero_comm.recipes.recipe_for(
        torch.optim.AdamW([torch.zeros(1)]) if optimizer_name == "adamw"
        else torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9)).settings)
    numel = 4224
    velocity = torch.zeros(numel) if state.momentum else None
    codecs = []
    for _ in range(11):
        segment = state.segment_size_for(numel)
        block = state.dct_block_size if state.basis == "dct" else 0
        count = (num_segments(numel, segment) if not block
                 else num_segments(num_segments(numel, block), segment) * block)
        codec = codec_module.BucketCodec(state, numel, state.segments_to_send(count, 10**6),
                                         segment, count, torch.device("cpu"))
        codecs.append((codec, torch.zeros(numel), torch.randn(numel) * 1e-3,
                       None if velocity is None else torch.zeros(numel)))
    junk, junk_copy = torch.randn(1 << 20), torch.empty(1 << 20)

    def three_calls(codec, residual, grad, velocity):
        codec.encode(residual, grad, 1.0, velocity, state.momentum, state.nesterov)
        codec.pack(residual, velocity)
        codec.unpack(codec.wire, codec.scale, torch.empty(numel))

    def median_of_buckets(order, evict: bool, rounds: int = 200) -> float:
        """The median time of one bucket's three calls, the buckets taken in ``order``."""
        times = []
        for _ in range(rounds):
            for entry in order:
                if evict:
                    junk_copy.copy_(junk)
                began = time.perf_counter()
                three_calls(*entry)
                times.append(time.perf_counter() - began)
        return statistics.median(times[len(order) * 10:]) * 1e6

    small = torch.zeros(64), torch.randn(64), torch.empty(4)
    encode = torch.ops.hetero_comm.sparse_encode_.default
    return {"kernel call on 64 values (sparse_encode_, elements)": median_us(
                lambda: encode(small[0], small[1], 1.0, None, 0.0, False, 16, 0, None, small[2])),
            "codec's 3 kernels, one bucket again and again": median_of_buckets(codecs[:1] * 11, False),
            "codec's 3 kernels, 11 buckets in turn": median_of_buckets(codecs, False),
            "codec's 3 kernels, 4 MB copied before each": median_of_buckets(codecs, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2100)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, kernels {kernel_backend('cpu')}, 1 thread, world size 1")
    print("\n| recipe | hook, us a bucket | kernel calls | dist.all_reduce calls | the rest (Python, waits) |")
    print("|---|---|---|---|---|")
    for name in ("sgd", "adamw"):
        split = per_bucket_split(name, args.steps)
        print(f"| {name} | {split['hook']:.0f} | {split['kernels']:.0f} | {split['allreduce']:.0f} | "
              f"{split['rest']:.0f} |")
    print("\n| recipe | added a bucket, us: DDP's allreduce | the least exchange | the recipe | "
          "least / DDP | recipe / DDP |")
    print("|---|---|---|---|---|---|")
    for name in ("sgd", "adamw"):
        added = added_per_bucket(name, args.steps)
        print(f"| {name} | {added['allreduce']:.0f} | {added['least']:.0f} | {added['recipe']:.0f} | "
              f"{added['least'] / added['allreduce']:.1f}x | {added['recipe'] / added['allreduce']:.1f}x |")
    print("\n| part alone | us |")
    print("|---|---|")
    for part, us in collective_costs().items():
        print(f"| {part} | {us:.1f} |")
    for name in ("sgd", "adamw"):
        for part, us in kernel_costs(name).items():
            print(f"| {name} recipe: {part} | {us:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
