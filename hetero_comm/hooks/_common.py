"""What every hetero_comm DDP communication hook shares.

* :class:`HookState`: the settings shared by every hook (process group, rank weight,
  warm-up, minimum bucket size), statistics, the buffer pool, checkpointing, and the *plan*:
  the per-bucket error-feedback state laid out by parameter so that it survives DDP's
  bucket rebuild and a resumed run.
* :func:`allreduce_hook`: the dense baseline with the same weighting as the compressed hooks.

Why a plan keyed by parameter: DDP's first iteration runs with a provisional bucket layout and
every later one with the rebuilt layout (other order, other partition; a resumed run goes
through both again). State laid out by bucket index and flat offset would be silently
misaligned after a rebuild or a resume. Here each parameter gets a stable key, its position in
the provisional layout (``"<bucket index>.<position>"``, the same in every process running
the same model), and each *plan bucket* stores flat state for an ordered tuple of keys:

* an incoming bucket equal to a plan bucket (every step after the rebuild) is processed in
  place, with no copy;
* an incoming bucket made of whole plan buckets (the provisional layout of a resumed run) is
  processed plan bucket by plan bucket, gathered into plan order, so a resumed run computes
  exactly what the uninterrupted run did;
* any other bucket in the provisional layout is sent dense while every residual stays held
  (nothing is lost); a new layout that persists gets new plan buckets, each parameter's
  state moved into them.
"""


import itertools
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._checks import check_float, check_int
from ..buffer_pool import BufferPool

logger = logging.getLogger("hetero_comm")

__all__ = ["HookState", "AllreduceState", "allreduce_hook"]

GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def starts(numels: Sequence[int]) -> Tuple[int, ...]:
    """Offset of each of consecutive pieces of the given sizes in their flat buffer."""
    return (0,) + tuple(itertools.accumulate(numels))[:-1] if numels else ()


class PlanBucket:
    """Error-feedback state for an ordered tuple of parameters (one DDP bucket's worth).

    ``tensors`` holds flat float32 buffers of ``numel`` elements laid out like the bucket
    (e.g. ``"residual"``); ``extra`` holds anything else a hook keeps (e.g. its indicator).
    """

    def __init__(self, keys: Tuple[str, ...], numels: Tuple[int, ...]) -> None:
        self.keys = keys
        self.numels = numels
        self.offsets = starts(numels)
        self.numel = sum(numels)
        self.tensors: Dict[str, torch.Tensor] = {}
        self.extra: Dict[str, object] = {}

    def slice_of(self, name: str, key: str) -> torch.Tensor:
        position = self.keys.index(key)
        start = self.offsets[position]
        return self.tensors[name][start: start + self.numels[position]]


class _Timer:
    """Adds the seconds spent inside ``with`` to ``stats[field]``."""

    def __init__(self, stats: dict, field: str) -> None:
        self.stats, self.field = stats, field

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats[self.field] += time.perf_counter() - self.start


