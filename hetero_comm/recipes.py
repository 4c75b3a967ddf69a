"""One call for compressed gradient sync: the recipe is chosen from the user's optimizer.

:func:`compress` takes a ``DistributedDataParallel`` model (or, with ``mesh=``, a model sharded
with FSDP2's ``fully_shard`` inside each machine) and the optimizer set up as for dense
training, and does what the recipes ask by hand: it builds a
:class:`~hetero_comm.hooks.SegmentSparseState` with the recipe for that optimizer (FSDP2: an
:class:`~hetero_comm.fsdp.FSDPSparseState` around one), registers its hook and fits the
optimizer (:meth:`~hetero_comm.hooks.HookState.prepare_optimizer`). The lower-level states
stay for anyone who wants other settings.
"""

import dataclasses
import warnings
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ._agreement import agree_across_ranks
from ._checks import check_float
from .fsdp import (FSDPSparseState, agree_over_mesh, check_mesh, check_sharded_model,
                   has_all_reduce_hook)
from .hooks import (DCT, AllreduceState, AutoDensity, MachineLayout, SegmentSparseState,
                    TwoLevelState, allreduce_hook, segment_sparse_hook, two_level_hook,
                    unwrap_optimizer)

__all__ = ["Recipe", "recipe_for", "compress", "density_for_ratio", "MIN_RATIO", "MAX_RATIO",
           "AUTO_RATIOS", "DENSITY_WARMUP_STEPS"]

# Both recipes send one int8 byte per selected value and one float32 importance per segment of
# 512 elements (a dense float32 gradient is 4 bytes per element).
SEGMENT_SIZE = 512
WIRE_BYTES_PER_VALUE = 1
DENSE_BYTES_PER_VALUE = 4
ADAMW_DENSITY = 0.10
SGD_DENSITY = 0.08
SGD_MIN_SEGMENTS_PER_BUCKET = 150
# The SGD recipe sends at least this share of the segments while the ranks' gradient is large
# (docs/design/one-call.md, "A higher density while the gradient is large"); flat DDP only.
SGD_LARGE_GRADIENT_DENSITY = 0.16
# After the one dense step, both recipes start near dense and reach their density
# geometrically over this many steps (DGC's warm-up; docs/design/one-call.md, "The density
# warm-up").
DENSITY_WARMUP_STEPS = 25
# ratio: 4x is every value on the int8 wire; 256x leaves about 0.8% of the segments.
MIN_RATIO, MAX_RATIO = 4.0, 256.0
# The recipes were measured at 29x to 37x; above this the call warns.
MEASURED_RATIO = 40.0
# ratio="auto": the compression the link asks for, between these (64x: about 5.5% of the
# segments, where the AdamW recipe still held at 2 ranks; 16x: about 24%).
AUTO_RATIOS = (16.0, 64.0)
# The SGD recipe sets the optimizer's momentum to 0 and Nesterov off (the hook applies them);
# what the user gave is kept in each parameter group under these keys, so it travels in
# optimizer.state_dict() and a resumed run's compress() finds it whichever it loads first.
USER_MOMENTUM_KEY = "hetero_comm_momentum"
USER_NESTEROV_KEY = "hetero_comm_nesterov"

_SUPPORTED = ("torch.optim.AdamW, torch.optim.Adam (no weight decay, or "
              "decoupled_weight_decay=True), torch.optim.SGD (with or without momentum, "
              "Nesterov or not; no dampening)")
