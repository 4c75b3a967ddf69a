"""Keep, swap or recompute each block: the cost model, the swap-or-recompute rule and the optimum.

The model (one training step, gradients ``None`` when it starts, bytes above what is in
memory before it). For block ``l`` with output ``o_l``, internal saved bytes ``i_l``,
parameters ``p_l``, forward peaks ``f_l`` and backward peaks ``b_l`` from the profile:

* after the forward, block ``l`` holds ``i_l`` if kept (swapped: in the swap space;
  recomputed: freed; partially recomputed: the measured ``partial_kept_bytes``) and its output
  ``o_l`` if anything still needs it: the block itself (kept, saving its output), the next
  block (saving its input, unless recomputed: a wholly or partially recomputed block keeps its
  input instead) or the loss (the last block's output);
* forward phase ``l``: what blocks ``< l`` hold, plus the input if nothing holds it, plus
  ``f_l`` of the block's mode (measured with the block run alone in that mode);
* backward phase ``l``: what blocks ``< l`` hold, plus what block ``l`` kept (its internals, its
  output if it saves it: the next block's backward, done, released it), the output's gradient ``o_l``, the parameter gradients of blocks ``> l``, block
  ``l - 1``'s swapped bytes (prefetched one block ahead), plus ``b_l`` of the block's mode
  (fetching, recomputing and the backward itself, measured alone);
* time: the profile's forward and backward, per recomputed block its measured recomputation
  (``recompute_s``: the forward up to the block's last saved tensor, as the pipeline planner
  prices a recomputing stage that ends at that block), per partially recomputed block its
  measured ``partial_recompute_s``, and per
  swapped block what its transfer (each way) does not hide behind the next block's forward
  (offload) or backward (prefetch); all of it where the transfer runs on the cores that
  compute (the CPU).

:func:`predict` evaluates these expressions for a choice; :func:`plan_memory` minimises the
time under a budget, by the swap-or-recompute rule or exactly (``scipy.optimize.milp``, the same
expressions as constraints).
"""

import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .._checks import check_choice, check_int
from .._linear_program import Expression, LinearProgram, combine, const, var
from ..pipeline.profile import recompute_seconds
from .profile import CHOICES, MemoryProfile

__all__ = ["MemoryPlan", "predict", "plan_memory", "candidate_plans", "rule_choices",
           "exhaustive_memory_plan"]

@dataclass(frozen=True)
class MemoryPlan:
    """What to do with each block's saved activations, and what the cost model expects.

    Attributes:
        names: the blocks, in order.
        choices: ``"keep"``, ``"swap"``, ``"recompute"`` or ``"partial"`` per block
            (:data:`~hetero_comm.memory.CHOICES`).
        predicted_peak_bytes / predicted_step_s: the model's step under this plan.
        unplanned_peak_bytes / unplanned_step_s: the model's step keeping everything.
    """

    names: Tuple[str, ...]
    choices: Tuple[str, ...]
    predicted_peak_bytes: float
    predicted_step_s: float
    unplanned_peak_bytes: float
    unplanned_step_s: float

    def __post_init__(self) -> None:
        if len(self.names) != len(self.choices):
            raise ValueError(f"a MemoryPlan needs one choice per block: {len(self.names)} blocks, "
                             f"{len(self.choices)} choices")
        for name, choice in zip(self.names, self.choices):
            check_choice(f"choice of block {name!r}", choice, CHOICES)

    def format(self) -> str:
        """A short table: each block's choice, then the predicted peak and step time."""
        lines = [f"{name:>16}  {choice}" for name, choice in zip(self.names, self.choices)]
        lines.append(f"predicted peak {self.predicted_peak_bytes / 2**20:.1f} MiB "
                     f"(unplanned {self.unplanned_peak_bytes / 2**20:.1f}), step "
                     f"{self.predicted_step_s * 1e3:.1f} ms (unplanned {self.unplanned_step_s * 1e3:.1f})")
        return "\n".join(lines)


