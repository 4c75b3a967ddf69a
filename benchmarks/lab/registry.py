"""Every hook the demo, the benchmarks and the tests run, by name: one place for its title,
its state, and whether it can weight ranks unequally."""

import dataclasses
import inspect
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from hetero_comm._checks import check_choice, check_int
from hetero_comm.recipes import density_for_ratio
from .baselines import DeMoState, Int4BetweenMachinesState, demo_hook, int4_between_machines_hook
from hetero_comm.hooks import (AllreduceState, DCTQuantState, HookState, SegmentSparseState, TwoLevelState,
                     allreduce_hook, dct_quant_hook, segment_sparse_hook, two_level_hook)

__all__ = ["HookSpec", "HOOKS", "WEIGHTED_HOOKS", "make_hook"]


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """A hook and how to build its state.

    ``state_class(**defaults, **settings)`` builds the state (a class or a function that
    builds it; ``None``: the hook takes no
    state and no settings); ``weighted``: the state takes a ``rank_weight``, so ranks with
    unequal batches can be weighted exactly; ``one_call``: :func:`hetero_comm.compress` builds
    the state and registers the hook from the model and its optimizer (settings: ``ratio``,
    ``machines``); ``collective``: building the state is a collective (it creates process
    groups), so without a process group the settings' names are checked only; ``hands_sign``:
    the hook hands the optimizer a sign, for AdamW with betas ``(0, 0)`` (signum).
    """

    name: str
    title: str
    hook: Callable
    state_class: Optional[type]
    weighted: bool
    defaults: Tuple[Tuple[str, object], ...] = ()
    one_call: bool = False
    collective: bool = False  # building the state creates process groups
    hands_sign: bool = False

    @property
    def is_hetero_comm(self) -> bool:
        """Whether the state is a hetero_comm one (else the hook is torch's)."""
        owner = getattr(self.state_class, "__self__", self.state_class)  # (a classmethod's class)
        return self.one_call or (isinstance(owner, type) and issubclass(owner, HookState))

    def make_state(self, settings: Optional[dict] = None):
        """The hook's state from ``settings`` (``None`` for a hook without one; a one-call
        hook's settings are only checked: its state needs the model and optimizer)."""
        settings = dict(settings or {})
        if self.one_call:
            unknown = sorted(set(settings) - {"ratio", "machines"})
            if unknown:
                raise ValueError(f"hook {self.name!r} takes only 'ratio' and 'machines'; got {unknown}")
            if settings.get("ratio") not in (None, "auto"):
                density_for_ratio(settings["ratio"])
            return None
        if self.collective and not dist.is_initialized():  # e.g. TrainConfig.validate's check
            unknown = sorted(set(settings) - _settings_of(self.state_class))
            if unknown:
                raise ValueError(f"hook {self.name!r} has no setting(s) {unknown}")
            return None
        if self.state_class is None:
            if settings:
                raise ValueError(f"hook {self.name!r} takes no settings; got {sorted(settings)}")
            return None
        return self.state_class(**dict(self.defaults, **settings))


def _settings_of(state_class) -> set:
    """The keyword arguments ``state_class`` (a class, or a function that builds one) takes,
    through the ``**settings`` a class hands on to the classes it derives from."""
    if not isinstance(state_class, type):
        parameters = inspect.signature(state_class).parameters.values()
        return {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    names = set()
    for klass in state_class.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return names - {"self"}


def _torch_hooks() -> Tuple[HookSpec, ...]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def powersgd_state(**settings):
        if "matrix_approximation_rank" in settings:  # torch's state does not check it
            check_int("matrix_approximation_rank", settings["matrix_approximation_rank"], 1)
        return powerSGD_hook.PowerSGDState(process_group=None, **settings)

    return (HookSpec("fp16", "torch fp16_compress_hook", default_hooks.fp16_compress_hook,
                     None, weighted=False),
            # PowerSGD's own default starts compressing at step 1,000: start after one dense step.
            HookSpec("powersgd", "torch powerSGD_hook", powerSGD_hook.powerSGD_hook,
                     powersgd_state, weighted=False, defaults=(("start_powerSGD_iter", 2),)))


def hand_back_hook(_, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Each bucket handed back as it is, nothing sent: the compute alone (a baseline for what
    a hook that hides all of its communication would cost; ranks do not stay in sync)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


HOOKS: Dict[str, HookSpec] = {spec.name: spec for spec in (
    HookSpec("dense", "dense allreduce", allreduce_hook, AllreduceState, weighted=True),
    HookSpec("none", "no communication (the compute alone; a baseline)", hand_back_hook, None,
             weighted=False),
    HookSpec("recipe", "hetero_comm.compress (the optimizer's recipe)", segment_sparse_hook,
             None, weighted=False, one_call=True),
    HookSpec("sparse", "segment_sparse_hook", segment_sparse_hook, SegmentSparseState, weighted=True),
    HookSpec("dct", "dct_quant_hook", dct_quant_hook, DCTQuantState, weighted=True),
    HookSpec("two_level", "two_level_hook", two_level_hook, TwoLevelState, weighted=True,
             collective=True),
    HookSpec("two_level_dense", "two_level_hook, dense between machines", two_level_hook,
             TwoLevelState.dense, weighted=True, collective=True),
    HookSpec("int4_qgz", "ZeRO++ qgZ scheme: int4 between machines (baseline from the paper)",
             int4_between_machines_hook, Int4BetweenMachinesState, weighted=True, collective=True),
    HookSpec("demo", "DeMo: each rank's top DCT components of its momentum, signum (baseline "
             "from the paper)", demo_hook, DeMoState, weighted=False, hands_sign=True),
    *_torch_hooks(),
)}
WEIGHTED_HOOKS = tuple(name for name, spec in HOOKS.items() if spec.weighted)


def make_hook(name: str, settings: Optional[dict] = None):
    """``(state, hook)`` for the hook called ``name``, its state built from ``settings``."""
    spec = HOOKS[check_choice("hook", name, HOOKS)]
    return spec.make_state(settings), spec.hook
