"""Bytes a rank hands to collectives, and the bytes those put on its link, measured the same way
for every hook (hetero_comm's, whose states also count their own, and PyTorch's, which do not)."""

import contextlib
import inspect
from typing import Dict, Optional

import torch
import torch.distributed as dist

__all__ = ["count_collective_bytes", "link_bytes", "COUNTED"]

# The collectives counted, each by the bytes of the tensor a rank hands in (its input):
# name -> the position of that tensor among the function's parameters.
COUNTED = {"all_reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1,
           "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_to_all_single": 1}


def link_bytes(name: str, handed: int, world_size: int, kept: Optional[int] = None) -> float:
    """The bytes a rank sends over its link when it hands ``handed`` bytes to the collective
    ``name`` among ``world_size`` ranks, with bandwidth-optimal (ring) algorithms: an allreduce
    ``2 (W - 1) / W`` times its input, an all-gather ``W - 1`` times (every other rank's copy), a
    reduce-scatter ``(W - 1) / W``, an all-to-all all but ``kept``, the part for the rank itself
    (``handed / W`` when not given). A rank receives as much as it sends in each."""
    if world_size <= 1:
        return 0.0
    if name == "all_reduce":
        return 2.0 * (world_size - 1) / world_size * handed
    if name.startswith("all_gather"):
        return float((world_size - 1) * handed)
    if name.startswith("reduce_scatter"):
        return (world_size - 1) / world_size * handed
    if name == "all_to_all_single":
        return float(handed - (handed / world_size if kept is None else kept))
    raise ValueError(f"no link model for the collective {name!r}")


def _kept_by_all_to_all(arguments: dict, tensor: torch.Tensor, group) -> Optional[int]:
    """Bytes of an ``all_to_all_single``'s input that stay on this rank (None: even splits)."""
    splits = arguments.get("input_split_sizes")
    if not splits:
        return None
    row_bytes = tensor.element_size() * (tensor[0].numel() if tensor.dim() else 1)
    return splits[dist.get_rank(group)] * row_bytes


@contextlib.contextmanager
def count_collective_bytes(totals: Dict[str, float]):
    """Add the bytes this rank hands to the collectives of :data:`COUNTED` to
    ``totals["bytes"]``, and the bytes they send over its link (:func:`link_bytes`) to
    ``totals["link_bytes"]``, while active (by wrapping those functions of
    ``torch.distributed``, restored on exit)."""
    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
    totals.setdefault("bytes", 0)
    totals.setdefault("link_bytes", 0.0)

    def counted(name, original):
        signature = inspect.signature(original)
        input_name = list(signature.parameters)[COUNTED[name]]

        def collective(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            tensor = arguments[input_name]
            handed = tensor.numel() * tensor.element_size()
            group = arguments.get("group")
            world_size = dist.get_world_size(group)
            kept = _kept_by_all_to_all(arguments, tensor, group) if name == "all_to_all_single" \
                else None
            totals["bytes"] += handed
            totals["link_bytes"] += link_bytes(name, handed, world_size, kept)
            return original(*args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield totals
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
