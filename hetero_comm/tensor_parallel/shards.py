"""How a layer's neurons are split over unequal ranks, and the 2-D process groups."""

import math
from typing import Sequence, Tuple

import torch.distributed as dist

from .._checks import check_int

__all__ = ["shard_sizes", "shard_range", "tensor_data_groups"]


def shard_sizes(total: int, speeds: Sequence[float], multiple: int = 1) -> Tuple[int, ...]:
    """Split ``total`` neurons into one shard per rank, proportional to ``speeds``.

    Each shard is a multiple of ``multiple`` and at least one multiple; the shares are rounded
    by largest remainder (each within one multiple of its exact share when every share is at
    least one), so the sizes sum to ``total`` exactly.

    Example::

        >>> shard_sizes(1024, [2.0, 1.0])      # a rank twice as fast gets twice the neurons
        (683, 341)
    """
    check_int("total", total, 1)
    check_int("multiple", multiple, 1)
    speeds = list(speeds)
    if not speeds:
        raise ValueError("shard_sizes needs at least one rank's speed")
    for rank, speed in enumerate(speeds):
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (
                math.isfinite(speed) and speed > 0):
            raise ValueError(f"speeds[{rank}] must be a finite number > 0; got {speed!r}")
    if total % multiple:
        raise ValueError(f"total ({total}) must be a multiple of multiple ({multiple})")
    units = total // multiple
    if units < len(speeds):
        raise ValueError(f"{total} neurons in multiples of {multiple} cannot give each of "
                         f"{len(speeds)} ranks a shard")
    # Largest remainder of the proportional shares; then a rank left empty takes one unit
    # from the largest shard.
    shares = [units * speed / sum(speeds) for speed in speeds]
    counts = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(speeds)), key=lambda r: (counts[r] - shares[r], r))
    for rank in by_remainder[:units - sum(counts)]:
        counts[rank] += 1
    for rank in range(len(counts)):
        if counts[rank] == 0:
            counts[max(range(len(counts)), key=lambda r: counts[r])] -= 1
            counts[rank] = 1
    return tuple(count * multiple for count in counts)


def shard_range(sizes: Sequence[int], rank: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s shard."""
    if not 0 <= rank < len(sizes):
        raise ValueError(f"rank {rank} has no shard: there are {len(sizes)} shards")
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def tensor_data_groups(tensor_parallel_size: int):
    """The 2-D layout over the world: consecutive runs of ``tensor_parallel_size`` ranks share
    the layers (tensor parallel); the ranks at the same place in each run form a
    data-parallel group (DDP, any hetero_comm hook). Collective: every rank calls it.

    Returns:
        ``(tensor_group, data_group)`` of this rank.
    """
    world = dist.get_world_size()
    check_int("tensor_parallel_size", tensor_parallel_size, 1, world)
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must divide the number "
                         f"of ranks ({world})")
    rank = dist.get_rank()
    tensor_group = data_group = None
    runs = world // tensor_parallel_size
    for run in range(runs):  # every rank creates every group, in the same order
        ranks = list(range(run * tensor_parallel_size, (run + 1) * tensor_parallel_size))
        created = dist.new_group(ranks)
        if rank in ranks:
            tensor_group = created
    for place in range(tensor_parallel_size):
        ranks = list(range(place, world, tensor_parallel_size))
        created = dist.new_group(ranks)
        if rank in ranks:
            data_group = created
    return tensor_group, data_group
