"""Baselines written from their papers where the real implementation cannot run here.

:class:`Int4BetweenMachinesState` with :func:`int4_between_machines_hook` is ZeRO++'s
quantized gradient exchange (qgZ, Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training") as a DDP hook: full precision inside a machine,
blockwise int4 between machines (DeepSpeed's own is CUDA-only). It is a benchmark baseline,
labelled as such, not part of the library's API: it keeps no error feedback, as qgZ keeps none.
"""

import torch
import torch.distributed as dist

from .._checks import check_int
from ..hooks.two_level import Shares, TwoLevelState, two_level_hook

__all__ = ["Int4BetweenMachinesState", "int4_between_machines_hook", "quantize_int4",
           "dequantize_int4"]

INT4_LEVELS = 7  # symmetric: -7..7 (one code of 16 unused)


def quantize_int4(values: torch.Tensor, block: int):
    """Blockwise symmetric int4: each block of ``block`` values (zero-padded) scaled by its
    largest magnitude over 7 and rounded; two codes per byte.

    Returns:
        (packed uint8 [ceil(n / block) * block / 2], scales float32 [ceil(n / block)]).
    """
    blocks = -(-values.numel() // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[:values.numel()].copy_(values)
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / INT4_LEVELS
    codes = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    codes = (codes.clamp_(-INT4_LEVELS, INT4_LEVELS) + 8).to(torch.uint8).view(-1)
    return codes[0::2] | (codes[1::2] << 4), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values of :func:`quantize_int4`'s output (the first ``numel``)."""
    codes = torch.stack((packed & 15, packed >> 4), dim=1).view(-1).to(torch.float32) - 8
    block = codes.numel() // scales.numel()
    return (codes.view(-1, block) * scales.unsqueeze(1)).view(-1)[:numel]


class Int4BetweenMachinesState(TwoLevelState):
    """ZeRO++ qgZ's scheme as a two-level hook (a baseline): the sum inside each machine and
    the spread of the result as :class:`~hetero_comm.hooks.TwoLevelState` does (full
    precision); between machines, each share is cut into one piece per machine, quantized to
    int4 in blocks of ``block`` (all-to-all: each machine gets every machine's version of its
    piece and sums them), quantized again and all-gathered. No error feedback.

    Args:
        machines, process_group, rank_weight, warmup_steps: as for TwoLevelState.
        block: values per int4 scale, in [2, 2**16], even (default 128).
    """

    def __init__(self, *, block: int = 128, **settings) -> None:
        self.block = check_int("block", block, 2, 1 << 16)
        if block % 2:
            raise ValueError(f"block must be even (two int4 codes per byte); got {block}")
        super().__init__(**settings)

    def exchange_share(self, plan_bucket, shares: Shares, values: torch.Tensor, index: int) -> bool:
        machines, rail = self.groups.machines, self.exchange_group()
        piece = -(-values.numel() // (machines * self.block)) * self.block
        padded = torch.zeros(machines * piece, dtype=torch.float32, device=values.device)
        padded[:values.numel()].copy_(values)
        # Reduce-scatter as qgZ does it: every machine's int4 version of each piece to its owner.
        packed, scales = quantize_int4(padded, self.block)
        got_packed, got_scales = torch.empty_like(packed), torch.empty_like(scales)
        dist.all_to_all_single(got_packed, packed, group=rail)
        dist.all_to_all_single(got_scales, scales, group=rail)
        per_packed, per_scales = piece // 2, piece // self.block
        mine = sum(dequantize_int4(got_packed[m * per_packed:(m + 1) * per_packed],
                                   got_scales[m * per_scales:(m + 1) * per_scales], piece)
                   for m in range(machines))
        # All-gather the summed pieces, in int4 again.
        packed, scales = quantize_int4(mine, self.block)
        all_packed = torch.empty(machines * packed.numel(), dtype=torch.uint8, device=values.device)
        all_scales = torch.empty(machines * scales.numel(), dtype=torch.float32, device=values.device)
        dist.all_gather_single(all_packed, packed, group=rail)
        dist.all_gather_single(all_scales, scales, group=rail)
        values.copy_(dequantize_int4(all_packed, all_scales, machines * piece)[:values.numel()])
        sent = (machines + 1) * (packed.numel() + scales.numel() * 4)  # handed to the two stages
        self.count_bytes(values.numel() * values.element_size(), sent, True)
        return not bool(torch.isfinite(values).all())

    def settings(self) -> dict:
        return dict(super().settings(), block=self.block)


def int4_between_machines_hook(state: Int4BetweenMachinesState, bucket: dist.GradBucket):
    """:func:`~hetero_comm.hooks.two_level_hook` with :class:`Int4BetweenMachinesState`'s
    exchange between machines (ZeRO++ qgZ's int4 scheme, a baseline)."""
    return two_level_hook(state, bucket)
