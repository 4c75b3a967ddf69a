"""Layers split by neurons over ranks of unequal speed (tensor parallel), with the
communication overlapped with the compute.

1. Speeds: :func:`measure_speeds` (or the batch controller's), then :func:`shard_sizes`.
2. Split: :func:`parallelize_mlps` replaces a model's ``Linear -> activation -> Linear`` blocks by
   :class:`TensorParallelMLP` in place; :class:`ColumnParallelLinear` and
   :class:`RowParallelLinear` split single layers.
3. Overlap: :func:`tune_chunks` measures the chunk count at which the forward's allreduce hides best
   (the backward's hides behind the weight gradients).
4. 2-D: :func:`tensor_data_groups` gives the tensor-parallel and data-parallel groups; wrap the
   model in DDP over the data group (any hetero_comm hook).
"""

from .apply import find_mlps, measure_speeds, parallelize_mlps, tune_chunks
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .shards import shard_range, shard_sizes, tensor_data_groups

__all__ = ["shard_sizes", "shard_range", "tensor_data_groups", "ColumnParallelLinear",
           "RowParallelLinear", "TensorParallelMLP", "find_mlps", "parallelize_mlps", "tune_chunks",
           "measure_speeds"]
