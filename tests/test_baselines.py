"""The benchmarks' baselines written from their papers (benchmarks/lab/baselines.py): DeMo."""

import pytest
import torch

from baseline_workers import demo_steps, demo_two_components
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
        taken_components = ops.dct_encode(taken, chunk, chunk)[:-1]  # (the short chunk is padded)
        largest = ops.dct_encode(last, chunk, chunk)[:-1].abs().topk(top_k, dim=1).indices
        assert torch.equal((taken_components.abs() > 1e-5).nonzero()[:, 1].view(-1, top_k),
                           largest.sort(dim=1).values)
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


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_demo_gathers_an_odd_number_of_components(world_size):
    # 3 chunks x top 1: each rank's payload is 9 bytes, so every other rank's values start
    # at an odd byte of the gathered buffer
    ranks = run_ranks(world_size, demo_steps, 192, 64, 1, 2)
    for result in ranks[1:]:
        assert torch.equal(result["outputs"][-1], ranks[0]["outputs"][-1])
    assert ranks[0]["bytes"] == 2 * 3 * 3


@pytest.mark.multirank
def test_demo_averages_each_component_over_the_ranks_that_sent_it():
    # both ranks send the lowest frequency (1.0); rank r also sends frequency 1 + r (0.9)
    ranks = run_ranks(2, demo_two_components, 2)
    components = torch.zeros(1, 64)
    components[0, :3] = torch.tensor([1.0, 0.9, 0.9])
    by_senders = ops.dct_decode(components, 64, 64).sign()
    components[0, 1:3] /= 2  # what dividing every component by the world size would give
    by_world_size = ops.dct_decode(components, 64, 64).sign()
    assert not torch.equal(by_senders, by_world_size)
    assert torch.equal(ranks[0]["output"], by_senders)
    assert torch.equal(ranks[1]["output"], by_senders)


def test_demo_rejects_settings_it_cannot_send():
    with pytest.raises(ValueError, match="power of two"):
        DeMoState(chunk=48)
    with pytest.raises(ValueError, match="top_k"):
        DeMoState(chunk=64, top_k=65)
    with pytest.raises(ValueError, match="chunk"):
        DeMoState(chunk=512)  # positions are one byte
