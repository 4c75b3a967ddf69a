"""Where swapped activations go between the forward and the backward, asynchronously.

* :class:`HostSwap` (CUDA tensors): pinned host memory, copied on a side stream.
* :class:`FileSwap` (CPU tensors): a file (the page cache, then the disk), written and read by
  one background thread; the process's memory is freed as soon as a write completes.

Both move whole storages as bytes, so a view comes back with the same offset and strides,
and every value bit for bit.
"""

import abc
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

__all__ = ["SwapSpace", "HostSwap", "FileSwap", "make_swap_space", "storage_bytes"]


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a 1-D uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


class SwapSpace(abc.ABC):
    """A place to keep byte buffers while they are not needed on the device.

    ``offload(data)`` starts moving ``data`` (1-D uint8) away and returns a ticket; the device
    memory is released once the move completes. ``prefetch(ticket)`` starts bringing it back,
    ``fetch(ticket)`` returns it on the device (waiting if needed). A ticket may be fetched
    any number of times (a graph kept for a second backward). ``device``: where the data lives
    when it is not swapped.
    """

    device: torch.device

    @abc.abstractmethod
    def offload(self, data: torch.Tensor):
        """Start moving ``data`` away; return its ticket."""

    @abc.abstractmethod
    def prefetch(self, ticket) -> None:
        """Start bringing ``ticket``'s data back (nothing if already under way)."""

    @abc.abstractmethod
    def fetch(self, ticket) -> torch.Tensor:
        """``ticket``'s data on the device, waiting for it if needed."""

    @abc.abstractmethod
    def drain(self) -> None:
        """Wait until every offload so far has completed."""

    @abc.abstractmethod
    def ready(self, ticket) -> bool:
        """Whether a prefetch of ``ticket`` has arrived (``fetch`` would not wait)."""

    def close(self) -> None:
        """Release what the space holds (files, threads); nothing by default."""


class _FileTicket:
    __slots__ = ("offset", "nbytes", "written", "read", "space", "__weakref__")

    def __init__(self, space: "FileSwap", offset: int, nbytes: int) -> None:
        self.space, self.offset, self.nbytes = space, offset, nbytes
        self.written: Optional[Future] = None
        self.read: Optional[Future] = None

    def __del__(self) -> None:
        self.space._ticket_released()


class FileSwap(SwapSpace):
    """Swap CPU storages to a file in ``directory`` (default: the system's temporary folder).

    One background thread writes and reads; ``os.pwrite``/``os.preadv`` release the GIL, so
    it runs while the forward and the backward compute. The file is unlinked at once (it
    disappears with the process) and its space is reused once every ticket is gone.
    """

    def __init__(self, directory: Optional[str] = None) -> None:
        directory = directory or tempfile.gettempdir()
        if not os.path.isdir(directory):
            raise ValueError(f"swap directory {directory!r} does not exist")
        handle, path = tempfile.mkstemp(prefix="hetero_comm_swap_", dir=directory)
        os.unlink(path)
        self.device = torch.device("cpu")
        self._fd = handle
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero_comm_swap")
        self._lock = threading.Lock()
        self._end = 0
        self._live_tickets = 0

    def _ticket_released(self) -> None:
        with self._lock:
            self._live_tickets -= 1
            if self._live_tickets == 0:
                self._end = 0  # nothing in the file is needed any more: write from the start

    def offload(self, data: torch.Tensor) -> _FileTicket:
        nbytes = data.numel()
        with self._lock:
            ticket = _FileTicket(self, self._end, nbytes)
            self._end += nbytes
            self._live_tickets += 1
        # The worker holds ``data`` until it is written; then the last reference goes.
        ticket.written = self._worker.submit(self._write, data, ticket.offset)
        return ticket

    def _write(self, data: torch.Tensor, offset: int) -> None:
        view = memoryview(data.numpy())
        while len(view):
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _read(self, ticket: _FileTicket) -> torch.Tensor:
        ticket.written.result()
        data = torch.empty(ticket.nbytes, dtype=torch.uint8)
        view, offset = memoryview(data.numpy()), ticket.offset
        while len(view):
            count = os.preadv(self._fd, [view], offset)
            if count == 0:
                raise RuntimeError("the swap file ended early: was it truncated?")
            view, offset = view[count:], offset + count
        return data

    def prefetch(self, ticket: _FileTicket) -> None:
        if ticket.read is None:
            ticket.read = self._worker.submit(self._read, ticket)

    def fetch(self, ticket: _FileTicket) -> torch.Tensor:
        self.prefetch(ticket)
        data = ticket.read.result()
        ticket.read = None  # the next fetch reads again: no copy stays in memory
        return data

    def drain(self) -> None:
        self._worker.submit(lambda: None).result()

    def ready(self, ticket: _FileTicket) -> bool:
        return ticket.read is not None and ticket.read.done()

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the file is unlinked already
            pass


class _HostTicket:
    __slots__ = ("host", "copied", "nbytes", "device_copy", "arrived")

    def __init__(self, host: torch.Tensor, copied) -> None:
        self.host, self.copied, self.nbytes = host, copied, host.numel()
        self.device_copy: Optional[torch.Tensor] = None
        self.arrived = None


class HostSwap(SwapSpace):
    """Swap CUDA storages to pinned host memory, copying on a side stream.

    The offload waits for the work that produced the storage, then copies; the storage is
    marked as used by the side stream so the caching allocator reuses it only after the copy.
    ``prefetch`` copies back on the side stream; ``fetch`` makes the current stream wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"HostSwap swaps CUDA memory; got device {self.device}")
        self._stream = torch.cuda.Stream(self.device)

    def offload(self, data: torch.Tensor) -> _HostTicket:
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(data, non_blocking=True)
            data.record_stream(self._stream)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return _HostTicket(host, copied)

    def prefetch(self, ticket: _HostTicket) -> None:
        if ticket.device_copy is not None:
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ticket.copied)
            ticket.device_copy = torch.empty(ticket.nbytes, dtype=torch.uint8, device=self.device)
            ticket.device_copy.copy_(ticket.host, non_blocking=True)
            ticket.arrived = torch.cuda.Event()
            ticket.arrived.record(self._stream)

    def drain(self) -> None:
        self._stream.synchronize()

    def ready(self, ticket: _HostTicket) -> bool:
        return ticket.arrived is not None and ticket.arrived.query()

    def fetch(self, ticket: _HostTicket) -> torch.Tensor:
        self.prefetch(ticket)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ticket.arrived)
        data, ticket.device_copy = ticket.device_copy, None
        data.record_stream(current)
        return data


def make_swap_space(device: torch.device, directory: Optional[str] = None) -> SwapSpace:
    """:class:`HostSwap` for a CUDA device, :class:`FileSwap` in ``directory`` for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return HostSwap(device)
    if device.type == "cpu":
        return FileSwap(directory)
    raise ValueError(f"no swap space for device {device}: cpu and cuda are supported")
