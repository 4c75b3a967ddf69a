"""Baselines written from their papers where the real implementation cannot run here.

:class:`Int4BetweenMachinesState` with :func:`int4_between_machines_hook` is ZeRO++'s
quantized gradient exchange (qgZ, Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training") as a DDP hook: full precision inside a machine,
blockwise int4 between machines (DeepSpeed's own is CUDA-only). It is a benchmark baseline,
labelled as such, not part of the library's API: it keeps no error feedback, as qgZ keeps none.

:class:`DeMoState` with :func:`demo_hook` is DeMo (Peng, Quesnelle and Kingma 2024, "DeMo:
Decoupled Momentum Optimization", arXiv 2411.19870; no package of it runs here) as a DDP hook:
each rank keeps its own momentum, sends only its largest DCT components per chunk, and the
optimizer steps by the sign of their mean (signum; AdamW with betas (0, 0) does that step with
DeMo's decoupled weight decay). :func:`demo_exchange` says where it departs from the authors'
code.

:class:`SparseLoCo` is SparseLoCo's scheme (Sarfi et al. 2025, "Communication Efficient LLM
Pre-training with SparseLoCo", arXiv 2508.15706; no package provides it) between sites:
synchronous rounds of top-k per chunk at 2 bits with error feedback, DDP inside each site.
"""

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from hetero_comm import ops
from hetero_comm._checks import check_float, check_int
from hetero_comm._collectives import all_gather_single
from hetero_comm.hooks.two_level import Shares, TwoLevelState, two_level_hook
from hetero_comm.sync.wire import pack_codes, unpack_codes

__all__ = ["Int4BetweenMachinesState", "int4_between_machines_hook", "quantize_int4",
           "dequantize_int4", "DeMoState", "demo_exchange", "demo_hook", "SparseLoCo", "encode_top_k_2bit", "decode_top_k_2bit"]

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
    return pack_codes(codes, 4), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values of :func:`quantize_int4`'s output (the first ``numel``)."""
    codes = unpack_codes(packed, 4, 2 * packed.numel()).to(torch.float32) - 8
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
        all_gather_single(all_packed, packed, group=rail)
        all_gather_single(all_scales, scales, group=rail)
        values.copy_(dequantize_int4(all_packed, all_scales, machines * piece)[:values.numel()])
        sent = (machines + 1) * (packed.numel() + scales.numel() * 4)  # handed to the two stages
        self.statistics.count_bytes(values.numel() * values.element_size(), sent, True)
        return not bool(torch.isfinite(values).all())

    def settings(self) -> dict:
        return dict(super().settings(), block=self.block)


def int4_between_machines_hook(state: Int4BetweenMachinesState, bucket: dist.GradBucket):
    """:func:`~hetero_comm.hooks.two_level_hook` with :class:`Int4BetweenMachinesState`'s
    exchange between machines (ZeRO++ qgZ's int4 scheme, a baseline)."""
    return two_level_hook(state, bucket)


# ----- SparseLoCo ----------------------------------------------------------------------------
_TWO_BIT_CODES = torch.tensor([-3.0, -1.0, 1.0, 3.0]) / 3  # of the chunk's scale


