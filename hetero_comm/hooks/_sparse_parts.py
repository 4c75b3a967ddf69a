"""The parts :func:`~hetero_comm.hooks.segment_sparse_hook`'s steps call, one per variation.

Each part has one job, and the hook's steps call it the same way whichever variant it is:

* what the segments cut (``basis``): :class:`ElementSegments` (consecutive gradient elements)
  or :class:`DctSegments` (one frequency of a group of DCT blocks);
* how the ranks agree on the segments: :class:`AgreedNow` (this step's importance, summed
  over the ranks first);
* the number format on the wire (``wire_dtype``): :class:`FloatWire` or :class:`IntegerWire`;
* what goes into the residual (``momentum``): :func:`add_contribution` and
  :func:`restart_sent_velocity`.

A new variant is a new class with the same methods, not a branch in every step.
"""

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import ops
from .._layout import dct_coeffs_shape, num_segments
from ._plan import PlanBucket

__all__ = ["ElementSegments", "DctSegments", "AgreedNow", "FloatWire", "IntegerWire",
           "int8_levels", "add_contribution", "restart_sent_velocity", "SEGMENTS", "WIRES",
           "INT8_CLIP_RMS", "WIRE_DTYPES"]

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "int8": torch.int8}
# basis="elements": a bucket cut into fewer segments than this gets a warning (coarse segments
# mix coordinates that need sending often with ones that can wait).
MIN_SEGMENTS_PER_BUCKET = 150
# int8 wire: a rank's values are clipped at this many times the ranks' mean RMS of the segment
# (what is clipped stays in the residual).
INT8_CLIP_RMS = 4.0


# ------------------------------------------------------------------ what the segments cut
class ElementSegments:
    """Segments of ``segment`` consecutive elements of the residual itself."""

    def __init__(self, state, residual: torch.Tensor, grad: torch.Tensor) -> None:
        self.residual = self.vector = residual
        self.numel = residual.numel()
        self.segment = state.segment_size_for(self.numel)
        self.count = num_segments(self.numel, self.segment)
        self.buffers: Tuple[torch.Tensor, ...] = ()

    def warn_if_coarse(self, state, index: int, k: int) -> None:
        """Warn (once per state) when a selection among too few segments of elements mixes
        coordinates that need sending often with ones that can wait."""
        if k < self.count < MIN_SEGMENTS_PER_BUCKET:
            state.warn_coarse_segments(index, self.numel, self.segment, self.count)

    def accumulate(self, contribution: torch.Tensor, importance: torch.Tensor) -> None:
        """``residual += contribution``; every segment's L2 norm into ``importance``."""
        ops.segment_accumulate_(self.residual, contribution, self.segment, out=importance)

    def keep_unsent(self) -> None:
        """After packing zeroed the sent segments of :attr:`vector`: nothing to do, the
        residual is that vector."""

    def scratch_for_residual(self) -> tuple:
        """:func:`._two_phase.add_to_residual`'s basis arguments: none (plain elements)."""
        return ()

    def clear(self, state, flat: torch.Tensor, indices: torch.Tensor) -> None:
        """Zero the selected segments of ``flat`` (laid out like the residual)."""
        scratch = state.pool.acquire(indices.numel() * self.segment, torch.float32, flat.device)
        ops.pack_segments_(flat, indices, self.segment, out=scratch)  # zeroes what it packs
        state.pool.release(scratch)

    def deliver(self, packed: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor) -> None:
        """The summed segments into ``grad``, zeros elsewhere."""
        ops.unpack_segments(packed, indices, self.segment, grad.numel(), out=grad)


