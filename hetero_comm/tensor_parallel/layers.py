"""Linear layers split by neurons over the ranks of a process group, in shards sized by speed.

* :class:`ColumnParallelLinear`: each rank computes its share of the output features.
* :class:`RowParallelLinear`: each rank multiplies its share of the input features; the
  partial outputs are summed across ranks.
* :class:`TensorParallelMLP`: ``Linear -> activation -> Linear`` as column then row parallel;
  the forward cuts the batch into chunks so that chunk ``i``'s output allreduce runs while
  chunk ``i + 1`` computes, the backward's input-gradient allreduce runs while the weight
  gradients compute.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_int
from .shards import shard_range

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"]


def _check_sizes(sizes: Sequence[int], total: int, group, what: str) -> tuple:
    sizes = tuple(sizes)
    ranks = dist.get_world_size(group)
    if len(sizes) != ranks:
        raise ValueError(f"{what}: {len(sizes)} shard sizes for {ranks} ranks in the group; give "
                         "one per rank")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != total:
        raise ValueError(f"{what}: shard sizes {sizes} must be integers >= 1 that sum to the "
                         f"layer's {total} features")
    return sizes


def _check_linear(module, what: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{what} must be an nn.Linear; got {type(module).__name__}")
    return module


def _broadcast_from_first(tensors, group) -> None:
    """Give every rank the group's first rank's values (the layer is split from one copy)."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in tensors:
        dist.broadcast(tensor, source, group=group)


class _AllReduceGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over the group (the input every shard used)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        gradient = gradient.contiguous().clone()
        dist.all_reduce(gradient, group=ctx.group)
        return gradient, None


class _AllReduceOutput(torch.autograd.Function):
    """The partial outputs summed over the group; identity backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, gradient):
        return gradient, None


class _GatherFeatures(torch.autograd.Function):
    """Every rank's shard of the last dimension, concatenated (uneven: padded to the largest
    for gloo's all_gather); the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, shard, sizes, rank, group):
        ctx.range = shard_range(sizes, rank)
        padded = F.pad(shard, (0, max(sizes) - shard.shape[-1])).contiguous()
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([part[..., :size] for part, size in zip(gathered, sizes)], dim=-1)

    @staticmethod
    def backward(ctx, gradient):
        start, end = ctx.range
        return gradient[..., start:end], None, None, None


class _TensorParallelLayer(nn.Module):
    """What every split layer sets up: shard sizes checked against the ``features`` they split,
    the group's first rank's weights of ``originals`` broadcast (a collective), and
    :attr:`shard`, this rank's slice of the split features."""

    def __init__(self, sizes, features: int, group, originals: Sequence[nn.Module]) -> None:
        super().__init__()
        self.group = group
        self.sizes = _check_sizes(sizes, features, group, type(self).__name__)
        self.rank = dist.get_rank(group)
        self.shard = slice(*shard_range(self.sizes, self.rank))
        _broadcast_from_first([p.data for m in originals for p in m.parameters()], group)

    def extra_repr(self) -> str:
        return f"shards={self.sizes}, rank={self.rank}"


class ColumnParallelLinear(_TensorParallelLayer):
    """This rank's output features of ``linear`` (rows ``shard_range(sizes, rank)`` of its
    weight). Input: the whole input, the same on every rank. Output: this rank's features, or
    all of them with ``gather_output=True``.

    Args:
        linear: the layer to split; every rank passes its copy, and the group's first rank's
            values are used (broadcast at construction, a collective).
        sizes: output features per rank (:func:`~hetero_comm.tensor_parallel.shard_sizes`).
        group: the tensor-parallel process group (default: the world).
    """

    def __init__(self, linear: nn.Linear, sizes: Sequence[int], group=None, *,
                 gather_output: bool = False) -> None:
        linear = _check_linear(linear, "ColumnParallelLinear's layer")
        super().__init__(sizes, linear.out_features, group, [linear])
        self.gather_output = gather_output
        self.weight = nn.Parameter(linear.weight.detach()[self.shard].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[self.shard].clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output = F.linear(_AllReduceGradient.apply(inputs, self.group), self.weight, self.bias)
        if self.gather_output:
            output = _GatherFeatures.apply(output, self.sizes, self.rank, self.group)
        return output


class RowParallelLinear(_TensorParallelLayer):
    """``linear`` with its input features split over the ranks (columns
    ``shard_range(sizes, rank)`` of its weight); the partial outputs are summed across the group
    and the bias added once. Input: this rank's features (``input_is_split=True``, as a
    :class:`ColumnParallelLinear` gives them) or the whole input. Output: the whole output.
    """

    def __init__(self, linear: nn.Linear, sizes: Sequence[int], group=None, *,
                 input_is_split: bool = True) -> None:
        linear = _check_linear(linear, "RowParallelLinear's layer")
        super().__init__(sizes, linear.in_features, group, [linear])
        self.input_is_split = input_is_split
        self.weight = nn.Parameter(linear.weight.detach()[:, self.shard].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self.input_is_split:
            inputs = _AllReduceGradient.apply(inputs, self.group)[..., self.shard]
        output = _AllReduceOutput.apply(F.linear(inputs, self.weight), self.group)
        return output if self.bias is None else output + self.bias


class _ChunkedMLP(torch.autograd.Function):
    """``sum over ranks of act(x W1_r^T + b1_r) W2_r^T`` for rows ``x`` [N, d]. Forward: in
    chunks of rows, each chunk's output allreduce running while the next chunk computes.
    Backward: in one piece, the input gradient first so that its allreduce runs while the
    weight gradients (two thirds of the backward's work) compute; cutting it too would only add
    a latency per piece."""

    @staticmethod
    def forward(ctx, rows, weight1, bias1, weight2, activation, chunks, group):
        pre_activations, outputs, pending = [], [], []
        for part in torch.tensor_split(rows, chunks):
            pre = F.linear(part, weight1, bias1)  # as the whole layer would (autocast included)
            output = F.linear(activation(pre), weight2)
            pending.append(dist.all_reduce(output, group=group, async_op=True))
            pre_activations.append(pre)
            outputs.append(output)
        for work in pending:
            work.wait()
        ctx.save_for_backward(rows, weight1, weight2, *pre_activations)
        ctx.activation, ctx.group = activation, group
        ctx.has_bias1 = bias1 is not None
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, gradient):
        rows, weight1, weight2, *pre_activations = ctx.saved_tensors
        pre = pre_activations[0] if len(pre_activations) == 1 else torch.cat(pre_activations)
        with torch.enable_grad():
            pre = pre.detach().requires_grad_()
            hidden = ctx.activation(pre)
        pre_grad, = torch.autograd.grad(hidden, pre, gradient @ weight2)
        rows_grad = work = None
        if ctx.needs_input_grad[0]:  # first, so that its allreduce runs behind what follows
            rows_grad = pre_grad @ weight1  # this rank's part of the sum
            work = dist.all_reduce(rows_grad, group=ctx.group, async_op=True)
        weight2_grad = gradient.t() @ hidden.detach()
        weight1_grad = pre_grad.t() @ rows
        bias1_grad = pre_grad.sum(0) if ctx.has_bias1 else None
        if work is not None:
            work.wait()
        return rows_grad, weight1_grad, bias1_grad, weight2_grad, None, None, None


# Modules that draw random numbers in training: recomputed in the backward, they would draw anew.
RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout, nn.RReLU)


