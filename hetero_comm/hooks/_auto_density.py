"""The density chosen from the link: the exchange between machines sized to hide behind the
backward pass.

Each step the two-level sync measures: the backward pass's window (from DDP's first bucket to
its last, the time the exchange can overlap), the step's compute (from the previous step's
result to this step's last bucket: optimizer, forward and backward), the bytes its exchange
between machines sent and the seconds those collectives took, and the seconds it spent
encoding and decoding.

The link's bandwidth ``R``. A collective's seconds include its latency and the wait for the
other machines' ranks, which do not grow with the bytes: on a fast link they are most of it
(37 ms for 1 ms of wire at 1 Gbit/s), so bytes over seconds underestimates the bandwidth there.
The wait for peers that are still computing is taken out: the agreement below also carries
each rank's seconds of the steps since the last one and takes, within each rail (the ranks that
exchanged the same bytes), the least (the rank that arrived last waited for no one); the fit's
points take them when the agreement is read, so its newest few are still a rank's own. ``R`` is then
read from the slope of seconds against bytes over the last steps (whose bytes differ as the
density moves), the slope taken two standard errors high for what the link carries *at least*
and two low for what it carries *at most*: a clean line gives the link's bandwidth for both,
seconds that stay flat while the bytes spread widely give a fast link, and a line lost in noise
gives little at least and no bound at most. ``R`` at least is never below this step's bytes
over seconds, nor the last agreed step's over its least seconds. Where the density sits at the
floor and the bytes have not spread for as many steps, no reading is possible (an exchange
that is all latency pins the floor this way, however fast the link): the next agreement then
proposes twice the bytes (a probe, run until the agreement after it applies: AGREE_EVERY
steps), so that the slope can be read; the reading lasts until the probe leaves the last steps
and then :data:`FIT_STEPS` more, so a slow link at the floor pays 4 probe steps in 40.

The density. The time a step can give the wire is the window, or a quarter of the compute
where that is longer (a model of one bucket has no window: its exchange then adds at most a
quarter to the step), less the codec's, the median of the last steps'; the bytes it affords
are ``R`` times that time, and the density that sends them follows from how the recipe's bytes
grow with the density: ``wire_bytes * density + 4 / segment`` per value (the selected values,
and one float32 importance per segment). The density is the largest the link is shown to
afford (``R`` at least), and at least the middle of the bounds (their geometric mean: 32x
between compress's 16x and 64x, where the recipes were measured) unless the link is shown too
slow for that (``R`` at most). Exchanges of a few kilobytes on a busy machine are why: their
bytes cost microseconds that per-step timing cannot read under milliseconds of jitter, so no
reading ever shows the link fast enough for them, and the floor, which the reading at least
chooses, costs accuracy for nothing. Not the ceiling where nothing is shown: a line read across
a change of the link fits neither speed, and shows nothing either. Ranks agree on the smallest
proposal (the slowest link decides), and the least seconds, by an allreduce issued at the end
of every :data:`AGREE_EVERY`-th step and read at the next step's end, so every rank changes
density at the same step without waiting for it.
"""

import collections
import math
import statistics
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .variants import AutoDensity

__all__ = ["DensityController", "bandwidth_bounds"]

# The wire's time is the median of the last steps' (one step whose codec or wait ate its window,
# affording nothing, moves nothing).
MEDIAN_STEPS = 5
# Where the backward pass leaves no window to hide in, the exchange may take this share of the
# step's compute.
COMPUTE_SHARE = 0.25
HISTORY_STEPS = 256
# At most this factor up or down per agreement: a collective whose time was mostly latency must
# not swing the density from ceiling to floor at once.
MAX_STEP_FACTOR = 2.0
# The bandwidth fit: over this many steps' (bytes, seconds), once the bytes spread by this
# share of their mean; the slope is taken SLOPE_ERRORS standard errors high.
FIT_STEPS = 16  # also how long a fitted bandwidth is used once no fit is possible
MIN_FIT_POINTS = 4
MIN_SPREAD = 0.1
SLOPE_ERRORS = 2.0
MAX_BANDWIDTH = 1e12  # bytes per second: what flat seconds read as (no link is faster)
# Ranks agree at every this many steps: the agreement's collective took about 1 ms of CPU a
# step where four ranks share two cores (docs/design/two-level.md, "The automatic density: why
# each part is there"). A proposal agreed at step s runs from step s + 2 to s + AGREE_EVERY + 1.
AGREE_EVERY = 4


