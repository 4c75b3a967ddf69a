"""The sign step sized as Adam sizes its step: by how much the ranks' gradients agree.

With ``output="sign"`` AdamW (betas (0, 0)) moves every coordinate the hook hands a sign by
the whole rate, where dense Adam moves it by ``|m| / sqrt(v)`` of the rate: about 1 while the
gradient's signal dominates, much less once it is mostly noise. Under a decaying schedule the
rate does that shrinking; at a constant rate the sign step keeps jittering by the whole rate
and ends well above dense's loss (docs/design/recipes-adamw.md, "The step at a constant rate",
which also has why the AdamW recipe leaves this opt-in: it costs short runs and low rates).

The ranks' gradients tell the signal from the noise. With ``W`` ranks each holding
``g_i = G + n_i``, ``E|sum g_i|^2 = W^2 |G|^2 + W N`` and ``E sum |g_i|^2 = W |G|^2 + W N``, so
their ratio ``rho = |sum g_i|^2 / (W sum |g_i|^2)`` (1 where the ranks agree, ``1/W`` for
independent noise) gives the summed gradient's signal to noise ``S = (W rho - 1) / (1 - rho)``
and the agreement's factor ``sqrt(S / (1 + S))``, the size of Adam's step for that signal to
noise. A decaying schedule has shrunk the step already: the factor applied is the agreement's
divided by the share of its peak the user's rate is at, at most 1 (:meth:`StepScale.factor_for`),
so that under a cosine the step shrinks only where the noise asks for more than the schedule
gives, and at a constant rate it shrinks as Adam's does.

Nothing dense is sent for it: ``sum |g_i|^2`` is one number per rank, and ``|sum g_i|^2`` is
read from a count sketch of each rank's gradient (every element added, with a random sign the
same on every rank, into one of :data:`SKETCH_SIZE` slots; the sketch of the sum is the sum
of the sketches, and its squared norm estimates the sum's without bias,
:func:`hetero_comm.ops.gradient_sketch_`). Each step sketches one bucket, the buckets in turn
(one kernel call a step, not one a bucket; a plan bucket, so a resumed run sketches what the
uninterrupted one did), and both
sums go in one allreduce of ``SKETCH_SIZE + 1`` floats issued at the end of the step and read
at the end of the next, so no rank waits for it. Running means (decay :data:`DECAY`) smooth
the estimates over the buckets and steps, and the factor applies from the step after it is
read, the same on every rank.
"""

import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import ops

__all__ = ["StepScale", "SKETCH_SIZE", "DECAY", "MIN_SCALE", "step_scale_for"]


SKETCH_SIZE = 256
DECAY = 0.9
MIN_SCALE = 0.05  # (a factor of 0 would stop training; the weight decay is divided by it)


def step_scale_for(together: float, apart: float, world_size: int) -> float:
    """The step factor from ``|sum g_i|^2`` (``together``) and ``sum |g_i|^2`` (``apart``) over
    ``world_size`` ranks, in [:data:`MIN_SCALE`, 1]; 1 where nothing was measured."""
    if apart <= 0 or world_size < 2:
        return 1.0
    rho = together / (world_size * apart)
    if rho >= 1.0:
        return 1.0
    signal = max((world_size * rho - 1.0) / (1.0 - rho), 0.0)
    return max(math.sqrt(signal / (1.0 + signal)), MIN_SCALE)


