"""Measure every rank's compute speed and re-plan the batch sizes from it, keeping the
averaged gradient exactly that of the global batch."""

import contextlib
import math
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from .._checks import check_float, check_int
from .planning import plan_batch_sizes
from .sampler import HeteroSampler

__all__ = ["DynamicBatchController"]


class DynamicBatchController:
    r"""Give each rank a batch proportional to its measured speed; weight its gradient exactly.

    1. Every step, :meth:`step` sets ``hook_state.rank_weight = b_i / B`` (this rank's samples
       over the step's global batch), so the hook's weighted sum is the gradient of the mean
       loss over the global batch, and times the step's compute: forward plus backward up to
       the moment the last gradient bucket is handed to the hook, minus the time spent inside
       the hook for earlier buckets. Waiting for other ranks (inside the hook or in DDP's final
       wait for the collectives) is excluded, so a fast rank does not look slow because it
       waits for a slow one.
    2. :meth:`replan` (called by :meth:`set_epoch` at each new epoch and, with
       ``replan_every=K``, after every K steps) exchanges each rank's samples and compute
       seconds since the last plan in one allreduce of ``2 * world_size`` float64 values,
       turns them into speeds ``v_i`` (samples per second of compute), smooths them
       (exponential moving average), plans ``b_i`` proportional to ``v_i`` with
       :func:`plan_batch_sizes` (sum exactly ``B``), limits how far each rank's batch moves
       (``max_change``) and hands the sizes to the sampler, from its next step on.

    Every rank computes the same plan from the same exchanged numbers, so the ranks never
    disagree about the cut. The first epoch is an equal split (the basic scheme's rule, the
    sampler's default); the first plan uses the speeds measured in it.

    Requirements: the local loss is the mean over the local batch (``reduction="mean"``);
    ``hook_state`` belongs to the hook registered through :meth:`register_comm_hook` (any
    hetero_comm hook; for PyTorch's plain DDP use :func:`~hetero_comm.hooks.allreduce_hook`,
    the weighted dense allreduce); every rank calls :meth:`set_epoch`, :meth:`step` and
    :meth:`replan` at the same points of its loop. Layers that depend on the local batch
    (BatchNorm) see unequal batches: use ``SyncBatchNorm`` or a batch-independent norm; DDP's
    buffer broadcast (``broadcast_buffers=True`` with buffers) waits for the other ranks inside
    the forward pass, which then counts as compute: pass ``broadcast_buffers=False`` if the
    buffers need no broadcast.

    Args:
        sampler: this rank's :class:`HeteroSampler`.
        hook_state: the state of the registered hook (it has a ``rank_weight``).
        replan_every: also re-plan after every this many steps (speeds that drift within an
            epoch); ``None``: once per epoch, the basic scheme.
        smoothing: weight of the newest measurement in the moving average of the speeds, in
            (0, 1]; 1 keeps no memory (the basic scheme).
        max_change: the largest relative change of a rank's batch at one re-plan (e.g. 0.25:
            at most 25% up or down, but always at least one sample, give or take one sample of
            rounding); ``None``: no bound.
        adapt: ``False`` measures and exchanges the speeds but keeps the batch sizes (a
            baseline that reports what the equal split costs).
        process_group: the group for the speed exchange (default: the hook state's).
        clock: seconds as a float (``time.perf_counter``; a test can pass a simulated clock).

    Example::

        >>> sampler = HeteroSampler(len(dataset), 256, rank, world_size, seed=0)
        >>> state = SegmentSparseState(density=0.01)
        >>> controller = DynamicBatchController(sampler, state)
        >>> controller.register_comm_hook(ddp_model, segment_sparse_hook)
        >>> loader = DataLoader(dataset, batch_sampler=sampler)
        >>> for epoch in range(epochs):
        ...     controller.set_epoch(epoch)
        ...     for x, y in loader:
        ...         with controller.step(len(x)):
        ...             loss_fn(ddp_model(x), y).backward()
        ...         optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, sampler: HeteroSampler, hook_state, *, replan_every: Optional[int] = None,
                 smoothing: float = 1.0, max_change: Optional[float] = None, adapt: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(sampler, HeteroSampler):
            raise TypeError(f"sampler must be a HeteroSampler; got {type(sampler).__name__}")
        if not hasattr(hook_state, "rank_weight"):
            raise TypeError(f"hook_state must be a hetero_comm hook state with a rank_weight "
                            f"(for plain DDP use AllreduceState with allreduce_hook); got "
                            f"{type(hook_state).__name__}")
        if replan_every is not None:
            check_int("replan_every", replan_every, 1)
        check_float("smoothing", smoothing, 0.0, 1.0, low_open=True)
        if max_change is not None:
            check_float("max_change", max_change, 0.0, math.inf, low_open=True)
        self.process_group = (process_group if process_group is not None
                              else getattr(hook_state, "process_group", None))
        if dist.is_initialized():
            group_rank = dist.get_rank(self.process_group)
            group_size = dist.get_world_size(self.process_group)
            if (group_rank, group_size) != (sampler.rank, sampler.world_size):
                raise ValueError(f"the sampler is for rank {sampler.rank} of "
                                 f"{sampler.world_size}, but this process is rank {group_rank} "
                                 f"of {group_size} in the process group")
        # Settings.
        self.sampler, self.hook_state = sampler, hook_state
        self.replan_every, self.smoothing, self.max_change = replan_every, float(smoothing), max_change
        self.adapt, self.clock = adapt, clock
        # Internal state.
        self.speeds: Optional[List[float]] = None  # smoothed samples/s of every rank
        self.history: List[dict] = []  # one entry per plan
        self._epoch: Optional[int] = None
        self._step_in_epoch = 0
        self._window_samples, self._window_seconds, self._window_steps = 0, 0.0, 0
        self._hook_calls: List[List[float]] = []  # [entered, left] of this step's hook calls

    # ------------------------------------------------------------------------ the hook
    def register_comm_hook(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                           hook: Callable) -> None:
        """``ddp_model.register_comm_hook(hook_state, hook)``, with the hook timed so that
        time spent in it (waiting for other ranks included) is not counted as compute."""
        def timed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            call = [self.clock(), 0.0]
            self._hook_calls.append(call)
            try:
                return hook(state, bucket)
            finally:
                call[1] = self.clock()

        ddp_model.register_comm_hook(self.hook_state, timed_hook)

    # ----------------------------------------------------------------------- the loop
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: re-plan from what was measured since the last plan (nothing before
        the first epoch), then shuffle the sampler for ``epoch``."""
        if self._window_steps:
            self.replan()
        self.sampler.set_epoch(epoch)
        self._epoch, self._step_in_epoch = epoch, 0

    @contextlib.contextmanager
    def step(self, num_samples: int) -> Iterator[None]:
        """Wrap one step's forward and backward on ``num_samples`` local samples: sets the
        hook's ``rank_weight`` and measures the compute; may re-plan on exit
        (``replan_every``)."""
        if self._epoch is None:
            raise RuntimeError("call set_epoch(epoch) before the first step")
        if self._step_in_epoch >= self.sampler.num_steps():
            raise RuntimeError(f"step {self._step_in_epoch} is past the epoch's "
                               f"{self.sampler.num_steps()} steps; call set_epoch for the next")
        global_batch = self.sampler.global_batch_of_step(self._step_in_epoch)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or \
                not 0 <= num_samples <= global_batch:
            raise ValueError(f"num_samples must be an integer in [0, {global_batch}] (this "
                             f"step's global batch); got {num_samples!r}")
        self.hook_state.rank_weight = num_samples / global_batch
        self._hook_calls = []
        began = self.clock()
        yield
        ended = self.clock()
        if self._hook_calls:
            waits = sum(left - entered for entered, left in self._hook_calls[:-1])
            compute = self._hook_calls[-1][0] - began - waits
        else:  # no_sync(), or no hook: nothing was waited for
            compute = ended - began
        self._window_samples += num_samples
        self._window_seconds += compute
        self._window_steps += 1
        self._step_in_epoch += 1
        if self.replan_every is not None and self._window_steps >= self.replan_every:
            self.replan()

    # --------------------------------------------------------------------- planning
    def replan(self) -> List[int]:
        """Exchange every rank's samples and compute seconds since the last plan (one
        allreduce), update the smoothed speeds and, with ``adapt``, the sampler's batch sizes.
        A collective: every rank must call it at the same point. Returns the batch sizes."""
        world_size = self.sampler.world_size
        measured = torch.zeros(2 * world_size, dtype=torch.float64)
        measured[self.sampler.rank] = self._window_samples
        measured[world_size + self.sampler.rank] = self._window_seconds
        if dist.is_initialized():
            dist.all_reduce(measured, group=self.process_group)
        samples = measured[:world_size].tolist()
        seconds = measured[world_size:].tolist()
        self._window_samples, self._window_seconds, self._window_steps = 0, 0.0, 0
        fresh = [n / t if n > 0 and t > 0 else None for n, t in zip(samples, seconds)]
        self.speeds = self._smoothed(fresh)
        sizes = list(self.sampler.batch_sizes)
        if self.adapt and self.speeds is not None:
            sizes = self._bounded(plan_batch_sizes(self.speeds, self.sampler.global_batch_size))
            self.sampler.set_batch_sizes(sizes)
        self.history.append(dict(epoch=self._epoch, step=self._step_in_epoch,
                                 samples=samples, compute_seconds=seconds,
                                 speeds=None if self.speeds is None else list(self.speeds),
                                 batch_sizes=list(sizes)))
        return sizes

    def _smoothed(self, fresh: Sequence[Optional[float]]) -> Optional[List[float]]:
        """The moving average of the speeds; a rank without a new measurement (no samples
        since the last plan) keeps its old speed, or the mean of the others at first."""
        known = [v for v in fresh if v is not None]
        if not known:
            return self.speeds
        fallback = sum(known) / len(known)
        speeds = []
        for rank, v in enumerate(fresh):
            old = self.speeds[rank] if self.speeds is not None else None
            if v is None:
                speeds.append(old if old is not None else fallback)
            elif old is None:
                speeds.append(v)
            else:
                speeds.append(self.smoothing * v + (1 - self.smoothing) * old)
        return speeds

    def _bounded(self, target: List[int]) -> List[int]:
        """Move from the current sizes towards ``target`` along the straight line (which keeps
        the sum), as far as ``max_change`` allows every rank; round by largest remainder."""
        current = self.sampler.batch_sizes
        if self.max_change is None or target == current:
            return target
        fraction = 1.0  # of the way to the target; at least one sample a rank may always move
        for now, goal in zip(current, target):
            if goal != now:
                fraction = min(fraction, max(1.0, self.max_change * now) / abs(goal - now))
        if fraction >= 1.0:
            return target
        between = [now + fraction * (goal - now) for now, goal in zip(current, target)]
        return plan_batch_sizes(between, self.sampler.global_batch_size)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, object]:
        """Speeds, batch sizes and plan history, for a resumed run."""
        return {"speeds": None if self.speeds is None else list(self.speeds),
                "batch_sizes": list(self.sampler.batch_sizes),
                "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved (the sampler's sizes included)."""
        speeds = state_dict["speeds"]
        if speeds is not None and len(speeds) != self.sampler.world_size:
            raise ValueError(f"state_dict has speeds for {len(speeds)} ranks; this run has "
                             f"{self.sampler.world_size}")
        self.sampler.set_batch_sizes(state_dict["batch_sizes"])
        self.speeds = None if speeds is None else [float(v) for v in speeds]
        self.history = [dict(h) for h in state_dict["history"]]
