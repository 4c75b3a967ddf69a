"""Lightning callbacks that run hetero_comm on any device and checkpoint its state:
:class:`CompressCallback` (the one call, the recipe from the optimizer) and
:class:`HeteroCommCallback` (a hook and state of your choice)."""

import warnings
from typing import Any, Callable, Dict, Optional, Union

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..hooks import HookState, SegmentSparseState
from ..recipes import compress, density_for_ratio

__all__ = ["CompressCallback", "HeteroCommCallback"]


def _ddp_model(strategy) -> DistributedDataParallel:
    """The strategy's DDP model, which must not have a hook of Lightning's own."""
    model = strategy.model
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"hetero_comm's callbacks need a DistributedDataParallel model (Lightning's "
                         f"'ddp' strategy with several processes); the strategy is "
                         f"{type(strategy).__name__} and its model a {type(model).__name__}")
    if getattr(strategy, "_ddp_comm_hook", None) is not None:
        raise ValueError("the DDP strategy has a ddp_comm_hook of its own (Lightning registers "
                         "it on CUDA only): give the hook to hetero_comm's callback alone")
    return model


class HeteroCommCallback(Callback):
    """Register ``hook`` with ``state`` on the DDP model of Lightning's ``"ddp"`` strategy,
    and save and restore the state with Lightning's checkpoints (``trainer.fit(ckpt_path=)``
    then resumes exactly: the state's dict holds every rank's part).

    Give the hook to this callback only, not to ``DDPStrategy(ddp_comm_hook=...)``.

    ``prepare_optimizers=True`` hands every optimizer to ``state.prepare_optimizer`` at the
    start of ``fit``, so ``configure_optimizers`` keeps the dense learning rate and schedule
    (the recipes of docs/recipes.md); otherwise each is only checked (``state.check_optimizer``, which
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
        model = _ddp_model(trainer.strategy)
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


class CompressCallback(Callback):
    """:func:`hetero_comm.compress` on Lightning's DDP model and its optimizer at the start of
    ``fit``: the recipe for the optimizer of ``configure_optimizers`` (kept as for dense
    training), and the hook state in Lightning's checkpoints (``trainer.fit(ckpt_path=)``
    resumes it exactly). ``ratio`` and ``machines``: as :func:`hetero_comm.compress`'s. The state is
    :attr:`state` once ``fit`` has started.

    Example::

        >>> trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu",
        ...                   callbacks=[CompressCallback()])
    """

    def __init__(self, ratio: Union[None, float, str] = None, machines=None) -> None:
        if ratio not in (None, "auto"):
            density_for_ratio(ratio)  # a clear error now rather than at fit
        self.ratio, self.machines = ratio, machines
        self.state: Optional[SegmentSparseState] = None
        self._saved: Optional[Dict[str, Any]] = None  # a checkpoint loaded before fit started

    @property
    def state_key(self) -> str:
        return "hetero_comm.CompressCallback"

    def on_fit_start(self, trainer, pl_module) -> None:
        model = _ddp_model(trainer.strategy)
        if len(trainer.optimizers) != 1:
            raise ValueError(f"CompressCallback fits one optimizer; configure_optimizers returned "
                             f"{len(trainer.optimizers)}: use HeteroCommCallback with a state "
                             f"of your own")
        self.state = compress(model, trainer.optimizers[0], ratio=self.ratio, machines=self.machines)
        if self._saved is not None:
            self.state.load_state_dict(self._saved)
            self._saved = None

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.state is None else self.state.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.state is None:  # Lightning restores callbacks before on_fit_start
            self._saved = state_dict
        else:
            self.state.load_state_dict(state_dict)
