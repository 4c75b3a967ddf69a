"""Run a :class:`~hetero_comm.pipeline.plan.PipelinePlan`: pipeline stages
inside each machine, data parallelism across machines, on ``torch.distributed.pipelining``.

The world is ``machines x num_stages`` ranks; rank ``machine * num_stages + stage`` holds
``plan.stages[stage]`` of that machine. Inside a machine the stages pass activations point to
point (the machine's *pipeline group*); the replicas of one stage across machines form its
*data-parallel group*, in which a ``DistributedDataParallel`` wrapper (and any DDP comm hook of
:mod:`hetero_comm.hooks`) averages the stage's gradients.

How ``torch.distributed.pipelining`` (2.13) treats the DDP-wrapped stage module, read from its
``stage.py`` and ``schedules.py`` and checked by ``tests/test_pipeline_executor.py``:

* every micro-batch's forward, and the backward of all but the last micro-batch, run under
  ``no_sync()``; the last micro-batch's backward arms the reducer by hand, so DDP reduces the
  gradient accumulated over all micro-batches once per step;
* after the last backward the schedule divides the (already averaged) gradients by the
  number of micro-batches (``scale_grads=True``), matching a loss that averages over its
  micro-batch;
* on its first step the stage infers the shapes of what it receives by running the DDP
  module once on the first micro-batch, outside ``no_sync()``: that arms DDP's reducer, so
  the first micro-batch's backward reduces too. Where every forward precedes the first
  backward (GPipe; 1F1B on a stage whose warm-up covers all micro-batches) DDP then records
  each parameter twice for its bucket rebuild and the second step fails with "rebuilt
  parameter indices size is not same as original model parameters size"; elsewhere the
  first step reduces twice (a comm hook runs twice). :meth:`PipelineRunner.step` therefore
  runs the schedule under ``no_sync()``, leaving the one reduction per step to the schedule.

Buffers (e.g. batch-norm statistics) are not synchronised across machines: the schedule runs
every forward under ``no_sync()``.
"""

import contextlib
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .._agreement import agree_across_ranks
from .._checks import check_int
from .._recompute import recompute_in_backward
from .plan import PipelinePlan, StagePlan

__all__ = ["PipelineGroups", "PipelineRunner", "build_pipeline"]

class PipelineGroups:
    """This rank's place in a ``machines x num_stages`` world and its two subgroups.

    Created collectively: every rank must construct it, in the same order relative to other
    ``new_group`` calls, because ``torch.distributed.new_group`` is collective over the world.

    Args:
        num_stages: pipeline stages per machine.
        machines: data-parallel replicas of the pipeline.

    Attributes:
        machine, stage: this rank's machine and stage (``rank = machine * num_stages + stage``).
        pipeline_group: the ``num_stages`` ranks of this machine, group rank = stage index.
        data_parallel_group: the ``machines`` replicas of this stage, group rank = machine.

    Raises:
        RuntimeError: no default process group is initialised; a rank did not construct it
            within :data:`hetero_comm._agreement.SETUP_TIMEOUT_SECONDS`.
        ValueError: the world size is not ``machines * num_stages``; ranks passed different
            ``num_stages`` or ``machines`` (on every rank, before any group is created).

    Example::

        >>> groups = PipelineGroups(num_stages=2, machines=2)  # on each of 4 ranks
        >>> groups.machine, groups.stage
        (1, 0)  # on rank 2
    """

    def __init__(self, num_stages: int, machines: int) -> None:
        self.num_stages = check_int("num_stages", num_stages, 1)
        self.machines = check_int("machines", machines, 1)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("PipelineGroups needs torch.distributed initialised "
                               "(dist.init_process_group) on every rank first")
        # before new_group, which would block on ranks that asked for other groups
        agree_across_ranks("PipelineGroups settings", dict(num_stages=num_stages, machines=machines))
        world_size = dist.get_world_size()
        if world_size != machines * num_stages:
            raise ValueError(f"a pipeline of {num_stages} stages on {machines} machines needs a "
                             f"world of {machines * num_stages} ranks; this world has {world_size}")
        self.machine, self.stage = divmod(dist.get_rank(), num_stages)
        # new_group is collective over the whole world: every rank creates every subgroup, in
        # the same order, and keeps the two it belongs to. Ranks are listed in ascending order,
        # so the group rank is the stage index (pipeline) or the machine index (data parallel).
        pipeline_groups = [dist.new_group([m * num_stages + s for s in range(num_stages)])
                           for m in range(machines)]
        data_parallel_groups = [dist.new_group([m * num_stages + s for m in range(machines)])
                                for s in range(num_stages)]
        self.pipeline_group = pipeline_groups[self.machine]
        self.data_parallel_group = data_parallel_groups[self.stage]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def __repr__(self) -> str:
        return (f"PipelineGroups(machine={self.machine}/{self.machines}, "
                f"stage={self.stage}/{self.num_stages})")


