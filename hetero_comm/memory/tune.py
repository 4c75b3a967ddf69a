"""Pick a plan by running the cost model's best few: measured step time decides.

The cost model predicts peaks closely (the blocks' peaks are measured), but its step time
assumes what it cannot see: that a swapped block's copies hide behind the next block's
compute, and that recomputing costs one forward. Where that is wrong (an H200 ran the
predicted-fastest plan at half a wide transformer's peak 5% slower than the plan without
swapping) the fastest plan is the one that runs fastest, so :func:`tune_memory_plan` runs a
handful of candidates for a few steps each and keeps the fastest whose measured peak fits.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

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


def _run_trial(blocks, plan: MemoryPlan, step: Callable[[], object], meter: MemoryMeter,
               steps: int, warmup: int, swap_directory: Optional[str]) -> PlanTrial:
    seconds, peaks = [], []
    with apply_memory_plan(blocks, plan, swap_directory=swap_directory):
        for index in range(warmup + steps):
            meter.reset()  # waits for the device too
            start = time.perf_counter()
            step()
            if meter.device.type == "cuda":
                torch.cuda.synchronize(meter.device)
            if index >= warmup:
                seconds.append(time.perf_counter() - start)
                peaks.append(meter.added_peak_bytes())
    return PlanTrial(plan, statistics.median(seconds), statistics.median(peaks))


def tune_memory_plan(blocks, profile: MemoryProfile, budget_bytes: float, step: Callable[[], object], *,
                     candidates: int = 4, steps: int = 3, warmup: int = 1,
                     swap_directory: Optional[str] = None) -> TunedMemoryPlan:
    """Run the best few plans under ``budget_bytes`` and return the fastest that fits.

    Args:
        blocks, profile: as for :func:`~hetero_comm.memory.apply_memory_plan` and
            :func:`~hetero_comm.memory.plan_memory` (the profile of these blocks).
        budget_bytes: what one step may add above the memory in use when it begins.
        step: runs one training step of the model the blocks belong to (forward, backward,
            optimizer update), with no arguments. It runs ``warmup + steps`` times per
            candidate plan (up to ``candidates + 2`` plans), so it trains the model: tune on a
            copy, or accept those updates.
        candidates: how many of the integer program's best plans to run, besides the best
            plan without swapping and the seed's rule (see :func:`~hetero_comm.memory.candidate_plans`).

    Returns:
        a :class:`TunedMemoryPlan`. Raises ``ValueError`` when no plan fits by the cost model,
        or when every candidate's measured peak exceeds the budget (the step adds more than the
        blocks do: its loss, the optimizer's update), naming the least measured peak.
    """
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    meter = MemoryMeter(parameter_device(chain_blocks(blocks)[1]))
    plans = candidate_plans(profile, budget_bytes, candidates)
    trials = tuple(_run_trial(blocks, plan, step, meter, steps, warmup, swap_directory) for plan in plans)
    fitting = [trial for trial in trials if trial.peak_bytes <= budget_bytes]
    if not fitting:
        least = min(trial.peak_bytes for trial in trials)
        raise ValueError(f"no candidate plan's step stayed within the budget of "
                         f"{budget_bytes / 2**20:.1f} MiB when it ran (least: {least / 2**20:.1f} MiB, "
                         f"{len(trials)} plans tried): the step adds memory the blocks' profile does "
                         "not see; lower the budget by the difference")
    best = min(fitting, key=lambda trial: trial.step_s)
    return TunedMemoryPlan(best.plan, trials, float(budget_bytes))
