"""The state every hetero_comm hook keeps, and the frame every compressing hook runs in.

* :class:`HookState`: settings shared by every hook (process group, rank weight), statistics,
  pickling, checkpointing of the counters, and the weighted dense allreduce.
* :class:`ErrorFeedbackState`: adds what compressing hooks share: the dense warm-up, the
  minimum bucket size, the buffer pool, the parameter-keyed :class:`~._plan.Plan` of
  error-feedback state, and :meth:`ErrorFeedbackState.run`, which routes a bucket through
  the plan to the hook's own send function.
"""

import logging
import math
import time
import warnings
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._checks import check_float, check_int, check_optional
from .._layout import GRADIENT_DTYPES
from ..buffer_pool import BufferPool
from ._dropped import KeptLayout, kept_layout, send_kept_part
from ._optimizer import HandedSum, check_optimizer, fit_optimizer
from ._plan import Plan, PlanBucket, Route, redistribute
from ._streams import CallbackOrder

logger = logging.getLogger("hetero_comm")

__all__ = ["HookState", "ErrorFeedbackState", "check_state"]

# send(state, plan_bucket, grad, bucket_index) -> future of grad holding the weighted sum
SendFunction = Callable[["ErrorFeedbackState", PlanBucket, torch.Tensor, int], torch.futures.Future]


class _Timer:
    """Adds the seconds spent inside ``with`` to ``stats[field]``."""

    def __init__(self, stats: dict, field: str) -> None:
        self.stats, self.field = stats, field

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats[self.field] += time.perf_counter() - self.start