class DensityController:
    """Proposes each step's density within ``[floor, ceiling]`` and agrees on it.

    Args:
        floor, ceiling: the density's bounds, ``0 < floor <= ceiling <= 1``.
        wire_bytes_per_value: bytes per selected value on the wire (int8: 1).
        segment_size: values per segment (each segment also sends a float32 importance).

    Attributes:
        rail, rails: this rank's rail (the ranks that exchange the same share) and how many
            rails there are (the two-level sync sets them; by default one).
    """

    def __init__(self, bounds: AutoDensity, wire_bytes_per_value: int,
                 segment_size: int) -> None:
        self.floor, self.ceiling = bounds.floor, bounds.ceiling
        self.wire_bytes = wire_bytes_per_value
        self.importance_bytes = 4.0 / segment_size
        self.middle = math.sqrt(self.floor * self.ceiling)  # (see the module's docstring)
        # the seconds the last steps could give the wire
        self._wire_seconds: collections.deque = collections.deque(maxlen=MEDIAN_STEPS)
        self._exchanges: collections.deque = collections.deque(maxlen=FIT_STEPS)  # [bytes, s]
        # the steps since the last agreement: (the exchange measured or None, history entry)
        self._unagreed: list = []
        # the agreement in flight: (work, [proposal, each step's least seconds], its steps)
        self._pending: Optional[tuple] = None
        self._agreed: Optional[float] = None  # its proposal once read, until agree() returns it
        self._agreed_rate = 0.0  # bytes over least seconds of the last step agreed on
        self.rail, self.rails = 0, 1  # this rank's rail and how many (set by the two-level sync)
        self._fitted_bandwidth = 0.0  # bytes per second from the last line that fitted...
        self._fitted_at_most: Optional[float] = None  # ...and at most (None: no line)
        self._fit_age = 0  # steps since that line last fitted
        self._probe_proposed = False  # at the last agreement (the next one has measured it)
        self._steps = 0  # proposals made: the agreements' clock, alike on every rank
        # the last steps' measurements and proposals (bounded: a long run keeps no more)
        self.history: collections.deque = collections.deque(maxlen=HISTORY_STEPS)
        self.reset_step()

    def reset_step(self) -> None:
        self.sent_bytes = 0
        self.link_seconds = 0.0
        self.codec_seconds = 0.0

    def add_exchange(self, sent_bytes: int, link_seconds: float, codec_seconds: float) -> None:
        """One share's exchange between machines at this step."""
        self.sent_bytes += sent_bytes
        self.link_seconds += link_seconds
        self.codec_seconds += codec_seconds

    def bytes_per_value(self, density: float) -> float:
        return self.wire_bytes * density + self.importance_bytes

    def propose(self, window_seconds: float, compute_seconds: float, density: float) -> float:
        """The density for the coming steps from this step's measurements (``density``: the
        one this step ran at)."""
        began = time.perf_counter()
        self._read_agreement()
        waited = time.perf_counter() - began
        proposal, bandwidth, at_most, measured = density, 0.0, None, None
        if self.sent_bytes and self.link_seconds > 0:
            bandwidth, at_most = self._bandwidth()
            measured = self._exchanges[-1]
            budget = max(window_seconds, COMPUTE_SHARE * compute_seconds)
            self._wire_seconds.append(max(budget - self.codec_seconds, 0.0))
            wire_seconds = statistics.median(self._wire_seconds)
            values = self.sent_bytes / self.bytes_per_value(density)  # what a step exchanges
            proposal = self._density_sending(bandwidth * wire_seconds / values)
            if at_most is not None:  # the middle, unless the link is shown too slow for it
                possible = (self.ceiling if at_most == math.inf  # (bytes cost nothing readable)
                            else self._density_sending(at_most * wire_seconds / values))
                proposal = max(proposal, min(self.middle, possible))
            # after a probe the density may return to the floor at once
            lower = self.floor if self._probe_proposed else density / MAX_STEP_FACTOR
            proposal = min(max(proposal, lower), density * MAX_STEP_FACTOR)
            if self._agreeing():  # (a probe proposed at another step would not run)
                probe = not self._probe_proposed and self._should_probe(density)
                if probe:
                    proposal = self._probe_density(density)
                self._probe_proposed = probe
        proposal = min(max(proposal, self.floor), self.ceiling)
        entry = dict(window_seconds=window_seconds, compute_seconds=compute_seconds,
                     link_seconds=self.link_seconds, codec_seconds=self.codec_seconds,
                     sent_bytes=self.sent_bytes, density=density, proposal=proposal,
                     bandwidth=bandwidth, bandwidth_at_most=at_most, agreement_wait_seconds=waited)
        self.history.append(entry)
        self._unagreed = (self._unagreed + [(measured, entry)])[-AGREE_EVERY:]
        self.reset_step()
        self._steps += 1
        return proposal

    def _agreeing(self) -> bool:
        """Whether the proposal being made is one :meth:`agree` will start agreeing on."""
        return self._steps % AGREE_EVERY == 0

    def _density_sending(self, bytes_per_value: float) -> float:
        return (bytes_per_value - self.importance_bytes) / self.wire_bytes

    def _read_agreement(self) -> None:
        """Wait for the agreement in flight and give the exchanges of its steps the least
        seconds any rank of this rail measured there (their history entries record them)."""
        self.finish()
        if self._pending is None:
            return
        _, result, steps = self._pending
        self._pending = None
        self._agreed = float(result[0]) if math.isfinite(result[0]) else None  # (no rank had a say)
        # this rail's seconds: AGREE_EVERY of them after the proposal, the last for the last step
        ours = result[1 + self.rail * AGREE_EVERY:1 + (self.rail + 1) * AGREE_EVERY].tolist()
        for (exchange, entry), least in zip(steps, ours[AGREE_EVERY - len(steps):]):
            if exchange is not None:
                exchange[1] = min(exchange[1], least)
            if entry is not None:
                entry["least_link_seconds"] = least
        last = steps[-1][0] if steps else None
        self._agreed_rate = last[0] / last[1] if last is not None and last[1] > 0 else 0.0

    def _bandwidth(self) -> Tuple[float, Optional[float]]:
        """The bytes per second the link is shown to carry at least, and at most (``None``:
        no reading), from this step's exchange and the last steps' (see the module's
        docstring)."""
        self._exchanges.append([float(self.sent_bytes), self.link_seconds])
        self._fit_age += 1
        if self._fit_age > FIT_STEPS:  # a link that slowed must not keep an old, faster fit
            self._fitted_bandwidth, self._fitted_at_most = 0.0, None
        fitted = bandwidth_bounds(self._exchanges)
        if fitted is not None:
            (self._fitted_bandwidth, self._fitted_at_most), self._fit_age = fitted, 0
        at_least = max(self.sent_bytes / self.link_seconds, self._agreed_rate, self._fitted_bandwidth)
        return at_least, None if self._fitted_at_most is None else max(self._fitted_at_most, at_least)

    def _should_probe(self, density: float) -> bool:
        """At the floor with no fit, and none possible: the last :data:`FIT_STEPS` steps' bytes
        did not spread."""
        return (density <= self.floor < self.ceiling and self._fitted_bandwidth == 0.0
                and len(self._exchanges) == FIT_STEPS and _spread(self._exchanges) is None)

    def _probe_density(self, density: float) -> float:
        """The density that sends twice the bytes of ``density`` (one point that far out
        spreads the last steps' bytes enough for a reading)."""
        return 2 * density + self.importance_bytes / self.wire_bytes

    def agree(self, proposal: float, group: Optional[dist.ProcessGroup]) -> Optional[float]:
        """After every :data:`AGREE_EVERY`-th :meth:`propose`, start the agreement on its
        ``proposal`` and on the exchange seconds of the steps since the last agreement (the
        smallest of each over ``group``);
        return the previous agreement's proposal once (else ``None``): the density from the
        next step on, the same on every rank. Call after :meth:`propose`, which reads the
        previous agreement."""
        self._read_agreement()
        agreed, self._agreed = self._agreed, None
        if (self._steps - 1) % AGREE_EVERY == 0:
            # each rail's seconds in slots of its own (the least is taken over ranks that
            # exchanged the same bytes), the last steps last, inf where none was measured
            seconds = [math.inf] * (AGREE_EVERY * self.rails)
            for slot, (exchange, _) in enumerate(self._unagreed, AGREE_EVERY - len(self._unagreed)):
                if exchange is not None:
                    seconds[self.rail * AGREE_EVERY + slot] = exchange[1]
            # a rank that exchanged nothing since (its shares were empty) has no say
            measured = any(exchange is not None for exchange, _ in self._unagreed)
            value = torch.tensor([proposal if measured else math.inf] + seconds, dtype=torch.float64)
            work = dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group, async_op=True)
            self._pending, self._unagreed = (work, value, self._unagreed), []
        return agreed

    def finish(self) -> None:
        """Wait for the agreement in flight."""
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].wait()
            self._pending = (None,) + self._pending[1:]

    def state_dict(self) -> dict:
        """The last steps' wire time, the bandwidth fit, the steps not yet agreed on and the
        agreement in flight (waited for), so that a resumed run changes density at the same
        steps."""
        self.finish()
        if self._agreed is not None:  # read, not yet returned (between propose and agree)
            pending, pending_steps = [self._agreed], []
        elif self._pending is not None:
            pending, pending_steps = self._pending[1].tolist(), self._pending[2]
        else:
            pending, pending_steps = None, []
        return dict(wire_seconds=list(self._wire_seconds),
                    exchanges=[list(pair) for pair in self._exchanges],
                    fitted_bandwidth=self._fitted_bandwidth, fitted_at_most=self._fitted_at_most,
                    fit_age=self._fit_age, probe_proposed=self._probe_proposed, steps=self._steps,
                    agreed_rate=self._agreed_rate,
                    pending=pending,
                    # which of those steps, and of those not yet agreed on, measured an
                    # exchange (theirs are the last in exchanges, in order)
                    pending_measured=[exchange is not None for exchange, _ in pending_steps],
                    unagreed_measured=[exchange is not None for exchange, _ in self._unagreed])

    def load_state_dict(self, saved: dict) -> None:
        self._wire_seconds = collections.deque(saved.get("wire_seconds", ()), maxlen=MEDIAN_STEPS)
        self._exchanges = collections.deque(map(list, saved.get("exchanges", ())), maxlen=FIT_STEPS)
        self._fitted_bandwidth = saved.get("fitted_bandwidth", 0.0)
        self._fitted_at_most = saved.get("fitted_at_most")
        self._fit_age = saved.get("fit_age", 0)
        self._probe_proposed = saved.get("probe_proposed", False)
        self._steps = saved.get("steps", 0)
        self._agreed_rate = saved.get("agreed_rate", 0.0)
        pending_measured = saved.get("pending_measured", [])
        unagreed_measured = saved.get("unagreed_measured", [])
        # the exchanges those steps measured, oldest first, are the last ones kept
        exchanges = iter(list(self._exchanges)[len(self._exchanges) - sum(pending_measured)
                                               - sum(unagreed_measured):])
        pending_steps = [(next(exchanges) if measured else None, None) for measured in pending_measured]
        self._unagreed = [(next(exchanges) if measured else None, None) for measured in unagreed_measured]
        pending = saved["pending"]
        if isinstance(pending, (int, float)):  # saved before the least seconds were agreed
            pending = [pending]
        self._pending = None if pending is None else (
            None, torch.tensor(pending, dtype=torch.float64), pending_steps)
        self._agreed = None

    def __getstate__(self) -> dict:
        self.finish()
        return dict(self.__dict__)


