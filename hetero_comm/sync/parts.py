"""Layers of a model as the parts of a contribution, and the forward time before each part:
what the layer-wise soft deadline of :class:`~hetero_comm.sync.GroupSync` needs."""

import time
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = ["Part", "split_into_parts", "ForwardClock"]


@dataclass(frozen=True)
class Part:
    """Parameters ``[start, end)`` of the flat parameter vector, owned by ``modules``."""

    start: int
    end: int
    modules: Tuple[torch.nn.Module, ...]


def split_into_parts(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                     min_numel: int) -> List[Part]:
    """Consecutive layers merged into parts of at least ``min_numel`` elements (the last part
    may be smaller), in registration order, which is the order of ``module.parameters()`` and of
    the flat vector, and the order the layers run in for most models.

    A layer is a module that owns parameters directly; a parameter shared by two modules belongs
    to the first that registers it (as ``parameters()`` deduplicates it)."""
    owner = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owner.setdefault(id(p), sub)
    layers, offset = [], 0  # (start, end, owner): runs of parameters with one owner
    for p in params:
        if layers and layers[-1][2] is owner[id(p)]:
            layers[-1][1] += p.numel()
        else:
            layers.append([offset, offset + p.numel(), owner[id(p)]])
        offset += p.numel()
    parts, start, modules = [], 0, []
    for _, end, layer in layers:
        if layer not in modules:
            modules.append(layer)
        if end - start >= min_numel or end == offset:
            parts.append(Part(start, end, tuple(modules)))
            start, modules = end, []
    return parts


class ForwardClock:
    r"""Measures ``before[k]``: the time from the start of a training forward pass (the root
    module's forward pre-hook) to the first forward of one of part ``k``'s layers; an
    exponential average over passes (``smoothing`` is the weight of the newest). This is how long
    after its start the next forward needs part ``k``'s parameters. A part whose layers never
    run their own forward (their parameters used by a parent) keeps ``before[k] = 0``; passes
    without autograd (evaluation) are not measured."""

    def __init__(self, root: torch.nn.Module, parts: Sequence[Part], smoothing: float = 0.3):
        self.before = [0.0] * len(parts)
        self._seen_in_pass = [False] * len(parts)
        self._measured = [False] * len(parts)
        self._smoothing = smoothing
        self._start = None
        self._handles = [root.register_forward_pre_hook(self._on_root)]
        for k, part in enumerate(parts):
            for layer in part.modules:
                self._handles.append(layer.register_forward_pre_hook(self._on_part(k)))

    def _on_root(self, module, inputs) -> None:
        self._start = time.monotonic() if torch.is_grad_enabled() else None
        self._seen_in_pass = [False] * len(self.before)

    def _on_part(self, k: int):
        def hook(module, inputs) -> None:
            if self._start is None or self._seen_in_pass[k]:
                return
            self._seen_in_pass[k] = True
            elapsed = time.monotonic() - self._start
            weight = self._smoothing if self._measured[k] else 1.0
            self.before[k] += weight * (elapsed - self.before[k])
            self._measured[k] = True
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
