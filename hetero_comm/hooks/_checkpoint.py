"""Moving a compressing state's per-rank error feedback through one checkpoint: every rank's
part gathered to rank 0 on save, and on load the part of this rank picked out, or every saved
rank's parts summed and split anew when the world size changed."""

from typing import Callable, Dict, List, Tuple

import torch.distributed as dist

__all__ = ["group_shape", "gather_rank_parts", "part_of_this_rank"]


def group_shape(process_group) -> Tuple[int, int]:
    """``(world_size, rank)`` in ``process_group``; ``(1, 0)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


def gather_rank_parts(local: dict, process_group) -> Tuple[int, Dict[int, dict]]:
    """``(world_size, parts)``: rank 0 of the group gets every rank's ``local`` by rank, any
    other rank its own. A collective: call it on every rank of the group."""
    world_size, rank = group_shape(process_group)
    parts = {rank: local}
    if world_size > 1:
        gathered = [None] * world_size if rank == 0 else None
        group = process_group or dist.group.WORLD
        dist.gather_object(local, gathered, dst=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            parts = dict(enumerate(gathered))
    return world_size, parts


def part_of_this_rank(saved_size: int, parts: Dict[int, dict], process_group,
                      redistribute: Callable[[List[dict], int], dict]) -> dict:
    """This rank's part of what :func:`gather_rank_parts` saved: its own when the world size is
    the same, else ``{"stats": rank 0's, "plan": redistribute(every saved plan, world_size)}``
    (which needs rank 0's dict, holding every part)."""
    world_size, rank = group_shape(process_group)
    if saved_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"this state_dict holds the error feedback of {saved_size} ranks: "
                           f"load it after init_process_group, which tells this rank's part")
    if saved_size == world_size and rank in parts:
        return parts[rank]
    if len(parts) == saved_size:
        return {"stats": parts[0]["stats"],
                "plan": redistribute([parts[r]["plan"] for r in range(saved_size)], world_size)}
    raise ValueError(f"this state_dict holds the part of rank(s) {sorted(parts)} of "
                     f"{saved_size}, not this rank's ({rank} of {world_size}): load the "
                     f"dict saved by rank 0, which holds every rank's part")
