"""Importance-segment sparse synchronisation with a globally agreed selection.

Seed: 001 (claims 1-7). Each bucket is cut into segments of ``segment_size`` elements; every
rank accumulates what it has not sent yet (error feedback) and measures each segment's
importance (its L2 norm). The ranks agree on one set of segments, so the packed values can
be summed by ONE plain allreduce: no allgather, no index exchange.
"""


import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from ..reference import num_segments
from .._checks import check_float, check_int
from ._common import HookState, PlanBucket, raise_non_finite

__all__ = ["SegmentSparseState", "segment_sparse_hook"]

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SELECTIONS = ("current", "lagged")


class SegmentSparseState(HookState):
    """State of :func:`segment_sparse_hook`.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        density: fraction of segments sent per step, in (0, 1]; ``k = ceil(density * S)``.
        segment_size: elements per segment, in [1, 2**20].
        selection: ``"current"`` (default): agree on this step's importance first (a small
            allreduce of S float32 values), then send the top ``k`` segments; or
            ``"lagged"``: send the segments chosen from the previous step's importance and
            carry this step's importance in the same single allreduce (the seed's scheme;
            one collective per bucket, a selection one step old).
        momentum: momentum correction in [0, 1) (Deep Gradient Compression): the hook keeps a
            velocity ``u = momentum * u + g`` and accumulates ``u``, clearing both for the
            segments it sends. Use it INSTEAD of the optimizer's momentum (set that to 0).
            0 (default) accumulates the gradient itself.
        density_warmup_steps: after the dense warm-up, the density falls geometrically from 1
            to ``density`` over this many steps (0: start at ``density``), >= 0.
        wire_dtype: dtype of the packed values on the wire: ``"float32"`` (default),
            ``"float16"`` or ``"bfloat16"`` (half the bytes; each rank's rounding error stays
            in its residual, the rounding of the sum on the wire is not fed back).
        rank_weight, warmup_steps, min_compress_numel: see :class:`HookState`.
    """

    _checkpoint_settings = ("density", "segment_size", "selection", "momentum",
                            "density_warmup_steps")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 density: float = 0.01, segment_size: int = 256, selection: str = "current",
                 momentum: float = 0.0, density_warmup_steps: int = 0,
                 wire_dtype: str = "float32", rank_weight: Optional[float] = None,
                 warmup_steps: int = 1, min_compress_numel: int = 0) -> None:
        super().__init__(process_group, rank_weight, warmup_steps, min_compress_numel)
        self.density = check_float("density", density, 0.0, 1.0, low_open=True)
        self.segment_size = check_int("segment_size", segment_size, 1, 1 << 20)
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}; got {selection!r}")
        self.selection = selection
        self.momentum = check_float("momentum", momentum, 0.0, 0.999)
        self.density_warmup_steps = check_int("density_warmup_steps", density_warmup_steps, 0)
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {tuple(WIRE_DTYPES)}; got {wire_dtype!r}")
        self.wire_dtype = wire_dtype
        self._plan_tensors = ("residual", "momentum") if self.momentum else ("residual",)
        self._log_settings()

    def settings(self) -> dict:
        return dict(density=self.density, segment_size=self.segment_size,
                    selection=self.selection, momentum=self.momentum,
                    density_warmup_steps=self.density_warmup_steps, wire_dtype=self.wire_dtype,
                    **super().settings())

    def density_at(self, step: int) -> float:
        """The density used at ``step`` (1 during the dense warm-up)."""
        ramp = step - self.warmup_steps
        if ramp < 0:
            return 1.0
        if ramp >= self.density_warmup_steps:
            return self.density
        return self.density ** ((ramp + 1) / (self.density_warmup_steps + 1))

    def segments_to_send(self, num_segments_: int, step: int) -> int:
        """``k = ceil(density * S)`` at ``step`` (at least 1 for a non-empty bucket)."""
        return min(num_segments_, max(1, math.ceil(self.density_at(step) * num_segments_ - 1e-9)))

    # --------------------------------------------------------------------- compression
    def _compress(self, plan_bucket: PlanBucket, grad: torch.Tensor, index: int) -> torch.futures.Future:
        step, segment = self.step, self.segment_size
        count = num_segments(grad.numel(), segment)
        k = self.segments_to_send(count, step)
        with self._timer("encode_seconds"):
            source = self._accumulate_source(plan_bucket, grad)
            importance = self.pool.acquire(count, torch.float32, grad.device)
            ops.segment_accumulate_(plan_bucket.tensors["residual"], source, segment, out=importance)
        indicator = plan_bucket.extra.get("indicator")
        if self.selection == "lagged" and indicator is not None and indicator.numel() == k:
            return self._send_lagged(plan_bucket, grad, index, importance, indicator, step)
        return self._send_current(plan_bucket, grad, index, importance, k, step)

    def _accumulate_source(self, plan_bucket: PlanBucket, grad: torch.Tensor) -> torch.Tensor:
        """What goes into the residual this step: the weighted gradient, or with momentum
        correction the velocity ``u = momentum * u + w * g``."""
        grad.mul_(self.weight())
        if not self.momentum:
            return grad
        velocity = plan_bucket.tensors["momentum"]
        return velocity.mul_(self.momentum).add_(grad)

    def _pack(self, plan_bucket: PlanBucket, indices: torch.Tensor, out: torch.Tensor) -> None:
        """Move the selected segments of the residual into ``out``; with momentum correction
        also clear the velocity there (the segments have been sent). A 16-bit ``out`` rounds
        the values: the rounding error stays in the residual (error feedback)."""
        residual = plan_bucket.tensors["residual"]
        if out.dtype == torch.float32:
            ops.pack_segments_(residual, indices, self.segment_size, out=out)
        else:
            exact = self.pool.acquire(out.numel(), torch.float32, out.device)
            ops.pack_segments_(residual, indices, self.segment_size, out=exact)
            out.copy_(exact)
            _write_segments(residual, indices, exact.sub_(out), self.segment_size)
            self.pool.release(exact)
        if self.momentum:
            scratch = self.pool.acquire(out.numel(), torch.float32, out.device)
            ops.pack_segments_(plan_bucket.tensors["momentum"], indices, self.segment_size, out=scratch)
            self.pool.release(scratch)

    def _send_current(self, plan_bucket, grad, index, importance, k, step) -> torch.futures.Future:
        """Agree on this step's importance, then send its top-k segments."""
        wire_dtype = WIRE_DTYPES[self.wire_dtype]
        values_bytes = k * self.segment_size * torch.finfo(wire_dtype).bits // 8
        self._count_bytes(grad.numel() * grad.element_size(), importance.numel() * 4 + values_bytes, True)
        # Wait here rather than in a callback: every collective is issued from this thread,
        # so all ranks issue them in the same order (gloo and NCCL match them by order).
        dist.all_reduce(importance, group=self.process_group)
        indices = self.pool.acquire(k, torch.int64, grad.device)
        wire = self.pool.acquire(k * self.segment_size, wire_dtype, grad.device)
        with self._timer("encode_seconds"):
            if not bool(torch.isfinite(importance).all()):
                self._release(importance, indices, wire)
                raise_non_finite(self, index, plan_bucket)
            ops.select_segments(importance, k, out=indices)
            self._pack(plan_bucket, indices, wire)
        summed = dist.all_reduce(wire, group=self.process_group, async_op=True).get_future()

        def decode(fut):
            fut.value()
            with self._timer("decode_seconds"):
                ops.unpack_segments(wire, indices, self.segment_size, grad.numel(), out=grad)
                if self.selection == "lagged":  # this step also chooses the next one
                    importance[indices] = 0.0
                    self._select_next(plan_bucket, importance, step)
                self._release(importance, indices, wire)
            return grad

        return summed.then(decode)

    def _send_lagged(self, plan_bucket, grad, index, importance, indicator, step) -> torch.futures.Future:
        """Send the segments agreed at the previous step and, in the same allreduce, this
        step's importance of what stays held back (from which the next selection is made)."""
        wire_dtype = WIRE_DTYPES[self.wire_dtype]
        k, count = indicator.numel(), importance.numel()
        packed_numel = k * self.segment_size
        wire = self.pool.acquire(packed_numel + count, wire_dtype, grad.device)
        self._count_bytes(grad.numel() * grad.element_size(),
                          wire.numel() * wire.element_size(), True)
        with self._timer("encode_seconds"):
            # Zeroing the sent segments' importance and saturating it to a 16-bit wire could
            # hide a NaN or infinity: poison the whole vector so every rank sees it after the
            # sum. (The current mode needs no such step: norms are >= 0, so the sum keeps them.)
            finite = bool(torch.isfinite(importance).all())
            self._pack(plan_bucket, indicator, wire[:packed_numel])
            # Sent segments are no longer held back: their importance is what remains, zero.
            importance[indicator] = 0.0
            if not finite:
                importance.fill_(math.nan)
            elif wire_dtype != torch.float32:
                importance.clamp_(max=torch.finfo(wire_dtype).max)
            wire[packed_numel:].copy_(importance)
        summed = dist.all_reduce(wire, group=self.process_group, async_op=True).get_future()

        def decode(fut):
            fut.value()
            with self._timer("decode_seconds"):
                importance.copy_(wire[packed_numel:])
                if not bool(torch.isfinite(importance).all()):
                    self._release(importance, wire)
                    raise_non_finite(self, index, plan_bucket)
                ops.unpack_segments(wire[:packed_numel], indicator, self.segment_size,
                                    grad.numel(), out=grad)
                self._select_next(plan_bucket, importance, step)
                self._release(importance, wire)
            return grad

        return summed.then(decode)

    def _select_next(self, plan_bucket: PlanBucket, importance: torch.Tensor, step: int) -> None:
        """Lagged mode: the segments to send at the next step, from the agreed importance of
        what stays held back."""
        k_next = self.segments_to_send(importance.numel(), step + 1)
        indicator = plan_bucket.extra.get("indicator")
        if indicator is None or indicator.numel() != k_next:
            indicator = plan_bucket.extra["indicator"] = torch.empty(
                k_next, dtype=torch.int64, device=importance.device)
        ops.select_segments(importance, k_next, out=indicator)

    def _release(self, *buffers: torch.Tensor) -> None:
        for buffer in buffers:
            self.pool.release(buffer)

    def _new_plan_bucket(self, keys, numels, device) -> PlanBucket:
        plan_bucket = super()._new_plan_bucket(keys, numels, device)
        if self.selection == "lagged":
            # The first step of a new plan bucket selects on the current importance and
            # leaves the indicator for the next step.
            plan_bucket.extra["indicator"] = None
        return plan_bucket