class HookState:
    """Settings, statistics, buffers and checkpointing shared by the hetero_comm hooks.

    Args:
        process_group: the group to communicate in (``None``: the default group).
        rank_weight: this rank's weight ``w_i`` in the result ``sum_i w_i * g_i``
            (``None``: ``1 / world_size``, the plain average). The weights of all ranks
            should sum to 1; the heterogeneous-batch planner sets
            ``w_i = local_batch_i / global_batch``. May be changed between steps.
        warmup_steps: steps sent dense (plain weighted allreduce) before compressing, >= 1
            because DDP's first iteration runs with a provisional bucket layout.
        min_compress_numel: buckets with fewer elements are always sent dense, >= 0.
    """

    # Hook-specific settings that must match when loading a checkpoint.
    _checkpoint_settings: Tuple[str, ...] = ()
    # Names of the flat float32 buffers each plan bucket keeps.
    _plan_tensors: Tuple[str, ...] = ()

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None, warmup_steps: int = 1,
                 min_compress_numel: int = 0) -> None:
        # Settings.
        self.process_group = process_group
        self.rank_weight = rank_weight
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        # Internal state.
        self.step = 0
        self.pool = BufferPool()
        self._plan: List[PlanBucket] = []
        self._plan_of_key: Dict[str, PlanBucket] = {}
        self._key_of_param: Dict[int, str] = {}  # id(parameter) -> key
        self._params_seen: List[torch.Tensor] = []  # keeps those ids valid
        self._numel_of_key: Dict[str, int] = {}
        self._fallback_layouts: set = set()
        # Statistics.
        self._stats = dict(bytes_sent=0, bytes_dense=0, compressed_bytes_sent=0,
                           compressed_bytes_dense=0, encode_seconds=0.0, decode_seconds=0.0,
                           dense_fallbacks=0)

    # ---------------------------------------------------------------- settings and logging
    @property
    def rank_weight(self) -> Optional[float]:
        return self._rank_weight

    @rank_weight.setter
    def rank_weight(self, value: Optional[float]) -> None:
        if value is not None:
            value = check_float("rank_weight", value, 0.0, 1.0)
        self._rank_weight = value

    def weight(self) -> float:
        """The weight applied to this rank's gradient this step."""
        if self._rank_weight is not None:
            return self._rank_weight
        return 1.0 / dist.get_world_size(self.process_group)

    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def settings(self) -> dict:
        """The settings of this state, as passed to the constructor."""
        return dict(rank_weight=self._rank_weight, warmup_steps=self.warmup_steps,
                    min_compress_numel=self.min_compress_numel)

    def _log_settings(self) -> None:
        logger.info("%s: %s", type(self).__name__,
                    ", ".join(f"{k}={v}" for k, v in self.settings().items()))

    def __getstate__(self) -> dict:
        """Pickle without the process group and the pool (neither is picklable); the
        unpickled state uses the default group unless one is assigned."""
        state = dict(self.__dict__)
        state["process_group"] = None
        del state["pool"]
        state["_key_of_param"], state["_params_seen"] = {}, []
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pool = BufferPool()

    # ------------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Totals since construction (or the loaded checkpoint).

        Returns:
            dict with ``steps``; ``bytes_sent`` and ``bytes_dense`` (bytes this rank handed to
            collectives, and what plain allreduce of the same gradients would have handed,
            warm-up included); ``compression_ratio`` (dense-equivalent bytes / bytes sent,
            over the compressed steps only, everything on the wire counted: values,
            importance, scales; ``nan`` before the first compressed step);
            ``encode_seconds`` and ``decode_seconds`` (time in the hook around the
            collectives); ``dense_fallbacks`` (buckets sent dense because their layout did
            not match the plan, see the module docstring); ``pool`` (the buffer pool's
            counters).
        """
        s = dict(self._stats)
        sent, dense = s.pop("compressed_bytes_sent"), s.pop("compressed_bytes_dense")
        s["compression_ratio"] = dense / sent if sent else float("nan")
        s["steps"] = self.step
        s["pool"] = self.pool.stats()
        return s

    def _count_bytes(self, dense: int, sent: int, compressed_step: bool) -> None:
        self._stats["bytes_dense"] += dense
        self._stats["bytes_sent"] += sent
        if compressed_step:
            self._stats["compressed_bytes_dense"] += dense
            self._stats["compressed_bytes_sent"] += sent

    def _timer(self, field: str) -> _Timer:
        return _Timer(self._stats, field)

    def held_back(self, parameters) -> List[torch.Tensor]:
        """What error feedback holds back for each parameter (its slice of the residual,
        shaped like the parameter; zeros where nothing is held). In the units of the result:
        already multiplied by this rank's weight."""
        held = []
        for p in parameters:
            key = self._key_of_param.get(id(p))
            owner = self._plan_of_key.get(key) if key is not None else None
            if owner is None or "residual" not in owner.tensors:
                held.append(torch.zeros_like(p, dtype=torch.float32))
            else:
                held.append(owner.slice_of("residual", key).view(p.shape).clone())
        return held

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly: step counter, statistics
        and per-parameter-group error-feedback state (tensors are cloned)."""
        self._drop_orphans()
        return {
            "type": type(self).__name__,
            "settings": {name: getattr(self, name) for name in self._checkpoint_settings},
            "step": self.step,
            "stats": dict(self._stats),
            "plan": [{"keys": list(b.keys), "numels": list(b.numels),
                      "tensors": {k: v.detach().clone() for k, v in b.tensors.items()},
                      "extra": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                for k, v in b.extra.items()}}
                     for b in self._plan],
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
        self._plan, self._plan_of_key, self._fallback_layouts = [], {}, set()
        for saved in state_dict["plan"]:
            bucket = PlanBucket(tuple(saved["keys"]), tuple(int(n) for n in saved["numels"]))
            bucket.tensors = {k: v.detach().clone() for k, v in saved["tensors"].items()}
            bucket.extra = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in saved["extra"].items()}
            self._add_plan_bucket(bucket)

    # -------------------------------------------------------------------- the plan
    def _keys_of(self, bucket: dist.GradBucket) -> Tuple[Tuple[str, ...], Tuple[int, ...], bool]:
        """Stable keys of the bucket's parameters, their sizes, and whether the bucket is in
        the provisional layout (its keys are its own index and positions)."""
        params = bucket.parameters()
        known = [id(p) in self._key_of_param for p in params]
        if not any(known):  # first iteration of this model: the provisional layout
            for position, p in enumerate(params):
                key = f"{bucket.index()}.{position}"
                expected = self._numel_of_key.get(key)
                if expected is not None and expected != p.numel():
                    raise ValueError(f"parameter {key} has {p.numel()} elements but the loaded "
                                     f"state_dict has {expected}: it is for another model")
                self._key_of_param[id(p)] = key
                self._params_seen.append(p)
                self._numel_of_key[key] = p.numel()
        elif not all(known):
            raise ValueError("a DDP bucket mixes parameters this hook state has seen with new "
                             "ones; use one state per model")
        keys = tuple(self._key_of_param[id(p)] for p in params)
        numels = tuple(p.numel() for p in params)
        provisional = keys == tuple(f"{bucket.index()}.{i}" for i in range(len(params)))
        return keys, numels, provisional

    def _add_plan_bucket(self, plan_bucket: PlanBucket) -> None:
        self._plan.append(plan_bucket)
        for key, numel in zip(plan_bucket.keys, plan_bucket.numels):
            self._plan_of_key[key] = plan_bucket
            self._numel_of_key[key] = numel

    def _drop_orphans(self) -> None:
        owners = {id(b) for b in self._plan_of_key.values()}
        self._plan = [b for b in self._plan if id(b) in owners]

    def _new_plan_bucket(self, keys, numels, device) -> PlanBucket:
        """A plan bucket for ``keys``, taking over each key's state from its old plan bucket
        (zeros for keys without state); hooks then fill :attr:`PlanBucket.extra`."""
        plan_bucket = PlanBucket(keys, numels)
        for name in self._plan_tensors:
            flat = torch.zeros(plan_bucket.numel, dtype=torch.float32, device=device)
            for key, start, numel in zip(keys, plan_bucket.offsets, numels):
                old = self._plan_of_key.get(key)
                if old is not None:
                    flat[start: start + numel].copy_(old.slice_of(name, key))
            plan_bucket.tensors[name] = flat
        self._add_plan_bucket(plan_bucket)
        self._drop_orphans()
        return plan_bucket

    def _route(self, bucket: dist.GradBucket):
        """Decide how to process a bucket after warm-up.

        Returns ``("direct", plan_bucket)``, ``("gather", [plan buckets], keys, numels)`` or
        ``("dense", None)``.
        """
        keys, numels, provisional = self._keys_of(bucket)
        device = bucket.buffer().device
        owners = [self._plan_of_key.get(key) for key in keys]
        if all(owner is None for owner in owners):
            return "direct", self._new_plan_bucket(keys, numels, device)
        if all(owner is not None for owner in owners):
            distinct = list({id(o): o for o in owners}.values())
            key_set = set(keys)
            if all(set(o.keys) <= key_set for o in distinct):
                if len(distinct) == 1 and distinct[0].keys == keys:
                    return "direct", distinct[0]
                return "gather", distinct, keys, numels
        if provisional and keys not in self._fallback_layouts:
            self._fallback_layouts.add(keys)
            return "dense", None
        logger.info("%s: new bucket layout for %d parameters; moving their state",
                    type(self).__name__, len(keys))
        return "direct", self._new_plan_bucket(keys, numels, device)

    # ----------------------------------------------------------------------- running
    def _compress(self, plan_bucket: PlanBucket, grad: torch.Tensor, index: int) -> torch.futures.Future:
        """Send ``grad`` (flat, laid out like ``plan_bucket``) compressed; the future's value
        is ``grad`` overwritten with the weighted sum over ranks. Compressing hooks override
        this; a state without a compressed form (``AllreduceState``) never gets here."""
        raise TypeError(f"{type(self).__name__} has no compressed form")

    def _dense(self, grad: torch.Tensor, compressed_step: bool) -> torch.futures.Future:
        """Weighted dense allreduce of ``grad`` in place."""
        with self._timer("encode_seconds"):
            grad.mul_(self.weight())
        nbytes = grad.numel() * grad.element_size()
        self._count_bytes(nbytes, nbytes, compressed_step)
        work = dist.all_reduce(grad, group=self.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Process one bucket: dense during warm-up or for small buckets, else the hook's
        compression, routed through the plan. Advances :attr:`step` after the last bucket."""
        grad = bucket.buffer()
        if grad.dtype not in GRADIENT_DTYPES:
            raise TypeError(f"{type(self).__name__}: bucket {bucket.index()} has dtype "
                            f"{grad.dtype}; gradients must be float32, bfloat16 or float16")
        compressed_step = self.step >= self.warmup_steps
        if not compressed_step:
            self._keys_of(bucket)  # learn the provisional layout's keys
            future = self._dense(grad, False)
        elif grad.numel() < self.min_compress_numel:
            self._keys_of(bucket)
            future = self._dense(grad, True)
        else:
            route = self._route(bucket)
            if route[0] == "direct":
                future = self._compress(route[1], grad, bucket.index())
            elif route[0] == "gather":
                future = self._gather_and_compress(route[1], route[2], route[3], grad, bucket.index())
            else:
                self._stats["dense_fallbacks"] += 1
                future = self._dense(grad, True)
        if bucket.is_last():
            self.step += 1
        return future

    def _gather_and_compress(self, plan_buckets: Sequence[PlanBucket], keys, numels,
                             grad: torch.Tensor, index: int) -> torch.futures.Future:
        """Process a bucket made of whole plan buckets, each in its own layout."""
        offsets = dict(zip(keys, starts(numels)))
        parts = []
        for plan_bucket in plan_bucket_order(plan_buckets):
            part = self.pool.acquire(plan_bucket.numel, grad.dtype, grad.device)
            for key, start, numel in zip(plan_bucket.keys, plan_bucket.offsets, plan_bucket.numels):
                part[start: start + numel].copy_(grad[offsets[key]: offsets[key] + numel])
            parts.append((plan_bucket, part, self._compress(plan_bucket, part, index)))

        def scatter(_):
            for plan_bucket, part, future in parts:
                future.value()
                for key, start, numel in zip(plan_bucket.keys, plan_bucket.offsets, plan_bucket.numels):
                    grad[offsets[key]: offsets[key] + numel].copy_(part[start: start + numel])
                self.pool.release(part)
            return grad

        return torch.futures.collect_all([f for _, _, f in parts]).then(scatter)


