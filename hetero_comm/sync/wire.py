"""How a contribution travels between groups: its bytes on the wire, and what the receiver
reconstructs from them (the sender keeps the difference for its next contribution)."""

from typing import Optional

import torch

from .. import ops
from .._checks import check_choice

__all__ = ["WIRE_FORMATS", "Wire"]

WIRE_FORMATS = ("float32", "bfloat16", "int8")
_INT8_BLOCK = 256  # elements per scale: 1/64 of a byte per element more than the integers
_INT8_LEVELS = 127


class Wire:
    r"""One wire format: ``None`` (the parameters' dtype), ``"float32"``, ``"bfloat16"``, or
    ``"int8"``: blocks of 256 values as integers in [-127, 127] times the block's largest
    magnitude / 127 (hetero_comm's ``quantize`` kernel; 1.016 bytes a value, 3.9x fewer than
    float32)."""

    def __init__(self, name: Optional[str], param_dtype: torch.dtype):
        self.name = None if name is None else check_choice("wire_dtype", name, WIRE_FORMATS)
        self.value_dtype = {None: param_dtype, "float32": torch.float32,
                            "bfloat16": torch.bfloat16, "int8": torch.int8}[self.name]

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