class DctSegments:
    """Segments of the residual's DCT coefficients (``basis="dct"``, pooled work buffer).

    The residual is cut into blocks of ``state.dct_block_size`` elements, each goes through an
    orthonormal DCT-II, and a segment is ONE frequency of ``state.segment_size`` consecutive
    blocks (:func:`hetero_comm.ops.dct_encode`'s grouped layout, in which such a segment is
    contiguous; the last group's padding blocks are zero). A plain segment of elements
    delivers those elements and nothing to the rest, which may wait many steps for their
    turn; sending a segment of coefficients touches every element of its blocks, so a sparse
    selection still moves almost every coordinate at every step. The transform is
    orthonormal, so norms (the importance) and error feedback carry over unchanged."""

    def __init__(self, state, residual: torch.Tensor, grad: torch.Tensor) -> None:
        self.residual = residual
        self.segment = state.segment_size_for(residual.numel())
        self.block_size = state.dct_block_size
        self.shape = dct_coeffs_shape(residual.numel(), self.block_size, self.block_size, self.segment)
        self.numel = math.prod(self.shape)
        self.count = num_segments(self.numel, self.segment)
        pool, device = state.pool, grad.device
        self.vector = pool.acquire(self.numel, torch.float32, device)
        self.buffers: Tuple[torch.Tensor, ...] = (self.vector,)
        self.decoded = grad  # the decoded sum; float32, or a buffer before the cast into grad
        if grad.dtype != torch.float32:
            self.decoded = pool.acquire(grad.numel(), torch.float32, device)
            self.buffers += (self.decoded,)

    def _encode(self, flat: torch.Tensor) -> None:
        """``flat``'s coefficients into :attr:`vector`."""
        ops.dct_encode(flat, self.block_size, self.block_size, self.segment, out=self.vector.view(self.shape))

    def _decode(self, out: torch.Tensor) -> None:
        """:attr:`vector`'s coefficients transformed back into ``out`` (float32, like the residual)."""
        ops.dct_decode(self.vector.view(self.shape), self.block_size, out.numel(), out=out)

    def warn_if_coarse(self, state, index: int, k: int) -> None:
        """Nothing: every segment of coefficients touches all of its blocks' elements."""

    def accumulate(self, contribution: torch.Tensor, importance: torch.Tensor) -> None:
        """``residual += contribution``; its coefficients into :attr:`vector` and every
        segment's L2 norm into ``importance`` (the transform is orthonormal)."""
        self.residual.add_(contribution)
        self._encode(self.residual)
        torch.linalg.vector_norm(self.vector.view(-1, self.segment), dim=1, out=importance)

    def keep_unsent(self) -> None:
        """After packing zeroed the sent coefficients: the residual is the rest, transformed
        back."""
        self._decode(self.residual)

    def scratch_for_residual(self) -> tuple:
        """:func:`._two_phase.add_to_residual`'s basis arguments: the block size and
        :attr:`vector` (free after :meth:`keep_unsent`, until :meth:`deliver`)."""
        return self.block_size, self.vector.view(self.shape)

    def clear(self, state, flat: torch.Tensor, indices: torch.Tensor) -> None:
        """Zero the selected segments of ``flat``'s coefficients (``flat`` laid out like the
        residual). Uses :attr:`vector`: call it only after :meth:`keep_unsent` and before
        :meth:`deliver`, when it holds nothing needed."""
        self._encode(flat)
        self.vector.view(-1, self.segment).index_fill_(0, indices, 0.0)
        self._decode(flat)

    def deliver(self, packed: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor) -> None:
        """The summed coefficients, transformed back, into ``grad``."""
        ops.unpack_segments(packed, indices, self.segment, self.numel, out=self.vector)
        self._decode(self.decoded)
        if self.decoded is not grad:
            grad.copy_(self.decoded)


# ------------------------------------------------------------- how the ranks agree on them
class AgreedNow:
    """This step's selection: the top ``k`` of its importance, summed over the ranks first
    (a small allreduce of one float32 per segment, waited for)."""

    importance_bytes_per_segment = 4  # the allreduce of the importance

    def __init__(self, state, plan_bucket: PlanBucket, importance: torch.Tensor, k: int,
                 index: int, segments) -> None:
        # Wait here rather than in a callback: every collective is issued from this thread,
        # so all ranks issue them in the same order (gloo and NCCL match them by order).
        dist.all_reduce(importance, group=state.exchange_group())
        with state.statistics.timer("encode_seconds"):
            # Norms are >= 0: the sum keeps a NaN. CUDA: flagged on the device, selection goes on.
            self.finite = state.non_finite.check(importance, index, state.step, plan_bucket,
                                             (importance,) + segments.buffers)
            self.indices = state.pool.acquire(k, torch.int64, importance.device)
            ops.select_segments(importance, k, out=self.indices)
        self.buffers: Tuple[torch.Tensor, ...] = (self.indices,)

    def agreed_importance_of_selected(self, importance: torch.Tensor, out: torch.Tensor) -> None:
        """The ranks' summed importance of each selected segment into ``out``."""
        torch.index_select(importance, 0, self.indices, out=out)

    @staticmethod
    def finish(work, unpack) -> torch.futures.Future:
        """Unpack once the sum arrives (overlapping the rest of the backward pass)."""
        def after_sum(fut) -> torch.Tensor:
            fut.wait()
            return unpack()
        return work.get_future().then(after_sum)


