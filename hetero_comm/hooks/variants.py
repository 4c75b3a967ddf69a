"""Variants of the sparse hooks that carry settings of their own, each a small config object,
so that a setting can only be written with the variant it belongs to.

* ``SegmentSparseState(basis=DCT(block_size=32))``: segments of DCT coefficients instead of
  gradient elements (``basis="dct"`` is ``DCT()``).
* ``TwoLevelState(density=AutoDensity(floor=0.02, ceiling=0.3))``: the density chosen each step
  from the measured link within bounds (``density="auto"`` is ``AutoDensity()``).
"""

import dataclasses
from typing import Union

from .._checks import check_float, check_int

__all__ = ["DCT", "AutoDensity", "resolve_basis", "resolve_density"]


@dataclasses.dataclass(frozen=True)
class DCT:
    """Select among segments of DCT coefficients: each bucket is cut into blocks of
    ``block_size`` elements (a power of two in [2, 4096]), each block goes through an
    orthonormal DCT-II, and a segment is one coefficient index taken across blocks."""

    block_size: int = 64

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 2, 4096)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"DCT block_size must be a power of two in [2, 4096]; got "
                             f"{self.block_size}")


@dataclasses.dataclass(frozen=True)
class AutoDensity:
    """The density chosen each step within ``[floor, ceiling]`` (``0 < floor <= ceiling <= 1``)
    so that the exchange between machines hides behind the backward pass, starting at the
    ceiling (docs/design/two-level.md)."""

    floor: float = 0.01
    ceiling: float = 0.25

    def __post_init__(self) -> None:
        check_float("AutoDensity floor", self.floor, 0.0, 1.0, low_open=True)
        check_float("AutoDensity ceiling", self.ceiling, 0.0, 1.0, low_open=True)
        if self.floor > self.ceiling:
            raise ValueError(f"AutoDensity floor ({self.floor}) is above its ceiling "
                             f"({self.ceiling})")


Basis = Union[str, DCT]
Density = Union[float, str, AutoDensity]


def resolve_basis(basis: Basis) -> Union[str, DCT]:
    """``"elements"`` or a :class:`DCT` (``"dct"`` taken as ``DCT()``); anything else raises."""
    if isinstance(basis, DCT) or basis == "elements":
        return basis
    if basis == "dct":
        return DCT()
    raise ValueError(f"basis must be 'elements', 'dct' or a DCT(block_size=...); got {basis!r}")


def resolve_density(density: Density, automatic: bool) -> Union[float, AutoDensity]:
    """A fixed density, or (where ``automatic`` is allowed) an :class:`AutoDensity`
    (``"auto"`` taken as ``AutoDensity()``); a bad value raises naming what is allowed."""
    if density == "auto" or isinstance(density, AutoDensity):
        if not automatic:
            raise ValueError(f"an automatic density needs the two-level sync "
                             f"(TwoLevelState), which measures the link between machines; "
                             f"got density={density!r}")
        return AutoDensity() if density == "auto" else density
    return check_float("density", density, 0.0, 1.0, low_open=True)
