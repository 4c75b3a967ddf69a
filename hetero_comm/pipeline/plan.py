"""What the planner decides and the executor runs: which contiguous layers each pipeline stage
holds, on which kind of device, whether it recomputes its activations, and the schedule."""

from dataclasses import dataclass
from typing import Tuple

from .._checks import check_choice, check_int

__all__ = ["StagePlan", "PipelinePlan", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: ``layers[first_layer:last_layer]`` on a device of kind ``device``.

    The ``predicted_*`` fields are the planner's estimates per micro-batch (seconds) and for
    the whole step (bytes); they are for reading, the executor ignores them.
    """

    device: str
    first_layer: int
    last_layer: int
    recompute: bool = False
    predicted_forward_s: float = 0.0
    predicted_backward_s: float = 0.0
    predicted_memory_bytes: int = 0
    predicted_sync_s: float = 0.0

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True)
class PipelinePlan:
    """Stages in pipeline order (stage 0 takes the input), covering layers ``0..L`` without gap.

    Every machine runs the same plan: rank ``machine * len(stages) + stage`` holds ``stages[stage]``
    of ``machine``; the replicas of one stage across machines are data parallel.
    """

    stages: Tuple[StagePlan, ...]
    micro_batches: int
    schedule: str = "gpipe"
    predicted_step_s: float = 0.0

    def __post_init__(self) -> None:
        check_int("micro_batches", self.micro_batches, 1)
        check_choice("schedule", self.schedule, SCHEDULES)
        if not self.stages:
            raise ValueError("a PipelinePlan needs at least one stage")
        expected_first = 0
        for index, stage in enumerate(self.stages):
            if stage.first_layer != expected_first or stage.last_layer <= stage.first_layer:
                raise ValueError(
                    f"stage {index} holds layers [{stage.first_layer}, {stage.last_layer}); stages "
                    f"must be non-empty and contiguous, starting at layer {expected_first}")
            expected_first = stage.last_layer

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last_layer
