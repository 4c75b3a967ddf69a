"""The dense baseline: a weighted allreduce, with the same weighting as the compressed hooks."""

from typing import Optional

import torch
import torch.distributed as dist

from ._state import HookState, check_state

__all__ = ["AllreduceState", "allreduce_hook"]


class AllreduceState(HookState):
    """State of :func:`allreduce_hook`: the settings of :class:`HookState` (every step is
    dense, so there is no warm-up and no error feedback)."""

    def __init__(self, *, process_group: Optional[dist.ProcessGroup] = None,
                 rank_weight: Optional[float] = None) -> None:
        super().__init__(process_group=process_group, rank_weight=rank_weight)
        self._log_settings()


def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Weighted dense allreduce: the baseline the compressed hooks are measured against.

    1. Multiply this rank's gradient by ``state.weight()`` (``1 / world_size`` by default).
    2. Allreduce (sum) in place.

    With the default weight this equals DDP without a hook; with ``rank_weight`` set it gives
    ``sum_i w_i * g_i`` (e.g. ranks with unequal batch sizes).

    Args:
        state: an :class:`AllreduceState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future of the bucket's buffer holding the weighted sum over ranks.

    Example::

        >>> state = AllreduceState(rank_weight=local_batch / global_batch)
        >>> ddp_model.register_comm_hook(state, allreduce_hook)
    """
    check_state(state, AllreduceState, "allreduce_hook")
    state.claim(bucket)
    future = state.send_dense(bucket.buffer(), after_warmup=True, parameters=bucket.parameters())
    state.end_bucket(bucket)
    return future
