"""The density chosen from the link: the exchange between machines sized to hide behind the
backward pass.

Each step the two-level sync measures: the backward pass's window (from DDP's first bucket to
its last, the time the exchange can overlap), the step's compute (from the previous step's
result to this step's last bucket: optimizer, forward and backward), the bytes its exchange
between machines sent and the seconds those collectives took (the measured bandwidth ``R``),
and the seconds it spent encoding and decoding. A collective's seconds include its latency and
the wait for the other machines' ranks, which do not grow with the bytes: on a fast link they
are most of it (37 ms for 1 ms of wire at 1 Gbit/s), so bytes over seconds underestimates the
bandwidth there. ``R`` is therefore read from the slope of seconds against bytes over the last
steps (whose bytes differ as the density moves), the slope taken two standard errors high: a
clean line gives the link's bandwidth, seconds that stay flat while the bytes spread widely
give a fast link (the bytes cost nothing measurable), and a line lost in noise gives little.
``R`` is never below this step's bytes over seconds (a lower bound). Where the density sits at
the floor and the bytes have not spread for as many steps, no reading is possible (an exchange
that is all latency pins the floor this way, however fast the link): one step then runs at twice
the bytes (a probe), so that the slope can be read; the reading lasts until the probe leaves
the last steps and then :data:`FIT_STEPS` more, so a slow link at the floor pays about one
probe step in 34. The time a step can give the exchange is the
window, or a quarter of the compute where that is longer (a model of one bucket has no window:
its exchange then adds at most a quarter to the step); the bytes it can afford are ``R`` times
that time less the codec's; the density that sends them follows from how the recipe's
bytes grow with the density: ``wire_bytes * density + 4 / segment`` per value (the selected
values, and one float32 importance per segment). Ranks agree on the smallest proposal (the
slowest link decides) by a one-float allreduce issued at a step's end and read at the next
step's end, so every rank changes density at the same step without waiting for it.
"""

import collections
import math
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import check_float

__all__ = ["AutoDensity", "DEFAULT_FLOOR", "DEFAULT_CEILING"]

DEFAULT_FLOOR = 0.01
DEFAULT_CEILING = 0.25
# The affordable bytes are the median of the last steps' (a link that changes is followed within
# a few steps; one step whose codec or wait ate its window, affording nothing, moves nothing).
MEDIAN_STEPS = 5
# Where the backward pass leaves no window to hide in, the exchange may take this share of the
# step's compute.
COMPUTE_SHARE = 0.25
HISTORY_STEPS = 256
# At most this factor up or down per step: a collective whose time was mostly latency must
# not swing the density from ceiling to floor at once.
MAX_STEP_FACTOR = 2.0
# The bandwidth fit: over this many steps' (bytes, seconds), once the bytes spread by this
# share of their mean; the slope is taken SLOPE_ERRORS standard errors high.
FIT_STEPS = 16  # also how long a fitted bandwidth is used once no fit is possible
MIN_FIT_POINTS = 4
MIN_SPREAD = 0.1
SLOPE_ERRORS = 2.0
MAX_BANDWIDTH = 1e12  # bytes per second: what flat seconds read as (no link is faster)
# A proposal runs two steps later (the agreement is read a step late): no second probe before
# the first one's bytes are measured.
PROBE_LAG = 2


