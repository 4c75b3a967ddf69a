"""Which ranks synchronise together: groups from a declared topology (sites) or from measured
speed, and each group's share of the samples."""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from .._checks import check_float, check_int, check_optional

__all__ = ["Grouping", "groups_from_sites", "groups_from_speeds", "periods_for_speeds"]


@dataclass(frozen=True)
class Grouping:
    r"""A partition of the ranks ``0 .. world_size - 1`` into groups.

    Inside a group the ranks train synchronously (DDP on the group's process group); the
    groups run asynchronously against one another (:class:`~hetero_comm.sync.GroupSync`). The
    first rank of each group is its leader: it alone exchanges with the other groups.

    Args:
        groups: each group's ranks; together every rank exactly once.
        batch_sizes: each rank's samples per step (``None``: the same on every rank). A
            group's share of the samples, :meth:`sample_share`, is the default scale of its
            learning rate.
    """

    groups: Tuple[Tuple[int, ...], ...]
    batch_sizes: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        groups = tuple(tuple(sorted(int(rank) for rank in group)) for group in self.groups)
        if not groups or any(len(group) == 0 for group in groups):
            raise ValueError(f"groups must be non-empty lists of ranks; got {self.groups!r}")
        ranks = sorted(rank for group in groups for rank in group)
        if ranks != list(range(len(ranks))):
            raise ValueError("groups must hold every rank 0 .. world_size - 1 exactly once; got "
                             f"{[list(group) for group in groups]}")
        object.__setattr__(self, "groups", groups)
        if self.batch_sizes is not None:
            sizes = tuple(check_int("batch_sizes[i]", size, 1) for size in self.batch_sizes)
            if len(sizes) != len(ranks):
                raise ValueError(f"batch_sizes needs one entry per rank ({len(ranks)}); got "
                                 f"{len(sizes)}")
            object.__setattr__(self, "batch_sizes", sizes)

    @property
    def world_size(self) -> int:
        return sum(len(group) for group in self.groups)

    @property
    def leaders(self) -> Tuple[int, ...]:
        return tuple(group[0] for group in self.groups)

    def group_of(self, rank: int) -> int:
        """The index of the group that holds ``rank``."""
        for index, group in enumerate(self.groups):
            if rank in group:
                return index
        raise ValueError(f"rank {rank} is in no group (world size {self.world_size})")

    def sample_share(self, index: int) -> float:
        """Group ``index``'s samples per step over all groups' samples per step."""
        sizes = self.batch_sizes or (1,) * self.world_size
        return sum(sizes[rank] for rank in self.groups[index]) / sum(sizes)


def groups_from_sites(sites: Sequence, batch_sizes: Optional[Sequence[int]] = None) -> Grouping:
    """One group per site: ``sites[rank]`` names the site of each rank (any hashable label);
    groups are ordered by each site's first rank."""
    if len(sites) == 0:
        raise ValueError("sites needs one label per rank; got none")
    by_site: Dict[object, list] = {}
    for rank, site in enumerate(sites):
        by_site.setdefault(site, []).append(rank)
    return Grouping(tuple(tuple(ranks) for ranks in by_site.values()),
                    None if batch_sizes is None else tuple(batch_sizes))


def groups_from_speeds(speeds: Sequence[float], *, num_groups: Optional[int] = None,
                       max_spread: float = 1.5,
                       batch_sizes: Optional[Sequence[int]] = None) -> Grouping:
    r"""Group ranks of similar speed, so that waiting inside a group is cheap.

    The ranks are sorted by speed (for example :attr:`DynamicBatchController.speeds`, samples
    per second). With ``num_groups``, the sorted list is cut at the ``num_groups - 1`` largest
    ratios between neighbours; without it, a new group starts wherever a rank is more than
    ``max_spread`` times slower than the fastest rank of the current group.

    Args:
        speeds: each rank's measured speed (positive).
        num_groups: exactly this many groups (at most the number of ranks).
        max_spread: the largest ratio fastest / slowest inside a group (> 1), without
            ``num_groups``.
        batch_sizes: passed on to :class:`Grouping`.

    Returns:
        the :class:`Grouping`, fastest group first.
    """
    speeds = [check_float("speeds[i]", speed, 0.0, math.inf, low_open=True) for speed in speeds]
    if not speeds:
        raise ValueError("speeds needs one value per rank; got none")
    check_optional(check_int, "num_groups", num_groups, 1, len(speeds))
    max_spread = check_float("max_spread", max_spread, 1.0, math.inf, low_open=True)
    order = sorted(range(len(speeds)), key=lambda rank: (-speeds[rank], rank))
    if num_groups is not None:
        ratios = [speeds[order[i]] / speeds[order[i + 1]] for i in range(len(order) - 1)]
        cuts = sorted(sorted(range(len(ratios)), key=lambda i: (-ratios[i], i))[:num_groups - 1])
        bounds = [0] + [cut + 1 for cut in cuts] + [len(order)]
        groups = [order[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    else:
        groups = [[order[0]]]
        for rank in order[1:]:
            if speeds[groups[-1][0]] / speeds[rank] > max_spread:
                groups.append([])
            groups[-1].append(rank)
    return Grouping(tuple(tuple(group) for group in groups),
                    None if batch_sizes is None else tuple(batch_sizes))


def periods_for_speeds(grouping: Grouping, speeds: Sequence[float], period: int) -> Tuple[int, ...]:
    """One period per group, proportional to the group's speed, the slowest group's being
    ``period``: every group then makes its rounds at about the same pace, so a staleness bound
    counted in rounds never holds a faster group back, and the faster group does more steps
    (takes more samples) per round.

    A group's speed is its slowest rank's (``speeds[rank]``, e.g. steps or samples per second;
    the ranks of a group step together)."""
    speeds = [check_float("speeds[i]", speed, 0.0, math.inf, low_open=True) for speed in speeds]
    if len(speeds) != grouping.world_size:
        raise ValueError(f"speeds needs one value per rank ({grouping.world_size}); got {len(speeds)}")
    period = check_int("period", period, 1)
    group_speeds = [min(speeds[rank] for rank in group) for group in grouping.groups]
    slowest = min(group_speeds)
    return tuple(max(1, round(period * speed / slowest)) for speed in group_speeds)
