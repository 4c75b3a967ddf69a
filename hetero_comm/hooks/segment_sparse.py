"""Importance-segment sparse synchronisation with a globally agreed selection.

Each bucket is cut into segments of ``segment_size`` elements; every rank accumulates what it
has not sent yet (error feedback) and measures each segment's importance (its L2 norm). The
ranks agree on one set of segments, so the packed values are summed by a plain allreduce: no
allgather, no index exchange. The default (``selection="current"``) agrees on this step's
importance first, in a small allreduce of one float per segment, so it makes two allreduces
per bucket; ``selection="lagged"`` sends the segments agreed at the previous step and makes
one.

``basis="dct"`` selects segments of blockwise DCT coefficients instead (one frequency of a
group of blocks, see :mod:`._basis`), so that a sparse selection moves almost every
coordinate at every step; ``output="sign"`` delivers the sign of the agreed sum, the step
that makes such a selection train well with Adam-family optimizers (see the README's
"Compression with AdamW"). ``wire_dtype="int8"`` sends a byte per value, rounded to a step
every rank shares, so the allreduce sums exact integers and the same bytes carry about twice
bfloat16's density (the importance, a float32 per segment, is the same on every wire).
"""

import math
import warnings
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import ops
from .._checks import check_choice, check_float, check_int
from .._layout import num_segments
from ._basis import DctBasis
from ._plan import PlanBucket
from ._state import ErrorFeedbackState, check_state

__all__ = ["SegmentSparseState", "segment_sparse_hook"]

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "int8": torch.int8}
# int8 wire: a rank's values are clipped at this many times the ranks' mean RMS of the segment
# (what is clipped stays in the residual).
INT8_CLIP_RMS = 4.0
# prepare_optimizer's default learning-rate factor for output="sign" (README: "The recipe's
# learning rate"); momentum correction's is momentum_correction_lr_scale().
SIGN_LR_SCALE = 1.5
# basis="elements": a bucket cut into fewer segments than this gets a warning. Coarse segments
# mix coordinates that need sending often with ones that can wait (README: "SGD at large learning
# rates"; measured: 27 and 108 segments failed on a small CNN at its top rates; 167, 189 and 216
# held).
MIN_SEGMENTS_PER_BUCKET = 150
SELECTIONS = ("current", "lagged")
BASES = ("elements", "dct")
OUTPUTS = ("sum", "sign")


def _refuse_coupled_weight_decay(optimizer: torch.optim.Optimizer) -> None:
    """Adam's own ``weight_decay`` adds ``wd * p`` to the gradient before normalising: with
    sign steps that moves every coordinate the hook left at 0 by a whole ``lr``."""
    for index, group in enumerate(optimizer.param_groups):
        if group.get("weight_decay") and not group.get("decoupled_weight_decay", False):
            raise ValueError(f"parameter group {index} has Adam's weight_decay "
                             f"{group['weight_decay']}, added to the gradient before Adam's "
                             f"normalisation: with sign steps it moves every coordinate not "
                             f"sent by a whole lr. Use AdamW (decoupled weight decay), or Adam "
                             f"with decoupled_weight_decay=True")


