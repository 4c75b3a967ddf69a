"""Segments of DCT coefficients for the sparse hook (``basis="dct"``).

A segment of the plain hook is a run of consecutive gradient elements: the selection
delivers those elements and nothing to the rest, which wait (sometimes many steps) for their
turn. Here the gradient is cut into blocks of ``block_size`` elements, each block goes through
an orthonormal DCT-II, and a segment is ONE frequency of ``group`` consecutive blocks. Sending
a segment touches every element of those blocks, so a sparse selection still moves almost
every coordinate at every step. The transform is orthonormal, so norms (the importance) and
error feedback carry over unchanged.

Layout of the coefficient vector: ``[groups, block_size, group]`` (group, frequency, block),
flattened; segment ``s = g * block_size + f`` holds frequency ``f`` of the blocks of group
``g``. Blocks past the end (the last group's padding) are zero.
"""

import torch

from .. import ops
from .._layout import num_segments

__all__ = ["DctBasis"]


class DctBasis:
    """Maps a flat gradient of ``numel`` elements to interleaved DCT coefficients and back."""

    def __init__(self, numel: int, block_size: int, group: int) -> None:
        self.numel, self.block_size, self.group = numel, block_size, group
        self.blocks = num_segments(numel, block_size)
        self.groups = num_segments(self.blocks, group)
        self.coefficients = self.groups * block_size * group  # padded to whole groups

    def _by_block(self, scratch: torch.Tensor) -> torch.Tensor:
        """``scratch`` (``coefficients`` elements) seen as [groups * group, block_size]."""
        return scratch.view(self.groups * self.group, self.block_size)

    def encode(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Interleaved coefficients of ``x`` into ``out`` (``scratch``: same size, work)."""
        by_block = self._by_block(scratch)
        ops.dct_encode(x, self.block_size, self.block_size, out=by_block[: self.blocks])
        by_block[self.blocks:].zero_()
        interleaved = by_block.view(self.groups, self.group, self.block_size).transpose(1, 2)
        out.view(self.groups, self.block_size, self.group).copy_(interleaved)
        return out

    def decode(self, coefficients: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode` into ``out`` (float32, ``numel``); padding dropped."""
        by_block = self._by_block(scratch)
        grouped = coefficients.view(self.groups, self.block_size, self.group).transpose(1, 2)
        by_block.view(self.groups, self.group, self.block_size).copy_(grouped)
        ops.dct_decode(by_block[: self.blocks], self.block_size, self.numel, out=out)
        return out
