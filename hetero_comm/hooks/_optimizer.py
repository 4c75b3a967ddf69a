"""Fitting a dense optimizer to what a hook hands it, without touching the user's learning rate.

What a hook hands the optimizer is one of :class:`HandedSum` (any optimizer),
:class:`HandedSign` (AdamW's sign step) or :class:`HandedMomentumCorrectedSum` (SGD whose
momentum the hook applies). Each says which optimizers suit it, what it sets in them and at
what multiple of the user's rate they step (:meth:`HandedSum.fit`), and what it does last to
the bucket (:meth:`HandedSum.finish`). :func:`fit_optimizer` applies a fit;
:func:`check_optimizer` only warns where an optimizer does not match it.

:meth:`HookState.prepare_optimizer` sets the optimizer's hyperparameters the hook needs
(AdamW's betas, SGD's momentum) and runs each step at a multiple of the learning rate, with
the weight decay scaled so that it decays as dense training does. Both are applied inside
``optimizer.step()`` only: the optimizer's ``step`` is wrapped, and the user's rate and decay
are put back when the step returns or raises. Between steps every parameter
group holds the user's own rate, so learning-rate schedulers (created before or after), logs
and checkpoints see the rate the user set.
"""

import functools
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .._checks import check_float

__all__ = ["HandedSum", "HandedSign", "HandedMomentumCorrectedSum", "OptimizerFit",
           "fit_optimizer", "check_optimizer", "unwrap_optimizer", "momentum_correction_lr_scale",
           "SIGN_LR_SCALE"]

# The default learning-rate factor for sign steps (docs/design/recipes-adamw.md, "The rate: 1.5x
# dense, betas (0, 0)").
SIGN_LR_SCALE = 1.5


class HandedSum:
    """The hook hands DDP the (weighted) sum of the gradients: any optimizer suits it."""

    setting = ""  # the hook's setting that hands this, as messages name it

    def fit(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, object], float]:
        """The hyperparameters to set in every parameter group and the default factor on the
        learning rate; raises ``TypeError`` or ``ValueError`` if ``optimizer`` cannot take
        this step."""
        return {}, 1.0

    def finish(self, grad: torch.Tensor) -> None:
        """The last change to the delivered bucket: none for a sum."""

    def weight_decay_scale(self, lr_scale: float) -> float:
        """The factor on each group's ``weight_decay`` inside a step taken at ``lr_scale`` times
        the rate: 1 for a sum (the optimizer steps as the user's own would at that rate)."""
        return 1.0


class HandedSign(HandedSum):
    """The elementwise sign of the agreed sum: AdamW's (or Adam's) step with ``betas=(0, 0)``
    moves each coordinate by ``lr`` in that direction, at :data:`SIGN_LR_SCALE` times the
    user's rate, or times ``step_scale(rates)`` too (a factor from each parameter group's
    rate, read at every step: :meth:`~._step_scale.StepScale.factor_for`)."""

    setting = "output='sign'"

    def __init__(self, step_scale: Optional[Callable[[List[float]], float]] = None) -> None:
        self.step_scale = step_scale

    def fit(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, object], float]:
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"SegmentSparseState(output='sign') hands the optimizer sign "
                            f"steps, which Adam or AdamW take with betas (0, 0); got "
                            f"{type(optimizer).__name__}: use output='sum' with it")
        for index, group in enumerate(optimizer.param_groups):
            # Adam's coupled weight decay adds wd * p to the gradient before normalising: with
            # sign steps that moves every coordinate the hook left at 0 by a whole lr.
            if group.get("weight_decay") and not group.get("decoupled_weight_decay", False):
                raise ValueError(f"parameter group {index} has Adam's weight_decay "
                                 f"{group['weight_decay']}, added to the gradient before Adam's "
                                 f"normalisation: with sign steps it moves every coordinate not "
                                 f"sent by a whole lr. Use AdamW (decoupled weight decay), or "
                                 f"Adam with decoupled_weight_decay=True")
        if self.step_scale is not None:
            step_scale = self.step_scale
            return {"betas": (0.0, 0.0)}, lambda: SIGN_LR_SCALE * step_scale(
                [group["lr"] for group in optimizer.param_groups])
        return {"betas": (0.0, 0.0)}, SIGN_LR_SCALE

    def finish(self, grad: torch.Tensor) -> None:
        grad.sign_()

    def weight_decay_scale(self, lr_scale: float) -> float:
        """``1 / lr_scale``: the factor makes up for what the sign step loses, not the decay,
        which AdamW (decoupled) applies at ``lr * weight_decay``: dense's."""
        return 1.0 / lr_scale


