"""``hetero_comm.BufferPool``: the C++ pool when the extension is built, else the pure-Python
one (``_python_pool``)."""

from __future__ import annotations

from typing import Union

import torch

from ._backend import extension_loaded
from ._python_pool import PythonBufferPool


class BufferPool:
    """Reference-counted pool of work buffers, so steady-state steps allocate nothing.

    ``acquire`` hands out a contiguous tensor with reference count 1, reusing the storage of
    a released buffer of the same size class (sizes rounded up to 1, 1.25, 1.5 or 1.75 times
    a power of two bytes, at least 256) on the same device; ``retain`` adds a reference,
    ``release`` drops one and at zero returns the storage to the pool. A released buffer's
    contents are undefined and its storage will be handed out again: stop using it.
    Releasing a tensor the pool did not hand out, or one already returned, raises
    ``ValueError``. Thread-safe; the bookkeeping runs in C++ when the extension is built.

    Example::

        >>> pool = BufferPool()
        >>> buf = pool.acquire(1024, torch.float32)
        >>> pool.release(buf)
        >>> again = pool.acquire(1000, torch.float32)   # same storage, no new allocation
        >>> pool.stats()["reuses"]
        1
    """

    def __init__(self) -> None:
        self._impl = torch.classes.hetero_comm.BufferPool() if extension_loaded() else PythonBufferPool()

    def acquire(self, numel: int, dtype: torch.dtype = torch.float32,
                device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """Return an uninitialised 1-D tensor of ``numel`` elements (reference count 1)."""
        return self._impl.acquire(int(numel), dtype, torch.device(device))

    def retain(self, tensor: torch.Tensor) -> None:
        """Add one reference to a buffer handed out by :meth:`acquire`."""
        self._impl.retain(tensor)

    def release(self, tensor: torch.Tensor) -> None:
        """Drop one reference; at zero the storage goes back to the pool."""
        self._impl.release(tensor)

    def empty_cache(self) -> None:
        """Free every storage not in use."""
        self._impl.empty_cache()

    def stats(self) -> dict:
        """``allocations``, ``reuses``, ``bytes_reserved``, ``bytes_in_use``, ``buffers_in_use``."""
        return dict(self._impl.stats())
