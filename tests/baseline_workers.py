"""Rank functions for tests/test_baselines.py (run in gloo processes by lab.launch.run_ranks)."""

import torch

from hetero_comm import ops
from lab.baselines import DeMoState, demo_exchange
from lab.byte_count import count_collective_bytes


def demo_steps(rank: int, world_size: int, numel: int, chunk: int, top_k: int, steps: int) -> dict:
    """``steps`` DeMo exchanges of this rank's random gradients: what each returned, the
    momentum before and after the last, and the bytes handed to collectives."""
    state = DeMoState(chunk=chunk, top_k=top_k, decay=0.9)
    generator = torch.Generator().manual_seed(rank)
    grads, outputs, totals = [], [], {"bytes": 0}
    with count_collective_bytes(totals):
        for _ in range(steps):
            grad = torch.randn(numel, generator=generator)
            grads.append(grad.clone())
            before = state.momentum_of(0, grad).clone()
            outputs.append(demo_exchange(state, 0, grad).clone())
    return dict(grads=grads, outputs=outputs, bytes=totals["bytes"],
                momentum_before=before, momentum_after=state.momentum[0].clone())


def demo_two_components(rank: int, world_size: int, top_k: int) -> dict:
    """One DeMo exchange of a 64-value chunk made of the lowest frequency (1.0) and
    frequency 1 + rank (0.9)."""
    components = torch.zeros(1, 64)
    components[0, 0], components[0, 1 + rank] = 1.0, 0.9
    grad = ops.dct_decode(components, 64, 64)
    state = DeMoState(chunk=64, top_k=top_k, decay=0.9)
    return dict(output=demo_exchange(state, 0, grad).clone())