def momentum_correction_lr_scale(density: float, momentum: float, nesterov: bool = False) -> float:
    """The learning-rate factor that gives back what momentum correction's clearing loses.

    Momentum SGD moves a gradient by ``1 / (1 - m)`` times the rate in all. Momentum correction
    moves a gradient that arrived ``t`` steps before its segment went out by
    ``(1 - m**(t + 1)) / (1 - m)`` times the rate, then clears the velocity. With a segment
    sent every ``T = 1 / density`` steps and arrivals spread evenly over that interval, the
    fraction kept is ``1 - m * (1 - m**T) / (T * (1 - m))``; the factor is its inverse (2.1 at
    8% and momentum 0.9, 1.5 at 4%, 2.7 at 12%). With ``nesterov`` the hook accumulates
    ``g + m u`` (Nesterov's update), which moves such a gradient by
    ``(1 - m**(t + 2)) / (1 - m)``: the kept fraction is ``1 - m**2 (1 - m**T) / (T (1 - m))``
    (1.9 at 8% and 0.9)."""
    check_float("density", density, 0.0, 1.0, low_open=True)
    check_float("momentum", momentum, 0.0, 0.999)
    if not momentum:
        return 1.0
    interval = 1.0 / density
    lost = momentum ** (2 if nesterov else 1)
    kept = 1.0 - lost * (1.0 - momentum ** interval) / (interval * (1.0 - momentum))
    return 1.0 / kept


class HandedMomentumCorrectedSum(HandedSum):
    """A sum into which the hook has already folded SGD's momentum ``momentum`` (momentum
    correction; Nesterov's with ``nesterov``): SGD with its own momentum at 0 (and Nesterov
    off), at :func:`momentum_correction_lr_scale` times the user's rate."""

    def __init__(self, momentum: float, density: Union[float, Callable[[], float]],
                 nesterov: bool = False) -> None:
        # density: fixed, or read at every step (a density chosen as training runs)
        self.momentum, self.density, self.nesterov = momentum, density, nesterov
        self.setting = f"momentum={momentum}" + (", nesterov=True" if nesterov else "")

    def fit(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, object], float]:
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"SegmentSparseState(momentum={self.momentum}) replaces SGD's "
                            f"momentum; got {type(optimizer).__name__}: use momentum=0 with it")
        for index, group in enumerate(optimizer.param_groups):
            if group["momentum"] not in (0.0, self.momentum):
                raise ValueError(f"parameter group {index} has momentum {group['momentum']}, but "
                                 f"the hook applies momentum {self.momentum}: give "
                                 f"SegmentSparseState the optimizer's momentum (the hook's is "
                                 f"fixed: a scheduler cycling momentum, such as OneCycleLR, "
                                 f"needs cycle_momentum=False)")
            if group["momentum"] and group["nesterov"] != self.nesterov:
                kinds = ("plain", "Nesterov") if self.nesterov else ("Nesterov", "plain")
                raise ValueError(f"parameter group {index} uses {kinds[0]} momentum, but the hook "
                                 f"applies {kinds[1]} momentum: give SegmentSparseState "
                                 f"nesterov={bool(group['nesterov'])}, as the optimizer has it")
            if group["momentum"] and group["dampening"]:
                raise ValueError(f"parameter group {index} has dampening {group['dampening']}, "
                                 f"which the hook's momentum correction does not apply: build "
                                 f"the optimizer with dampening=0, or use AdamW")
        settings = {"momentum": 0.0, "nesterov": False} if self.nesterov else {"momentum": 0.0}
        if callable(self.density):
            return settings, lambda: momentum_correction_lr_scale(self.density(), self.momentum,
                                                                  self.nesterov)
        return settings, momentum_correction_lr_scale(self.density, self.momentum, self.nesterov)

    def weight_decay_scale(self, lr_scale: float) -> float:
        """``1 / ((1 - momentum) * lr_scale)``: SGD adds ``weight_decay * p`` to the gradient,
        and under dense momentum SGD that term passes through the momentum, which sums it to
        ``1 / (1 - momentum)`` times itself; with the momentum in the hook (and the optimizer's
        at 0) the decay would be that many times weaker, and ``lr_scale`` is for the sum, not
        the decay."""
        return 1.0 / ((1.0 - self.momentum) * lr_scale)


def fit_optimizer(optimizer, handed: HandedSum, lr_scale: Optional[float]) -> None:
    """Fit ``optimizer`` (or the torch optimizer inside a framework's wrapper) to ``handed``
    at ``lr_scale`` times its rate (``None``: ``handed``'s default); nothing is changed when
    it raises."""
    if lr_scale is not None:
        check_float("lr_scale", lr_scale, 0.0, float("inf"), low_open=True)
    inner = unwrap_optimizer(optimizer)
    settings, default_scale = handed.fit(inner)
    OptimizerFit(inner, settings, default_scale if lr_scale is None else float(lr_scale),
                 check=handed.fit, weight_decay_scale=handed.weight_decay_scale)


