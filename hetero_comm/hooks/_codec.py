"""The sparse exchange of one flat gradient in three kernels and two allreduces: the sparse
hook's steps where the gradient is on the CPU (the codec's kernels are compiled for the CPU; a
GPU takes the steps part by part, :func:`~.segment_sparse.sparse_allreduce`).

Per plan bucket the buffers (importance, indices, scales, wire, DCT coefficients) are made once
and reused every step while the bucket's shape and ``k`` stay, so a step allocates nothing (but
the int8 wire summed in two phases, :mod:`._two_phase`, whose collectives take buffers of their
own) and issues five operator calls: :func:`hetero_comm.ops.sparse_encode_`, the importance's allreduce,
:func:`hetero_comm.ops.sparse_pack_`, the wire's allreduce and, once the sum arrives,
:func:`hetero_comm.ops.sparse_unpack_`. Consecutive small buckets share the two allreduces
(:class:`ExchangePipeline`), each bucket keeping its own selection and scales.
"""

import math
import time
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import ops
from .._backend import kernel_backend
from .._layout import dct_coeffs_shape, num_segments
from ._non_finite import NonFiniteGradient
from ._plan import PlanBucket
from ._sparse_parts import INT8_CLIP_RMS, MIN_SEGMENTS_PER_BUCKET, WIRE_DTYPES
from ._two_phase import add_to_residual, two_phase_int8_sum, two_phase_wire_bytes

__all__ = ["BucketCodec", "CodecBuffers", "AgreementInFlight", "ExchangePipeline",
           "FUSE_BELOW_NUMEL", "codec_allreduce"]

