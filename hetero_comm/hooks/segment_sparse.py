"""Importance-segment sparse synchronisation with a globally agreed selection.

Each bucket is cut into segments; every rank accumulates what it has not sent yet (error
feedback) and measures each segment's importance (its L2 norm). The ranks agree on one set
of segments, so the packed values are summed by a plain allreduce: no allgather, no index
exchange. :func:`segment_sparse_hook` lists the steps; what varies between settings (what
the segments cut, the wire's number format, what goes into the residual, what the optimizer
is handed) is a part each step calls, in :mod:`._sparse_parts`
and :mod:`._optimizer`.
"""

import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import check_choice, check_float, check_int
from .._layout import num_segments
from ._optimizer import (HandedMomentumCorrectedSum, HandedSign, HandedSum, SIGN_LR_SCALE,
                         momentum_correction_lr_scale)
from ._plan import PlanBucket
from ._large_gradient import LARGE_GRADIENT_WARN_AFTER, GradientEnergyWatch
from ._step_scale import SKETCH_SIZE, StepScale
from ._sparse_parts import (INT8_CLIP_RMS, MIN_SEGMENTS_PER_BUCKET, SEGMENTS, WIRE_DTYPES, WIRES,
                            AgreedNow, add_contribution, int8_levels, restart_sent_velocity)
from . import _codec
from ._codec import CodecBuffers, ExchangePipeline, codec_allreduce
from ._two_phase import TWO_PHASE_LEVELS, add_to_residual, two_phase_int8_sum, two_phase_wire_bytes
from ._state import ErrorFeedbackState, check_state
from .variants import DCT, Basis, resolve_basis, resolve_density

__all__ = ["SegmentSparseState", "segment_sparse_hook", "momentum_correction_lr_scale",
           "int8_levels", "fitting_segment_size", "MIN_SEGMENTS_PER_BUCKET", "SIGN_LR_SCALE",
           "INT8_CLIP_RMS", "WIRE_DTYPES"]

OUTPUTS = ("sum", "sign")
INT8_SUMS = ("auto", "allreduce", "two_phase")
MAX_INT8_ALLREDUCE_RANKS = 63  # int8_levels: 127 // world_size >= 2


