"""Two-level sync for machines of several ranks: a dense sum inside each machine, the
compressed recipe between machines, the result spread inside the machine.

Every local rank carries its own share of each bucket between machines (so every machine's
links work in parallel), with its own error feedback for that share; the compressed exchange
of a share is the sparse hook's own steps (:func:`~.segment_sparse.sparse_allreduce`), run in
the share's *rail*: the ranks of equal local index, one per machine. The work runs on one
exchange thread per rank, bucket after bucket, so the backward pass goes on while buckets
travel and every group's collectives are issued in the same order on every rank.
"""

import functools
import math
import time
from typing import Optional, Union

import torch
import torch.distributed as dist

from .._checks import check_choice
from .._collectives import all_gather_single, reduce_scatter_single
from .._layout import GRADIENT_DTYPES
from ._auto_density import DensityController
from ._machines import MachineLayout, MachinesArgument
from ._optimizer import HandedMomentumCorrectedSum, HandedSum
from ._plan import PlanBucket
from ._sparse_parts import WIRE_DTYPES
from ._non_finite import DeviceFiniteChecks, NonFiniteGradient
from ._exchange_thread import ExchangeThread
from ._state import ErrorFeedbackState, check_state
from .segment_sparse import SegmentSparseState, sparse_allreduce
from .variants import AutoDensity, Density, resolve_density

__all__ = ["TwoLevelState", "two_level_hook", "INSIDE_DTYPES"]

INSIDE_DTYPES = {None: None, "bfloat16": torch.bfloat16}
# plan_bucket.extra: the share layout its error feedback is gathered for (see _gather_held_back)
SHARES_KEY = "two_level_shares"


class _HostFiniteChecks(DeviceFiniteChecks):
    """The exchange thread may wait on the device: non-finite values are found at once on
    every device (no flag carried to a later step)."""

    def on_device(self, device: torch.device) -> bool:
        return False


class Shares:
    """How a bucket of ``numel`` elements is cut into ``local_size`` shares of whole
    ``unit``-element pieces (the last shares may be shorter or empty), and where this rank's
    share lies: ``[start, stop)``. Staged for the collectives, each share gets a slot of
    ``share + 1`` elements, the last one a flag."""

    def __init__(self, numel: int, local_size: int, local_rank: int, unit: int) -> None:
        self.numel, self.local_size, self.unit = numel, local_size, unit
        self.share = math.ceil(math.ceil(numel / unit) / local_size) * unit
        self.slot = self.share + 1
        self.start = min(local_rank * self.share, numel)
        self.stop = min(self.start + self.share, numel)
        self.key = (numel, local_size, unit)  # the same on every rank

    def stage(self, flat: torch.Tensor, staged: torch.Tensor, weight: float) -> None:
        """``weight * flat`` into the share slots of ``staged``; the padding and flags zero."""
        slots = staged.view(self.local_size, self.slot)
        for j in range(self.local_size):
            start, stop = min(j * self.share, self.numel), min((j + 1) * self.share, self.numel)
            torch.mul(flat[start:stop], weight, out=slots[j, :stop - start])
            slots[j, stop - start:].zero_()

    def unstage(self, staged: torch.Tensor, flat: torch.Tensor) -> None:
        slots = staged.view(self.local_size, self.slot)
        for j in range(self.local_size):
            start, stop = min(j * self.share, self.numel), min((j + 1) * self.share, self.numel)
            flat[start:stop].copy_(slots[j, :stop - start])

    def flags(self, staged: torch.Tensor) -> torch.Tensor:
        return staged.view(self.local_size, self.slot)[:, -1]


class _ShareOfPlanBucket(PlanBucket):
    """This rank's share of a plan bucket's error feedback (views into it)."""

    def __init__(self, whole: PlanBucket, start: int, stop: int) -> None:
        super().__init__(("share",), (stop - start,))
        self.whole = whole
        self.tensors = {name: tensor[start:stop] for name, tensor in whole.tensors.items()}
        self.extra = whole.extra

    @property
    def origin(self) -> PlanBucket:
        return self.whole.origin

    def reset(self) -> None:
        self.whole.reset()


