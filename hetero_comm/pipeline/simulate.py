"""Play a plan's schedule out in time, and show plans readably.

:func:`simulate` runs every forward, backward, transfer and sync of one step as events with
their real dependencies and the order each schedule uses on each stage, rather than the closed
formulas the integer program minimises; :func:`format_plan` prints the table and
:func:`plot_timeline` draws the simulated step.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .._optional import import_optional
from .cost import Cluster, StageEstimate
from .plan import PipelinePlan

__all__ = ["Event", "Simulation", "simulate", "format_plan", "plot_timeline"]


@dataclass(frozen=True)
class Event:
    """One piece of work: ``kind`` is "forward", "backward", "send", "send_grad" or "sync"."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    step_s: float
    events: Tuple[Event, ...]

    def busy_fraction(self, stage: int) -> float:
        """Share of the step that ``stage`` spends computing (1 - its bubble)."""
        busy = sum(e.end_s - e.start_s for e in self.events
                   if e.stage == stage and e.kind in ("forward", "backward"))
        return busy / self.step_s if self.step_s > 0 else 0.0


def _stage_order(schedule: str, stage: int, num_stages: int, k: int) -> List[Tuple[str, int]]:
    """The order in which ``stage`` runs its forwards and backwards."""
    if schedule == "gpipe":
        return [("forward", j) for j in range(k)] + [("backward", j) for j in range(k)]
    warmup = min(k, num_stages - stage - 1)
    order = [("forward", j) for j in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < k:
        if next_forward < k:
            order.append(("forward", next_forward))
            next_forward += 1
        order.append(("backward", next_backward))
        next_backward += 1
    return order


def simulate(cluster: Cluster, plan: PipelinePlan) -> Simulation:
    """The timeline of one step of ``plan`` on ``cluster``'s profiles.

    Each stage runs its operations in the schedule's order, each as soon as its input has
    arrived; a link carries one transfer at a time in each direction; each stage's sync with
    the other machines starts after its last backward.
    """
    from .planner import evaluate_plan  # the predicted figures per stage

    filled = evaluate_plan(cluster, plan)
    stages = [StageEstimate(s.predicted_forward_s, s.predicted_backward_s, 0.0, s.predicted_sync_s, 0)
              for s in filled.stages]
    profile = cluster.devices[0].profile
    transfer = [profile.output_bytes[s.last_layer - 1] / cluster.stage_bytes_per_s
                for s in plan.stages[:-1]]
    num_stages, k = plan.num_stages, plan.micro_batches
    orders = [_stage_order(plan.schedule, s, num_stages, k) for s in range(num_stages)]
    position, stage_free = [0] * num_stages, [0.0] * num_stages
    arrival: Dict[Tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> input ready
    link_free = {("forward", s): 0.0 for s in range(num_stages - 1)}
    link_free.update({("backward", s): 0.0 for s in range(num_stages - 1)})
    events: List[Event] = []
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                ready = _input_ready(kind, s, j, num_stages, arrival)
                if ready is None:
                    break
                start = max(ready, stage_free[s])
                cost = stages[s].forward_s if kind == "forward" else stages[s].backward_s
                stage_free[s] = start + cost
                events.append(Event(s, kind, j, start, stage_free[s]))
                _send(kind, s, j, stage_free[s], num_stages, transfer, link_free, arrival, events)
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked in simulation; this is a bug in hetero_comm")
    for s in range(num_stages):
        events.append(Event(s, "sync", -1, stage_free[s], stage_free[s] + stages[s].sync_s))
    return Simulation(max(e.end_s for e in events), tuple(events))


def _input_ready(kind: str, s: int, j: int, num_stages: int, arrival) -> Optional[float]:
    if kind == "forward":
        return 0.0 if s == 0 else arrival.get(("forward", s, j))
    if s == num_stages - 1:
        return arrival.get(("backward", s, j), 0.0)  # after its own forward, which ran before
    return arrival.get(("backward", s, j))


def _send(kind, s, j, done, num_stages, transfer, link_free, arrival, events) -> None:
    """Ship a finished forward's output downstream, or a backward's gradient upstream."""
    if kind == "forward" and s + 1 < num_stages:
        start = max(done, link_free["forward", s])
        link_free["forward", s] = start + transfer[s]
        arrival["forward", s + 1, j] = start + transfer[s]
        events.append(Event(s, "send", j, start, start + transfer[s]))
    elif kind == "backward" and s > 0:
        start = max(done, link_free["backward", s - 1])
        link_free["backward", s - 1] = start + transfer[s - 1]
        arrival["backward", s - 1, j] = start + transfer[s - 1]
        events.append(Event(s, "send_grad", j, start, start + transfer[s - 1]))


def format_plan(plan: PipelinePlan, simulation: Optional[Simulation] = None) -> str:
    """The plan as a table: stage, device, layers, predicted times and memory."""
    header = (f"{'stage':>5}  {'device':<12} {'layers':<11} {'fwd ms':>8} {'bwd ms':>8} "
              f"{'sync ms':>8} {'memory MB':>10} {'recompute':>9}")
    if simulation is not None:
        header += f" {'busy':>6}"
    lines = [header, "-" * len(header)]
    for index, stage in enumerate(plan.stages):
        line = (f"{index:>5}  {stage.device:<12} {f'[{stage.first_layer}, {stage.last_layer})':<11} "
                f"{stage.predicted_forward_s * 1e3:>8.2f} {stage.predicted_backward_s * 1e3:>8.2f} "
                f"{stage.predicted_sync_s * 1e3:>8.2f} {stage.predicted_memory_bytes / 2**20:>10.1f} "
                f"{'yes' if stage.recompute else 'no':>9}")
        if simulation is not None:
            line += f" {simulation.busy_fraction(index):>6.0%}"
        lines.append(line)
    lines.append(f"{plan.schedule}, {plan.micro_batches} micro-batches: predicted step "
                 f"{plan.predicted_step_s * 1e3:.1f} ms (cost model)"
                 + (f", {simulation.step_s * 1e3:.1f} ms (simulated)" if simulation else ""))
    return "\n".join(lines)


def plot_timeline(plan: PipelinePlan, simulation: Simulation, path: str, title: str = "") -> None:
    """Save a PNG of the simulated step: one row per stage, forwards, backwards and syncs."""
    matplotlib = import_optional("matplotlib", "planner", "plot_timeline")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:green"}
    figure, axes = plt.subplots(figsize=(10, 1 + 0.6 * plan.num_stages))
    for event in simulation.events:
        if event.kind in colours and event.end_s > event.start_s:
            axes.broken_barh([(event.start_s * 1e3, (event.end_s - event.start_s) * 1e3)],
                             (event.stage - 0.4, 0.8), facecolors=colours[event.kind],
                             edgecolor="black", linewidth=0.3)
    axes.set_yticks(range(plan.num_stages),
                    [f"{i}: {s.device}{' (recompute)' if s.recompute else ''}"
                     for i, s in enumerate(plan.stages)])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    axes.set_title(title or f"{plan.schedule}, {plan.micro_batches} micro-batches: "
                            f"{simulation.step_s * 1e3:.1f} ms simulated")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
