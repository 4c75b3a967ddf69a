"""The plan: error-feedback state laid out by parameter, so it survives DDP's bucket rebuild
and a resumed run.

Why keyed by parameter: DDP's first iteration runs with a provisional bucket layout and every
later one with the rebuilt layout (other order, other partition; a resumed run goes through
both again). State laid out by bucket index and flat offset would be silently misaligned
after a rebuild or a resume. Here each parameter gets a stable key, its position in the
provisional layout (``"<bucket index>.<position>"``, the same in every process running the
same model), and each :class:`PlanBucket` stores flat state for an ordered tuple of keys.
:meth:`Plan.route` maps an incoming bucket onto plan buckets:

* a bucket equal to one plan bucket (every step after the rebuild): processed in place;
* a bucket made of whole plan buckets (the provisional layout of a resumed run): each plan
  bucket's slice is gathered into plan order, processed, and scattered back, so a resumed run
  computes exactly what the uninterrupted run did;
* any other bucket in the provisional layout: no route (the caller sends it dense while every
  residual stays held, nothing is lost); a new layout that persists gets new plan buckets,
  each parameter's state moved into them.
"""

import itertools
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger("hetero_comm")

__all__ = ["PlanBucket", "Plan", "Route", "redistribute"]


def starts(numels: Sequence[int]) -> Tuple[int, ...]:
    """Offset of each of consecutive pieces of the given sizes in their flat buffer."""
    return (0,) + tuple(itertools.accumulate(numels))[:-1] if numels else ()


class PlanBucket:
    """Error-feedback state for an ordered tuple of parameters (one DDP bucket's worth).

    ``tensors`` holds flat float32 buffers of ``numel`` elements laid out like the bucket
    (e.g. ``"residual"``); ``extra`` holds anything else a hook keeps (e.g. the next
    selection).
    """

    def __init__(self, keys: Tuple[str, ...], numels: Tuple[int, ...]) -> None:
        self.keys = keys
        self.numels = numels
        self.offsets = starts(numels)
        self.numel = sum(numels)
        self.tensors: Dict[str, torch.Tensor] = {}
        self.extra: Dict[str, object] = {}

    @property
    def origin(self) -> "PlanBucket":
        """The plan bucket whose state this one holds or views (itself here)."""
        return self

    def slice_of(self, name: str, key: str) -> torch.Tensor:
        position = self.keys.index(key)
        start = self.offsets[position]
        return self.tensors[name][start: start + self.numels[position]]

    def to(self, device: torch.device) -> "PlanBucket":
        """Move the state to ``device`` (a checkpoint may be loaded onto another device)."""
        for name, tensor in self.tensors.items():
            if tensor.device != device:
                self.tensors[name] = tensor.to(device)
        for name, value in self.extra.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                self.extra[name] = value.to(device)
        return self

    def reset(self) -> None:
        """Forget everything held (after a non-finite gradient reached it)."""
        for tensor in self.tensors.values():
            tensor.zero_()


