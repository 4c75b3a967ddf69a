"""Settings that must be the same on every rank, compared across the ranks once at set-up
through the process group's key-value store, with a bounded wait: a disagreement raises on
every rank naming the setting and each rank's value, and a rank that never arrives makes the
others raise after :data:`SETUP_TIMEOUT_SECONDS` instead of waiting for the process group's
timeout (30 minutes by default). No collective is left pending on the group, so a rank that
ends on the error leaves at once."""

import datetime
import pickle
from typing import List, Optional

import torch.distributed as dist

__all__ = ["SETUP_TIMEOUT_SECONDS", "agree_across_ranks", "gathered_across_ranks"]

# How long a set-up comparison waits for the other ranks.
SETUP_TIMEOUT_SECONDS = 120.0


def agree_across_ranks(setting: str, value, group: Optional[dist.ProcessGroup] = None,
                       timeout_seconds: Optional[float] = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless every rank passed an equal
    ``value`` (picklable) for ``setting``; ``RuntimeError`` if the ranks have not all arrived
    within ``timeout_seconds`` (default :data:`SETUP_TIMEOUT_SECONDS`)."""
    values = gathered_across_ranks(value, group, SETUP_TIMEOUT_SECONDS if timeout_seconds is None
                       else timeout_seconds, setting)
    if any(other != values[0] for other in values):
        raise ValueError(f"the ranks' {setting} differ ({_differences(values)}): every rank must "
                         f"pass the same {setting}")


def _differences(values: List) -> str:
    """Each rank's value; of a dict, only the entries that differ between the ranks."""
    if all(isinstance(value, dict) for value in values):
        names = sorted({name for value in values for name in value}, key=str)
        differing = [name for name in names
                     if any(value.get(name) != values[0].get(name) for value in values)]
        return "; ".join(f"rank {rank}: " + ", ".join(f"{name!r}: {value.get(name)!r}"
                                                      for name in differing)
                         for rank, value in enumerate(values))
    return "; ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(values))


def gathered_across_ranks(value, group: Optional[dist.ProcessGroup], timeout_seconds: float,
                          setting: str) -> List:
    """Every rank's ``value``, in rank order, exchanged through the process group's key-value
    store (no collective is left pending on the group when a rank never arrives, so the ranks
    that raise can leave), waited for at most ``timeout_seconds``."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    prefix = f"hetero_comm/agreement/{'-'.join(map(str, ranks))}"
    store = dist.distributed_c10d._get_default_store()
    # every rank of the group makes the same calls in one order (counted afresh in a new
    # default group, whose store is new)
    call = _calls.get((id(store), prefix), 0)
    _calls[(id(store), prefix)] = call + 1
    keys = [f"{prefix}/{call}/{rank}" for rank in ranks]
    store.set(keys[ranks.index(dist.get_rank())], pickle.dumps(value))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
    except RuntimeError as error:  # (the store's timeout; DistStoreError subclasses it)
        raise RuntimeError(f"not every rank compared its {setting} within {timeout_seconds:g} s "
                           f"(hetero_comm._agreement.SETUP_TIMEOUT_SECONDS): every rank of the "
                           f"process group must make the same set-up call ({error})") from error
    return [pickle.loads(store.get(key)) for key in keys]


# how many agreements each group (by its store and ranks) has made: the calls' keys
_calls: dict = {}
