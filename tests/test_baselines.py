"""The benchmarks' baselines written from their papers (benchmarks/lab/baselines.py): DeMo."""

import pytest
import torch

from baseline_workers import demo_steps
from hetero_comm import ops
from lab.baselines import DeMoState
from lab.launch import run_ranks


@pytest.mark.multirank
def test_demo_sends_each_chunks_top_components_and_keeps_the_rest():
    numel, chunk, top_k = 1000, 64, 2  # a short last chunk
    ranks = run_ranks(2, demo_steps, numel, chunk, top_k, 3)
    chunks = -(-numel // chunk)
    for result in ranks:
        # bfloat16 values and one-byte positions, every step
        assert result["bytes"] == 3 * 3 * top_k * chunks
        # what left the momentum is its top_k components per chunk: the rest stays
        last = result["momentum_before"] * 0.9 + result["grads"][-1]
        taken = last - result["momentum_after"]
        coefficients = ops.dct_encode(taken, chunk, chunk)[:-1]  # (the short chunk is padded)
        assert ((coefficients.abs() > 1e-5).sum(dim=1) == top_k).all()
        kept = ops.dct_encode(result["momentum_after"], chunk, chunk)
        assert kept.abs().max() > 0
    for step in range(3):  # the same sign on every rank
        assert torch.equal(ranks[0]["outputs"][step], ranks[1]["outputs"][step])
        assert set(ranks[0]["outputs"][step].unique().tolist()) <= {-1.0, 0.0, 1.0}


@pytest.mark.multirank
def test_demo_with_every_component_sent_steps_by_the_sign_of_the_mean_gradient():
    numel = 512
    ranks = run_ranks(2, demo_steps, numel, 64, 64, 1)
    mean = (ranks[0]["grads"][0] + ranks[1]["grads"][0]) / 2
    clear = mean.abs() > 0.05  # beyond bfloat16's rounding of the components
    assert clear.float().mean() > 0.9
    assert torch.equal(ranks[0]["outputs"][0][clear], mean.sign()[clear])
    assert ranks[0]["momentum_after"].abs().max() < 1e-5  # nothing kept back


def test_demo_rejects_settings_it_cannot_send():
    with pytest.raises(ValueError, match="power of two"):
        DeMoState(chunk=48)
    with pytest.raises(ValueError, match="top_k"):
        DeMoState(chunk=64, top_k=65)
    with pytest.raises(ValueError, match="chunk"):
        DeMoState(chunk=512)  # positions are one byte
