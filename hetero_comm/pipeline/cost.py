"""The cluster the planner plans for, and the cost model it minimises.

One step, per machine: ``k`` micro-batches go through ``S`` stages (one device each) and back;
then each stage's parameters are averaged with the same stage on the other machines. The
model (the same formulas in :func:`estimate_step` and in the integer program):

* stage ``s`` spends ``F_s`` (forward) and ``B_s`` (backward, plus its recomputation when it
  recomputes: every layer's forward but the last one's, whose rerun stops at its last saved
  tensor, the profile's ``recompute_s``) seconds per micro-batch; the link to the next stage takes ``t_s`` per
  micro-batch each way (the boundary layer's output, then its gradient);
* GPipe is two flow shops, all forwards then all backwards, so with identical micro-batches
  ``pipe = sum(F) + sum(B) + 2 sum(t) + (k - 1) (max(F, t) + max(B, t))``, exact for the
  simulator. 1F1B: ``sum(F) + sum(B) + 2 sum(t) + (k - 1) max(F + B, 2 t)``;
* stage ``s`` finishes its last backward at most ``pipe - sum_{s' < s}(B_s' + t_s')`` (the
  drain runs back to stage 0), then syncs for ``2 (m - 1) / m * param_bytes_s / bandwidth``
  and runs its optimizer step (the profile's ``update_s``); the step is the latest of those;
* memory: ``state_bytes_per_param_byte`` times the stage's parameter bytes, plus the saved
  activations of every micro-batch in flight (``k`` in GPipe, ``min(k, S - s)`` in 1F1B); a
  recomputing stage keeps only its input per micro-batch in flight, plus one micro-batch's
  activations while it recomputes.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .._checks import check_choice, check_float, check_int
from .plan import SCHEDULES
from .profile import LayerProfile, recompute_seconds

__all__ = ["DeviceKind", "Cluster", "StageEstimate", "estimate_step"]


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device, present once in every machine.

    Args:
        name: how plans and errors name it.
        profile: its per-layer costs (:func:`~hetero_comm.pipeline.profile_layers` run on it).
        memory_bytes: what a stage on it may use (parameters, optimizer state, activations).
        sync_bytes_per_s: its link to the same stage on the other machines; ``None`` takes the
            cluster's.
    """

    name: str
    profile: LayerProfile
    memory_bytes: float = math.inf
    sync_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a device kind needs a non-empty name; got {self.name!r}")
        if not isinstance(self.profile, LayerProfile):
            raise ValueError(f"device {self.name!r}: profile must be a LayerProfile; got "
                             f"{type(self.profile).__name__}")
        if not (isinstance(self.memory_bytes, (int, float)) and self.memory_bytes > 0):
            raise ValueError(f"device {self.name!r}: memory_bytes must be > 0; got {self.memory_bytes!r}")
        if self.sync_bytes_per_s is not None:
            _check_bandwidth(f"device {self.name!r}: sync_bytes_per_s", self.sync_bytes_per_s)


