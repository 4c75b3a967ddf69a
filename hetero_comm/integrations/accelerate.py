"""Register a hetero_comm hook on a model prepared by Hugging Face Accelerate."""

from typing import Callable

from torch.nn.parallel import DistributedDataParallel

from ..hooks import HookState

__all__ = ["register_comm_hook"]


def register_comm_hook(accelerator, model, state: HookState, hook: Callable) -> None:
    """Register ``hook`` with ``state`` on ``model`` (as returned by ``accelerator.prepare``)
    and the state for ``accelerator.save_state`` / ``load_state``, which then resume exactly
    (call both on every process, as Accelerate asks).

    Raises:
        ValueError: ``model`` is not a DistributedDataParallel: Accelerate runs a single
            process (``accelerate launch --cpu`` starts one; use ``--multi_gpu
            --num_processes N`` or torchrun for several CPU processes).

    Example::

        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> register_comm_hook(accelerator, model, SegmentSparseState(density=0.01),
        ...                    segment_sparse_hook)
    """
    if not isinstance(state, HookState):
        raise TypeError(f"state must be a hetero_comm hook state; got {type(state).__name__}")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"model is a {type(model).__name__}, not DistributedDataParallel: "
                         f"Accelerate prepared it for a single process (accelerate launch "
                         f"--cpu starts one; use --multi_gpu --num_processes N, or torchrun), "
                         f"or for another wrapper (FSDP, DeepSpeed), which DDP hooks do not serve")
    model.register_comm_hook(state, hook)
    accelerator.register_for_checkpointing(state)
