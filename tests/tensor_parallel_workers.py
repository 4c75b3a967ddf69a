"""Rank functions for the tensor-parallel tests (:mod:`hetero_comm.tensor_parallel`), run on real
gloo ranks by :func:`lab.launch.run_ranks`: each rank runs the split model and the
whole model on the same batch, in the same process, and reports the largest differences."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from hetero_comm.hooks import AllreduceState, allreduce_hook
from hetero_comm.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelMLP,
                                         parallelize_mlps, shard_range, shard_sizes,
                                         tensor_data_groups)


def make_model(dtype, seed=0):
    """A model with two MLP blocks (hidden 13 and 9: uneven splits) between other layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Sequential(nn.Linear(10, 13), nn.GELU(), nn.Linear(13, 10)),
                         nn.Tanh(), nn.Sequential(nn.Linear(10, 9), nn.ReLU(), nn.Linear(9, 10)),
                         nn.Linear(10, 3)).to(dtype)


def make_batch(dtype, rows=7, step=0):
    generator = torch.Generator().manual_seed(10 + step)
    return (torch.randn(2, rows, 6, generator=generator, dtype=dtype),
            torch.randn(2, rows, 3, generator=generator, dtype=dtype))


def _sharded_reference(name, reference_grad, module: TensorParallelMLP):
    """The slice of the whole model's gradient that parameter ``name`` of ``module`` holds."""
    start, end = shard_range(module.sizes, module.rank)
    if name in ("fc1_weight", "fc1_bias"):
        return reference_grad[start:end]
    if name == "fc2_weight":
        return reference_grad[:, start:end]
    return reference_grad


def _compare(split_model, whole_model, inputs, targets, mlp_names):
    """Largest differences of the output and of every gradient (split vs whole)."""
    outputs = [model(inputs) for model in (split_model, whole_model)]
    for output in outputs:
        F.mse_loss(output, targets).backward()
    errors = {"output": (outputs[0] - outputs[1]).abs().max().item()}
    whole = dict(whole_model.named_parameters())
    for name, parameter in split_model.named_parameters():
        block = next((b for b in mlp_names if name.startswith(b + ".")), None)
        if block is None:
            errors[name] = (parameter.grad - whole[name].grad).abs().max().item()
            continue
        short = name[len(block) + 1:]
        original = {"fc1_weight": "0.weight", "fc1_bias": "0.bias", "fc2_weight": "2.weight",
                    "fc2_bias": "2.bias"}[short]
        expected = _sharded_reference(short, whole[f"{block}.{original}"].grad,
                                      split_model.get_submodule(block))
        errors[name] = (parameter.grad - expected).abs().max().item()
    return errors


def split_mlps_match_whole(rank, world_size, dtype, chunks, uneven):
    """parallelize_mlps on a model (speeds 1, 2, 3 ... when ``uneven``): output and gradients
    against the whole model."""
    whole = make_model(dtype)
    split = copy.deepcopy(whole)
    speeds = [float(r + 1) for r in range(world_size)] if uneven else None
    replaced = parallelize_mlps(split, speeds=speeds, chunks=chunks)
    inputs, targets = make_batch(dtype)
    errors = _compare(split, whole, inputs, targets, list(replaced))
    return dict(errors=errors, sizes={name: m.sizes for name, m in replaced.items()})


def single_layers_match_whole(rank, world_size, dtype):
    """ColumnParallelLinear (gathered) then RowParallelLinear (whole input), uneven shards."""
    torch.manual_seed(0)
    first, second = nn.Linear(5, 11).to(dtype), nn.Linear(11, 4).to(dtype)
    speeds = [float(r + 1) for r in range(world_size)]
    column = ColumnParallelLinear(first, shard_sizes(11, speeds), gather_output=True)
    row = RowParallelLinear(second, shard_sizes(11, speeds[::-1]), input_is_split=False)
    inputs = torch.randn(3, 5, dtype=dtype, generator=torch.Generator().manual_seed(3))
    split_inputs, whole_inputs = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    split_out = row(torch.tanh(column(split_inputs)))
    whole_out = second(torch.tanh(first(whole_inputs)))
    split_out.square().sum().backward()
    whole_out.square().sum().backward()
    column_range, row_range = shard_range(column.sizes, rank), shard_range(row.sizes, rank)
    errors = {
        "output": (split_out - whole_out).abs().max().item(),
        "input": (split_inputs.grad - whole_inputs.grad).abs().max().item(),
        "column.weight": (column.weight.grad - first.weight.grad[slice(*column_range)]).abs().max().item(),
        "column.bias": (column.bias.grad - first.bias.grad[slice(*column_range)]).abs().max().item(),
        "row.weight": (row.weight.grad - second.weight.grad[:, slice(*row_range)]).abs().max().item(),
        "row.bias": (row.bias.grad - second.bias.grad).abs().max().item(),
    }
    return dict(errors=errors)