class Route:
    """How one incoming bucket maps onto plan buckets: ``parts``, each lying whole inside
    the bucket, in a rank-independent order; ``in_place`` when the bucket is exactly
    ``parts[0]`` (nothing to gather)."""

    def __init__(self, parts: List[PlanBucket], keys: Tuple[str, ...], numels: Tuple[int, ...],
                 device: torch.device) -> None:
        self.parts = sorted((part.to(device) for part in parts), key=lambda part: part.keys[0])
        self.in_place = len(parts) == 1 and parts[0].keys == keys
        self._offset_of_key = dict(zip(keys, starts(numels)))

    def _pieces(self, part: PlanBucket):
        for key, start, numel in zip(part.keys, part.offsets, part.numels):
            yield self._offset_of_key[key], start, numel

    def gather(self, part: PlanBucket, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``part``'s parameters' slices of the bucket ``grad``, in ``part``'s layout."""
        for offset, start, numel in self._pieces(part):
            out[start: start + numel].copy_(grad[offset: offset + numel])
        return out

    def scatter(self, part: PlanBucket, values: torch.Tensor, grad: torch.Tensor) -> None:
        """Inverse of :meth:`gather`: ``values`` (``part``'s layout) into the bucket."""
        for offset, start, numel in self._pieces(part):
            grad[offset: offset + numel].copy_(values[start: start + numel])


class Plan:
    """Stable parameter keys, the plan buckets that hold each key's state, and the routing of
    incoming buckets onto them.

    Args:
        tensor_names: the flat float32 buffers every plan bucket keeps (e.g. ``("residual",)``).
        owner: a name for log messages (the hook state's class).
    """

    def __init__(self, tensor_names: Tuple[str, ...], owner: str) -> None:
        self.tensor_names = tensor_names
        self.owner = owner
        self.buckets: List[PlanBucket] = []
        self._bucket_of_key: Dict[str, PlanBucket] = {}
        self._key_of_param: Dict[int, str] = {}  # id(parameter) -> key
        self._param_of_key: Dict[str, torch.Tensor] = {}  # also keeps those ids valid
        self._numel_of_key: Dict[str, int] = {}
        self._fallback_layouts: set = set()
        # (the bucket's parameter ids, device) -> its route, while the plan buckets stay
        self._routes: Dict[tuple, Route] = {}

    # ---------------------------------------------------------------------- keys
    def keys_of(self, bucket: dist.GradBucket) -> Tuple[Tuple[str, ...], Tuple[int, ...], bool]:
        """Stable keys of the bucket's parameters (learnt at this model's first iteration),
        their sizes, and whether the bucket is in the provisional layout."""
        params = bucket.parameters()
        # All known or none (HookState.claim has refused parameters of another model).
        if id(params[0]) not in self._key_of_param:  # this model's first iteration
            for position, p in enumerate(params):
                self._learn_key(f"{bucket.index()}.{position}", p)
        keys = tuple(self._key_of_param[id(p)] for p in params)
        numels = tuple(p.numel() for p in params)
        provisional = keys == tuple(f"{bucket.index()}.{i}" for i in range(len(params)))
        return keys, numels, provisional

    def _learn_key(self, key: str, param: torch.Tensor) -> None:
        expected = self._numel_of_key.get(key)
        if expected is not None and expected != param.numel():
            raise ValueError(f"parameter {key} has {param.numel()} elements but the loaded "
                             f"state_dict has {expected}: it is for another model")
        self._key_of_param[id(param)] = key
        self._param_of_key[key] = param
        self._numel_of_key[key] = param.numel()

    def parameters_of(self, part: PlanBucket) -> List[torch.Tensor]:
        """The parameters whose state ``part`` holds, in its layout."""
        return [self._param_of_key[key] for key in part.keys]

    # ------------------------------------------------------------------- routing
    def route(self, bucket: dist.GradBucket, params: List[torch.Tensor],
              device: torch.device) -> Optional[Route]:
        """The plan buckets that hold this bucket's state (``params``, its parameters, on
        ``device``), created or re-laid-out where needed; ``None``: send this bucket dense
        this time (see the module docstring). A route found is kept until a plan bucket is
        added."""
        known = (tuple(map(id, params)), device)
        route = self._routes.get(known)
        if route is None:
            route = self._route(bucket, device)
            if route is not None:
                self._routes[known] = route
        return route

    def _route(self, bucket: dist.GradBucket, device: torch.device) -> Optional[Route]:
        keys, numels, provisional = self.keys_of(bucket)
        owners = [self._bucket_of_key.get(key) for key in keys]
        if all(owner is None for owner in owners):
            return Route([self._new_bucket(keys, numels, device)], keys, numels, device)
        if all(owner is not None for owner in owners):
            distinct = list({id(o): o for o in owners}.values())
            if all(set(o.keys) <= set(keys) for o in distinct):
                return Route(distinct, keys, numels, device)
        if provisional and keys not in self._fallback_layouts:
            self._fallback_layouts.add(keys)
            return None
        logger.info("%s: new bucket layout for %d parameters; moving their state",
                    self.owner, len(keys))
        return Route([self._new_bucket(keys, numels, device)], keys, numels, device)

    def _new_bucket(self, keys, numels, device) -> PlanBucket:
        """A plan bucket for ``keys``, taking over each key's state from its old plan bucket
        (zeros for keys without state)."""
        plan_bucket = PlanBucket(keys, numels)
        for name in self.tensor_names:
            flat = torch.zeros(plan_bucket.numel, dtype=torch.float32, device=device)
            for key, start, numel in zip(keys, plan_bucket.offsets, numels):
                old = self._bucket_of_key.get(key)
                if old is not None:
                    flat[start: start + numel].copy_(old.to(device).slice_of(name, key))
            plan_bucket.tensors[name] = flat
        self._add(plan_bucket)
        self._drop_orphans()
        return plan_bucket

    def _add(self, plan_bucket: PlanBucket) -> None:
        self._routes.clear()
        self.buckets.append(plan_bucket)
        for key, numel in zip(plan_bucket.keys, plan_bucket.numels):
            self._bucket_of_key[key] = plan_bucket
            self._numel_of_key[key] = numel

    def _drop_orphans(self) -> None:
        owners = {id(b) for b in self._bucket_of_key.values()}
        self.buckets = [b for b in self.buckets if id(b) in owners]

    # ------------------------------------------------------------ what is held back
    def held_back(self, parameters, name: str = "residual") -> List[torch.Tensor]:
        """Each parameter's slice of the ``name`` buffer, shaped like the parameter (zeros
        where nothing is held)."""
        held = []
        for p in parameters:
            key = self._key_of_param.get(id(p))
            owner = self._bucket_of_key.get(key) if key is not None else None
            if owner is None or name not in owner.tensors:
                held.append(torch.zeros_like(p, dtype=torch.float32))
            else:
                held.append(owner.slice_of(name, key).view(p.shape).clone())
        return held

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> List[dict]:
        """Every plan bucket's keys, sizes and state (copied to the CPU)."""
        return [{"keys": list(b.keys), "numels": list(b.numels),
                 "tensors": {k: _cpu_copy(v) for k, v in b.tensors.items()},
                 "extra": {k: _cpu_copy(v) for k, v in b.extra.items()}}
                for b in self.buckets]

    def load_state_dict(self, saved_buckets: List[dict]) -> None:
        """Replace the plan buckets by the saved ones; parameter keys are learnt again at the
        next first iteration (a new model's parameters are new objects)."""
        self.buckets, self._bucket_of_key, self._fallback_layouts = [], {}, set()
        self._routes.clear()
        for saved in saved_buckets:
            plan_bucket = PlanBucket(tuple(saved["keys"]), tuple(int(n) for n in saved["numels"]))
            plan_bucket.tensors = {k: v.detach().clone() for k, v in saved["tensors"].items()}
            plan_bucket.extra = {k: _cpu_copy(v) for k, v in saved["extra"].items()}
            self._add(plan_bucket)

    def __getstate__(self) -> dict:
        """Pickle without the parameter objects: they belong to this process's model, and
        the keys are learnt again at the next first iteration."""
        state = dict(self.__dict__)
        state["_key_of_param"], state["_param_of_key"], state["_routes"] = {}, {}, {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_routes", {})  # pickled before routes were kept


def _cpu_copy(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def redistribute(saved_plans: List[List[dict]], world_size: int) -> List[dict]:
    """One rank's plan state, from the saved plan states of every rank of another world size:
    each buffer summed over the saved ranks and divided by ``world_size``, so that the new
    ranks together hold back what the saved ranks did; what the ranks agree on (``extra``)
    from the first."""
    layouts = {tuple(tuple(b["keys"]) for b in plan) for plan in saved_plans}
    if len(layouts) != 1:
        raise ValueError("the saved ranks' error-feedback state has different layouts; it "
                         "cannot be redistributed")
    merged = []
    for buckets in zip(*saved_plans):
        tensors = {name: sum(b["tensors"][name] for b in buckets) / world_size
                   for name in buckets[0]["tensors"]}
        merged.append(dict(buckets[0], tensors=tensors))
    return merged
