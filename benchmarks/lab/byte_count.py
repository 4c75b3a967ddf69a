"""Bytes a rank hands to collectives, measured the same way for every hook (hetero_comm's,
whose states also count their own, and PyTorch's, which do not)."""

import contextlib
from typing import Dict

import torch.distributed as dist

__all__ = ["count_collective_bytes"]


@contextlib.contextmanager
def count_collective_bytes(totals: Dict[str, int]):
    """Add the bytes this rank hands to ``dist.all_reduce`` / ``all_gather`` to
    ``totals["bytes"]`` while active (by wrapping the two functions of
    ``torch.distributed``, restored on exit)."""
    original_allreduce, original_allgather = dist.all_reduce, dist.all_gather

    def all_reduce(tensor, *args, **kwargs):
        totals["bytes"] += tensor.numel() * tensor.element_size()
        return original_allreduce(tensor, *args, **kwargs)

    def all_gather(tensor_list, tensor, *args, **kwargs):
        totals["bytes"] += tensor.numel() * tensor.element_size()
        return original_allgather(tensor_list, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    try:
        yield totals
    finally:
        dist.all_reduce, dist.all_gather = original_allreduce, original_allgather
