"""Group synchronisation: synchronous DDP inside each group of similar ranks, asynchronous
exchange of model progress between the groups' leaders, each contribution scaled down by its
staleness. The rounds are here; the link between leaders is :mod:`.link`, what has arrived and
the waits are :mod:`.arrivals`, the versions and the staleness rule :mod:`.versions`."""

import time
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from .._agreement import agree_across_ranks
from .._checks import check_float, check_int
from .arrivals import Arrivals
from .grouping import Grouping
from .link import Framing, GroupFailedError, LeaderLink, Message, MessageKind
from .parts import ForwardClock, Part, split_into_parts
from .versions import Contribution, VersionBook, inverse_staleness
from .wire import SparseWire, Wire, make_wire

__all__ = ["GroupSync", "GroupFailedError"]


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
        period: local steps between contributions (>= 1): one number for every group, or one
            per group (a faster group with a proportionally longer period makes its rounds at the
            slower groups' pace, so the bound below never holds it back;
            :func:`periods_for_speeds`).
        max_staleness: the bound of step 2 (>= 0).
        staleness_scale: ``tau -> scale`` in [0, 1].
        lr_scale: this group's learning-rate factor (> 0); default its sample share.
        wire_dtype: the exchange between groups: ``"float32"``, ``"bfloat16"``, or ``"int8"``
            (blocks of 256 values scaled to [-127, 127] by hetero_comm's ``quantize`` kernel,
            1.016 bytes a value); ``None``: the parameters' dtype; or a :class:`SparseWire`:
            the most important segments of each contribution at 2, 4 or 8 bits (a few
            hundredths of a byte a value), the rest held back in ``params - base`` for later
            contributions.
        layer_deadline: the layer-wise soft deadline. Each contribution goes as
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
        part_bytes: the smallest part in bytes (>= 1; with ``layer_deadline``); a receiver needs the interpreter
            lock once per part, so very small parts cost a throttled process time.
        stall_timeout_s: the longest wait for another group in seconds (> 0; step 2,
            :meth:`flush`) before :class:`GroupFailedError`.

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
                 lr_scale: Optional[float] = None,
                 wire_dtype: Union[None, str, SparseWire] = None,
                 layer_deadline: bool = False, part_bytes: int = 1 << 18,
                 stall_timeout_s: float = 1800.0):
        _check_job(grouping)
        self.stall_timeout_s = check_float("stall_timeout_s", stall_timeout_s, 0.0, 1e9, low_open=True)
        self.grouping, self.rank = grouping, dist.get_rank()
        self.group_index = grouping.group_of(self.rank)
        self.period = _periods(grouping, period)[self.group_index]
        self.lr_scale = (grouping.sample_share(self.group_index) if lr_scale is None
                         else check_float("lr_scale", lr_scale, 0.0, 1e9, low_open=True))
        self.params = [p for p in module.parameters()]
        if not self.params:
            raise ValueError("module has no parameters to synchronise")
        self._numel = sum(p.numel() for p in self.params)
        self.wire = make_wire(wire_dtype, self.params[0].dtype)
        self.parts = _parts(module, self.params, self.wire, layer_deadline, part_bytes)
        self.book = VersionBook(len(grouping.groups), self.group_index, max_staleness=max_staleness,
                                staleness_scale=staleness_scale, num_parts=len(self.parts))
        # Ranks that differ here would block in new_group below or exchange mismatched frames.
        agree_across_ranks("GroupSync settings", dict(
            groups=grouping.groups, batch_sizes=grouping.batch_sizes,
            periods=_periods(grouping, period), max_staleness=max_staleness,
            wire=(repr(self.wire) if isinstance(self.wire, SparseWire)
                  else f"{self.wire.name} ({self.wire.value_dtype})"),
            layer_deadline=layer_deadline, part_bytes=part_bytes, parameters=self._numel,
            parts=[(part.start, part.end) for part in self.parts]))
        # Every rank creates every process group, in the same order (torch.distributed's rule).
        groups = [dist.new_group(list(ranks)) for ranks in grouping.groups]
        self.process_group = groups[self.group_index]
        framing = Framing(len(grouping.groups),
                          [self.wire.payload_bytes(part.end - part.start) for part in self.parts])
        self.link = LeaderLink(grouping, self.group_index, framing, self.stall_timeout_s)
        self.is_leader = self.link.is_leader
        self.arrivals = Arrivals(self.link, self.book, self.stall_timeout_s)
        # The leader decides each round's deadlines from its own forward times.
        self._clock = ForwardClock(module, self.parts) if layer_deadline and self.is_leader else None
        self.local_step, self._flushed_at = 0, 0
        self._base = _flatten(self.params).clone() if self.is_leader else None
        self._closed = False

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
        flat = _flatten(self.params)
        flat.mul_(self.grouping.sample_share(self.group_index) / len(self.grouping.groups[self.group_index]))
        dist.all_reduce(flat)
        _write(self.params, flat)
        if self.is_leader:
            self._base.copy_(flat)
        self._flushed_at = self.local_step

    def close(self) -> None:
        """Flush, then stop the exchange between groups (every rank, at the end of training)."""
        if self._closed:
            return
        self.flush()
        if self.is_leader:
            self.link.close(Message(MessageKind.CLOSE, self.group_index, self.book.made, 0,
                                    self.book.seen(), torch.empty(0, dtype=torch.uint8)))
        if self._clock is not None:
            self._clock.remove()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GroupSync was closed")

    # ----- one round -----------------------------------------------------------------------
    def _round(self, flush: bool) -> None:
        """The leader contributes, receives and combines; the group's other ranks get the
        combined update from it; every rank applies it."""
        update = self._leader_round(flush) if self.is_leader else None
        if len(self.grouping.groups[self.group_index]) > 1:
            update = self._share(update)
        if update is not None:
            _write(self.params, update, add=True)
            if self.is_leader:
                self._base.add_(update)

    def _leader_round(self, flush: bool) -> Optional[torch.Tensor]:
        self.link.wait_sends()
        self._contribute(MessageKind.FLUSH if flush else MessageKind.CONTRIBUTION)
        if flush:
            self.link.wait_sends()
            self.arrivals.wait_for_flushes()
            return self._combine(self.arrivals.pop(None))
        self.arrivals.wait_for_bound()
        # max_staleness=0: exactly the other groups' contributions of this group's rounds
        # (deterministic without the layer-wise deadline); otherwise everything that has arrived.
        below = self.book.made if self.book.max_staleness == 0 else None
        if self._clock is not None:
            self.arrivals.wait_for_parts(time.monotonic(), self._clock.before, below)
        return self._combine(self.arrivals.pop(below))

    def _contribute(self, kind: MessageKind) -> None:
        """Send this group's progress since its last contribution, one message per part in order;
        what the wire format leaves out stays in ``params - base`` for the next contribution
        (a ``feedback_decay`` below 1 keeps that fraction of it)."""
        version = self.book.record_made()
        seen = list(self.book.seen())
        seen[self.group_index] = version
        progress = _flatten(self.params) - self._base
        for k, part in enumerate(self.parts):
            payload = torch.empty(self.link.framing.payload_bytes[k], dtype=torch.uint8)
            values = progress[part.start:part.end]
            # sent is on the host; the base where the parameters are
            sent = self.wire.encode_(values, payload).to(self._base)
            self._base[part.start:part.end].add_(sent)
            if self.wire.feedback_decay < 1.0:
                self._base[part.start:part.end].add_(values - sent,
                                                     alpha=1.0 - self.wire.feedback_decay)
            self.link.send(Message(kind, self.group_index, version, k, tuple(seen), payload))

    def _combine(self, ready: List[Contribution]) -> Optional[torch.Tensor]:
        """The sum of ``ready``, each scaled by the staleness rule (``None`` if none)."""
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

    def _share(self, update: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The leader's ``update`` (or ``None``) on every rank of the group (broadcasts)."""
        leader = self.grouping.leaders[self.group_index]
        count = torch.tensor([0 if update is None else 1], device=self.params[0].device)
        dist.broadcast(count, leader, group=self.process_group)
        if int(count) == 0:
            return None
        if update is None:
            update = torch.empty(self._numel, dtype=self.params[0].dtype, device=self.params[0].device)
        dist.broadcast(update, leader, group=self.process_group)
        return update

    # ----- statistics and checkpoints -------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """This group's counts: contributions made and applied in full (per group), parts
        applied, staleness and the mean scale (per part), parts scaled to zero (``dropped``),
        parts that missed their round's deadline (``late_parts``), waits, bytes this rank sent."""
        return dict(self.book.stats(), group=self.group_index, local_step=self.local_step,
                    waits=self.arrivals.waits, waited_s=self.arrivals.waited_s,
                    bytes_sent=self.link.bytes_sent)

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
            self._base = _flatten(self.params).clone()


# ----- set-up and the flat parameter vector ------------------------------------------------------
def _check_job(grouping: Grouping) -> None:
    if not dist.is_initialized():
        raise RuntimeError("GroupSync needs torch.distributed initialised (init_process_group)")
    if not isinstance(grouping, Grouping):
        raise ValueError(f"grouping must be a Grouping; got {type(grouping).__name__}")
    if grouping.world_size != dist.get_world_size():
        raise ValueError(f"grouping covers {grouping.world_size} ranks; the job has "
                         f"{dist.get_world_size()}")


def _periods(grouping: Grouping, period: Union[int, Sequence[int]]) -> List[int]:
    periods = [period] * len(grouping.groups) if isinstance(period, int) else list(period)
    if len(periods) != len(grouping.groups):
        raise ValueError(f"period needs one value per group ({len(grouping.groups)}); got "
                         f"{len(periods)}")
    return [check_int("period", p, 1) for p in periods]


def _parts(module: torch.nn.Module, params: List[torch.nn.Parameter], wire: Union[Wire, SparseWire],
           layer_deadline: bool, part_bytes: int) -> List[Part]:
    """One part (everything) without the layer-wise deadline; with it, consecutive layers of at
    least ``part_bytes`` on the wire."""
    if not isinstance(layer_deadline, bool):
        raise ValueError(f"layer_deadline must be True or False; got {layer_deadline!r}")
    check_int("part_bytes", part_bytes, 1)
    if not layer_deadline:
        return [Part(0, sum(p.numel() for p in params), ())]
    bytes_per_value = wire.payload_bytes(1 << 20) / (1 << 20)
    return split_into_parts(module, params, max(1, int(part_bytes / bytes_per_value)))


def _flatten(params: List[torch.nn.Parameter]) -> torch.Tensor:
    return parameters_to_vector([p.detach() for p in params])


@torch.no_grad()
def _write(params: List[torch.nn.Parameter], flat: torch.Tensor, add: bool = False) -> None:
    """Copy (or add) ``flat`` into the parameters in place (their storage, which DDP and the
    optimizer hold, stays theirs)."""
    offset = 0
    for p in params:
        chunk = flat[offset:offset + p.numel()].view_as(p)
        if add:
            p.add_(chunk)
        else:
            p.copy_(chunk)
        offset += p.numel()
