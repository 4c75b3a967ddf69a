"""The sparse exchange between machines for a model sharded with FSDP2 inside each machine.

Each FSDP parameter group (one ``fully_shard`` call) hands its gradient shard to an all-reduce
hook right after its reduce-scatter among the ranks of one machine. :class:`FSDPSparseState`
registers that hook: it sums the shard across the machines holding the same shard with the
sparse hook's steps (error feedback, the selection agreed among those ranks, the int8 wire),
so each rank keeps the residual of its own shard only. :func:`hetero_comm.compress` with
``mesh=`` builds it with the recipe for the optimizer.
"""

import math
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from ._agreement import agree_across_ranks
from .hooks import SegmentSparseState
from .hooks._non_finite import NonFiniteGradient
from .hooks._plan import PlanBucket
from .hooks.segment_sparse import sparse_allreduce

__all__ = ["FSDPSparseState", "MESH_DIMS", "sharded_modules", "check_sharded_model", "has_all_reduce_hook",
           "agree_over_mesh"]

# The mesh's dimensions: machines (the sparse exchange) x ranks per machine (FSDP's shards).
MESH_DIMS = ("replicate", "shard")

_HOW_TO_SHARD = ('mesh = init_device_mesh(device, (machines, ranks_per_machine), '
                 'mesh_dim_names=("replicate", "shard")); fully_shard(block, mesh=mesh["shard"]) '
                 'for each block and fully_shard(model, mesh=mesh["shard"]); then '
                 'hetero_comm.compress(model, optimizer, mesh=mesh)')


def check_mesh(mesh) -> DeviceMesh:
    """``mesh`` if it is a two-dimensional ``DeviceMesh`` named :data:`MESH_DIMS`; else
    ``ValueError`` (``TypeError`` for another type) showing how to make one."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh; got "
                        f"{type(mesh).__name__}. {_HOW_TO_SHARD}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"mesh must have the two dimensions {MESH_DIMS} (machines x ranks per "
                         f"machine); got {mesh.ndim} dimension(s) named {mesh.mesh_dim_names}. "
                         f"{_HOW_TO_SHARD}")
    return mesh


def agree_over_mesh(setting: str, value, mesh: DeviceMesh) -> None:
    """:func:`~hetero_comm._agreement.agree_across_ranks` over every rank of ``mesh``: in one
    comparison where the mesh is the whole world (the usual case), else through its two
    dimensions' groups in turn."""
    if mesh.size() == dist.get_world_size():
        agree_across_ranks(setting, value, None)
        return
    for dimension in mesh.mesh_dim_names:
        agree_across_ranks(f"{setting} (mesh['{dimension}'])", value, mesh[dimension].get_group())


def sharded_modules(model: torch.nn.Module) -> List[tuple]:
    """``(name, modules, parameters)`` for every FSDP parameter group of ``model`` (one
    ``fully_shard`` call: the modules it was given, in ``named_modules`` order), with the
    parameters the group manages in FSDP's order (those below its modules that no nested
    ``fully_shard`` claims, each once; frozen ones too). Parameters FSDP was told to ignore stay
    plain tensors and are left out: FSDP does not reduce them."""
    fsdp_names = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, FSDPModule)]
    claimed, managed = set(), {}
    for name, module in reversed(fsdp_names):  # innermost first: they claim their own first
        managed[name] = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in managed[name])
    groups: Dict[int, tuple] = {}  # the FSDP state's id -> (name, modules, parameters)
    for name, module in fsdp_names:
        key = id(module._get_fsdp_state())  # fully_shard([a, b]): one state, one group
        entry = groups.setdefault(key, (name, [], []))
        entry[1].append(module)
        entry[2].extend(p for p in managed[name] if isinstance(p, DTensor))
    return list(groups.values())


