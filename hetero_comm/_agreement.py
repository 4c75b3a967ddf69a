"""Settings that must be the same on every rank, compared across the ranks once at set-up,
with a bounded wait: a disagreement raises on every rank naming the setting and each rank's
value, and a rank that never arrives makes the others raise after
:data:`SETUP_TIMEOUT_SECONDS` instead of waiting for the process group's timeout (30 minutes
by default)."""

import datetime
import pickle
from typing import List, Optional

import torch
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
    """Every rank's ``value``, in rank order, each collective waited for at most
    ``timeout_seconds``."""
    world_size = dist.get_world_size(group)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    _wait(dist.all_gather(sizes, torch.tensor([payload.numel()], device=device), group=group,
                          async_op=True), timeout_seconds, setting)
    longest = max(int(size) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    _wait(dist.all_gather(gathered, padded, group=group, async_op=True), timeout_seconds, setting)
    return [pickle.loads(bytes(data[:int(size)].cpu().numpy()))
            for data, size in zip(gathered, sizes)]


def _wait(work, timeout_seconds: float, setting: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_seconds))
    except RuntimeError as error:
        raise RuntimeError(f"not every rank compared its {setting} within {timeout_seconds:g} s "
                           f"(hetero_comm._agreement.SETUP_TIMEOUT_SECONDS): every rank of the "
                           f"process group must make the same set-up call ({error})") from error
