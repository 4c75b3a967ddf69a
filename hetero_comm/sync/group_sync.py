"""Group synchronisation (CN107018184): synchronous DDP inside each group of similar ranks,
asynchronous exchange of model progress between the groups, each contribution scaled by its
staleness (CN111027671)."""

import datetime
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from .._checks import check_float, check_int
from .grouping import Grouping
from .parts import ForwardClock, Part, split_into_parts
from .versions import Contribution, VersionBook, inverse_staleness
from .wire import Wire

__all__ = ["GroupSync", "GroupFailedError"]

_CONTRIBUTION, _FLUSH, _CLOSE = 0, 1, 2


class GroupFailedError(RuntimeError):
    """Another group stalled beyond the time limit or its leader failed."""


class GroupSync:
    r"""Synchronous inside a group, asynchronous between groups.

    Every rank builds it (collectively, in the same order) and trains its group's DDP module
    on :attr:`process_group`. Each group's optimizer runs at ``lr * lr_scale``; after each
    optimizer step every rank calls :meth:`step`. Every ``period`` steps:

    1. the group's leader sends the group's progress since its last contribution,
       ``params - base``, to the other groups' leaders (point-to-point, in the background; in
       ``wire_dtype``: what rounding leaves out stays in ``params - base`` and goes with the
       next contribution), with its version and the versions it has applied;
    2. if the group is more than ``max_staleness`` contributions ahead of what it has applied
       from some other group, it waits for that group (``max_staleness=0``: every round waits
       for the other groups' same round, which is synchronous training);
    3. it applies the other groups' contributions that have arrived, in order, each scaled by
       ``staleness_scale(tau)`` (default ``1 / (1 + tau)``; ``tau``: the versions of this group
       the contribution did not see), and hands the sum to the group's other ranks (a
       broadcast inside the group).

    The contributions add up (an asynchronous parameter server without the server): with a
    learning rate scaled by each group's share of the samples (the default ``lr_scale``), one
    round with ``tau = 0`` is exactly a synchronous step on all groups' samples for SGD with or
    without momentum. Nothing is lost: every contribution is applied exactly once, at its
    scale, by every other group; :meth:`stats` counts them (and any scaled to zero).

    :meth:`flush` (every rank; a group that flushes first waits there for the others, which are
    no longer held by the staleness bound) drains all contributions in flight and replaces every
    group's parameters by their average weighted by the groups' sample shares;
    :meth:`state_dict` is valid only right after it, so a checkpoint holds no contribution in
    flight and the same model on every rank. :meth:`close` flushes and stops the exchange.

    Args:
        module: the model (its parameters are exchanged; buffers are not).
        grouping: the :class:`Grouping`; its world size must be the job's.
        period: local steps between contributions: one number for every group, or one per
            group (a faster group with a proportionally longer period makes its rounds at the
            slower groups' pace, so the bound below never holds it back;
            :func:`periods_for_speeds`).
        max_staleness: the bound of step 2.
        staleness_scale: ``tau -> scale`` in [0, 1].
        lr_scale: this group's learning-rate factor; default its sample share.
        wire_dtype: the exchange between groups: ``"float32"``, ``"bfloat16"``, or ``"int8"``
            (blocks of 256 values scaled to [-127, 127] by hetero_comm's ``quantize`` kernel,
            1.016 bytes a value); ``None``: the parameters' dtype.
        layer_deadline: the layer-wise soft deadline of CN111027671. Each contribution goes as
            one message per part (consecutive layers of at least ``part_bytes`` on the wire, in
            registration order, usually the order they run in), and a round no longer waits
            for a contribution in full: once the staleness bound is met, it waits for each
            missing part ``k`` of a contribution that has begun to arrive only until ``resume +
            before[k]``, where ``resume`` is when the round could give training back and
            ``before[k]`` this group's measured forward time up to part ``k``'s first layer
            (when the next forward needs it). A part that misses its deadline is not lost: it
            is applied at a later round, as stale as it then is (at least one version more),
            and counted in ``stats()["late_parts"]``. Lockstep (``max_staleness=0``) is then no
            longer exactly synchronous. The bound counts a contribution once a part of it is in.
        part_bytes: the smallest part (with ``layer_deadline``); a receiver needs the interpreter
            lock once per part, so very small parts cost a throttled process time.
        stall_timeout_s: the longest wait for another group (step 2, :meth:`flush`) before
            :class:`GroupFailedError`.

    Example::

        grouping = groups_from_sites(["a", "a", "b", "b"])
        sync = GroupSync(model, grouping, period=8)
        ddp_model = DDP(model, process_group=sync.process_group)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr * sync.lr_scale, momentum=0.9)
        for inputs, targets in loader:
            loss_fn(ddp_model(inputs), targets).backward()
            optimizer.step(); optimizer.zero_grad()
            sync.step()
        sync.close()
    """

    def __init__(self, module: torch.nn.Module, grouping: Grouping, *,
                 period: Union[int, Sequence[int]] = 1,
                 max_staleness: int = 4, staleness_scale: Callable[[int], float] = inverse_staleness,
                 lr_scale: Optional[float] = None, wire_dtype: Optional[str] = None,
                 layer_deadline: bool = False, part_bytes: int = 1 << 18,
                 stall_timeout_s: float = 1800.0):
        if not dist.is_initialized():
            raise RuntimeError("GroupSync needs torch.distributed initialised (init_process_group)")
        if not isinstance(grouping, Grouping):
            raise ValueError(f"grouping must be a Grouping; got {type(grouping).__name__}")
        if grouping.world_size != dist.get_world_size():
            raise ValueError(f"grouping covers {grouping.world_size} ranks; the job has "
                             f"{dist.get_world_size()}")
        self.stall_timeout_s = check_float("stall_timeout_s", stall_timeout_s, 0.0, 1e9, low_open=True)
        self.grouping, self.rank = grouping, dist.get_rank()
        self.group_index = grouping.group_of(self.rank)
        periods = [period] * len(grouping.groups) if isinstance(period, int) else list(period)
        if len(periods) != len(grouping.groups):
            raise ValueError(f"period needs one value per group ({len(grouping.groups)}); got "
                             f"{len(periods)}")
        self.period = [check_int("period", p, 1) for p in periods][self.group_index]
        self.lr_scale = (grouping.sample_share(self.group_index) if lr_scale is None
                         else check_float("lr_scale", lr_scale, 0.0, 1e9, low_open=True))
        self.params = [p for p in module.parameters()]
        if not self.params:
            raise ValueError("module has no parameters to synchronise")
        self._numel = sum(p.numel() for p in self.params)
        self.wire = Wire(wire_dtype, self.params[0].dtype)
        if not isinstance(layer_deadline, bool):
            raise ValueError(f"layer_deadline must be True or False; got {layer_deadline!r}")
        check_int("part_bytes", part_bytes, 1)
        bytes_per_value = self.wire.payload_bytes(1 << 20) / (1 << 20)
        self.parts = (split_into_parts(module, self.params, max(1, int(part_bytes / bytes_per_value)))
                      if layer_deadline else [Part(0, self._numel, ())])
        self.book = VersionBook(len(grouping.groups), self.group_index, max_staleness=max_staleness,
                                staleness_scale=staleness_scale, num_parts=len(self.parts))
        self._make_process_groups()
        self.is_leader = self.rank == grouping.groups[self.group_index][0]
        # The leader decides each round's deadlines from its own forward times.
        self._clock = ForwardClock(module, self.parts) if layer_deadline and self.is_leader else None
        self.local_step, self._flushed_at = 0, 0
        self._waited_s, self._waits, self._bytes_sent = 0.0, 0, 0
        self._base = self._flat().clone() if self.is_leader else None
        self._arrived: Dict[int, List[Contribution]] = {h: [] for h in range(len(grouping.groups))}
        self._markers: Dict[int, int] = {}
        self._inbox: "queue.Queue" = queue.Queue()
        self._sends: list = []
        self._threads = [self._start_receiver(h) for h in self._peers()] if self.is_leader else []
        self._closed = False

    # ----- set-up -----------------------------------------------------------------------
    def _make_process_groups(self) -> None:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        self.process_group = None
        for index, ranks in enumerate(self.grouping.groups):
            group = dist.new_group(list(ranks))
            if index == self.group_index:
                self.process_group = group
        # The leaders talk point-to-point over gloo whatever the backend (a slow link between
        # sites is TCP anyway); its timeout is the longest a receiver waits between messages.
        self._leaders_group = dist.new_group(
            list(self.grouping.leaders), backend="gloo",
            timeout=datetime.timedelta(seconds=self.stall_timeout_s))

    def _peers(self) -> List[int]:
        return [h for h in range(len(self.grouping.groups)) if h != self.group_index]

    def _flat(self) -> torch.Tensor:
        return parameters_to_vector([p.detach() for p in self.params])

    @torch.no_grad()
    def _write(self, flat: torch.Tensor, add: bool = False) -> None:
        """Copy (or add) ``flat`` into the parameters in place (their storage, which DDP and
        the optimizer hold, stays theirs)."""
        offset = 0
        for p in self.params:
            chunk = flat[offset:offset + p.numel()].view_as(p)
            if add:
                p.add_(chunk)
            else:
                p.copy_(chunk)
            offset += p.numel()

    def _start_receiver(self, source: int) -> threading.Thread:
        thread = threading.Thread(target=self._receive_from, args=(source,), daemon=True,
                                  name=f"hetero_comm-group-sync-from-{source}")
        thread.start()
        return thread

    def _message_sizes(self, part: int):
        """Bytes of a message: the int64 header (kind, version, part, the seen vector), then the
        payload of ``part`` in the wire dtype. One message per part (without the layer-wise
        deadline: per contribution), so a receiver thread needs the interpreter lock once per
        part (a throttled process hands it over slowly: parts are not made too small)."""
        header = 8 * (3 + len(self.grouping.groups))
        numel = self.parts[part].end - self.parts[part].start
        return header, self.wire.payload_bytes(numel)

    def _receive_from(self, source: int) -> None:
        """Background: every message from group ``source``'s leader, in order, into the inbox."""
        leader = self.grouping.leaders[source]
        try:
            while True:  # a contribution's parts in order; a close message is sized as part 0
                for part in range(len(self.parts)):
                    header_bytes, payload_bytes = self._message_sizes(part)
                    message = torch.empty(header_bytes + payload_bytes, dtype=torch.uint8)
                    dist.recv(message, leader, group=self._leaders_group)
                    header = message[:header_bytes].view(torch.int64)
                    kind, version = int(header[0]), int(header[1])
                    if kind == _CLOSE:
                        self._inbox.put(("close", (source, version)))
                        return
                    payload = message[header_bytes:]
                    self._inbox.put(("contribution", Contribution(
                        source, version, tuple(header[3:].tolist()), payload, part=int(header[2]))))
                if kind == _FLUSH:
                    self._inbox.put(("flush", (source, version + 1)))
        except Exception as error:  # noqa: BLE001 (handed to the training thread)
            self._inbox.put(("error", (source, error)))

    # ----- the training loop's calls -------------------------------------------------------
    def step(self) -> None:
        """Call after every optimizer step, on every rank; every ``period`` steps a round."""
        self._check_open()
        self.local_step += 1
        if self.local_step % self.period == 0:
            self._round(flush=False)

    def flush(self) -> None:
        """Every rank (each group at a step of its own choosing; the first waits for the
        others): send what is left, apply every contribution in flight, then give every group
        the sample-weighted average of the groups' parameters."""
        self._check_open()
        self._round(flush=True)
        flat = self._flat()
        flat.mul_(self.grouping.sample_share(self.group_index) / len(self.grouping.groups[self.group_index]))
        dist.all_reduce(flat)
        self._write(flat)
        if self.is_leader:
            self._base.copy_(flat)
        self._flushed_at = self.local_step

    def close(self) -> None:
        """Flush, then stop the background exchange (every rank, at the end of training)."""
        if self._closed:
            return
        self.flush()
        if self.is_leader:
            self._send_all(self._message(_CLOSE, self.book.made, self.book.seen(), 0)[0])
            self._wait_sends()
            for thread in self._threads:
                thread.join(timeout=self.stall_timeout_s)
        if self._clock is not None:
            self._clock.remove()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GroupSync was closed")

    # ----- one round -----------------------------------------------------------------------
    def _round(self, flush: bool) -> None:
        update = None
        if self.is_leader:
            update = self._leader_round(flush)
        members = len(self.grouping.groups[self.group_index])
        if members > 1:
            count = torch.tensor([0 if update is None else 1], device=self.params[0].device)
            leader = self.grouping.groups[self.group_index][0]
            dist.broadcast(count, leader, group=self.process_group)
            if int(count) == 0:
                return
            if update is None:
                update = torch.empty(self._numel, dtype=self.params[0].dtype,
                                     device=self.params[0].device)
            dist.broadcast(update, leader, group=self.process_group)
        if update is not None:
            self._apply(update)

    def _leader_round(self, flush: bool) -> Optional[torch.Tensor]:
        self._wait_sends()
        self._contribute(_FLUSH if flush else _CONTRIBUTION)
        if flush:
            self._wait_sends()
            self._drain(lambda: len(self._markers) < len(self._peers()), "flush")
            for h, count in self._markers.items():
                self._check_complete(h, count)
            self._markers.clear()
            ready = self._take_arrived(None)
        else:
            self._drain(lambda: self.book.lagging_group(self._arrived_counts(), self._markers) is not None,
                        "the staleness bound")
            if self._clock is not None:
                self._await_parts(resume=time.monotonic())
            # max_staleness=0: exactly the other groups' contributions of this group's rounds
            # (deterministic without the layer-wise deadline); otherwise everything that has arrived.
            ready = self._take_arrived(self.book.made if self.book.max_staleness == 0 else None)
        return self._combine(ready)

    def _check_complete(self, source: int, count: int) -> None:
        """After a flush drained group ``source``, which made ``count`` contributions: every part
        of each is applied or here, once."""
        here = [sum(c.part == k for c in self._arrived[source]) for k in range(len(self.parts))]
        done = self.book.part_applied[source]
        if any(a + n != count for a, n in zip(done, here)):
            raise RuntimeError(f"group {source} made {count} contributions; per part, {done} applied "
                               f"and {here} arrived here")

    def _await_parts(self, resume: float) -> None:
        """The layer-wise soft deadline (CN111027671). The next forward starts at ``resume`` and
        needs part ``k`` about ``before[k]`` later (measured): wait for each missing part of a
        contribution that has begun to arrive until ``resume + before[k]``, no longer. A part
        that misses it is applied at a later round, one version staler (counted in ``stats()``
        as ``late_parts``)."""
        below = self.book.made if self.book.max_staleness == 0 else None
        while True:
            now = time.monotonic()
            deadlines = [resume + self._clock.before[k] for k in self._missing_parts(below)]
            latest = max(deadlines, default=now)
            if latest <= now:
                return
            try:
                self._take(*self._inbox.get(timeout=latest - now))
            except queue.Empty:
                return

    def _missing_parts(self, below: Optional[int]) -> List[int]:
        return [k for h in self._peers() for _, k in self.book.missing_parts(
            h, {(c.version, c.part) for c in self._arrived[h]}, below)]

    def _contribute(self, kind: int) -> None:
        """Send this group's progress, one message per part in order; a flush's last contribution
        (``_FLUSH``) also tells the others how many this group has made."""
        version = self.book.record_made()
        seen = list(self.book.seen())
        seen[self.group_index] = version
        progress = self._flat() - self._base
        for k, part in enumerate(self.parts):
            message, payload = self._message(kind, version, seen, k)
            sent = self.wire.encode_(progress[part.start:part.end], payload)
            # what the wire left out goes next time (sent is on the host; the base where the
            # parameters are)
            self._base[part.start:part.end].add_(sent.to(self._base))
            self._send_all(message)

    def _message(self, kind: int, version: int, seen, part: int) -> tuple:
        """A message (host bytes) with its header written, and a view of its payload."""
        header_bytes, payload_bytes = self._message_sizes(part)
        message = torch.empty(header_bytes + payload_bytes, dtype=torch.uint8)
        message[:header_bytes] = torch.tensor([kind, version, part, *seen],
                                              dtype=torch.int64).view(torch.uint8)
        return message, message[header_bytes:]

    def _send_all(self, message: torch.Tensor) -> None:
        for h in self._peers():
            work = dist.isend(message, self.grouping.leaders[h], group=self._leaders_group)
            self._sends.append((work, message))
            self._bytes_sent += message.numel()

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _arrived_counts(self) -> Dict[int, int]:
        """Per group, its contributions with a part here and none applied yet."""
        return {h: len({c.version for c in arrived if c.version >= self.book.opened(h)})
                for h, arrived in self._arrived.items()}

    def _take_arrived(self, below: Optional[int]) -> List[Contribution]:
        """Remove and return the arrived contributions (each group's in order), only those with
        a version under ``below`` if given."""
        ready = []
        for h in self._peers():
            arrived = self._arrived[h]
            count = len(arrived) if below is None else sum(c.version < below for c in arrived)
            ready += arrived[:count]
            del arrived[:count]
        return ready

    def _combine(self, ready: List[Contribution]) -> Optional[torch.Tensor]:
        if not ready:
            return None
        update = torch.zeros_like(self._base)
        for contribution in ready:
            _, scale = self.book.accept(contribution)
            if scale:
                part = self.parts[contribution.part]
                values = self.wire.decode(contribution.payload, part.end - part.start)
                update[part.start:part.end].add_(values.to(update), alpha=scale)
        return update

    def _apply(self, update: torch.Tensor) -> None:
        self._write(update, add=True)
        if self.is_leader:
            self._base.add_(update)

    def _drain(self, must_wait: Callable[[], bool], reason: str) -> None:
        """Take every message that has arrived; block while ``must_wait()``, at most
        ``stall_timeout_s`` in all."""
        start = time.monotonic()
        waited = False
        while True:
            blocking = must_wait()
            waited = waited or blocking
            left = self.stall_timeout_s - (time.monotonic() - start)
            try:
                message = self._inbox.get(timeout=max(left, 1e-3)) if blocking else self._inbox.get_nowait()
            except queue.Empty:
                if blocking:
                    raise GroupFailedError(self._stall_message(reason)) from None
                break
            self._take(*message)
        if waited:
            self._waits += 1
            self._waited_s += time.monotonic() - start

    def _take(self, kind: str, value) -> None:
        if kind == "contribution":
            self._arrived[value.source].append(value)
        elif kind == "flush":
            self._markers[value[0]] = value[1]
        elif kind == "error":
            source, error = value
            raise GroupFailedError(f"group {source} (ranks {list(self.grouping.groups[source])}) "
                                   f"stalled or died: its leader sent nothing for "
                                   f"{self.stall_timeout_s:g} s or its link failed ({error})") from error
        else:
            raise GroupFailedError(f"group {value[0]} closed while group {self.group_index} "
                                   "still trains: every rank must call close() at the end")

    def _stall_message(self, reason: str) -> str:
        behind = {h: self.book.made - self.book.applied[h] for h in self._peers()}
        return (f"group {self.group_index} waited {self.stall_timeout_s:g} s for {reason} and "
                f"another group stalled or died; "
                f"contributions it is ahead of each other group: {behind} (max_staleness "
                f"{self.book.max_staleness}).")

    # ----- statistics and checkpoints -------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """This group's counts: contributions made and applied in full (per group), parts
        applied, staleness and the mean scale (per part), parts scaled to zero (``dropped``),
        parts that missed their round's deadline (``late_parts``), waits, bytes this rank sent."""
        return dict(self.book.stats(), group=self.group_index, local_step=self.local_step,
                    waits=self._waits, waited_s=self._waited_s, bytes_sent=self._bytes_sent)

    def state_dict(self) -> Dict[str, object]:
        """The versions and counters; only right after :meth:`flush` (nothing in flight, the same
        parameters on every rank, so the model's own checkpoint is the rest)."""
        if self._flushed_at != self.local_step:
            raise RuntimeError("GroupSync.state_dict() needs flush() at this step first (on "
                               "every rank): a checkpoint must hold no contribution in flight")
        return dict(book=self.book.state_dict(), local_step=self.local_step,
                    groups=[list(g) for g in self.grouping.groups])

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Load after the model's parameters (they become the base of the next contribution)."""
        if [list(g) for g in self.grouping.groups] != [list(g) for g in state["groups"]]:
            raise ValueError(f"the checkpoint's groups {state['groups']} differ from this run's "
                             f"{[list(g) for g in self.grouping.groups]}")
        self.book.load_state_dict(state["book"])
        self.local_step = self._flushed_at = int(state["local_step"])
        if self.is_leader:
            self._base = self._flat().clone()
