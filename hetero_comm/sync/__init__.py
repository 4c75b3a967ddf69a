"""Group synchronisation across sites: synchronous data parallelism inside groups of similar
ranks, asynchronous between the groups, stale contributions scaled down.

* :class:`Grouping`, :func:`groups_from_sites`, :func:`groups_from_speeds`: which ranks
  synchronise together, and each group's share of the samples; :func:`periods_for_speeds`:
  a period per group that keeps the groups' rounds at one pace;
* :class:`GroupSync`: the exchange between groups (point-to-point between the groups' leaders
  on torch.distributed, in the background; float32, bfloat16 or int8 on the wire, or a
  :class:`SparseWire`: the most important segments at 2 to 8 bits), the staleness
  bound and rule, the layer-wise soft deadline, flush, checkpoints;
* :class:`VersionBook`, :func:`inverse_staleness`: versions and staleness, without transport.

Inside: :mod:`.link` carries typed messages between the groups' leaders (framing, receiver
threads), :mod:`.arrivals` holds what has arrived and the rounds' waits, :mod:`.wire` the number
formats, :mod:`.parts` a contribution's parts and the forward clock of the layer-wise deadline.
"""

from .group_sync import GroupFailedError, GroupSync
from .grouping import Grouping, groups_from_sites, groups_from_speeds, periods_for_speeds
from .versions import Contribution, VersionBook, inverse_staleness
from .wire import SparseWire

__all__ = ["Grouping", "groups_from_sites", "groups_from_speeds", "periods_for_speeds", "GroupSync", "GroupFailedError",
           "VersionBook", "Contribution", "inverse_staleness", "SparseWire"]
