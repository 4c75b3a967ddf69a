"""A Lightning callback that runs a hetero_comm hook on any device and checkpoints its state."""

import warnings
from typing import Any, Callable, Dict

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..hooks import HookState

__all__ = ["HeteroCommCallback"]


class HeteroCommCallback(Callback):
    """Register ``hook`` with ``state`` on the DDP model of Lightning's ``"ddp"`` strategy,
    and save and restore the state with Lightning's checkpoints (``trainer.fit(ckpt_path=)``
    then resumes exactly: the state's dict holds every rank's part).

    Give the hook to this callback only, not to ``DDPStrategy(ddp_comm_hook=...)``.

    ``prepare_optimizers=True`` hands every optimizer to ``state.prepare_optimizer`` at the
    start of ``fit``, so ``configure_optimizers`` keeps the dense learning rate and schedule
    (the README's recipes); otherwise each is only checked (``state.check_optimizer``, which
    warns if it does not suit the hook).

    Example::

        >>> state = SegmentSparseState(density=0.01)
        >>> trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu",
        ...                   callbacks=[HeteroCommCallback(state, segment_sparse_hook)])
        >>> # the AdamW recipe, configure_optimizers unchanged:
        >>> state = SegmentSparseState(density=0.10, segment_size=512, wire_dtype="int8",
        ...                            basis="dct", output="sign")
        >>> callback = HeteroCommCallback(state, segment_sparse_hook, prepare_optimizers=True)
    """

    def __init__(self, state: HookState, hook: Callable, *, prepare_optimizers: bool = False) -> None:
        if not isinstance(state, HookState):
            raise TypeError(f"state must be a hetero_comm hook state; got {type(state).__name__}")
        self.state, self.hook = state, hook
        self.prepare_optimizers = bool(prepare_optimizers)

    @property
    def state_key(self) -> str:
        return f"HeteroCommCallback[{type(self.state).__name__}]"

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        model = strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(f"HeteroCommCallback needs a DistributedDataParallel model (Lightning's "
                             f"'ddp' strategy with several processes); the strategy is "
                             f"{type(strategy).__name__} and its model a {type(model).__name__}")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError("the DDP strategy has a ddp_comm_hook of its own (Lightning registers "
                             "it on CUDA only): give the hook to HeteroCommCallback alone")
        model.register_comm_hook(self.state, self.hook)
        for optimizer in trainer.optimizers:  # configured by now (Lightning's setup precedes this)
            if self.prepare_optimizers:
                self.state.prepare_optimizer(optimizer)
            else:
                self._check_optimizer(optimizer)

    def _check_optimizer(self, optimizer) -> None:
        """``state.check_optimizer``, its warnings saying how to prepare the optimizer here."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.state.check_optimizer(optimizer)
        for warning in caught:
            warnings.warn(f"{warning.message} (with Lightning: HeteroCommCallback(state, hook, "
                          f"prepare_optimizers=True))", warning.category, stacklevel=3)

    def state_dict(self) -> Dict[str, Any]:
        return self.state.state_dict()  # a collective: Lightning calls it on every rank

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.state.load_state_dict(state_dict)
