"""Split a model into pipeline stages across unequal devices.

* :func:`capability_order`: the devices' stage order, by the ratio of compute capability to sync cost.
* :func:`plan_pipeline`: contiguous layer ranges (and where to recompute) by an integer program
  (``scipy.optimize.milp``, HiGHS) that minimises the cost model of :mod:`.cost`.
* :func:`exhaustive_plan`: the same minimum by trying every split; the ILP's check on small cases.
* :func:`proportional_plan` / :func:`even_plan`: the proportional rule of thumb and the naive split.
"""

import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_choice, check_float, check_int
from .cost import Cluster, DeviceKind, estimate_step, stage_estimates
from .plan import SCHEDULES, PipelinePlan, StagePlan

__all__ = ["capability_order", "plan_pipeline", "exhaustive_plan", "proportional_plan",
           "even_plan", "evaluate_plan"]


def _compute_capability(device: DeviceKind) -> float:
    """Micro-batches per second through the whole model on this device."""
    total = sum(device.profile.forward_s) + sum(device.profile.backward_s)
    return math.inf if total == 0 else 1.0 / total


def capability_order(cluster: Cluster) -> Tuple[DeviceKind, ...]:
    """The stage order: largest ratio of compute capability to communication cost first.

    Each device's share of the model is proportional to its capability (equal stage times), so
    its sync cost is ``share * model bytes * 2 (m - 1) / m / its bandwidth``. Ties (e.g. one
    shared bandwidth, where the ratio is the same for all) put the smaller sync first: a later
    stage finishes its backward earlier, so its sync overlaps the rest of the drain.
    """
    capability = {d.name: _compute_capability(d) for d in cluster.devices}
    total_capability = sum(capability.values())
    model_bytes = sum(cluster.devices[0].profile.param_bytes)

    def key(device: DeviceKind):
        share = 1.0 if math.isinf(total_capability) else capability[device.name] / total_capability
        sync = share * model_bytes * cluster.sync_seconds_per_byte(device)
        ratio = math.inf if sync == 0 else capability[device.name] / sync
        return (-ratio, sync, device.name)

    return tuple(sorted(cluster.devices, key=key))


def _resolve_order(cluster: Cluster, order) -> Tuple[DeviceKind, ...]:
    if isinstance(order, str) and order == "capability":
        return capability_order(cluster)
    names = list(order)
    if sorted(names) != sorted(d.name for d in cluster.devices):
        raise ValueError(f"order must name every device kind once; got {names}, the cluster has "
                         f"{[d.name for d in cluster.devices]}")
    return tuple(cluster.device(name) for name in names)


def _check_request(cluster: Cluster, micro_batches: int, schedule: str) -> None:
    check_int("micro_batches", micro_batches, 1)
    check_choice("schedule", schedule, SCHEDULES)
    if cluster.num_layers < len(cluster.devices):
        raise ValueError(
            f"the model has {cluster.num_layers} layers but each machine has {len(cluster.devices)} "
            f"device kinds, one stage each; give the planner finer layers or fewer device kinds")


def _make_plan(cluster, order, boundaries, recompute, micro_batches, schedule) -> PipelinePlan:
    estimates = stage_estimates(cluster, order, boundaries, recompute, micro_batches, schedule)
    stages = tuple(
        StagePlan(device.name, boundaries[s], boundaries[s + 1], bool(recompute[s]),
                  e.forward_s, e.backward_s, int(round(e.memory_bytes)) if math.isfinite(e.memory_bytes)
                  else 0, e.sync_s)
        for s, (device, e) in enumerate(zip(order, estimates)))
    return PipelinePlan(stages, micro_batches, schedule,
                        estimate_step(estimates, micro_batches, schedule))


def evaluate_plan(cluster: Cluster, plan: PipelinePlan) -> PipelinePlan:
    """``plan`` with the cost model's predictions filled in for ``cluster``."""
    if plan.num_layers != cluster.num_layers:
        raise ValueError(f"the plan covers {plan.num_layers} layers, the cluster's profiles "
                         f"{cluster.num_layers}")
    order = tuple(cluster.device(stage.device) for stage in plan.stages)
    boundaries = [stage.first_layer for stage in plan.stages] + [plan.num_layers]
    return _make_plan(cluster, order, boundaries, [s.recompute for s in plan.stages],
                      plan.micro_batches, plan.schedule)


def _fits(cluster, order, boundaries, recompute, micro_batches, schedule) -> bool:
    estimates = stage_estimates(cluster, order, boundaries, recompute, micro_batches, schedule)
    return all(e.memory_bytes <= d.memory_bytes for e, d in zip(estimates, order))


def exhaustive_plan(cluster: Cluster, micro_batches: int, schedule: str = "gpipe", *,
                    order="capability", allow_recompute: bool = True) -> PipelinePlan:
    """The best plan under the cost model by trying every split and recompute choice.

    Exponential: for checking :func:`plan_pipeline` on small cases only.
    """
    _check_request(cluster, micro_batches, schedule)
    order = _resolve_order(cluster, order)
    num_stages, num_layers = len(order), cluster.num_layers
    best: Optional[Tuple[float, int, list, tuple]] = None
    choices = list(itertools.product((False, True), repeat=num_stages)) if allow_recompute else \
        [(False,) * num_stages]
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        boundaries = [0, *cuts, num_layers]
        for recompute in choices:
            if not _fits(cluster, order, boundaries, recompute, micro_batches, schedule):
                continue
            estimates = stage_estimates(cluster, order, boundaries, recompute, micro_batches, schedule)
            candidate = (estimate_step(estimates, micro_batches, schedule), sum(recompute),
                         boundaries, recompute)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is None:
        raise ValueError(_no_fit_message(cluster, order, micro_batches, schedule))
    return _make_plan(cluster, order, best[2], best[3], micro_batches, schedule)