def check_sharded_model(model: torch.nn.Module, mesh: DeviceMesh) -> List[tuple]:
    """:func:`sharded_modules` of ``model`` after checking it was sharded with ``fully_shard``
    on ``mesh["shard"]``, every trainable parameter of it; ``TypeError`` / ``ValueError``
    naming what is not."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"compress(model, optimizer, mesh=...) needs a model sharded with "
                        f"torch.distributed.fsdp.fully_shard (its root too); got "
                        f"{type(model).__name__}. {_HOW_TO_SHARD}")
    shard_group = mesh["shard"].get_group()
    modules = sharded_modules(model)
    for name, _modules, parameters in modules:
        meshes = {_mesh_key(p.device_mesh) for p in parameters}
        if len(meshes) > 1:
            raise ValueError(f"{_module_name(name)} shards its parameters "
                             f"on {len(meshes)} meshes (a per-parameter mesh): the sparse "
                             f"exchange needs one mesh per module, mesh['shard']")
        for parameter in parameters:
            parameter_mesh = parameter.device_mesh
            if parameter_mesh.ndim == 2:
                raise ValueError(
                    f"{_module_name(name)} is sharded on a two-dimensional mesh: native HSDP "
                    f"(fully_shard given the 2-D mesh), whose own all-reduce between machines "
                    f"would send every value, or FSDP with tensor parallelism, which the exchange "
                    f"does not serve. For HSDP, shard inside each machine only: "
                    f"fully_shard(module, mesh=mesh['shard']) instead of fully_shard(module, "
                    f"mesh=mesh), for every module; hetero_comm then sums between machines")
            if parameter_mesh.get_group() is not shard_group:
                raise ValueError(f"{_module_name(name)} is sharded on the ranks "
                                 f"{parameter_mesh.mesh.tolist()} (process group "
                                 f"{parameter_mesh.get_group().group_name}), but the mesh given to "
                                 f"compress has mesh['shard'] = {mesh['shard'].mesh.tolist()} (group "
                                 f"{shard_group.group_name}): shard every module on mesh['shard'] "
                                 f"of the mesh given to compress")
    if not any(p.requires_grad for _, _, parameters in modules for p in parameters):
        raise ValueError("the model has no trainable parameter sharded with fully_shard")
    return modules


def _param_groups_of(module: FSDPModule) -> list:
    """The FSDP parameter groups of ``module``'s state (torch 2.13 keeps a list; torch 2.11 one
    group or ``None``)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def has_all_reduce_hook(model: torch.nn.Module) -> bool:
    """Whether an FSDP parameter group of ``model`` already has an all-reduce hook."""
    return any(getattr(group, "_all_reduce_hook", None) is not None
               for module in model.modules() if isinstance(module, FSDPModule)
               for group in _param_groups_of(module))


def _mesh_key(mesh: DeviceMesh) -> tuple:
    """A mesh's ranks and the process groups of its dimensions (equal meshes may be distinct
    objects)."""
    return (tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim)))


def _module_name(name: str) -> str:
    return f"the module {name!r}" if name else "the model's root"