@dataclass(frozen=True)
class Cluster:
    """``machines`` identical machines, each with one device of every kind in ``devices``.

    Args:
        stage_bytes_per_s: the link between two stages inside a machine.
        sync_bytes_per_s: each device's link to the other machines (the data-parallel sync).
        state_bytes_per_param_byte: parameter memory per parameter byte: weights, gradients
            and optimizer state (4 for Adam in float32: weights, gradients, two moments).
    """

    devices: Tuple[DeviceKind, ...]
    machines: int
    stage_bytes_per_s: float = math.inf
    sync_bytes_per_s: float = math.inf
    state_bytes_per_param_byte: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError("a Cluster needs at least one device kind")
        names = [device.name for device in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device kind names must be distinct; got {names}")
        check_int("machines", self.machines, 1)
        _check_bandwidth("stage_bytes_per_s", self.stage_bytes_per_s)
        _check_bandwidth("sync_bytes_per_s", self.sync_bytes_per_s)
        check_float("state_bytes_per_param_byte", self.state_bytes_per_param_byte, 0, 1e6)
        _check_profiles_agree(self.devices)

    @property
    def num_layers(self) -> int:
        return self.devices[0].profile.num_layers

    def device(self, name: str) -> DeviceKind:
        for device in self.devices:
            if device.name == name:
                return device
        raise ValueError(f"no device kind {name!r} in this cluster; it has "
                         f"{[d.name for d in self.devices]}")

    def sync_seconds_per_byte(self, device: DeviceKind) -> float:
        """Ring allreduce: each device sends and receives 2 (m - 1) / m of its stage's bytes."""
        if self.machines == 1:
            return 0.0
        bandwidth = device.sync_bytes_per_s or self.sync_bytes_per_s
        return 2.0 * (self.machines - 1) / self.machines / bandwidth


def _check_bandwidth(name: str, value) -> None:
    """Bytes per second: > 0; ``math.inf`` means the link costs nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of bytes per second > 0 (math.inf for a free "
                         f"link); got {value!r}")


def _check_profiles_agree(devices: Sequence[DeviceKind]) -> None:
    first = devices[0]
    for device in devices[1:]:
        if device.profile.num_layers != first.profile.num_layers:
            raise ValueError(
                f"inconsistent profiles: device {first.name!r} has {first.profile.num_layers} layers, "
                f"{device.name!r} has {device.profile.num_layers}; profile the same model on both")
        for field in ("output_bytes", "param_bytes", "input_bytes"):
            if getattr(device.profile, field) != getattr(first.profile, field):
                raise ValueError(
                    f"inconsistent profiles: {field} differs between {first.name!r} and "
                    f"{device.name!r}; profile the same model with the same micro-batch on both")


@dataclass(frozen=True)
class StageEstimate:
    """The cost model's figures for one stage (seconds per micro-batch, bytes per step)."""

    forward_s: float
    backward_s: float
    transfer_s: float  # to the next stage, each way; 0 for the last stage
    sync_s: float  # the data-parallel sync, then the optimizer's step
    memory_bytes: float


def stage_estimates(cluster: Cluster, order: Sequence[DeviceKind], boundaries: Sequence[int],
                    recompute: Sequence[bool], micro_batches: int, schedule: str) -> List[StageEstimate]:
    """Per-stage figures for the stages ``[boundaries[s], boundaries[s + 1])`` on ``order``."""
    profile = cluster.devices[0].profile
    num_stages = len(order)
    estimates = []
    for s, device in enumerate(order):
        layers = range(boundaries[s], boundaries[s + 1])
        forward = sum(device.profile.forward_s[l] for l in layers)
        backward = sum(device.profile.backward_s[l] for l in layers) + \
            (recompute_seconds(device.profile, layers) if recompute[s] else 0.0)
        last = s == num_stages - 1
        transfer = 0.0 if last else profile.output_bytes[layers[-1]] / cluster.stage_bytes_per_s
        params = sum(profile.param_bytes[l] for l in layers)
        saved = sum(device.profile.saved_bytes[l] for l in layers)
        in_flight = micro_batches if schedule == "gpipe" else min(micro_batches, num_stages - s)
        stage_input = profile.input_bytes if s == 0 else profile.output_bytes[layers[0] - 1]
        activations = (in_flight * stage_input + saved) if recompute[s] else in_flight * saved
        estimates.append(StageEstimate(
            forward, backward, transfer,
            params * cluster.sync_seconds_per_byte(device) + sum(device.profile.update_s[l] for l in layers),
            cluster.state_bytes_per_param_byte * params + activations))
    return estimates


def pipeline_seconds(estimates: Sequence[StageEstimate], micro_batches: int, schedule: str) -> float:
    """The pipeline part of a step (no sync), per the module's formulas."""
    check_choice("schedule", schedule, SCHEDULES)
    forward = [e.forward_s for e in estimates]
    backward = [e.backward_s for e in estimates]
    transfer = [e.transfer_s for e in estimates]
    fill = sum(forward) + sum(backward) + 2 * sum(transfer)
    if schedule == "gpipe":
        cycle = max(forward + transfer) + max(backward + transfer)
    else:
        cycle = max([f + b for f, b in zip(forward, backward)] + [2 * t for t in transfer])
    return fill + (micro_batches - 1) * cycle


def estimate_step(estimates: Sequence[StageEstimate], micro_batches: int, schedule: str) -> float:
    """Step time: the pipeline, then each stage's sync from when its last backward ends."""
    pipe = pipeline_seconds(estimates, micro_batches, schedule)
    step, drained = pipe, 0.0
    for estimate in estimates:
        step = max(step, pipe - drained + estimate.sync_s)
        drained += estimate.backward_s + estimate.transfer_s
    return step
