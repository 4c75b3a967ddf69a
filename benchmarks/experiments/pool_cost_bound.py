"""How much of the recipes' host time per bucket is the BufferPool's: bench_hook_cost's
small-bucket run (buckets of 4-8K values, where the kernels take microseconds) with the pool
as it is, and with ``BufferPool.acquire`` replaced by ``torch.empty`` and ``release`` /
``retain`` by nothing (``POOL_MODE=empty``, read by every spawned rank): the most that a
cheaper pool could give back. Run each mode several times in turns; the machine's noise is of
the same order as the effect. Results: ``benchmarks/results/pool_cost_bound.txt``.

Usage: POOL_MODE=pool|empty PYTHONPATH=benchmarks python benchmarks/experiments/pool_cost_bound.py
"""

import os
import sys

import torch

import hetero_comm.buffer_pool

if os.environ.get("POOL_MODE") == "empty":  # in every spawned rank, which imports this module again
    hetero_comm.buffer_pool.BufferPool.acquire = (
        lambda self, numel, dtype=torch.float32, device="cpu": torch.empty(int(numel), dtype=dtype, device=device))
    hetero_comm.buffer_pool.BufferPool.release = lambda self, tensor: None
    hetero_comm.buffer_pool.BufferPool.retain = lambda self, tensor: None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_hook_cost  # noqa: E402

if __name__ == "__main__":
    bench_hook_cost.main(["--device", "cpu", "--width", "64", "--layers", "16", "--batch", "8",
                          "--bucket-mb", "0.016", "--steps", "100"])