def fitting_segment_size(numel: int, segments: int) -> int:
    """The largest power of two that cuts ``numel`` elements into at least ``segments``
    segments (1 when even single elements are too few)."""
    return 1 << max(0, (numel // segments).bit_length() - 1)


class SegmentSparseState(ErrorFeedbackState):
    """State of :func:`segment_sparse_hook`.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        density: fraction of segments sent per step, in (0, 1]; ``k = ceil(density * S)``.
        segment_size: elements per segment, in [1, 2**20]. With ``basis="elements"`` keep
            at least :data:`MIN_SEGMENTS_PER_BUCKET` segments per bucket (a warning says when a
            bucket has fewer): on small models, use smaller segments, or let
            ``min_segments_per_bucket`` pick them.
        min_segments_per_bucket: a bucket that ``segment_size`` cuts into fewer segments than
            this is cut into smaller ones (``basis="dct"``: of fewer blocks): the largest power
            of two no larger than the bucket's size over this, which gives at least this many
            (:meth:`segment_size_for`; each bucket's size follows from its own number of
            elements, so it is the same on every rank and after a resume). 0 (default):
            ``segment_size`` everywhere. The SGD recipe uses :data:`MIN_SEGMENTS_PER_BUCKET`
            (150).
        momentum: momentum correction in [0, 1) (Deep Gradient Compression): the hook keeps a
            velocity ``u = momentum * u + g`` and accumulates ``u``, clearing both for the
            segments it sends. Use it INSTEAD of the optimizer's momentum (set that to 0).
            0 (default) accumulates the gradient itself.
        nesterov: with ``momentum``, accumulate Nesterov's update ``g + momentum * u``
            instead of ``u`` (SGD with ``nesterov=True``); default False.
        density_warmup_steps: after the dense warm-up, the density falls geometrically from 1
            to ``density`` over this many steps (0: start at ``density``), >= 0.
        wire_dtype: dtype of the packed values on the wire: ``"float32"`` (default),
            ``"float16"`` or ``"bfloat16"`` (half the bytes; each rank's rounding error stays
            in its residual, the rounding of the sum on the wire is not fed back), or
            ``"int8"`` (a quarter of the bytes, so about twice the density of bfloat16 at the
            same bytes): every rank rounds a selected segment to the same step, derived from
            the agreed importance, with at most ``127 // world_size`` steps each way, so the
            integer sum cannot overflow and is exact; the rounding and clipping error stays in
            the residual. More than 63 ranks (or ``int8_sum="two_phase"``): see ``int8_sum``.
        basis: ``"elements"`` (default): a segment is ``segment_size`` consecutive gradient
            elements; ``DCT(block_size=64)`` (:class:`~hetero_comm.hooks.DCT`; ``"dct"`` is
            ``DCT()``): each block goes through an orthonormal DCT and a segment is one
            frequency of ``segment_size`` consecutive blocks (at most: a bucket's blocks are
            shared evenly among its groups), so every selected segment touches all their
            elements (momentum correction then clears the velocity's sent coefficients).
        int8_sum: how the int8 wire is summed: ``"allreduce"`` (``127 // world_size`` steps
            a rank, at most 63 ranks), ``"two_phase"`` (127 steps a rank at any number of
            ranks: an all-to-all, each owner's exact sum of its chunk rounded once more to 127
            steps of its own scale, that rounding kept in the owner's residual, and an
            all-gather; :mod:`._two_phase`), or ``"auto"`` (default): the allreduce up to 63
            ranks, the two phases beyond.
        output: ``"sum"`` (default): the bucket becomes the (weighted) sum of what was sent;
            ``"sign"``: its elementwise sign (-1, 0 or 1), a sign step for AdamW with
            ``betas=(0.0, 0.0)`` (it then moves each coordinate by ``lr`` in the direction of
            the agreed sum; the residual plays the momentum's part). See docs/recipes.md.
        scale_sign_step: with ``output="sign"``, size the step as Adam sizes it, from how much
            the ranks' gradients agree at each step (:class:`~._step_scale.StepScale`: a factor
            in (0, 1] on the rate, about 1 while the gradient's signal dominates, smaller once
            it is mostly noise, so that a constant rate does not keep the sign step jittering;
            257 floats more are summed a step). Default False: the AdamW recipe leaves it out,
            as it helped at a constant rate and cost short runs (docs/design/recipes-adamw.md,
            "The step at a constant rate"). Flat DDP only.
        large_gradient_density: while the ranks' summed gradient is large, send at least this
            share of the segments (:class:`~._large_gradient.GradientEnergyWatch`: large while
            a running mean of its squared norm stays above ``1 / large_gradient_fall`` of its
            peak; one norm a bucket and one float summed a step). With ``momentum`` the rate's
            factor stays that of ``density``, as in the density warm-up. 0 (default): off. The
            SGD recipe uses 0.16. Flat DDP only.
        large_gradient_fall: how far (a factor on the squared norm, > 1) the gradient must fall
            from its peak to count as small; default 4.
        rank_weight, warmup_steps, min_compress_numel: see
            :class:`~hetero_comm.hooks.ErrorFeedbackState`.
    """

    _checkpoint_settings = ("density", "segment_size", "min_segments_per_bucket", "momentum", "nesterov", "density_warmup_steps", "basis",
                            "dct_block_size", "scale_sign_step",
                            "large_gradient_density", "large_gradient_fall")

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 density: float = 0.01, segment_size: int = 256,
                 min_segments_per_bucket: int = 0, momentum: float = 0.0, nesterov: bool = False, density_warmup_steps: int = 0,
                 wire_dtype: str = "float32", basis: Basis = "elements", int8_sum: str = "auto",
                 output: str = "sum", scale_sign_step: bool = False,
                 large_gradient_density: float = 0.0, large_gradient_fall: float = 4.0,
                 rank_weight: Optional[float] = None,
                 warmup_steps: int = 1, min_compress_numel: int = 0) -> None:
        self.momentum = check_float("momentum", momentum, 0.0, 0.999)
        if not isinstance(nesterov, bool):
            raise ValueError(f"nesterov must be True or False; got {nesterov!r}")
        if nesterov and not self.momentum:
            raise ValueError("nesterov=True needs momentum > 0 (Nesterov's update adds the "
                             "momentum's look-ahead)")
        self.nesterov = nesterov
        super().__init__(process_group=process_group, rank_weight=rank_weight,
                         warmup_steps=warmup_steps, min_compress_numel=min_compress_numel,
                         plan_tensors=("residual", "momentum") if self.momentum else ("residual",))
        self.density = resolve_density(density, automatic=False)
        self.segment_size = check_int("segment_size", segment_size, 1, 1 << 20)
        self.min_segments_per_bucket = check_int("min_segments_per_bucket", min_segments_per_bucket,
                                                 0, 1 << 20)
        self.density_warmup_steps = check_int("density_warmup_steps", density_warmup_steps, 0)
        self.wire_dtype = check_choice("wire_dtype", wire_dtype, WIRE_DTYPES)
        basis = resolve_basis(basis)
        # kept as plain values (the checkpoint's settings): the basis' name and DCT block
        self.basis = "dct" if isinstance(basis, DCT) else basis
        self.dct_block_size = basis.block_size if isinstance(basis, DCT) else DCT().block_size
        self.output = check_choice("output", output, OUTPUTS)
        if not isinstance(scale_sign_step, bool):
            raise ValueError(f"scale_sign_step must be True or False; got {scale_sign_step!r}")
        if scale_sign_step and self.output != "sign":
            raise ValueError(f"scale_sign_step sizes the sign step of output='sign'; this state "
                             f"has output={output!r} (leave scale_sign_step False)")
        self.scale_sign_step = scale_sign_step
        self.step_scale = StepScale() if scale_sign_step else None
        self.large_gradient_density = check_float("large_gradient_density",
                                                  large_gradient_density, 0.0, 1.0)
        self.large_gradient_fall = check_float("large_gradient_fall", large_gradient_fall, 1.0,
                                               float("inf"), low_open=True)
        self.large_gradient = (GradientEnergyWatch(self.large_gradient_fall)
                               if self.large_gradient_density else None)
        self.int8_sum = check_choice("int8_sum", int8_sum, INT8_SUMS)
        if int8_sum != "auto" and self.wire_dtype != "int8":
            raise ValueError(f"int8_sum={int8_sum!r} says how the int8 wire is summed; this "
                             f"state's wire is {self.wire_dtype} (wire_dtype='int8', or leave "
                             f"int8_sum='auto')")
        if self.wire_dtype == "int8" and dist.is_initialized():
            self.int8_levels()  # a clear error now rather than at the first step
        self._warned_coarse_segments = False
        self._warned_large_gradient = False
        self._log_settings()

    def _start_process_parts(self) -> None:
        """:meth:`ErrorFeedbackState._start_process_parts` plus each bucket's codec buffers
        and the agreements in flight."""
        super()._start_process_parts()
        self.codecs = CodecBuffers()
        self._costly_buckets: dict = {}  # this step's buckets that sent >= dense: index -> values
        self._warned_costly_buckets = False
        self._pipeline = ExchangePipeline(self)  # the CPU's buckets in flight

    def __getstate__(self) -> dict:
        """:meth:`ErrorFeedbackState.__getstate__`; the coarse-segment warning and the codec
        buffers are per process."""
        state = super().__getstate__()
        state.pop("_warned_coarse_segments", None)
        del state["codecs"], state["_pipeline"]
        del state["_costly_buckets"], state["_warned_costly_buckets"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._warned_coarse_segments = False
        self.__dict__.setdefault("_warned_large_gradient", False)
        self.__dict__.setdefault("nesterov", False)  # pickled before the setting existed
        self.__dict__.setdefault("int8_sum", "auto")
        self.__dict__.setdefault("scale_sign_step", False)
        self.__dict__.setdefault("step_scale", None)
        self.__dict__.setdefault("large_gradient_density", 0.0)
        self.__dict__.setdefault("large_gradient_fall", 4.0)
        self.__dict__.setdefault("large_gradient", None)

    def settings(self) -> dict:
        return dict(density=self.density, segment_size=self.segment_size,
                    min_segments_per_bucket=self.min_segments_per_bucket,
                    momentum=self.momentum, nesterov=self.nesterov,
                    density_warmup_steps=self.density_warmup_steps, wire_dtype=self.wire_dtype,
                    basis=self.basis_setting(), int8_sum=self.int8_sum, output=self.output,
                    scale_sign_step=self.scale_sign_step,
                    large_gradient_density=self.large_gradient_density,
                    large_gradient_fall=self.large_gradient_fall, **super().settings())

    def stats(self) -> dict:
        """:meth:`ErrorFeedbackState.stats`, plus the share of the segments the last step sent
        (``density``: 1 in the dense warm-up, then falling over ``density_warmup_steps`` to the
        setting, or ``large_gradient_density`` while the gradient is large), with
        ``large_gradient_density`` whether the last step counted the gradient as large
        (``large_gradient``) and how many steps did (``large_gradient_steps``), and with
        ``scale_sign_step`` the factor the last step took on the recipe's rate
        (``sign_step_scale``, in (0, 1])."""
        stats = super().stats()
        watch = self.large_gradient
        stats["density"] = self.density_at(max(self.step - 1, 0),
                                           watch is not None and watch.large_last_step)
        if watch is not None:
            stats["large_gradient"] = watch.large_last_step
            stats["large_gradient_steps"] = watch.large_steps
        if self.step_scale is not None:
            stats["sign_step_scale"] = self.step_scale.applied
        return stats

    def state_dict(self) -> dict:
        """:meth:`ErrorFeedbackState.state_dict` (a collective), plus the step scale's and the
        gradient watch's running means (the same on every rank)."""
        saved = dict(step_scale=self.step_scale.state_dict()) if self.step_scale else {}
        if self.large_gradient is not None:
            saved["large_gradient"] = self.large_gradient.state_dict()
        return dict(super().state_dict(), **saved)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.step_scale is not None and "step_scale" in state_dict:
            self.step_scale.load_state_dict(state_dict["step_scale"])
        if self.large_gradient is not None:
            self.large_gradient.load_state_dict(state_dict["large_gradient"])

    def agreed_constants(self) -> dict:
        """:meth:`HookState.agreed_constants`: how many values consecutive buckets gather
        before their exchange on the CPU (:data:`._codec.FUSE_BELOW_NUMEL`), and with
        ``scale_sign_step`` the size of the step scale's allreduce."""
        constants = dict(fuse_below_numel=_codec.FUSE_BELOW_NUMEL)
        if self.step_scale is not None:
            constants["step_scale_sketch_size"] = SKETCH_SIZE
        return constants

    # ---------------------------------------------------------------- the pipelined agreement
    def pipelines_agreement(self, grad: torch.Tensor) -> bool:
        """Whether buckets go through the codec with their agreement pipelined: on the CPU,
        where waiting for the importance's sum would stop the backward pass for a round trip
        per bucket (on a GPU the wait is the stream's, not the host's)."""
        return grad.is_cpu and not self.non_finite.device_checks.on_device(grad.device)

    def run(self, bucket: dist.GradBucket, send) -> torch.futures.Future[torch.Tensor]:
        """:meth:`ErrorFeedbackState.run`. On the CPU the codec sends the bucket
        (:func:`._codec.codec_allreduce`) with its agreement pipelined
        (:class:`._codec.ExchangePipeline`): consecutive small buckets are grouped, a group's
        importance sum is issued, then the previous group's is read, its segments packed and
        its wire issued (at the step's last bucket, everything). Every rank issues the
        collectives in that one order, and the backward pass computes the next buckets while
        an agreement makes its round trip. The future completes when the bucket's sum has
        been delivered into it. With ``scale_sign_step`` a plan bucket's own gradient first goes
        into the step's sketch where it is the step's to sketch, and the step's sums are
        issued after its last bucket."""
        last = bucket.is_last()
        if not self.pipelines_agreement(bucket.buffer()):
            try:
                return super().run(bucket, self._sketched(self._watched(send)))
            finally:
                if last:
                    self._end_step_scale(bucket.buffer().device)
                    self._warn_costly_buckets()
                    self._warn_large_gradient()
        pipeline = self._pipeline
        if bucket.index() == 0 and pipeline.pending():  # DDP hands bucket 0 over first
            pipeline.discard()
        earlier = len(pipeline.issued)
        try:
            return super().run(bucket, self._sketched(self._watched(self._send_pipelined)))
        finally:  # the groups issued before this bucket; at the step's last bucket, all
            if last:
                pipeline.end_step()
                self._end_step_scale(bucket.buffer().device)
                self._warn_costly_buckets()
                self._warn_large_gradient()
            else:
                pipeline.finish(earlier)
                pipeline.deliver(wait=False)

    def _sketched(self, send):
        """``send``, first adding to the step scale's sketch the plan bucket whose turn it is
        (by its place in the plan, which a checkpoint keeps: a resumed run sketches what the
        uninterrupted run did, whatever DDP's bucket layout)."""
        if self.step_scale is None:
            return send

        def sketched_send(state, plan_bucket: PlanBucket, grad: torch.Tensor, index: int):
            position = self.step_scale.turn_among(len(self.plan.buckets))
            if plan_bucket.origin is self.plan.buckets[position]:
                self.step_scale.observe(grad, position)
            return send(state, plan_bucket, grad, index)

        return sketched_send

    def _watched(self, send):
        """``send``, first noting each compressed bucket's gradient norm where
        ``large_gradient_density`` is set."""
        if self.large_gradient is None:
            return send

        def watched_send(state, plan_bucket: PlanBucket, grad: torch.Tensor, index: int):
            self.large_gradient.observe(grad)
            return send(state, plan_bucket, grad, index)

        return watched_send

    def _warn_large_gradient(self) -> None:
        """Warn once when the gradient still counts as large
        :data:`LARGE_GRADIENT_WARN_AFTER` steps past the density warm-up."""
        watch = self.large_gradient
        if (watch is None or not watch.large or self._warned_large_gradient
                or self.step < self.warmup_steps + self.density_warmup_steps + LARGE_GRADIENT_WARN_AFTER):
            return
        self._warned_large_gradient = True
        warnings.warn(f"hetero_comm: after {self.step} steps the gradient is still large (a "
                      f"running mean of its squared norm above 1/{self.large_gradient_fall:g} of "
                      f"its peak), so each step sends {self.large_gradient_density:.0%} of the "
                      f"segments instead of {self.density:.0%} while it stays so: less "
                      f"compression, kept where the smaller share fell behind dense training "
                      f"(docs/design/one-call.md, 'A higher density while the gradient is "
                      f"large'). stats() has 'large_gradient_steps' and the "
                      f"'compression_ratio' reached; this warning is given once",
                      UserWarning, stacklevel=2)

    def _end_step_scale(self, device: torch.device) -> None:
        """After a step's last bucket: the step scale's and the gradient watch's sums (every
        rank in this order)."""
        if self.step_scale is not None:
            self.step_scale.end_step(self.process_group, device)
        if self.large_gradient is not None:
            self.large_gradient.end_step(self.process_group)

    def count_exchange(self, index: int, numel: int, dense_bytes: int, sent_bytes: int,
                       step: Optional[int] = None) -> None:
        """Count one compressed exchange's bytes; note a bucket that sent at least what its
        dense allreduce would (once the density has reached its setting at ``step``, the
        bucket's; default the current step)."""
        self.statistics.count_bytes(dense_bytes, sent_bytes, True)
        step = self.step if step is None else step
        if 0 < dense_bytes <= sent_bytes and self.density_at(step) <= self.density:
            self._costly_buckets[index] = max(numel, self._costly_buckets.get(index, 0))

    def take_costly_buckets(self) -> dict:
        """The buckets of the step just ended that sent at least their dense bytes (index ->
        values; empty once a warning about them was given), forgotten here."""
        costly, self._costly_buckets = self._costly_buckets, {}
        if self._warned_costly_buckets:
            return {}
        self._warned_costly_buckets = bool(costly)
        return costly

    def _warn_costly_buckets(self) -> None:
        """At a step's end: warn (once per state) about the buckets that sent more than they
        saved, and say what to do."""
        costly = self.take_costly_buckets()
        if not costly:
            return
        listed = ", ".join(f"{index} ({numel} values)" for index, numel in sorted(costly.items())[:5])
        more = f" and {len(costly) - 5} more" if len(costly) > 5 else ""
        warnings.warn(
            f"segment_sparse_hook: bucket(s) {listed}{more} sent at least the bytes a dense "
            f"allreduce would (stats()['compression_ratio'] counts them): a bucket this small "
            f"spends on the importance (4 bytes a segment) what the selection saves. Send such "
            f"buckets dense (min_compress_numel={max(costly.values()) + 1}) or give DDP larger "
            f"buckets (bucket_cap_mb)", UserWarning, stacklevel=2)


    def _send_pipelined(self, state, plan_bucket, grad: torch.Tensor,
                        index: int) -> torch.futures.Future:
        return codec_allreduce(state, plan_bucket, grad, index, pipeline=self._pipeline)

    def basis_setting(self) -> Basis:
        """The ``basis`` as the constructor takes it: ``"elements"`` or a :class:`DCT`."""
        return DCT(self.dct_block_size) if self.basis == "dct" else self.basis

    def exchange_group(self) -> Optional[dist.ProcessGroup]:
        """The group the compressed values are summed in (the two-level sync: this rank's
        rail, one rank per machine)."""
        return self.process_group

    def exchange_size(self) -> int:
        """How many contributions that sum adds up (the int8 wire's levels follow from it)."""
        return self.world_size()

    def sums_in_two_phases(self) -> bool:
        """Whether the int8 wire is summed in two phases (``int8_sum``; ``"auto"``: beyond the
        ranks an int8 allreduce can sum)."""
        if self.wire_dtype != "int8" or self.int8_sum == "allreduce":
            return False
        return self.int8_sum == "two_phase" or self.exchange_size() > MAX_INT8_ALLREDUCE_RANKS

    def int8_levels(self) -> int:
        """Steps each way a rank rounds to on the int8 wire: :data:`TWO_PHASE_LEVELS` when it
        is summed in two phases, else :func:`int8_levels` of the ranks (``ValueError`` beyond
        63 ranks)."""
        if self.sums_in_two_phases():
            return TWO_PHASE_LEVELS
        return int8_levels(self.exchange_size())

    def contribution_weight(self) -> float:
        """The factor on the gradient this rank adds to its residual (the two-level sync
        weights before summing inside the machine, so 1 there)."""
        return self.weight()

    def handed_step(self) -> HandedSum:
        """What the hook hands the optimizer (see :meth:`prepare_optimizer`)."""
        if self.output == "sign":
            return HandedSign(None if self.step_scale is None else self.step_scale.factor_for)
        if self.momentum:
            return HandedMomentumCorrectedSum(self.momentum, self.density, self.nesterov)
        return HandedSum()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          lr_scale: Optional[float] = None) -> torch.optim.Optimizer:
        """Fit ``optimizer``, set up as for dense training, to this hook's output, keeping the
        user's learning rate and schedule (the mechanism and its guarantees:
        :meth:`HookState.prepare_optimizer`):

        * ``output="sign"``: AdamW, or Adam without weight decay or with
          ``decoupled_weight_decay=True``. Sets ``betas=(0.0, 0.0)`` (the step becomes
          ``lr`` times the agreed sign, with AdamW's decoupled weight decay) and steps at
          ``lr_scale`` times the rate, default :data:`SIGN_LR_SCALE` (1.5), and the weight
          decay divided by ``lr_scale`` (dense's decay, ``lr * weight_decay``).
        * ``momentum`` > 0 (momentum correction): SGD whose momentum is 0 or this state's,
          without Nesterov or dampening. Sets its momentum to 0 (the hook applies it) and
          steps at ``lr_scale`` times the rate, default :func:`momentum_correction_lr_scale`
          of the density and momentum (2.1 at 8% and 0.9: clearing the velocity of sent
          segments loses about half of each step), and the weight decay times
          ``1 / ((1 - momentum) * lr_scale)`` (dense momentum SGD's decay, which its momentum
          sums to ``1 / (1 - momentum)`` times itself).
        * otherwise (``output="sum"``): any optimizer, unchanged (``lr_scale`` default 1).
        """
        return super().prepare_optimizer(optimizer, lr_scale)

    def segment_size_for(self, numel: int) -> int:
        """Elements per segment (``basis="dct"``: blocks per segment) in a bucket, or the part
        of one a plan bucket holds, of ``numel`` elements: ``segment_size``, or with
        ``min_segments_per_bucket`` the power of two :func:`fitting_segment_size` gives when
        ``segment_size`` leaves fewer segments than that (1 when even that gives too few).
        ``basis="dct"``: that size sets the number of groups of blocks, and the blocks are then
        shared out evenly among them (``ceil(blocks / groups)`` each), so that padding the
        last group wastes fewer than ``groups`` blocks."""
        if self.basis != "dct":
            return self._fitted_size(numel, num_segments(numel, self.segment_size))
        # a segment: one frequency of ``size`` blocks; the groups then evened out so that the
        # last one is not mostly padding (a 600-block bucket: 2 groups of 300, not of 512)
        blocks = num_segments(numel, self.dct_block_size)
        count = num_segments(blocks, self.segment_size) * self.dct_block_size
        size = self._fitted_size(blocks * self.dct_block_size, count)
        return num_segments(blocks, num_segments(blocks, size)) if blocks else size

    def _fitted_size(self, numel: int, count: int) -> int:
        """``segment_size``, or a smaller power of two where ``count`` segments are fewer
        than ``min_segments_per_bucket``."""
        minimum = self.min_segments_per_bucket
        if not minimum or count >= minimum:
            return self.segment_size
        return min(self.segment_size, fitting_segment_size(numel, minimum))

    def warn_coarse_segments(self, index: int, numel: int, segment: int, count: int) -> None:
        """Warn (once per state) that ``numel`` elements of bucket ``index`` (all of it, or the
        part one plan bucket holds) make ``count`` < :data:`MIN_SEGMENTS_PER_BUCKET` segments
        of ``segment``."""
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

    def density_at(self, step: int, large_gradient: bool = False) -> float:
        """The density used at ``step`` (1 during the dense warm-up; at least
        ``large_gradient_density`` where ``large_gradient``)."""
        if large_gradient and self.large_gradient_density:
            return max(self.density_at(step), self.large_gradient_density)
        ramp = step - self.warmup_steps
        if ramp < 0:
            return 1.0
        if ramp >= self.density_warmup_steps:
            return self.density
        return self.density ** ((ramp + 1) / (self.density_warmup_steps + 1))

    def segments_to_send(self, segments: int, step: int) -> int:
        """``k = ceil(density * S)`` at ``step`` (at least 1 for a non-empty bucket)."""
        large = self.large_gradient is not None and self.large_gradient.large
        return min(segments, max(1, math.ceil(self.density_at(step, large) * segments - 1e-9)))


def segment_sparse_hook(state: SegmentSparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Send the most important segments of each bucket, with error feedback.

    Per bucket (flattened gradient ``g`` of ``n`` elements, ``S = ceil(n / s)`` segments of
    ``s = state.segment_size_for(n)`` elements, ``k = ceil(density * S)``), after
    ``warmup_steps`` dense steps (the steps are :func:`sparse_allreduce`, top to bottom):

    1. ``residual += w * g`` (or the momentum-corrected velocity) and the L2 norm of every
       segment of the residual, in one pass (:func:`hetero_comm.ops.segment_accumulate_`).
    2. Select the same ``k`` segments on every rank: allreduce the importance vector (S
       float32) and take its top ``k`` (:func:`hetero_comm.ops.select_segments`).
    3. Pack those segments and zero them in the residual, which keeps whatever the wire dtype
       cannot represent (:func:`hetero_comm.ops.pack_segments_`). int8: each segment is
       rounded to integers in a step shared by all ranks, and the rounding and clipping error
       stays in the residual, in the same pass (:func:`hetero_comm.ops.pack_quantized_segments_`,
       see :class:`~._sparse_parts.IntegerWire`).
    4. Allreduce (sum) the packed values; every rank sent the same segments, so the sum is
       ``sum_i w_i * residual_i`` there.
    5. Scatter the sum into the bucket, zeros elsewhere
       (:func:`hetero_comm.ops.unpack_segments`).

    With ``basis="dct"`` the segments are cut from the residual's interleaved DCT
    coefficients (step 1 transforms the residual, step 3 transforms what was not sent back
    into it, step 5 inverts the transform of the sum). With ``output="sign"`` step 5 keeps
    only the sign of the result.

    Args:
        state: a :class:`SegmentSparseState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the sparse weighted sum.

    A NaN or infinity in the bucket on any rank: the bucket is handed on holding NaN on
    every rank (CPU: all of it; CUDA: its first element, set on the device), as DDP's
    allreduce would hand on the sum, so a ``torch.amp.GradScaler`` skips the step; its error
    feedback restarts from zero, ``stats()["non_finite_buckets"]`` counts it and the first
    one warns (``RuntimeWarning``).

    Example::

        >>> state = SegmentSparseState(density=0.01, segment_size=256)
        >>> ddp_model.register_comm_hook(state, segment_sparse_hook)
    """
    check_state(state, SegmentSparseState, "segment_sparse_hook")
    return state.run(bucket, sparse_allreduce)


def sparse_allreduce(state: SegmentSparseState, plan_bucket: PlanBucket, grad: torch.Tensor,
                      index: int) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-5 of :func:`segment_sparse_hook` for ``grad``, laid out like ``plan_bucket``:
    on the CPU by the codec's kernels (:func:`._codec.codec_allreduce`), on a GPU part by part."""
    if not state.non_finite.device_checks.on_device(grad.device):
        return codec_allreduce(state, plan_bucket, grad, index)
    step, pool, device = state.step, state.pool, grad.device
    wire_format_class = WIRES[state.wire_dtype]
    if state.wire_dtype == "int8":
        state.int8_levels()  # too many ranks for the allreduce raise before anything is written
    segments = SEGMENTS[state.basis](state, plan_bucket.tensors["residual"], grad)
    k = state.segments_to_send(segments.count, step)
    segments.warn_if_coarse(state, index, k)
    # 1. Accumulate.
    importance = pool.acquire(segments.count, torch.float32, device)
    with state.statistics.timer("encode_seconds"):
        segments.accumulate(add_contribution(state, plan_bucket, grad), importance)
    # 2. Select.
    selected = AgreedNow(state, plan_bucket, importance, k, index, segments)
    # 3. Pack: the selected segments onto the wire, the rest kept in the residual.
    wire = pool.acquire(k * segments.segment, WIRE_DTYPES[state.wire_dtype], device)
    wire_format = wire_format_class(state, importance, selected, segments)
    with state.statistics.timer("encode_seconds"):
        wire_format.pack_(segments, wire)
        segments.keep_unsent()
        restart_sent_velocity(state, plan_bucket, selected.indices, segments)
        state.non_finite.drop_unless(selected.finite, wire)  # CUDA, non-finite: zeros on the wire
    two_phase = state.sums_in_two_phases()
    wire_bytes = (two_phase_wire_bytes(k, segments.segment, state.exchange_size()) if two_phase
                  else wire.numel() * wire.element_size())
    state.count_exchange(index, grad.numel(), grad.numel() * grad.element_size(),
                         wire_bytes + selected.importance_bytes_per_segment * segments.count)
    # 4. Allreduce (or the int8 wire's two phases, waited for: what the owner's rounding
    # dropped goes into its residual now).
    summed = None
    if two_phase:
        summed = two_phase_int8_sum(wire, wire_format.scale, segments.segment, state.exchange_group())
        add_to_residual(segments.residual, summed.error, selected.indices[summed.owned],
                        segments.segment, *segments.scratch_for_residual())
        work = _Done()
    else:
        work = dist.all_reduce(wire, group=state.exchange_group(), async_op=True)
    handed = state.handed_step()

    # 5. Unpack.
    def unpack() -> torch.Tensor:
        with state.statistics.timer("decode_seconds"):
            to_release = ((importance, wire) + selected.buffers + segments.buffers
                          + wire_format.buffers)
            decoded = (wire_format.decode(wire) if summed is None
                       else wire_format.decode(summed.wire, summed.scale))
            segments.deliver(decoded, selected.indices, grad)
            handed.finish(grad)
            state.non_finite.nan_unless(selected.finite, grad)  # CUDA: a non-finite bucket handed on as NaN
            state.callbacks.release(to_release, device)  # CUDA: after this stream's work
        return grad

    return selected.finish(work, unpack)


class _Done:
    """A collective's work that has completed (the two-phase sum, waited for in place)."""

    @staticmethod
    def get_future() -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future
