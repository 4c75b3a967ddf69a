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
    """What autograd keeps for a swapped tensor: where its storage went and how to view it,
    and the tensor's version when saved (autograd's own check, which saved-tensor hooks skip)."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride", "source", "version")

    def __init__(self, storage: _SwappedStorage, tensor: torch.Tensor) -> None:
        self.storage, self.dtype = storage, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()
        self.source, self.version = weakref.ref(tensor), tensor._version

    def changed_in_place(self) -> bool:
        """Whether the saved tensor, still alive, was changed in place since it was saved."""
        tensor = self.source()
        return tensor is not None and tensor._version != self.version

    def restore(self, space: SwapSpace) -> torch.Tensor:
        storage = self.storage.fetch(space)
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride)


def _changed_after_saving(name: str) -> RuntimeError:
    return RuntimeError(
        f"block {name!r} is swapped, but a tensor its forward saved for the backward was changed "
        f"in place after it was saved (an in-place op on the output of an op that saves it, "
        f"e.g. sigmoid(x).mul_(2), or an in-place activation in the next block): without a plan "
        f"autograd refuses this, and swapped, the gradient would depend on when the copy was "
        f"made. Make that op out of place, or keep the block (choice 'keep')")


class SwapBlock:
    """Swaps what one block saves (not its parameters, buffers or input) during its forward;
    fetches it back from when the next block's backward begins (its own, for the last)."""

    def __init__(self, module: nn.Module, space: SwapSpace, name: str = "") -> None:
        self.module, self.space = module, space
        self.name = name or type(module).__name__
        self.latest: List[_SwappedStorage] = []  # what the latest forward swapped
        self.latest_saved: List[_SwappedTensor] = []  # and the tensors it saved

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
        packed: List[_SwappedTensor] = []

        def pack(tensor: torch.Tensor):
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in kept or tensor.device != self.space.device:
                return tensor
            if pointer not in swapped:
                data = storage_bytes(tensor)
                swapped[pointer] = (_SwappedStorage(self.space.offload(data)), data)
            packed.append(_SwappedTensor(swapped[pointer][0], tensor))
            return packed[-1]

        def unpack(saved):
            if not isinstance(saved, _SwappedTensor):
                return saved
            if saved.changed_in_place():  # after this forward (the next block's in-place op)
                raise _changed_after_saving(self.name)
            return saved.restore(self.space)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = original(inputs, *args, **kwargs)
        if any(saved.changed_in_place() for saved in packed):  # within this forward
            raise _changed_after_saving(self.name)
        self.latest_saved = list(packed)  # checked again after the next block's forward
        packed.clear()
        self.latest = [storage for storage, _ in swapped.values()]
        swapped.clear()  # autograd keeps ``pack`` (and so this dict) as long as the graph
        self.prefetch_when_output_gradient(self.latest, output)
        return output

    def next_block_hook(self, module, inputs, output) -> None:
        """Forward hook of the next block: its backward runs just before this block's. Its
        input (often this block's output) is alive here: an in-place change it made to what
        this block saved shows now."""
        saved, self.latest_saved = self.latest_saved, []
        if any(tensor.changed_in_place() for tensor in saved):
            raise _changed_after_saving(self.name)
        self.prefetch_when_output_gradient(self.latest, output)


def _prefetch(space: SwapSpace, storages: List[_SwappedStorage], gradient) -> None:
    for storage in storages:
        space.prefetch(storage.ticket)


def recomputed_forward(original, *args, block_name: str = "", **kwargs):
    """``original`` (a module's bound ``forward``) with its saved tensors rebuilt in the
    backward instead of kept (errors name ``block_name``)."""
    return recompute_in_backward(original.__self__, original, *args,
                                 name=f"block {block_name!r}" if block_name else "", **kwargs)


def partial_forward(original, *args, block_name: str = "", **kwargs):
    """``original`` keeping only the outputs of matrix products, convolutions and attention;
    the rest rebuilt in the backward. Where torch refuses the recomputation (the forward
    changed a kept output in place), the error names ``block_name``."""
    return recompute_in_backward(original.__self__, original, *args, keep_outputs_of=PRODUCT_OPS,
                                 recompute_context=_NamesRefusedBlock(block_name),
                                 name=f"block {block_name!r}" if block_name else "", **kwargs)


class _NamesRefusedBlock:
    """Around each partial recomputation: torch's refusal of a kept output changed in place,
    raised again naming the block and what to do."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, RuntimeError) and "mutated" in str(error) and self.name:
            raise RuntimeError(
                f"block {self.name!r} is partially recomputed, but its forward changes in place "
                f"the output of a matrix product, convolution or attention that the partial "
                f"recomputation keeps (e.g. ReLU(inplace=True) after a Linear): make that op out "
                f"of place, or give the block 'recompute' or 'keep' (torch: {error})") from error
        return False
