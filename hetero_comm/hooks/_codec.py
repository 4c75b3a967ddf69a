"""The sparse exchange of one flat gradient in three kernels and two allreduces: the sparse
hook's steps where the gradient is on the CPU (the codec's kernels are compiled for the CPU; a
GPU takes the steps part by part, :func:`~.segment_sparse.sparse_allreduce`).

Per plan bucket the buffers (importance, indices, scales, wire, DCT coefficients) are made once
and reused every step while the bucket's shape and ``k`` stay, so a step allocates nothing (but
the int8 wire summed in two phases, :mod:`._two_phase`, whose collectives take buffers of their
own) and issues five operator calls: :func:`hetero_comm.ops.sparse_encode_`, the importance's allreduce,
:func:`hetero_comm.ops.sparse_pack_`, the wire's allreduce and, once the sum arrives,
:func:`hetero_comm.ops.sparse_unpack_`.
"""

import math
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from .._backend import kernel_backend
from .._layout import dct_coeffs_shape, num_segments
from ._non_finite import NonFiniteGradient
from ._plan import PlanBucket
from ._sparse_parts import INT8_CLIP_RMS, MIN_SEGMENTS_PER_BUCKET, WIRE_DTYPES
from ._two_phase import add_to_residual, two_phase_int8_sum, two_phase_wire_bytes

__all__ = ["BucketCodec", "CodecBuffers", "AgreementInFlight", "codec_allreduce"]


