"""Fitting a dense optimizer to what a hook hands it, without touching the user's learning rate.

:meth:`SegmentSparseState.prepare_optimizer` changes the optimizer's hyperparameters the hook
needs (AdamW's betas, SGD's momentum) and runs each step at a multiple of the learning rate.
The multiple is applied inside ``optimizer.step()`` only, through the optimizer's step pre- and
post-hooks: between steps every parameter group holds the user's own rate, so learning-rate
schedulers (created before or after), logs and checkpoints see the rate the user set.
"""

from typing import Callable, Dict, List, Optional

import torch

__all__ = ["OptimizerFit", "unwrap_optimizer"]


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``
    keeps it in ``.optimizer`` and steps it there)."""
    inner = optimizer
    while not isinstance(vars(inner).get("_optimizer_step_pre_hooks"), dict):
        inner = getattr(inner, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one "
                            f"in .optimizer); got {type(optimizer).__name__}")
    return inner


class OptimizerFit:
    """Keeps ``settings`` (hyperparameter name -> value) in every parameter group of
    ``optimizer`` at each step (so a scheduler that cycles momentum or betas, or
    ``optimizer.load_state_dict``, cannot undo them) and steps at ``lr_scale`` times each
    group's learning rate. Fitting the same optimizer again replaces the previous fit."""

    _ATTRIBUTE = "_hetero_comm_fit"

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Dict[str, object],
                 lr_scale: float) -> None:
        previous: Optional[OptimizerFit] = getattr(optimizer, self._ATTRIBUTE, None)
        if previous is not None:
            previous.remove()
        self.optimizer, self.settings, self.lr_scale = optimizer, dict(settings), lr_scale
        # (group, the user's rate, the scaled rate put there for this step)
        self._scaled: List[tuple] = []
        self._handles = [optimizer.register_load_state_dict_post_hook(self._apply_settings),
                         optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._unscale)]
        self._apply_settings(optimizer)
        setattr(optimizer, self._ATTRIBUTE, self)

    def remove(self) -> None:
        """Undo the step scaling and the settings' persistence (the settings stay as set)."""
        self._unscale()
        for handle in self._handles:
            handle.remove()
        if getattr(self.optimizer, self._ATTRIBUTE, None) is self:
            delattr(self.optimizer, self._ATTRIBUTE)

    def _apply_settings(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group.update(self.settings)

    def _before_step(self, *_) -> None:
        self._unscale()  # a step that raised left its groups scaled
        self._apply_settings(self.optimizer)
        if self.lr_scale == 1.0:
            return
        for group in self.optimizer.param_groups:
            user_lr = group["lr"]
            group["lr"] = user_lr * self.lr_scale
            self._scaled.append((group, user_lr, group["lr"]))

    def _unscale(self, *_) -> None:
        for group, user_lr, scaled_lr in self._scaled:
            if group["lr"] is scaled_lr:  # else something set a new rate since: keep it
                group["lr"] = user_lr
        self._scaled = []

