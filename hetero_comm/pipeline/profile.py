"""Per-layer costs for the planner: time each layer's forward and backward on
the device that will run it, and count the bytes it keeps, sends and holds as parameters."""

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn


from .._checks import check_float, check_int
from .._recompute import recompute_in_backward

__all__ = ["LayerProfile", "profile_layers", "gather_profiles", "recompute_seconds"]


@dataclass(frozen=True)
class LayerProfile:
    """What one micro-batch costs in each layer of a model, on one kind of device.

    Attributes (one entry per layer, in model order):
        forward_s / backward_s: seconds per micro-batch.
        output_bytes: the layer's output per micro-batch (sent to the next stage when a stage
            ends here; its gradient comes back the same size).
        saved_bytes: what autograd keeps from the layer's forward until its backward, per
            micro-batch (the activation memory a stage holds for each micro-batch in flight).
        param_bytes: the layer's parameters (the data-parallel sync of a stage sends these).
        input_bytes: the model's input per micro-batch (a scalar; what stage 0 receives).
        update_s: seconds of the optimizer's step on the layer's parameters, once per step
            (empty: not measured, taken as 0).
        recompute_s: seconds that recomputing the layer adds to its backward when it is the
            last layer of a checkpointed segment. Non-reentrant checkpointing stops once the
            last tensor the backward needs is rebuilt, so this is often less than
            ``forward_s`` (a transformer block skips its last matrix product); a layer
            followed by others in the segment runs whole (see :func:`recompute_seconds`).
            Empty: not measured, taken as ``forward_s``.
    """

    forward_s: Tuple[float, ...]
    backward_s: Tuple[float, ...]
    output_bytes: Tuple[int, ...]
    saved_bytes: Tuple[int, ...]
    param_bytes: Tuple[int, ...]
    input_bytes: int = 0
    update_s: Tuple[float, ...] = ()
    recompute_s: Tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.update_s:
            object.__setattr__(self, "update_s", (0.0,) * len(self.forward_s))
        if not self.recompute_s:
            object.__setattr__(self, "recompute_s", tuple(self.forward_s))
        lengths = {f.name: len(getattr(self, f.name)) for f in fields(self) if f.name != "input_bytes"}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"a LayerProfile needs one entry per layer in every field; got lengths "
                             f"{lengths}")
        if not lengths["forward_s"]:
            raise ValueError("a LayerProfile needs at least one layer")
        for name in lengths:
            for index, value in enumerate(getattr(self, name)):
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ValueError(f"{name}[{index}] must be a finite number >= 0; got {value!r}")
        check_int("input_bytes", self.input_bytes, 0)

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def scaled(self, time_factor: float) -> "LayerProfile":
        """The same layers on a device ``time_factor`` times slower (bytes unchanged)."""
        return LayerProfile(tuple(t * time_factor for t in self.forward_s),
                            tuple(t * time_factor for t in self.backward_s), self.output_bytes,
                            self.saved_bytes, self.param_bytes, self.input_bytes,
                            tuple(t * time_factor for t in self.update_s),
                            tuple(t * time_factor for t in self.recompute_s))


def recompute_seconds(profile: LayerProfile, layers: Sequence[int]) -> float:
    """What recomputing the contiguous ``layers`` as one checkpointed segment adds to their
    backward: every layer's forward but the last, whose run stops at its last saved tensor."""
    layers = list(layers)
    if not layers:
        return 0.0
    return sum(profile.forward_s[l] for l in layers[:-1]) + profile.recompute_s[layers[-1]]


