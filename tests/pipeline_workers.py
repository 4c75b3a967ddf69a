"""Rank functions for the pipeline executor tests (:mod:`hetero_comm.pipeline.executor`), run on
real gloo ranks by :func:`lab.launch.run_ranks`: each rank trains its stage of the
pipeline and compares it with single-process training of the whole model, in the same process."""

import numpy as np
import torch
import torch.nn as nn

from hetero_comm.hooks import AllreduceState, allreduce_hook
from hetero_comm.pipeline import PipelineGroups, PipelinePlan, StagePlan, build_pipeline

LOCAL_BATCH = 8  # rows per machine and step
LR = 0.1


def make_pipeline_model(seed: int = 0) -> nn.Sequential:
    """Five layers (three with parameters) of uneven sizes, in float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 7), nn.ReLU(),
                         nn.Linear(7, 3)).double()


def make_plan(schedule: str, micro_batches: int, recompute_stage=None) -> PipelinePlan:
    """Layers [0, 3) and [3, 5): two Linear layers on stage 0, one on stage 1 (uneven)."""
    ranges = ((0, 3), (3, 5))
    return PipelinePlan(tuple(StagePlan("cpu", first, last, recompute=index == recompute_stage)
                              for index, (first, last) in enumerate(ranges)),
                        micro_batches=micro_batches, schedule=schedule)


def global_batch(step: int, machines: int):
    """The step's inputs and targets of all machines; machine m takes rows [8m, 8m + 8)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = LOCAL_BATCH * machines
    return (torch.randn(rows, 6, generator=g, dtype=torch.float64),
            torch.randn(rows, 3, generator=g, dtype=torch.float64))


def train_pipeline(rank, world_size, num_stages, configs, steps=2):
    """Train every config of ``configs`` for ``steps`` SGD steps on this rank's stage, next to
    a single-process reference of the whole model on the global batch.

    A config: ``schedule``, ``micro_batches``, ``recompute_stage`` (or None), ``hook`` (register
    :func:`allreduce_hook` on the DDP module), ``other_init`` (machine 1 starts from other
    weights, which DDP must replace with machine 0's). Returns per config the largest
    difference to the reference of the gradients (per step), of the parameters after the last
    step and of the loss; the parameters; the first layer's forward calls in the last step;
    the hook state's steps."""
    groups = PipelineGroups(num_stages, world_size // num_stages)
    return [_train_one(groups, config, steps) for config in configs]


def _train_one(groups, config, steps):
    plan = make_plan(config["schedule"], config["micro_batches"], config.get("recompute_stage"))
    seed = 1 if config.get("other_init") and groups.machine == 1 else 0
    runner = build_pipeline(make_pipeline_model(seed), plan, nn.functional.mse_loss, groups=groups)
    state = None
    if config.get("hook"):
        state = AllreduceState(process_group=groups.data_parallel_group)
        runner.module.register_comm_hook(state, allreduce_hook)
    forward_calls = []
    runner.stage_module[0].register_forward_hook(lambda *_: forward_calls.append(1))
    optimizer = torch.optim.SGD(runner.module.parameters(), lr=LR)
    reference = make_pipeline_model(0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    stage = plan.stages[groups.stage]
    reference_stage = nn.Sequential(*list(reference)[stage.first_layer:stage.last_layer])
    grad_errors, loss_errors = [], []
    for step in range(steps):
        inputs, target = global_batch(step, groups.machines)
        rows = slice(LOCAL_BATCH * groups.machine, LOCAL_BATCH * (groups.machine + 1))
        forward_calls.clear()
        optimizer.zero_grad()
        losses = runner.step(inputs[rows] if groups.is_first else None,
                             target[rows] if groups.is_last else None)
        reference_optimizer.zero_grad()
        with torch.no_grad():  # the mean loss over this machine's rows, before the update
            machine_loss = nn.functional.mse_loss(reference(inputs[rows]), target[rows])
        nn.functional.mse_loss(reference(inputs), target).backward()
        grad_errors.append(_max_difference((p.grad for p in runner.stage_module.parameters()),
                                           (p.grad for p in reference_stage.parameters())))
        if losses is not None:
            loss_errors.append(abs(torch.stack(losses).mean().item() - machine_loss.item()))
        optimizer.step()
        reference_optimizer.step()
    return {"grad_errors": grad_errors, "loss_errors": loss_errors,
            "num_losses": None if losses is None else len(losses),
            "param_error": _max_difference(runner.stage_module.parameters(),
                                           reference_stage.parameters()),
            "params": _flat(runner.stage_module.parameters()),
            "forward_calls": len(forward_calls),
            "hook_steps": None if state is None else state.stats()["steps"],
            "is_ddp": runner.module is not runner.stage_module}


def _flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


def _max_difference(ours, theirs) -> float:
    return float(np.abs(_flat(ours) - _flat(theirs)).max())


def build_with_this_ranks_arguments(rank, world_size, variants):
    """Build a 2-stage pipeline (``PipelineGroups`` first when ``variants`` says "groups") with
    ``variants[rank]``: a plan's schedule and micro-batches, the model's seed and widths, or the
    groups' machines. Returns the error's type and message, and whether the model's parameters
    and devices are as before the call."""
    variant = variants[rank]
    model = make_pipeline_model()
    if variant.get("wider"):
        model[2] = nn.Linear(8, 9).double()
        model[4] = nn.Linear(9, 3).double()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    try:
        if "machines" in variant:
            PipelineGroups(num_stages=2 if world_size % 2 == 0 else 1, machines=variant["machines"])
        else:
            build_pipeline(model, make_plan(variant.get("schedule", "gpipe"), variant.get("micro_batches", 2)),
                           nn.functional.mse_loss)
        outcome = ("no error", "")
    except (ValueError, RuntimeError) as error:
        outcome = (type(error).__name__, str(error))
    unchanged = all(torch.equal(a, b) and b.device.type == "cpu"
                    for a, b in zip(before, model.parameters()))
    return outcome + (unchanged,)
