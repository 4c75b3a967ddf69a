"""Fitting a dense optimizer to what a hook hands it, without touching the user's learning rate.

:meth:`HookState.prepare_optimizer` sets the optimizer's hyperparameters the hook needs
(AdamW's betas, SGD's momentum) and runs each step at a multiple of the learning rate. The
multiple is applied inside ``optimizer.step()`` only: the optimizer's ``step`` is wrapped, and
the user's rate is put back when the step returns or raises. Between steps every parameter
group holds the user's own rate, so learning-rate schedulers (created before or after), logs
and checkpoints see the rate the user set.
"""

import functools
import types
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["OptimizerFit", "unwrap_optimizer"]


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``
    keeps it in ``.optimizer`` and steps it there)."""
    inner = optimizer
    # A torch optimizer sets up its own attributes in __init__; Accelerate's wrapper subclasses
    # Optimizer without running it (its param_groups is a property reading the inner one).
    while "param_groups" not in getattr(inner, "__dict__", {}):
        inner = getattr(inner, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one "
                            f"in .optimizer); got {type(optimizer).__name__}")
    return inner


class OptimizerFit:
    """Before every step of ``optimizer``: runs ``check(optimizer)`` (which raises if a
    parameter group no longer suits the hook, e.g. one added since, or a momentum a scheduler
    set) and puts ``settings`` (hyperparameter name -> value) into every parameter group; then
    steps at ``lr_scale`` times each group's learning rate and puts the rates back. The
    settings are also put back after ``optimizer.load_state_dict``. Fitting the same optimizer
    again replaces the previous fit. Copies and unpickled optimizers lose the fit (torch keeps
    only the state and the parameter groups): prepare them again."""

    _ATTRIBUTE = "_hetero_comm_fit"

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Dict[str, object],
                 lr_scale: float, check: Callable[[torch.optim.Optimizer], None]) -> None:
        previous: Optional[OptimizerFit] = getattr(optimizer, self._ATTRIBUTE, None)
        if previous is not None:
            previous.remove()
        self.optimizer, self.settings, self.lr_scale = optimizer, dict(settings), lr_scale
        self._check = check
        self._user_rates: List[tuple] = []  # (group, the user's rate) while a step runs
        self._active = True
        self._load_hook = optimizer.register_load_state_dict_post_hook(self._apply_settings)
        self._original_step = optimizer.step
        fit = self

        @functools.wraps(self._original_step)
        def step(_optimizer, *args, **kwargs):
            if not fit._active:
                return fit._original_step(*args, **kwargs)
            fit._before_step()
            try:
                return fit._original_step(*args, **kwargs)
            finally:  # also when the step raised
                fit._restore_rates()

        # A bound method, as LR schedulers (which wrap ``step`` again) expect.
        self._step = types.MethodType(step, optimizer)
        optimizer.step = self._step
        self._apply_settings(optimizer)
        setattr(optimizer, self._ATTRIBUTE, self)

    def remove(self) -> None:
        """Stop fitting (the settings stay as set)."""
        self._active = False
        self._load_hook.remove()
        if vars(self.optimizer).get("step") is self._step:  # else a scheduler wrapped it since
            self.optimizer.step = self._original_step
        if getattr(self.optimizer, self._ATTRIBUTE, None) is self:
            delattr(self.optimizer, self._ATTRIBUTE)

    def _apply_settings(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group.update(self.settings)

    def _before_step(self) -> None:
        self._check(self.optimizer)
        self._apply_settings(self.optimizer)
        if self.lr_scale != 1.0:
            for group in self.optimizer.param_groups:
                self._user_rates.append((group, group["lr"]))
                group["lr"] = group["lr"] * self.lr_scale

    def _restore_rates(self) -> None:
        for group, user_lr in self._user_rates:
            group["lr"] = user_lr
        self._user_rates = []