@contextlib.contextmanager
def buffers_kept(modules: Sequence[nn.Module]):
    """Put the modules' buffers back as they were on entry: profiling runs each layer's forward
    in training mode many times, which would move BatchNorm's running statistics."""
    kept = [(buffer, buffer.clone()) for module in modules for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def saved_storages(layer: nn.Module, inputs: torch.Tensor,
                   excluded: Optional[set] = None) -> Tuple[torch.Tensor, Dict[int, int]]:
    """Run ``layer`` once; its output and the distinct storages autograd saves for its backward
    (data pointer -> bytes). Storages in ``excluded`` (default: the layer's parameters, counted
    as parameter memory) are left out."""
    if excluded is None:
        excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: Dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in excluded:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(inputs)
    return output, storages


def median_seconds(action, repeats: int, warmup: int, min_sample_s: float,
                   device: torch.device) -> float:
    """Median seconds per call of ``action``. Each sample runs it back to back for at least
    ``min_sample_s``: a CPU quota (or a clock that throttles) only shows over many periods,
    and a single short call can fit inside one period's budget at full speed."""

    def timed(calls: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            action()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(warmup):
        timed(1)
    calls = max(1, math.ceil(min_sample_s / max(timed(1), 1e-9)))
    return statistics.median(timed(calls) / calls for _ in range(repeats))


def profile_layers(layers: Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 5,
                   warmup: int = 2, min_sample_s: float = 0.02,
                   optimizer: Optional[Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = None
                   ) -> LayerProfile:
    """Time each layer's forward and backward on ``sample`` (one micro-batch) where it lives.

    Each layer runs on the output of the layers before it; its backward is timed alone, from
    a gradient of its output's shape. Times are medians of ``repeats`` samples after ``warmup``
    calls, each sample at least ``min_sample_s`` of back-to-back calls.
    Run it on the device (or under the CPU quota) that the stage will use: the planner's
    plan is only as good as these figures.

    Args:
        layers: the model's layers in order (an ``nn.Sequential`` works).
        sample: one micro-batch of model input.
        optimizer: makes the training's optimizer from a list of parameters (e.g.
            ``lambda params: torch.optim.AdamW(params)``); its step is timed per layer, on
            copies, so the layers' weights are left as they were. ``None``: not timed.

    Returns:
        a :class:`LayerProfile`.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    check_int("repeats", repeats, 1)
    check_int("warmup", warmup, 0)
    check_float("min_sample_s", min_sample_s, 0, 60)
    timing = dict(repeats=repeats, warmup=warmup, min_sample_s=min_sample_s, device=sample.device)
    rows, current = [], sample.detach()
    with buffers_kept(layers):
        for layer in layers:
            row, current = _profile_layer(layer, current, optimizer, timing)
            rows.append(row)
    columns = {name: tuple(row[name] for row in rows) for name in rows[0]}
    return LayerProfile(**columns, input_bytes=_tensor_bytes(sample))


def _profile_layer(layer: nn.Module, current: torch.Tensor, optimizer, timing: dict):
    """One layer's row of :func:`profile_layers` on input ``current``, and its output."""
    inputs = current.detach().requires_grad_(current.is_floating_point())
    output, storages = saved_storages(layer, inputs)
    saved = sum(storages.values())
    gradient = torch.randn_like(output) if output.is_floating_point() else None
    with torch.no_grad():
        forward_s = median_seconds(lambda: layer(inputs), **timing)

    def forward_backward():
        out = layer(inputs)
        if gradient is not None and out.requires_grad:
            out.backward(gradient)

    both = median_seconds(forward_backward, **timing)
    recompute_s = 0.0
    if saved and gradient is not None and output.requires_grad:
        recompute_s = median_recompute_seconds(layer, inputs, gradient, both, **timing)
    layer.zero_grad(set_to_none=True)
    row = dict(forward_s=forward_s, backward_s=max(both - forward_s, 0.0),
               output_bytes=_tensor_bytes(output), saved_bytes=saved,
               param_bytes=sum(_tensor_bytes(p) for p in layer.parameters()),
               update_s=_update_seconds(layer, optimizer, **timing), recompute_s=recompute_s)
    return row, output


class _RecomputeTimer:
    """Checkpoint's recompute context: adds up how long each recomputation ran (CUDA: between
    events on the stream it ran on), from its start to where early stopping ends it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: List[tuple] = []

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self) -> None:
        self.spans.append([self._mark(), None])

    def __exit__(self, *exc) -> bool:
        self.spans[-1][1] = self._mark()
        return False  # early stopping ends the recomputation with an exception checkpoint catches

    def take_seconds(self) -> float:
        """The spans' total since the last call."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            total = sum(start.elapsed_time(end) for start, end in self.spans) / 1e3
        else:
            total = sum(end - start for start, end in self.spans)
        self.spans = []
        return total


def median_recompute_seconds(layer: nn.Module, inputs: torch.Tensor, gradient: torch.Tensor,
                              call_s: Optional[float], repeats: int, warmup: int, min_sample_s: float,
                              device: torch.device, keep_outputs_of=None) -> float:
    """Median seconds of the recomputation when ``layer`` alone is checkpointed (non-reentrant,
    as the memory planner and the pipeline's recomputing stages run it; ``keep_outputs_of``:
    selectively), timed from inside: a difference of two timed steps would drown it in their
    noise. ``call_s``: how long a checkpointed forward and backward take (``None``: timed here)."""
    timer = _RecomputeTimer(device)

    def checkpointed_step():
        output = recompute_in_backward(layer, layer, inputs, keep_outputs_of=keep_outputs_of,
                                       recompute_context=timer)
        output.backward(gradient)

    for _ in range(max(warmup, 1)):
        start = time.perf_counter()
        checkpointed_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    call_s = time.perf_counter() - start if call_s is None else call_s
    timer.take_seconds()
    calls = max(1, math.ceil(min_sample_s / max(call_s, 1e-9)))
    samples = []
    for _ in range(repeats):
        for _ in range(calls):
            checkpointed_step()
        samples.append(timer.take_seconds() / calls)
    return statistics.median(samples)


def _update_seconds(layer: nn.Module, optimizer, repeats: int, warmup: int, min_sample_s: float,
                   device: torch.device) -> float:
    """The optimizer's step on copies of ``layer``'s parameters (with gradients)."""
    parameters = [p for p in layer.parameters() if p.requires_grad]
    if optimizer is None or not parameters:
        return 0.0
    copies = [nn.Parameter(p.detach().clone()) for p in parameters]
    for copy in copies:
        copy.grad = torch.randn_like(copy)
    stepper = optimizer(copies)
    return median_seconds(stepper.step, repeats, warmup, min_sample_s, device)


def gather_profiles(profile: LayerProfile, device_kind: str,
                    group: Optional[dist.ProcessGroup] = None) -> Dict[str, LayerProfile]:
    """Share every rank's profile (collective) and return one per device kind: the median over
    the ranks of that kind, layer by layer, so one noisy rank does not set the plan."""
    if not isinstance(device_kind, str) or not device_kind:
        raise ValueError(f"device_kind must be a non-empty string; got {device_kind!r}")
    gathered: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (device_kind, profile), group=group)
    by_kind: Dict[str, List[LayerProfile]] = {}
    for kind, their_profile in gathered:
        by_kind.setdefault(kind, []).append(their_profile)
    layer_counts = {kind: {p.num_layers for p in profiles} for kind, profiles in by_kind.items()}
    if len(set().union(*layer_counts.values())) != 1:
        raise ValueError(f"ranks profiled different numbers of layers: {layer_counts}")
    return {kind: _median_profile(profiles) for kind, profiles in by_kind.items()}


def _median_profile(profiles: Sequence[LayerProfile]) -> LayerProfile:
    def median_column(name):
        return tuple(statistics.median(column) for column in zip(*(getattr(p, name) for p in profiles)))

    first = profiles[0]
    return LayerProfile(median_column("forward_s"), median_column("backward_s"), first.output_bytes,
                        first.saved_bytes, first.param_bytes, first.input_bytes,
                        median_column("update_s"), median_column("recompute_s"))