# --------------------------------------------------------------------- the wire's format
class FloatWire:
    """The selected segments' values as they are, cast to the wire's float dtype (each rank's
    rounding error stays in its residual)."""

    def __init__(self, state, importance: torch.Tensor, selected, segments) -> None:
        self.indices, self.segment = selected.indices, segments.segment
        self.buffers: Tuple[torch.Tensor, ...] = ()

    def pack_(self, segments, wire: torch.Tensor) -> None:
        """The selected segments onto ``wire``; zeros (or what the dtype cannot carry) left in
        their place."""
        ops.pack_segments_(segments.vector, self.indices, self.segment, out=wire)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        return wire


def int8_levels(world_size: int) -> int:
    """Steps each way one rank may send on the int8 wire, so that the sum of ``world_size``
    ranks' integers fits in int8 (``127 // world_size``, at least 2)."""
    levels = 127 // world_size
    if levels < 2:
        raise ValueError(f"wire_dtype='int8' sums the integers of {world_size} ranks in int8, which "
                         f"leaves {levels} step(s) each way per rank (at least 2 are needed, so at "
                         "most 63 ranks): use int8_sum='two_phase' (or 'auto'), which sums "
                         "in two phases at any number of ranks")
    return levels


class IntegerWire:
    """The selected segments as integers in steps every rank shares.

    A segment's scale (the value sent as ``levels`` steps) is :data:`INT8_CLIP_RMS` times the
    ranks' mean RMS there; that RMS, ``importance / (world_size * sqrt(elements))``, comes from
    the agreed importance (the sum of the ranks' norms), so every rank rounds to the same grid
    and the allreduce's integer sum is exact (``world_size * levels <= 127``). Many ranks leave
    few levels (32 ranks: 3 each way); error feedback carries the rest. Summed in two phases
    (``int8_sum="two_phase"``), every rank gets 127 levels at any number of ranks."""

    def __init__(self, state, importance: torch.Tensor, selected, segments) -> None:
        self.levels = state.int8_levels()
        self.indices = indices = selected.indices
        self.k = indices.numel()
        self.segment = segment = segments.segment
        count, device = importance.numel(), importance.device
        self.values = state.pool.acquire(self.k * segment, torch.float32, device)
        self.scale = state.pool.acquire(self.k, torch.float32, device)
        selected.agreed_importance_of_selected(importance, self.scale)
        self.scale.mul_(INT8_CLIP_RMS / (state.exchange_size() * math.sqrt(segment)))
        tail = segments.numel - (count - 1) * segment  # a short last segment: its RMS is over tail
        if tail < segment:
            self.scale.mul_(torch.where(indices == count - 1, math.sqrt(segment / tail), 1.0))
        self.scale.clamp_(max=torch.finfo(torch.float32).max)  # a huge finite norm: no infinite step
        self.buffers = (self.values, self.scale)

    def pack_(self, segments, wire: torch.Tensor) -> None:
        """Round the selected segments onto ``wire``; what the integers do not carry
        (rounding, clipping) stays in those segments. A NaN is sent as 0 and stays in the
        residual (CUDA: the caller then zeroes the wire by the agreed importance's flag)."""
        ops.pack_quantized_segments_(segments.vector, self.indices, self.segment, self.scale,
                                     self.levels, torch.int8, out=wire)

    def decode(self, wire: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The summed integers back to float32 values (packed, like the other wires), in
        steps of ``scale`` (default: the scale they were rounded to; the two-phase sum
        brings its own)."""
        segment = self.segment
        ops.dequantize(wire.view(self.k, segment), self.scale if scale is None else scale,
                       self.levels, out=self.values.view(self.k, segment))
        return self.values


# ------------------------------------------------------------ what goes into the residual
def add_contribution(state, plan_bucket: PlanBucket, grad: torch.Tensor) -> torch.Tensor:
    """What goes into the residual this step: the weighted gradient, or with momentum
    correction the velocity ``u = momentum * u + w * g`` (Nesterov's: ``w * g + momentum * u``,
    written over ``grad``)."""
    weight = state.contribution_weight()
    if weight != 1.0:
        grad.mul_(weight)
    if not state.momentum:
        return grad
    velocity = plan_bucket.tensors["momentum"].mul_(state.momentum).add_(grad)
    if state.nesterov:
        return grad.add_(velocity, alpha=state.momentum)
    return velocity


def restart_sent_velocity(state, plan_bucket: PlanBucket, indices: torch.Tensor,
                          segments) -> None:
    """Momentum correction: the sent segments' velocity restarts from zero (in the basis the
    segments cut)."""
    if state.momentum:
        segments.clear(state, plan_bucket.tensors["momentum"], indices)


SEGMENTS = {"elements": ElementSegments, "dct": DctSegments}
WIRES = {"float32": FloatWire, "float16": FloatWire, "bfloat16": FloatWire, "int8": IntegerWire}
