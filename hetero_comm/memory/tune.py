"""Pick a plan by running the cost model's best few: measured step time decides.

The cost model predicts peaks closely (the blocks' peaks are measured), but its step time
assumes what it cannot see: that a swapped block's copies hide behind the next block's
compute, and that a recomputation costs what it cost alone. Where that is wrong, the plan
predicted fastest is not the one that runs fastest, so :func:`tune_memory_plan` runs a handful
of candidates, in turns for a few rounds, and keeps the fastest whose measured peak fits.
The measurements behind this: docs/design/memory.md ("Choosing a plan by measurement").
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._agreement import SETUP_TIMEOUT_SECONDS, gathered_across_ranks
from .._checks import check_int
from .apply import apply_memory_plan, parameter_device
from .meter import MemoryMeter
from .plan import MemoryPlan, candidate_plans
from .profile import MemoryProfile, chain_blocks

__all__ = ["PlanTrial", "TunedMemoryPlan", "tune_memory_plan"]


@dataclass(frozen=True)
class PlanTrial:
    """One candidate plan as it ran: median seconds and median peak bytes of the user's step
    (the peak above the memory in use when the step began)."""

    plan: MemoryPlan
    step_s: float
    peak_bytes: float


@dataclass(frozen=True)
class TunedMemoryPlan:
    """The chosen plan (the fastest trial whose measured peak fits the budget) and every trial,
    fastest predicted first."""

    plan: MemoryPlan
    trials: Tuple[PlanTrial, ...]
    budget_bytes: float

    def format(self) -> str:
        """One line per trial: its choices, predicted and measured peak and step time."""
        lines = [f"budget {self.budget_bytes / 2**20:.1f} MiB; plan (k/s/r/p per block), "
                 "peak MiB predicted/measured, step ms predicted/measured"]
        for trial in self.trials:
            plan = trial.plan
            mark = "*" if plan is self.plan else " "
            lines.append(f"{mark} {' '.join(c[0] for c in plan.choices)}  "
                         f"{plan.predicted_peak_bytes / 2**20:.1f}/{trial.peak_bytes / 2**20:.1f}  "
                         f"{plan.predicted_step_s * 1e3:.1f}/{trial.step_s * 1e3:.1f}")
        return "\n".join(lines)


def _group_stepping_together(process_group) -> Tuple[bool, Optional[dist.ProcessGroup]]:
    """Whether ranks tune together, and their group (``None``: the default group), from
    :func:`tune_memory_plan`'s ``process_group``."""
    if isinstance(process_group, str):
        if process_group != "default":
            raise ValueError(f"process_group must be 'default', a ProcessGroup or None; got "
                             f"{process_group!r}")
        together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return together, None
    if process_group is None:
        return False, None
    return dist.get_world_size(process_group) > 1, process_group


def _gathered_for_tuning(value: dict, group: Optional[dist.ProcessGroup], what: str) -> list:
    try:
        return gathered_across_ranks(value, group, SETUP_TIMEOUT_SECONDS, what)
    except RuntimeError as error:
        raise RuntimeError(f"{error}. Tuning on this rank alone (a copy whose step does not "
                           f"communicate)? Pass process_group=None") from error


def _plans_in_step_with_the_ranks(profile: MemoryProfile, budget_bytes: float, candidates: int,
                                  steps: int, warmup: int, together: bool,
                                  group: Optional[dist.ProcessGroup]) -> Tuple[list, list]:
    """This rank's candidate plans, and the repeats of its first that make the ranks tuning
    ``together`` run equally many (none alone). Raises ``ValueError`` on every such rank when
    any has no plan that fits, or when their ``steps`` or ``warmup`` differ."""
    try:
        plans, error = candidate_plans(profile, budget_bytes, candidates), None
    except ValueError as no_fit:
        plans, error = [], no_fit
    if not together:
        if error is not None:
            raise error
        return plans, []
    mine = dict(plans=len(plans), steps=steps, warmup=warmup, error=None if error is None else str(error))
    ranks = _gathered_for_tuning(mine, group, "tune_memory_plan candidates")
    failed = {rank: value["error"] for rank, value in enumerate(ranks) if value["error"]}
    if failed:
        if error is not None:
            raise error
        raise ValueError("tune_memory_plan: no plan fits on rank(s) " + "; ".join(
            f"{rank} ({message})" for rank, message in failed.items()) + ": no rank ran a step")
    if any((value["steps"], value["warmup"]) != (steps, warmup) for value in ranks):
        raise ValueError("tune_memory_plan: the ranks' steps and warmup differ (" + "; ".join(
            f"rank {rank}: steps={value['steps']}, warmup={value['warmup']}"
            for rank, value in enumerate(ranks)) + "): every rank must call step equally often")
    most = max(value["plans"] for value in ranks)
    return plans, [plans[0]] * (most - len(plans))


