"""The partition as a mixed-integer linear program, solved by HiGHS (``scipy.optimize.milp``).

Variables, for layers ``l < L`` and stages ``s < S`` in a fixed device order:

* ``y[l, s]`` (binary, ``s < S - 1``): layer ``l`` is in one of the stages ``0..s``. Monotone in
  both indices, so every stage is a contiguous range: layer ``l`` is in stage ``s`` iff
  ``x(l, s) = y[l, s] - y[l, s - 1]`` is 1, and stage ``s`` ends at layer ``l`` iff
  ``y[l, s] - y[l + 1, s]`` is 1. Everything below is linear in ``y``.
* ``r[s]`` (binary): stage ``s`` recomputes; its extra forward time, the activation bytes it
  frees and the input bytes it keeps are products of ``r[s]`` with linear terms, bounded by
  big-M rows.
* ``T_F``, ``T_B`` (GPipe) or ``T`` (1F1B): the slowest stage or link per micro-batch, and
  ``Z``, the step time of :func:`~hetero_comm.pipeline.cost.estimate_step`, minimised.
"""

from typing import List, Sequence, Tuple

import numpy as np

from .._linear_program import Expression, LinearProgram, combine, const, var
from .cost import Cluster, DeviceKind


def solve_partition(cluster: Cluster, order: Sequence[DeviceKind], micro_batches: int,
                    schedule: str, allow_recompute: bool, time_limit_s: float,
                    memory_limits: bool = True) -> Tuple[List[int], List[bool], str]:
    """The optimal stage boundaries and recompute flags, and HiGHS's status message.

    ``memory_limits=False`` drops the memory rows (a relaxation, and a much easier program).
    Returns empty lists when the program is infeasible (nothing fits in memory).
    """
    program = LinearProgram()
    profile = cluster.devices[0].profile
    num_layers, num_stages, k = profile.num_layers, len(order), micro_batches
    y = {(l, s): program.variable(0, 1, True) for l in range(num_layers) for s in range(num_stages - 1)}

    def prefix(l: int, s: int) -> Expression:  # layer l is in a stage <= s
        if s < 0:
            return const(0)
        return const(1) if s == num_stages - 1 else var(y[l, s])

    def member(l: int, s: int) -> Expression:
        return combine((1, prefix(l, s)), (-1, prefix(l, s - 1)))

    def ends_at(l: int, s: int) -> Expression:  # stage s < S - 1 ends at layer l < L - 1
        return combine((1, prefix(l, s)), (-1, prefix(l + 1, s)))

    for (l, s), index in y.items():
        if l + 1 < num_layers:
            program.constrain(combine((1, var(index)), (-1, var(y[l + 1, s]))), lower=0)
    for s in range(num_stages):
        program.constrain(combine(*((1, member(l, s)) for l in range(num_layers))), lower=1)
        for l in range(num_layers):
            program.constrain(member(l, s), lower=0)

    # Times in units of an even stage's compute, memory rows as shares of the device: HiGHS's
    # tolerances are absolute, so rows of seconds next to rows of gigabytes would break them.
    time_unit = max(sum(d.profile.forward_s) + sum(d.profile.backward_s) for d in order) / num_stages
    time_unit = time_unit if time_unit > 0 else 1.0
    stages = [_stage_terms(program, cluster, order, s, k, schedule, allow_recompute, member, ends_at,
                           time_unit, memory_limits) for s in range(num_stages)]
    step = _step_terms(program, stages, k, schedule)
    recompute_flags = [stage["recompute"] for stage in stages if stage["recompute"] is not None]
    # A tiny price on recomputing: among equally fast plans, prefer the one that recomputes less.
    price = 1e-7
    objective = {step: 1.0, **{flag: price for flag in recompute_flags}}
    result = program.solve(objective, time_limit_s)
    if result.x is None:
        return [], [], result.message
    values = np.round(result.x).astype(int)
    boundaries = [0] + [int(sum(values[y[l, s]] for l in range(num_layers))) for s in range(num_stages - 1)]
    recompute = [bool(stage["recompute"] is not None and values[stage["recompute"]]) for stage in stages]
    return boundaries + [num_layers], recompute, result.message


