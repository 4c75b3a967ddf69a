"""The int8 wire's sum in two phases, for any number of ranks.

An allreduce sums the ranks' int8 values in int8, so each rank may send only
``127 // world_size`` steps each way. Here each rank rounds to the full 127 steps, and the sum
is made in two collectives instead: an all-to-all gives every rank (the *owner*) one chunk of
the selected segments from every rank, which it sums exactly in int32 and rounds once more to
127 steps per segment, on a scale of its own; an all-gather then gives every rank every
owner's chunk and scales. The bytes per value stay those of a ring allreduce whatever the
number of ranks, and so does the precision. What the owner's rounding drops is added to its
own residual, so error feedback sends it later (nothing is lost: the conservation the other
wires keep holds here too).
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import ops
from .._collectives import all_gather_single

__all__ = ["TWO_PHASE_LEVELS", "TwoPhaseSum", "owned_bounds", "two_phase_int8_sum",
           "add_to_residual", "two_phase_wire_bytes"]

# Steps each way a rank's values, and an owner's sum, are rounded to.
TWO_PHASE_LEVELS = 127


def owned_bounds(k: int, world_size: int) -> List[int]:
    """Where each rank's chunk of ``k`` segments begins, and the end: rank ``r`` owns
    segments ``bounds[r]:bounds[r + 1]`` (sizes differ by at most one)."""
    return [(k * rank) // world_size for rank in range(world_size + 1)]


def two_phase_wire_bytes(k: int, segment: int, world_size: int) -> int:
    """Bytes one rank hands to the two collectives: its ``k`` segments to the all-to-all, its
    chunk (padded to the largest) and the chunk's float32 scales to the all-gather."""
    largest = -(-k // world_size)
    return k * segment + largest * (segment + 4)


@dataclass
class TwoPhaseSum:
    """The ranks' summed segments, the same on every rank: ``wire`` (int8, ``k * segment``)
    times ``scale`` (float32, one a segment) over :data:`TWO_PHASE_LEVELS`; and what this
    rank's rounding of the chunk it owns (segments ``owned``) dropped, in values (``error``)."""

    wire: torch.Tensor
    scale: torch.Tensor
    owned: slice
    error: torch.Tensor


def two_phase_int8_sum(wire: torch.Tensor, scale: torch.Tensor, segment: int,
                       group: Optional[dist.ProcessGroup] = None) -> TwoPhaseSum:
    """Sum ``wire`` (int8, ``k`` segments of ``segment`` values, each segment's value
    ``wire * scale / TWO_PHASE_LEVELS``, ``scale`` the same on every rank) over ``group``:
    all-to-all, each owner's exact int32 sum rounded once to int8 on a scale of its own,
    all-gather. Waits for both collectives."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    k, device = scale.numel(), wire.device
    bounds = owned_bounds(k, world_size)
    sizes = [(bounds[r + 1] - bounds[r]) * segment for r in range(world_size)]
    owned = slice(bounds[rank], bounds[rank + 1])
    mine = owned.stop - owned.start
    received = torch.empty(world_size * mine * segment, dtype=torch.int8, device=device)
    dist.all_to_all_single(received, wire, output_split_sizes=[mine * segment] * world_size,
                           input_split_sizes=sizes, group=group)
    sums = received.view(world_size, mine, segment).sum(0, dtype=torch.int32)  # exact
    # Round each segment's sum to 127 steps of its largest magnitude.
    largest = sums.abs().amax(1, keepdim=True).clamp_(min=1).to(torch.float32)
    sums = sums.to(torch.float32)  # exact: |sums| <= 127 * world_size < 2 ** 24
    rounded = torch.round(sums * TWO_PHASE_LEVELS / largest)
    own_scale = (scale[owned] * (largest.view(-1) / TWO_PHASE_LEVELS)).clamp_(
        max=torch.finfo(torch.float32).max)  # a huge finite scale: no infinite step
    step_in = scale[owned].view(-1, 1) / TWO_PHASE_LEVELS
    step_out = own_scale.view(-1, 1) / TWO_PHASE_LEVELS
    error = (sums * step_in - rounded * step_out).view(-1)
    # One all-gather of every chunk and its scales, as bytes, each chunk padded to the largest.
    width = -(-k // world_size)
    payload = torch.zeros(width * segment + width * 4, dtype=torch.uint8, device=device)
    payload[:mine * segment] = rounded.to(torch.int8).view(-1).view(torch.uint8)
    payload[width * segment:width * segment + mine * 4] = own_scale.view(torch.uint8)
    gathered = torch.empty(world_size * payload.numel(), dtype=torch.uint8, device=device)
    all_gather_single(gathered, payload, group=group)
    gathered = gathered.view(world_size, -1)
    summed = torch.cat([gathered[r, :sizes[r]] for r in range(world_size)]).view(torch.int8)
    scales = torch.cat([gathered[r, width * segment:width * segment + 4 * (bounds[r + 1] - bounds[r])]
                        for r in range(world_size)]).view(torch.float32)
    return TwoPhaseSum(summed, scales, owned, error)


def add_to_residual(residual: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                    segment: int, block_size: int = 0,
                    coefficients: Optional[torch.Tensor] = None) -> None:
    """``residual +=`` the segments ``indices`` holding ``values`` (packed, ``segment`` each);
    with ``block_size`` the segments are of DCT coefficients laid out like ``coefficients``
    (whose contents this overwrites) and are transformed back first (a whole decode). Plain
    segments are added in place; a short last segment takes its first values."""
    if indices.numel() == 0:  # this rank owns no segment
        return
    if block_size:
        spread = torch.empty_like(residual)
        ops.unpack_segments(values, indices, segment, coefficients.numel(),
                            out=coefficients.view(-1))
        ops.dct_decode(coefficients, block_size, residual.numel(), out=spread)
        residual.add_(spread)
        return
    whole = residual.numel() // segment
    rows = values.view(-1, segment)
    if whole:  # every selected segment is distinct, so each row is added once
        in_whole = (indices < whole).unsqueeze(1)
        residual[:whole * segment].view(whole, segment).index_add_(
            0, indices.clamp(max=whole - 1), rows * in_whole)
    tail = residual.numel() - whole * segment
    if tail:  # without a host read of whether the short segment was selected
        residual[whole * segment:].add_((rows[:, :tail] * (indices == whole).unsqueeze(1)).sum(0))
