"""hetero_comm on a model prepared by Hugging Face Accelerate: :func:`compress` (the one
call, the recipe from the optimizer) or :func:`register_comm_hook` (a hook and state of your
choice), each with the state in ``accelerator.save_state`` / ``load_state``."""

from typing import Callable, Optional, Union

from torch.nn.parallel import DistributedDataParallel

from .. import recipes
from ..hooks import HookState, SegmentSparseState

__all__ = ["compress", "register_comm_hook"]


def compress(accelerator, model, optimizer, *, ratio: Union[None, float, str] = None,
             machines=None) -> SegmentSparseState:
    """:func:`hetero_comm.compress` (``ratio`` and ``machines`` as there) on ``model`` and
    ``optimizer`` as returned by ``accelerator.prepare``, with the state registered for
    ``accelerator.save_state`` / ``load_state`` (which then resume exactly; call both on
    every process).

    Raises:
        ValueError: ``model`` is not a DistributedDataParallel (see :func:`register_comm_hook`);
            and whatever :func:`hetero_comm.compress` raises. Nothing is registered then.

    Example::

        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> state = compress(accelerator, model, optimizer)
    """
    _check_ddp(model)
    state = recipes.compress(model, optimizer, ratio=ratio, machines=machines)
    accelerator.register_for_checkpointing(state)
    return state


def _check_ddp(model) -> None:
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"model is a {type(model).__name__}, not DistributedDataParallel: "
                         f"Accelerate prepared it for a single process (accelerate launch "
                         f"--cpu starts one; use --multi_gpu --num_processes N, or torchrun), "
                         f"or for another wrapper (FSDP, DeepSpeed), which DDP hooks do not serve")


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
    _check_ddp(model)
    model.register_comm_hook(state, hook)
    accelerator.register_for_checkpointing(state)
