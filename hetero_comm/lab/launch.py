"""Local worker processes, one gloo rank each, on 127.0.0.1 (a free port)."""

import io
import queue
import socket
import time
import traceback
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks", "report_progress"]

_progress: Optional["mp.Queue"] = None  # set in each worker by _rank_entry


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report_progress(item) -> None:
    """From inside a rank started by :func:`run_ranks`: hand ``item`` to its ``on_progress``
    (nothing happens elsewhere)."""
    if _progress is not None:
        _progress.put(item)


def run_ranks(world_size: int, target: Callable, *args, timeout: float = 600.0,
              on_progress: Optional[Callable] = None,
              on_start: Optional[Callable[[List[mp.Process]], None]] = None) -> list:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` new processes joined in one
    gloo group (one intra-op thread each) and return each rank's result, rank 0 first.

    Args:
        timeout: seconds for the whole run; then ``TimeoutError``.
        on_progress: called in this process with every item a rank passes to
            :func:`report_progress`.
        on_start: called with the started processes (e.g. to put one under a CPU quota).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
    """
    context = mp.get_context("spawn")
    results, progress = context.Queue(), context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_entry, daemon=True,
                                 args=(rank, world_size, port, target, args, results, progress))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        if on_start is not None:
            on_start(processes)
        collected = _collect(processes, results, progress, on_progress, time.monotonic() + timeout)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    _drain(progress, on_progress)
    return [collected[rank] for rank in range(world_size)]


def _collect(processes, results, progress, on_progress, deadline: float) -> dict:
    collected = {}
    while len(collected) < len(processes):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            _drain(progress, on_progress)
            died = [(r, p.exitcode) for r, p in enumerate(processes)
                    if p.exitcode not in (None, 0) and r not in collected]
            if died:
                raise RuntimeError(f"rank {died[0][0]} exited with code {died[0][1]} before "
                                   f"reporting (see its output above)") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(processes))) - set(collected))
                raise TimeoutError(f"ranks {missing} did not finish in time") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return collected


def _drain(progress, on_progress) -> None:
    while on_progress is not None and not progress.empty():
        on_progress(progress.get())


def _rank_entry(rank, world_size, port, target, args, results, progress) -> None:
    global _progress
    _progress = progress
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        # By value: a tensor put in the queue as such is shared through a handle that dies with
        # this process, which may exit before the parent has read it.
        buffer = io.BytesIO()
        torch.save(target(rank, world_size, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
