"""Run a :class:`~hetero_comm.memory.MemoryPlan` on a model: recomputed blocks through
``torch.utils.checkpoint``, swapped blocks through ``saved_tensors_hooks``."""

import functools
import weakref
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .._recompute import PRODUCT_OPS, recompute_in_backward
from .plan import MemoryPlan
from .profile import chain_blocks
from .swap import SwapSpace, make_swap_space, storage_bytes

__all__ = ["apply_memory_plan", "AppliedMemoryPlan"]


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


class _SwapBlock:
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


def parameter_device(modules: Sequence[nn.Module]) -> torch.device:
    """The device every parameter of ``modules`` is on; the CPU when they are spread or absent."""
    devices = {p.device for module in modules for p in module.parameters()}
    return next(iter(devices)) if len(devices) == 1 else torch.device("cpu")


def _prefetch(space: SwapSpace, storages: List[_SwappedStorage], gradient) -> None:
    for storage in storages:
        space.prefetch(storage.ticket)


def _recomputed_forward(original, *args, **kwargs):
    return recompute_in_backward(original.__self__, original, *args, **kwargs)


def _partial_forward(original, *args, **kwargs):
    return recompute_in_backward(original.__self__, original, *args, keep_outputs_of=PRODUCT_OPS, **kwargs)


class AppliedMemoryPlan:
    """A plan in effect on a model's blocks; :meth:`remove` restores their ``forward``."""

    def __init__(self, modules: Sequence[nn.Module], space: Optional[SwapSpace], hooks: list) -> None:
        self._modules, self._hooks = list(modules), hooks
        self.space = space

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        for hook in self._hooks:
            hook.remove()
        self._modules, self._hooks = [], []
        if self.space is not None:
            self.space.close()
            self.space = None

    def __enter__(self) -> "AppliedMemoryPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def apply_memory_plan(blocks, plan: MemoryPlan, *, swap_directory: Optional[str] = None) -> AppliedMemoryPlan:
    """Make each block of ``blocks`` keep, swap or (partly) recompute its activations as ``plan`` says.

    The blocks are the ones the plan was made for (same names, see
    :func:`~hetero_comm.memory.chain_blocks`); the model is used as before (any caller of the
    blocks, DDP included). Recomputed blocks run under ``torch.utils.checkpoint``
    (non-reentrant, random state preserved, buffers such as BatchNorm's running statistics
    updated once); partially recomputed blocks too, keeping the outputs of their matrix
    products, convolutions and attention (torch's selective checkpointing, so only the cheap
    operators run again; it allows one backward per forward); swapped blocks send what autograd saves, except
    parameters, buffers and the block's input, to the swap space (pinned host memory on CUDA,
    a file in ``swap_directory`` on the CPU) and fetch it back one block ahead of the
    backward. Values are unchanged: gradients are bitwise those of the unplanned model.

    Returns:
        an :class:`AppliedMemoryPlan`; ``remove()`` (or leaving its ``with`` block) undoes it.
    """
    names, modules = chain_blocks(blocks)
    if names != plan.names:
        raise ValueError(f"the plan was made for blocks {plan.names}; these are {names}")
    for name, module in zip(names, modules):
        if "forward" in module.__dict__:
            raise ValueError(f"block {name!r} already has a memory plan (or another wrapper of "
                             "its forward); remove that first")
    space = None
    if "swap" in plan.choices:
        space = make_swap_space(parameter_device(modules), swap_directory)
    hooks = []
    for index, (module, choice) in enumerate(zip(modules, plan.choices)):
        original = type(module).forward.__get__(module)
        if choice == "recompute":
            module.forward = functools.partial(_recomputed_forward, original)
        elif choice == "partial":
            module.forward = functools.partial(_partial_forward, original)
        elif choice == "swap":
            block = _SwapBlock(module, space)
            module.forward = functools.partial(block.forward, original)
            if index + 1 < len(modules):
                hooks.append(modules[index + 1].register_forward_hook(block.next_block_hook))
    return AppliedMemoryPlan(modules, space, hooks)
