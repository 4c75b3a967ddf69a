"""Sizes and dtypes shared by every layer: the kernel specification (``reference``), the
public ops and the hooks. It imports nothing of hetero_comm, so any module may import it."""

from typing import NamedTuple, Optional

import torch

__all__ = ["GRADIENT_DTYPES", "QUANT_DTYPES", "MAX_BLOCK_SIZE", "num_segments", "dct_coeffs_shape", "Piece"]

# What a gradient (and a packed or unpacked value) may be; residuals are always float32.
GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Integer widths of quantized values, by bits.
QUANT_DTYPES = {8: torch.int8, 16: torch.int16, 32: torch.int32}
# Largest DCT block (a power of two): the kernels' scratch per block is sized by it.
MAX_BLOCK_SIZE = 1 << 16


def num_segments(numel: int, segment_size: int) -> int:
    """Number of segments (or blocks) of ``segment_size`` in ``numel`` elements, the last one
    possibly short: ``ceil(numel / segment_size)``."""
    return (numel + segment_size - 1) // segment_size


def dct_coeffs_shape(numel: int, block_size: int, keep: int, group: Optional[int] = None) -> tuple:
    """Shape of the DCT coefficients of ``numel`` values: plain ``[blocks, keep]``, or grouped
    ``[ceil(blocks / group), keep, group]`` (frequency ``k`` of ``group`` consecutive blocks
    side by side; the last group's padding blocks have zero coefficients)."""
    blocks = num_segments(numel, block_size)
    return (blocks, keep) if group is None else (num_segments(blocks, group), keep, group)


class Piece(NamedTuple):
    """One parameter at ``start`` in a flat layout, seen as ``rows x cols``, with the indices
    of the rows and columns that can have a nonzero gradient at this step (``None``: all):
    what :mod:`hetero_comm.nn`'s unit dropout reports and the hooks skip the rest of."""

    start: int
    rows: int
    cols: int
    kept_rows: Optional[torch.Tensor] = None
    kept_cols: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def kept_numel(self) -> int:
        rows = self.rows if self.kept_rows is None else self.kept_rows.numel()
        cols = self.cols if self.kept_cols is None else self.kept_cols.numel()
        return rows * cols