def _run_in_turns(blocks, plans, step: Callable[[], object], meter: MemoryMeter, steps: int,
                  warmup: int, swap_directory: Optional[str]) -> Tuple[PlanTrial, ...]:
    """``steps`` rounds; in each, every plan in turn is applied, runs ``warmup`` steps and one
    timed step, and is removed. Run back to back instead, a plan's steps would share whatever
    load the machine had then, which can move a plan's time by more than the plans differ
    (docs/design/memory.md)."""
    seconds = [[] for _ in plans]
    peaks = [[] for _ in plans]
    for _ in range(steps):
        for index, plan in enumerate(plans):
            with apply_memory_plan(blocks, plan, swap_directory=swap_directory):
                for _ in range(warmup):
                    step()
                meter.reset()  # waits for the device too
                start = time.perf_counter()
                step()
                if meter.device.type == "cuda":
                    torch.cuda.synchronize(meter.device)
                seconds[index].append(time.perf_counter() - start)
                peaks[index].append(meter.added_peak_bytes())
    return tuple(PlanTrial(plan, statistics.median(s), statistics.median(p))
                 for plan, s, p in zip(plans, seconds, peaks))


def tune_memory_plan(blocks, profile: MemoryProfile, budget_bytes: float, step: Callable[[], object], *,
                     candidates: int = 4, steps: int = 3, warmup: int = 1,
                     swap_directory: Optional[str] = None,
                     process_group: Union[str, dist.ProcessGroup, None] = "default") -> TunedMemoryPlan:
    """Run the best few plans under ``budget_bytes`` and return the fastest that fits.

    Args:
        blocks, profile: as for :func:`~hetero_comm.memory.apply_memory_plan` and
            :func:`~hetero_comm.memory.plan_memory` (the profile of these blocks).
        budget_bytes: what one step may add above the memory in use when it begins.
        step: runs one training step of the model the blocks belong to (forward, backward,
            optimizer update), with no arguments. It runs ``steps * (warmup + 1)`` times per
            candidate plan (up to ``candidates + 2`` plans), so it trains the model: tune on a
            copy, or accept those updates.
        steps: timed steps per plan, one per round; the plans take turns in each round, so
            a machine whose speed drifts slows them alike.
        warmup: untimed steps before each timed one (a plan's first step after it is
            applied may pay for its set-up).
        candidates: how many of the integer program's best plans to run, besides the best
            plan without swapping and the swap-or-recompute rule (see :func:`~hetero_comm.memory.candidate_plans`).

        process_group: the ranks that tune together because ``step`` communicates among
            them (a DDP model's group). They first compare how many plans each will run, and
            each runs the most any of them runs (repeating its fastest predicted plan, whose
            extra trials are dropped), so every rank calls ``step`` equally often whatever its
            budget and profile; a rank on which no plan fits, before or after the trials,
            makes all of them raise. ``"default"`` (default): torch.distributed's default
            group when it is initialised with more than one rank (call it on every rank);
            ``None``: this rank alone (tuning a copy whose step does not communicate).

    Returns:
        a :class:`TunedMemoryPlan`. Raises ``ValueError`` when no plan fits by the cost model
        (on any rank), or when every candidate's measured peak exceeds the budget (the step adds
        more than the blocks do: its loss, the optimizer's update), naming the least measured
        peak; ``RuntimeError`` when another rank has not called it within
        :data:`hetero_comm._agreement.SETUP_TIMEOUT_SECONDS`.
    """
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    meter = MemoryMeter(parameter_device(chain_blocks(blocks)[1]))
    together, group = _group_stepping_together(process_group)
    plans, padding = _plans_in_step_with_the_ranks(profile, budget_bytes, candidates, steps, warmup,
                                                   together, group)
    trials = _run_in_turns(blocks, plans + padding, step, meter, steps, warmup,
                           swap_directory)[:len(plans)]
    fitting = [trial for trial in trials if trial.peak_bytes <= budget_bytes]
    if together:  # every rank raises if one found nothing that fits (its own reason below)
        ranks = _gathered_for_tuning(dict(fits=bool(fitting)), group, "tune_memory_plan results")
        missing = [rank for rank, value in enumerate(ranks) if not value["fits"]]
        if missing and fitting:
            raise ValueError(f"tune_memory_plan: no candidate plan's step stayed within the "
                             f"budget on rank(s) {missing}: every rank stops tuning")
    if not fitting:
        least = min(trial.peak_bytes for trial in trials)
        raise ValueError(f"no candidate plan's step stayed within the budget of "
                         f"{budget_bytes / 2**20:.1f} MiB when it ran (least: {least / 2**20:.1f} MiB, "
                         f"{len(trials)} plans tried): the step adds memory the blocks' profile does "
                         "not see; lower the budget by the difference")
    best = min(fitting, key=lambda trial: trial.step_s)
    return TunedMemoryPlan(best.plan, trials, float(budget_bytes))
