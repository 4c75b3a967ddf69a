"""Blockwise DCT + quantization with error feedback.

Most of a gradient block's energy sits in few DCT frequencies. The hook keeps ``keep`` of
each block's coefficients (by default half of them the lowest frequencies and half a band
that cycles through the rest, so error feedback can deliver everything it holds back),
quantizes them with a per-block scale every rank agrees on (a small MAX allreduce), and sums
the integers with one allreduce: integer sums are exact and the transform is linear, so the
decoded sum is the sum of what each rank encoded.
"""


import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from .._checks import check_choice, check_float, check_int
from .._layout import MAX_BLOCK_SIZE, QUANT_DTYPES, num_segments
from ._plan import PlanBucket
from ._state import ErrorFeedbackState, check_state

__all__ = ["DCTQuantState", "dct_quant_hook", "pack_int16_pairs", "unpack_int16_pair_sums"]

_LOW_BITS = 1 << 16


def quantization_levels(bits: int, world_size: int) -> int:
    """Largest level L such that the sum over ``world_size`` ranks of integers in [-L, L]
    fits a signed ``bits``-bit integer: ``(2**(bits-1) - 1) // world_size``."""
    return ((1 << (bits - 1)) - 1) // world_size


def pack_int16_pairs(q: torch.Tensor, levels: int, out: torch.Tensor) -> torch.Tensor:
    """Pack int16 values in [-levels, levels] two per int32, so that summing the int32 words
    over ranks sums each half exactly (gloo and NCCL cannot sum int16).

    Word ``j`` holds ``q[2j] * 2**16 + (q[2j+1] + levels)``: the low half is offset to be
    non-negative, so the low halves' sum (at most ``2 * world_size * levels <= 65534``) never
    borrows from the high half, and with ``levels <= 32767 // world_size`` the total stays
    inside int32. An odd length is padded with a zero value.

    Args:
        q: int16 [m], values in [-levels, levels].
        levels: the quantization levels.
        out: int32 [ceil(m / 2)].
    """
    m = q.numel()
    out.copy_(q[0::2])
    out.mul_(_LOW_BITS).add_(levels)
    out[: m // 2].add_(q[1::2])
    return out


def unpack_int16_pair_sums(words: torch.Tensor, levels: int, world_size: int, m: int,
                           out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int16_pairs` for a sum over ``world_size`` ranks.

    Args:
        words: int32 [ceil(m / 2)], the summed words; used as scratch (overwritten).
        out: int32 [m], receives the summed values.
    """
    low = out[1::2]
    torch.bitwise_and(words[: m // 2], _LOW_BITS - 1, out=low)
    low.sub_(world_size * levels)
    words.sub_(torch.bitwise_and(words, _LOW_BITS - 1)).bitwise_right_shift_(16)
    out[0::2].copy_(words)
    return out


class DCTQuantState(ErrorFeedbackState):
    """State of :func:`dct_quant_hook`.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        block_size: DCT block length, a power of two in [2, 65536].
        keep_ratio: fraction of each block's coefficients sent, in (0, 1];
            ``keep = max(1, round(keep_ratio * block_size))``: the ``ceil(keep / 2)`` lowest
            frequencies always, and ``keep // 2`` slots that walk through the remaining
            frequencies step by step, so everything held back is sent eventually.
        bits: width of the integers on the wire: 8, 16 or 32. The levels leave headroom for
            the sum over ranks: ``levels = (2**(bits-1) - 1) // world_size``. 16-bit values are
            sent two per int32 word (neither gloo nor NCCL sums int16), so they cost 2 bytes.
        rank_weight, warmup_steps, min_compress_numel: see
            :class:`~hetero_comm.hooks.ErrorFeedbackState`.
    """

    _checkpoint_settings = ("block_size", "keep_ratio", "bits")

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 block_size: int = 256, keep_ratio: float = 0.125, bits: int = 8,
                 rank_weight: Optional[float] = None, warmup_steps: int = 1,
                 min_compress_numel: int = 0) -> None:
        super().__init__(process_group=process_group, rank_weight=rank_weight,
                         warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)
        self.block_size = check_int("block_size", block_size, 2, MAX_BLOCK_SIZE)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [2, {MAX_BLOCK_SIZE}]; "
                             f"got {block_size}")
        self.keep_ratio = check_float("keep_ratio", keep_ratio, 0.0, 1.0, low_open=True)
        self.keep = max(1, round(keep_ratio * block_size))
        self.bits = check_choice("bits", bits, QUANT_DTYPES)
        self._bands_on_device: dict = {}  # (band start, device) -> its frequencies there
        self._log_settings()

    def settings(self) -> dict:
        return dict(block_size=self.block_size, keep_ratio=self.keep_ratio, bits=self.bits,
                    **super().settings())

    def levels(self) -> int:
        world_size = self.world_size()
        levels = quantization_levels(self.bits, world_size)
        if levels < 1:
            raise ValueError(f"bits={self.bits} leaves no quantization levels for "
                             f"{world_size} ranks; use more bits")
        return levels

    def wire_bytes(self, numel: int) -> int:
        """Bytes of the integers sent for a bucket of ``numel`` elements."""
        values = num_segments(numel, self.block_size) * self.keep
        return 4 * ((values + 1) // 2) if self.bits == 16 else values * self.bits // 8

    def _band_start(self, step: int) -> Optional[int]:
        """Where the moving part of the band starts at ``step`` (``None``: no moving part)."""
        low = (self.keep + 1) // 2
        if self.keep == self.block_size or self.keep - low == 0:
            return None
        return (step * (self.keep - low)) % (self.block_size - low)

    def frequencies(self, step: int, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """Indices of the coefficients sent at ``step``, ascending (``None``: the lowest
        ``keep``), made on ``device`` (no copy from the host). The same on every rank: a
        function of the step alone."""
        start = self._band_start(step)
        if start is None:
            return None
        # The lowest `low`, then `moving` of the rest from `start` on, wrapping around: ascending,
        # that is the wrapped part first. Built from ranges (no sort, nothing read back).
        low = (self.keep + 1) // 2
        moving, rest = self.keep - low, self.block_size - low
        wrapped = max(0, start + moving - rest)
        ranges = ((0, low + wrapped), (low + start, low + min(start + moving, rest)))
        return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])

    def frequencies_on(self, step: int, device: torch.device) -> Optional[torch.Tensor]:
        """:meth:`frequencies` on ``device``, kept: the band repeats after at most
        ``block_size`` steps, and no freed band can be reused while a callback's kernels still
        read it. Made on the device: a copy from pageable host memory would wait for the GPU."""
        start = self._band_start(step)
        if start is None:
            return None
        key = (start, str(device))
        if key not in self._bands_on_device:
            self._bands_on_device[key] = self.frequencies(step, device)
        return self._bands_on_device[key]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_bands_on_device"] = {}  # device tensors stay with this process
        return state


def dct_quant_hook(state: DCTQuantState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Send each bucket as quantized DCT coefficients, with error feedback.

    Per bucket (flattened gradient ``g`` of ``n`` elements), after ``warmup_steps`` dense steps
    (the steps are :func:`_dct_quant_allreduce`, top to bottom):

    1. ``residual += w * g`` (``w``: this rank's weight, ``1 / world_size`` by default).
    2. Blockwise DCT-II of the residual, keeping ``keep`` coefficients of each block of
       ``block_size``: the lowest half and a band that moves every step (:func:`hetero_comm.ops.dct_encode`).
    3. Agree on a per-block scale, the same on every rank: a MAX allreduce of each block's
       largest ``|coefficient|``.
    4. Quantize to integers in ``[-levels, levels]`` with
       ``levels = (2**(bits-1) - 1) // world_size`` (:func:`hetero_comm.ops.quantize`), so
       the sum over ranks cannot overflow.
    5. Allreduce (sum) the integers. Meanwhile, error feedback:
       ``residual -= decode(this rank's integers)``.
    6. Dequantize the sum and invert the DCT into the bucket
       (:func:`hetero_comm.ops.dequantize`, :func:`hetero_comm.ops.dct_decode`).

    Args:
        state: a :class:`DCTQuantState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the decoded weighted sum.

    A NaN or infinity in the bucket on any rank: the bucket is handed on holding NaN on
    every rank (CPU: all of it; CUDA: its first element, set on the device), as DDP's
    allreduce would hand on the sum, so a ``torch.amp.GradScaler`` skips the step; its error
    feedback restarts from zero, ``stats()["non_finite_buckets"]`` counts it and the first
    one warns (``RuntimeWarning``).

    Example::

        >>> state = DCTQuantState(block_size=256, keep_ratio=0.125, bits=8)
        >>> ddp_model.register_comm_hook(state, dct_quant_hook)
    """
    check_state(state, DCTQuantState, "dct_quant_hook")
    return state.run(bucket, _dct_quant_allreduce)


def _dct_quant_allreduce(state: DCTQuantState, plan_bucket: PlanBucket, grad: torch.Tensor,
                         index: int) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-6 of :func:`dct_quant_hook` for ``grad``, laid out like ``plan_bucket``."""
    n, device, pool, step = grad.numel(), grad.device, state.pool, state.step
    blocks, keep, levels, world_size = num_segments(n, state.block_size), state.keep, state.levels(), state.world_size()
    residual = plan_bucket.tensors["residual"]
    band = state.frequencies_on(step - state.warmup_steps, device)
    buffers = _Buffers(pool, device, blocks, keep, n, state.bits,
                       None if band is None else state.block_size)
    coeffs, scale = buffers.coeffs, buffers.scale
    with state.statistics.timer("encode_seconds"):
        # 1. Accumulate.
        residual.add_(grad, alpha=state.weight())
        # 2. Transform.
        _encode(state, residual, band, coeffs, buffers.full)
        # 3. Agree on a scale (below): each block's largest |coefficient|.
        torch.linalg.vector_norm(coeffs, math.inf, dim=1, out=scale)
        scale.nan_to_num_(nan=math.inf)  # MAX keeps an infinity, so every rank sees it
    state.statistics.count_bytes(n * grad.element_size(), blocks * 4 + state.wire_bytes(n), True)
    # Waited for here: all ranks issue every collective from this thread, in the same order.
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=state.process_group)
    with state.statistics.timer("encode_seconds"):
        # CUDA: a device flag (no host sync); a non-finite step sends zeros, hands on NaN.
        finite = state.non_finite.check(scale, index, step, plan_bucket, tuple(buffers.all))
        state.non_finite.drop_unless(finite, coeffs)
        # 4. Quantize.
        _quantize_onto_wire(state, buffers, levels)
    # 5. Allreduce the integers; meanwhile error feedback keeps what this rank's own
    #    integers do not represent: residual -= decode(q_local).
    summed = dist.all_reduce(buffers.wire, group=state.process_group, async_op=True).get_future()
    with state.statistics.timer("encode_seconds"):
        ops.dequantize(buffers.q, scale, levels, out=coeffs)
        _decode(state, coeffs, band, buffers.decoded, buffers.full)
        residual.sub_(buffers.decoded)
    error_feedback_done = state.callbacks.mark(device)  # CUDA: decode() reuses these buffers

    # 6. Dequantize the sum and invert the transform into the bucket.
    def decode(fut) -> torch.Tensor:
        fut.value()
        with state.statistics.timer("decode_seconds"):
            state.callbacks.wait(error_feedback_done, device)
            if state.bits == 16:  # the wire's pairs back to one sum per coefficient
                unpack_int16_pair_sums(buffers.wire, levels, world_size, blocks * keep, buffers.summed.view(-1))
            ops.dequantize(buffers.summed, scale, levels, out=coeffs)
            _decode(state, coeffs, band, buffers.decoded, buffers.full)
            grad.copy_(buffers.decoded)
            state.non_finite.nan_unless(finite, grad)  # CUDA: a non-finite bucket handed on as NaN
            state.callbacks.release(buffers.all, device)
        return grad

    return summed.then(decode)


def _quantize_onto_wire(state: DCTQuantState, buffers: "_Buffers", levels: int) -> None:
    """Step 4: the kept coefficients as integers of the agreed scale, onto the wire (16 bits:
    two per int32, see :func:`pack_int16_pairs`)."""
    ops.quantize(buffers.coeffs, buffers.scale, levels, QUANT_DTYPES[state.bits], out=buffers.q)
    if state.bits == 16:
        pack_int16_pairs(buffers.q.view(-1), levels, buffers.wire)
    else:
        buffers.wire.copy_(buffers.q.view(-1))


class _Buffers:
    """The pooled work buffers of one :func:`_dct_quant_allreduce` call."""

    def __init__(self, pool, device, blocks: int, keep: int, n: int, bits: int,
                 block_size: Optional[int]) -> None:
        self.pool = pool
        self.coeffs = pool.acquire(blocks * keep, torch.float32, device).view(blocks, keep)
        self.scale = pool.acquire(blocks, torch.float32, device)
        self.q = pool.acquire(blocks * keep, QUANT_DTYPES[bits], device).view(blocks, keep)
        self.decoded = pool.acquire(n, torch.float32, device)
        self.all = [self.coeffs, self.scale, self.q, self.decoded]
        # Every coefficient of each block, when a band is picked out of them (acquired here,
        # on the hook's thread: the callback must not take buffers from the pool).
        self.full = None
        if block_size is not None:
            self.full = pool.acquire(blocks * block_size, torch.float32, device).view(blocks, block_size)
            self.all.append(self.full)
        if bits == 16:  # two int16 per int32 word on the wire, the sums unpacked to int32
            self.wire = pool.acquire((blocks * keep + 1) // 2, torch.int32, device)
            self.summed = pool.acquire(blocks * keep, torch.int32, device).view(blocks, keep)
            self.all += [self.wire, self.summed]
        else:
            self.wire = pool.acquire(blocks * keep, QUANT_DTYPES[bits], device)
            self.summed = self.wire.view(blocks, keep)
            self.all.append(self.wire)


def _encode(state: DCTQuantState, residual: torch.Tensor, band: Optional[torch.Tensor],
            out: torch.Tensor, full: Optional[torch.Tensor]) -> None:
    """The coefficients ``band`` (``None``: the lowest ``keep``) of each block of ``residual``
    (``full``: scratch for every coefficient, given with a band)."""
    if band is None:
        ops.dct_encode(residual, state.block_size, state.keep, out=out)
        return
    ops.dct_encode(residual, state.block_size, state.block_size, out=full)
    torch.index_select(full, 1, band, out=out)


def _decode(state: DCTQuantState, coeffs: torch.Tensor, band: Optional[torch.Tensor],
            out: torch.Tensor, full: Optional[torch.Tensor]) -> None:
    """Inverse of :func:`_encode`: the blocks whose coefficients ``band`` are ``coeffs``,
    every other coefficient zero."""
    if band is None:
        ops.dct_decode(coeffs, state.block_size, out.numel(), out=out)
        return
    full.zero_().index_copy_(1, band, coeffs)
    ops.dct_decode(full, state.block_size, out.numel(), out=out)