def _no_fit_message(cluster, order, micro_batches, schedule) -> str:
    needs = []
    profile = cluster.devices[0].profile
    for device in order:
        smallest = min(cluster.state_bytes_per_param_byte * p + s
                       for p, s in zip(profile.param_bytes, device.profile.saved_bytes))
        if smallest > device.memory_bytes:
            needs.append(f"{device.name!r} has {device.memory_bytes:.3g} bytes but even its "
                         f"smallest single layer needs {smallest:.3g}")
    detail = "; ".join(needs) if needs else "no split of the layers fits every device at once"
    return (f"no pipeline plan fits in memory ({schedule}, {micro_batches} micro-batches): {detail}. "
            f"Give the devices more memory, use 1f1b (fewer micro-batches in flight), allow "
            f"recompute, or split the large layers")


def proportional_plan(cluster: Cluster, micro_batches: int, schedule: str = "gpipe", *,
                      order="capability") -> PipelinePlan:
    """The proportional rule: layers in proportion to each device's compute capability (the
    largest remainders rounded up, at least one layer each). Exact only for equal layers."""
    _check_request(cluster, micro_batches, schedule)
    order = _resolve_order(cluster, order)
    capability = [_compute_capability(d) for d in order]
    counts = _apportion(cluster.num_layers, capability)
    boundaries = [0, *itertools.accumulate(counts)]
    return _make_plan(cluster, order, boundaries, [False] * len(order), micro_batches, schedule)


def even_plan(cluster: Cluster, micro_batches: int, schedule: str = "gpipe", *,
              order="capability") -> PipelinePlan:
    """Equal numbers of layers per stage (the first stages take the remainder)."""
    _check_request(cluster, micro_batches, schedule)
    order = _resolve_order(cluster, order)
    counts = _apportion(cluster.num_layers, [1.0] * len(order))
    boundaries = [0, *itertools.accumulate(counts)]
    return _make_plan(cluster, order, boundaries, [False] * len(order), micro_batches, schedule)


def _apportion(total: int, weights: Sequence[float]) -> List[int]:
    """``total`` items in proportion to ``weights``, each at least 1 (largest remainder)."""
    weights = [1.0 if math.isinf(w) else w for w in weights]
    spare = total - len(weights)
    exact = [spare * w / sum(weights) for w in weights]
    counts = [1 + int(math.floor(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def plan_pipeline(cluster: Cluster, micro_batches: int, schedule: str = "gpipe", *,
                  order="capability", allow_recompute: bool = True,
                  time_limit_s: float = 30.0) -> PipelinePlan:
    """Split the model into one contiguous stage per device kind, minimising the step time.

    1. Order the devices (:func:`capability_order`, or ``order``: a sequence of device kind names).
    2. Solve the integer program of :mod:`._milp` (HiGHS): where each stage starts and whether
       it recomputes its activations, under each device's memory limit (first without the
       limits: if that optimum fits, it is the answer). Recomputation is chosen only where
       needed to fit, on stages whose extra forward hides in the pipeline's idle time
       whenever such a plan is as fast.
    3. Fill in the cost model's predictions (:func:`~hetero_comm.pipeline.simulate` gives the
       schedule's timeline).

    Args:
        cluster: the devices of one machine, their profiles and the links.
        micro_batches: ``k``, micro-batches per step and machine.
        schedule: ``"gpipe"`` or ``"1f1b"``.

    Returns:
        a :class:`PipelinePlan` with every stage's predicted figures.

    Raises:
        ValueError: fewer layers than device kinds, inconsistent profiles, or no plan fits in
            memory (the message says which device and what to change).

    Example::

        >>> cluster = Cluster((DeviceKind("fast", fast_profile, memory_bytes=8e9),
        ...                    DeviceKind("slow", slow_profile, memory_bytes=4e9)), machines=2,
        ...                   sync_bytes_per_s=1.25e9)
        >>> plan = plan_pipeline(cluster, micro_batches=8)
        >>> print(format_plan(plan))
    """
    _check_request(cluster, micro_batches, schedule)
    check_float("time_limit_s", time_limit_s, 0, math.inf, low_open=True)
    order = _resolve_order(cluster, order)
    from ._milp import solve_partition
    # The best plan with no memory limit and no recomputation is a lower bound on the step;
    # when it fits anyway it is the answer, and that program is several times easier.
    boundaries, recompute, message = solve_partition(cluster, order, micro_batches, schedule, False,
                                                     time_limit_s, memory_limits=False)
    if not boundaries or not _fits(cluster, order, boundaries, recompute, micro_batches, schedule):
        boundaries, recompute, message = solve_partition(cluster, order, micro_batches, schedule,
                                                         allow_recompute, time_limit_s)
    if not boundaries:
        if "infeasible" in message.lower():
            raise ValueError(_no_fit_message(cluster, order, micro_batches, schedule))
        raise RuntimeError(f"the planner's integer program found no plan: {message}")
    return _make_plan(cluster, order, boundaries, recompute, micro_batches, schedule)