class HookState:
    """Settings, statistics and checkpointing shared by the hetero_comm hooks.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        rank_weight: this rank's weight ``w_i`` in the result ``sum_i w_i * g_i``
            (``None``: ``1 / world_size``, the plain average). The weights of all ranks
            should sum to 1; the heterogeneous-batch planner sets
            ``w_i = local_batch_i / global_batch``. May be changed between steps.
    """

    # Hook-specific settings that must match when loading a checkpoint.
    _checkpoint_settings: Tuple[str, ...] = ()

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None) -> None:
        # Settings.
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None; "
                            f"got {type(process_group).__name__} (the other settings of "
                            f"{type(self).__name__} are keyword arguments)")
        self.process_group = process_group
        self.rank_weight = rank_weight
        # Internal state: steps completed (a step ends with DDP's last bucket), and the
        # parameters of the one model this state serves (learnt in its first step here).
        self.step = 0
        self._model_parameters: dict = {}  # id -> parameter (keeps the id valid)
        self._learning_model = True
        self._dropped_units = None  # a UnitDropoutSet: its dropped units' gradient is not sent
        # Statistics.
        self._stats = dict(bytes_sent=0, bytes_dense=0, compressed_bytes_sent=0,
                           compressed_bytes_dense=0, encode_seconds=0.0, decode_seconds=0.0,
                           dense_fallbacks=0, non_finite_buckets=0)

    # ---------------------------------------------------------------- settings and logging
    @property
    def rank_weight(self) -> Optional[float]:
        return self._rank_weight

    @rank_weight.setter
    def rank_weight(self, value: Optional[float]) -> None:
        self._rank_weight = check_optional(check_float, "rank_weight", value, 0.0, 1.0)

    def weight(self) -> float:
        """The weight applied to this rank's gradient this step."""
        if self._rank_weight is not None:
            return self._rank_weight
        return 1.0 / dist.get_world_size(self.process_group)

    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def settings(self) -> dict:
        """The settings of this state, as passed to the constructor."""
        return dict(rank_weight=self._rank_weight)

    def _log_settings(self) -> None:
        logger.info("%s: %s", type(self).__name__,
                    ", ".join(f"{k}={v}" for k, v in self.settings().items()))

    def __getstate__(self) -> dict:
        """Pickle without the process group (not picklable) and the model's parameters; the
        unpickled state uses the default group unless one is assigned, and learns its model
        at its first step."""
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_model_parameters"], state["_learning_model"] = {}, True
        state["_dropped_units"] = None
        return state

    def claim(self, bucket: dist.GradBucket) -> None:
        """Make sure the bucket belongs to this state's model: a state keeps error feedback
        and counters for one model, so a second model sharing it would corrupt both."""
        params = bucket.parameters()
        if self._learning_model:
            self._model_parameters.update((id(p), p) for p in params)
            self._learning_model = not bucket.is_last()
        elif any(id(p) not in self._model_parameters for p in params):
            raise ValueError(f"this {type(self).__name__} already serves another model: "
                             f"register each DDP model's hook with a state of its own")

    def skip_dropped_units(self, units) -> None:
        """Send only the gradient of units that ``units`` (a
        :class:`~hetero_comm.nn.UnitDropoutSet`) keeps at each step: every rank dropped the
        same ones, so their producer's rows and consumer's columns are zero everywhere.
        Those stay zero in the result, their error-feedback residual is kept for a step that
        keeps them, and their bytes are saved (``stats()`` counts them in ``bytes_dense``,
        not in ``bytes_sent``). ``None`` stops skipping. What a hook keeps besides its
        error-feedback tensors (the two-level hook's share layout) is dropped for a bucket
        with dropped units and made afresh.

        Example::

            >>> units = hetero_comm.nn.convert_dropout(model, p=0.5, seed=0)
            >>> units.attach(optimizer)  # new masks after each step
            >>> state.skip_dropped_units(units)
            >>> ddp_model.register_comm_hook(state, hook)
        """
        if units is not None and not callable(getattr(units, "kept_piece", None)):
            raise TypeError(f"skip_dropped_units takes a hetero_comm.nn.UnitDropoutSet or None; "
                            f"got {type(units).__name__}")
        self._dropped_units = units
        self._masks_step, self._warned_masks = None, False
        self._non_finite_at_checks = (0, 0)  # the count at the last two mask checks

    def kept_layout(self, parameters) -> Optional[KeptLayout]:
        """What units kept at this step touch of ``parameters`` (a flat layout); ``None``:
        send all."""
        if self._dropped_units is None:
            return None
        return kept_layout(self._dropped_units, parameters)

    def handed_step(self) -> HandedSum:
        """What this hook hands the optimizer: here a (weighted) sum, which suits any
        optimizer. A state whose hook hands something else overrides this."""
        return HandedSum()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn (``UserWarning``) if ``optimizer`` does not take the step this hook hands it
        (:meth:`handed_step`) as it stands: :meth:`prepare_optimizer` would raise, or would
        change a hyperparameter."""
        check_optimizer(optimizer, self.handed_step(), type(self).__name__)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          lr_scale: Optional[float] = None) -> torch.optim.Optimizer:
        """Fit ``optimizer``, set up as for dense training, to what this hook hands DDP, and
        keep the user's learning rate and schedule: the hyperparameters the hook needs are set
        in every parameter group (and set again after ``optimizer.load_state_dict``), and each
        ``optimizer.step()`` runs at ``lr_scale`` times every group's learning rate, which
        holds the user's rate again when the step returns or raises (so schedulers, created
        before or after, logs and checkpoints see the user's rate). Before each step the
        groups are checked again (a group added since, or a momentum a scheduler set, raises
        as here). A copy or an unpickled optimizer loses this: prepare it again.

        What is set, and the default ``lr_scale``, follow from :meth:`handed_step` (a sum:
        nothing, and 1). So does each group's ``weight_decay`` inside the step: the recipes'
        factor makes up for what their hooks lose of the gradient, so their steps scale the
        decay back to dense's (:meth:`~._optimizer.HandedSum.weight_decay_scale`); a sum's
        leaves it as it is.

        Call it on every rank, after creating the optimizer, and again on the new optimizer
        of a resumed run; preparing the same optimizer again replaces the earlier call.
        Framework wrappers that hold the optimizer in ``.optimizer`` (Accelerate's) are
        unwrapped.

        Args:
            optimizer: a ``torch.optim.Optimizer`` (or a wrapper as above).
            lr_scale: the factor on the learning rate inside each step, > 0 (``None``: the
                hook's default).

        Returns:
            ``optimizer``, as given.

        Raises:
            TypeError: the optimizer is not one this hook's output suits.
            ValueError: a bad ``lr_scale``, or a hyperparameter the hook cannot take over.
            Nothing is changed when it raises.

        Example::

            >>> optimizer = torch.optim.AdamW(model.parameters(), lr=dense_lr)
            >>> state.prepare_optimizer(optimizer)
        """
        fit_optimizer(optimizer, self.handed_step(), lr_scale)
        return optimizer

    # ------------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Totals since construction (or the loaded checkpoint).

        Returns:
            dict with ``steps``; ``bytes_sent`` and ``bytes_dense`` (bytes this rank handed to
            collectives, and what plain allreduce of the same gradients would have handed,
            warm-up included); ``compression_ratio`` (dense-equivalent bytes / bytes sent,
            over the steps after the warm-up only, everything on the wire counted: values,
            importance, scales; 1.0 for a dense hook; ``nan`` before the first such step);
            ``encode_seconds`` and ``decode_seconds`` (time in the hook around the
            collectives); ``dense_fallbacks`` (buckets sent dense because their layout did
            not match the plan, see :mod:`hetero_comm.hooks._plan`); ``non_finite_buckets``
            (compressed buckets handed on holding NaN because a rank's gradient held a NaN or an
            infinity, see :meth:`ErrorFeedbackState.hand_on_non_finite`).
        """
        s = dict(self._stats)
        sent, dense = s.pop("compressed_bytes_sent"), s.pop("compressed_bytes_dense")
        s["compression_ratio"] = dense / sent if sent else float("nan")
        s["steps"] = self.step
        return s

    def count_bytes(self, dense: int, sent: int, after_warmup: bool) -> None:
        self._stats["bytes_dense"] += dense
        self._stats["bytes_sent"] += sent
        if after_warmup:
            self._stats["compressed_bytes_dense"] += dense
            self._stats["compressed_bytes_sent"] += sent

    def timer(self, field: str) -> _Timer:
        """``with state.timer("encode_seconds"):`` adds the time inside to that statistic."""
        return _Timer(self._stats, field)

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (tensors are cloned)."""
        return {
            "type": type(self).__name__,
            "settings": {name: getattr(self, name) for name in self._checkpoint_settings},
            "step": self.step,
            "stats": dict(self._stats),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (before or after registering the hook)."""
        if state_dict.get("type") != type(self).__name__:
            raise ValueError(f"state_dict was saved by {state_dict.get('type')!r}, "
                             f"not {type(self).__name__!r}")
        for name, value in state_dict["settings"].items():
            if getattr(self, name) != value:
                raise ValueError(f"state_dict was saved with {name}={value!r}; this state has "
                                 f"{name}={getattr(self, name)!r}")
        self.step = int(state_dict["step"])
        self._stats.update(state_dict["stats"])

    # ----------------------------------------------------------------------- running
    def send_dense(self, grad: torch.Tensor, after_warmup: bool,
                   parameters=()) -> torch.futures.Future:
        """Weighted dense allreduce of ``grad`` in place (``after_warmup``: its bytes count
        in the compression ratio); ``parameters``, laid out in ``grad``, tell the rows of
        dropped units, which are not sent (see :meth:`skip_dropped_units`)."""
        layout = self.kept_layout(parameters)
        with self.timer("encode_seconds"):
            grad.mul_(self.weight())
            sent = grad if layout is None else layout.gather(grad, grad.new_empty(layout.numel))
        self.count_bytes(grad.numel() * grad.element_size(), sent.numel() * sent.element_size(),
                         after_warmup)
        work = dist.all_reduce(sent, group=self.process_group, async_op=True)
        if layout is None:
            return work.get_future().then(lambda fut: fut.value()[0])
        return work.get_future().then(lambda fut: layout.expand(fut.value()[0], grad))

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        """Count the step once DDP hands over its last bucket."""
        if bucket.is_last():
            self.step += 1
            self._check_masks_advance()

    def _check_masks_advance(self) -> None:
        """Warn (once) when the unit-dropout masks did not change between two synchronised
        steps: the set was not attached to the optimizer, so the same units stay dropped.
        Not after a bucket was handed on holding NaN in the last two steps (a ``GradScaler``
        then skips ``optimizer.step()``, and the attached set with it; on CUDA that bucket is
        counted a step late)."""
        units = self._dropped_units
        if units is None:
            return
        non_finite = self._stats.get("non_finite_buckets", 0)
        skipped = non_finite > self._non_finite_at_checks[0]
        self._non_finite_at_checks = (self._non_finite_at_checks[1], non_finite)
        if units.step == self._masks_step and not self._warned_masks and not skipped:
            logger.warning("%s: the unit-dropout masks did not change since the last step; call "
                           "units.attach(optimizer) (or units.next_step() after each step)",
                           type(self).__name__)
            self._warned_masks = True
        self._masks_step = units.step


class NonFiniteGradient(FloatingPointError):
    """A NaN or infinity reached a compressed bucket on some rank (all ranks agree on it):
    raised inside a hook's send on the CPU and caught by :meth:`ErrorFeedbackState.run`,
    which hands the bucket on as NaN."""

    def __init__(self, owner: str, index: int, step: int) -> None:
        super().__init__(f"{owner}: non-finite gradient (NaN or infinity) in DDP bucket {index} "
                         f"on at least one rank at step {step}")
        self.index, self.step = index, step


class DeviceFiniteChecks:
    """Non-finite gradients found on a GPU without a host sync (on the CPU the hooks check at
    once). Each flag is copied to pinned host memory behind an event; :meth:`report`, at the
    next hook call, resets the error feedback of every bucket whose flag arrived false (until
    then the hook sends zeros for it and hands the bucket on as NaN: see
    :meth:`ErrorFeedbackState.check_finite`), and keeps the flags still in flight."""

    # True: take the device path on every device (the CPU tests of the CUDA path).
    on_every_device = False

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._pending: List[tuple] = []  # (host flag, event or None, plan bucket, index, step)

    def on_device(self, device: torch.device) -> bool:
        return self.on_every_device or device.type == "cuda"

    def watch(self, finite: torch.Tensor, plan_bucket: PlanBucket, index: int, step: int) -> None:
        if finite.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = finite.clone(), None
        self._pending.append((host, event, plan_bucket, index, step))

    def report(self) -> List[NonFiniteGradient]:
        """Reset the error feedback of every bucket whose flag arrived false; returns what
        was found, for the state to count."""
        failed, still_in_flight = [], []
        for host, event, plan_bucket, index, step in self._pending:
            if event is not None and not event.query():  # one query per flag
                still_in_flight.append((host, event, plan_bucket, index, step))
            elif not bool(host):
                plan_bucket.reset()
                failed.append(NonFiniteGradient(self.owner, index, step))
        self._pending = still_in_flight
        return failed


class ErrorFeedbackState(HookState):
    """:class:`HookState` plus what the compressing hooks share.

    Args:
        process_group, rank_weight: see :class:`HookState`.
        warmup_steps: steps sent dense (plain weighted allreduce) before compressing, >= 1
            because DDP's first iteration runs with a provisional bucket layout.
        min_compress_numel: buckets with fewer elements are always sent dense, >= 0.
        plan_tensors: (for subclasses) the flat float32 buffers each plan bucket keeps.
    """

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None, warmup_steps: int = 1,
                 min_compress_numel: int = 0,
                 plan_tensors: Tuple[str, ...] = ("residual",)) -> None:
        super().__init__(process_group=process_group, rank_weight=rank_weight)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        self.pool = BufferPool()
        self.callbacks = CallbackOrder(self.pool)
        self.plan = Plan(plan_tensors, type(self).__name__)
        self.finite_checks = DeviceFiniteChecks(type(self).__name__)
        self._warned_non_finite, self._non_finite_warning = False, None

    def settings(self) -> dict:
        return dict(super().settings(), warmup_steps=self.warmup_steps,
                    min_compress_numel=self.min_compress_numel)

    def __getstate__(self) -> dict:
        """Pickle without the pool (its storage belongs to this process)."""
        state = super().__getstate__()
        del state["pool"], state["callbacks"], state["finite_checks"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pool = BufferPool()
        self.callbacks = CallbackOrder(self.pool)
        self.finite_checks = DeviceFiniteChecks(type(self).__name__)
        self._warned_non_finite, self._non_finite_warning = False, None  # once per process

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether this hook can compress gradients of ``dtype``."""
        return dtype in GRADIENT_DTYPES

    def check_finite(self, values: torch.Tensor, index: int, step: int, plan_bucket: PlanBucket,
                     release: Tuple[torch.Tensor, ...] = ()) -> Optional[torch.Tensor]:
        """Whether ``values`` (the same on every rank: agreed by a collective) are all finite.

        CPU: checked now; if not, ``release`` goes back to the pool, the bucket's error
        feedback is reset and :class:`NonFiniteGradient` is raised (:meth:`run` hands the
        bucket on as NaN); returns ``None``. CUDA: no host sync. Returns the flag as a device
        tensor; the caller sends on (non-finite values replaced by zeros), zeroes what it puts
        on the wire with :meth:`drop_unless` and fills the delivered bucket with NaN with
        :meth:`nan_unless`; :meth:`run` resets the bucket's error feedback at a later step,
        once the flag has reached the host.
        """
        if not self.finite_checks.on_device(values.device):
            # float64: a sum of float32 values cannot overflow it, so only a NaN or an
            # infinity makes it non-finite (one reduction instead of isfinite's five ops)
            if not math.isfinite(values.sum(dtype=torch.float64).item()):
                for buffer in release:
                    self.pool.release(buffer)
                plan_bucket.reset()
                raise NonFiniteGradient(type(self).__name__, index, step)
            return None
        finite = torch.isfinite(values).all()
        self.finite_checks.watch(finite, plan_bucket, index, step)
        values.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return finite

    @staticmethod
    def drop_unless(finite: Optional[torch.Tensor], *tensors: torch.Tensor) -> None:
        """Zero ``tensors`` (what goes on the wire) on the device where ``finite`` is false,
        without reading the flag: the sum stays finite (int8: within range)."""
        if finite is not None:
            for tensor in tensors:
                tensor.masked_fill_(~finite, 0.0)

    @staticmethod
    def nan_unless(finite: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        """Put a NaN into the delivered bucket on the device where ``finite`` is false (the
        CPU path's :meth:`hand_on_non_finite`, without reading the flag). One element is
        enough for a ``GradScaler`` (and, without one, for the parameters to go NaN), and
        spares a pass over the bucket at every step."""
        if finite is not None:
            if finite.is_cuda:  # read on this callback's stream: keep its memory until then
                finite.record_stream(torch.cuda.current_stream(finite.device))
            grad[:1].masked_fill_(~finite, math.nan)

    def hand_on_non_finite(self, grad: torch.Tensor, found: NonFiniteGradient) -> torch.futures.Future:
        """A bucket in which some rank's gradient held a NaN or an infinity: handed on as NaN,
        as DDP's allreduce would hand on the sum, so that a ``GradScaler`` skips the step (and
        without one the parameters go NaN, as with DDP's own hook); the error feedback of
        the part that held it was reset. Returns the completed future."""
        grad.fill_(math.nan)
        self.count_non_finite(found)
        done = torch.futures.Future()
        done.set_result(grad)
        return done

    def count_non_finite(self, found: NonFiniteGradient) -> None:
        """Count a bucket handed on holding NaN (``stats()["non_finite_buckets"]``); the first
        one's warning is given by :meth:`warn_non_finite`."""
        self._stats["non_finite_buckets"] += 1
        if not self._warned_non_finite and self._non_finite_warning is None:
            self._non_finite_warning = (
                f"{found}: the bucket is handed on holding NaN, as DDP's allreduce would hand on "
                f"the sum (a torch.amp.GradScaler then skips the step), and the error feedback "
                f"of the part of it that held the value restarts from zero. "
                f"stats()['non_finite_buckets'] counts such buckets; this warning is given once")

    def warn_non_finite(self) -> None:
        """Give the warning :meth:`count_non_finite` kept, once per process (last in
        :meth:`run`, so that an error raised for it leaves the state consistent)."""
        if self._non_finite_warning is not None:
            message, self._non_finite_warning = self._non_finite_warning, None
            self._warned_non_finite = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def stats(self) -> dict:
        """:meth:`HookState.stats` plus ``pool`` (the buffer pool's counters)."""
        return dict(super().stats(), pool=self.pool.stats())

    def held_back(self, parameters) -> List[torch.Tensor]:
        """What error feedback holds back for each parameter (its slice of the residual,
        shaped like the parameter; zeros where nothing is held). In the units of the result:
        already multiplied by this rank's weight."""
        return self.plan.held_back(parameters)

    def state_dict(self) -> dict:
        """:meth:`HookState.state_dict` plus every rank's error-feedback state.

        Error feedback differs between ranks, and frameworks save one rank's dict (rank 0's)
        and load it on every rank. So this is a collective: call it on every rank of the
        process group (frameworks do). It gathers each rank's part (on the CPU) to rank 0,
        whose dict then holds ``world_size`` parts; any other rank's holds its own.
        """
        for found in self.finite_checks.report():  # CUDA: no NaN residual into the checkpoint
            self.count_non_finite(found)
        world_size, rank = self._group_shape()
        local = {"stats": dict(self._stats), "plan": self.plan.state_dict()}
        parts = {rank: local}
        if world_size > 1:
            gathered = [None] * world_size if rank == 0 else None
            group = self.process_group or dist.group.WORLD
            dist.gather_object(local, gathered, dst=dist.get_global_rank(group, 0), group=group)
            if rank == 0:
                parts = dict(enumerate(gathered))
        return dict(super().state_dict(), world_size=world_size, ranks=parts)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's part of a :meth:`state_dict` (rank 0's dict serves every rank).

        Into another world size: what every saved rank held back is summed and split equally
        among the new ranks (the total held back, and so everything not yet applied, is
        kept); that needs the dict of rank 0, which holds every saved rank's part.
        """
        if "ranks" not in state_dict:
            raise ValueError("this state_dict has no per-rank error-feedback state: it was "
                             "saved by an older hetero_comm; start the hook state afresh")
        super().load_state_dict(state_dict)
        world_size, rank = self._group_shape()
        saved_size, parts = state_dict["world_size"], state_dict["ranks"]
        if saved_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"this state_dict holds the error feedback of {saved_size} ranks: "
                               f"load it after init_process_group, which tells this rank's part")
        if saved_size == world_size and rank in parts:
            mine = parts[rank]
        elif len(parts) == saved_size:
            mine = {"stats": parts[0]["stats"],
                    "plan": redistribute([parts[r]["plan"] for r in range(saved_size)], world_size)}
        else:
            raise ValueError(f"this state_dict holds the part of rank(s) {sorted(parts)} of "
                             f"{saved_size}, not this rank's ({rank} of {world_size}): load the "
                             f"dict saved by rank 0, which holds every rank's part")
        self._stats.update(mine["stats"])
        self.plan.load_state_dict(mine["plan"])

    def _group_shape(self) -> Tuple[int, int]:
        """``(world_size, rank)`` in the process group; ``(1, 0)`` without one."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0
        return dist.get_world_size(self.process_group), dist.get_rank(self.process_group)

    # ----------------------------------------------------------------------- running
    def run(self, bucket: dist.GradBucket, send: SendFunction) -> torch.futures.Future[torch.Tensor]:
        """Process one bucket: dense during warm-up, for small buckets or a layout the plan
        does not hold yet; else ``send`` each plan bucket's worth of it. Advances
        :attr:`step` after the last bucket."""
        self.claim(bucket)
        for found in self.finite_checks.report():  # CUDA: a bucket handed on holding NaN earlier
            self.count_non_finite(found)
        self.callbacks.settle()
        grad = bucket.buffer()
        if not self.accepts(grad.dtype):
            raise TypeError(f"{type(self).__name__}: bucket {bucket.index()} has dtype "
                            f"{grad.dtype}; gradients must be float32, bfloat16 or float16")
        compressing = self.step >= self.warmup_steps
        route = None
        if compressing and grad.numel() >= self.min_compress_numel:
            route = self.plan.route(bucket)
            if route is None:
                self._stats["dense_fallbacks"] += 1
        else:
            self.plan.keys_of(bucket)  # learn the provisional layout's keys
        if self._dropped_units is not None:
            send = send_kept_part(send, self._dropped_units)
        try:
            if route is None:
                future = self.send_dense(grad, compressing, bucket.parameters())
            elif route.in_place:
                future = send(self, route.parts[0], grad, bucket.index())
            else:
                future = self._send_parts(route, grad, bucket.index(), send)
        except NonFiniteGradient as found:  # every rank found it (an agreed value)
            future = self.hand_on_non_finite(grad, found)
        self.end_bucket(bucket)
        self.warn_non_finite()
        return future

    def _send_parts(self, route: Route, grad: torch.Tensor, index: int,
                    send: SendFunction) -> torch.futures.Future:
        """A bucket made of whole plan buckets: each sent in its own layout."""
        sent = []
        for part in route.parts:
            buffer = route.gather(part, grad, self.pool.acquire(part.numel, grad.dtype, grad.device))
            try:
                sent.append((part, buffer, send(self, part, buffer, index)))
            except BaseException:  # e.g. a non-finite gradient: give every gather buffer back
                self.pool.release(buffer)
                if sent:  # the parts already sent write into theirs when their sums arrive
                    torch.futures.collect_all([future for _, _, future in sent]).then(
                        lambda _: self.callbacks.release([b for _, b, _ in sent], grad.device))
                raise

        def scatter(_):
            for part, _, future in sent:
                route.scatter(part, future.wait(), grad)  # wait(): orders CUDA streams too
            self.callbacks.release([buffer for _, buffer, _ in sent], grad.device)
            return grad

        return torch.futures.collect_all([future for _, _, future in sent]).then(scatter)


def check_state(state, state_class: type, hook_name: str) -> None:
    """Raise ``TypeError`` unless ``state`` is a ``state_class`` (each hook reads settings
    only its own state has)."""
    if not isinstance(state, state_class):
        raise TypeError(f"{hook_name} takes a {state_class.__name__} state; got a "
                        f"{type(state).__name__} (register the hook with its own state)")
