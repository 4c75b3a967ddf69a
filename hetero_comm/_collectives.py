"""Tensor-in, tensor-out collectives under whichever name the installed torch gives them.

torch 2.13 renamed ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` to
``reduce_scatter_single`` and ``all_gather_single`` (the old names now warn); torch 2.11 has
only the old names. The package supports both (``torch>=2.11``), so it calls these."""

import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
