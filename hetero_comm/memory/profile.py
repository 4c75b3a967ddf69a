"""What each block of a model costs in time and memory, and what swapping costs.

The times and byte counts are the pipeline planner's (:func:`~hetero_comm.pipeline.profile_layers`),
so both planners price a recomputed layer the same way: its measured recomputation, which
early stopping often makes shorter than its forward.
"""

import functools
import math
import time
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._checks import check_int
from .._recompute import PRODUCT_OPS
from ..pipeline.profile import (LayerProfile, buffers_kept, median_recompute_seconds, profile_layers,
                                saved_storages)
from .meter import MemoryMeter
from .modes import SwapBlock, partial_forward, recomputed_forward
from .swap import make_swap_space

# keep: autograd keeps what the block saves; swap: it goes to the swap space and comes back;
# recompute: the block's forward runs again in the backward; partial: only its cheap operators
# run again (the outputs of matrix products, convolutions and attention are kept).
CHOICES = ("keep", "swap", "recompute", "partial")

__all__ = ["MemoryProfile", "profile_memory", "measure_swap_bandwidth", "chain_blocks"]


@dataclass(frozen=True)
class MemoryProfile:
    """One micro-batch through a chain of blocks: what each block costs and keeps.

    Attributes (one entry per block, in order, except ``layers``, ``swap_bytes_per_s``):
        names: how plans and errors name the blocks.
        layers: the pipeline planner's profile of the same blocks (forward and backward
            seconds, output and saved bytes, parameter bytes).
        internal_bytes: what autograd saves from the block's forward that is neither its input
            nor its output (nor a parameter): freed by recomputing, moved by swapping.
        saves_input / saves_output: whether autograd saves the block's input / output.
        forward_peak_bytes: per block, per mode in :data:`CHOICES` order (keep, swap,
            recompute, partial): the most the block's forward adds above its input, run alone.
        backward_peak_bytes: the same for its backward, above what is in memory when it starts
            (what the forward left, the output's gradient).
        partial_kept_bytes: what the block holds from its forward to its backward when it
            recomputes partially (the kept products' outputs; its input and output aside).
        partial_recompute_s: the seconds a partial recomputation adds to the block's backward.
        swap_bytes_per_s: the swap space's bandwidth, one way (:func:`measure_swap_bandwidth`).
        swap_overlaps_compute: whether a transfer runs beside the compute (CUDA's copy engines)
            rather than on the cores that compute (the CPU): then the next block's forward and
            backward hide it.
    """

    names: Tuple[str, ...]
    layers: LayerProfile
    internal_bytes: Tuple[int, ...]
    saves_input: Tuple[bool, ...]
    saves_output: Tuple[bool, ...]
    forward_peak_bytes: Tuple[Tuple[int, ...], ...]
    backward_peak_bytes: Tuple[Tuple[int, ...], ...]
    partial_kept_bytes: Tuple[int, ...]
    partial_recompute_s: Tuple[float, ...]
    swap_bytes_per_s: float
    swap_overlaps_compute: bool = True

    def __post_init__(self) -> None:
        count = self.layers.num_layers
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple) and field.name != "layers" and len(value) != count:
                raise ValueError(f"MemoryProfile.{field.name} has {len(value)} entries for "
                                 f"{count} blocks")
        for name in ("forward_peak_bytes", "backward_peak_bytes"):
            if any(len(peaks) != len(CHOICES) for peaks in getattr(self, name)):
                raise ValueError(f"MemoryProfile.{name} needs one peak per mode {CHOICES} for each block")
        if not (isinstance(self.swap_bytes_per_s, (int, float)) and self.swap_bytes_per_s > 0):
            raise ValueError(f"swap_bytes_per_s must be > 0 (math.inf: free); got "
                             f"{self.swap_bytes_per_s!r}")

    @property
    def num_blocks(self) -> int:
        return self.layers.num_layers

    def swap_bytes(self, block: int) -> int:
        """What swapping ``block`` moves each way: its internal storages and its saved output."""
        return self.internal_bytes[block] + (self.layers.output_bytes[block] if self.saves_output[block] else 0)


