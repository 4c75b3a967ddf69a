"""Local worker processes, one gloo rank each, on 127.0.0.1 (a free port)."""

import datetime
import io
import os
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks", "report_progress"]

_progress: Optional["mp.Queue"] = None  # set in each worker by _rank_entry

# Ranks are forked from a server process that imported torch once: spawned, every rank imports
# torch itself (2 s of CPU) and, at DistributedDataParallel's first use, torch._dynamo (1.7 s
# more); a 4-rank run of a few small DDP steps took 8.8 s on 2 busy cores, 0.7 s forked. Each
# rank takes the caller's os.environ as it is at the call (scripts hand settings to their ranks
# that way); only what torch reads while it is imported keeps the values of the first call,
# which started the server. Only torch is preloaded: the server's sys.path starts with its
# working directory, where a source checkout of this package would shadow the installed one.
_SERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"]


def _start_context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_SERVER_PRELOAD)  # read when the server starts: the first call
    return context


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

    The processes fork from a server that has imported torch once (Python's "forkserver"); a
    rank takes ``os.environ`` as it is at the call and imports ``target``'s module itself.
    Variables that torch reads while it is imported keep the values they had at the first call.

    Args:
        timeout: seconds for the whole run; then ``TimeoutError``.
        on_progress: called in this process with every item a rank passes to
            :func:`report_progress`.
        on_start: called with the started processes (e.g. to put one under a CPU quota).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
    """
    context = _start_context()
    progress = context.Queue()
    # One pipe per rank for its result, written by the rank's own thread: no lock shared between
    # processes and no feeder thread that could be left holding one.
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    port = free_port()
    environment = dict(os.environ)
    processes = [context.Process(target=_rank_entry, daemon=True,
                                 args=(rank, world_size, port, target, args, pipes[rank][1],
                                       progress, environment))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    for _, writer in pipes:
        writer.close()  # the ranks hold theirs: a rank that dies closes its pipe
    try:
        if on_start is not None:
            on_start(processes)
        collected = _collect(processes, [reader for reader, _ in pipes], progress, on_progress,
                             time.monotonic() + timeout)
    finally:
        for reader, _ in pipes:
            reader.close()
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    _drain(progress, on_progress)
    return [collected[rank] for rank in range(world_size)]


def _collect(processes, readers, progress, on_progress, deadline: float) -> dict:
    collected = {}
    while len(collected) < len(processes):
        ready = wait([r for rank, r in enumerate(readers) if rank not in collected], timeout=0.2)
        _drain(progress, on_progress)
        for reader in ready:
            rank = readers.index(reader)
            try:
                ok, value = reader.recv()
            except EOFError:  # the rank closed its pipe without a result: it died
                processes[rank].join(timeout=5)
                raise RuntimeError(f"rank {rank} exited with code {processes[rank].exitcode} "
                                   f"before reporting (see its output above)") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if not ready and time.monotonic() > deadline:
            missing = sorted(set(range(len(processes))) - set(collected))
            raise TimeoutError(f"ranks {missing} did not finish in time")
    return collected


def _drain(progress, on_progress) -> None:
    while on_progress is not None and not progress.empty():
        on_progress(progress.get())


def _rank_entry(rank, world_size, port, target, args, result, progress, environment) -> None:
    global _progress
    _progress = progress
    if os.environ != environment:  # forked: the server's environment until now
        os.environ.clear()
        os.environ.update(environment)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    # Every rank's connections made before any may finish and close its own: a rank whose
    # target raises at once would otherwise exit while a slower one is still connecting
    # ("Gloo connectFullMesh failed ... Connection closed by peer").
    dist.barrier()
    returned = False
    try:
        # By value: a tensor put in the queue as such is shared through a handle that dies with
        # this process, which may exit before the parent has read it.
        buffer = io.BytesIO()
        torch.save(target(rank, world_size, *args), buffer)
        result.send((True, buffer.getvalue()))
        returned = True
    except BaseException:
        result.send((False, traceback.format_exc()))
    finally:
        result.close()
    if returned:  # likewise at the end: the target's last new_group may still be connecting
        try:  # elsewhere ("Connection closed by peer" there if this rank exits first)
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=10), wait_all_ranks=True)
        except RuntimeError:
            pass  # a rank that raised does not come; its error is already reported
    dist.destroy_process_group()
