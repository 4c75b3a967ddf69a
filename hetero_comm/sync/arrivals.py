"""What a group's leader has received from the other groups and not yet applied, and the waits
of a round: for the staleness bound, for the parts the next forward needs (the layer-wise soft
deadline), and for every other group's flush."""

import time
from typing import Callable, Dict, List, Optional, Sequence

from .link import GroupFailedError, LeaderLink, Message, MessageKind
from .versions import Contribution, VersionBook

__all__ = ["Arrivals"]


class Arrivals:
    r"""The other groups' contributions (their parts) received and not yet applied, in the order
    each group sent them, and the groups that have flushed; every wait reads the link until what
    it needs is here, at most ``stall_timeout_s`` (then :class:`GroupFailedError`).

    Args:
        link: the :class:`~hetero_comm.sync.link.LeaderLink` the messages come from.
        book: this group's :class:`~hetero_comm.sync.VersionBook` (what is applied; the bound).
        stall_timeout_s: the longest one wait lasts (> 0).
    """

    def __init__(self, link: LeaderLink, book: VersionBook, stall_timeout_s: float):
        self.link, self.book, self.stall_timeout_s = link, book, stall_timeout_s
        self.contributions: Dict[int, List[Contribution]] = {h: [] for h in link.peers}
        self.flushed: Dict[int, int] = {}  # group -> contributions it made in all, then flushed
        self.waits, self.waited_s = 0, 0.0

    def wait_for_bound(self) -> None:
        """Take what has arrived; block while the staleness bound holds this group back (a
        contribution counts once one of its parts is here)."""
        self._drain(lambda: self.book.lagging_group(self._counts(), self.flushed) is not None,
                    "the staleness bound")

    def wait_for_flushes(self) -> None:
        """Block until every other group has flushed and its last contribution is here; check
        that every part of each of its contributions is applied or here, exactly once."""
        self._drain(lambda: len(self.flushed) < len(self.link.peers), "flush")
        for h, count in self.flushed.items():
            self._check_complete(h, count)
        self.flushed.clear()

    def wait_for_parts(self, resume: float, before: Sequence[float], below: Optional[int]) -> None:
        """The layer-wise soft deadline. The next forward starts at ``resume`` (``time.monotonic()``)
        and needs part ``k`` ``before[k]`` seconds later: wait for each missing part ``k`` of a
        contribution (with a version under ``below`` if given) of which some part is applied or
        here, until ``resume + before[k]``, no longer. A part that misses it stays missing and is
        applied at a later round, at its staleness then."""
        while True:
            now = time.monotonic()
            latest = max((resume + before[k] for k in self._missing_parts(below)), default=now)
            if latest <= now:
                return
            message = self.link.receive(timeout=latest - now)
            if message is None:
                return
            self._take(message)

    def pop(self, below: Optional[int]) -> List[Contribution]:
        """Remove and return the contributions here (each group's in order), only those with a
        version under ``below`` if given."""
        ready = []
        for arrived in self.contributions.values():
            count = len(arrived) if below is None else sum(c.version < below for c in arrived)
            ready += arrived[:count]
            del arrived[:count]
        return ready

    def _take(self, message: Message) -> None:
        if message.kind is MessageKind.CLOSE:
            raise GroupFailedError(f"group {message.source} closed while group {self.book.index} "
                                   "still trains: every rank must call close() at the end")
        self.contributions[message.source].append(Contribution(
            message.source, message.version, message.seen, message.payload, part=message.part))
        if message.kind is MessageKind.FLUSH and message.part == self.book.num_parts - 1:
            self.flushed[message.source] = message.version + 1

    def _drain(self, must_wait: Callable[[], bool], reason: str) -> None:
        """Take every message that has arrived; block while ``must_wait()``, at most
        ``stall_timeout_s`` in all."""
        start = time.monotonic()
        waited = False
        while True:
            blocking = must_wait()
            waited = waited or blocking
            left = self.stall_timeout_s - (time.monotonic() - start)
            message = self.link.receive(timeout=max(left, 1e-3) if blocking else 0.0)
            if message is None:
                if blocking:
                    raise GroupFailedError(self._stall_message(reason))
                break
            self._take(message)
        if waited:
            self.waits += 1
            self.waited_s += time.monotonic() - start

    def _counts(self) -> Dict[int, int]:
        """Per group, its contributions with a part here and none applied yet."""
        return {h: len({c.version for c in arrived if c.version >= self.book.opened(h)})
                for h, arrived in self.contributions.items()}

    def _missing_parts(self, below: Optional[int]) -> List[int]:
        return [k for h, arrived in self.contributions.items() for _, k in self.book.missing_parts(
            h, {(c.version, c.part) for c in arrived}, below)]

    def _check_complete(self, source: int, count: int) -> None:
        """After group ``source`` flushed having made ``count`` contributions: every part of
        each is applied or here, once."""
        here = [sum(c.part == k for c in self.contributions[source])
                for k in range(self.book.num_parts)]
        done = self.book.part_applied[source]
        if any(a + n != count for a, n in zip(done, here)):
            raise RuntimeError(f"group {source} made {count} contributions; per part, {done} applied "
                               f"and {here} arrived here")

    def _stall_message(self, reason: str) -> str:
        behind = {h: self.book.made - self.book.applied[h] for h in self.link.peers}
        return (f"group {self.book.index} waited {self.stall_timeout_s:g} s for {reason} and "
                f"another group stalled or died; contributions it is ahead of each other group: "
                f"{behind} (max_staleness {self.book.max_staleness}).")
