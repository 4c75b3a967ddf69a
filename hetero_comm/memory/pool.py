"""The pooled CPU allocator: freed storages go back to a free list by size class and serve
the next request of that class (reference-counted gradient maps, for every CPU tensor:
autograd frees a map when its last reference goes). It saves step time and raises the peak
(docs/design/memory.md, "Allocator and meter"). Opt-in, while the context is open;
it needs the compiled extension."""

import contextlib
from typing import Dict

import torch

from .._backend import extension_loaded

__all__ = ["pooled_cpu_allocator", "pooled_cpu_allocator_stats", "empty_pooled_cpu_cache"]


def _require_extension() -> None:
    if not extension_loaded():
        raise RuntimeError("the pooled CPU allocator is part of the compiled extension, which is "
                           "not built here (see docs/kernels.md#building)")


@contextlib.contextmanager
def pooled_cpu_allocator():
    """Allocate CPU tensors from the pool while the context is open.

    Tensors allocated inside may outlive it: their memory still returns to the pool when freed.
    The pool keeps what it holds until :func:`empty_pooled_cpu_cache`.

    Example::

        >>> with pooled_cpu_allocator():
        ...     train_steps(model)
        >>> pooled_cpu_allocator_stats()["reuses"] > 0
        True
    """
    _require_extension()
    previous = torch.ops.hetero_comm._use_pooled_cpu_allocator(True)
    try:
        yield
    finally:
        torch.ops.hetero_comm._use_pooled_cpu_allocator(previous)


def pooled_cpu_allocator_stats() -> Dict[str, int]:
    """``allocations`` (from the system), ``reuses`` (from a free list), ``bytes_reserved``,
    ``bytes_in_use``, since the process started."""
    _require_extension()
    names = ("allocations", "reuses", "bytes_reserved", "bytes_in_use")
    return dict(zip(names, torch.ops.hetero_comm._pooled_cpu_allocator_stats()))


def empty_pooled_cpu_cache() -> None:
    """Return every free block of the pool to the system."""
    _require_extension()
    torch.ops.hetero_comm._pooled_cpu_allocator_empty_cache()
