"""Which ranks share a machine, and the process groups of a two-level sync.

Ranks on one machine talk over fast links (NVLink, PCIe, shared memory); machines over a slow
network. :class:`MachineLayout` says which rank is on which machine (given, from the launcher's
local world size, or from host names), and :meth:`MachineLayout.groups` creates, for this
rank, the group of its machine and its *rail*: the ranks of every machine with the same local
index, which carry the same share of each bucket between machines.
"""

import dataclasses
import os
import socket
from typing import Optional, Sequence, Tuple, Union

import torch.distributed as dist

from .._agreement import agree_across_ranks

__all__ = ["MachineLayout", "MachineGroups"]

MachinesArgument = Union[None, str, int, Sequence]


@dataclasses.dataclass(frozen=True)
class MachineGroups:
    """This rank's groups: ``machine`` (the ranks of its machine), ``rail`` (one rank per
    machine, all of this rank's local index) and ``control`` (every rank, used only by the
    exchange thread, so its collectives never interleave with the main thread's)."""

    machine: Optional[dist.ProcessGroup]
    rail: Optional[dist.ProcessGroup]
    control: Optional[dist.ProcessGroup]
    local_rank: int
    local_size: int
    machine_index: int
    machines: int


class MachineLayout:
    """The machine of every rank of a process group.

    Args:
        machine_of_rank: one label per rank (any hashable: a host name, a number), in rank
            order. Every machine must hold the same number of ranks (a share of each bucket
            per local rank, carried between machines by the ranks of equal local index).

    Raises:
        ValueError: no ranks, or machines of unequal rank counts.
    """

    def __init__(self, machine_of_rank: Sequence) -> None:
        labels = list(machine_of_rank)
        if not labels:
            raise ValueError("a machine layout needs at least one rank")
        distinct = list(dict.fromkeys(labels))
        self.machine_of_rank: Tuple[int, ...] = tuple(distinct.index(label) for label in labels)
        self.ranks_of_machine: Tuple[Tuple[int, ...], ...] = tuple(
            tuple(r for r, m in enumerate(self.machine_of_rank) if m == machine)
            for machine in range(len(distinct)))
        counts = sorted({len(ranks) for ranks in self.ranks_of_machine})
        if len(counts) > 1:
            sizes = ", ".join(f"{label!r}: {len(ranks)}" for label, ranks in
                              zip(distinct, self.ranks_of_machine))
            raise ValueError(f"machines of unequal rank counts are not supported ({sizes}): the "
                             f"two-level sync gives each local rank one share of a bucket to "
                             f"carry between machines, so every machine needs as many ranks; "
                             f"run the same number of ranks per machine, or use the flat hook")
        self.local_size = counts[0]

    @property
    def world_size(self) -> int:
        return len(self.machine_of_rank)

    @property
    def machines(self) -> int:
        return len(self.ranks_of_machine)

    def local_rank(self, rank: int) -> int:
        return self.ranks_of_machine[self.machine_of_rank[rank]].index(rank)

    def rail(self, local_rank: int) -> Tuple[int, ...]:
        """The ranks of local index ``local_rank``, one per machine, in machine order."""
        return tuple(ranks[local_rank] for ranks in self.ranks_of_machine)

    def __repr__(self) -> str:
        return f"MachineLayout({self.machines} machines x {self.local_size} ranks)"

    @classmethod
    def resolve(cls, machines: MachinesArgument,
                process_group: Optional[dist.ProcessGroup] = None) -> "MachineLayout":
        """The layout ``machines`` describes for ``process_group``'s ranks (collective for
        ``"auto"`` without a launcher's local world size):

        * an int: ranks per machine, consecutive ranks together (``2``: ranks 0-1, 2-3, ...);
        * a sequence: one machine label per rank;
        * ``"auto"``: ``LOCAL_WORLD_SIZE`` (torchrun, Accelerate) when set, else the host
          names of the ranks (gathered).

        Raises:
            ValueError: a layout that does not cover the group's ranks, a rank count that
                does not divide the world size, or machines of unequal rank counts.
        """
        world_size = dist.get_world_size(process_group)
        if machines == "auto":
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is not None and local.isdigit() and int(local) > 0 and world_size % int(local) == 0:
                machines = int(local)
            else:
                hosts = [None] * world_size
                dist.all_gather_object(hosts, socket.gethostname(), group=process_group)
                return cls(hosts)
        if isinstance(machines, bool) or machines is None:
            raise ValueError(f"machines must be 'auto', ranks per machine (an int) or one label "
                             f"per rank; got {machines!r}")
        if isinstance(machines, int):
            if machines < 1 or world_size % machines:
                raise ValueError(f"machines={machines} ranks per machine does not divide the "
                                 f"{world_size} ranks of the process group")
            return cls([rank // machines for rank in range(world_size)])
        if isinstance(machines, str) or not isinstance(machines, Sequence):
            raise ValueError(f"machines must be 'auto', ranks per machine (an int) or one label "
                             f"per rank; got {machines!r}")
        if len(machines) != world_size:
            raise ValueError(f"machines has {len(machines)} labels but the process group has "
                             f"{world_size} ranks: give one machine label per rank")
        return cls(machines)

    def _check_every_rank_agrees(self, group: dist.ProcessGroup) -> None:
        """Raise ``ValueError`` on every rank when the ranks' layouts differ, ``RuntimeError``
        when not every rank arrives in time (:func:`~hetero_comm._agreement.agree_across_ranks`):
        groups made from different layouts would wait for each other forever."""
        agree_across_ranks("machine layouts", list(self.machine_of_rank), group)

    def groups(self, process_group: Optional[dist.ProcessGroup] = None) -> MachineGroups:
        """Create this rank's groups (a collective: every rank of the world calls it, in the
        same order, as ``torch.distributed.new_group`` requires)."""
        group = process_group or dist.group.WORLD
        rank = dist.get_rank(group)
        if self.world_size != dist.get_world_size(group):
            raise ValueError(f"this layout covers {self.world_size} ranks; the process group has "
                             f"{dist.get_world_size(group)}")
        self._check_every_rank_agrees(group)

        def new_group(ranks):
            return dist.new_group([dist.get_global_rank(group, r) for r in ranks])

        machine = rail = None
        for ranks in self.ranks_of_machine:
            created = new_group(ranks)
            if rank in ranks:
                machine = created
        for local in range(self.local_size):
            created = new_group(self.rail(local))
            if rank in self.rail(local):
                rail = created
        control = new_group(range(self.world_size))
        return MachineGroups(machine=machine, rail=rail, control=control,
                             local_rank=self.local_rank(rank), local_size=self.local_size,
                             machine_index=self.machine_of_rank[rank], machines=self.machines)
