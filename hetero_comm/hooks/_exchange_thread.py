"""A background thread per state that runs a hook's bucket work in the order the buckets came,
so the backward pass goes on while a bucket's collectives wait, and every rank issues them in
one order."""

import queue
import threading
from typing import Optional

import torch

__all__ = ["ExchangeThread"]


class ExchangeThread:
    """One background thread running submitted jobs in order; each job's result (or
    exception) completes the future :meth:`submit` returned."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._outstanding = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def submit(self, job) -> torch.futures.Future:
        future = torch.futures.Future()
        with self._lock:
            self._outstanding += 1
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="hetero_comm-exchange")
                self._thread.start()
        self._jobs.put((job, future))
        return future

    def wait_idle(self) -> None:
        """Return once every submitted job has finished."""
        self._idle.wait()

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                result = job()
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)
            else:
                future.set_result(result)
            with self._lock:
                self._outstanding -= 1
                if not self._outstanding:
                    self._idle.set()
