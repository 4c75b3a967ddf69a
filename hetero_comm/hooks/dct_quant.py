"""Blockwise DCT + quantization with error feedback.

Seed: 003 (the DCT patent). Gradients are smooth enough along a bucket that most of a block's
energy sits in its lowest DCT frequencies; the hook keeps those, quantizes them with a scale
every rank agrees on, and sums the integers with ONE allreduce (integer sums are exact and
the transform is linear, so the decoded sum is the sum of what each rank encoded).
"""


import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from ..reference import num_segments
from .._checks import check_float, check_int
from ._common import HookState, PlanBucket, raise_non_finite

__all__ = ["DCTQuantState", "dct_quant_hook", "pack_int16_pairs", "unpack_int16_pair_sums"]

BANDS = ("cycling", "low")
QUANT_DTYPES = {8: torch.int8, 16: torch.int16, 32: torch.int32}
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


class DCTQuantState(HookState):
    """State of :func:`dct_quant_hook`.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        block_size: DCT block length, a power of two in [2, 65536].
        keep_ratio: fraction of each block's coefficients kept (the lowest frequencies), in
            (0, 1]; ``keep = max(1, round(keep_ratio * block_size))``.
        bits: width of the integers on the wire: 8, 16 or 32. The levels leave headroom for
            the sum over ranks: ``levels = (2**(bits-1) - 1) // world_size``. 16-bit values are
            sent two per int32 word (neither gloo nor NCCL sums int16), so they cost 2 bytes.
        band: which coefficients of each block are sent. ``"low"``: always the ``keep``
            lowest frequencies (the seed's high-frequency filter; the higher frequencies are
            never sent, so error feedback cannot deliver them). ``"cycling"`` (default): the
            ``ceil(keep / 2)`` lowest always, the other ``keep // 2`` slots walk through the
            remaining frequencies step by step, so everything held back is sent eventually.
        rank_weight, warmup_steps, min_compress_numel: see :class:`HookState`.
    """

    _checkpoint_settings = ("block_size", "keep_ratio", "bits", "band")
    _plan_tensors = ("residual",)

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 block_size: int = 256, keep_ratio: float = 0.125, bits: int = 8,
                 band: str = "cycling",
                 rank_weight: Optional[float] = None, warmup_steps: int = 1,
                 min_compress_numel: int = 0) -> None:
        super().__init__(process_group, rank_weight, warmup_steps, min_compress_numel)
        self.block_size = check_int("block_size", block_size, 2, 65536)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [2, 65536]; got {block_size}")
        self.keep_ratio = check_float("keep_ratio", keep_ratio, 0.0, 1.0, low_open=True)
        self.keep = max(1, round(keep_ratio * block_size))
        if bits not in QUANT_DTYPES:
            raise ValueError(f"bits must be 8, 16 or 32; got {bits!r}")
        self.bits = bits
        if band not in BANDS:
            raise ValueError(f"band must be one of {BANDS}; got {band!r}")
        self.band = band
        self._log_settings()

    def settings(self) -> dict:
        return dict(block_size=self.block_size, keep_ratio=self.keep_ratio, bits=self.bits,
                    band=self.band,
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

    def frequencies(self, step: int) -> Optional[torch.Tensor]:
        """Indices of the coefficients sent at ``step``, ascending (``None``: the lowest
        ``keep``). The same on every rank: a function of the step alone."""
        low = (self.keep + 1) // 2
        rest = self.block_size - low
        if self.band == "low" or self.keep == self.block_size or self.keep - low == 0:
            return None
        start = (step * (self.keep - low)) % rest
        cycling = low + (start + torch.arange(self.keep - low)) % rest
        return torch.cat([torch.arange(low), cycling.sort().values])

    def _encode(self, residual, coeffs, band, device) -> None:
        if band is None:
            ops.dct_encode(residual, self.block_size, self.keep, out=coeffs)
            return
        full = self.pool.acquire(coeffs.shape[0] * self.block_size, torch.float32, device)
        full = full.view(coeffs.shape[0], self.block_size)
        ops.dct_encode(residual, self.block_size, self.block_size, out=full)
        torch.index_select(full, 1, band, out=coeffs)
        self.pool.release(full)

    def _decode(self, coeffs, band, n, out) -> None:
        if band is None:
            ops.dct_decode(coeffs, self.block_size, n, out=out)
            return
        full = self.pool.acquire(coeffs.shape[0] * self.block_size, torch.float32, out.device)
        full = full.view(coeffs.shape[0], self.block_size).zero_()
        full.index_copy_(1, band, coeffs)
        ops.dct_decode(full, self.block_size, n, out=out)
        self.pool.release(full)

    def _compress(self, plan_bucket: PlanBucket, grad: torch.Tensor, index: int) -> torch.futures.Future:
        n, device = grad.numel(), grad.device
        blocks, keep = num_segments(n, self.block_size), self.keep
        levels, world_size = self.levels(), self.world_size()
        residual = plan_bucket.tensors["residual"]
        coeffs = self.pool.acquire(blocks * keep, torch.float32, device).view(blocks, keep)
        scale = self.pool.acquire(blocks, torch.float32, device)
        with self._timer("encode_seconds"):
            residual.add_(grad, alpha=self.weight())
            band = self.frequencies(self.step - self.warmup_steps)
            if band is not None:
                band = band.to(device)
            self._encode(residual, coeffs, band, device)
            torch.linalg.vector_norm(coeffs, math.inf, dim=1, out=scale)
            scale.nan_to_num_(nan=math.inf)  # MAX keeps an infinity, so every rank sees it
        self._count_bytes(n * grad.element_size(), blocks * 4 + self.wire_bytes(n), True)
        # Wait here rather than in a callback: every collective is issued from this thread,
        # so all ranks issue them in the same order (gloo and NCCL match them by order).
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=self.process_group)
        quant_dtype = QUANT_DTYPES[self.bits]
        q = self.pool.acquire(blocks * keep, quant_dtype, device).view(blocks, keep)
        decoded = self.pool.acquire(n, torch.float32, device)
        if self.bits == 16:
            wire = self.pool.acquire((blocks * keep + 1) // 2, torch.int32, device)
            summed = self.pool.acquire(blocks * keep, torch.int32, device).view(blocks, keep)
            buffers = (coeffs, scale, q, decoded, wire, summed)
        else:
            wire = self.pool.acquire(blocks * keep, quant_dtype, device)
            summed = wire.view(blocks, keep)
            buffers = (coeffs, scale, q, decoded, wire)

        def release():
            for buffer in buffers:
                self.pool.release(buffer)

        with self._timer("encode_seconds"):
            if not bool(torch.isfinite(scale).all()):
                release()
                raise_non_finite(self, index, plan_bucket)
            ops.quantize(coeffs, scale, levels, quant_dtype, out=q)
            if self.bits == 16:
                pack_int16_pairs(q.view(-1), levels, wire)
            else:
                wire.copy_(q.view(-1))
        summed_future = dist.all_reduce(wire, group=self.process_group, async_op=True).get_future()
        with self._timer("encode_seconds"):
            # Error feedback while the integers travel: keep what this rank's own integers
            # do not represent (residual = accumulated - decode(q_local)).
            ops.dequantize(q, scale, levels, out=coeffs)
            self._decode(coeffs, band, n, decoded)
            residual.sub_(decoded)

        def decode(fut):
            fut.value()
            with self._timer("decode_seconds"):
                if self.bits == 16:
                    unpack_int16_pair_sums(wire, levels, world_size, blocks * keep, summed.view(-1))
                ops.dequantize(summed, scale, levels, out=coeffs)
                self._decode(coeffs, band, n, decoded)
                grad.copy_(decoded)
                release()
            return grad

        return summed_future.then(decode)


def dct_quant_hook(state: DCTQuantState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Send each bucket as quantized low-frequency DCT coefficients, with error feedback.

    Per bucket (flattened gradient ``g`` of ``n`` elements), after ``warmup_steps`` dense steps:

    1. ``residual += w * g`` (``w``: this rank's weight, ``1 / world_size`` by default).
    2. Blockwise DCT-II of the residual, keeping the ``keep`` lowest coefficients of each
       block of ``block_size`` (:func:`hetero_comm.ops.dct_encode`).
    3. Agree on a per-block scale, the same on every rank: a MAX allreduce of each block's
       largest ``|coefficient|``.
    4. Quantize to integers in ``[-levels, levels]`` with
       ``levels = (2**(bits-1) - 1) // world_size`` (:func:`hetero_comm.ops.quantize`), so
       the sum over ranks cannot overflow.
    5. ONE allreduce (sum) of the integers. Meanwhile, error feedback:
       ``residual -= decode(this rank's integers)``.
    6. Dequantize the sum and invert the DCT into the bucket
       (:func:`hetero_comm.ops.dequantize`, :func:`hetero_comm.ops.dct_decode`).

    Args:
        state: a :class:`DCTQuantState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the decoded weighted sum.

    Raises:
        FloatingPointError: (from the hook) a NaN or infinity reached the bucket on any rank.

    Example::

        >>> state = DCTQuantState(block_size=256, keep_ratio=0.125, bits=8)
        >>> ddp_model.register_comm_hook(state, dct_quant_hook)
    """
    return state.run(bucket)
