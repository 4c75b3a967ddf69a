"""Split an existing model's MLP blocks over a process group, and pick the chunk count."""

import math
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .._agreement import agree_across_ranks
from .._checks import check_int
from ..pipeline.profile import median_seconds
from .layers import TensorParallelMLP
from .shards import shard_sizes

__all__ = ["find_mlps", "parallelize_mlps", "tune_chunks", "measure_speeds"]

# A timed sample runs steps back to back for at least this long: a CPU quota shows only over
# many of its periods.
MIN_SAMPLE_SECONDS = 0.05


def _is_activation(module: nn.Module) -> bool:
    return not isinstance(module, nn.Linear) and not any(True for _ in module.parameters())


def find_mlps(model: nn.Module) -> List[str]:
    """Names of the ``nn.Sequential(Linear, activation, Linear)`` blocks of ``model`` (the
    activation a module without parameters), in model order."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Sequential) and len(module) == 3 and isinstance(module[0], nn.Linear) \
                and _is_activation(module[1]) and isinstance(module[2], nn.Linear):
            names.append(name)
    return names


def _mlp_parts(model: nn.Module, name: str):
    try:
        block = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"the model has no submodule {name!r}") from None
    if not (isinstance(block, nn.Sequential) and len(block) == 3):
        raise TypeError(f"{name!r} is a {type(block).__name__}, not an nn.Sequential(Linear, "
                        "activation, Linear): only such blocks can be split")
    for index in (0, 2):
        if not isinstance(block[index], nn.Linear):
            raise TypeError(f"{name}.{index} is a {type(block[index]).__name__}, not an nn.Linear")
    if not _is_activation(block[1]):
        raise TypeError(f"{name}.1 ({type(block[1]).__name__}) has parameters: not an activation")
    return block


def parallelize_mlps(model: nn.Module, group=None, *, speeds: Optional[Sequence[float]] = None,
                     names: Optional[Sequence[str]] = None, chunks: int = 1,
                     multiple: int = 1) -> Dict[str, TensorParallelMLP]:
    """Replace MLP blocks of ``model`` in place by :class:`TensorParallelMLP` over ``group``.

    Collective: every rank of the group calls it on its copy of the same model (the group's
    first rank's weights are used). The rest of the model stays as it is, replicated. The
    blocks, their shard sizes and ``chunks`` are compared across the group first: ranks that
    differ (other speeds, another model) raise ``ValueError`` on every rank, naming them.

    Args:
        speeds: one per rank of the group (e.g. :func:`measure_speeds`, or the batch controller's
            samples per second): each rank's hidden neurons are proportional. ``None``: equal.
        names: the blocks to split (``model.get_submodule`` names); ``None``: every block
            :func:`find_mlps` finds (an error if there is none).
        chunks: pieces of each block's forward allreduce (:func:`tune_chunks` measures the best).
        multiple: each shard a multiple of this many neurons.

    Returns:
        the new modules by name.
    """
    ranks = dist.get_world_size(group)
    speeds = [1.0] * ranks if speeds is None else list(speeds)
    if len(speeds) != ranks:
        raise ValueError(f"{len(speeds)} speeds for {ranks} ranks in the group; give one per rank")
    names = find_mlps(model) if names is None else list(names)
    if not names:
        raise ValueError("the model has no nn.Sequential(Linear, activation, Linear) block; name "
                         "the blocks to split with names=")
    if "" in names:
        raise ValueError("the model itself is an nn.Sequential(Linear, activation, Linear) block, "
                         "which parallelize_mlps cannot replace in place: split a model that holds "
                         "it (e.g. nn.Sequential(mlp)), or build a TensorParallelMLP from its layers")
    blocks = {name: _mlp_parts(model, name) for name in names}
    sizes = {name: shard_sizes(block[0].out_features, speeds, multiple) for name, block in blocks.items()}
    # ranks that split differently would exchange mismatched shards (or wait on each other)
    agree_across_ranks("parallelize_mlps settings", dict(
        shards={name: list(shard) for name, shard in sizes.items()}, chunks=chunks,
        layers={name: (block[0].in_features, block[0].out_features, block[2].out_features)
                for name, block in blocks.items()}), group)
    replaced = {}
    for name, block in blocks.items():
        replaced[name] = TensorParallelMLP(block[0], block[1], block[2], sizes[name], group,
                                           chunks=chunks)
    for name, module in replaced.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
    return replaced


def _median_step_seconds(model: nn.Module, sample: torch.Tensor, repeats: int) -> float:
    """Median seconds of a forward and backward, each sample at least
    :data:`MIN_SAMPLE_SECONDS` of calls. Each rank picks its own number of calls: ``model``
    must not communicate (see :func:`_agreed_calls_per_sample` for one that does)."""
    seconds = median_seconds(lambda: _training_step(model, sample), repeats, warmup=1,
                              min_sample_s=MIN_SAMPLE_SECONDS, device=sample.device)
    model.zero_grad(set_to_none=True)
    return seconds


def _training_step(model: nn.Module, sample: torch.Tensor) -> None:
    model(sample).sum().backward()
    if sample.device.type == "cuda":
        torch.cuda.synchronize(sample.device)


def _agreed_calls_per_sample(model: nn.Module, sample: torch.Tensor, group) -> int:
    """Steps per timed sample, enough for :data:`MIN_SAMPLE_SECONDS` on every rank and the
    same on every rank: each step is collective."""
    _training_step(model, sample)
    start = time.perf_counter()
    _training_step(model, sample)
    needed = torch.tensor([math.ceil(MIN_SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-9))])
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    return int(needed.item())


def tune_chunks(model: nn.Module, sample: torch.Tensor, group=None,
                candidates: Sequence[int] = (1, 2, 4, 8), repeats: int = 5) -> int:
    """Time a forward and backward of ``model`` on ``sample`` with each chunk count of its
    :class:`TensorParallelMLP` blocks and set the fastest (the slowest rank's time decides).
    The candidates take turns, ``repeats`` rounds, and each is judged by its median, so a
    drift in the machine's speed during tuning favours none. Collective. Returns the chosen
    count."""
    check_int("repeats", repeats, 1)
    candidates = [check_int("chunk count", candidate, 1) for candidate in candidates]
    if not candidates:
        raise ValueError("tune_chunks needs at least one candidate chunk count")
    blocks = [m for m in model.modules() if isinstance(m, TensorParallelMLP)]
    if not blocks:
        raise ValueError("the model has no TensorParallelMLP block to tune")
    calls = _agreed_calls_per_sample(model, sample, group)
    samples: List[List[float]] = [[] for _ in candidates]
    for _ in range(repeats):
        for index, candidate in enumerate(candidates):
            for block in blocks:
                block.chunks = candidate
            _training_step(model, sample)  # warm, at this chunk count
            start = time.perf_counter()
            for _ in range(calls):
                _training_step(model, sample)
            samples[index].append((time.perf_counter() - start) / calls)
    model.zero_grad(set_to_none=True)
    medians = torch.tensor([statistics.median(times) for times in samples], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    best = candidates[int(torch.argmin(medians))]
    for block in blocks:
        block.chunks = best
    return best


def measure_speeds(block: nn.Module, sample: torch.Tensor, group=None, repeats: int = 3) -> List[float]:
    """Every rank's speed on ``block`` (an unsplit copy of one MLP): forward and backward passes
    per second on ``sample``, gathered over the group. Collective."""
    seconds = _median_step_seconds(block, sample, repeats)
    speeds = [None] * dist.get_world_size(group)
    dist.all_gather_object(speeds, 1.0 / max(seconds, 1e-9), group=group)
    return speeds
