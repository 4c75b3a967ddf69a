"""Recomputing a module in the backward (non-reentrant ``torch.utils.checkpoint``) without
changing its buffers twice.

Checkpointing runs a module's forward a second time in the backward. A forward that updates
buffers (BatchNorm's running statistics and batch count) would update them again there: the
running mean would move two steps per batch. Here the forward notes which modules changed a
buffer, and the recomputation puts those modules' buffers back as they were when it began.
"""

import contextlib
import functools
import weakref
from typing import FrozenSet, List, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["recompute_in_backward", "PRODUCT_OPS"]


def _aten_ops(*names: str) -> FrozenSet:
    """The default overloads of those of ``names`` this torch has."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


# The costly operators (matrix products, convolutions, attention): a partial recomputation keeps
# their outputs and reruns the rest (normalisations, activations, reshapes, sums), which costs
# little time for much of the memory.
PRODUCT_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                        "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                        "_efficient_attention_forward")


def _modules_with_buffers(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if next(m.buffers(recurse=False), None) is not None]


def _versions(module: nn.Module) -> tuple:
    return tuple(buffer._version for buffer in module.buffers(recurse=False))


class _ForwardNotes:
    """Checkpoint's forward context: which modules' buffer versions move during the forward
    (BatchNorm's in-place batch count does; its running statistics, written by the kernel, do
    not move theirs, so every buffer of such a module is kept)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.changed: List[nn.Module] = []

    def __enter__(self) -> None:
        self.candidates = _modules_with_buffers(self.module)
        self.before = [_versions(m) for m in self.candidates]

    def __exit__(self, *exc) -> bool:
        self.changed = [m for m, versions in zip(self.candidates, self.before) if _versions(m) != versions]
        return False


class _BuffersKept:
    """Checkpoint's recompute context (entered once per recomputation, so any number of
    backward passes): the changing modules' buffers as they were when it began."""

    def __init__(self, notes: _ForwardNotes, inner: Optional[contextlib.AbstractContextManager]) -> None:
        self.notes, self.inner = notes, inner or contextlib.nullcontext()
        self.kept: List[tuple] = []

    def __enter__(self) -> None:
        self.kept = [(buffer, buffer.clone()) for m in self.notes.changed for buffer in m.buffers(recurse=False)]
        self.inner.__enter__()

    def __exit__(self, *exc) -> bool:
        # Early stopping ends a recomputation with an exception that checkpoint catches.
        try:
            self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for buffer, value in self.kept:
                    buffer.copy_(value)
            self.kept = []
        return False


class _Nested:
    """Several contexts entered as one (in order), any number of times."""

    def __init__(self, *contexts) -> None:
        self.contexts = [context for context in contexts if context is not None]
        self.stacks: List[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for context in self.contexts:
            stack.enter_context(context)
        self.stacks.append(stack)

    def __exit__(self, *exc) -> bool:
        return self.stacks.pop().__exit__(*exc)


class _SavedUnchanged:
    """Checkpoint's forward context, innermost: notes the version of every tensor the forward
    saves (passing it on to checkpoint's own hooks) and raises, naming ``name``, when the
    forward changed one in place after saving it. Without checkpointing autograd refuses such a
    backward; with it the recomputation would silently use the changed value."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.saved: List[tuple] = []

    def __enter__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:  # (checkpoint always has its hooks here; nothing to watch otherwise)
            self.pushed = False
            return
        outer_pack, outer_unpack = outer

        def pack(tensor: torch.Tensor):
            self.saved.append((weakref.ref(tensor), tensor._version))
            return outer_pack(tensor)

        torch._C._autograd._push_saved_tensors_default_hooks(pack, outer_unpack)
        self.pushed = True

    def __exit__(self, *exc) -> bool:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        saved, self.saved = self.saved, []
        if exc[0] is None and any(ref() is not None and ref()._version != version
                                  for ref, version in saved):
            raise RuntimeError(
                f"{self.name} is recomputed in the backward, but its forward changed a tensor in "
                f"place after saving it for the backward (an in-place op on the output of an op "
                f"that saves it, e.g. sigmoid(x).mul_(2)): without recomputation autograd refuses "
                f"this backward, and recomputed it would use the changed value. Make that op "
                f"out of place, or keep the block's activations")
        return False


def _keep_outputs_of(ops: FrozenSet):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def recompute_in_backward(module: nn.Module, function, *args, keep_outputs_of: Optional[FrozenSet] = None,
                          recompute_context: Optional[contextlib.AbstractContextManager] = None,
                          name: str = "", **kwargs):
    """``function(*args, **kwargs)``, a forward of ``module``, under non-reentrant checkpointing
    (random state preserved): what it saves for the backward is dropped and rebuilt when the
    backward needs it. Buffers the forward changes in place (BatchNorm's statistics) are changed
    once, as without checkpointing; a buffer the forward replaces by a new tensor is not tracked.

    ``keep_outputs_of``: aten operators whose outputs are kept from the forward instead
    (torch's selective checkpointing), so the recomputation runs only the others.
    ``recompute_context`` (optional) is entered around each recomputation. A forward that
    changes a tensor in place after saving it raises ``RuntimeError`` naming ``name`` (default:
    the module's type), where autograd would refuse the backward without recomputation."""
    if torch.compiler.is_compiling():
        # Compiled, checkpoint becomes part of the graph and accepts no Python contexts; the
        # compiler's recomputation replays no buffer update.
        if keep_outputs_of is None:
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_outputs_of(keep_outputs_of))
        return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    selective = (None, None) if keep_outputs_of is None else \
        create_selective_checkpoint_contexts(_keep_outputs_of(keep_outputs_of))
    notes = _ForwardNotes(module)
    watched = _SavedUnchanged(name or f"the {type(module).__name__} module")
    contexts = (_Nested(notes, selective[0], watched),
                _BuffersKept(notes, _Nested(selective[1], recompute_context)))
    return checkpoint(function, *args, use_reentrant=False, context_fn=lambda: contexts, **kwargs)
