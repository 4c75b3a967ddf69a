"""Run a :class:`~hetero_comm.memory.MemoryPlan` on a model: recomputed blocks through
``torch.utils.checkpoint``, swapped blocks through ``saved_tensors_hooks``."""

import functools
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .modes import SwapBlock, partial_forward, recomputed_forward
from .plan import MemoryPlan
from .profile import chain_blocks
from .swap import SwapSpace, make_swap_space

__all__ = ["apply_memory_plan", "AppliedMemoryPlan"]


def parameter_device(modules: Sequence[nn.Module]) -> torch.device:
    """The device every parameter of ``modules`` is on; the CPU when they are spread or absent."""
    devices = {p.device for module in modules for p in module.parameters()}
    return next(iter(devices)) if len(devices) == 1 else torch.device("cpu")


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
            module.forward = functools.partial(recomputed_forward, original, block_name=names[index])
        elif choice == "partial":
            module.forward = functools.partial(partial_forward, original, block_name=names[index])
        elif choice == "swap":
            block = SwapBlock(module, space, names[index])
            module.forward = functools.partial(block.forward, original)
            if index + 1 < len(modules):
                hooks.append(modules[index + 1].register_forward_hook(block.next_block_hook))
    return AppliedMemoryPlan(modules, space, hooks)