class _CostModel:
    """The module docstring's expressions over 0/1 variables ``keep[l]``, ``swap[l]``,
    ``recompute[l]``, ``partial[l]`` and ``held[l]`` (block ``l``'s output stays in memory)."""

    def __init__(self, profile: MemoryProfile, program: LinearProgram) -> None:
        self.profile, count = profile, profile.num_blocks
        self.keep = [program.variable(0, 1, integer=True) for _ in range(count)]
        self.swap = [program.variable(0, 1, integer=True) for _ in range(count)]
        self.recompute = [program.variable(0, 1, integer=True) for _ in range(count)]
        self.partial = [program.variable(0, 1, integer=True) for _ in range(count)]
        self.held = [program.variable(0, 1) for _ in range(count)]
        self.flags = dict(zip(CHOICES, (self.keep, self.swap, self.recompute, self.partial)))

    def held_reasons(self, block: int) -> List[Expression]:
        """Each reason for block ``block``'s output to stay in memory (``held`` is their OR)."""
        p = self.profile
        if block == p.num_blocks - 1:
            return [const(1.0)]  # the loss holds the model's output
        reasons = [combine((1, var(self.recompute[block + 1])), (1, var(self.partial[block + 1])))]
        if p.saves_output[block]:
            reasons.append(var(self.keep[block]))
        if p.saves_input[block + 1]:
            reasons.append(combine((1, var(self.keep[block + 1])), (1, var(self.swap[block + 1]))))
        return reasons

    def constrain(self, program: LinearProgram, allow_swap: bool) -> None:
        """One choice per block; ``held`` at least each of its reasons."""
        for l in range(self.profile.num_blocks):
            program.constrain(combine(*[(1, var(flag[l])) for flag in self.flags.values()]), 1, 1)
            if not allow_swap:
                program.constrain(var(self.swap[l]), 0, 0)
            if not partial_frees_memory(self.profile, l):
                program.constrain(var(self.partial[l]), 0, 0)
            for reason in self.held_reasons(l):
                program.constrain(combine((1, var(self.held[l])), (-1, reason)), 0, math.inf)

    def _held_before(self, block: int) -> Expression:
        p = self.profile
        return combine(*[(p.internal_bytes[j], var(self.keep[j])) for j in range(block)],
                        *[(p.partial_kept_bytes[j], var(self.partial[j])) for j in range(block)],
                        *[(p.layers.output_bytes[j], var(self.held[j])) for j in range(block)])

    def _by_mode(self, block: int, peaks: Tuple[int, ...]) -> Expression:
        """``peaks`` (one per mode, in :data:`CHOICES` order) of the mode ``block`` is in."""
        return combine(*[(peak, var(flag[block])) for peak, flag in zip(peaks, self.flags.values())])

    def phases(self) -> List[Tuple[str, Expression]]:
        """Bytes in use at each phase of the step (name, expression)."""
        p, out = self.profile, self.profile.layers.output_bytes
        phases = []
        for l in range(p.num_blocks):
            held = self._held_before(l)
            loose_input = combine((out[l - 1], const(1)), (-out[l - 1], var(self.held[l - 1]))) \
                if l > 0 else const(0)
            phases.append((f"forward {p.names[l]}", combine(
                (1, held), (1, loose_input), (1, self._by_mode(l, p.forward_peak_bytes[l])))))
            prefetch = (p.swap_bytes(l - 1), var(self.swap[l - 1])) if l > 0 else (0, const(0))
            phases.append((f"backward {p.names[l]}", combine(
                (1, held), (1, const(out[l] + sum(p.layers.param_bytes[l + 1:]))),
                (p.internal_bytes[l] + (out[l] if p.saves_output[l] else 0), var(self.keep[l])),
                (p.partial_kept_bytes[l], var(self.partial[l])),
                (1, self._by_mode(l, p.backward_peak_bytes[l])), prefetch)))
        return phases

    def seconds(self) -> Expression:
        p, layers = self.profile, self.profile.layers
        terms = [(1, const(sum(layers.forward_s) + sum(layers.backward_s)))]
        for l in range(p.num_blocks):
            terms.append((recompute_seconds(layers, [l]), var(self.recompute[l])))
            terms.append((p.partial_recompute_s[l], var(self.partial[l])))
            terms.append((self.exposed_swap_s(l), var(self.swap[l])))
        return combine(*terms)

    def exposed_swap_s(self, block: int) -> float:
        """Transfer time of ``block`` that the next block's forward and backward do not hide."""
        p, layers = self.profile, self.profile.layers
        transfer = p.swap_bytes(block) / p.swap_bytes_per_s
        if block + 1 == p.num_blocks or not p.swap_overlaps_compute:
            return 2 * transfer
        return max(0.0, transfer - layers.forward_s[block + 1]) + \
            max(0.0, transfer - layers.backward_s[block + 1])


