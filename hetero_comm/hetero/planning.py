"""Batch sizes proportional to measured speed."""

import math
from fractions import Fraction
from typing import List, Sequence

__all__ = ["plan_batch_sizes"]


def plan_batch_sizes(throughputs: Sequence[float], global_batch_size: int,
                     minimum: int = 1) -> List[int]:
    """Split ``global_batch_size`` between ranks in proportion to their speeds.

    1. Exact shares ``e_i = B * v_i / sum(v)`` (computed exactly, in rationals).
    2. Everyone gets ``floor(e_i)``; the units still missing go one each to the largest
       fractional parts (largest remainder), ties to the lower rank.
    3. A rank below ``minimum`` is raised to it, the units taken one at a time from the rank
       whose size is furthest above its exact share (ties to the higher rank).

    When no rank's exact share is below ``minimum`` (step 3 changes nothing), every size is
    within 1 of its exact share. A strictly faster rank never gets a smaller batch.

    Args:
        throughputs: samples per second of pure compute for each rank; finite and > 0.
        global_batch_size: B, an integer >= minimum * number of ranks.
        minimum: smallest batch a rank may get, 0 or 1 (0 for a final partial batch smaller
            than the number of ranks).

    Returns:
        One integer per rank, summing exactly to ``global_batch_size``.
    """
    speeds = list(throughputs)
    if not speeds:
        raise ValueError("throughputs must name at least one rank; got an empty sequence")
    for rank, v in enumerate(speeds):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"throughputs must be finite and > 0; rank {rank} has {v!r}")
    if minimum not in (0, 1):
        raise ValueError(f"minimum must be 0 or 1; got {minimum!r}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or \
            global_batch_size < minimum * len(speeds) or global_batch_size < 0:
        raise ValueError(f"global_batch_size must be an integer >= {minimum * len(speeds)} "
                         f"(minimum {minimum} per rank, {len(speeds)} ranks); got {global_batch_size!r}")
    total = sum(Fraction(v) for v in speeds)
    exact = [global_batch_size * Fraction(v) / total for v in speeds]
    sizes = [math.floor(e) for e in exact]
    missing = global_batch_size - sum(sizes)
    by_remainder = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for rank in by_remainder[:missing]:
        sizes[rank] += 1
    for rank in range(len(speeds)):
        while sizes[rank] < minimum:
            donor = max((i for i in range(len(speeds)) if sizes[i] > minimum),
                        key=lambda i: (sizes[i] - exact[i], i))
            sizes[donor] -= 1
            sizes[rank] += 1
    return sizes
