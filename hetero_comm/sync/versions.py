"""What each group has made and applied, and how stale an arriving contribution is: the
bookkeeping of :class:`~hetero_comm.sync.GroupSync`, free of any transport so that it can be
tested with a simulated clock."""

import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Optional, Tuple

from .._checks import check_int

__all__ = ["inverse_staleness", "Contribution", "VersionBook"]


def inverse_staleness(staleness: int) -> float:
    r"""The default staleness rule: a contribution ``tau`` versions behind is scaled by
    ``1 / (1 + tau)`` (CN111027671 scales stale gradients down by their staleness; this is the
    usual form of that rule, as in staleness-aware asynchronous SGD). ``tau = 0`` keeps it whole."""
    return 1.0 / (1.0 + staleness)


@dataclass(eq=False)  # identity: two contributions are never the same one
class Contribution:
    """One group's progress since its previous contribution.

    ``seen[h]`` counts group ``h``'s contributions that the source had applied when it made this
    one (``seen[source]`` is its own ``version``, numbered from 0)."""

    source: int
    version: int
    seen: Tuple[int, ...]
    payload: object  # a flat tensor (the transport's) or anything a test uses


class VersionBook:
    r"""Versions and staleness of one group (index ``index`` of ``num_groups``).

    * ``made``: this group's contributions so far; ``applied[h]``: group ``h``'s contributions
      applied here, in order (``applied[index] == made``).
    * A contribution from ``h`` is ``tau = max(0, made - seen[index] - 1)`` versions stale here:
      the number of this group's contributions it did not see, not counting the one this group
      made in the same round (two groups working at once from the same state are not stale,
      as two ranks of synchronous data parallelism are not).
    * Bound: this group may not make contribution ``made`` while some group ``h`` has
      ``made - applied[h] > max_staleness`` (0: every round waits for the other groups' same
      round, which is synchronous training).

    Contributions must be applied in order, each exactly once (:meth:`accept` raises
    otherwise): that is what makes the conservation test exact.
    """

    def __init__(self, num_groups: int, index: int, *, max_staleness: int = 4,
                 staleness_scale: Callable[[int], float] = inverse_staleness):
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.index = check_int("index", index, 0, num_groups - 1)
        self.max_staleness = check_int("max_staleness", max_staleness, 0)
        if not callable(staleness_scale):
            raise ValueError(f"staleness_scale must be a function of the staleness; got "
                             f"{staleness_scale!r}")
        self.staleness_scale = staleness_scale
        self.made = 0
        self.applied = [0] * num_groups
        self.staleness_counts: Dict[int, int] = {}
        self.scale_sum = 0.0
        self.dropped = 0

    def seen(self) -> Tuple[int, ...]:
        """The ``seen`` vector of the contribution this group makes next."""
        return tuple(self.made if h == self.index else self.applied[h] for h in range(self.num_groups))

    def record_made(self) -> int:
        """Count a contribution made now; return its version."""
        self.made += 1
        self.applied[self.index] = self.made
        return self.made - 1

    def lagging_group(self, arrived: Optional[Dict[int, int]] = None,
                      finished: Collection[int] = ()) -> Optional[int]:
        """A group this one must wait for, or ``None``; ``arrived[h]``: group ``h``'s
        contributions received but not yet applied (they count as applied here); groups in
        ``finished`` make no more contributions (they wait in a flush) and are not waited for."""
        arrived = arrived or {}
        for h in range(self.num_groups):
            if h == self.index or h in finished:
                continue
            if self.made - self.applied[h] - arrived.get(h, 0) > self.max_staleness:
                return h
        return None

    def staleness(self, contribution: Contribution) -> int:
        return max(0, self.made - contribution.seen[self.index] - 1)

    def accept(self, contribution: Contribution) -> Tuple[int, float]:
        """Apply-time bookkeeping of ``contribution``: its staleness and its scale. Raises if it
        is out of order or was applied before."""
        source = contribution.source
        if source == self.index or not 0 <= source < self.num_groups:
            raise ValueError(f"contribution from group {source} cannot be applied by group "
                             f"{self.index} of {self.num_groups}")
        if contribution.version != self.applied[source]:
            raise RuntimeError(f"group {source}'s contribution {contribution.version} arrived when "
                               f"{self.applied[source]} was expected: lost or repeated")
        tau = self.staleness(contribution)
        scale = float(self.staleness_scale(tau))
        if not (math.isfinite(scale) and 0.0 <= scale <= 1.0):
            raise ValueError(f"staleness_scale({tau}) must be in [0, 1]; got {scale!r}")
        self.applied[source] += 1
        self.staleness_counts[tau] = self.staleness_counts.get(tau, 0) + 1
        self.scale_sum += scale
        self.dropped += scale == 0.0
        return tau, scale

    def stats(self) -> Dict[str, object]:
        applied = sum(self.applied) - self.made
        counts = self.staleness_counts
        return dict(contributions_made=self.made, contributions_applied=applied,
                    applied_per_group=list(self.applied),
                    mean_staleness=(sum(t * n for t, n in counts.items()) / applied) if applied else 0.0,
                    max_staleness_seen=max(counts, default=0),
                    mean_scale=self.scale_sum / applied if applied else 1.0,
                    dropped=self.dropped)

    def state_dict(self) -> Dict[str, object]:
        return dict(made=self.made, applied=list(self.applied),
                    staleness_counts=dict(self.staleness_counts), scale_sum=self.scale_sum,
                    dropped=self.dropped)

    def load_state_dict(self, state: Dict[str, object]) -> None:
        applied = [int(a) for a in state["applied"]]
        if len(applied) != self.num_groups:
            raise ValueError(f"the checkpoint has {len(applied)} groups; this run has "
                             f"{self.num_groups}")
        self.made, self.applied = int(state["made"]), applied
        self.staleness_counts = {int(t): int(n) for t, n in dict(state["staleness_counts"]).items()}
        self.scale_sum, self.dropped = float(state["scale_sum"]), int(state["dropped"])