def _evaluate(expression: Expression, values: Dict[int, float]) -> float:
    coefficients, constant = expression
    return constant + sum(c * values[v] for v, c in coefficients.items())


def _assignment(model: _CostModel, choices: Sequence[str]) -> Dict[int, float]:
    """Variable values for ``choices``: the choice flags, and ``held`` as the OR of its reasons."""
    values: Dict[int, float] = {}
    for l, choice in enumerate(choices):
        for mode, flag in model.flags.items():
            values[flag[l]] = float(choice == mode)
    for l in range(len(choices)):
        values[model.held[l]] = max(_evaluate(reason, values) for reason in model.held_reasons(l))
    return values


def predict(profile: MemoryProfile, choices: Sequence[str]) -> Tuple[float, float]:
    """The cost model's peak bytes and step seconds for ``choices`` (one per block)."""
    choices = tuple(choices)
    if len(choices) != profile.num_blocks:
        raise ValueError(f"predict needs one choice per block: {profile.num_blocks} blocks, got "
                         f"{len(choices)} choices")
    for name, choice in zip(profile.names, choices):
        check_choice(f"choice of block {name!r}", choice, CHOICES)
    model = _CostModel(profile, LinearProgram())
    values = _assignment(model, choices)
    peak = max(_evaluate(expression, values) for _, expression in model.phases())
    return peak, _evaluate(model.seconds(), values)


def _make_plan(profile: MemoryProfile, choices: Sequence[str]) -> MemoryPlan:
    peak, seconds = predict(profile, choices)
    unplanned_peak, unplanned_seconds = predict(profile, ("keep",) * profile.num_blocks)
    return MemoryPlan(profile.names, tuple(choices), peak, seconds, unplanned_peak, unplanned_seconds)


def rule_choices(profile: MemoryProfile) -> Tuple[str, ...]:
    """The swap-or-recompute rule's class of every block: swap where computing the block again costs
    more than moving its saved bytes out and back, recompute where it costs less."""
    return tuple("swap" if recompute_seconds(profile.layers, [l]) > 2 * profile.swap_bytes(l) / profile.swap_bytes_per_s
                 else "recompute" for l in range(profile.num_blocks))


def _rule_plan(profile: MemoryProfile, budget_bytes: float, allow_swap: bool) -> Tuple[str, ...]:
    """Apply the swap-or-recompute class to one block at a time, the most bytes freed per second of cost
    first, until the predicted peak fits the budget."""
    classes = rule_choices(profile) if allow_swap else ("recompute",) * profile.num_blocks
    choices = ["keep"] * profile.num_blocks

    def seconds_per_byte(l):
        cost = recompute_seconds(profile.layers, [l]) if classes[l] == "recompute" else \
            2 * profile.swap_bytes(l) / profile.swap_bytes_per_s
        return cost / max(profile.internal_bytes[l] + profile.layers.output_bytes[l], 1)

    for l in sorted(range(profile.num_blocks), key=seconds_per_byte):
        if predict(profile, choices)[0] <= budget_bytes:
            break
        choices[l] = classes[l]
    return tuple(choices)


def _optimal_plan(profile: MemoryProfile, budget_bytes: float, allow_swap: bool,
                  time_limit_s: float, excluded: Sequence[Tuple[str, ...]] = ()) -> Optional[Tuple[str, ...]]:
    """The least predicted step time under the budget, other than the choices in ``excluded``."""
    program = LinearProgram()
    model = _CostModel(profile, program)
    model.constrain(program, allow_swap)
    for _, expression in model.phases():
        program.constrain(expression, upper=budget_bytes)
    for choices in excluded:  # at least one block chooses differently
        program.constrain(combine(*[(1, var(model.flags[choice][l])) for l, choice in enumerate(choices)]),
                          upper=profile.num_blocks - 1)
    coefficients, _ = model.seconds()
    result = program.solve(coefficients, time_limit_s)
    if result.x is None:
        return None
    return tuple(max(CHOICES, key=lambda mode: result.x[model.flags[mode][l]]) for l in range(profile.num_blocks))