def two_dimensional_matches_whole(rank, world_size, tensor_parallel_size, steps=2):
    """Tensor parallel inside each run of ranks, DDP (hetero_comm's allreduce hook) across runs:
    every data-parallel replica takes its rows of the global batch; after ``steps`` SGD steps
    the split parameters equal the whole model's trained on the global batch."""
    tensor_group, data_group = tensor_data_groups(tensor_parallel_size)
    replicas = world_size // tensor_parallel_size
    replica = rank // tensor_parallel_size
    whole = make_model(torch.float64)
    split = copy.deepcopy(whole)
    replaced = parallelize_mlps(split, tensor_group, speeds=[1.0, 2.0][:tensor_parallel_size], chunks=2)
    ddp = torch.nn.parallel.DistributedDataParallel(split, process_group=data_group)
    ddp.register_comm_hook(AllreduceState(process_group=data_group), allreduce_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, whole)]
    for step in range(steps):
        inputs, targets = make_batch(torch.float64, rows=4 * replicas, step=step)
        mine = slice(4 * replica, 4 * replica + 4)
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.mse_loss(ddp(inputs[:, mine]), targets[:, mine]).backward()
        F.mse_loss(whole(inputs), targets).backward()
        for optimizer in optimizers:
            optimizer.step()
    for model in (split, whole):
        model.zero_grad(set_to_none=True)
    errors = _compare(split, whole, *make_batch(torch.float64, rows=4, step=99), list(replaced))
    return dict(errors=errors)


def bad_input_messages(rank, world_size):
    """The error each kind of bad setup raises (type name and message), in a 2-rank group."""
    def message(action):
        try:
            action()
        except (TypeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    linear = nn.Linear(4, 6)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
    return {
        "sizes short": message(lambda: ColumnParallelLinear(linear, (3, 2))),
        "sizes per rank": message(lambda: RowParallelLinear(nn.Linear(6, 4), (6,))),
        "not linear": message(lambda: ColumnParallelLinear(nn.Conv1d(4, 6, 1), (3, 3))),
        "activation with parameters": message(
            lambda: TensorParallelMLP(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 4), (3, 3))),
        "mismatched mlp": message(
            lambda: TensorParallelMLP(nn.Linear(4, 6), nn.GELU(), nn.Linear(5, 4), (3, 3))),
        "in-place activation": message(
            lambda: TensorParallelMLP(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 4), (3, 3))),
        "random activation": message(lambda: TensorParallelMLP(
            nn.Linear(4, 6), nn.Sequential(nn.GELU(), nn.Dropout(0.1)), nn.Linear(6, 4), (3, 3))),
        # cases the issue did not name: another in-place activation, another random module
        "in-place hardtanh": message(
            lambda: TensorParallelMLP(nn.Linear(4, 6), nn.Hardtanh(inplace=True), nn.Linear(6, 4), (3, 3))),
        "randomized leaky relu": message(
            lambda: TensorParallelMLP(nn.Linear(4, 6), nn.RReLU(), nn.Linear(6, 4), (3, 3))),
        "not an mlp": message(lambda: parallelize_mlps(nn.Sequential(nn.Linear(2, 2)))),
        "named block not linear": message(lambda: parallelize_mlps(
            nn.Sequential(nn.Sequential(nn.Conv1d(4, 6, 1), nn.GELU(), nn.Linear(6, 4))), names=["0"])),
        "missing block": message(lambda: parallelize_mlps(mlp, names=["head"])),
        "the model is the block": message(lambda: parallelize_mlps(mlp)),
        "speeds per rank": message(lambda: parallelize_mlps(mlp, speeds=[1.0])),
        "groups do not divide": message(lambda: tensor_data_groups(3)),
    }


def tune_chunks_agrees(rank, world_size):
    """tune_chunks on a split model: the count every rank chose, what its blocks hold, whether
    the output after tuning is the output before, and the errors for bad candidates."""
    from hetero_comm.tensor_parallel import tune_chunks
    model = make_model(torch.float64)
    parallelize_mlps(model)
    inputs, _ = make_batch(torch.float64, rows=16)
    before = model(inputs).detach()
    chosen = tune_chunks(model, inputs, candidates=(1, 2, 4), repeats=2)
    chunks = {m.chunks for m in model.modules() if isinstance(m, TensorParallelMLP)}
    errors = []
    for bad in ((1, 0), ()):
        try:
            tune_chunks(model, inputs, candidates=bad)
        except ValueError as error:
            errors.append(str(error))
    try:
        tune_chunks(nn.Sequential(nn.Linear(6, 6)), inputs)
    except ValueError as error:
        errors.append(str(error))
    return chosen, chunks, torch.equal(model(inputs).detach(), before), errors


def speeds_disagree(rank, world_size):
    """Rank 1 passes other speeds: every rank raises naming the shard sizes, model unchanged."""
    from hetero_comm.tensor_parallel import parallelize_mlps

    model = make_model(torch.float32)
    before = copy.deepcopy(model.state_dict())
    speeds = [2.0, 1.0] if rank == 1 else [1.0, 1.0]
    try:
        parallelize_mlps(model, speeds=speeds)
    except ValueError as error:
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) \
            and set(before) == set(model.state_dict())
        return str(error), unchanged
    return "no error", False