def _write_segments(flat: torch.Tensor, indices: torch.Tensor, packed: torch.Tensor,
                    segment_size: int) -> None:
    """``flat[segment indices[j]] = packed[j-th segment]`` (a short last segment's padding is
    dropped); every other element is left alone."""
    n = flat.numel()
    full = n // segment_size
    rows = packed.view(-1, segment_size)
    whole = indices < full
    flat[: full * segment_size].view(full, segment_size).index_copy_(0, indices[whole], rows[whole])
    if not bool(whole.all()):  # the short last segment was selected (it is the largest index)
        flat[full * segment_size:].copy_(rows[-1, : n - full * segment_size])


def segment_sparse_hook(state: SegmentSparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Send the most important segments of each bucket, with error feedback.

    Per bucket (flattened gradient ``g`` of ``n`` elements, ``S = ceil(n / segment_size)``
    segments, ``k = ceil(density * S)``), after ``warmup_steps`` dense steps:

    1. ``residual += w * g`` (or the momentum-corrected velocity) and the L2 norm of every
       segment of the residual, in one pass (:func:`hetero_comm.ops.segment_accumulate_`).
    2. ``selection="current"``: allreduce the importance vector (S float32), and take its top
       ``k`` segments (:func:`hetero_comm.ops.select_segments`); the same on every rank.
       ``selection="lagged"``: take the segments agreed at the previous step.
    3. Pack those segments and zero them in the residual
       (:func:`hetero_comm.ops.pack_segments_`).
    4. ONE allreduce (sum) of the packed values; every rank sent the same segments, so the sum
       is ``sum_i w_i * residual_i`` there. In lagged mode the importance of what stays held
       back travels in the same allreduce, and its top ``k`` is the next selection.
    5. Scatter the sum into the bucket, zeros elsewhere
       (:func:`hetero_comm.ops.unpack_segments`).

    Args:
        state: a :class:`SegmentSparseState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the sparse weighted sum.

    Raises:
        FloatingPointError: a NaN or infinity reached the bucket on any rank (raised by the
            hook in the current mode, by its future in the lagged mode).

    Example::

        >>> state = SegmentSparseState(density=0.01, segment_size=256)
        >>> ddp_model.register_comm_hook(state, segment_sparse_hook)
    """
    return state.run(bucket)