def fitting_segment_size(numel: int, segments: int) -> int:
    """The largest power of two that cuts ``numel`` elements into at least ``segments``
    segments (1 when even single elements are too few)."""
    return 1 << max(0, (numel // segments).bit_length() - 1)


def momentum_correction_lr_scale(density: float, momentum: float) -> float:
    """The learning-rate factor that gives back what momentum correction's clearing loses.

    Momentum SGD moves a gradient by ``1 / (1 - m)`` times the rate in all. Momentum correction
    moves a gradient that arrived ``t`` steps before its segment went out by
    ``(1 - m**(t + 1)) / (1 - m)`` times the rate, then clears the velocity. With a segment sent every
    ``T = 1 / density`` steps and arrivals spread evenly over that interval, the fraction kept
    is ``1 - m * (1 - m**T) / (T * (1 - m))``; the factor is its inverse (2.1 at 8% and
    momentum 0.9, 1.5 at 4%, 2.7 at 12%; README: "SGD at large learning rates")."""
    check_float("density", density, 0.0, 1.0, low_open=True)
    check_float("momentum", momentum, 0.0, 0.999)
    if not momentum:
        return 1.0
    interval = 1.0 / density
    kept = 1.0 - momentum * (1.0 - momentum ** interval) / (interval * (1.0 - momentum))
    return 1.0 / kept


class SegmentSparseState(ErrorFeedbackState):
    """State of :func:`segment_sparse_hook`.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        density: fraction of segments sent per step, in (0, 1]; ``k = ceil(density * S)``.
        segment_size: elements per segment, in [1, 2**20]. With ``basis="elements"`` keep
            at least :data:`MIN_SEGMENTS_PER_BUCKET` segments per bucket (a warning says when a
            bucket has fewer): on small models, use smaller segments, or let
            ``min_segments_per_bucket`` pick them.
        min_segments_per_bucket: with ``basis="elements"``, a bucket that ``segment_size`` cuts
            into fewer segments than this is cut into smaller ones: the largest power of two
            that gives at least this many (:meth:`segment_size_for`; each bucket's size
            follows from its own number of elements, so it is the same on every rank and after
            a resume). 0 (default): ``segment_size`` everywhere. The SGD recipe uses
            :data:`MIN_SEGMENTS_PER_BUCKET` (150).
        selection: ``"current"`` (default): agree on this step's importance first (a small
            allreduce of S float32 values), then send the top ``k`` segments; or
            ``"lagged"``: send the segments chosen from the previous step's importance and
            carry this step's importance in the same single allreduce (one collective per
            bucket, a selection one step old).
        momentum: momentum correction in [0, 1) (Deep Gradient Compression): the hook keeps a
            velocity ``u = momentum * u + g`` and accumulates ``u``, clearing both for the
            segments it sends. Use it INSTEAD of the optimizer's momentum (set that to 0).
            0 (default) accumulates the gradient itself.
        density_warmup_steps: after the dense warm-up, the density falls geometrically from 1
            to ``density`` over this many steps (0: start at ``density``), >= 0.
        wire_dtype: dtype of the packed values on the wire: ``"float32"`` (default),
            ``"float16"`` or ``"bfloat16"`` (half the bytes; each rank's rounding error stays
            in its residual, the rounding of the sum on the wire is not fed back), or
            ``"int8"`` (a quarter of the bytes, so about twice the density of bfloat16 at the
            same bytes): every rank rounds a selected segment to the same step, derived from
            the agreed importance, with at most ``127 // world_size`` steps each way, so the
            integer sum cannot overflow and is exact; the rounding and clipping error stays in
            the residual. Needs ``selection="current"`` and at most 63 ranks.
        basis: ``"elements"`` (default): a segment is ``segment_size`` consecutive gradient
            elements; ``"dct"``: each block of ``dct_block_size`` elements goes through an
            orthonormal DCT and a segment is one frequency of ``segment_size`` consecutive
            blocks, so every selected segment touches all their elements. Not with
            ``momentum``.
        dct_block_size: the DCT's block, a power of two in [2, 4096] (default 64).
        output: ``"sum"`` (default): the bucket becomes the (weighted) sum of what was sent;
            ``"sign"``: its elementwise sign (-1, 0 or 1), a sign step for AdamW with
            ``betas=(0.0, 0.0)`` (it then moves each coordinate by ``lr`` in the direction of
            the agreed sum; the residual plays the momentum's part). See the README.
        rank_weight, warmup_steps, min_compress_numel: see
            :class:`~hetero_comm.hooks.ErrorFeedbackState`.
    """

    _checkpoint_settings = ("density", "segment_size", "min_segments_per_bucket", "selection",
                            "momentum", "density_warmup_steps", "basis", "dct_block_size")
    min_segments_per_bucket = 0  # a class default: states pickled before it existed load

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 density: float = 0.01, segment_size: int = 256,
                 min_segments_per_bucket: int = 0, selection: str = "current",
                 momentum: float = 0.0, density_warmup_steps: int = 0,
                 wire_dtype: str = "float32", basis: str = "elements", dct_block_size: int = 64,
                 output: str = "sum", rank_weight: Optional[float] = None,
                 warmup_steps: int = 1, min_compress_numel: int = 0) -> None:
        self.momentum = check_float("momentum", momentum, 0.0, 0.999)
        super().__init__(process_group=process_group, rank_weight=rank_weight,
                         warmup_steps=warmup_steps, min_compress_numel=min_compress_numel,
                         plan_tensors=("residual", "momentum") if self.momentum else ("residual",))
        self.density = check_float("density", density, 0.0, 1.0, low_open=True)
        self.segment_size = check_int("segment_size", segment_size, 1, 1 << 20)
        self.min_segments_per_bucket = check_int("min_segments_per_bucket", min_segments_per_bucket,
                                                 0, 1 << 20)
        self.selection = check_choice("selection", selection, SELECTIONS)
        self.density_warmup_steps = check_int("density_warmup_steps", density_warmup_steps, 0)
        self.wire_dtype = check_choice("wire_dtype", wire_dtype, WIRE_DTYPES)
        if self.wire_dtype == "int8" and self.selection == "lagged":
            raise ValueError("wire_dtype='int8' needs selection='current': its rounding step comes "
                             "from this step's agreed importance, which 'lagged' does not send first")
        if self.wire_dtype == "int8" and dist.is_initialized():
            int8_levels(self.world_size())  # a clear error now rather than at the first step
        self.basis = check_choice("basis", basis, BASES)
        self.dct_block_size = check_int("dct_block_size", dct_block_size, 2, 4096)
        if dct_block_size & (dct_block_size - 1):
            raise ValueError(f"dct_block_size must be a power of two in [2, 4096]; got {dct_block_size}")
        if self.basis == "dct" and self.momentum:
            raise ValueError("momentum correction clears the velocity of the sent elements, which "
                             "basis='dct' does not send one by one: use basis='elements' with momentum")
        if self.basis == "dct" and self.min_segments_per_bucket:
            raise ValueError("min_segments_per_bucket cuts buckets into smaller segments of "
                             "elements; with basis='dct' a segment is one frequency of "
                             "segment_size blocks, which it does not change: use "
                             "basis='elements' with it, or leave it at 0")
        self.output = check_choice("output", output, OUTPUTS)
        self._log_settings()

    def settings(self) -> dict:
        return dict(density=self.density, segment_size=self.segment_size,
                    min_segments_per_bucket=self.min_segments_per_bucket,
                    selection=self.selection, momentum=self.momentum,
                    density_warmup_steps=self.density_warmup_steps, wire_dtype=self.wire_dtype,
                    basis=self.basis, dct_block_size=self.dct_block_size, output=self.output,
                    **super().settings())

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn (``UserWarning``) if ``optimizer`` does not take the step this hook's output
        is made for. ``output="sign"`` is AdamW's (or Adam's) with ``betas=(0.0, 0.0)``: with
        the default betas the README's recipe ends 30-50% worse on its transformer, and SGD's
        learning rate is not a sign step's. With ``momentum`` (momentum correction) the hook
        applies the momentum, so an optimizer's own would apply it twice. Otherwise
        ``output="sum"`` suits any optimizer. (Neither check can see the learning rate: the
        README's recipes take 1.5x (sign) and about 2x (momentum correction) the dense rate, which
        :meth:`prepare_optimizer` applies along with these settings.)"""
        if self.momentum:
            doubled = sorted({group["momentum"] for group in optimizer.param_groups if group.get("momentum")})
            if doubled:
                warnings.warn(f"SegmentSparseState(momentum={self.momentum}) applies momentum in the hook: "
                              f"give the optimizer momentum=0 in every parameter group (or call "
                              f"state.prepare_optimizer(optimizer)); found momentum {doubled}",
                              UserWarning, stacklevel=2)
        if self.output != "sign":
            return
        try:
            _refuse_coupled_weight_decay(optimizer)
        except ValueError as error:
            warnings.warn(f"SegmentSparseState(output='sign'): {error}", UserWarning, stacklevel=2)
        betas = {tuple(group["betas"]) for group in optimizer.param_groups if "betas" in group}
        if betas == {(0.0, 0.0)}:
            return
        found = (f"betas {sorted(betas)}" if betas
                 else f"{type(optimizer).__name__}, which has no betas")
        warnings.warn(f"SegmentSparseState(output='sign') hands the optimizer sign steps: use "
                      f"AdamW (or Adam) with betas=(0.0, 0.0) in every parameter group (or call "
                      f"state.prepare_optimizer(optimizer)); found {found}", UserWarning,
                      stacklevel=2)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          lr_scale: Optional[float] = None) -> torch.optim.Optimizer:
        """Fit ``optimizer``, set up as for dense training, to this hook's output, keeping the
        user's learning rate and schedule (the README's recipes; the mechanism and its
        guarantees: :meth:`HookState.prepare_optimizer`):

        * ``output="sign"``: AdamW, or Adam without weight decay or with
          ``decoupled_weight_decay=True``. Sets ``betas=(0.0, 0.0)`` (the step becomes
          ``lr`` times the agreed sign, with AdamW's decoupled weight decay) and steps at
          ``lr_scale`` times the rate, default :data:`SIGN_LR_SCALE` (1.5: the recipe's
          optimum was 1.5x dense's on the README's transformer, digits MLP and CNN).
        * ``momentum`` > 0 (momentum correction): SGD whose momentum is 0 or this state's,
          without Nesterov or dampening. Sets its momentum to 0 (the hook applies it) and steps at
          ``lr_scale`` times the rate, default :func:`momentum_correction_lr_scale` of the
          density and momentum (2.1 at 8% and 0.9: clearing the velocity of sent segments
          loses about half of each step). Measured within a point of dense SGD at 2 ranks on the
          README's MLP and CNN, at rates up to dense's best, with 167 to 216 segments per bucket
          (27 and 108 were too few; hence ``min_segments_per_bucket=150`` in the recipe).
        * otherwise (``output="sum"``): any optimizer, unchanged (``lr_scale`` default 1).
        """
        return super().prepare_optimizer(optimizer, lr_scale)

    def _optimizer_fit(self, optimizer: torch.optim.Optimizer) -> Tuple[dict, float]:
        if self.output == "sign":
            if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                raise TypeError(f"SegmentSparseState(output='sign') hands the optimizer sign "
                                f"steps, which Adam or AdamW take with betas (0, 0); got "
                                f"{type(optimizer).__name__}: use output='sum' with it")
            _refuse_coupled_weight_decay(optimizer)
            return {"betas": (0.0, 0.0)}, SIGN_LR_SCALE
        if not self.momentum:
            return {}, 1.0
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"SegmentSparseState(momentum={self.momentum}) replaces SGD's "
                            f"momentum; got {type(optimizer).__name__}: use momentum=0 with it")
        for index, group in enumerate(optimizer.param_groups):
            if group["momentum"] not in (0.0, self.momentum):
                raise ValueError(f"parameter group {index} has momentum {group['momentum']}, but "
                                 f"the hook applies momentum {self.momentum}: give "
                                 f"SegmentSparseState the optimizer's momentum (the hook's is "
                                 f"fixed: a scheduler cycling momentum, such as OneCycleLR, "
                                 f"needs cycle_momentum=False)")
            if group["nesterov"]:
                raise ValueError(f"parameter group {index} uses Nesterov momentum, which the "
                                 f"hook's momentum correction does not apply")
            if group["momentum"] and group["dampening"]:
                raise ValueError(f"parameter group {index} has dampening {group['dampening']}, "
                                 f"which the hook's momentum correction does not apply")
        return {"momentum": 0.0}, momentum_correction_lr_scale(self.density, self.momentum)

    def segment_size_for(self, numel: int) -> int:
        """Elements per segment in a bucket (or the part of one a plan bucket holds) of
        ``numel`` elements: ``segment_size``, or with ``min_segments_per_bucket`` (and
        ``basis="elements"``) a power of two small enough to give the bucket that many segments
        when ``segment_size`` does not (single elements when even they are too few)."""
        minimum = self.min_segments_per_bucket
        if self.basis != "elements" or not minimum or num_segments(numel, self.segment_size) >= minimum:
            return self.segment_size
        return min(self.segment_size, fitting_segment_size(numel, minimum))

    _warned_coarse_segments = False  # a class default: states pickled before it existed load

    def _warn_coarse_segments(self, index: int, numel: int, segment: int, count: int) -> None:
        """Warn (once per state) that ``numel`` elements of bucket ``index`` (all of it, or the
        part one plan bucket holds) make ``count`` < MIN_SEGMENTS_PER_BUCKET segments of
        ``segment``."""
        if self._warned_coarse_segments:
            return
        self._warned_coarse_segments = True
        dense = (f"send buckets this small dense "
                 f"(min_compress_numel={MIN_SEGMENTS_PER_BUCKET * self.segment_size})")
        fix = dense
        if numel >= MIN_SEGMENTS_PER_BUCKET:
            fix = (f"use min_segments_per_bucket={MIN_SEGMENTS_PER_BUCKET} (here segments of "
                   f"{fitting_segment_size(numel, MIN_SEGMENTS_PER_BUCKET)}), or {dense}")
        warnings.warn(f"segment_sparse_hook: {numel} elements of bucket {index} make only {count} "
                      f"segments of {segment}; with fewer than {MIN_SEGMENTS_PER_BUCKET} "
                      f"the selection cannot tell the coordinates that need sending often from "
                      f"those that can wait, and training can fall behind or diverge at large "
                      f"learning rates: {fix}", UserWarning, stacklevel=2)

    def density_at(self, step: int) -> float:
        """The density used at ``step`` (1 during the dense warm-up)."""
        ramp = step - self.warmup_steps
        if ramp < 0:
            return 1.0
        if ramp >= self.density_warmup_steps:
            return self.density
        return self.density ** ((ramp + 1) / (self.density_warmup_steps + 1))

    def segments_to_send(self, segments: int, step: int) -> int:
        """``k = ceil(density * S)`` at ``step`` (at least 1 for a non-empty bucket)."""
        return min(segments, max(1, math.ceil(self.density_at(step) * segments - 1e-9)))


def segment_sparse_hook(state: SegmentSparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Send the most important segments of each bucket, with error feedback.

    Per bucket (flattened gradient ``g`` of ``n`` elements, ``S = ceil(n / s)`` segments of
    ``s = state.segment_size_for(n)`` elements, ``k = ceil(density * S)``), after
    ``warmup_steps`` dense steps (the steps are :func:`_sparse_allreduce`, top to bottom):

    1. ``residual += w * g`` (or the momentum-corrected velocity) and the L2 norm of every
       segment of the residual, in one pass (:func:`hetero_comm.ops.segment_accumulate_`).
    2. Select the same ``k`` segments on every rank. ``selection="current"``: allreduce the
       importance vector (S float32) and take its top ``k``
       (:func:`hetero_comm.ops.select_segments`). ``selection="lagged"``: take the segments
       agreed at the previous step.
    3. Pack those segments and zero them in the residual, which keeps whatever the wire dtype
       cannot represent (:func:`hetero_comm.ops.pack_segments_`). int8: each segment is
       rounded to integers in a step shared by all ranks, and the rounding and clipping error
       stays in the residual, in the same pass (:func:`hetero_comm.ops.pack_quantized_segments_`,
       see :class:`_IntegerWire`).
    4. Allreduce (sum) the packed values; every rank sent the same segments, so the sum is
       ``sum_i w_i * residual_i`` there. Lagged: the importance of what stays held back
       travels in the same allreduce.
    5. Scatter the sum into the bucket, zeros elsewhere
       (:func:`hetero_comm.ops.unpack_segments`). Lagged: the top ``k`` of the summed
       importance is the next step's selection.

    With ``basis="dct"`` the segments are cut from the residual's interleaved DCT
    coefficients (step 1 transforms the residual, step 3 transforms what was not sent back
    into it, step 5 inverts the transform of the sum). With ``output="sign"`` step 5 keeps
    only the sign of the result.

    Args:
        state: a :class:`SegmentSparseState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the sparse weighted sum.

    Raises:
        FloatingPointError: a NaN or infinity reached the bucket on any rank (from the hook,
            in either mode, on every rank).

    Example::

        >>> state = SegmentSparseState(density=0.01, segment_size=256)
        >>> ddp_model.register_comm_hook(state, segment_sparse_hook)
    """
    check_state(state, SegmentSparseState, "segment_sparse_hook")
    return state.run(bucket, _sparse_allreduce)


def _sparse_allreduce(state: SegmentSparseState, plan_bucket: PlanBucket, grad: torch.Tensor,
                      index: int) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-5 of :func:`segment_sparse_hook` for ``grad``, laid out like ``plan_bucket``."""
    step, pool, lagged = state.step, state.pool, state.selection == "lagged"
    levels = int8_levels(state.world_size()) if state.wire_dtype == "int8" else 0  # before any write
    space = _Segmented(state, plan_bucket.tensors["residual"], grad)
    segment = space.segment
    count = num_segments(space.numel, segment)
    k = state.segments_to_send(count, step)
    if k < count and state.basis == "elements" and count < MIN_SEGMENTS_PER_BUCKET:
        state._warn_coarse_segments(index, space.numel, segment, count)
    # 1. Accumulate.
    importance = pool.acquire(count, torch.float32, grad.device)
    with state.timer("encode_seconds"):
        space.accumulate(_contribution(state, plan_bucket, grad), importance)
    # 2. Select.
    indices = plan_bucket.extra.get("indicator") if lagged else None
    agree_now = indices is None or indices.numel() != k
    finite = None  # CUDA: the agreed importance's finiteness, as a device flag
    if agree_now:
        indices, finite = _agree_and_select(state, plan_bucket, importance, k, index, step, space)
    # 3. Pack (lagged, from the previous selection: with the importance riding along).
    packed_numel = k * segment
    wire = pool.acquire(packed_numel + (0 if agree_now else count), WIRE_DTYPES[state.wire_dtype], grad.device)
    integers = _IntegerWire(state, levels, importance, indices, space) if levels else None
    with state.timer("encode_seconds"):
        # Lagged: zeroing the sent segments below could hide a NaN; flag it first (on the device).
        local_finite = None if agree_now else torch.isfinite(importance).all()
        _pack_selected(space, indices, wire[:packed_numel], integers)
        space.keep_unsent()
        if state.momentum:  # sent segments' velocity restarts from zero
            _clear_segments(state, plan_bucket.tensors["momentum"], indices, segment)
        if lagged:  # sent segments are no longer held back (index_fill_: no host sync on CUDA)
            importance.index_fill_(0, indices, 0.0)
        if not agree_now:
            _load_importance(wire[packed_numel:], importance, local_finite, state.world_size())
        state.drop_unless(finite, wire)  # CUDA, non-finite: the sum, and the gradient, are zero
    state.count_bytes(grad.numel() * grad.element_size(),
                      wire.numel() * wire.element_size() + (4 * count if agree_now else 0), True)
    # 4. Allreduce. Lagged: waited for here, so a NaN raises FloatingPointError from the hook
    #    (not wrapped by DDP's wait), at the price of no overlap with the backward pass.
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)

    # 5. Unpack.
    def unpack() -> torch.Tensor:
        with state.timer("decode_seconds"):
            to_release = ((importance, wire) + ((indices,) if agree_now else ()) + space.buffers
                          + (integers.buffers if integers is not None else ()))
            if not agree_now:  # runs in the hook (lagged waits there): state resets in order
                importance.copy_(wire[packed_numel:])
                state.drop_unless(state.check_finite(importance, index, step, plan_bucket, to_release),
                                  wire)
            packed = wire[:packed_numel] if integers is None else integers.decode(wire)
            space.deliver(packed, indices, grad)
            if lagged:
                _select_next(state, plan_bucket, importance, step)
            state.callbacks.release(to_release, grad.device)  # CUDA: after this stream's work
        return grad

    def after_sum(fut) -> torch.Tensor:
        fut.wait()
        return unpack()

    if agree_now:
        return work.get_future().then(after_sum)
    work.wait()
    done = torch.futures.Future()
    done.set_result(unpack())
    return done


def _pack_selected(space: "_Segmented", indices: torch.Tensor, wire: torch.Tensor,
                   integers: Optional["_IntegerWire"]) -> None:
    """Step 3: the selected segments onto ``wire``; in the residual, zeros or what the wire
    dtype cannot carry."""
    if integers is None:
        ops.pack_segments_(space.vector, indices, space.segment, out=wire)
    else:
        integers.pack_(space, wire)


def int8_levels(world_size: int) -> int:
    """Steps each way one rank may send on the int8 wire, so that the sum of ``world_size``
    ranks' integers fits in int8 (``127 // world_size``, at least 2)."""
    levels = 127 // world_size
    if levels < 2:
        raise ValueError(f"wire_dtype='int8' sums the integers of {world_size} ranks in int8, which "
                         f"leaves {levels} step(s) each way per rank (at least 2 are needed, so at "
                         "most 63 ranks): use wire_dtype='bfloat16'")
    return levels


class _IntegerWire:
    """The int8 wire: the selected segments as integers in steps every rank shares.

    A segment's scale (the value sent as ``levels`` steps) is ``INT8_CLIP_RMS`` times the ranks'
    mean RMS there; that RMS, ``importance / (world_size * sqrt(elements))``, comes from the
    agreed importance (the sum of the ranks' norms), so every rank rounds to the same grid and
    the allreduce's integer sum is exact (``world_size * levels <= 127``). Many ranks leave few
    levels (32 ranks: 3 each way, close to ternary); error feedback carries the rest."""

    def __init__(self, state: SegmentSparseState, levels: int, importance: torch.Tensor,
                 indices: torch.Tensor, space: "_Segmented") -> None:
        self.levels, self.indices, self.k = levels, indices, indices.numel()
        self.segment = segment = space.segment
        numel, count, device = space.numel, importance.numel(), importance.device
        self.values = state.pool.acquire(self.k * segment, torch.float32, device)
        self.scale = state.pool.acquire(self.k, torch.float32, device)
        torch.index_select(importance, 0, indices, out=self.scale)
        self.scale.mul_(INT8_CLIP_RMS / (state.world_size() * math.sqrt(segment)))
        tail = numel - (count - 1) * segment  # the last segment may be short: its RMS is over tail
        if tail < segment:
            self.scale.mul_(torch.where(indices == count - 1, math.sqrt(segment / tail), 1.0))
        self.scale.clamp_(max=torch.finfo(torch.float32).max)  # a huge finite norm: no infinite step
        self.buffers = (self.values, self.scale)

    def pack_(self, space: "_Segmented", wire: torch.Tensor) -> None:
        """Round the selected segments of ``space.vector`` onto ``wire``; what the integers do
        not carry (rounding, clipping) stays in those segments. A NaN is sent as 0 and stays in
        the residual (CUDA: the caller then zeroes the wire by the agreed importance's flag)."""
        ops.pack_quantized_segments_(space.vector, self.indices, self.segment, self.scale,
                                     self.levels, torch.int8, out=wire)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """The summed integers back to float32 values (packed, like the other wires)."""
        segment = self.segment
        ops.dequantize(wire.view(self.k, segment), self.scale, self.levels,
                       out=self.values.view(self.k, segment))
        return self.values


class _Segmented:
    """What the segments cut: the residual itself (``basis="elements"``), or its interleaved
    DCT coefficients (``basis="dct"``, in pooled work buffers), in segments of ``segment``."""

    def __init__(self, state: SegmentSparseState, residual: torch.Tensor, grad: torch.Tensor) -> None:
        self.state, self.residual = state, residual
        self.segment = state.segment_size_for(residual.numel())
        self.basis = None
        self.vector, self.numel, self.buffers = residual, residual.numel(), ()
        if state.basis == "dct":
            self.basis = DctBasis(residual.numel(), state.dct_block_size, state.segment_size)
            self.numel = self.basis.coefficients
            self.vector = state.pool.acquire(self.numel, torch.float32, grad.device)
            self.scratch = state.pool.acquire(self.numel, torch.float32, grad.device)
            self.buffers = (self.vector, self.scratch)
            if grad.dtype != torch.float32:  # the decoded sum, before its cast into the bucket
                self.decoded = state.pool.acquire(grad.numel(), torch.float32, grad.device)
                self.buffers += (self.decoded,)

    def accumulate(self, contribution: torch.Tensor, importance: torch.Tensor) -> None:
        """``residual += contribution``; the L2 norm of every segment into ``importance``."""
        if self.basis is None:
            ops.segment_accumulate_(self.residual, contribution, self.segment, out=importance)
            return
        self.residual.add_(contribution)
        self.basis.encode(self.residual, self.vector, self.scratch)
        torch.linalg.vector_norm(self.vector.view(-1, self.segment), dim=1, out=importance)

    def keep_unsent(self) -> None:
        """After packing zeroed the sent segments: the residual is what was not sent."""
        if self.basis is not None:
            self.basis.decode(self.vector, self.residual, self.scratch)

    def deliver(self, packed: torch.Tensor, indices: torch.Tensor, grad: torch.Tensor) -> None:
        """The summed segments into the bucket, zeros elsewhere (``output="sign"``: signs)."""
        segment = self.segment
        if self.basis is None:
            ops.unpack_segments(packed, indices, segment, grad.numel(), out=grad)
        else:
            ops.unpack_segments(packed, indices, segment, self.numel, out=self.vector)
            decoded = grad if grad.dtype == torch.float32 else self.decoded
            self.basis.decode(self.vector, decoded, self.scratch)
            if decoded is not grad:
                grad.copy_(decoded)
        if self.state.output == "sign":
            grad.sign_()


def _contribution(state: SegmentSparseState, plan_bucket: PlanBucket, grad: torch.Tensor) -> torch.Tensor:
    """What goes into the residual this step: the weighted gradient, or with momentum
    correction the velocity ``u = momentum * u + w * g``."""
    grad.mul_(state.weight())
    if not state.momentum:
        return grad
    return plan_bucket.tensors["momentum"].mul_(state.momentum).add_(grad)


def _agree_and_select(state: SegmentSparseState, plan_bucket: PlanBucket, importance: torch.Tensor,
                      k: int, index: int, step: int, space: _Segmented) -> torch.Tensor:
    """Sum the importance over ranks and take its top ``k`` (pooled int64 indices)."""
    # Wait here rather than in a callback: every collective is issued from this thread,
    # so all ranks issue them in the same order (gloo and NCCL match them by order).
    dist.all_reduce(importance, group=state.process_group)
    with state.timer("encode_seconds"):
        # Norms are >= 0: the sum keeps a NaN. CUDA: flagged on the device, selection goes on.
        finite = state.check_finite(importance, index, step, plan_bucket, (importance,) + space.buffers)
        indices = state.pool.acquire(k, torch.int64, importance.device)
        return ops.select_segments(importance, k, out=indices), finite


def _load_importance(out: torch.Tensor, importance: torch.Tensor, finite: torch.Tensor,
                     world_size: int) -> None:
    """Lagged mode: put the importance on the wire. Zeroing the sent segments and
    saturating to a 16-bit wire could hide a NaN or infinity, so a non-finite vector is
    poisoned whole (on the device, no host read): every rank sees it after the sum. A finite
    one is saturated so that the sum over ranks stays finite too."""
    importance.masked_fill_(~finite, math.nan)
    if out.dtype != torch.float32:
        importance.clamp_(max=torch.finfo(out.dtype).max / world_size)
    out.copy_(importance)


def _clear_segments(state: SegmentSparseState, flat: torch.Tensor, indices: torch.Tensor,
                    segment: int) -> None:
    scratch = state.pool.acquire(indices.numel() * segment, torch.float32, flat.device)
    ops.pack_segments_(flat, indices, segment, out=scratch)
    state.pool.release(scratch)


def _select_next(state: SegmentSparseState, plan_bucket: PlanBucket, importance: torch.Tensor,
                 step: int) -> None:
    """Lagged mode: the segments to send at the next step (``extra["indicator"]``), from the
    agreed importance of what stays held back."""
    k_next = state.segments_to_send(importance.numel(), step + 1)
    indicator = plan_bucket.extra.get("indicator")
    if indicator is None or indicator.numel() != k_next:
        indicator = plan_bucket.extra["indicator"] = torch.empty(
            k_next, dtype=torch.int64, device=importance.device)
    ops.select_segments(importance, k_next, out=indicator)