class StepScale:
    """The sign step's factor, measured from the ranks' gradients at every step.

    Call :meth:`observe` with the gradient of the plan bucket at :meth:`turn_among` (this
    rank's own, before it is changed), and :meth:`end_step` after the step's last bucket (it issues the step's allreduce in ``group``
    and reads the previous one's); :attr:`scale` is the agreement's factor for the coming step,
    :meth:`factor_for` the one to step at.
    """

    def __init__(self) -> None:
        self.scale = 1.0
        self.applied = 1.0  # the factor of the last step taken
        self.peaks: list = []  # each parameter group's largest rate so far
        self.steps = 0  # steps whose sums were read
        self.means = [0.0, 0.0]  # running means of |sum g_i|^2 and sum |g_i|^2
        self._step: Optional[torch.Tensor] = None  # this step's sketch and squared norm
        self._spare: Optional[torch.Tensor] = None  # the buffer the next step writes
        self._pending: Optional[tuple] = None  # (work, tensor) of the last step's allreduce
        self._turn = 0  # steps issued: the bucket sketched is this one modulo their number
        self.started = False  # whether a bucket was sketched yet (the same on every rank)

    def turn_among(self, count: int) -> int:
        """The place, among ``count`` plan buckets, of the one this step sketches."""
        return self._turn % max(count, 1)

    def observe(self, grad: torch.Tensor, salt: int) -> None:
        """Add ``grad`` (this rank's own) to the step's sketch
        (:func:`hetero_comm.ops.gradient_sketch_`, its signs drawn with ``salt``, the plan
        bucket's place, so the same on every rank)."""
        self.started = True
        self._buffer(grad.device)
        ops.gradient_sketch_(grad.detach().reshape(-1), salt, self._step)

    def _buffer(self, device: torch.device) -> torch.Tensor:
        """This step's sketch (zeros until a bucket is added), on ``device``."""
        if self._step is None or self._step.device != device:
            self._step = torch.zeros(SKETCH_SIZE + 1, dtype=torch.float32, device=device)
        return self._step

    def end_step(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """Read the previous step's sums (waiting for them if they have not arrived) and
        issue this step's on ``device`` (the gradients'; zeros where no bucket was sketched at
        this step: every rank issues it once a bucket was sketched, as every rank sketches the
        same buckets)."""
        self._read()
        if not self.started:  # nothing sketched yet (the dense warm-up), on any rank
            return
        step = self._buffer(device)
        work = dist.all_reduce(step, group=group, async_op=True)
        self._world_size = dist.get_world_size(group)
        self._pending, self._step, self._spare = (work, step), self._spare, None
        self._turn += 1

    def _read(self) -> None:
        if self._pending is None:
            return
        work, summed = self._pending
        self._pending = None
        work.wait()
        sums = summed.tolist()  # (read on the host: no operator calls on the hot path)
        summed.zero_()  # the buffer the step after next writes
        self._spare = summed
        together = math.fsum(value * value for value in sums[:SKETCH_SIZE])
        apart = sums[SKETCH_SIZE]
        if not (math.isfinite(together) and math.isfinite(apart)):
            return  # a non-finite gradient (e.g. under a GradScaler): the step is skipped
        self.steps += 1
        self.means = [DECAY * mean + (1 - DECAY) * value
                      for mean, value in zip(self.means, (together, apart))]
        correction = 1.0 - DECAY ** self.steps
        self.scale = step_scale_for(self.means[0] / correction, self.means[1] / correction,
                                    self._world_size)

    def factor_for(self, rates) -> float:
        """The factor on the user's ``rates`` (one per parameter group, this step's): the
        agreement's over the largest share of its peak a group's rate is at, at most 1."""
        rates = [float(rate) for rate in rates]
        if len(self.peaks) != len(rates):  # a group added (its peak starts at its rate)
            self.peaks = (self.peaks + rates[len(self.peaks):])[:len(rates)]
        self.peaks = [max(peak, rate) for peak, rate in zip(self.peaks, rates)]
        share = max((rate / peak for rate, peak in zip(rates, self.peaks) if peak > 0), default=1.0)
        self.applied = 1.0 if share <= 0 else min(1.0, self.scale / share)
        return self.applied

    def state_dict(self) -> dict:
        """The running means, the factors and the rates' peaks (the allreduce in flight is
        read first)."""
        self._read()
        return dict(scale=self.scale, applied=self.applied, steps=self.steps,
                    means=list(self.means), peaks=list(self.peaks), turn=self._turn,
                    started=self.started)

    def load_state_dict(self, saved: dict) -> None:
        self.scale, self.steps = float(saved["scale"]), int(saved["steps"])
        self.applied = float(saved["applied"])
        self.means = [float(value) for value in saved["means"]]
        self.peaks = [float(value) for value in saved["peaks"]]
        self._turn, self.started = int(saved["turn"]), bool(saved["started"])
        self._pending = self._step = self._spare = None

    def __getstate__(self) -> dict:
        self._read()
        return dict(self.__dict__, _step=None, _spare=None, _pending=None)
