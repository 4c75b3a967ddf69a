"""The state every hetero_comm hook keeps, and the frame every compressing hook runs in.

* :class:`HookState`: settings shared by every hook (process group, rank weight), the step,
  the one model it serves, fitting the optimizer, and the weighted dense allreduce. Its
  counters are a :class:`~._statistics.HookStatistics`; units it does not send, a
  :class:`~._dropped.DroppedUnits`.
* :class:`ErrorFeedbackState`: adds what compressing hooks share: the dense warm-up, the
  minimum bucket size, the buffer pool, the parameter-keyed :class:`~._plan.Plan` of
  error-feedback state (saved through :mod:`._checkpoint`), non-finite values
  (:class:`~._non_finite.NonFiniteHandling`), and :meth:`ErrorFeedbackState.run`, which routes
  a bucket through the plan to the hook's own send function.
"""

import logging
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._agreement import agree_across_ranks
from .._checks import check_float, check_int, check_optional
from .._layout import GRADIENT_DTYPES
from ..buffer_pool import BufferPool
from ._checkpoint import gather_rank_parts, part_of_this_rank
from ._dropped import DroppedUnits, send_kept_part
from ._non_finite import DeviceFiniteChecks, NonFiniteGradient, NonFiniteHandling
from ._optimizer import HandedSum, check_optimizer, fit_optimizer
from ._plan import Plan, PlanBucket, Route, redistribute
from ._statistics import HookStatistics
from ._streams import CallbackOrder

logger = logging.getLogger("hetero_comm")

__all__ = ["HookState", "ErrorFeedbackState", "check_state"]

