"""Bytes a rank hands to collectives, measured the same way for every hook (hetero_comm's,
whose states also count their own, and PyTorch's, which do not)."""

import contextlib
from typing import Dict

import torch.distributed as dist

__all__ = ["count_collective_bytes", "COUNTED"]

# The collectives counted, each by the bytes of the tensor a rank hands in (its input):
# name -> the position of that tensor among the arguments.
COUNTED = {"all_reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1, "all_gather_single": 1,
           "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_to_all_single": 1}


@contextlib.contextmanager
def count_collective_bytes(totals: Dict[str, int]):
    """Add the bytes this rank hands to the collectives of :data:`COUNTED` to
    ``totals["bytes"]`` while active (by wrapping those functions of ``torch.distributed``,
    restored on exit)."""
    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}

    def counted(name, original):
        def collective(*args, **kwargs):
            position = COUNTED[name]
            tensor = (args[position] if len(args) > position
                      else kwargs.get("tensor", kwargs.get("input_tensor", kwargs.get("input"))))
            totals["bytes"] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield totals
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