def chain_blocks(blocks) -> Tuple[Tuple[str, ...], Tuple[nn.Module, ...]]:
    """Names and modules of ``blocks``: an ``nn.Sequential``/``nn.ModuleList``, a list of
    modules, or a list of ``(name, module)`` pairs. Anything that is not a module is an error
    naming it: only a module boundary can be recomputed or swapped."""
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        pairs = list(blocks.named_children())
    else:
        pairs = [item if isinstance(item, tuple) else (str(index), item)
                 for index, item in enumerate(blocks)]
    if not pairs:
        raise ValueError("a memory plan needs at least one block")
    for name, module in pairs:
        if not isinstance(module, nn.Module):
            raise TypeError(f"block {name!r} is a {type(module).__name__}, not an nn.Module: the "
                            "memory planner swaps or recomputes whole modules; wrap that "
                            "computation in a module (or leave it out of the chain)")
    names = tuple(str(name) for name, _ in pairs)
    if len(set(names)) != len(names):
        raise ValueError(f"block names must be distinct; got {names}")
    return names, tuple(module for _, module in pairs)


def measure_swap_bandwidth(device, directory: Optional[str] = None, nbytes: int = 64 << 20,
                           repeats: int = 3) -> float:
    """Bytes per second, one way, through the swap space the planner will use on ``device``
    (pinned host memory for CUDA, a file in ``directory`` for the CPU): the median of
    ``repeats`` round trips of ``nbytes``, halved.

    On the CPU the copies run on the cores that compute, so each round trip is timed while
    this thread keeps multiplying matrices, as the training step would: the bandwidth left
    to swapping while the model computes (a few times less than on idle cores)."""
    check_int("nbytes", nbytes, 1)
    check_int("repeats", repeats, 1)
    device = torch.device(device)
    space = make_swap_space(device, directory)
    busy = None
    if device.type == "cpu":
        left, right = torch.randn(256, 256), torch.randn(256, 256)
        busy = functools.partial(torch.mm, left, right)
    samples = []
    try:
        for _ in range(repeats + 1):  # the first trip warms the file or the pinned pool
            data = torch.ones(nbytes, dtype=torch.uint8, device=device)
            _synchronize(device)
            start = time.perf_counter()
            ticket = space.offload(data)
            del data
            space.prefetch(ticket)
            while busy is not None and not space.ready(ticket):
                busy()
            space.fetch(ticket)
            _synchronize(device)
            samples.append(time.perf_counter() - start)
    finally:
        space.close()
    median = sorted(samples[1:])[len(samples[1:]) // 2]
    return math.inf if median == 0 else 2 * nbytes / median


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parameter_pointers(modules: Sequence[nn.Module]) -> set:
    return {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}


def _saved_storages(block: nn.Module, inputs: torch.Tensor, parameters: set):
    """The pipeline profiler's count of saved storages, for a block that must return one tensor."""
    output, saved = saved_storages(block, inputs, parameters)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a block must return one tensor (the next block's input); got "
                        f"{type(output).__name__}")
    return output, saved


def _peaks_in_mode(forward, block: nn.Module, inputs: torch.Tensor, meter: MemoryMeter,
                   settle) -> Tuple[int, int, int]:
    """The most a forward (``forward(inputs)``) adds above its input, what it leaves besides its
    output, and the most its backward adds above what is in memory when it starts (what the
    forward left, the output's gradient)."""
    meter.reset()
    output = forward(inputs)
    settle()
    forward_peak = meter.added_peak_bytes()
    new_output = output.untyped_storage().data_ptr() != inputs.untyped_storage().data_ptr()
    left = max(0, meter.current_bytes() - meter.start_bytes
               - (output.untyped_storage().nbytes() if new_output else 0))
    backward_peak = 0
    if output.requires_grad:
        gradient = torch.randn_like(output)
        meter.reset()
        output.backward(gradient)
        backward_peak = meter.added_peak_bytes()
    block.zero_grad(set_to_none=True)
    return forward_peak, left, backward_peak


def _block_memory(block: nn.Module, inputs: torch.Tensor, meter: MemoryMeter, parameters: set,
                  space, timing: Optional[dict]) -> Tuple[Dict, torch.Tensor]:
    """One block's memory row, run alone on ``inputs`` in each mode; and its output. With
    ``timing`` (the arguments of the pipeline profiler's timing), the partial recomputation's
    seconds too."""
    output, saved = _saved_storages(block, inputs, parameters)
    input_pointer = inputs.untyped_storage().data_ptr()
    output_pointer = output.untyped_storage().data_ptr()
    row = dict(internal_bytes=sum(n for p, n in saved.items() if p not in (input_pointer, output_pointer)),
               saves_input=input_pointer in saved, saves_output=output_pointer in saved)
    gradient = torch.randn_like(output) if output.requires_grad else None
    del saved, output  # and the graph that holds what the block saved
    original = type(block).forward.__get__(block)
    modes = {"keep": block, "swap": functools.partial(SwapBlock(block, space).forward, original),
             "recompute": functools.partial(recomputed_forward, original),
             "partial": functools.partial(partial_forward, original)}
    peaks = {}
    for mode, forward in modes.items():
        try:
            peaks[mode] = _peaks_in_mode(forward, block, inputs, meter, space.drain)
        except RuntimeError as error:
            # torch refuses a partial recomputation when the block changes a kept product's
            # output in place (a ReLU(inplace=True) after a Linear): give the block keep's
            # figures and a forward's cost, so that no plan chooses it.
            if mode != "partial" or "mutated" not in str(error):
                raise
            block.zero_grad(set_to_none=True)
            peaks[mode] = None
    refused = peaks["partial"] is None
    if refused:
        peaks["partial"] = peaks["keep"]
    row["forward_peak_bytes"] = tuple(peaks[mode][0] for mode in CHOICES)
    row["backward_peak_bytes"] = tuple(peaks[mode][2] for mode in CHOICES)
    row["partial_kept_bytes"] = row["internal_bytes"] if refused else min(peaks["partial"][1], row["internal_bytes"])
    row["partial_recompute_s"] = 0.0
    if refused:
        row["partial_recompute_s"] = math.inf  # replaced by the block's forward time below
    elif timing is not None and row["internal_bytes"] and gradient is not None:
        row["partial_recompute_s"] = median_recompute_seconds(
            block, inputs, gradient, None, keep_outputs_of=PRODUCT_OPS, **timing)
        block.zero_grad(set_to_none=True)
    del gradient
    with torch.no_grad():
        output = block(inputs)
    return row, output


def _memory_rows(names, modules, sample, meter, parameters, space, timing: dict) -> List[Dict]:
    rows, current = [], sample.detach()
    for index, (name, module) in enumerate(zip(names, modules)):
        # The model's input needs no gradient in training; every later block's input does.
        inputs = current.detach().requires_grad_(index > 0 and current.is_floating_point())
        try:
            # The first run pays for one-time set-up (the autograd engine's threads, their
            # allocator arenas); the second is what every step costs.
            _block_memory(module, inputs, meter, parameters, space, None)
            row, current = _block_memory(module, inputs, meter, parameters, space, timing)
        except TypeError as error:
            raise TypeError(f"block {name!r}: {error}") from None
        rows.append(row)
    return rows


def profile_memory(blocks, sample: torch.Tensor, *, swap_directory: Optional[str] = None,
                   swap_bytes_per_s: Optional[float] = None, repeats: int = 5,
                   min_sample_s: float = 0.02) -> MemoryProfile:
    """Profile a chain of blocks on ``sample`` (one micro-batch), on the device it is on.

    Each block runs on the output of the blocks before it: block ``i + 1`` must take block
    ``i``'s output (one tensor) as its only argument. Times come from
    :func:`~hetero_comm.pipeline.profile_layers`; memory from a :class:`MemoryMeter` around
    each block's forward and backward run alone; the swap bandwidth is measured with
    :func:`measure_swap_bandwidth` unless ``swap_bytes_per_s`` is given.

    Args:
        blocks: see :func:`chain_blocks`.
        sample: one micro-batch of the first block's input.
        swap_directory: where the CPU's swap file goes (default: the temporary folder).
    """
    names, modules = chain_blocks(blocks)
    meter = MemoryMeter(sample.device)
    parameters = _parameter_pointers(modules)
    space = make_swap_space(sample.device, swap_directory)
    timing = dict(repeats=repeats, warmup=1, min_sample_s=min_sample_s, device=sample.device)
    try:
        with buffers_kept(modules):
            rows = _memory_rows(names, modules, sample, meter, parameters, space, timing)
    finally:
        space.close()
    layers = profile_layers(modules, sample, repeats=repeats, min_sample_s=min_sample_s)
    if swap_bytes_per_s is None:
        swap_bytes_per_s = measure_swap_bandwidth(sample.device, swap_directory)
    columns = {key: tuple(row[key] for row in rows) for key in rows[0]}
    columns["partial_recompute_s"] = tuple(
        forward if math.isinf(seconds) else seconds
        for seconds, forward in zip(columns["partial_recompute_s"], layers.forward_s))
    return MemoryProfile(names=names, layers=layers, swap_bytes_per_s=swap_bytes_per_s,
                         swap_overlaps_compute=sample.device.type == "cuda", **columns)
