"""The pure-Python BufferPool: the fallback behind ``hetero_comm.BufferPool`` when the
extension is not built, and the second implementation the pool tests hold the C++ pool
(``csrc/buffer_pool.cpp``) to."""

from __future__ import annotations

import threading

import torch

from ._checks import check_int

__all__ = ["PythonBufferPool", "pool_device", "size_class_bytes"]

def size_class_bytes(nbytes: int) -> int:
    """Bytes reserved for a request: the next of {1, 1.25, 1.5, 1.75} x 2^p, at least 256.

    Quarter-power-of-two classes waste at most 25% while letting buffers of nearby sizes
    share storage.
    """
    if nbytes <= 256:
        return 256
    power = 1 << (nbytes - 1).bit_length() - 1  # largest power of two below nbytes
    quarter = power // 4
    return power + ((nbytes - power + quarter - 1) // quarter) * quarter


def pool_device(device) -> torch.device:
    """The device free buffers are kept under: ``"cuda"`` (no index) is the current CUDA
    device, so it shares buffers with ``"cuda:<current index>"``; ``"cpu:0"`` is ``"cpu"``."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


class PythonBufferPool:
    """Reference-counted pool of work buffers (pure-Python reference of the C++ pool).

    ``acquire`` returns a tensor with reference count 1, taking the storage of an earlier
    released buffer of the same size class and device when one is free; ``retain`` adds a
    reference; ``release`` removes one, and at zero the storage goes back to the pool.
    Releasing a tensor the pool did not hand out, or one already returned, raises
    ``ValueError``. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: dict = {}   # storage key -> [refcount, class bytes]
        self._free: dict = {}     # (device, class bytes) -> list of untyped storages
        self._owned: dict = {}    # storage key -> untyped storage, every storage the pool made
        self._allocations = 0
        self._reuses = 0
        self._bytes_reserved = 0
        self._bytes_in_use = 0

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def acquire(self, numel: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        """Return an uninitialised contiguous ``dtype`` tensor of ``numel`` elements."""
        check_int("numel", numel, 0)
        device = pool_device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        class_bytes = size_class_bytes(numel * itemsize)
        with self._lock:
            free = self._free.get((device, class_bytes))
            if free:
                storage = free.pop()
                self._reuses += 1
            else:
                storage = torch.empty(class_bytes, dtype=torch.uint8, device=device).untyped_storage()
                self._owned[storage.data_ptr()] = storage
                self._allocations += 1
                self._bytes_reserved += class_bytes
            self._in_use[storage.data_ptr()] = [1, class_bytes]
            self._bytes_in_use += class_bytes
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))

    def _entry(self, t: torch.Tensor, action: str):
        key = self._key(t)
        entry = self._in_use.get(key)
        if entry is None:
            if key in self._owned:
                raise ValueError(f"cannot {action} a buffer that was already released to the pool")
            raise ValueError(f"cannot {action} a tensor this pool did not hand out")
        return key, entry

    def retain(self, t: torch.Tensor) -> None:
        """Add one reference to a buffer handed out by :meth:`acquire`."""
        with self._lock:
            self._entry(t, "retain")[1][0] += 1

    def release(self, t: torch.Tensor) -> None:
        """Drop one reference; at zero the storage becomes free for the next acquire."""
        with self._lock:
            key, entry = self._entry(t, "release")
            entry[0] -= 1
            if entry[0] == 0:
                del self._in_use[key]
                self._bytes_in_use -= entry[1]
                self._free.setdefault((pool_device(t.device), entry[1]), []).append(self._owned[key])

    def empty_cache(self) -> None:
        """Drop every free storage (buffers still in use are kept)."""
        with self._lock:
            for storages in self._free.values():
                for storage in storages:
                    self._bytes_reserved -= storage.nbytes()
                    del self._owned[storage.data_ptr()]
            self._free.clear()

    def stats(self) -> dict:
        """Counters: allocations, reuses, bytes_reserved, bytes_in_use, buffers_in_use."""
        with self._lock:
            return {
                "allocations": self._allocations,
                "reuses": self._reuses,
                "bytes_reserved": self._bytes_reserved,
                "bytes_in_use": self._bytes_in_use,
                "buffers_in_use": len(self._in_use),
            }
