"""What each group has made and applied, and how stale an arriving contribution is: the
bookkeeping of :class:`~hetero_comm.sync.GroupSync`, free of any transport so that it can be
tested with a simulated clock."""

import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Optional, Tuple

from .._checks import check_int

__all__ = ["inverse_staleness", "Contribution", "VersionBook"]


def inverse_staleness(staleness: int) -> float:
    r"""The default staleness rule: a contribution ``tau`` versions behind is scaled by
    ``1 / (1 + tau)``, in (0, 1] for ``tau >= 0``; ``tau = 0`` keeps it whole."""
    return 1.0 / (1.0 + staleness)


@dataclass(eq=False)  # identity: two contributions are never the same one
class Contribution:
    """One group's progress since its previous contribution, or one part of it (a layer or a few:
    ``part`` of the book's ``num_parts``, with the layer-wise deadline).

    ``seen[h]`` counts group ``h``'s contributions that the source had applied when it made this
    one (``seen[source]`` is its own ``version``, numbered from 0)."""

    source: int
    version: int
    seen: Tuple[int, ...]
    payload: object  # a flat tensor (the transport's) or anything a test uses
    part: int = 0


class VersionBook:
    r"""Versions and staleness of one group (index ``index`` of ``num_groups``), for
    contributions sent in ``num_parts`` parts each.

    * ``made``: this group's contributions so far; ``applied[h]``: group ``h``'s contributions
      applied here in full, in order (``applied[index] == made``); ``opened(h)``: those of which
      at least one part has been applied (a part that misses its round's deadline is applied in a
      later round, so a contribution can be open for a while).
    * A contribution (or part) from ``h`` is ``tau = max(0, made - seen[index] - 1)`` versions
      stale here, counted when it is applied: the number of this group's contributions it did not
      see, not counting the one this group made in the same round (two groups working at once
      from the same state are not stale, as two ranks of synchronous data parallelism are not).
      A part applied a round late is therefore one version staler than its contribution's others.
    * Bound: this group may not make contribution ``made`` while some group ``h`` has
      ``made - opened(h) > max_staleness`` (0: every round waits for the other groups' same
      round, which is synchronous training).

    Each part of each contribution must be applied in order, exactly once (:meth:`accept` raises
    otherwise): that is what makes the conservation test exact.
    """

    def __init__(self, num_groups: int, index: int, *, max_staleness: int = 4,
                 staleness_scale: Callable[[int], float] = inverse_staleness, num_parts: int = 1):
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.index = check_int("index", index, 0, num_groups - 1)
        self.max_staleness = check_int("max_staleness", max_staleness, 0)
        self.num_parts = check_int("num_parts", num_parts, 1)
        if not callable(staleness_scale):
            raise ValueError(f"staleness_scale must be a function of the staleness; got "
                             f"{staleness_scale!r}")
        self.staleness_scale = staleness_scale
        self.made = 0
        # part_applied[h][k]: the version of group h's part k to apply next
        self.part_applied = [[0] * num_parts for _ in range(num_groups)]
        self._opened_at: Dict[Tuple[int, int], int] = {}  # (source, version) -> made when opened
        self.staleness_counts: Dict[int, int] = {}
        self.scale_sum = 0.0
        self.dropped = 0
        self.late_parts = 0

    @property
    def applied(self) -> List[int]:
        return [self.made if h == self.index else min(self.part_applied[h])
                for h in range(self.num_groups)]

    def opened(self, source: int) -> int:
        return self.made if source == self.index else max(self.part_applied[source])

    def seen(self) -> Tuple[int, ...]:
        """The ``seen`` vector of the contribution this group makes next: a contribution counts
        as seen once opened (its late parts are charged their own staleness when they are
        applied; counting the contribution unseen as well would charge that delay twice)."""
        return tuple(self.opened(h) for h in range(self.num_groups))

    def record_made(self) -> int:
        """Count a contribution made now; return its version."""
        self.made += 1
        return self.made - 1

    def lagging_group(self, arrived: Optional[Dict[int, int]] = None,
                      finished: Collection[int] = ()) -> Optional[int]:
        """A group this one must wait for, or ``None``; ``arrived[h]``: group ``h``'s
        contributions of which a part was received but none applied yet (they count as opened
        here); groups in ``finished`` make no more contributions (they wait in a flush) and are
        not waited for."""
        arrived = arrived or {}
        for h in range(self.num_groups):
            if h == self.index or h in finished:
                continue
            if self.made - self.opened(h) - arrived.get(h, 0) > self.max_staleness:
                return h
        return None

    def missing_parts(self, source: int, here: Collection[Tuple[int, int]],
                      below: Optional[int] = None) -> List[Tuple[int, int]]:
        """``(version, part)`` of group ``source``'s parts that are neither applied nor ``here``
        (received, ``(version, part)`` pairs), of its contributions (with a version under
        ``below`` if given) of which some part is applied or here: what the layer-wise deadline
        waits for."""
        done = self.part_applied[source]
        newest = max([v for v, _ in here] + [max(done) - 1])
        if below is not None:
            newest = min(newest, below - 1)
        return [(version, k) for version in range(min(done), newest + 1)
                for k in range(self.num_parts) if done[k] <= version and (version, k) not in here]

    def staleness(self, contribution: Contribution) -> int:
        return max(0, self.made - contribution.seen[self.index] - 1)

    def accept(self, contribution: Contribution) -> Tuple[int, float]:
        """Apply-time bookkeeping of ``contribution`` (a part of one): its staleness and its
        scale. Raises if it is out of order or was applied before."""
        source, version, part = contribution.source, contribution.version, contribution.part
        if source == self.index or not 0 <= source < self.num_groups:
            raise ValueError(f"contribution from group {source} cannot be applied by group "
                             f"{self.index} of {self.num_groups}")
        if not 0 <= part < self.num_parts:
            raise ValueError(f"part {part} of a contribution in {self.num_parts} parts")
        if version != self.part_applied[source][part]:
            raise RuntimeError(f"group {source}'s contribution {version} (part {part}) arrived "
                               f"when {self.part_applied[source][part]} was expected: lost or "
                               "repeated")
        tau = self.staleness(contribution)
        scale = float(self.staleness_scale(tau))
        if not (math.isfinite(scale) and 0.0 <= scale <= 1.0):
            raise ValueError(f"staleness_scale({tau}) must be in [0, 1]; got {scale!r}")
        opened_at = self._opened_at.setdefault((source, version), self.made)
        self.late_parts += opened_at < self.made
        self.part_applied[source][part] += 1
        if min(self.part_applied[source]) > version:  # every part of it is in
            del self._opened_at[(source, version)]
        self.staleness_counts[tau] = self.staleness_counts.get(tau, 0) + 1
        self.scale_sum += scale
        self.dropped += scale == 0.0
        return tau, scale

    def stats(self) -> Dict[str, object]:
        """Counts; staleness and scale are per applied part (per contribution with one part),
        ``dropped``: parts scaled to zero, ``late_parts``: parts applied in a later round than
        their contribution's first."""
        applied = sum(self.applied) - self.made
        counts = self.staleness_counts
        parts = sum(counts.values())
        return dict(contributions_made=self.made, contributions_applied=applied,
                    applied_per_group=self.applied, parts_applied=parts,
                    mean_staleness=(sum(t * n for t, n in counts.items()) / parts) if parts else 0.0,
                    max_staleness_seen=max(counts, default=0),
                    mean_scale=self.scale_sum / parts if parts else 1.0,
                    dropped=self.dropped, late_parts=self.late_parts)

    def state_dict(self) -> Dict[str, object]:
        if self._opened_at:
            raise RuntimeError(f"contributions {sorted(self._opened_at)} are partly applied: "
                               "a checkpoint needs every part in (flush first)")
        return dict(made=self.made, part_applied=[list(a) for a in self.part_applied],
                    staleness_counts=dict(self.staleness_counts), scale_sum=self.scale_sum,
                    dropped=self.dropped, late_parts=self.late_parts)

    def load_state_dict(self, state: Dict[str, object]) -> None:
        part_applied = [[int(v) for v in a] for a in state["part_applied"]]
        if len(part_applied) != self.num_groups:
            raise ValueError(f"the checkpoint has {len(part_applied)} groups; this run has "
                             f"{self.num_groups}")
        if any(len(a) != self.num_parts for a in part_applied):
            raise ValueError(f"the checkpoint's contributions have {len(part_applied[0])} parts; "
                             f"this run's have {self.num_parts} (the same layer_deadline and "
                             "part size are needed to resume)")
        self.made, self.part_applied = int(state["made"]), part_applied
        self._opened_at.clear()
        self.staleness_counts = {int(t): int(n) for t, n in dict(state["staleness_counts"]).items()}
        self.scale_sum, self.dropped = float(state["scale_sum"]), int(state["dropped"])
        self.late_parts = int(state["late_parts"])