def check_optimizer(optimizer, handed: HandedSum, owner: str) -> None:
    """Warn (``UserWarning``) where ``optimizer`` does not take the step ``handed`` is made
    for: it cannot (what :meth:`HandedSum.fit` raises), or a parameter group lacks a setting
    the fit would put there."""
    inner = unwrap_optimizer(optimizer)
    owner = f"{owner}({handed.setting})"
    try:
        settings, _ = handed.fit(inner)
    except TypeError as error:  # its message names the setting
        warnings.warn(str(error), UserWarning, stacklevel=3)
        return
    except ValueError as error:
        warnings.warn(f"{owner}: {error}", UserWarning, stacklevel=3)
        return
    for name, value in settings.items():
        found = sorted({_hashable(group.get(name)) for group in inner.param_groups}, key=repr)
        if found != [_hashable(value)]:
            warnings.warn(f"{owner} needs {name}={value} in every parameter group (or call "
                          f"state.prepare_optimizer(optimizer)); found {name} {found}",
                          UserWarning, stacklevel=3)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


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
    steps at ``lr_scale`` (a number, or a function called at every step) times each group's
    learning rate, with ``weight_decay_scale(lr_scale)`` times its weight decay, and puts the
    rates and decays back. The
    settings are also put back after ``optimizer.load_state_dict``. Fitting the same optimizer
    again replaces the previous fit. Copies and unpickled optimizers lose the fit (torch keeps
    only the state and the parameter groups): prepare them again."""

    _ATTRIBUTE = "_hetero_comm_fit"

    def __init__(self, optimizer: torch.optim.Optimizer, settings: Dict[str, object],
                 lr_scale: Union[float, Callable[[], float]],
                 check: Callable[[torch.optim.Optimizer], None],
                 weight_decay_scale: Callable[[float], float] = lambda lr_scale: 1.0) -> None:
        previous: Optional[OptimizerFit] = getattr(optimizer, self._ATTRIBUTE, None)
        if previous is not None:
            previous.remove()
        self.optimizer, self.settings, self.lr_scale = optimizer, dict(settings), lr_scale
        self._check, self._weight_decay_scale = check, weight_decay_scale
        self._user_values: List[tuple] = []  # (group, the user's rate and decay) while a step runs
        # id(group) -> (group, its values of the settings before the fit first set them)
        self._before_fit: Dict[int, tuple] = {}
        self._active = True
        self._load_hook = optimizer.register_load_state_dict_post_hook(self._apply_settings)
        self._original_step = optimizer.step
        fit = self

        @functools.wraps(self._original_step)
        def step(_optimizer, *args, **kwargs):
            if not fit._active:
                return fit._original_step(*args, **kwargs)
            try:
                fit._before_step()
                return fit._original_step(*args, **kwargs)
            finally:  # also when the step (or the check before it) raised
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
        current = {id(group) for group in optimizer.param_groups}
        for replaced in [key for key in self._before_fit if key not in current]:
            del self._before_fit[replaced]  # (load_state_dict replaces the group dicts)
        for group in optimizer.param_groups:
            if id(group) not in self._before_fit:
                self._before_fit[id(group)] = (group, {name: _hashable(group.get(name))
                                                       for name in self.settings})
            group.update(self.settings)

    def _check_settings_kept(self) -> None:
        """Raise ``ValueError`` where a setting the fit put into a group has changed since to
        anything but the group's own value before the fit (a scheduler cycling momentum writes
        AdamW's betas and SGD's momentum at every step)."""
        for index, group in enumerate(self.optimizer.param_groups):
            known = self._before_fit.get(id(group))
            if known is None or known[0] is not group:  # a group added since: fitted below
                continue
            for name, value in self.settings.items():
                current = _hashable(group.get(name))
                if current not in (_hashable(value), known[1][name]):
                    raise ValueError(
                        f"parameter group {index} has {name}={group.get(name)!r}, but the hook "
                        f"set {name}={value!r} and needs it kept: something changed it between "
                        f"steps. A scheduler cycling momentum (OneCycleLR, CyclicLR) does; give "
                        f"it cycle_momentum=False")

    def _before_step(self) -> None:
        self._check_settings_kept()
        self._check(self.optimizer)
        self._apply_settings(self.optimizer)
        lr_scale = self.lr_scale() if callable(self.lr_scale) else self.lr_scale
        decay_scale = self._weight_decay_scale(lr_scale)
        if lr_scale != 1.0 or decay_scale != 1.0:
            for group in self.optimizer.param_groups:
                self._user_values.append((group, group["lr"], group.get("weight_decay")))
                group["lr"] = group["lr"] * lr_scale
                if group.get("weight_decay"):
                    group["weight_decay"] = group["weight_decay"] * decay_scale

    def _restore_rates(self) -> None:
        for group, user_lr, user_decay in self._user_values:
            group["lr"] = user_lr
            if user_decay is not None:
                group["weight_decay"] = user_decay
        self._user_values = []