def plan_bucket_order(plan_buckets: Sequence[PlanBucket]) -> List[PlanBucket]:
    """Plan buckets in a rank-independent order (by their first key)."""
    return sorted(plan_buckets, key=lambda b: b.keys[0])


def raise_non_finite(state: HookState, index: int, plan_bucket: Optional[PlanBucket]) -> None:
    """Reset the bucket's error-feedback state and raise: a NaN or infinity reached it."""
    if plan_bucket is not None:
        for tensor in plan_bucket.tensors.values():
            tensor.zero_()
    raise FloatingPointError(
        f"{type(state).__name__}: non-finite gradient (NaN or infinity) in DDP bucket {index} "
        f"on at least one rank at step {state.step}; this step's gradient for the bucket is "
        f"dropped and its error-feedback state reset")


class AllreduceState(HookState):
    """State of :func:`allreduce_hook`: the settings of :class:`HookState`, where
    ``warmup_steps`` and ``min_compress_numel`` change nothing (every step is dense)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None) -> None:
        super().__init__(process_group, rank_weight)
        self._log_settings()


def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Weighted dense allreduce: the baseline the compressed hooks are measured against.

    1. Multiply this rank's gradient by ``state.weight()`` (``1 / world_size`` by default).
    2. Allreduce (sum) in place.

    With the default weight this equals DDP without a hook; with ``rank_weight`` set it gives
    ``sum_i w_i * g_i`` (e.g. ranks with unequal batch sizes).

    Args:
        state: an :class:`AllreduceState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer holding the weighted sum over ranks.

    Example::

        >>> state = AllreduceState(rank_weight=local_batch / global_batch)
        >>> ddp_model.register_comm_hook(state, allreduce_hook)
    """
    future = state._dense(bucket.buffer(), False)
    if bucket.is_last():
        state.step += 1
    return future
