"""The sign step sized by the ranks' gradient agreement (``scale_sign_step``, the AdamW
recipe's): its arithmetic, the count sketch it reads the summed gradient's norm from, the
factor under a schedule, and the one call on gloo ranks."""

import math

import pytest
import torch

from hetero_comm.hooks import SegmentSparseState, TwoLevelState
from hetero_comm.hooks._step_scale import MIN_SCALE, SKETCH_SIZE, StepScale, step_scale_for
from lab.launch import run_ranks
import compress_workers


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_the_factor_is_adams_step_for_the_measured_signal_to_noise(world_size):
    # g_i = G + n_i with |G|^2 = 1 and E|n_i|^2 = N: the sums' expectations
    for noise, expected in ((0.0, 1.0), (1.0, math.sqrt(world_size / (1 + world_size))),
                            (1e9, MIN_SCALE)):
        together = world_size ** 2 + world_size * noise
        apart = world_size * (1 + noise)
        assert step_scale_for(together, apart, world_size) == pytest.approx(expected, rel=1e-6)
    assert step_scale_for(0.0, 0.0, world_size) == 1.0  # nothing measured
    assert step_scale_for(5.0, 1.0, 1) == 1.0  # one rank: no agreement to read


def test_the_sketch_of_a_sum_is_the_sum_of_the_sketches_and_keeps_its_norm():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(10_000, generator=generator) + 0.5 for _ in range(3)]
    sketches = []
    for grad in grads + [sum(grads)]:
        scale = StepScale()
        scale.observe(grad, index=2)
        scale.observe(grad[:300], index=5)  # a second bucket, shorter than the sketch's rows
        sketches.append(scale._step)
    torch.testing.assert_close(sum(s[:SKETCH_SIZE] for s in sketches[:3]), sketches[3][:SKETCH_SIZE],
                               rtol=1e-4, atol=1e-3)
    total = sum(grads)
    exact = float(total.square().sum() + total[:300].square().sum())
    assert float(sketches[3][:SKETCH_SIZE].square().sum()) == pytest.approx(exact, rel=0.25)
    assert float(sketches[3][SKETCH_SIZE]) == pytest.approx(exact, rel=1e-5)


def test_a_decayed_schedule_is_not_shrunk_again():
    scale = StepScale()
    scale.scale = 0.4
    assert scale.factor_for([1e-3]) == pytest.approx(0.4)  # at the peak: the agreement's
    assert scale.factor_for([0.5e-3]) == pytest.approx(0.8)  # half the peak: 0.4 / 0.5
    assert scale.factor_for([0.2e-3]) == 1.0  # decayed further than the noise asks
    assert scale.factor_for([0.2e-3, 1e-2]) == pytest.approx(0.4)  # a new group, at its peak
    assert scale.peaks == [1e-3, 1e-2]


@pytest.mark.parametrize("settings_,pattern", [
    (dict(output="sum", scale_sign_step=True), "scale_sign_step sizes the sign step"),
    (dict(output="sign", scale_sign_step=1), "scale_sign_step must be True or False"),
])
def test_bad_settings_raise_clear_errors(settings_, pattern):
    with pytest.raises(ValueError, match=pattern):
        SegmentSparseState(**settings_)


def test_the_two_level_sync_refuses_it_until_it_offers_it():
    with pytest.raises(ValueError, match="not offered on the two-level sync"):
        TwoLevelState(machines=1, output="sign", scale_sign_step=True)


@pytest.mark.multirank
def test_agreeing_ranks_step_whole_and_noise_shrinks_the_step_alike_on_every_rank():
    agreeing = run_ranks(2, compress_workers.step_scale_steps, True)
    noise = run_ranks(2, compress_workers.step_scale_steps, False)
    for results in (agreeing, noise):
        assert results[0]["params"] == results[1]["params"]
        assert results[0]["factors"] == results[1]["factors"]
    assert min(agreeing[0]["factors"][5:]) > 0.8
    assert max(noise[0]["factors"][10:]) < 0.5


@pytest.mark.multirank
def test_under_a_decaying_rate_the_factor_returns_to_one():
    """Noise targets with the rate halved every 10 steps: the agreement asks for a small step,
    the schedule's decay soon gives more than that, and the factor goes back to 1."""
    results = run_ranks(2, compress_workers.step_scale_steps, False, 40, True)
    factors = results[0]["factors"]
    assert min(factors[5:15]) < 0.6 and factors[-1] == 1.0
    assert results[0]["saved"]["peaks"] == [1e-3]