class BucketCodec:
    """The settings and buffers of one plan bucket's exchange at one ``k``."""

    def __init__(self, state, numel: int, k: int, segment: int, count: int,
                 device: torch.device) -> None:
        self.numel, self.k, self.segment, self.count = numel, k, segment, count
        self.block_size = state.dct_block_size if state.basis == "dct" else 0
        integer = state.wire_dtype == "int8"
        self.levels = state.int8_levels() if integer else 0
        self.two_phase = state.sums_in_two_phases()
        self.ranks = state.exchange_size()
        self.scale_factor = (INT8_CLIP_RMS / (state.exchange_size() * math.sqrt(segment))
                             if integer else 0.0)
        coefficients = (math.prod(dct_coeffs_shape(numel, self.block_size, self.block_size, segment))
                        if self.block_size else 0)
        # one float32 arena: importance, scales, coefficients
        arena = torch.empty(count + (k if integer else 0) + coefficients, device=device)
        self.importance = arena[:count]
        self.scale = arena[count:count + k] if integer else None
        self.coefficients = (arena[arena.numel() - coefficients:].view(
            dct_coeffs_shape(numel, self.block_size, self.block_size, segment))
            if self.block_size else None)
        self.indices = torch.empty(k, dtype=torch.int64, device=device)
        self.wire = torch.empty(k * segment, dtype=WIRE_DTYPES[state.wire_dtype], device=device)
        self.sign = state.output == "sign"
        self.device = device
        # the compiled ops called directly: the hook's host time is a few calls a bucket
        self.compiled = device.type == "cpu" and kernel_backend(device) == "compiled"

    def encode(self, residual: torch.Tensor, grad: torch.Tensor, weight: float,
               velocity: Optional[torch.Tensor], momentum: float, nesterov: bool) -> None:
        """:func:`hetero_comm.ops.sparse_encode_` into this codec's importance."""
        if self.compiled:
            torch.ops.hetero_comm.sparse_encode_.default(
                residual, grad, weight, velocity, momentum, nesterov, self.segment,
                self.block_size, self.coefficients, self.importance)
        else:
            ops.sparse_encode_(residual, grad, self.segment, self.importance, weight=weight,
                               velocity=velocity, momentum=momentum, nesterov=nesterov,
                               block_size=self.block_size, coefficients=self.coefficients)

    def pack(self, residual: torch.Tensor, velocity: Optional[torch.Tensor]) -> bool:
        """:func:`hetero_comm.ops.sparse_pack_` of the agreed importance onto this codec's
        wire; False if the importance is not finite."""
        if self.compiled:
            return torch.ops.hetero_comm.sparse_pack_.default(
                residual, self.coefficients, velocity, self.importance, self.segment,
                self.block_size, self.scale_factor, self.levels, self.indices, self.scale,
                self.wire)
        return ops.sparse_pack_(residual, self.importance, self.segment, self.indices, self.wire,
                                block_size=self.block_size, coefficients=self.coefficients,
                                velocity=velocity, levels=self.levels, scale=self.scale,
                                scale_factor=self.scale_factor)

    def unpack(self, wire: torch.Tensor, scale: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        """:func:`hetero_comm.ops.sparse_unpack_` of the summed ``wire`` into ``grad``."""
        if self.compiled:
            torch.ops.hetero_comm.sparse_unpack_.default(
                wire, self.indices, scale, self.levels, self.segment, self.block_size, self.sign,
                self.coefficients, grad)
        else:
            ops.sparse_unpack_(wire, self.indices, self.segment, grad, levels=self.levels,
                               scale=scale, block_size=self.block_size,
                               coefficients=self.coefficients, sign=self.sign)

    def wire_bytes(self) -> int:
        """Bytes handed to the collectives per step: the importance and the wire."""
        if self.two_phase:
            return self.importance.numel() * 4 + two_phase_wire_bytes(self.k, self.segment, self.ranks)
        return self.importance.numel() * 4 + self.wire.numel() * self.wire.element_size()


class CodecBuffers:
    """Each plan bucket's :class:`BucketCodec` (made anew when its ``k`` or layout changes)."""

    def __init__(self) -> None:
        self._codecs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.builds = 0  # buffer sets made (a steady step makes none)

    def codec_for(self, state, plan_bucket: PlanBucket, grad: torch.Tensor, index: int) -> BucketCodec:
        owner = plan_bucket.origin  # (the two-level sync's share, the kept part of one)
        numel = grad.numel()
        codec = self._codecs.get(owner)
        if codec is not None and codec.numel == numel and codec.device == grad.device \
                and state.segments_to_send(codec.count, state.step) == codec.k:
            return codec  # (the segments follow from the settings and numel alone)
        segment = state.segment_size_for(numel)
        block = state.dct_block_size if state.basis == "dct" else 0
        count = (num_segments(numel, segment) if not block
                 else math.prod(dct_coeffs_shape(numel, block, block, segment)[:2]))
        k = state.segments_to_send(count, state.step)
        if not block and k < count < MIN_SEGMENTS_PER_BUCKET:
            state.warn_coarse_segments(index, numel, segment, count)
        codec = self._codecs[owner] = BucketCodec(state, numel, k, segment, count, grad.device)
        self.builds += 1
        return codec


def codec_allreduce(state, plan_bucket: PlanBucket, grad: torch.Tensor, index: int,
                    agreements: Optional[list] = None) -> torch.futures.Future:
    """Steps 1-5 of :func:`~.segment_sparse.segment_sparse_hook` for ``grad`` (on the CPU),
    laid out like ``plan_bucket``. Encodes and issues the importance's sum; without
    ``agreements`` it waits for that sum and goes on (a non-finite one raises
    :class:`NonFiniteGradient`); with it, the rest is appended there as an
    :class:`AgreementInFlight` for the caller to finish later, in order."""
    codec = state.codecs.codec_for(state, plan_bucket, grad, index)  # (too many ranks for
    # the int8 wire raise there, before anything is written)
    velocity: Optional[torch.Tensor] = plan_bucket.tensors["momentum"] if state.momentum else None
    began = time.perf_counter()
    codec.encode(plan_bucket.tensors["residual"], grad, state.contribution_weight(), velocity,
                 state.momentum, state.nesterov)
    state.statistics.counters["encode_seconds"] += time.perf_counter() - began
    work = dist.all_reduce(codec.importance, group=state.exchange_group(), async_op=True)
    agreement = AgreementInFlight(state, codec, plan_bucket, grad, index, velocity, work)
    if agreements is None:
        return agreement.finish(raise_non_finite=True)
    agreements.append(agreement)
    return agreement.delivered


class AgreementInFlight:
    """A bucket whose importance's sum was issued: :meth:`finish` waits for it, packs the
    agreed segments, issues the wire's sum and unpacks it into the bucket when it arrives
    (completing :attr:`delivered`)."""

    def __init__(self, state, codec: BucketCodec, plan_bucket: PlanBucket, grad: torch.Tensor,
                 index: int, velocity: Optional[torch.Tensor], work) -> None:
        self.state, self.codec, self.plan_bucket, self.grad = state, codec, plan_bucket, grad
        self.index, self.step, self.velocity, self.work = index, state.step, velocity, work
        self.delivered = torch.futures.Future()

    def finish(self, raise_non_finite: bool = False,
               wires: Optional[list] = None) -> torch.futures.Future:
        """Pack and send; returns :attr:`delivered`. The sum is unpacked by a callback when it
        arrives, or with ``wires`` by :meth:`deliver`, called by whoever keeps that list (this
        agreement is appended to it). Importance that is not finite (every rank summed the
        same, so all find it): the bucket's error feedback restarts and the bucket is handed on
        as NaN (``raise_non_finite``: :class:`NonFiniteGradient` is raised instead, for the
        state's ``run`` to do that)."""
        state, codec, grad = self.state, self.codec, self.grad
        try:
            self.work.wait()
            began = time.perf_counter()
            finite = codec.pack(self.plan_bucket.tensors["residual"], self.velocity)
            state.statistics.counters["encode_seconds"] += time.perf_counter() - began
            if not finite:  # its own tensors too: a kept part's are scattered back later
                for tensor in self.plan_bucket.tensors.values():
                    tensor.zero_()
                self.plan_bucket.reset()
                found = NonFiniteGradient(type(state).__name__, self.index, self.step)
                if raise_non_finite:
                    raise found
                self.delivered.set_result(state.non_finite.hand_on(grad, found).wait())
                return self.delivered
            state.count_exchange(self.index, grad.numel(), grad.numel() * grad.element_size(),
                                 codec.wire_bytes())
            if codec.two_phase:  # both collectives waited for here; the owner's rounding kept
                self.summed = two_phase_int8_sum(codec.wire, codec.scale, codec.segment,
                                                 state.exchange_group())
                add_to_residual(self.plan_bucket.tensors["residual"], self.summed.error,
                                codec.indices[self.summed.owned], codec.segment,
                                codec.block_size, codec.coefficients)
                work = None
            else:
                work = dist.all_reduce(codec.wire, group=state.exchange_group(), async_op=True)
        except NonFiniteGradient:
            raise
        except BaseException as error:  # e.g. the group failed: whoever waits on the bucket sees it
            if raise_non_finite:
                raise
            self.delivered.set_exception(error)
            return self.delivered
        self.wire_work = work
        if wires is not None:
            wires.append(self)
        elif work is None:
            self.deliver()
        else:
            work.get_future().add_done_callback(self.deliver)
        return self.delivered

    def arrived(self) -> bool:
        """Whether the wire's sum has arrived (after :meth:`finish`)."""
        return self.wire_work is None or self.wire_work.is_completed()

    def deliver(self, summed: Optional[torch.futures.Future] = None) -> None:
        """Wait for the wire's sum (``summed``: its completed future, in a callback) and unpack
        it into the bucket, completing :attr:`delivered`."""
        codec = self.codec
        try:
            if self.wire_work is not None:
                (self.wire_work if summed is None else summed).wait()
            wire, scale = ((codec.wire, codec.scale) if self.wire_work is not None
                           else (self.summed.wire, self.summed.scale))
            began = time.perf_counter()
            codec.unpack(wire, scale, self.grad)
            self.state.statistics.counters["decode_seconds"] += time.perf_counter() - began
        except BaseException as error:
            self.delivered.set_exception(error)
        else:
            self.delivered.set_result(self.grad)