# Consecutive buckets are exchanged together until they hold this many values: an exchange
# costs two collectives (about 70 us each on gloo at world size 1) besides its kernels (about
# 9 ns a value), so alone a bucket of 4K values would spend three quarters of its time on them.
FUSE_BELOW_NUMEL = 1 << 16


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

    def pack(self, residual: torch.Tensor, velocity: Optional[torch.Tensor],
             importance: Optional[torch.Tensor] = None) -> bool:
        """:func:`hetero_comm.ops.sparse_pack_` of the agreed ``importance`` (default: this
        codec's; a fused group's sum holds its own copy) onto this codec's wire; False if it is
        not finite."""
        if importance is None:
            importance = self.importance
        if self.compiled:
            return torch.ops.hetero_comm.sparse_pack_.default(
                residual, self.coefficients, velocity, importance, self.segment,
                self.block_size, self.scale_factor, self.levels, self.indices, self.scale,
                self.wire)
        return ops.sparse_pack_(residual, importance, self.segment, self.indices, self.wire,
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
        self._fused: dict = {}  # a step's n-th fused group -> its FusedBuffers

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

    def fused_for(self, ordinal: int, codecs: Tuple[BucketCodec, ...]) -> "FusedBuffers":
        """The buffers of a step's ``ordinal``-th fused group, made anew when its members'
        codecs change."""
        buffers = self._fused.get(ordinal)
        if buffers is None or not buffers.holds(codecs):
            buffers = self._fused[ordinal] = FusedBuffers(codecs)
            self.builds += 1
        return buffers

    def keep_fused(self, count: int) -> None:
        """Let go of the buffers of fused groups beyond the first ``count`` (and of the codecs
        they hold)."""
        for ordinal in [o for o in self._fused if o >= count]:
            del self._fused[ordinal]


def codec_allreduce(state, plan_bucket: PlanBucket, grad: torch.Tensor, index: int,
                    pipeline: Optional["ExchangePipeline"] = None) -> torch.futures.Future:
    """Steps 1-5 of :func:`~.segment_sparse.segment_sparse_hook` for ``grad`` (on the CPU),
    laid out like ``plan_bucket``. Encodes the importance; without ``pipeline`` it sums it,
    waits and goes on (a non-finite sum raises :class:`NonFiniteGradient`); with it, the
    bucket joins the pipeline's open group as an :class:`AgreementInFlight`, for the
    pipeline to sum, finish and deliver later, in order."""
    codec = state.codecs.codec_for(state, plan_bucket, grad, index)  # (too many ranks for
    # the int8 wire raise there, before anything is written)
    velocity: Optional[torch.Tensor] = plan_bucket.tensors["momentum"] if state.momentum else None
    began = time.perf_counter()
    codec.encode(plan_bucket.tensors["residual"], grad, state.contribution_weight(), velocity,
                 state.momentum, state.nesterov)
    state.statistics.counters["encode_seconds"] += time.perf_counter() - began
    agreement = AgreementInFlight(state, codec, plan_bucket, grad, index, velocity)
    if pipeline is None:
        agreement.issue()
        return agreement.finish(raise_non_finite=True)
    pipeline.add(agreement)
    return agreement.delivered


class AgreementInFlight:
    """A bucket whose importance is encoded: :meth:`issue` sums it, :meth:`finish` waits for
    the sum, packs the agreed segments, issues the wire's sum and unpacks it into the bucket
    when it arrives (completing :attr:`delivered`). In a :class:`FusedGroup` the group does
    the summing and these steps are called one by one."""

    def __init__(self, state, codec: BucketCodec, plan_bucket: PlanBucket, grad: torch.Tensor,
                 index: int, velocity: Optional[torch.Tensor]) -> None:
        self.state, self.codec, self.plan_bucket, self.grad = state, codec, plan_bucket, grad
        self.index, self.step, self.velocity = index, state.step, velocity
        self.work = self.wire_work = None
        self.delivered = torch.futures.Future()

    @property
    def members(self) -> List["AgreementInFlight"]:
        """The buckets exchanged together (a group of one: this one), as :class:`FusedGroup`."""
        return [self]

    def issue(self) -> None:
        """Issue the importance's sum."""
        self.work = dist.all_reduce(self.codec.importance, group=self.state.exchange_group(),
                                    async_op=True)

    def pack_agreed(self, importance: torch.Tensor, raise_non_finite: bool = False) -> bool:
        """Pack the segments the summed ``importance`` selects onto the codec's wire and count
        the bytes. Importance that is not finite (every rank summed the same, so all find it):
        the bucket's error feedback restarts, the bucket is handed on as NaN and False is
        returned (``raise_non_finite``: :class:`NonFiniteGradient` is raised instead, for the
        state's ``run`` to do that)."""
        state, codec, grad = self.state, self.codec, self.grad
        began = time.perf_counter()
        finite = codec.pack(self.plan_bucket.tensors["residual"], self.velocity, importance)
        state.statistics.counters["encode_seconds"] += time.perf_counter() - began
        if not finite:  # its own tensors too: a kept part's are scattered back later
            for tensor in self.plan_bucket.tensors.values():
                tensor.zero_()
            self.plan_bucket.reset()
            found = NonFiniteGradient(type(state).__name__, self.index, self.step)
            if raise_non_finite:
                raise found
            self.delivered.set_result(state.non_finite.hand_on(grad, found).wait())
            return False
        state.count_exchange(self.index, grad.numel(), grad.numel() * grad.element_size(),
                             codec.wire_bytes(), self.step)
        return True

    def finish(self, raise_non_finite: bool = False,
               wires: Optional[list] = None) -> torch.futures.Future:
        """Wait for the importance's sum, pack and send; returns :attr:`delivered`. The sum is
        unpacked by a callback when it arrives, or with ``wires`` by :meth:`deliver`, called by
        whoever keeps that list (this agreement is appended to it). Non-finite importance:
        :meth:`pack_agreed`."""
        state, codec = self.state, self.codec
        try:
            self.work.wait()
            if not self.pack_agreed(codec.importance, raise_non_finite):
                return self.delivered
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
            self.unpack(wire, scale)
        except BaseException as error:
            self.delivered.set_exception(error)

    def unpack(self, wire: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
        """Unpack the summed ``wire`` into the bucket and complete :attr:`delivered`."""
        began = time.perf_counter()
        self.codec.unpack(wire, scale, self.grad)
        self.state.statistics.counters["decode_seconds"] += time.perf_counter() - began
        self.delivered.set_result(self.grad)


class FusedBuffers:
    """A fused group's two sums: its members' importances side by side, and their wires."""

    def __init__(self, codecs: Tuple[BucketCodec, ...]) -> None:
        self.codecs = codecs
        self.importance = torch.empty(sum(c.importance.numel() for c in codecs),
                                      device=codecs[0].device)
        self.wire = torch.empty(sum(c.wire.numel() for c in codecs), dtype=codecs[0].wire.dtype,
                                device=codecs[0].device)
        self.importances = self.importance.split([c.importance.numel() for c in codecs])
        self.wires = self.wire.split([c.wire.numel() for c in codecs])

    def holds(self, codecs: Tuple[BucketCodec, ...]) -> bool:
        return len(codecs) == len(self.codecs) and all(a is b for a, b in zip(codecs, self.codecs))


class FusedGroup:
    """Consecutive buckets exchanged together: one allreduce of their importances, then one
    of their wires. Each bucket keeps its own selection, step and error feedback, so the
    training is the one their separate exchanges give."""

    def __init__(self, members: List[AgreementInFlight], buffers: FusedBuffers) -> None:
        self.members, self.buffers = members, buffers
        self.state = members[0].state
        self.work = self.wire_work = None
        self.packed: List[int] = []

    def issue(self) -> None:
        """Gather the members' importances and issue their sum."""
        torch.cat([m.codec.importance for m in self.members], out=self.buffers.importance)
        self.work = dist.all_reduce(self.buffers.importance, group=self.state.exchange_group(),
                                    async_op=True)

    def finish(self, wires: list) -> None:
        """Wait for the importances' sum, pack every member, issue the wires' sum and append
        this group to ``wires`` (a member whose importance is not finite is handed on as NaN
        and not unpacked; its slot is sent all the same, as on every rank)."""
        try:
            self.work.wait()
            self.packed = [i for i, (member, importance) in
                           enumerate(zip(self.members, self.buffers.importances))
                           if member.pack_agreed(importance)]
            if self.packed:
                torch.cat([m.codec.wire for m in self.members], out=self.buffers.wire)
                self.wire_work = dist.all_reduce(self.buffers.wire,
                                                 group=self.state.exchange_group(), async_op=True)
        except BaseException as error:  # e.g. the group failed: whoever waits on a bucket sees it
            self._fail(error)
            return
        wires.append(self)

    def arrived(self) -> bool:
        return self.wire_work is None or self.wire_work.is_completed()

    def deliver(self) -> None:
        """Wait for the wires' sum and unpack each packed member from its slot."""
        try:
            if self.wire_work is not None:
                self.wire_work.wait()
            for i in self.packed:
                member = self.members[i]
                member.unpack(self.buffers.wires[i], member.codec.scale)
        except BaseException as error:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        for member in self.members:
            if not member.delivered.done():
                member.delivered.set_exception(error)


class ExchangePipeline:
    """The CPU's exchange of a step's buckets, in bucket order on every rank. Encoded buckets
    gather in an open group until it holds :data:`FUSE_BELOW_NUMEL` values (or the step ends),
    whose importances are then summed by one allreduce (a group of one: the bucket's own);
    a group issued earlier is finished (its wires packed and their sum issued) once the
    backward pass has moved on, so that the importance's round trip overlaps it."""

    def __init__(self, state) -> None:
        self.state = state
        self.open: List[AgreementInFlight] = []  # encoded, importance not yet summed
        self.open_numel = 0
        self.issued: list = []  # groups whose importance sum is in flight, in order
        self.wires: list = []  # groups whose wire sum is in flight
        self.fused_ordinals: List[int] = []  # this step's groups of several buckets

    def pending(self) -> bool:
        return bool(self.open or self.issued or self.wires)

    def add(self, agreement: AgreementInFlight) -> None:
        """Let ``agreement`` join the open group; sum the group's importances once it holds
        enough values. A bucket that holds enough alone, or whose int8 wire is summed in two
        phases, is exchanged alone (what is open goes first)."""
        if agreement.codec.two_phase or agreement.grad.numel() >= FUSE_BELOW_NUMEL:
            self.close()
            self.open.append(agreement)
            self.close()
            return
        self.open.append(agreement)
        self.open_numel += agreement.grad.numel()
        if self.open_numel >= FUSE_BELOW_NUMEL:
            self.close()

    def close(self) -> None:
        """Issue the open group's importance sum."""
        if not self.open:
            return
        members, self.open, self.open_numel = self.open, [], 0
        if len(members) == 1:
            group = members[0]
        else:
            ordinal = len(self.fused_ordinals)
            codecs = tuple(m.codec for m in members)
            group = FusedGroup(members, self.state.codecs.fused_for(ordinal, codecs))
            self.fused_ordinals.append(ordinal)
        group.issue()
        self.issued.append(group)

    def finish(self, count: int) -> None:
        """Finish the first ``count`` groups issued, in order."""
        finishing, self.issued = self.issued[:count], self.issued[count:]
        for group in finishing:
            group.finish(wires=self.wires)

    def deliver(self, wait: bool) -> None:
        """Unpack every wire whose sum has arrived (``wait``: every wire, waiting for it), on
        this thread: no callback on the communication thread competes for the interpreter."""
        waiting = []
        for group in self.wires:
            if wait or group.arrived():
                group.deliver()
            else:
                waiting.append(group)
        self.wires = waiting

    def end_step(self) -> None:
        """Sum what is open, finish and deliver everything: the step's last bucket. Buffers of
        fused groups this step did not make are let go."""
        self.close()
        self.finish(len(self.issued))
        self.deliver(wait=True)
        self.state.codecs.keep_fused(len(self.fused_ordinals))
        self.fused_ordinals = []

    def discard(self) -> None:
        """Drop the work of a step that ended before its last bucket (the backward raised): a
        new step's buckets must not be grouped or finished with it. Its buckets' futures fail."""
        error = RuntimeError("the sparse exchange's step ended before its last bucket; its "
                             "buckets in flight were dropped")
        members = list(self.open)
        for group in self.issued + self.wires:
            members.extend(group.members)
        for member in members:
            if not member.delivered.done():
                member.delivered.set_exception(error)
        self.open, self.open_numel, self.issued, self.wires = [], 0, [], []
        self.fused_ordinals = []
