"""How a contribution travels between groups: its bytes on the wire, and what the receiver
reconstructs from them (the sender keeps the difference for its next contribution)."""

import math
from typing import Optional, Tuple, Union

import torch

from .. import ops
from .._checks import check_choice, check_float, check_int

__all__ = ["WIRE_FORMATS", "Wire", "SparseWire", "make_wire", "pack_codes", "unpack_codes"]

WIRE_FORMATS = ("float32", "bfloat16", "int8")
_INT8_BLOCK = 256  # elements per scale: 1/64 of a byte per element more than the integers
_INT8_LEVELS = 127


class Wire:
    r"""A dense wire format: ``None`` (the parameters' dtype), ``"float32"``, ``"bfloat16"``, or
    ``"int8"``: blocks of 256 values as integers in [-127, 127] times the block's largest
    magnitude / 127 (hetero_comm's ``quantize`` kernel; 1.016 bytes a value, 3.9x fewer than
    float32)."""

    def __init__(self, name: Optional[str], param_dtype: torch.dtype):
        self.name = None if name is None else check_choice("wire_dtype", name, WIRE_FORMATS)
        self.value_dtype = {None: param_dtype, "float32": torch.float32,
                            "bfloat16": torch.bfloat16, "int8": torch.int8}[self.name]

    feedback_decay = 1.0  # what rounding leaves out is kept in full

    def _blocks(self, numel: int) -> int:
        return -(-numel // _INT8_BLOCK)

    def payload_bytes(self, numel: int) -> int:
        if self.name == "int8":
            return self._blocks(numel) * (_INT8_BLOCK + 4)  # the integers, then float32 scales
        return numel * torch.empty(0, dtype=self.value_dtype).element_size()

    def encode_(self, values: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """Write 1-D ``values`` into ``payload`` (host bytes of :meth:`payload_bytes`); return
        what :meth:`decode` will give the receiver, in ``values``' dtype, on the host."""
        if self.name != "int8":
            sent = payload.view(self.value_dtype)
            sent.copy_(values)
            return sent.to(values.dtype)
        blocks = self._blocks(values.numel())
        padded = torch.zeros(blocks * _INT8_BLOCK, dtype=torch.float32)
        padded[:values.numel()] = values
        padded = padded.view(blocks, _INT8_BLOCK)
        integers, scales = self._split(payload, blocks)
        scales.copy_(padded.abs().amax(dim=1))
        ops.quantize(padded, scales, _INT8_LEVELS, torch.int8, out=integers)
        return self._dequantize(integers, scales, values.numel()).to(values.dtype)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The values in ``payload`` (a received message's payload bytes)."""
        if self.name != "int8":
            return payload.view(self.value_dtype)
        return self._dequantize(*self._split(payload, self._blocks(numel)), numel)

    def _split(self, payload: torch.Tensor, blocks: int):
        integers = payload[:blocks * _INT8_BLOCK].view(torch.int8).view(blocks, _INT8_BLOCK)
        return integers, payload[blocks * _INT8_BLOCK:].view(torch.float32)

    def _dequantize(self, integers, scales, numel: int) -> torch.Tensor:
        return ops.dequantize(integers, scales, _INT8_LEVELS).view(-1)[:numel]


SPARSE_BITS = (2, 4, 8)


class SparseWire:
    r"""Sparse contributions: of each part, the ``density`` fraction of its segments of
    ``segment_size`` values with the largest L2 norm (hetero_comm's ``segment_accumulate_`` and
    ``select_segments`` kernels), each segment's values as ``bits``-bit integers in
    ``[-L, L]`` (``L = 2 ** (bits - 1) - 1``: 1, 7 or 127) times the segment's largest
    magnitude / ``L`` (its shared scale).

    A part's payload: the selected segments' float32 scales, their int32 indices, then the
    integers offset by ``L`` and packed ``8 / bits`` to a byte. Its size depends only on the
    part's length, so every contribution of a part is the same number of bytes.

    What is not sent (the unselected segments and the rounding of the selected ones) stays in
    GroupSync's ``params - base``: the error feedback that sends it with a later contribution.
    ``feedback_decay`` < 1 keeps only that fraction of it after each contribution (SparseLoCo's
    beta): the rest is never sent to the other groups (it stays in this group's model and
    reaches them at :meth:`GroupSync.flush`'s average).

    Args:
        density: the fraction of segments sent, in (0, 1]; at least one segment per part.
        bits: 2, 4 or 8 bits a value.
        segment_size: values a segment (>= 1): the unit selected, with one scale and one index.
        feedback_decay: in [0, 1].

    Example::

        sync = GroupSync(model, grouping, period=16, wire_dtype=SparseWire(density=0.02, bits=4))
    """

    def __init__(self, density: float, bits: int = 4, segment_size: int = 64,
                 feedback_decay: float = 1.0):
        self.density = check_float("density", density, 0.0, 1.0, low_open=True)
        self.bits = check_choice("bits", check_int("bits", bits, 1), SPARSE_BITS)
        self.segment_size = check_int("segment_size", segment_size, 1)
        self.feedback_decay = check_float("feedback_decay", feedback_decay, 0.0, 1.0)
        self.levels = 2 ** (self.bits - 1) - 1

    def __repr__(self) -> str:
        return (f"SparseWire(density={self.density}, bits={self.bits}, "
                f"segment_size={self.segment_size}, feedback_decay={self.feedback_decay})")

    def _counts(self, numel: int) -> Tuple[int, int]:
        """(segments selected, segments in the part)."""
        segments = -(-numel // self.segment_size)
        return min(segments, max(1, math.ceil(self.density * segments))), segments

    def _layout(self, numel: int) -> Tuple[int, int, int]:
        """(selected, scale and index bytes, packed integer bytes) of a part of ``numel``."""
        selected, _ = self._counts(numel)
        return selected, 8 * selected, -(-selected * self.segment_size * self.bits // 8)

    def payload_bytes(self, numel: int) -> int:
        _, header, packed = self._layout(numel)
        return header + packed

    def encode_(self, values: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """Write the selected segments of 1-D ``values`` into ``payload``; return what
        :meth:`decode` gives the receiver (zero outside them), in ``values``' dtype, on the
        host. Raises ``FloatingPointError`` on NaN or infinity (nothing is written then)."""
        numel = values.numel()
        selected, segments = self._counts(numel)
        padded = torch.zeros(segments * self.segment_size, dtype=torch.float32)
        copy = padded[:numel]  # the values, and their segments' norms, in one pass
        norms = ops.segment_accumulate_(copy, values.detach().to("cpu", torch.float32),
                                        self.segment_size)
        if not bool(torch.isfinite(norms).all()):
            raise FloatingPointError("a contribution holds NaN or infinity: the model diverged")
        indices = ops.select_segments(norms, selected)
        scales, wire_indices, packed = self._split(payload, numel)
        scales.copy_(padded.view(segments, self.segment_size)[indices].abs().amax(dim=1))
        wire_indices.copy_(indices)
        integers = ops.pack_quantized_segments_(copy, indices, self.segment_size, scales,
                                                self.levels, torch.int8)
        packed.copy_(self._pack(integers))
        return self.decode(payload, numel).to(values.dtype)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The part's values from ``payload``: float32 [numel], zero outside the sent segments."""
        scales, wire_indices, packed = self._split(payload, numel)
        selected = scales.numel()
        integers = self._unpack(packed, selected * self.segment_size)
        values = ops.dequantize(integers.view(selected, self.segment_size), scales, self.levels)
        return ops.unpack_segments(values.view(-1), wire_indices.long(), self.segment_size, numel)

    def _split(self, payload: torch.Tensor, numel: int):
        selected, header, packed = self._layout(numel)
        if payload.numel() != header + packed:
            raise ValueError(f"a sparse payload of a part of {numel} values is {header + packed} "
                             f"bytes; got {payload.numel()}")
        return (payload[:4 * selected].view(torch.float32),
                payload[4 * selected:header].view(torch.int32), payload[header:])

    def _pack(self, integers: torch.Tensor) -> torch.Tensor:
        return pack_codes((integers.to(torch.int16) + self.levels).to(torch.uint8), self.bits)

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        return (unpack_codes(packed, self.bits, count).to(torch.int16) - self.levels).to(torch.int8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D uint8 ``codes`` below ``2 ** bits`` (``bits`` 1, 2, 4 or 8), ``8 / bits`` to a byte,
    the first of each byte's codes in its lowest bits (the last byte padded with zeros)."""
    per_byte = 8 // bits
    codes = torch.cat([codes, codes.new_zeros(-codes.numel() % per_byte)]).view(-1, per_byte)
    packed = codes[:, 0].clone()
    for j in range(1, per_byte):
        packed |= codes[:, j] << (bits * j)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_codes`'s bytes (uint8)."""
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * j)) & mask for j in range(8 // bits)],
                       dim=1).view(-1)[:count]


def make_wire(spec: Union[None, str, SparseWire], param_dtype: torch.dtype):
    """GroupSync's ``wire_dtype``: a dense format's name (or ``None``) or a :class:`SparseWire`."""
    return spec if isinstance(spec, SparseWire) else Wire(spec, param_dtype)