# send(state, plan_bucket, grad, bucket_index) -> future of grad holding the weighted sum
SendFunction = Callable[["ErrorFeedbackState", PlanBucket, torch.Tensor, int], torch.futures.Future]


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
        self._settings_agreed = False  # compared across the ranks at the first bucket
        self.dropped_units: Optional[DroppedUnits] = None  # their gradient is not sent
        self.statistics = HookStatistics()

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
        state["_settings_agreed"] = False
        state["dropped_units"] = None
        return state

    # Settings each rank may set to its own value (the heterogeneous-batch planner's weights).
    _per_rank_settings: Tuple[str, ...] = ("rank_weight",)

    def agree_settings(self) -> None:
        """Compare :meth:`settings` (but the per-rank ones) across the process group, once:
        ranks that built their states differently raise ``ValueError`` on every rank, naming
        each rank's settings, instead of exchanging mismatched buffers; a rank that never
        arrives makes the others raise ``RuntimeError`` after
        :data:`~hetero_comm._agreement.SETUP_TIMEOUT_SECONDS`."""
        if getattr(self, "_settings_agreed", False):  # (False in a state pickled before it existed)
            return
        shared = {name: value for name, value in self.settings().items()
                  if name not in self._per_rank_settings}
        shared.update(self.agreed_constants())
        if shared:
            agree_across_ranks(f"{type(self).__name__} settings", shared, self.process_group)
        self._settings_agreed = True

    def agreed_constants(self) -> dict:
        """The library's constants that shape this state's collectives (compared with the
        settings: ranks running different versions of the library must not exchange)."""
        return {}

    def claim(self, bucket: dist.GradBucket, params: Optional[List[torch.Tensor]] = None) -> None:
        """Make sure the bucket belongs to this state's model: a state keeps error feedback
        and counters for one model, so a second model sharing it would corrupt both. At the
        first bucket, :meth:`agree_settings` (every rank's hook runs it there). ``params``:
        ``bucket.parameters()``, where the caller has them already."""
        self.agree_settings()
        params = bucket.parameters() if params is None else params
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
        self.dropped_units = None if units is None else DroppedUnits(units, type(self).__name__)

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
            infinity, see :meth:`~._non_finite.NonFiniteHandling.hand_on`).
        """
        return self.statistics.summary(self.step)

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (tensors are cloned)."""
        return {
            "type": type(self).__name__,
            "settings": {name: getattr(self, name) for name in self._checkpoint_settings},
            "step": self.step,
            "stats": dict(self.statistics.counters),
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
        self.statistics.counters.update(state_dict["stats"])

    # ----------------------------------------------------------------------- running
    def send_dense(self, grad: torch.Tensor, after_warmup: bool,
                   parameters=()) -> torch.futures.Future:
        """Weighted dense allreduce of ``grad`` in place (``after_warmup``: its bytes count
        in the compression ratio); ``parameters``, laid out in ``grad``, tell the rows of
        dropped units, which are not sent (see :meth:`skip_dropped_units`)."""
        layout = None if self.dropped_units is None else self.dropped_units.kept_layout(parameters)
        with self.statistics.timer("encode_seconds"):
            grad.mul_(self.weight())
            sent = grad if layout is None else layout.gather(grad, grad.new_empty(layout.numel))
        self.statistics.count_bytes(grad.numel() * grad.element_size(),
                                    sent.numel() * sent.element_size(), after_warmup)
        work = dist.all_reduce(sent, group=self.process_group, async_op=True)
        if layout is None:
            return work.get_future().then(lambda fut: fut.value()[0])
        return work.get_future().then(lambda fut: layout.expand(fut.value()[0], grad))

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        """Count the step once DDP hands over its last bucket."""
        if bucket.is_last():
            self.step += 1
            if self.dropped_units is not None:
                self.dropped_units.check_masks_advance(self.statistics.counters["non_finite_buckets"])


class ErrorFeedbackState(HookState):
    """:class:`HookState` plus what the compressing hooks share.

    Args:
        process_group, rank_weight: see :class:`HookState`.
        warmup_steps: steps sent dense (plain weighted allreduce) before compressing, >= 1
            because DDP's first iteration runs with a provisional bucket layout.
        min_compress_numel: buckets with fewer elements are always sent dense, >= 0.
        plan_tensors: (for subclasses) the flat float32 buffers each plan bucket keeps.
    """

    # How non-finite values found on a device are carried to a later hook call (a subclass
    # whose hook may wait on the device finds them at once instead).
    device_finite_checks = DeviceFiniteChecks

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None, warmup_steps: int = 1,
                 min_compress_numel: int = 0,
                 plan_tensors: Tuple[str, ...] = ("residual",)) -> None:
        super().__init__(process_group=process_group, rank_weight=rank_weight)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        self.plan = Plan(plan_tensors, type(self).__name__)
        self._start_process_parts()

    def _start_process_parts(self) -> None:
        """What belongs to this process and is made anew when unpickled: the buffer pool, the
        callbacks' order on CUDA, and the non-finite handling."""
        self.pool = BufferPool()
        self.callbacks = CallbackOrder(self.pool)
        owner = type(self).__name__
        self.non_finite = NonFiniteHandling(owner, self.pool, self.statistics,
                                            self.device_finite_checks(owner))

    def settings(self) -> dict:
        return dict(super().settings(), warmup_steps=self.warmup_steps,
                    min_compress_numel=self.min_compress_numel)

    def __getstate__(self) -> dict:
        """Pickle without the pool (its storage belongs to this process)."""
        state = super().__getstate__()
        del state["pool"], state["callbacks"], state["non_finite"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start_process_parts()

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether this hook can compress gradients of ``dtype``."""
        return dtype in GRADIENT_DTYPES

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
        self.non_finite.collect_device_findings()  # CUDA: no NaN residual into the checkpoint
        local = {"stats": dict(self.statistics.counters), "plan": self.plan.state_dict()}
        world_size, parts = gather_rank_parts(local, self.process_group)
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
        mine = part_of_this_rank(state_dict["world_size"], state_dict["ranks"], self.process_group,
                                 redistribute)
        self.statistics.counters.update(mine["stats"])
        self.plan.load_state_dict(mine["plan"])

    # ----------------------------------------------------------------------- running
    def run(self, bucket: dist.GradBucket, send: SendFunction) -> torch.futures.Future[torch.Tensor]:
        """Process one bucket: dense during warm-up, for small buckets or a layout the plan
        does not hold yet; else ``send`` each plan bucket's worth of it. Advances
        :attr:`step` after the last bucket."""
        params = bucket.parameters()
        self.claim(bucket, params)
        self.non_finite.collect_device_findings()  # CUDA: a bucket handed on holding NaN earlier
        self.callbacks.settle()
        grad = bucket.buffer()
        if not self.accepts(grad.dtype):
            raise TypeError(f"{type(self).__name__}: bucket {bucket.index()} has dtype "
                            f"{grad.dtype}; gradients must be float32, bfloat16 or float16")
        compressing = self.step >= self.warmup_steps
        route = None
        if compressing and grad.numel() >= self.min_compress_numel:
            route = self.plan.route(bucket, params, grad.device)
            if route is None:
                self.statistics.count("dense_fallbacks")
        else:
            self.plan.keys_of(bucket)  # learn the provisional layout's keys
        if self.dropped_units is not None:
            send = send_kept_part(send, self.dropped_units.units)
        try:
            if route is None:
                future = self.send_dense(grad, compressing, bucket.parameters())
            elif route.in_place:
                future = send(self, route.parts[0], grad, bucket.index())
            else:
                future = self._send_parts(route, grad, bucket.index(), send)
        except NonFiniteGradient as found:  # every rank found it (an agreed value)
            future = self.non_finite.hand_on(grad, found)
        self.end_bucket(bucket)
        self.non_finite.warn_once()
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