def _spread(exchanges) -> Optional[tuple]:
    """The means and (co)variances of ``(bytes, seconds)`` pairs, or ``None`` where there are
    too few of them or their bytes spread by less than :data:`MIN_SPREAD` of their mean."""
    count = len(exchanges)
    if count < MIN_FIT_POINTS:
        return None
    mean_bytes = sum(b for b, _ in exchanges) / count
    mean_seconds = sum(t for _, t in exchanges) / count
    var_bytes = sum((b - mean_bytes) ** 2 for b, _ in exchanges) / count
    if math.sqrt(var_bytes) < MIN_SPREAD * mean_bytes:
        return None
    covariance = sum((b - mean_bytes) * (t - mean_seconds) for b, t in exchanges) / count
    return mean_bytes, mean_seconds, var_bytes, covariance


def bandwidth_bounds(exchanges) -> Optional[Tuple[float, float]]:
    """The bytes per second that ``(bytes, seconds)`` pairs show a link carries at least and
    at most, read from the slope of seconds against bytes taken :data:`SLOPE_ERRORS` standard
    errors high and low (at least: at most :data:`MAX_BANDWIDTH`; at most: ``math.inf`` where
    the low side reads more than that, no bound); ``None`` where the bytes do not spread (see
    :func:`_spread`)."""
    moments = _spread(exchanges)
    if moments is None:
        return None
    mean_bytes, mean_seconds, var_bytes, covariance = moments
    slope = covariance / var_bytes
    count = len(exchanges)
    residual = sum((t - mean_seconds - slope * (b - mean_bytes)) ** 2 for b, t in exchanges)
    error = math.sqrt(residual / (count - 2) / (count * var_bytes))
    high, low = max(slope, 0.0) + SLOPE_ERRORS * error, slope - SLOPE_ERRORS * error
    return (MAX_BANDWIDTH if high * MAX_BANDWIDTH <= 1.0 else 1.0 / high,
            math.inf if low * MAX_BANDWIDTH <= 1.0 else 1.0 / low)
