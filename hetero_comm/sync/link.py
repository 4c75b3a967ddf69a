"""The link between the groups' leaders: typed messages, their frames (the bytes on the wire),
and the point-to-point transport, with one receiver thread per other group."""

import datetime
import enum
import queue
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._checks import check_float, check_int
from .grouping import Grouping

__all__ = ["GroupFailedError", "MalformedFrameError", "MessageKind", "Message", "Framing",
           "LeaderLink"]


class GroupFailedError(RuntimeError):
    """Another group stalled beyond the time limit or its leader failed."""


class MalformedFrameError(ValueError):
    """Bytes that are not a frame of this link: a wrong size, kind, part or seen vector."""


class MessageKind(enum.IntEnum):
    """What a message carries; its value is the first int64 of the frame."""

    CONTRIBUTION = 0  # one part of a contribution
    FLUSH = 1  # one part of the sender's last contribution before it waits in flush()
    CLOSE = 2  # the sender stops (close()); no payload


@dataclass(frozen=True, eq=False)  # the payload is a tensor: compare fields, not messages
class Message:
    """One message between leaders.

    ``source``: the sending group (the receiver knows it from the link, so it is not in the
    frame); ``version``: the sender's contribution number (for ``CLOSE``: how many it made);
    ``part``: which part of the contribution (0 for ``CLOSE``); ``seen[h]``: group ``h``'s
    contributions the sender had applied; ``payload``: the part's values in the wire format, as
    host bytes (``uint8``; empty for ``CLOSE``)."""

    kind: MessageKind
    source: int
    version: int
    part: int
    seen: Tuple[int, ...]
    payload: torch.Tensor


class Framing:
    r"""Messages to frames and back, for ``num_groups`` groups and contributions in parts of
    ``payload_bytes[k]`` bytes on the wire.

    A frame is host bytes (``uint8``): the int64 header ``[kind, version, part, seen[0], ...,
    seen[num_groups - 1]]``, then the payload of ``part``. A ``CLOSE`` frame is as long as a
    frame of part 0 (its payload bytes are zero and unused), so that a receiver waiting for the
    first part of a contribution can take it."""

    def __init__(self, num_groups: int, payload_bytes: Sequence[int]):
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.payload_bytes = tuple(check_int("payload_bytes[k]", n, 0) for n in payload_bytes)
        if not self.payload_bytes:
            raise ValueError("payload_bytes needs one size per part; got none")
        self.header_bytes = 8 * (3 + num_groups)

    @property
    def num_parts(self) -> int:
        return len(self.payload_bytes)

    def frame_bytes(self, part: int) -> int:
        """The length of a frame carrying part ``part`` (of a ``CLOSE``: ``part`` 0)."""
        return self.header_bytes + self.payload_bytes[part]

    def encode(self, message: Message) -> torch.Tensor:
        """The frame of ``message`` (a new tensor; ``message.source`` is not written)."""
        self._check_header(message.kind, message.version, message.part, message.seen)
        kind, payload = MessageKind(message.kind), message.payload
        expected = 0 if kind is MessageKind.CLOSE else self.payload_bytes[message.part]
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise ValueError(f"a {kind.name} message of part {message.part} needs a 1-D "
                             f"uint8 payload of {expected} bytes; got {payload.dtype} of shape "
                             f"{tuple(payload.shape)}")
        frame = torch.zeros(self.frame_bytes(message.part), dtype=torch.uint8)
        header = [int(kind), message.version, message.part, *message.seen]
        frame[:self.header_bytes] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
        frame[self.header_bytes:self.header_bytes + payload.numel()] = payload
        return frame

    def decode(self, frame: torch.Tensor, source: int) -> Message:
        """The message in ``frame`` (its payload a view of the frame), from group ``source``;
        raises :class:`MalformedFrameError` if the bytes are not a frame of this link."""
        if frame.dtype != torch.uint8 or frame.dim() != 1 or frame.numel() < self.header_bytes:
            raise MalformedFrameError(f"a frame from group {source} must be 1-D uint8 of at least "
                                      f"{self.header_bytes} bytes; got {frame.dtype} of shape "
                                      f"{tuple(frame.shape)}")
        header = frame[:self.header_bytes].view(torch.int64).tolist()
        kind, version, part, seen = header[0], header[1], header[2], tuple(header[3:])
        try:
            self._check_header(kind, version, part, seen)
        except ValueError as error:
            raise MalformedFrameError(f"malformed frame from group {source}: {error}") from None
        if frame.numel() != self.frame_bytes(part):
            raise MalformedFrameError(f"malformed frame from group {source}: part {part} needs "
                                      f"{self.frame_bytes(part)} bytes; got {frame.numel()}")
        kind = MessageKind(kind)
        payload = frame[:0] if kind is MessageKind.CLOSE else frame[self.header_bytes:]
        return Message(kind, source, version, part, seen, payload)

    def _check_header(self, kind: int, version: int, part: int, seen: Sequence[int]) -> None:
        if kind not in set(MessageKind):
            raise ValueError(f"kind must be one of {[int(k) for k in MessageKind]}; got {kind}")
        if version < 0 or not 0 <= part < self.num_parts:
            raise ValueError(f"version must be >= 0 and part in [0, {self.num_parts - 1}]; got "
                             f"version {version}, part {part}")
        if kind == MessageKind.CLOSE and part != 0:
            raise ValueError(f"a CLOSE message is sized as part 0; got part {part}")
        if len(seen) != self.num_groups or any(v < 0 for v in seen):
            raise ValueError(f"seen needs {self.num_groups} counts >= 0; got {tuple(seen)}")