def _check_replayable(activation: nn.Module) -> None:
    """Raise ``ValueError`` for an activation the backward cannot recompute as the forward ran
    it: one that works in place (it overwrites the pre-activations kept for the backward) or
    one that draws random numbers (the backward would draw a new mask)."""
    for name, module in activation.named_modules():
        where = f"{module!r}" + (f" (at {name!r} in the activation)" if name else "")
        if getattr(module, "inplace", False):
            raise ValueError(f"the activation {where} works in place, which overwrites the "
                             f"pre-activations the backward recomputes it from: use inplace=False")
        if isinstance(module, RANDOM_MODULES):
            raise ValueError(f"the activation {where} draws random numbers, and the backward, "
                             f"which recomputes the activation, would draw new ones: put it "
                             f"outside the MLP block")


class TensorParallelMLP(_TensorParallelLayer):
    """``fc2(activation(fc1(x)))`` with the hidden neurons split over the group's ranks
    (``sizes``, e.g. by speed), the communication overlapped with the compute in ``chunks``.

    Each rank holds rows ``shard_range(sizes, rank)`` of ``fc1`` and the same columns of
    ``fc2``; ``fc2``'s bias is added once. Input and output: the whole tensor, the same on every
    rank. Per step: one allreduce of the output (forward), cut into ``chunks`` pieces along
    the rows so that the allreduce of one piece runs while the next piece computes, and one of
    the input's gradient (backward), which runs while the weight gradients compute.

    Args:
        fc1, activation, fc2: the MLP to split (``fc1.out_features == fc2.in_features``); the
            group's first rank's weights are used (a broadcast at construction).
        sizes: hidden neurons per rank; ``chunks``: pieces of the forward's allreduce (>= 1;
            see :func:`~hetero_comm.tensor_parallel.tune_chunks`).
    """

    def __init__(self, fc1: nn.Linear, activation: nn.Module, fc2: nn.Linear, sizes: Sequence[int],
                 group=None, *, chunks: int = 1) -> None:
        fc1, fc2 = _check_linear(fc1, "fc1"), _check_linear(fc2, "fc2")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 gives {fc1.out_features} features, fc2 takes {fc2.in_features}")
        if not isinstance(activation, nn.Module) or any(True for _ in activation.parameters()):
            raise TypeError(f"the activation must be a module without parameters; got {activation!r}")
        _check_replayable(activation)
        chunks = check_int("chunks", chunks, 1)  # before the collective in the base class
        super().__init__(sizes, fc1.out_features, group, [fc1, fc2])
        self.chunks, self.activation = chunks, activation
        self.fc1_weight = nn.Parameter(fc1.weight.detach()[self.shard].clone())
        self.fc1_bias = None if fc1.bias is None else nn.Parameter(fc1.bias.detach()[self.shard].clone())
        self.fc2_weight = nn.Parameter(fc2.weight.detach()[:, self.shard].clone())
        self.fc2_bias = None if fc2.bias is None else nn.Parameter(fc2.bias.detach().clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])
        chunks = max(1, min(self.chunks, rows.shape[0]))
        output = _ChunkedMLP.apply(rows, self.fc1_weight, self.fc1_bias, self.fc2_weight,
                                   self.activation, chunks, self.group)
        output = output.reshape(*inputs.shape[:-1], output.shape[-1])
        return output if self.fc2_bias is None else output + self.fc2_bias
