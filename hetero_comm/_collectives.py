"""Tensor-in, tensor-out collectives under whichever name the installed torch gives them.

torch 2.13 renamed ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` to
``reduce_scatter_single`` and ``all_gather_single`` (the old names now warn); torch 2.11 has
only the old names. The package supports both (``torch>=2.11``), so it calls these."""

import torch.distributed as dist



def reduce_scatter_single(output, input, *args, **kwargs):  # noqa: A002 (torch's names)
    """``torch.distributed.reduce_scatter_single`` (torch 2.13), else ``reduce_scatter_tensor``
    (looked up at each call, so that a wrapper put on either, e.g. a byte counter, sees it)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, *args, **kwargs)


def all_gather_single(output, input, *args, **kwargs):  # noqa: A002
    """``torch.distributed.all_gather_single`` (torch 2.13), else ``all_gather_into_tensor``
    (looked up at each call)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, *args, **kwargs)