def padded_shard_numel(parameter: DTensor, shards: int) -> int:
    """Elements of ``parameter``'s gradient in its FSDP group's flat reduce-scatter output:
    FSDP pads the sharded dimension to a multiple of ``shards`` (dimension 0; others must divide
    evenly; FSDP refuses scalar parameters)."""
    size = parameter.size()
    dim = parameter.placements[0].dim if isinstance(parameter.placements[0], Shard) else 0
    rows = math.ceil(size[dim] / shards) if dim == 0 else size[dim] // shards
    return rows * (math.prod(size) // size[dim])


class _ShardGroup:
    """One FSDP parameter group: its name, its parameters, and the error-feedback state of its
    flat shard (a :class:`~hetero_comm.hooks._plan.PlanBucket` of one piece), laid out like
    FSDP's reduce-scatter output: each trainable parameter's padded shard, in order."""

    def __init__(self, name: str, index: int, parameters, shards: int, tensor_names,
                 device) -> None:
        self.name, self.index, self.parameters, self.shards = name, index, parameters, shards
        self.tensor_names, self.device = tensor_names, device
        self.layout: tuple = ()
        self.offsets: Dict[int, tuple] = {}
        self.numel = 0
        self.plan_bucket = PlanBucket((name,), (0,))
        self.lay_out(self.current_layout())

    def current_layout(self) -> tuple:
        """``(id, padded shard values)`` of each parameter FSDP reduces now (those that
        require a gradient; with ``set_reduce_scatter_unused_params`` also those without one
        this step)."""
        return tuple((id(p), padded_shard_numel(p, self.shards))
                     for p in self.parameters if p.requires_grad)

    def lay_out(self, layout: tuple) -> None:
        """Lay the error-feedback state out as ``layout``: each parameter kept keeps its
        values, a parameter new to it starts at zero (one frozen or unfrozen since)."""
        offsets, start = {}, 0
        for key, numel in layout:
            offsets[key] = (start, numel)
            start += numel
        bucket = PlanBucket((self.name,), (start,))
        for tensor_name in self.tensor_names:
            tensor = torch.zeros(start, device=self.device)
            old = self.plan_bucket.tensors.get(tensor_name)
            for key, (begin, numel) in offsets.items():
                if old is not None and key in self.offsets:
                    old_begin, _ = self.offsets[key]
                    tensor[begin:begin + numel].copy_(old[old_begin:old_begin + numel])
            bucket.tensors[tensor_name] = tensor
        self.layout, self.offsets, self.numel, self.plan_bucket = layout, offsets, start, bucket


class FSDPSparseState:
    """The sparse exchange between machines for a model sharded with ``fully_shard`` on
    ``mesh["shard"]``: every FSDP parameter group's gradient shard is summed across
    ``mesh["replicate"]`` (the ranks holding the same shard on the other machines) by the
    sparse hook's steps, with this rank's residual of its own shard.

    Args:
        model: the root ``fully_shard`` module.
        mesh: a ``DeviceMesh`` with dimensions :data:`MESH_DIMS`.
        **settings: the keyword arguments of :class:`~hetero_comm.hooks.SegmentSparseState`
            (not ``process_group``: the mesh gives it); the recipes' are
            :func:`hetero_comm.recipe_for`'s.

    A step is counted at each ``optimizer.step()`` after a backward pass that synchronised
    gradients (:meth:`register`): the dense warm-up and the density's schedule follow optimizer
    steps, and steps between syncs (``set_requires_gradient_sync(False)``) send nothing.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, **settings) -> None:
        if "process_group" in settings:
            raise ValueError("FSDPSparseState takes its group from the mesh (mesh['replicate']); "
                             "pass no process_group")
        self.mesh = check_mesh(mesh)
        modules = check_sharded_model(model, mesh)
        if settings.get("scale_sign_step"):
            raise ValueError("scale_sign_step is not offered with FSDP2 yet (the step scale "
                             "reads each DDP bucket's gradient): leave it False")
        if settings.get("large_gradient_density"):
            raise ValueError("large_gradient_density is not offered with FSDP2 yet (the watch "
                             "reads each DDP bucket's gradient): leave it 0")
        self.sparse = SegmentSparseState(process_group=mesh["replicate"].get_group(), **settings)
        shards = mesh["shard"].size()
        device = next(p for _, _, parameters in modules for p in parameters).to_local().device
        names = self.sparse.plan.tensor_names
        self.groups: Dict[str, _ShardGroup] = {}
        self._modules = []  # (group name, the first of its modules): where its hook is set
        for name, group_modules, parameters in modules:
            if parameters:  # (frozen ones too: unfrozen later, they are reduced)
                self.groups[name] = _ShardGroup(name, len(self.groups), parameters, shards,
                                                names, device)
                self._modules.append((name, group_modules[0]))
        self._synced_since_step = False
        self._warned_layouts: set = set()
        self._registered = False

    # ------------------------------------------------------------------ registering
    def register(self, optimizer: torch.optim.Optimizer) -> None:
        """Set every FSDP parameter group's all-reduce hook to this state's exchange and count
        a step after each ``optimizer.step()`` that follows a synchronised backward pass. Call
        it on every rank: it first compares the settings and the groups' shard sizes across the
        mesh (``ValueError`` on every rank where they differ)."""
        if self._registered:
            raise ValueError("this FSDPSparseState is registered already")
        shared = {name: value for name, value in self.settings().items() if name != "rank_weight"}
        agree_over_mesh("FSDPSparseState settings", dict(shared, mesh=list(self.mesh.shape),
                                                         groups={name: group.numel for name, group
                                                                 in self.groups.items()}), self.mesh)
        for name, module in self._modules:
            module.set_all_reduce_hook(self._hook_for(self.groups[name]))
            # Every rank's shard in one layout, whatever its batch used: a parameter without a
            # gradient this step is reduced as zeros (FSDP's option for conditional control
            # flow), so the ranks holding a shard always agree on the exchange's layout.
            if hasattr(module, "set_reduce_scatter_unused_params"):  # torch >= 2.12
                module.set_reduce_scatter_unused_params(True, recurse=False)
        optimizer.register_step_post_hook(self._end_step)
        self._registered = True

    def _hook_for(self, group: _ShardGroup):
        def all_reduce_hook(reduce_output: torch.Tensor) -> None:
            self.reduce(group, reduce_output)
        return all_reduce_hook

    # ------------------------------------------------------------------------ running
    def reduce(self, group: _ShardGroup, shard_grad: torch.Tensor) -> None:
        """Replace ``shard_grad`` (``group``'s reduce-scatter output on this rank) by its
        weighted sum across ``mesh["replicate"]``: dense during the warm-up, for a shard of a
        dtype the codec does not take or of another layout than the group's, else the sparse
        exchange."""
        state = self.sparse
        self._synced_since_step = True
        state.non_finite.collect_device_findings()  # CUDA: a shard handed on holding NaN earlier
        state.callbacks.settle()
        layout = group.current_layout()
        if layout != group.layout:  # a parameter frozen or unfrozen since: its state moves
            group.lay_out(layout)
        compressing = state.step >= state.warmup_steps
        layout_known = shard_grad.numel() == group.numel and shard_grad.dim() == 1
        if compressing and not (layout_known and state.accepts(shard_grad.dtype)):
            self._warn_dense(group, shard_grad)
            state.statistics.count("dense_fallbacks")
            compressing = False
        if not compressing or shard_grad.numel() < state.min_compress_numel:
            state.send_dense(shard_grad, compressing).wait()
            return
        group.plan_bucket.to(shard_grad.device)  # (CPU offloading: the gradient's device)
        try:
            sparse_allreduce(state, group.plan_bucket, shard_grad, group.index).wait()
        except NonFiniteGradient as found:  # every rank of the replicate group found it
            state.non_finite.hand_on(shard_grad, found)
        state.non_finite.warn_once()

    def _warn_dense(self, group: _ShardGroup, shard_grad: torch.Tensor) -> None:
        if group.name in self._warned_layouts:
            return
        self._warned_layouts.add(group.name)
        if not self.sparse.accepts(shard_grad.dtype):
            why = (f"its gradient is {shard_grad.dtype}; the exchange compresses float32, "
                   f"bfloat16 and float16 (MixedPrecisionPolicy(reduce_dtype=torch.float32))")
        else:
            cause = ("was set_reduce_scatter_unused_params turned off since compress?"
                     if hasattr(FSDPModule, "set_reduce_scatter_unused_params") else
                     f"torch {torch.__version__} leaves a parameter without a gradient out of the "
                     f"reduce-scatter; ranks whose batches used other parameters then disagree: "
                     f"torch 2.12 or later reduces it as zeros")
            why = (f"its reduce-scatter output has {shard_grad.numel()} elements where its "
                   f"trainable parameters' padded shards make {group.numel} ({cause})")
        warnings.warn(f"hetero_comm FSDP exchange: the parameter group {group.name or '(root)'!r} "
                      f"is sent dense (a plain average, without the recipe's momentum "
                      f"correction, while the optimizer steps as the recipe set it): {why}. "
                      f"stats()['dense_fallbacks'] counts such sends; this warning is given once "
                      f"per group", UserWarning, stacklevel=4)

    def _end_step(self, optimizer, args, kwargs) -> None:
        """After ``optimizer.step()``: a step ends if gradients were synchronised since the last."""
        if self._synced_since_step:
            self._synced_since_step = False
            self.sparse.step += 1
            self._warn_costly_groups(self.sparse.take_costly_buckets())

    def _warn_costly_groups(self, costly: dict) -> None:
        """Warn (once) about parameter groups whose shard sent at least its dense bytes."""
        if costly:
            names = {group.index: group.name or "(root)" for group in self.groups.values()}
            listed = ", ".join(f"{names[index]!r} ({numel} values)"
                               for index, numel in sorted(costly.items())[:5])
            warnings.warn(f"hetero_comm FSDP exchange: the parameter group(s) {listed} sent at "
                          f"least the bytes a dense all-reduce of their shard would (a shard this "
                          f"small spends on the importance, 4 bytes a segment, what the selection "
                          f"saves): shard fewer, larger modules, or send such groups dense "
                          f"(min_compress_numel={max(costly.values()) + 1})",
                          UserWarning, stacklevel=3)

    # -------------------------------------------------------------- what users read
    @property
    def step(self) -> int:
        """Steps completed (optimizer steps after a synchronised backward pass)."""
        return self.sparse.step

    def settings(self) -> dict:
        """The exchange's settings, as :class:`~hetero_comm.hooks.SegmentSparseState` takes them
        (its ``process_group`` is ``mesh["replicate"]``)."""
        return self.sparse.settings()

    def stats(self) -> dict:
        """:meth:`~hetero_comm.hooks.SegmentSparseState.stats`: this rank's bytes between
        machines (each FSDP parameter group's shard, after the reduce-scatter inside the
        machine), the compression ratio, the steps."""
        return self.sparse.stats()

    def residual_numel(self) -> int:
        """Float32 elements of error-feedback state this rank keeps (its shards' residual,
        and with momentum correction their velocity)."""
        return sum(tensor.numel() for group in self.groups.values()
                   for tensor in group.plan_bucket.tensors.values())

    # ---------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The step, counters, settings and every rank's error-feedback state (copies), as
        DTensors sharded over the whole mesh (each rank holds its own shard's), so that
        ``torch.distributed.checkpoint`` saves every rank's part; this object is ``Stateful``,
        so it can be put in the dict given to ``dcp.save`` / ``dcp.load`` as it is."""
        placements = [Shard(0)] * self.mesh.ndim
        tensors = {f"{tensor_name}/{group.name}": DTensor.from_local(  # copies: DCP loads into
                       tensor.clone(), device_mesh=self.mesh, placements=placements,  # them, and
                       run_check=False)  # load_state_dict checks before it copies them in
                   for group in self.groups.values()
                   for tensor_name, tensor in group.plan_bucket.tensors.items()}
        return {"type": type(self).__name__, "settings": self._checkpoint_settings(),
                "mesh_shape": list(self.mesh.shape), "step": self.sparse.step,
                "stats": dict(self.sparse.statistics.counters), "tensors": tensors}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved, on a mesh of the same shape (each rank's
        residual belongs to its place in the mesh)."""
        if state_dict.get("type") != type(self).__name__:
            raise ValueError(f"state_dict was saved by {state_dict.get('type')!r}, not "
                             f"{type(self).__name__!r}")
        if list(state_dict["mesh_shape"]) != list(self.mesh.shape):
            raise ValueError(f"state_dict was saved on a mesh of shape "
                             f"{tuple(state_dict['mesh_shape'])}; this one is "
                             f"{tuple(self.mesh.shape)}: the error feedback of each rank's shard "
                             f"cannot be moved to another layout (leave this entry out of the "
                             f"checkpoint to start it afresh)")
        settings = self._checkpoint_settings()
        for name, value in state_dict["settings"].items():
            if settings.get(name) != value:
                raise ValueError(f"state_dict was saved with {name}={value!r}; this state has "
                                 f"{name}={settings.get(name)!r}")
        mine = {f"{tensor_name}/{group.name}": tensor for group in self.groups.values()
                for tensor_name, tensor in group.plan_bucket.tensors.items()}
        if set(state_dict["tensors"]) != set(mine):
            raise ValueError(f"state_dict holds error feedback for {sorted(state_dict['tensors'])}; "
                             f"this model's parameter groups need {sorted(mine)}")
        for key, value in state_dict["tensors"].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.shape != mine[key].shape:
                raise ValueError(f"state_dict's {key} has shape {tuple(local.shape)}; this rank "
                                 f"keeps {tuple(mine[key].shape)}")
        for key, value in state_dict["tensors"].items():
            mine[key].copy_(value.to_local() if isinstance(value, DTensor) else value)
        self.sparse.step = int(state_dict["step"])
        self.sparse.statistics.counters.update(state_dict["stats"])

    def _checkpoint_settings(self) -> dict:
        state = self.sparse
        return {name: getattr(state, name) for name in state._checkpoint_settings}
