"""Compare DDP communication hooks: bytes on the wire, hook cost, step time, accuracy.

Two measurements per hook, printed as one table:

1. Training (the demo's workload): N local gloo ranks train the digits MLP for the given
   epochs; bytes each rank hands to collectives per step (measured by wrapping
   ``dist.all_reduce``/``all_gather``, the same instrument for every hook), the compression
   against dense float32, the median step time and the final test accuracy.
2. Hook cost: one rank (world size 1, so the collective moves nothing) runs backward through
   a 4 x Linear(2048, 2048) model (16.8M parameters, 67 MB of gradients) with the hook, and
   with a hook that returns the bucket untouched; the difference per MB of gradient is the
   hook's encode + decode time.

Usage: python benchmarks/bench_hooks.py [--workers 2] [--epochs 8] [--quick] [--json PATH] [--only int8,...]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from lab.launch import free_port
from lab.registry import make_hook
from lab.training import TrainConfig, run_training

CONFIGS = [
    ("dense allreduce", dict(hook="dense")),
    ("torch fp16_compress_hook", dict(hook="fp16")),
    ("torch powerSGD_hook rank 1", dict(hook="powersgd", hook_settings=dict(matrix_approximation_rank=1))),
    ("torch powerSGD_hook rank 4", dict(hook="powersgd", hook_settings=dict(matrix_approximation_rank=4))),
    ("segment_sparse 1% (current)", dict(hook="sparse", hook_settings=dict(density=0.01))),
    ("segment_sparse 1% + momentum corr.",
     dict(hook="sparse", hook_settings=dict(density=0.01, momentum=0.9))),
    ("segment_sparse 0.1%", dict(hook="sparse", hook_settings=dict(density=0.001))),
    ("dct_quant keep 1/8, 8 bit", dict(hook="dct", hook_settings=dict(keep_ratio=0.125, bits=8))),
    ("dct_quant keep 1/4, 16 bit", dict(hook="dct", hook_settings=dict(keep_ratio=0.25, bits=16))),
    ("segment_sparse 8% bfloat16, segments of 512",
     dict(hook="sparse", hook_settings=dict(density=0.08, wire_dtype="bfloat16", segment_size=512))),
    ("segment_sparse 8% int8, segments of 512",
     dict(hook="sparse", hook_settings=dict(density=0.08, wire_dtype="int8", segment_size=512))),
    ("segment_sparse 10% DCT basis, sign, int8 (AdamW recipe)",
     dict(hook="sparse", hook_settings=dict(density=0.1, basis="dct", output="sign", wire_dtype="int8",
                                            segment_size=512), optimizer="adamw", lr=3e-3)),
]


def _noop_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def hook_cost_ms_per_mb(config: TrainConfig, repeats: int) -> float:
    """Extra backward time per MB of gradient that the hook adds (world size 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    megabytes = sum(p.numel() for p in model.parameters()) * 4 / 1e6
    x = torch.randn(16, 2048)

    # torch's PowerSGD on gloo deadlocks with several buckets in flight (its callbacks wait on
    # gloo's own threads): one bucket for it, and the same layout for the no-op baseline.
    bucket_cap_mb = 128 if config.hook == "powersgd" else None

    def median_backward(hook, state) -> float:
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        ddp.register_comm_hook(state, hook)
        times = []
        for i in range(repeats + 3):  # the first steps: DDP rebuild and the hook's warm-up
            began = time.perf_counter()
            ddp(x).sum().backward()
            times.append(time.perf_counter() - began)
            model.zero_grad(set_to_none=False)
        return statistics.median(times[3:])

    state, hook = make_hook(config.hook, config.hook_settings)
    with_hook = median_backward(hook, state)
    without = median_backward(_noop_hook, None)
    return 1000 * (with_hook - without) / megabytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7, help="hook-cost repeats")
    parser.add_argument("--quick", action="store_true", help="2 epochs, 3 repeats")
    parser.add_argument("--json", help="save the numbers here")
    parser.add_argument("--only", help="comma-separated words: run dense and the hooks whose name "
                        "contains one of them")
    args = parser.parse_args()
    epochs, repeats = (2, 3) if args.quick else (args.epochs, args.repeats)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    rows = []
    words = args.only.split(",") if args.only else None
    chosen = [c for i, c in enumerate(CONFIGS) if i == 0 or words is None or any(w in c[0] for w in words)]
    for name, overrides in chosen:
        config = TrainConfig(workers=args.workers, epochs=epochs,
                             global_batch=32 * args.workers, **overrides)
        record = run_training(config)
        steps = record["history"]["seconds"]
        rows.append(dict(
            hook=name, bytes_per_step=record["bytes_per_step"],
            compression=record["dense_bytes_per_step"] / record["bytes_per_step"],
            hook_ms_per_mb=hook_cost_ms_per_mb(config, repeats),
            step_ms=1000 * statistics.median(steps), accuracy=record["final_accuracy"],
            ranks_identical=record["ranks_identical"]))
        print(f"  done: {name}", file=sys.stderr, flush=True)
    dist.destroy_process_group()

    dense = rows[0]
    print(f"\nDDP hooks: digits MLP (85,002 parameters), {args.workers} gloo ranks on 127.0.0.1, "
          f"{epochs} epochs, SGD lr 0.02 momentum 0.9 (0 with momentum correction); "
          f"hook cost on 67 MB of gradients, 1 thread")
    header = ("hook", "bytes/step", "compression", "hook ms/MB", "step ms", "test acc", "vs dense")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print(f"| {r['hook']} | {r['bytes_per_step']:,.0f} | {r['compression']:.1f}x | "
              f"{r['hook_ms_per_mb']:.2f} | {r['step_ms']:.2f} | {100 * r['accuracy']:.1f}% | "
              f"{100 * (r['accuracy'] - dense['accuracy']):+.1f} |")
    print("\nbytes/step: averaged over the run, warm-up steps (dense) included; compression: "
          "dense float32 bytes / bytes/step. step ms: median wall time of a training step "
          "(loopback network, so this is compute, not link, bound). The AdamW recipe's row "
          "trains with AdamW, lr 3e-3, betas (0, 0).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