def _stage_terms(program: LinearProgram, cluster: Cluster, order, s: int, k: int, schedule: str,
                 allow_recompute: bool, member, ends_at, time_unit: float,
                 memory_limits: bool) -> dict:
    """Stage ``s``'s forward, backward, transfer and sync seconds as expressions, with its
    memory limit and recompute linearisation added to ``program``."""
    device, profile = order[s], cluster.devices[0].profile
    num_layers, num_stages = profile.num_layers, len(order)
    forward = combine(*((device.profile.forward_s[l] / time_unit, member(l, s)) for l in range(num_layers)))
    backward = combine(*((device.profile.backward_s[l] / time_unit, member(l, s)) for l in range(num_layers)))
    params = combine(*((profile.param_bytes[l], member(l, s)) for l in range(num_layers)))
    saved = combine(*((device.profile.saved_bytes[l], member(l, s)) for l in range(num_layers)))
    transfer = const(0)
    if s < num_stages - 1:
        transfer = combine(*((profile.output_bytes[l] / cluster.stage_bytes_per_s / time_unit, ends_at(l, s))
                              for l in range(num_layers - 1)))
    in_flight = k if schedule == "gpipe" else min(k, num_stages - s)
    memory = combine((cluster.state_bytes_per_param_byte, params), (in_flight, saved))
    flag = None
    if allow_recompute:
        flag = program.variable(0, 1, True)
        stage_input = const(profile.input_bytes) if s == 0 else combine(
            *((profile.output_bytes[l], ends_at(l, s - 1)) for l in range(num_layers - 1)))
        largest_input = max([profile.input_bytes, *profile.output_bytes])
        kept_input = program.variable()  # = flag * stage input, from below; memory pushes it down
        program.constrain(combine((1, var(kept_input)), (-1, stage_input), (-largest_input, var(flag))),
                          lower=-largest_input)
        # Recomputing adds the stage's recomputation to its backward and frees all but one
        # micro-batch's saved activations: bilinear in (placement, flag), so bounded by big-M
        # rows; the objective keeps the time at its least, the memory row the freed bytes at most.
        recomputed_forward = program.variable()
        largest_forward = (sum(device.profile.forward_s) + max(
            0.0, *(r - f for f, r in zip(device.profile.forward_s, device.profile.recompute_s)))) / time_unit
        program.constrain(combine((1, var(recomputed_forward)), (-1, _recomputation(device.profile, s,
                                   num_stages, ends_at, forward, time_unit)),
                                   (-largest_forward, var(flag))), lower=-largest_forward)
        freed = program.variable()
        program.constrain(combine((1, var(freed)), (-1, saved)), upper=0)
        program.constrain(combine((1, var(freed)), (-sum(device.profile.saved_bytes), var(flag))),
                          upper=0)
        backward = combine((1, backward), (1, var(recomputed_forward)))
        memory = combine((1, memory), (1 - in_flight, var(freed)), (in_flight, var(kept_input)))
    if memory_limits and np.isfinite(device.memory_bytes):
        program.constrain(combine((1 / device.memory_bytes, memory)), upper=1)
    update = combine(*((device.profile.update_s[l] / time_unit, member(l, s)) for l in range(num_layers)))
    sync = combine((cluster.sync_seconds_per_byte(device) / time_unit, params), (1, update))
    return {"forward": forward, "backward": backward, "transfer": transfer, "sync": sync,
            "recompute": flag}


def _recomputation(profile, s: int, num_stages: int, ends_at, forward: Expression,
                   time_unit: float) -> Expression:
    """Stage ``s``'s recomputation (:func:`~hetero_comm.pipeline.profile.recompute_seconds`):
    its forward, less what early stopping saves in the layer it ends at."""
    num_layers = profile.num_layers

    def saving(l):
        return (profile.forward_s[l] - profile.recompute_s[l]) / time_unit

    if s == num_stages - 1:  # the last stage ends at the last layer
        return combine((1, forward), (-saving(num_layers - 1), const(1)))
    return combine((1, forward), *((-saving(l), ends_at(l, s)) for l in range(num_layers - 1)))


def _step_terms(program: LinearProgram, stages: List[dict], k: int, schedule: str) -> int:
    """Add the pipeline and step-time rows of the cost model; return the step variable."""
    fill = combine(*((1, st["forward"]) for st in stages), *((1, st["backward"]) for st in stages),
                    *((2, st["transfer"]) for st in stages))
    if schedule == "gpipe":
        slowest_forward, slowest_backward = program.variable(), program.variable()
        for st in stages:
            for slowest, part in ((slowest_forward, "forward"), (slowest_backward, "backward")):
                program.constrain(combine((1, var(slowest)), (-1, st[part])), lower=0)
                program.constrain(combine((1, var(slowest)), (-1, st["transfer"])), lower=0)
        pipe = combine((1, fill), (k - 1, var(slowest_forward)), (k - 1, var(slowest_backward)))
    else:
        slowest = program.variable()
        for st in stages:
            program.constrain(combine((1, var(slowest)), (-1, st["forward"]), (-1, st["backward"])), lower=0)
            program.constrain(combine((1, var(slowest)), (-2, st["transfer"])), lower=0)
        pipe = combine((1, fill), (k - 1, var(slowest)))
    step = program.variable()
    program.constrain(combine((1, var(step)), (-1, pipe)), lower=0)
    drained = const(0)
    for st in stages:
        program.constrain(combine((1, var(step)), (-1, pipe), (1, drained), (-1, st["sync"])), lower=0)
        drained = combine((1, drained), (1, st["backward"]), (1, st["transfer"]))
    return step