_LOWER_LEVEL = ("for other optimizers build a hetero_comm.hooks.SegmentSparseState (output='sum') "
                "and register hetero_comm.hooks.segment_sparse_hook yourself")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What :func:`compress` sets up for an optimizer.

    Attributes:
        name: ``"adamw"`` (sign steps on DCT segments) or ``"sgd"`` (sparse sum, with momentum
            correction when the optimizer has momentum).
        settings: the keyword arguments of :class:`~hetero_comm.hooks.SegmentSparseState`.
    """

    name: str
    settings: dict

    @property
    def nominal_ratio(self) -> float:
        """Dense bytes over sent bytes for a bucket cut into segments of 512 (the dense
        warm-up step and smaller segments in small buckets lower what ``stats()`` reports)."""
        return _ratio(self.settings["density"])


def _ratio(density: float) -> float:
    sent = WIRE_BYTES_PER_VALUE * density + DENSE_BYTES_PER_VALUE / SEGMENT_SIZE
    return DENSE_BYTES_PER_VALUE / sent


def density_for_ratio(ratio: float) -> float:
    """The density at which a recipe sends ``1 / ratio`` of the dense bytes (segments of 512
    on the int8 wire); ``ratio`` in [:data:`MIN_RATIO`, :data:`MAX_RATIO`]."""
    check_float("ratio", ratio, MIN_RATIO, MAX_RATIO)
    return (DENSE_BYTES_PER_VALUE / ratio - DENSE_BYTES_PER_VALUE / SEGMENT_SIZE) / WIRE_BYTES_PER_VALUE


def recipe_for(optimizer, ratio: Optional[float] = None) -> Recipe:
    """The recipe for ``optimizer`` (a torch optimizer, or a framework wrapper holding one in
    ``.optimizer``).

    * AdamW, or Adam without coupled weight decay: DCT segments, the sign of the agreed sum,
      10% density (about 37x).
    * SGD with momentum ``m``: momentum correction with ``m`` (Nesterov's where the optimizer
      has ``nesterov=True``), 8% density, segments of 512 or smaller so that every bucket has
      150 (about 29-35x measured).
    * SGD without momentum: the same, without momentum correction.

    Both send the first step dense and then reach their density over
    :data:`DENSITY_WARMUP_STEPS` steps, falling geometrically from near 1.

    Args:
        optimizer: the optimizer, set up as for dense training.
        ratio: target compression of the gradient bytes in [4, 256]; ``None`` or ``"auto"``:
            the recipe's own density (``"auto"`` then varies it, see :func:`compress`).

    Raises:
        TypeError: an optimizer no recipe serves (the message lists the supported ones).
        ValueError: a ``ratio`` out of range, SGD groups with different momenta or mixing
            Nesterov and plain momentum, dampening, or Adam's coupled weight decay.
    """
    inner = unwrap_optimizer(optimizer)
    if isinstance(ratio, str) and ratio != "auto":
        raise ValueError(f"ratio must be a number in [{MIN_RATIO:g}, {MAX_RATIO:g}], 'auto' or None; "
                         f"got {ratio!r}")
    density = None if ratio is None or ratio == "auto" else density_for_ratio(ratio)
    if isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
        return Recipe("adamw", dict(density=ADAMW_DENSITY if density is None else density,
                                    segment_size=SEGMENT_SIZE, wire_dtype="int8", basis=DCT(),
                                    output="sign", density_warmup_steps=DENSITY_WARMUP_STEPS))
    if isinstance(inner, torch.optim.SGD):
        momenta = sorted({float(group.get(USER_MOMENTUM_KEY, group["momentum"]))
                          for group in inner.param_groups})
        if len(momenta) > 1:
            raise ValueError(f"the SGD recipe applies one momentum in the hook; the optimizer's "
                             f"parameter groups have {momenta}: give them one momentum")
        settings = dict(density=SGD_DENSITY if density is None else density,
                        segment_size=SEGMENT_SIZE, wire_dtype="int8",
                        min_segments_per_bucket=SGD_MIN_SEGMENTS_PER_BUCKET,
                        density_warmup_steps=DENSITY_WARMUP_STEPS)
        if ratio is None:
            settings["large_gradient_density"] = SGD_LARGE_GRADIENT_DENSITY
        if momenta[0]:
            settings["momentum"] = momenta[0]
            nesterov = {bool(group.get(USER_NESTEROV_KEY, group["nesterov"]))
                        for group in inner.param_groups}
            if len(nesterov) > 1:
                raise ValueError("the SGD recipe applies one kind of momentum in the hook; the "
                                 "optimizer's parameter groups mix nesterov=True and False: give "
                                 "them one")
            if nesterov == {True}:
                settings["nesterov"] = True
        return Recipe("sgd", settings)
    raise TypeError(f"hetero_comm.compress has no recipe for {type(inner).__name__}; supported: "
                    f"{_SUPPORTED}. {_LOWER_LEVEL}")


def compress(model: torch.nn.Module, optimizer, *,
             ratio: Union[None, float, str] = None, machines=None,
             process_group: Optional[dist.ProcessGroup] = None,
             mesh=None) -> Union[SegmentSparseState, AllreduceState, FSDPSparseState]:
    """Send a small fraction of the gradient bytes, with the recipe for ``optimizer``.

    Keep your dense optimizer, rate and schedule: the recipe sets what it needs and scales
    the rate inside each step only (AdamW: ``betas=(0, 0)``, 1.5x; SGD: momentum moved into
    the hook, about 2.1x; :func:`recipe_for`), with the weight decay scaled so that parameters
    decay as under dense training. With AdamW, let the rate decay towards the end:
    the recipe's sign step moves every coordinate by the full rate, and at a constant rate it
    falls behind dense (docs/design/recipes-adamw.md, "Where it holds less well"). The first
    step is sent dense, and the share of the segments sent falls from near 1 to the recipe's
    over the next :data:`DENSITY_WARMUP_STEPS` (25) steps (``stats()["density"]``). Call it on
    every rank before the first step. Nothing is registered or changed when it raises.

    A model too large for DDP: shard it with FSDP2 inside each machine and give the mesh
    (docs/fsdp.md)::

        mesh = init_device_mesh("cuda", (machines, ranks_per_machine),
                                mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = hetero_comm.compress(model, optimizer, mesh=mesh)

    FSDP reduce-scatters each parameter group's gradient inside the machine; the recipe then
    sums each shard across the machines (:class:`~hetero_comm.fsdp.FSDPSparseState`).

    Args:
        model: a ``DistributedDataParallel`` model without a communication hook, or with
            ``mesh`` the root ``fully_shard`` module, sharded on ``mesh["shard"]``.
        optimizer: its optimizer (or a framework wrapper holding one in ``.optimizer``); its
            parameters must be the model's.
        ratio: target compression of the gradient bytes, in [4, 256] (``None``: the
            recipe's own, about 37x for AdamW and 29-35x for SGD; ``stats()`` reports what
            was achieved), or ``"auto"``: chosen each step from the measured link and
            backward pass within :data:`AUTO_RATIOS`, so the exchange hides behind compute.
        machines: ``"auto"``, ranks per machine, or one label per rank: the two-level sync
            (dense inside each machine, the recipe between; docs/machines.md). ``None``:
            every rank alike (with ``ratio="auto"``: ``"auto"``). Where that layout is one
            machine, nothing crosses a link between machines: the call warns and sets up the
            dense allreduce, leaving the optimizer as it is.
        process_group: the group to reduce in (``None``: the DDP model's).
        mesh: for a model sharded with ``fully_shard``: a ``DeviceMesh`` with dimensions
            ``("replicate", "shard")`` (machines x ranks per machine); ``machines`` and
            ``process_group`` then stay ``None`` and ``ratio`` is a number or ``None``.

    Returns:
        The hook's :class:`~hetero_comm.hooks.SegmentSparseState` (two-level: a
        :class:`~hetero_comm.hooks.TwoLevelState`; one machine: an
        :class:`~hetero_comm.hooks.AllreduceState`; FSDP2: an
        :class:`~hetero_comm.fsdp.FSDPSparseState`): ``stats()``, ``state_dict()`` and
        ``load_state_dict()`` (call both on every rank; to resume, call ``compress`` on the
        new model and optimizer, then ``state.load_state_dict``; FSDP2: save and load it with
        ``torch.distributed.checkpoint``).

    Raises:
        TypeError: ``model`` is not DDP (with ``mesh``: not sharded with ``fully_shard``), or
            no recipe serves the optimizer.
        ValueError: the optimizer holds parameters that are not the model's, the model already
            has a communication hook, ``ratio`` or ``machines`` is bad, the optimizer has a
            setting the recipe cannot take over, or the ranks passed different settings (the
            optimizer's type, ``ratio``, ``machines``: compared across the ranks, and the error
            names each rank's).
        RuntimeError: not every rank called it within
            ``hetero_comm._agreement.SETUP_TIMEOUT_SECONDS`` (120 s).

    Example::

        >>> optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-4)
        >>> state = hetero_comm.compress(ddp_model, optimizer)  # or machines="auto"
    """
    inner = unwrap_optimizer(optimizer)
    if mesh is not None or isinstance(model, FSDPModule):
        return _compress_sharded(model, inner, ratio, machines, process_group, mesh)
    ddp_model = model
    _check_model(ddp_model, inner)
    recipe = recipe_for(inner, ratio)
    given_machines = machines if isinstance(machines, (int, str, type(None))) else list(machines)
    agree_across_ranks("hetero_comm.compress settings",
                       dict(optimizer=type(inner).__name__, ratio=ratio, machines=given_machines,
                            recipe=recipe.settings),
                       ddp_model.process_group if process_group is None else process_group)
    state, hook = _recipe_state(recipe, ratio, machines, process_group, ddp_model)
    state.handed_step().fit(inner)  # raises for a setting the recipe cannot take over, before any change
    compressing = not isinstance(state, AllreduceState)
    if compressing:
        _warn_where_unmeasured(ddp_model, recipe, ratio)
    ddp_model.register_comm_hook(state, hook)
    if compressing:
        _remember_user_momentum(inner, recipe)
    state.prepare_optimizer(inner)
    return state


def _compress_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ratio,
                      machines, process_group, mesh) -> FSDPSparseState:
    """:func:`compress` for a model sharded with ``fully_shard`` on ``mesh["shard"]``."""
    if isinstance(model, DistributedDataParallel):
        raise TypeError("mesh= is for a model sharded with fully_shard; a DistributedDataParallel "
                        "model takes no mesh (call compress(ddp_model, optimizer))")
    if mesh is None:
        raise ValueError(
            "this model is sharded with fully_shard: give compress the two-dimensional mesh "
            "(machines x ranks per machine) it was sharded inside, mesh=mesh, with the model "
            "sharded on mesh['shard']. FSDP over every rank on a one-dimensional mesh puts the "
            "link between machines inside its reduce-scatter, which hetero_comm does not "
            "compress (docs/fsdp.md)")
    if machines is not None or process_group is not None:
        raise ValueError("with mesh=, the mesh gives the machines (mesh['replicate']) and the "
                         "groups: pass no machines and no process_group")
    if ratio == "auto":
        raise ValueError("ratio='auto' is not offered with FSDP2 yet: give a number in "
                         f"[{MIN_RATIO:g}, {MAX_RATIO:g}] or None (the recipe's own)")
    check_mesh(mesh)
    check_sharded_model(model, mesh)
    _check_parameters_are_the_models(model, optimizer, "sharded")
    if getattr(model, _SHARDED_STATE_ATTRIBUTE, None) is not None:
        raise ValueError("compress was called on this model already (its FSDP groups have the "
                         "sparse exchange as their all-reduce hook): call it once per model")
    if has_all_reduce_hook(model):
        raise ValueError("this model's FSDP modules already have an all-reduce hook "
                         "(set_all_reduce_hook), which the sparse exchange would replace: "
                         "compress on a model without one")
    recipe = recipe_for(optimizer, ratio)
    settings = dict(optimizer=type(optimizer).__name__, ratio=ratio, recipe=recipe.settings,
                    mesh=list(mesh.shape))
    agree_over_mesh("hetero_comm.compress settings", settings, mesh)
    state = FSDPSparseState(model, mesh, **_without_flat_only(recipe.settings))
    if mesh["replicate"].size() == 1:
        warnings.warn(f"hetero_comm.compress(mesh=...): the mesh has one machine "
                      f"({mesh['shard'].size()} ranks sharding the model), so FSDP's reduce-scatter "
                      f"already sums every gradient and nothing crosses a link between machines: "
                      f"nothing is registered and the optimizer is left as it is (the returned "
                      f"state is not registered; its stats stay zero)", UserWarning, stacklevel=3)
        return state
    state.sparse.handed_step().fit(optimizer)  # raises before any change
    _warn_where_unmeasured(model, recipe, ratio)
    state.register(optimizer)
    setattr(model, _SHARDED_STATE_ATTRIBUTE, state)
    _remember_user_momentum(optimizer, recipe)
    state.sparse.prepare_optimizer(optimizer)
    return state


# the FSDPSparseState that compress registered on a sharded model (a second call raises)
_SHARDED_STATE_ATTRIBUTE = "_hetero_comm_sparse_state"


def _recipe_state(recipe: Recipe, ratio, machines, process_group, ddp_model):
    """The recipe's state and hook: flat, or two-level for machines or an automatic ratio, in
    ``process_group`` (``None``: the DDP model's)."""
    if process_group is None:
        process_group = ddp_model.process_group
    if machines is None and ratio != "auto":
        return SegmentSparseState(process_group=process_group, **recipe.settings), segment_sparse_hook
    # machines=None with ratio="auto": the layout is found; any other value is taken as given
    # (0, [] or "" raise, as they do for TwoLevelState).
    layout = MachineLayout.resolve("auto" if machines is None else machines, process_group)
    if layout.machines == 1:
        warnings.warn(f"hetero_comm.compress(machines={machines!r}, ratio={ratio!r}): all "
                      f"{layout.world_size} ranks are on one machine (machines='auto' reads the "
                      f"launcher's LOCAL_WORLD_SIZE, else the host names), so "
                      f"no gradient crosses a link between machines and there is nothing to "
                      f"compress: the dense allreduce is used and the optimizer is left as it is. "
                      f"To compress among these ranks anyway, give ratio a number and no machines "
                      f"(the flat recipe); to treat groups of them as machines, give machines the "
                      f"ranks per machine", UserWarning, stacklevel=3)
        return AllreduceState(process_group=process_group), allreduce_hook
    settings = _without_flat_only(recipe.settings)
    if ratio == "auto":
        high, low = AUTO_RATIOS
        settings.update(density=AutoDensity(floor=density_for_ratio(low),
                                            ceiling=density_for_ratio(high)))
    return (TwoLevelState(process_group=process_group, machines=list(layout.machine_of_rank),
                          **settings), two_level_hook)



def _without_flat_only(settings: dict) -> dict:
    """``settings`` without those only flat DDP offers (the two-level sync and FSDP2 leave the
    larger density while the gradient is large out)."""
    return {name: value for name, value in settings.items() if name != "large_gradient_density"}


def _remember_user_momentum(optimizer: torch.optim.Optimizer, recipe: Recipe) -> None:
    """The SGD recipe sets the momentum to 0 and Nesterov off: keep the user's in each group,
    for the :func:`recipe_for` of a resumed run."""
    if recipe.name == "sgd":
        for group in optimizer.param_groups:
            group.setdefault(USER_MOMENTUM_KEY, float(group["momentum"]))
            group.setdefault(USER_NESTEROV_KEY, bool(group["nesterov"]))


def _check_model(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
    """A DDP model without a hook, whose parameters are the optimizer's."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"compress needs a torch.nn.parallel.DistributedDataParallel model; got "
                        f"{type(ddp_model).__name__} (wrap it: DistributedDataParallel(model); a model too "
                        f"large for DDP: shard it with fully_shard and pass mesh=, docs/fsdp.md)")
    _check_parameters_are_the_models(ddp_model, optimizer)
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError("this DistributedDataParallel model already has a communication hook "
                         "(DDP takes one): call compress once per model, on a model without a hook")


def _check_parameters_are_the_models(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                     kind: str = "DDP") -> None:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    model_parameters = {id(p) for p in inner.parameters()}
    foreign = [(index, position) for index, group in enumerate(optimizer.param_groups)
               for position, p in enumerate(group["params"]) if id(p) not in model_parameters]
    if foreign:
        index, position = foreign[0]
        raise ValueError(f"the optimizer holds {len(foreign)} parameter(s) that are not the {kind} "
                         f"model's (first: parameter {position} of group {index}): create it "
                         f"from the model's parameters() (FSDP2: after fully_shard)")


def _warn_where_unmeasured(model: torch.nn.Module, recipe: Recipe,
                           ratio: Optional[float]) -> None:
    """Warn about the cases the recipes are known not to serve well."""
    if isinstance(ratio, (int, float)) and ratio > MEASURED_RATIO:
        warnings.warn(f"hetero_comm.compress(ratio={ratio}): the recipes were measured up to "
                      f"{MEASURED_RATIO:.0f}x; expect a larger gap to dense training beyond it",
                      UserWarning, stacklevel=3)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if recipe.name == "sgd" and _has_layers_the_sgd_recipe_failed_on(inner):
        warnings.warn("hetero_comm.compress: the SGD recipe fell behind dense training on a GRU "
                      "(5% above its loss) and on one seed of three of a ResNet with GroupNorm "
                      "(5.6 points), and on transformers in earlier measurements: with "
                      "normalization, attention or recurrent layers prefer AdamW, or compare "
                      "with a dense run (docs/design/recipes-sgd.md, 'Where the call warns')",
                      UserWarning, stacklevel=3)


def _has_layers_the_sgd_recipe_failed_on(module: torch.nn.Module) -> bool:
    nn = torch.nn
    layers = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
              nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm,
              nn.MultiheadAttention, nn.RNNBase)
    return any(isinstance(m, layers) or "attention" in type(m).__name__.lower()
               or type(m).__name__.lower().endswith("norm") for m in module.modules())
