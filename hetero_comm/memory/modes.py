"""How a block runs in each of the memory planner's modes but "keep": swapped (what its forward
saves goes to a swap space and comes back before its backward), recomputed, or partially
recomputed. Used by :func:`~hetero_comm.memory.apply_memory_plan` and by the profiler."""

import functools
import weakref
from typing import Dict, List

import torch
import torch.nn as nn

from .._recompute import PRODUCT_OPS, recompute_in_backward
from .swap import SwapSpace, storage_bytes

__all__ = ["SwapBlock", "recomputed_forward", "partial_forward"]


class _SwappedStorage:
    """One storage in the swap space; the copy fetched last, while a restored tensor uses it
    (so the saved tensors that share a storage fetch it once)."""

    __slots__ = ("ticket", "fetched")

    def __init__(self, ticket) -> None:
        self.ticket = ticket
        self.fetched = lambda: None

    def fetch(self, space: SwapSpace) -> torch.UntypedStorage:
        storage = self.fetched()
        if storage is None:
            storage = space.fetch(self.ticket).untyped_storage()
            self.fetched = weakref.ref(storage)  # torch keeps one Python object per storage
        return storage


class _SwappedTensor:
    """What autograd keeps for a swapped tensor: where its storage went and how to view it."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: _SwappedStorage, tensor: torch.Tensor) -> None:
        self.storage, self.dtype = storage, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()

    def restore(self, space: SwapSpace) -> torch.Tensor:
        storage = self.storage.fetch(space)
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride)


class SwapBlock:
    """Swaps what one block saves (not its parameters, buffers or input) during its forward;
    fetches it back from when the next block's backward begins (its own, for the last)."""

    def __init__(self, module: nn.Module, space: SwapSpace) -> None:
        self.module, self.space = module, space
        self.latest: List[_SwappedStorage] = []  # what the latest forward swapped

    def prefetch_when_output_gradient(self, storages: List[_SwappedStorage], output) -> None:
        """Start fetching ``storages`` when the gradient of ``output`` is computed."""
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(_prefetch, self.space, storages))

    def forward(self, original, inputs, *args, **kwargs):
        kept = {t.untyped_storage().data_ptr() for t in
                list(self.module.parameters()) + list(self.module.buffers())}
        if isinstance(inputs, torch.Tensor):
            kept.add(inputs.untyped_storage().data_ptr())
        # Storages swapped in this forward, held until it ends so that no new tensor can take
        # the address of one already written (the address is the key).
        swapped: Dict[int, tuple] = {}

        def pack(tensor: torch.Tensor):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in kept or tensor.device != self.space.device:
                return tensor
            if pointer not in swapped:
                data = storage_bytes(tensor)
                swapped[pointer] = (_SwappedStorage(self.space.offload(data)), data)
            return _SwappedTensor(swapped[pointer][0], tensor)

        def unpack(packed):
            return packed.restore(self.space) if isinstance(packed, _SwappedTensor) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = original(inputs, *args, **kwargs)
        self.latest = [storage for storage, _ in swapped.values()]
        swapped.clear()  # autograd keeps ``pack`` (and so this dict) as long as the graph
        self.prefetch_when_output_gradient(self.latest, output)
        return output

    def next_block_hook(self, module, inputs, output) -> None:
        """Forward hook of the next block: its backward runs just before this block's."""
        self.prefetch_when_output_gradient(self.latest, output)


def _prefetch(space: SwapSpace, storages: List[_SwappedStorage], gradient) -> None:
    for storage in storages:
        space.prefetch(storage.ticket)


def recomputed_forward(original, *args, **kwargs):
    """``original`` (a module's bound ``forward``) with its saved tensors rebuilt in the
    backward instead of kept."""
    return recompute_in_backward(original.__self__, original, *args, **kwargs)


def partial_forward(original, *args, **kwargs):
    """``original`` keeping only the outputs of matrix products, convolutions and attention;
    the rest rebuilt in the backward."""
    return recompute_in_backward(original.__self__, original, *args, keep_outputs_of=PRODUCT_OPS, **kwargs)
