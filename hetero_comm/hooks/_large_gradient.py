"""A higher density while the gradient is still large.

Error feedback delays what it does not send; a delay costs most while the gradient is large
and the parameters still move far, and least once it has settled. On the quality matrix the
SGD recipe at 8% fell 2-5 points behind dense on a ResNet with GroupNorm in 200 steps, whose
gradient stays large through the run, and held at a higher density; on the MLP and the CNN,
whose gradient falls by an order of magnitude early, 8% held (docs/design/one-call.md, "A
higher density while the gradient is large").

:class:`GradientEnergyWatch` measures the ranks' summed squared gradient norm at every step
(one norm a bucket on each rank; the sum rides one allreduce of a single float issued at the
end of the step and read at the end of the next, so no rank waits for it) and keeps a running
mean of it. Past :data:`FIRST_READINGS` readings, the gradient counts as large while that mean
stays above ``1 / fall`` of the largest it has been; the state then sends at least the larger
density. The decision is made from the summed values every rank reads, so every rank makes
the same one, and it applies from the step after it is read.
"""

import math
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["GradientEnergyWatch", "DECAY", "FIRST_READINGS", "LARGE_GRADIENT_WARN_AFTER"]

DECAY = 0.9
FIRST_READINGS = 5  # readings before the peak is trusted (the gradient counts as small before)
# steps past the density warm-up after which a gradient still large is reported (a warning)
LARGE_GRADIENT_WARN_AFTER = 100


class GradientEnergyWatch:
    """Whether the ranks' gradient is still large (:attr:`large`), measured at every step.

    Call :meth:`observe` with each compressed bucket's gradient (this rank's own, before the
    exchange changes it) and :meth:`end_step` after the step's last bucket, on every rank.
    """

    def __init__(self, fall: float) -> None:
        self.fall = fall
        self.large = False  # for the coming step
        self.large_last_step = False  # what the step just ended used
        self.mean: Optional[float] = None  # running mean of the summed squared norm
        self.peak = 0.0
        self.readings = 0
        self.large_steps = 0  # steps that sent the larger density
        self._norms: List[torch.Tensor] = []
        self._pending = None  # (work, tensor) of the last step's allreduce, or its value read

    def observe(self, grad: torch.Tensor) -> None:
        """Note ``grad``'s norm (one operator call)."""
        self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def end_step(self, group: Optional[dist.ProcessGroup]) -> None:
        """Read the previous step's sum (waiting for it if it has not arrived) and decide the
        coming step; issue this step's (every rank observed the same buckets, so every rank
        issues it or none does)."""
        self.large_last_step = self.large
        self.large_steps += self.large
        self._read()
        if not self._norms:  # nothing compressed this step (the dense warm-up), on any rank
            return
        norms = torch.stack(self._norms)
        energy = torch.dot(norms, norms)
        self._norms = []
        work = dist.all_reduce(energy, group=group, async_op=True)
        if energy.is_cuda:  # copied to the host behind the sum on the stream, read a step later
            work.wait()  # (the stream waits, not the host)
            host = torch.empty((), dtype=energy.dtype, pin_memory=True)
            host.copy_(energy, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            work, energy = arrived, host
        self._pending = (work, energy)

    def _read(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        energy = pending if isinstance(pending, float) else _wait(*pending)
        if not math.isfinite(energy):
            return  # a non-finite gradient (e.g. under a GradScaler): the step is skipped
        self.readings += 1
        self.mean = energy if self.mean is None else DECAY * self.mean + (1 - DECAY) * energy
        if self.readings >= FIRST_READINGS:
            self.peak = max(self.peak, self.mean)
            self.large = self.mean > self.peak / self.fall

    def state_dict(self) -> dict:
        """The running mean, its peak, the decision and the sum in flight (waited for; read
        at the next step's end, as without the checkpoint)."""
        if self._pending is not None and not isinstance(self._pending, float):
            self._pending = _wait(*self._pending)
        return dict(large=self.large, large_last_step=self.large_last_step, mean=self.mean,
                    peak=self.peak, readings=self.readings, large_steps=self.large_steps,
                    pending=self._pending)

    def load_state_dict(self, saved: dict) -> None:
        self.large, self.large_last_step = bool(saved["large"]), bool(saved["large_last_step"])
        self.mean = None if saved["mean"] is None else float(saved["mean"])
        self.peak, self.readings = float(saved["peak"]), int(saved["readings"])
        self.large_steps = int(saved["large_steps"])
        self._pending = None if saved["pending"] is None else float(saved["pending"])
        self._norms = []

    def __getstate__(self) -> dict:
        if self._pending is not None and not isinstance(self._pending, float):
            self._pending = _wait(*self._pending)
        return dict(self.__dict__, _norms=[])


def _wait(work, energy: torch.Tensor) -> float:
    """The summed value once it has arrived (``work``: the allreduce, or on a GPU the event
    after its copy to the host, waited for by the host without a device-wide synchronisation)."""
    if isinstance(work, torch.cuda.Event):
        work.synchronize()
    else:
        work.wait()
    return float(energy)  # (read on the host, a step after it was issued)
