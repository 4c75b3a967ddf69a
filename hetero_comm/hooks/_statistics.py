"""The counters every hook state keeps, and the ``stats()`` dictionary made from them."""

import time
from typing import Dict

__all__ = ["HookStatistics"]


class _Timer:
    """Adds the seconds spent inside ``with`` to ``counters[field]``."""

    def __init__(self, counters: dict, field: str) -> None:
        self.counters, self.field = counters, field

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.counters[self.field] += time.perf_counter() - self.start


class HookStatistics:
    """Bytes this rank handed to collectives (and what a dense allreduce of the same gradients
    would have handed), seconds spent around the collectives, and buckets counted by kind.

    ``counters`` is the whole state (saved in checkpoints as it is); a hook may add counters of
    its own with :meth:`add_counter`.
    """

    def __init__(self) -> None:
        self.counters: Dict[str, float] = dict(
            bytes_sent=0, bytes_dense=0, compressed_bytes_sent=0, compressed_bytes_dense=0,
            encode_seconds=0.0, decode_seconds=0.0, dense_fallbacks=0, non_finite_buckets=0)

    def add_counter(self, name: str) -> None:
        """A counter of a hook's own, starting at 0, reported by :meth:`summary`."""
        self.counters.setdefault(name, 0)

    def count_bytes(self, dense: int, sent: int, after_warmup: bool) -> None:
        """Count ``sent`` bytes handed to collectives for ``dense`` bytes of gradient;
        ``after_warmup``: they count in the compression ratio too."""
        self.counters["bytes_dense"] += dense
        self.counters["bytes_sent"] += sent
        if after_warmup:
            self.counters["compressed_bytes_dense"] += dense
            self.counters["compressed_bytes_sent"] += sent

    def count(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to the counter ``name``."""
        self.counters[name] += amount

    def timer(self, field: str) -> _Timer:
        """``with statistics.timer("encode_seconds"):`` adds the time inside to that counter."""
        return _Timer(self.counters, field)

    def summary(self, steps: int) -> dict:
        """The public ``stats()`` dictionary: the counters, ``steps``, and the compression ratio
        over the steps after the warm-up (``nan`` before the first)."""
        summary = dict(self.counters)
        sent, dense = summary.pop("compressed_bytes_sent"), summary.pop("compressed_bytes_dense")
        summary["compression_ratio"] = dense / sent if sent else float("nan")
        summary["steps"] = steps
        return summary