class DeMoState:
    """DeMo's settings and each bucket's momentum (a baseline written from the paper).

    Args:
        process_group: the group to synchronise in (``None``: the default group).
        chunk: values a DCT chunk, a power of two (the paper's 64).
        top_k: components each rank sends a chunk, in [1, chunk].
        decay: the momentum's decay ``beta`` (the paper's 0.999).

    On the wire each component is its value as bfloat16 and its position in the chunk as one
    byte (``chunk`` <= 256): ``3 * top_k`` bytes a chunk of ``4 * chunk`` dense bytes.
    """

    def __init__(self, *, process_group=None, chunk: int = 64, top_k: int = 2,
                 decay: float = 0.999) -> None:
        self.chunk = check_int("chunk", chunk, 1, 256)
        if chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two (the DCT's block); got {chunk}")
        self.top_k = check_int("top_k", top_k, 1, chunk)
        self.decay = check_float("decay", decay, 0.0, 1.0)
        self.process_group = process_group
        self.momentum: Dict[int, torch.Tensor] = {}

    def momentum_of(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s momentum (zeros at first, and when DDP re-lays its buckets out)."""
        momentum = self.momentum.get(index)
        if momentum is None or momentum.numel() != grad.numel():
            momentum = self.momentum[index] = torch.zeros(grad.numel(), device=grad.device)
        return momentum


@torch.no_grad()
def demo_exchange(state: DeMoState, index: int, grad: torch.Tensor) -> torch.Tensor:
    """One DeMo step for bucket ``index``'s flat ``grad``, which it overwrites and returns:
    ``m = decay * m + grad``; the ``top_k`` largest DCT components of each chunk of ``m`` are
    taken out of ``m`` and all-gathered; ``grad`` becomes the sign of what they took out,
    averaged per component over the ranks that sent it and transformed back.

    Where this differs from the authors' optimizer: it chunks the flat DDP bucket in 1D chunks
    of ``chunk`` (the last zero-padded), where they chunk each parameter (matrices in 2D tiles,
    64 x 64 with 32 components by default); its momentum adds the gradient, not the rate times
    it (a hook does not see the rate)."""
    chunk, k, numel = state.chunk, state.top_k, grad.numel()
    momentum = state.momentum_of(index, grad)
    momentum.mul_(state.decay).add_(grad)
    coefficients = ops.dct_encode(momentum, chunk, chunk)  # [chunks, chunk]
    positions = coefficients.abs().topk(k, dim=1).indices
    values = coefficients.gather(1, positions)
    momentum.sub_(ops.dct_decode(torch.zeros_like(coefficients).scatter_(1, positions, values),
                                 chunk, numel))
    sent = values.numel()
    payload = torch.cat([values.to(torch.bfloat16).view(-1).view(torch.uint8),
                         positions.to(torch.uint8).view(-1)])
    world_size = dist.get_world_size(state.process_group)
    gathered = payload.new_empty(world_size * payload.numel())
    all_gather_single(gathered, payload, group=state.process_group)
    summed, senders = torch.zeros_like(coefficients), torch.zeros_like(coefficients)
    ones = torch.ones_like(values)
    for part in gathered.view(world_size, -1):
        # (a copy: an odd rank's values may start at an odd byte, which a bfloat16 view refuses)
        rank_values = part[:2 * sent].clone().view(torch.bfloat16).float().view_as(values)
        rank_positions = part[2 * sent:].long().view_as(positions)
        summed.scatter_add_(1, rank_positions, rank_values)
        senders.scatter_add_(1, rank_positions, ones)
    # each component's mean over the ranks that sent it, as the authors' code averages
    mean = summed.div_(senders.clamp_(min=1))
    return grad.copy_(ops.dct_decode(mean, chunk, numel).sign_())


def demo_hook(state: DeMoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`demo_exchange` as a DDP communication hook (synchronous)."""
    future = torch.futures.Future()
    future.set_result(demo_exchange(state, bucket.index(), bucket.buffer()))
    return future


def _chunked(values: torch.Tensor, chunk: int) -> torch.Tensor:
    chunks = -(-values.numel() // chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.float32)
    padded[:values.numel()] = values
    return padded.view(chunks, chunk)


def encode_top_k_2bit(values: torch.Tensor, chunk: int, k: int):
    """The ``k`` largest magnitudes of each chunk of ``chunk`` values (zero-padded), each
    rounded to the nearest of 4 levels ``{-1, -1/3, 1/3, 1}`` times the chunk's largest selected
    magnitude; indices as int16 within the chunk, codes 4 to a byte, one float32 scale a chunk.

    Returns:
        (payload uint8 [chunks * (4 + 2k) + ceil(chunks * k / 4)], what it decodes to:
        float32 [numel]).
    """
    rows = _chunked(values, chunk)
    top = rows.abs().topk(k, dim=1)
    scales = torch.empty(rows.shape[0]).copy_(top.values[:, 0])  # dense strides for the byte view
    picked = rows.gather(1, top.indices) / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = (picked.unsqueeze(-1) - _TWO_BIT_CODES).abs().argmin(dim=-1).to(torch.uint8)
    packed = pack_codes(codes.view(-1), 2)
    payload = torch.cat([scales.view(torch.uint8), top.indices.to(torch.int16).view(-1).view(torch.uint8),
                         packed])
    return payload, decode_top_k_2bit(payload, values.numel(), chunk, k)


def decode_top_k_2bit(payload: torch.Tensor, numel: int, chunk: int, k: int) -> torch.Tensor:
    """The float32 values of :func:`encode_top_k_2bit`'s payload (zero where none was sent)."""
    chunks = -(-numel // chunk)
    scales = payload[:4 * chunks].view(torch.float32)
    indices = payload[4 * chunks:4 * chunks + 2 * chunks * k].view(torch.int16).view(chunks, k)
    packed = payload[4 * chunks + 2 * chunks * k:]
    codes = unpack_codes(packed, 2, chunks * k).view(chunks, k)
    rows = torch.zeros(chunks, chunk, dtype=torch.float32)
    rows.scatter_(1, indices.long(), _TWO_BIT_CODES[codes.long()] * scales[:, None])
    return rows.view(-1)[:numel]


class SparseLoCo:
    r"""SparseLoCo between sites, as a benchmark baseline (written from the paper).

    Every rank builds it and trains its site's DDP module on :attr:`process_group` with the
    inner optimizer; after each optimizer step every rank calls :meth:`step`. Every ``period``
    steps, synchronously on every site:

    1. the site's leader forms the pseudo-gradient ``delta = base - params``, adds it to its
       error feedback ``e = beta * e + delta``, sends ``Q(top_k(e))`` (:func:`encode_top_k_2bit`,
       ``k = density * chunk`` per chunk) and keeps ``e -= Q(top_k(e))``;
    2. the leaders all-gather what they sent; ``base -= outer_lr * mean``;
    3. the leader broadcasts ``base`` inside its site; every rank's parameters become ``base``.

    Args:
        module: the model (every rank starts from the same parameters).
        sites: the ranks of each site (the first of each is its leader).
        period: local steps a round (``H``).
        density: the fraction of each chunk sent (``k / chunk``).
        chunk: values a chunk (the paper's 4096).
        beta: the error feedback's decay (0.95).
        outer_lr: the outer step's rate (1.0).
    """

    def __init__(self, module: torch.nn.Module, sites: Sequence[Sequence[int]], *, period: int,
                 density: float = 1 / 64, chunk: int = 4096, beta: float = 0.95,
                 outer_lr: float = 1.0):
        self.params = list(module.parameters())
        self.period = check_int("period", period, 1)
        self.chunk = check_int("chunk", chunk, 4)
        self.k = max(1, round(check_float("density", density, 0.0, 1.0, low_open=True) * chunk))
        self.beta = check_float("beta", beta, 0.0, 1.0)
        self.outer_lr = check_float("outer_lr", outer_lr, 0.0, 1e9, low_open=True)
        rank = dist.get_rank()
        groups = [dist.new_group(list(ranks)) for ranks in sites]
        self.leaders_group = dist.new_group([ranks[0] for ranks in sites])
        site = next(i for i, ranks in enumerate(sites) if rank in ranks)
        self.process_group, self.leader = groups[site], sites[site][0]
        self.num_sites, self.is_leader = len(sites), rank == sites[site][0]
        self.base = parameters_to_vector([p.detach() for p in self.params]).clone()
        self.error = torch.zeros_like(self.base)
        self.local_step, self.bytes_sent = 0, 0

    def step(self) -> None:
        self.local_step += 1
        if self.local_step % self.period == 0:
            self._round()

    @torch.no_grad()
    def _round(self) -> None:
        if self.is_leader:
            self.error.mul_(self.beta).add_(self.base - parameters_to_vector(self.params))
            payload, sent = encode_top_k_2bit(self.error, self.chunk, self.k)
            self.error.sub_(sent)
            gathered: List[torch.Tensor] = [torch.empty_like(payload) for _ in range(self.num_sites)]
            dist.all_gather(gathered, payload, group=self.leaders_group)
            self.bytes_sent += payload.numel()
            mean = sum(decode_top_k_2bit(p, self.base.numel(), self.chunk, self.k) for p in gathered)
            self.base.sub_(mean, alpha=self.outer_lr / self.num_sites)
        dist.broadcast(self.base, self.leader, group=self.process_group)
        offset = 0
        for p in self.params:
            p.copy_(self.base[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