class AutoDensity:
    """Proposes each step's density within ``[floor, ceiling]`` and agrees on it.

    Args:
        floor, ceiling: the density's bounds, ``0 < floor <= ceiling <= 1``.
        wire_bytes_per_value: bytes per selected value on the wire (int8: 1).
        segment_size: values per segment (each segment also sends a float32 importance).
    """

    def __init__(self, floor: float, ceiling: float, wire_bytes_per_value: int,
                 segment_size: int) -> None:
        self.floor = check_float("density_floor", floor, 0.0, 1.0, low_open=True)
        self.ceiling = check_float("density_ceiling", ceiling, 0.0, 1.0, low_open=True)
        if self.floor > self.ceiling:
            raise ValueError(f"density_floor ({floor}) is above density_ceiling ({ceiling})")
        self.wire_bytes = wire_bytes_per_value
        self.importance_bytes = 4.0 / segment_size
        self._affordable: collections.deque = collections.deque(maxlen=MEDIAN_STEPS)  # bytes
        self._pending: Optional[tuple] = None  # (work, tensor) of the last agreement
        self._exchanges: collections.deque = collections.deque(maxlen=FIT_STEPS)  # (bytes, s)
        self._fitted_bandwidth = 0.0  # bytes per second from the last line that fitted
        self._fit_age = 0  # steps since that line last fitted
        self._probe_wait = 0  # steps until a probe proposed may be measured
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
        proposal, bandwidth = density, 0.0
        if self.sent_bytes and self.link_seconds > 0:
            bandwidth = self._bandwidth()
            budget = max(window_seconds, COMPUTE_SHARE * compute_seconds)
            affordable = bandwidth * max(budget - self.codec_seconds, 0.0)
            self._affordable.append(affordable)
            values = self.sent_bytes / self.bytes_per_value(density)  # what a step exchanges
            per_value = statistics.median(self._affordable) / values
            proposal = (per_value - self.importance_bytes) / self.wire_bytes
            # after a probe's own step the density may return to the floor at once
            lower = self.floor if self._probe_wait == 1 else density / MAX_STEP_FACTOR
            proposal = min(max(proposal, lower), density * MAX_STEP_FACTOR)
            if self._probe_wait:
                self._probe_wait -= 1
            elif self._should_probe(density):
                proposal, self._probe_wait = self._probe_density(density), PROBE_LAG
        proposal = min(max(proposal, self.floor), self.ceiling)
        self.history.append(dict(window_seconds=window_seconds, compute_seconds=compute_seconds,
                                 link_seconds=self.link_seconds,
                                 codec_seconds=self.codec_seconds, sent_bytes=self.sent_bytes,
                                 density=density, proposal=proposal,
                                 bandwidth=bandwidth))
        self.reset_step()
        return proposal

    def _bandwidth(self) -> float:
        """The link's bytes per second from this step's exchange and the last steps' (see the
        module's docstring)."""
        self._exchanges.append((float(self.sent_bytes), self.link_seconds))
        self._fit_age += 1
        if self._fit_age > FIT_STEPS:  # a link that slowed must not keep an old, faster fit
            self._fitted_bandwidth = 0.0
        fitted = bandwidth_at_least(self._exchanges)
        if fitted is not None:
            self._fitted_bandwidth, self._fit_age = fitted, 0
        return max(self.sent_bytes / self.link_seconds, self._fitted_bandwidth)

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
        """Start the agreement on ``proposal`` (the smallest over ``group``) and return the
        previous one's result (``None`` at the first call): the density from the next step
        on, the same on every rank."""
        began = time.perf_counter()
        self.finish()
        if self.history:  # the time this step waited for the previous agreement
            self.history[-1]["agreement_wait_seconds"] = time.perf_counter() - began
        agreed = None if self._pending is None else float(self._pending[1])
        value = torch.tensor([proposal], dtype=torch.float64)
        self._pending = (dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group, async_op=True), value)
        return agreed

    def finish(self) -> None:
        """Wait for the agreement in flight."""
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].wait()
            self._pending = (None, self._pending[1])

    def state_dict(self) -> dict:
        """The last steps' affordable bytes, the bandwidth fit and the agreement in flight
        (waited for), so that a resumed run changes density at the same steps."""
        self.finish()
        return dict(affordable=list(self._affordable),
                    pending=None if self._pending is None else float(self._pending[1]),
                    exchanges=list(self._exchanges), fitted_bandwidth=self._fitted_bandwidth,
                    fit_age=self._fit_age, probe_wait=self._probe_wait)

    def load_state_dict(self, saved: dict) -> None:
        self._affordable = collections.deque(saved.get("affordable", ()), maxlen=MEDIAN_STEPS)
        self._exchanges = collections.deque(map(tuple, saved.get("exchanges", ())), maxlen=FIT_STEPS)
        self._fitted_bandwidth = saved.get("fitted_bandwidth", 0.0)
        self._fit_age = saved.get("fit_age", 0)
        self._probe_wait = saved.get("probe_wait", 0)
        pending = saved["pending"]
        self._pending = None if pending is None else (None, torch.tensor([pending], dtype=torch.float64))

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


def bandwidth_at_least(exchanges) -> Optional[float]:
    """Bytes per second that ``(bytes, seconds)`` pairs show a link carries, read from the slope
    of seconds against bytes taken :data:`SLOPE_ERRORS` standard errors high (at most
    :data:`MAX_BANDWIDTH`); ``None`` where the bytes do not spread (see :func:`_spread`)."""
    moments = _spread(exchanges)
    if moments is None:
        return None
    mean_bytes, mean_seconds, var_bytes, covariance = moments
    slope = covariance / var_bytes
    count = len(exchanges)
    residual = sum((t - mean_seconds - slope * (b - mean_bytes)) ** 2 for b, t in exchanges)
    error = math.sqrt(residual / (count - 2) / (count * var_bytes))
    high = max(slope, 0.0) + SLOPE_ERRORS * error
    return MAX_BANDWIDTH if high * MAX_BANDWIDTH <= 1.0 else 1.0 / high