@dataclass(frozen=True)
class _ReceiverFailure:
    source: int
    error: Exception


class LeaderLink:
    r"""Messages between the groups' leaders, point-to-point on a gloo process group of the
    leaders (whatever the job's backend).

    Build it on every rank, in the same order as the job's other process groups (it creates
    one: torch.distributed's rule); only a leader (the first rank of its group) sends and
    receives. A leader runs one receiver thread per other group, which takes that group's frames
    in order (a contribution's parts, 0 to ``num_parts - 1``, then the next contribution's) and
    puts their messages in one queue that :meth:`receive` reads. :meth:`send` is asynchronous
    (``isend``); :meth:`wait_sends` waits for every send so far.

    Args:
        grouping: the groups; the leaders are their first ranks.
        group_index: this rank's group.
        framing: the frames (one payload size per part).
        timeout_s: the longest a receiver waits between two messages (> 0); a receiver that
            waits longer, or whose link fails, makes :meth:`receive` raise
            :class:`GroupFailedError`.
    """

    def __init__(self, grouping: Grouping, group_index: int, framing: Framing, timeout_s: float):
        self.grouping, self.group_index, self.framing = grouping, group_index, framing
        self.timeout_s = check_float("timeout_s", timeout_s, 0.0, 1e9, low_open=True)
        self.peers: List[int] = [h for h in range(len(grouping.groups)) if h != group_index]
        self.is_leader = dist.get_rank() == grouping.leaders[group_index]
        self.process_group = dist.new_group(list(grouping.leaders), backend="gloo",
                                            timeout=datetime.timedelta(seconds=self.timeout_s))
        self.bytes_sent = 0
        self._sends: list = []  # (work, frame): a frame must live until its send completes
        self._inbox: "queue.Queue" = queue.Queue()
        self._threads = [self._start_receiver(h) for h in self.peers] if self.is_leader else []

    def send(self, message: Message) -> None:
        """Send ``message`` to every other group's leader (in the background)."""
        frame = self.framing.encode(message)
        for h in self.peers:
            work = dist.isend(frame, self.grouping.leaders[h], group=self.process_group)
            self._sends.append((work, frame))
            self.bytes_sent += frame.numel()

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def receive(self, timeout: float) -> Optional[Message]:
        """The next message from another group (each group's in the order sent), or ``None`` if
        none comes within ``timeout`` seconds (0: only one already here). Raises
        :class:`GroupFailedError` if a receiver failed."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, _ReceiverFailure):
            raise GroupFailedError(
                f"group {item.source} (ranks {list(self.grouping.groups[item.source])}) stalled or "
                f"died: its leader sent nothing for {self.timeout_s:g} s or its link failed "
                f"({item.error})") from item.error
        return item

    def close(self, message: Message) -> None:
        """Send ``message`` (a ``CLOSE``), wait for every send, and stop the receivers (each
        returns once the other group's ``CLOSE`` is in)."""
        self.send(message)
        self.wait_sends()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s)

    def _start_receiver(self, source: int) -> threading.Thread:
        thread = threading.Thread(target=self._receive_from, args=(source,), daemon=True,
                                  name=f"hetero_comm-group-sync-from-{source}")
        thread.start()
        return thread

    def _receive_from(self, source: int) -> None:
        """Background: every frame from group ``source``'s leader, in order, into the queue."""
        leader, part = self.grouping.leaders[source], 0
        try:
            while True:
                frame = torch.empty(self.framing.frame_bytes(part), dtype=torch.uint8)
                dist.recv(frame, leader, group=self.process_group)
                message = self.framing.decode(frame, source)
                if message.part != part:
                    raise MalformedFrameError(f"group {source} sent part {message.part} when part "
                                              f"{part} was due")
                self._inbox.put(message)
                if message.kind is MessageKind.CLOSE:
                    return
                part = (part + 1) % self.framing.num_parts
        except Exception as error:  # noqa: BLE001 (handed to the training thread)
            self._inbox.put(_ReceiverFailure(source, error))
