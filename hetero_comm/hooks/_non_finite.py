"""A NaN or an infinity in a compressed bucket: found in what the ranks agreed on (so every rank
finds it), handed on as NaN as DDP's allreduce would hand on the sum, the error feedback of the
part that held it restarted, counted, and warned about once. On a GPU the finding stays on the
device and is read at a later hook call, so that no step waits for the host."""

import math
import warnings
from typing import List, Optional, Tuple

import torch

from ..buffer_pool import BufferPool
from ._plan import PlanBucket
from ._statistics import HookStatistics

__all__ = ["NonFiniteGradient", "DeviceFiniteChecks", "NonFiniteHandling"]


class NonFiniteGradient(FloatingPointError):
    """A NaN or infinity reached a compressed bucket on some rank (all ranks agree on it):
    raised inside a hook's send on the CPU and caught by the state's ``run``,
    which hands the bucket on as NaN."""

    def __init__(self, owner: str, index: int, step: int) -> None:
        super().__init__(f"{owner}: non-finite gradient (NaN or infinity) in DDP bucket {index} "
                         f"on at least one rank at step {step}")
        self.index, self.step = index, step


class DeviceFiniteChecks:
    """Non-finite gradients found on a GPU without a host sync (on the CPU the hooks check at
    once). Each flag is copied to pinned host memory behind an event; :meth:`report`, at the
    next hook call, resets the error feedback of every bucket whose flag arrived false (until
    then the hook sends zeros for it and hands the bucket on as NaN: see
    :meth:`NonFiniteHandling.check`), and keeps the flags still in flight."""

    # True: take the device path on every device (the CPU tests of the CUDA path).
    on_every_device = False

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._pending: List[tuple] = []  # (host flag, event or None, plan bucket, index, step)

    def on_device(self, device: torch.device) -> bool:
        return self.on_every_device or device.type == "cuda"

    def watch(self, finite: torch.Tensor, plan_bucket: PlanBucket, index: int, step: int) -> None:
        if finite.is_cuda:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = finite.clone(), None
        self._pending.append((host, event, plan_bucket, index, step))

    def report(self) -> List[NonFiniteGradient]:
        """Reset the error feedback of every bucket whose flag arrived false; returns what
        was found, for the state to count."""
        if not self._pending:
            return []
        failed, still_in_flight = [], []
        for host, event, plan_bucket, index, step in self._pending:
            if event is not None and not event.query():  # one query per flag
                still_in_flight.append((host, event, plan_bucket, index, step))
            elif not bool(host):
                plan_bucket.reset()
                failed.append(NonFiniteGradient(self.owner, index, step))
        self._pending = still_in_flight
        return failed


class NonFiniteHandling:
    """What a compressing state does with non-finite values: :meth:`check` them, keep them off
    the wire (:meth:`drop_unless`), hand the bucket on as NaN (:meth:`nan_unless` on the device,
    :meth:`hand_on` on the host), count them in ``statistics`` and warn once per process."""

    def __init__(self, owner: str, pool: BufferPool, statistics: HookStatistics,
                 device_checks: Optional[DeviceFiniteChecks] = None) -> None:
        self.owner, self.pool, self.statistics = owner, pool, statistics
        self.device_checks = device_checks or DeviceFiniteChecks(owner)
        self._warned, self._warning = False, None

    def check(self, values: torch.Tensor, index: int, step: int, plan_bucket: PlanBucket,
              release: Tuple[torch.Tensor, ...] = ()) -> Optional[torch.Tensor]:
        """Whether ``values`` (the same on every rank: agreed by a collective) are all finite.

        CPU: checked now; if not, ``release`` goes back to the pool, the bucket's error
        feedback is reset and :class:`NonFiniteGradient` is raised (the state's ``run`` hands
        the bucket on as NaN); returns ``None``. CUDA: no host sync. Returns the flag as a
        device tensor; the caller sends on (non-finite values replaced by zeros), zeroes what it
        puts on the wire with :meth:`drop_unless` and fills the delivered bucket with NaN with
        :meth:`nan_unless`; the bucket's error feedback is reset at a later hook call, once the
        flag has reached the host (:meth:`collect_device_findings`).
        """
        if not self.device_checks.on_device(values.device):
            # float64: a sum of float32 values cannot overflow it, so only a NaN or an
            # infinity makes it non-finite (one reduction instead of isfinite's five ops)
            if not math.isfinite(values.sum(dtype=torch.float64).item()):
                for buffer in release:
                    self.pool.release(buffer)
                plan_bucket.reset()
                raise NonFiniteGradient(self.owner, index, step)
            return None
        finite = torch.isfinite(values).all()
        self.device_checks.watch(finite, plan_bucket, index, step)
        values.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return finite

    @staticmethod
    def drop_unless(finite: Optional[torch.Tensor], *tensors: torch.Tensor) -> None:
        """Zero ``tensors`` (what goes on the wire) on the device where ``finite`` is false,
        without reading the flag: the sum stays finite (int8: within range)."""
        if finite is not None:
            for tensor in tensors:
                tensor.masked_fill_(~finite, 0.0)

    @staticmethod
    def nan_unless(finite: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        """Put a NaN into the delivered bucket on the device where ``finite`` is false (what
        :meth:`hand_on` does on the host, without reading the flag). One element is enough for
        a ``GradScaler`` (and, without one, for the parameters to go NaN), and spares a pass
        over the bucket at every step."""
        if finite is not None:
            if finite.is_cuda:  # read on this callback's stream: keep its memory until then
                finite.record_stream(torch.cuda.current_stream(finite.device))
            grad[:1].masked_fill_(~finite, math.nan)

    def hand_on(self, grad: torch.Tensor, found: NonFiniteGradient) -> torch.futures.Future:
        """A bucket in which some rank's gradient held a NaN or an infinity: handed on as NaN,
        as DDP's allreduce would hand on the sum, so that a ``GradScaler`` skips the step (and
        without one the parameters go NaN, as with DDP's own hook); the error feedback of
        the part that held it was reset. Returns the completed future."""
        grad.fill_(math.nan)
        self.count(found)
        done = torch.futures.Future()
        done.set_result(grad)
        return done

    def collect_device_findings(self) -> None:
        """Count the buckets whose device flag has reached the host false (their error
        feedback is reset)."""
        for found in self.device_checks.report():
            self.count(found)

    def count(self, found: NonFiniteGradient) -> None:
        """Count a bucket handed on holding NaN (``stats()["non_finite_buckets"]``); the first
        one's warning is given by :meth:`warn_once`."""
        self.statistics.count("non_finite_buckets")
        if not self._warned and self._warning is None:
            self._warning = (
                f"{found}: the bucket is handed on holding NaN, as DDP's allreduce would hand on "
                f"the sum (a torch.amp.GradScaler then skips the step), and the error feedback "
                f"of the part of it that held the value restarts from zero. "
                f"stats()['non_finite_buckets'] counts such buckets; this warning is given once")

    def warn_once(self) -> None:
        """Give the warning :meth:`count` kept, once per process (last in a hook call, so that
        an error raised for it leaves the state consistent)."""
        if self._warning is not None:
            message, self._warning = self._warning, None
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
