"""Peak memory of a stretch of code, on the device that runs it.

CUDA: the caching allocator's statistics (``max_memory_allocated``). CPU: the process's
resident set, whose high-water mark Linux resets on request (``/proc/self/clear_refs``);
so that the resident set follows the live tensors, the meter sets glibc's mmap threshold to
a fixed 64 KiB once (every block of 64 KiB or more is then returned to the system when freed,
instead of staying in the heap under glibc's moving threshold), and each reset trims the
heap's free memory (``malloc_trim``).
"""

import ctypes
import ctypes.util
import gc
from typing import Optional

import torch

__all__ = ["MemoryMeter"]

_MMAP_THRESHOLD_BYTES = 64 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_libc = None


def _glibc():
    """glibc, with the mmap threshold fixed (once per process)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim") or \
                libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) != 1:
            raise RuntimeError("measuring CPU memory needs glibc's mallopt (Linux with glibc)")
        _libc = libc
    return _libc


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; measuring CPU memory needs Linux")


class MemoryMeter:
    """Bytes in use on ``device`` now, and the most in use since :meth:`reset`.

    Example::

        >>> meter = MemoryMeter(torch.device("cpu"))
        >>> meter.reset()
        >>> loss = model(batch).sum(); loss.backward()
        >>> meter.peak_bytes() - meter.start_bytes   # what the step added at its peak
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            _glibc()
        elif self.device.type != "cuda":
            raise ValueError(f"MemoryMeter measures cpu or cuda memory; got device {self.device}")
        self.start_bytes: Optional[int] = None

    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_kib("VmRSS") * 1024

    def reset(self) -> None:
        """Collect young garbage, start a new peak, and record the bytes in use as ``start_bytes``."""
        # The young generations hold what the code measured last left in reference cycles; a
        # full collection walks every object of the process (80 ms and more with torch loaded,
        # per reset) for garbage that is rarely a tensor.
        gc.collect(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Free heap memory allocated before the threshold was fixed would serve new tensors
            # without growing the resident set: hand it back to the system first.
            _glibc().malloc_trim(0)
            try:
                with open("/proc/self/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")  # 5: reset the peak resident set size (Linux >= 4.0)
            except OSError as error:
                raise RuntimeError(f"cannot reset the peak resident set ({error}); measuring "
                                   "CPU memory needs Linux >= 4.0 and a writable /proc") from error
        self.start_bytes = self.current_bytes()

    def peak_bytes(self) -> int:
        """The most bytes in use since :meth:`reset` (including ``start_bytes``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024

    def added_peak_bytes(self) -> int:
        """``peak_bytes() - start_bytes``: what the code since :meth:`reset` added at its peak."""
        if self.start_bytes is None:
            raise RuntimeError("call MemoryMeter.reset() before reading what was added")
        return max(self.peak_bytes() - self.start_bytes, 0)