def plan_memory(profile: MemoryProfile, budget_bytes: Optional[float] = None, *,
                method: str = "optimal", allow_swap: bool = True,
                time_limit_s: float = 10.0) -> MemoryPlan:
    """Choose keep, swap, recompute or partial for each block so the step's predicted peak fits.

    Args:
        profile: from :func:`~hetero_comm.memory.profile_memory`.
        budget_bytes: what the step may add above the memory in use before it (weights,
            optimizer state, the batch). ``None``: the swap-or-recompute rule on every block.
        method: ``"optimal"`` (the least predicted step time, by ``scipy.optimize.milp``) or
            ``"rule"`` (the swap-or-recompute rule's class, one block at a time, see :func:`rule_choices`).
        allow_swap: ``False`` plans without swapping (keep, recompute, partial).

    Returns:
        a :class:`MemoryPlan`. Raises ``ValueError`` when no plan fits, naming the least
        peak the model can reach.
    """
    check_choice("method", method, ("optimal", "rule"))
    if budget_bytes is None:
        return _make_plan(profile, rule_choices(profile))
    if not (isinstance(budget_bytes, (int, float)) and budget_bytes > 0):
        raise ValueError(f"budget_bytes must be a number of bytes > 0; got {budget_bytes!r}")
    if method == "rule":
        choices = _rule_plan(profile, budget_bytes, allow_swap)
    else:
        choices = _optimal_plan(profile, budget_bytes, allow_swap, time_limit_s)
    if choices is None or predict(profile, choices)[0] > budget_bytes * (1 + 1e-9):
        least = predict(profile, ("recompute",) * profile.num_blocks)[0]
        raise ValueError(f"no plan fits a budget of {budget_bytes / 2**20:.1f} MiB "
                         f"(method {method!r}); recomputing every block needs "
                         f"{least / 2**20:.1f} MiB: raise the budget or cut the model into finer blocks")
    return _make_plan(profile, choices)


def candidate_plans(profile: MemoryProfile, budget_bytes: float, count: int = 4, *,
                    time_limit_s: float = 10.0) -> List[MemoryPlan]:
    """Distinct plans that fit ``budget_bytes``, the fastest predicted first: the ``count``
    best of the integer program (each solved with the ones before excluded), then the best
    without swapping and the swap-or-recompute rule's plan where they are not among them. These are what
    :func:`~hetero_comm.memory.tune_memory_plan` runs, so that an error of the cost model's
    step time (copies that do not hide, a recompute cheaper than a forward) cannot decide alone.
    Raises ``ValueError`` as :func:`plan_memory` does when nothing fits."""
    check_int("count", count, 1)
    found: List[Tuple[str, ...]] = [plan_memory(profile, budget_bytes, time_limit_s=time_limit_s).choices]
    while len(found) < count:
        choices = _optimal_plan(profile, budget_bytes, True, time_limit_s, excluded=found)
        if choices is None or predict(profile, choices)[0] > budget_bytes * (1 + 1e-9):
            break
        found.append(choices)
    for method, allow_swap in (("optimal", False), ("rule", True)):
        try:
            choices = plan_memory(profile, budget_bytes, method=method, allow_swap=allow_swap,
                                  time_limit_s=time_limit_s).choices
        except ValueError:  # fits only with swapping, or the rule's order misses the budget
            continue
        if choices not in found:
            found.append(choices)
    plans = [_make_plan(profile, choices) for choices in found]
    return sorted(plans, key=lambda plan: plan.predicted_step_s)


def partial_frees_memory(profile: MemoryProfile, block: int) -> bool:
    """Whether a partial recomputation of ``block`` keeps less than keeping it does. A block torch
    cannot recompute partially is profiled as keeping everything, so no plan chooses it."""
    return profile.partial_kept_bytes[block] < profile.internal_bytes[block]


def exhaustive_memory_plan(profile: MemoryProfile, budget_bytes: float) -> Optional[Tuple[str, ...]]:
    """The fastest choices under the budget by trying all ``4 ** blocks`` (partial only where it
    frees memory): the check of :func:`plan_memory` on small models. ``None`` when nothing fits."""
    best = None
    for choices in itertools.product(CHOICES, repeat=profile.num_blocks):
        if any(choice == "partial" and not partial_frees_memory(profile, l)
               for l, choice in enumerate(choices)):
            continue
        peak, seconds = predict(profile, choices)
        if peak <= budget_bytes and (best is None or seconds < best[0]):
            best = (seconds, choices)
    return None if best is None else best[1]