class _RecomputedSequential(nn.Sequential):
    """An ``nn.Sequential`` that keeps only its input from the forward and recomputes its
    activations in the backward (same parameter names as the plain one)."""

    def forward(self, input):  # noqa: A002 - the name nn.Sequential.forward uses
        # Non-reentrant: works when the input needs no gradient (stage 0) and with DDP's
        # reducer, whose hooks sit on the parameters of the original graph.
        return recompute_in_backward(self, super().forward, input)


class PipelineRunner:
    """One rank's part of a pipeline + data-parallel training step (built by
    :func:`build_pipeline`).

    After :meth:`step`, the gradients of :attr:`stage_module`'s parameters are those of the
    mean loss over the machine's batch (``loss_fn`` averaging over each micro-batch, the
    micro-batches of equal size), averaged across machines by DDP; with equal batches on every
    machine that is the gradient of the mean loss over the global batch, as single-process
    training of the whole model would give. Gradients accumulate over calls like ``backward()``:
    call ``optimizer.zero_grad()`` between steps.

    Attributes:
        module: the stage's module as trained: ``DistributedDataParallel`` when there is more
            than one machine (register comm hooks on it, with a hook state whose
            ``process_group`` is ``groups.data_parallel_group``), else :attr:`stage_module`.
        stage_module: the unwrapped ``nn.Sequential`` of this stage's layers.
        groups: the :class:`PipelineGroups`.
        plan: the :class:`~hetero_comm.pipeline.plan.PipelinePlan`.
    """

    def __init__(self, module: nn.Module, stage_module: nn.Sequential, groups: PipelineGroups,
                 plan: PipelinePlan, schedule) -> None:
        self.module = module
        self.stage_module = stage_module
        self.groups = groups
        self.plan = plan
        self._schedule = schedule
        self._micro_batch_shapes = {}  # "inputs"/"target" -> shape of the first step's

    def step(self, inputs: Optional[torch.Tensor] = None,
             target: Optional[torch.Tensor] = None) -> Optional[List[torch.Tensor]]:
        """Run one forward and backward of the machine's batch through the pipeline.

        Call it on every rank of the world at once. ``inputs`` and ``target`` are split along
        dim 0 into ``plan.micro_batches`` equal micro-batches; the micro-batch shape must stay
        the same from step to step (the stages size their receive buffers on the first step).

        Args:
            inputs: the machine's batch; needed on stage 0, ignored elsewhere.
            target: the machine's targets; needed on the last stage, ignored elsewhere.

        Returns:
            On the last stage the loss of each micro-batch (detached), else ``None``.

        Example::

            >>> optimizer.zero_grad()
            >>> losses = runner.step(x, y)  # a list on the last stage, None elsewhere
            >>> optimizer.step()
        """
        args = (self._checked("inputs", inputs),) if self.groups.is_first else ()
        target = self._checked("target", target) if self.groups.is_last else None
        losses: Optional[list] = [] if self.groups.is_last else None
        # The schedule decides when DDP reduces (the last micro-batch's backward); no_sync
        # keeps the shape-inference forward of the first step from arming the reducer as well
        # (see the module docstring: a second reduction, or a failed bucket rebuild).
        with self._no_sync():
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return None if losses is None else [loss.detach() for loss in losses]

    def _checked(self, name: str, tensor: Optional[torch.Tensor]) -> torch.Tensor:
        stage = "stage 0" if name == "inputs" else f"the last stage ({self.groups.stage})"
        if tensor is None:
            raise ValueError(f"step() on {stage} needs {name} (machine {self.groups.machine})")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise ValueError(f"{name} must be a tensor with a batch dimension; got {tensor!r}")
        micro_batches = self.plan.micro_batches
        if tensor.shape[0] % micro_batches:
            raise ValueError(f"{name} has a batch of {tensor.shape[0]}, not divisible into "
                             f"{micro_batches} equal micro-batches")
        shape = (tensor.shape[0] // micro_batches,) + tuple(tensor.shape[1:])
        first = self._micro_batch_shapes.setdefault(name, shape)
        if shape != first:
            raise ValueError(f"{name} micro-batches have shape {shape}; the pipeline was sized "
                             f"for {first} on its first step")
        return tensor

    def _no_sync(self):
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()


def build_pipeline(layers: Union[nn.Sequential, Sequence[nn.Module]], plan: PipelinePlan,
                   loss_fn, *, groups: Optional[PipelineGroups] = None,
                   device: Union[str, torch.device] = "cpu",
                   ddp_kwargs: Optional[dict] = None) -> PipelineRunner:
    """Build this rank's stage of ``plan`` and the schedule that runs it (call on every rank).

    The stage module is ``nn.Sequential(*layers[first_layer:last_layer])`` of this rank's
    stage, moved to ``device`` (the layers themselves, not copies), run under activation
    recomputation when the stage says ``recompute``, wrapped in ``DistributedDataParallel``
    on the stage's data-parallel group when there is more than one machine (DDP makes the
    replicas' parameters equal to machine 0's), and driven by ``ScheduleGPipe`` or
    ``Schedule1F1B`` with ``plan.micro_batches`` micro-batches.

    Args:
        layers: the whole model, ``plan.num_layers`` layers (the same on every rank).
        plan: the pipeline plan, the same on every rank.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, averaging over it (the
            schedule divides the gradients by the number of micro-batches).
        groups: the :class:`PipelineGroups` (``None``: created here, for ``world_size //
            plan.num_stages`` machines; collective).
        device: where this stage runs.
        ddp_kwargs: extra keyword arguments for ``DistributedDataParallel``.

    Returns:
        The :class:`PipelineRunner` of this rank.

    Raises:
        ValueError: ``layers`` does not have ``plan.num_layers`` layers; ``groups`` is for
            another number of stages; the world does not fit the plan; a "1f1b" plan has
            fewer micro-batches than stages (torch's ``Schedule1F1B``); the ranks passed
            different plans (stages, micro-batches, schedule), layers of other types or
            parameter shapes, or other groups (on every rank, before a layer is moved).
        RuntimeError: a rank did not call it within
            :data:`hetero_comm._agreement.SETUP_TIMEOUT_SECONDS`.

    Example::

        >>> plan = PipelinePlan((StagePlan("cpu", 0, 3), StagePlan("cpu", 3, 5)), micro_batches=4)
        >>> runner = build_pipeline(model, plan, nn.functional.mse_loss)  # 2 x 2 ranks
        >>> optimizer = torch.optim.SGD(runner.module.parameters(), lr=0.1)
        >>> losses = runner.step(x, y)  # the machine's batch; each stage takes what it needs
        >>> optimizer.step()
    """
    layers = list(layers)
    if dist.is_available() and dist.is_initialized():  # before anything blocks or moves
        agree_across_ranks("build_pipeline arguments", dict(
            plan=_plan_structure(plan), layers=_layer_signatures(layers),
            groups=None if groups is None else (groups.num_stages, groups.machines)))
    if len(layers) != plan.num_layers:
        raise ValueError(f"the plan covers {plan.num_layers} layers but the model has {len(layers)}")
    groups = _groups_for(plan, groups)
    device = torch.device(device)
    stage_module = module = _stage_module(layers, plan.stages[groups.stage]).to(device)
    if groups.machines > 1:
        module = DistributedDataParallel(stage_module, process_group=groups.data_parallel_group,
                                         **(ddp_kwargs or {}))
    schedule = _schedule_for(module, groups, plan, device, loss_fn)
    return PipelineRunner(module, stage_module, groups, plan, schedule)


def _plan_structure(plan: PipelinePlan) -> dict:
    """What of ``plan`` the ranks must share: the stages' layers, devices and recomputation,
    the micro-batches and the schedule (not the planner's predictions, which each rank may
    have estimated from its own measurements)."""
    return dict(stages=[(stage.device, stage.first_layer, stage.last_layer, stage.recompute)
                        for stage in plan.stages],
                micro_batches=plan.micro_batches, schedule=plan.schedule)


def _layer_signatures(layers: List[nn.Module]) -> list:
    """Each layer's type and its parameters' names, shapes and dtypes: the model every rank
    must pass (a stage sized for other shapes would wait for activations that never come)."""
    return [(type(layer).__name__, [(name, tuple(parameter.shape), str(parameter.dtype))
                                    for name, parameter in layer.named_parameters()])
            for layer in layers]


def _schedule_for(module: nn.Module, groups: PipelineGroups, plan: PipelinePlan,
                  device: torch.device, loss_fn):
    """torch's stage of ``module`` and the plan's schedule around it."""
    # Imported here: torch.distributed.pipelining loads torch._dynamo (about a second), which
    # users of the planner alone should not wait for.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # PipelineStage maps stage index i to group rank i (i % group size) and resolves peers
    # through the group, so the machine's pipeline group must list its stages in order.
    stage = PipelineStage(module, groups.stage, plan.num_stages, device,
                          group=groups.pipeline_group)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    # scale_grads: divide by the number of micro-batches, for a loss_fn that averages.
    return schedule_class(stage, plan.micro_batches, loss_fn=loss_fn, scale_grads=True)


def _stage_module(layers: List[nn.Module], stage_plan: StagePlan) -> nn.Sequential:
    chosen = layers[stage_plan.first_layer:stage_plan.last_layer]
    return (_RecomputedSequential if stage_plan.recompute else nn.Sequential)(*chosen)


def _groups_for(plan: PipelinePlan, groups: Optional[PipelineGroups]) -> PipelineGroups:
    """``groups`` checked against ``plan``, or new groups for the world (collective)."""
    if groups is not None:
        if groups.num_stages != plan.num_stages:
            raise ValueError(f"groups are for {groups.num_stages} stages; the plan has "
                             f"{plan.num_stages}")
        return groups
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_pipeline needs torch.distributed initialised "
                           "(dist.init_process_group) on every rank first")
    world_size = dist.get_world_size()
    if world_size % plan.num_stages:
        raise ValueError(f"a plan of {plan.num_stages} stages needs a world of a multiple of "
                         f"{plan.num_stages} ranks (machines x stages); this world has "
                         f"{world_size}")
    return PipelineGroups(plan.num_stages, world_size // plan.num_stages)
