"""The sign step sized by the ranks' gradient agreement (``scale_sign_step``, opt-in): its
arithmetic, the count sketch it reads the summed gradient's norm from (compiled against its
reference), the factor under a schedule, and the AdamW recipe with it on gloo ranks."""

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
        scale.observe(grad, salt=2)
        scale.observe(grad[:300], salt=5)  # a second bucket, shorter than the sketch's rows
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
    assert max(noise[0]["factors"][5:]) < 0.6


@pytest.mark.multirank
def test_under_a_decaying_rate_the_factor_returns_to_one():
    """Noise targets with the rate halved every 10 steps: the agreement asks for a small step,
    the schedule's decay soon gives more than that, and the factor goes back to 1."""
    results = run_ranks(2, compress_workers.step_scale_steps, False, 40, True)
    factors = results[0]["factors"]
    assert min(factors[5:15]) < 0.6 and factors[-1] == 1.0
    assert results[0]["saved"]["peaks"] == [1e-3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 70_001, 200_000])
@pytest.mark.parametrize("slots,salt", [(1, 0), (7, 3), (256, 11), (256, 2**32 - 1)])
def test_the_compiled_sketch_equals_the_reference(dtype, numel, slots, salt):
    from hetero_comm import ops, reference
    generator = torch.Generator().manual_seed(numel + slots)
    grad = torch.randn(numel, generator=generator).to(dtype)
    start = torch.randn(slots + 1, generator=generator)
    compiled, expected = start.clone(), start.clone()
    ops.gradient_sketch_(grad, salt, compiled)
    reference.gradient_sketch_(grad, salt, expected)
    scale = float(grad.float().abs().sum()) / numel ** 0.5 + 1
    torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-4 * scale)


def test_the_sketch_signs_differ_by_salt_and_split_evenly():
    from hetero_comm import ops
    ones = torch.ones(100_000)
    first, second = torch.zeros(2), torch.zeros(2)
    ops.gradient_sketch_(ones, 1, first)
    ops.gradient_sketch_(ones, 2, second)
    assert abs(float(first[0])) < 1500 and float(first[0]) != float(second[0])  # about +-316
    assert float(first[1]) == 100_000


@pytest.mark.parametrize("module", ["ops", "reference"])
@pytest.mark.parametrize("arguments,error,pattern", [
    (dict(grad=torch.zeros(4, dtype=torch.float64)), TypeError, "grad must have dtype"),
    (dict(grad=torch.zeros(2, 2)), ValueError, "grad must be 1-D"),
    (dict(sketch=torch.zeros(1)), ValueError, "sketch must have at least 2 elements"),
    (dict(sketch=torch.zeros(5, dtype=torch.float64)), TypeError, "sketch must have dtype"),
    (dict(sketch=torch.zeros(10)[::2]), ValueError, "sketch is written in place and must be contiguous"),
    (dict(salt=-1), ValueError, "salt must be an integer in"),
    (dict(salt=2**32), ValueError, "salt must be an integer in"),
])
def test_bad_input_raises_before_the_sketch_is_written(module, arguments, error, pattern):
    import importlib
    kernel = importlib.import_module(f"hetero_comm.{module}").gradient_sketch_
    given = dict(grad=torch.ones(4), salt=0, sketch=torch.full((3,), 7.0))
    given.update(arguments)
    before = given["sketch"].clone()
    with pytest.raises(error, match=pattern):
        kernel(**given)
    torch.testing.assert_close(given["sketch"], before, rtol=0, atol=0)


@pytest.mark.parametrize("module", ["ops", "reference"])
def test_a_sketch_sharing_the_gradients_memory_is_refused(module):
    import importlib
    kernel = importlib.import_module(f"hetero_comm.{module}").gradient_sketch_
    storage = torch.ones(10)
    with pytest.raises(ValueError, match="sketch must not overlap grad"):
        kernel(storage[:6], 0, storage[4:])
    assert bool((storage == 1).all())


@pytest.mark.multirank
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.004])
def test_a_resumed_run_steps_as_the_uninterrupted_one(bucket_cap_mb):
    """Rank 0's checkpoint loaded on every rank into new objects (DDP's provisional buckets
    again): the same factors and bitwise the same parameters."""
    for result in run_ranks(2, compress_workers.step_scale_resume, bucket_cap_mb):
        assert result["factors"] == result["resumed_factors"]
        assert min(result["factors"][3:]) < 1.0  # the scale did act
        assert result["equal"]