class TwoLevelState(SegmentSparseState):
    """State of :func:`two_level_hook`. A collective to build: every rank of the process
    group builds it, in the same order (it creates each machine's and each rail's group).

    Args:
        process_group: the DDP model's group (``None``: the default group).
        machines: which ranks share a machine (see :meth:`MachineLayout.resolve`): ``"auto"``
            (default: the launcher's ``LOCAL_WORLD_SIZE``, else host names), ranks per
            machine (an int, consecutive ranks together), or one machine label per rank.
            Every machine must hold the same number of ranks.
        inside_dtype: ``None`` (default): the sums inside a machine are in the gradient's
            dtype; ``"bfloat16"``: half the bytes there (that rounding is not fed back).
        density: the fraction of segments sent per step, as for
            :class:`SegmentSparseState` (default 0.10), or an
            :class:`~hetero_comm.hooks.AutoDensity` (``"auto"``: ``AutoDensity()``): chosen
            each step within its floor and ceiling so that the exchange between machines hides
            behind the backward pass (:mod:`._auto_density`), starting at the ceiling.
        **settings: the other settings of :class:`SegmentSparseState` (segments, basis,
            wire, output, momentum, rank weight, warm-up).

    Each share goes through the sparse hook's steps with this state's settings, summed over
    one rank per machine (so the int8 wire's levels follow from the number of machines; beyond
    63 machines it is summed in two phases, see ``int8_sum``); a bucket whose share sends at
    least its dense bytes between machines is warned of once, naming the bucket's size, as the
    flat hook warns. :meth:`dense` builds the two-level sum without compression.

    Raises:
        ValueError: a machine layout that does not cover the ranks, machines of unequal rank
            counts, or any bad setting.
    """

    device_finite_checks = _HostFiniteChecks  # the exchange thread finds non-finite values at once

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 machines: MachinesArgument = "auto", inside_dtype: Optional[str] = None,
                 density: Density = 0.10, **settings) -> None:
        self._build(process_group, machines, "sparse", inside_dtype,
                    resolve_density(density, automatic=True), settings)

    @classmethod
    def dense(cls, *, process_group: Optional[dist.ProcessGroup] = None,
              machines: MachinesArgument = "auto", inside_dtype: Optional[str] = None,
              rank_weight: Optional[float] = None, warmup_steps: int = 1,
              min_compress_numel: int = 0) -> "TwoLevelState":
        """The two-level sum without compression: each share is allreduced between machines
        as it is (the settings as for the constructor; nothing of the sparse exchange)."""
        state = cls.__new__(cls)
        state._build(process_group, machines, "dense", inside_dtype, 0.10,
                     dict(rank_weight=rank_weight, warmup_steps=warmup_steps,
                          min_compress_numel=min_compress_numel))
        return state

    def _build(self, process_group, machines, between_machines: str, inside_dtype,
               density: Union[float, AutoDensity], settings: dict) -> None:
        check_choice("inside_dtype", inside_dtype, INSIDE_DTYPES)
        if settings.get("scale_sign_step"):
            raise ValueError("scale_sign_step is not offered on the two-level sync yet (its "
                             "exchange runs on a thread of its own): leave it False")
        if settings.get("large_gradient_density"):
            raise ValueError("large_gradient_density is not offered on the two-level sync yet "
                             "(its exchange runs on a thread of its own): leave it 0")
        controller = None
        if isinstance(density, AutoDensity):  # (its bad settings raise before any group is made)
            wire = WIRE_DTYPES[check_choice("wire_dtype", settings.get("wire_dtype", "float32"),
                                            WIRE_DTYPES)]
            controller = DensityController(density, wire.itemsize,
                                           settings.get("segment_size", 256))
        self.layout = MachineLayout.resolve(machines, process_group)
        self.groups = self.layout.groups(process_group)
        if controller is not None:  # the least seconds are taken within each rail
            controller.rail, controller.rails = self.groups.local_rank, self.groups.local_size
        self.between_machines = between_machines
        self.inside_dtype = inside_dtype
        self.auto_density = controller
        super().__init__(process_group=process_group,
                         density=controller.ceiling if controller else density, **settings)
        self._exchanges = ExchangeThread()
        self._step_began: Optional[float] = None  # the first bucket of the step in flight
        self._result_at: Optional[float] = None  # when the last step's result was ready
        self.statistics.add_counter("bytes_inside_machines")
        self.last_step_density = self.density  # what the optimizer's step follows

    def _start_process_parts(self) -> None:
        """:meth:`SegmentSparseState._start_process_parts` plus the size of each bucket whose
        shares the step in flight exchanged (index -> values)."""
        super()._start_process_parts()
        self._exchanged_numels: dict = {}

    _checkpoint_settings = tuple(name for name in SegmentSparseState._checkpoint_settings
                                 if name != "density") + ("between_machines", "inside_dtype")

    def settings(self) -> dict:
        extra = dict(machines=repr(self.layout), between_machines=self.between_machines,
                     inside_dtype=self.inside_dtype)
        if self.auto_density is not None:
            extra.update(density=AutoDensity(self.auto_density.floor, self.auto_density.ceiling))
        return dict(super().settings(), **extra)

    # ------------------------------------------------------------- the exchange's group
    def exchange_group(self) -> Optional[dist.ProcessGroup]:
        return self.groups.rail

    def exchange_size(self) -> int:
        return self.groups.machines

    def contribution_weight(self) -> float:
        return 1.0  # the rank weight is applied before the sum inside the machine

    def handed_step(self) -> HandedSum:
        """As :meth:`SegmentSparseState.handed_step`; with ``density="auto"`` and momentum
        correction, the learning-rate factor follows the density each step ran at; with
        ``between_machines="dense"``, the plain sum (which any optimizer takes as it is)."""
        if self.between_machines == "dense":
            return HandedSum()  # the exchange hands the plain sum, whatever the sparse settings
        handed = super().handed_step()
        if self.auto_density is not None and isinstance(handed, HandedMomentumCorrectedSum):
            return HandedMomentumCorrectedSum(self.momentum, lambda: self.last_step_density,
                                              self.nesterov)
        return handed

    def shares_of(self, numel: int) -> Shares:
        """The share layout of a bucket of ``numel`` elements: whole segments (DCT basis:
        whole blocks; each share then evens out its own groups) per share."""
        unit = self.dct_block_size if self.basis == "dct" else self.segment_size
        return Shares(numel, self.groups.local_size, self.groups.local_rank, unit)

    # ----------------------------------------------------------------------- running
    def accepts(self, dtype: torch.dtype) -> bool:
        """Gradient dtypes: those of the sparse hook; float64 too between machines dense."""
        return dtype in GRADIENT_DTYPES or (self.between_machines == "dense" and dtype == torch.float64)

    def run(self, bucket: dist.GradBucket, send) -> torch.futures.Future[torch.Tensor]:
        """Hand the bucket to the exchange thread, which runs
        :meth:`ErrorFeedbackState.run` on it (so the step count, the density and the error
        feedback change on that thread only, in bucket order); a step's first bucket first
        waits for the previous step's end there."""
        if self.groups is None:
            raise RuntimeError("this TwoLevelState was unpickled, which drops its process "
                               "groups: build a new one and load_state_dict into it")
        self.agree_settings()  # here, so that ranks that differ raise from the hook itself
        now = time.perf_counter()
        if self._step_began is None:
            self._exchanges.wait_idle()
            self._step_began = now
        timing = None  # the last bucket: (backward window, compute since the last result)
        if bucket.is_last():
            timing = (now - self._step_began, now - (self._result_at or self._step_began))
            self._step_began = None
        base_run = functools.partial(ErrorFeedbackState.run, self)

        def job() -> torch.Tensor:
            result = base_run(bucket, send).wait()
            if timing is not None:
                self._end_step(*timing)
                self._result_at = time.perf_counter()
            return result

        return self._exchanges.submit(job)

    def _end_step(self, window_seconds: float, compute_seconds: float) -> None:
        """On the exchange thread, after a step's last bucket: the automatic density, then the
        warning about buckets that sent at least their dense bytes (after the agreement, which
        every rank must join even where warnings raise)."""
        self.last_step_density = self.density
        if self.auto_density is not None:
            proposal = self.auto_density.propose(window_seconds, compute_seconds, self.density)
            agreed = self.auto_density.agree(proposal, self.groups.control)
            if agreed is not None:
                self.density = agreed
        self._warn_costly_buckets()

    def exchange_share(self, plan_bucket: PlanBucket, shares: Shares, values: torch.Tensor,
                       index: int) -> bool:
        """Step 2 of :func:`two_level_hook`: sum this rank's share ``values`` (non-empty,
        in place) over its rail; ``True`` if it held a non-finite value (then zeros)."""
        self._exchanged_numels[index] = max(shares.numel, self._exchanged_numels.get(index, 0))
        return _exchange_share(self, plan_bucket, shares, values, index)

    def take_costly_buckets(self) -> dict:
        """:meth:`SegmentSparseState.take_costly_buckets` with each bucket's whole size, which
        ``min_compress_numel`` compares, in place of the size of this rank's share."""
        numels, self._exchanged_numels = self._exchanged_numels, {}
        return {index: numels.get(index, numel)
                for index, numel in super().take_costly_buckets().items()}

    def wait(self) -> None:
        """Wait until the exchange thread has finished every bucket handed to it."""
        self._exchanges.wait_idle()

    # ------------------------------------------------------- statistics and checkpoints
    def stats(self) -> dict:
        """:meth:`SegmentSparseState.stats` (waiting for the exchange thread first), where
        ``bytes_sent`` counts the bytes this rank handed to collectives between machines
        (and to the dense warm-up), ``compression_ratio`` is the bytes a flat dense allreduce
        would hand per rank over those, plus ``bytes_inside_machines`` (handed to the
        collectives inside the machine), ``density`` (the current one) and, with
        ``density="auto"``, ``auto_density``: the last step's measurements (backward window,
        compute, link and codec seconds, bytes sent, the bandwidth the link was shown to carry
        at least and at most, the seconds it waited for the agreement in flight) and its
        proposal (agreed on every 4th step)."""
        self.wait()
        stats = dict(super().stats(), density=self.density)
        if self.auto_density is not None and self.auto_density.history:
            stats["auto_density"] = dict(self.auto_density.history[-1])
        return stats

    def state_dict(self) -> dict:
        """:meth:`ErrorFeedbackState.state_dict` plus the current density and the automatic
        density's state (a collective, as there)."""
        self.wait()
        saved = dict(super().state_dict(), density=self.density)
        if self.auto_density is not None:
            saved["auto_density"] = self.auto_density.state_dict()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`; the error feedback is gathered onto each share
        owner at the first step (exact when the layout is the same, lossless when not)."""
        self.wait()
        super().load_state_dict(state_dict)
        if (self.auto_density is None) != ("auto_density" not in state_dict):
            raise ValueError("state_dict was saved with another density setting ('auto' or fixed)")
        if self.auto_density is not None:
            self.auto_density.load_state_dict(state_dict["auto_density"])
            self.density = float(state_dict["density"])
        elif state_dict["density"] != self.density:
            raise ValueError(f"state_dict was saved with density={state_dict['density']!r}; this "
                             f"state has density={self.density!r}")
        for plan_bucket in self.plan.buckets:
            plan_bucket.extra.pop(SHARES_KEY, None)

    def __getstate__(self) -> dict:
        """:meth:`ErrorFeedbackState.__getstate__` without the groups and the thread."""
        self.wait()
        state = super().__getstate__()
        state["groups"], state["_exchanges"] = None, None
        del state["_exchanged_numels"]
        state["_step_began"], state["_result_at"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._exchanges = ExchangeThread()


def two_level_hook(state: TwoLevelState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Sum inside each machine, exchange compressed between machines, spread the result.

    Per bucket of ``n`` elements, after ``warmup_steps`` dense steps, on the exchange thread
    (the steps are :func:`_two_level_exchange`), with ``L`` ranks per machine:

    1. Cut the bucket into ``L`` shares of whole segments; reduce-scatter ``w_i * g_i``
       inside the machine: local rank ``j`` gets its machine's sum of share ``j``.
    2. Exchange share ``j`` between machines, among the ranks of local index ``j`` (its
       rail): the sparse hook's steps (:func:`~.segment_sparse.segment_sparse_hook`: error
       feedback, importance, the agreed selection, the wire, the handed step) with one
       contribution per machine; or, for :meth:`TwoLevelState.dense`, a plain allreduce.
    3. All-gather the shares inside the machine, with one flag per share: a non-finite
       gradient on any rank hands the bucket on as NaN on every rank (as
       :func:`~.segment_sparse.segment_sparse_hook` does).

    Args:
        state: a :class:`TwoLevelState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer, overwritten with the result (the same on every rank).

    Example::

        >>> state = TwoLevelState(machines=4, density=AutoDensity(), **recipe.settings)
        >>> ddp_model.register_comm_hook(state, two_level_hook)
    """
    check_state(state, TwoLevelState, "two_level_hook")
    return state.run(bucket, _two_level_exchange)


def _sum_inside_machine(state: TwoLevelState, staged: torch.Tensor, mine: torch.Tensor) -> None:
    if state.groups.local_size == 1:
        mine.copy_(staged)
    else:
        reduce_scatter_single(mine, staged, group=state.groups.machine)


def _spread_inside_machine(state: TwoLevelState, mine: torch.Tensor, staged: torch.Tensor) -> None:
    if state.groups.local_size == 1:
        staged.copy_(mine)
    else:
        all_gather_single(staged, mine, group=state.groups.machine)


def _gather_held_back(state: TwoLevelState, plan_bucket: PlanBucket, shares: Shares) -> None:
    """Make this rank's share of the error feedback its machine's whole: what the machine's
    ranks hold there is summed onto the share's owner, the rest of each rank's state zeroed.
    Runs when the plan bucket's share layout is new (a first step, a rebuilt bucket, a loaded
    checkpoint); with the same layout as before nothing moves (a sum with zeros is exact)."""
    if plan_bucket.extra.get(SHARES_KEY) == shares.key:
        return
    pool, device = state.pool, next(iter(plan_bucket.tensors.values())).device
    staged = pool.acquire(shares.local_size * shares.slot, torch.float32, device)
    mine = pool.acquire(shares.slot, torch.float32, device)
    for tensor in plan_bucket.tensors.values():
        shares.stage(tensor, staged, 1.0)
        _sum_inside_machine(state, staged, mine)
        tensor.zero_()
        tensor[shares.start:shares.stop].copy_(mine[:shares.stop - shares.start])
    pool.release(staged)
    pool.release(mine)
    plan_bucket.extra[SHARES_KEY] = shares.key


def _exchange_share(state: TwoLevelState, plan_bucket: PlanBucket, shares: Shares,
                    values: torch.Tensor, index: int) -> bool:
    """Step 2 for this rank's share ``values`` (in place); ``True`` if it held a non-finite
    value (then zeros)."""
    if state.between_machines == "dense":
        own_bytes = values.numel() * values.element_size()
        state.statistics.count_bytes(own_bytes, own_bytes, True)
        dist.all_reduce(values, group=state.exchange_group())
        return False
    stats, began = state.statistics.counters, time.perf_counter()
    codec_before = stats["encode_seconds"] + stats["decode_seconds"]
    sent_before = stats["bytes_sent"]
    try:
        sparse_allreduce(state, _ShareOfPlanBucket(plan_bucket, shares.start, shares.stop),
                          values, index).wait()
    except FloatingPointError:  # the rail agreed on it; the flag tells the machine
        values.zero_()
        return True
    if state.auto_density is not None:
        codec = stats["encode_seconds"] + stats["decode_seconds"] - codec_before
        state.auto_density.add_exchange(stats["bytes_sent"] - sent_before,
                                        time.perf_counter() - began - codec, codec)
    return False


def _two_level_exchange(state: TwoLevelState, plan_bucket: PlanBucket, grad: torch.Tensor,
                        index: int) -> torch.futures.Future[torch.Tensor]:
    """Steps 1-3 of :func:`two_level_hook` for ``grad``, laid out like ``plan_bucket``, on the
    calling thread; returns a completed future."""
    if not state.accepts(grad.dtype):
        raise TypeError(f"two_level_hook: bucket {index} has dtype {grad.dtype}; gradients must "
                        f"be float32, bfloat16 or float16 (float64 with TwoLevelState.dense)")
    shares = state.shares_of(grad.numel())
    _gather_held_back(state, plan_bucket, shares)
    pool, device = state.pool, grad.device
    dtype = INSIDE_DTYPES[state.inside_dtype] or grad.dtype
    staged = pool.acquire(shares.local_size * shares.slot, dtype, device)
    mine = pool.acquire(shares.slot, dtype, device)
    # 1. Sum inside the machine: this rank's share.
    with state.statistics.timer("encode_seconds"):
        shares.stage(grad, staged, state.weight())
    _sum_inside_machine(state, staged, mine)
    # 2. Exchange the share between machines (the sparse steps count its bytes).
    own = shares.stop - shares.start
    state.statistics.count_bytes((grad.numel() - own) * grad.element_size(), 0, True)
    failed = state.exchange_share(plan_bucket, shares, mine[:own], index) if own else False
    mine[-1] = float(failed)
    # 3. Spread inside the machine, with every share's flag.
    _spread_inside_machine(state, mine, staged)
    state.statistics.count("bytes_inside_machines", (staged.numel() + mine.numel()) * staged.element_size())
    try:
        if bool(shares.flags(staged).any()):
            plan_bucket.reset()  # the whole bucket's, on every rank of the machine
            return state.non_finite.hand_on(grad, NonFiniteGradient(type(state).__name__, index,
                                                                    state.step))
        with state.statistics.timer("decode_seconds"):
            shares.unstage(staged, grad)
    finally:
        pool.release(staged)
        pool.release(mine)
    done = torch.futures.Future()
    done.set_result(grad)
    return done
