"""CUDA stream order between a hook and the callback of its collective's future.

On CUDA, ``Future.then`` runs the callback with a stream of its own as the current one, and
that stream waits only for the collective. Two things then need ordering by hand:

* work the hook queued on its own stream AFTER issuing the collective (the DCT hook's
  error-feedback step) must finish before the callback overwrites the same buffers:
  :meth:`CallbackOrder.mark` records an event there and the callback waits for it
  (:meth:`CallbackOrder.wait`);
* the buffer pool knows nothing of streams, so a buffer the callback used must not go back
  to it while the callback's kernels may still run: :meth:`CallbackOrder.release` keeps such
  buffers out, with an event recorded on the callback's stream, until the next hook call,
  whose stream first waits for that event (:meth:`CallbackOrder.settle`).

On the CPU every method does the plain thing (no events, immediate release).
"""

import threading
from typing import Iterable, List, Optional, Tuple

import torch

from ..buffer_pool import BufferPool

__all__ = ["CallbackOrder"]


class CallbackOrder:
    """Orders a hook's callbacks after its own CUDA work, and the reuse of their pooled
    buffers after the callbacks' work (see the module docstring)."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()  # gloo runs callbacks on its own threads
        self._pending: List[Tuple[torch.cuda.Event, torch.device, Tuple[torch.Tensor, ...]]] = []

    @staticmethod
    def mark(device: torch.device) -> Optional[torch.cuda.Event]:
        """An event after the work queued so far on ``device``'s current stream (``None`` on
        the CPU). Call it on the hook's thread, before ``Future.then``: NCCL's future may run
        the callback at once."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @staticmethod
    def wait(mark: Optional[torch.cuda.Event], device: torch.device) -> None:
        """In the callback: its stream waits for ``mark`` (a no-op for ``None``)."""
        if mark is not None:
            torch.cuda.current_stream(device).wait_event(mark)

    def release(self, buffers: Iterable[torch.Tensor], device: torch.device) -> None:
        """In the callback: give ``buffers`` back once the callback's queued work has run."""
        buffers = tuple(buffers)
        if device.type != "cuda":
            for buffer in buffers:
                self.pool.release(buffer)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        with self._lock:
            self._pending.append((done, device, buffers))

    def settle(self) -> None:
        """On the hook's thread, before it acquires buffers: its stream waits for the
        callbacks' work, then their buffers go back to the pool."""
        if not self._pending:  # (a callback appending now is settled at the next call)
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for done, device, buffers in pending:
            torch.cuda.current_stream(device).wait_event(done)
            for buffer in buffers:
                self.pool.release(buffer)
