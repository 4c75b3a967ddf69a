"""The sign output's persistence gate (``sign_persistence``): a coordinate moves at a share of
the steps equal to its recent signs' agreement, the same on every rank, through the flat hook,
the two-level sync and checkpoints."""

import numpy as np
import pytest
import torch

from hetero_comm.hooks import DCT, SegmentSparseState
from hetero_comm.hooks._persistence import SHARE_ROUNDING, SIGN_CREDIT, SIGN_MEAN, gate_persistent_signs
from hetero_comm.hooks._plan import redistribute
from lab.launch import run_ranks
from hook_workers import train

SIGN = dict(segment_size=4, density=0.25, basis=DCT(block_size=8), output="sign", warmup_steps=2)


def reference_gate(sign_rows, decay):
    """Step by step, coordinate by coordinate, each product and sum rounded to float32: what
    moves at each step."""
    f32 = np.float32
    steps, size = sign_rows.shape
    mean, credit = [f32(0)] * size, [f32(0)] * size
    out = np.zeros_like(sign_rows)
    for t in range(steps):
        correction = f32((1.0 + SHARE_ROUNDING) / (1.0 - decay ** (t + 1)))
        for i in range(size):
            mean[i] = f32(mean[i] * f32(decay)) + f32(f32(sign_rows[t, i]) * f32(1.0 - decay))
            credit[i] = credit[i] + min(f32(abs(mean[i]) * correction), f32(1.0))
            if credit[i] >= 1.0:
                credit[i] = credit[i] - f32(1.0)
                out[t, i] = sign_rows[t, i]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [1, 7, 64, 513])
@pytest.mark.parametrize("decay", [0.5, 0.9, 0.95])
def test_gate_equals_the_step_by_step_reference(dtype, size, decay):
    generator = torch.Generator().manual_seed(size)
    # some coordinates keep their sign, some are noise, some are zero now and then
    drift = torch.rand(size, generator=generator) * 2 - 1
    rows = torch.sign(drift + torch.randn(40, size, generator=generator))
    rows[torch.rand(40, size, generator=generator) < 0.1] = 0
    mean, credit = torch.zeros(size), torch.zeros(size)
    gated = [gate_persistent_signs(row.to(dtype).clone(), mean, credit, decay, t + 1)
             for t, row in enumerate(rows)]
    expected = reference_gate(rows.double().numpy(), decay)
    np.testing.assert_array_equal(torch.stack(gated).float().numpy(), expected)


def test_persistent_signs_move_at_every_step_and_noise_at_a_small_share():
    steps, decay = 400, 0.95
    persistent = torch.ones(steps, 1000)
    noise = torch.sign(torch.randn(steps, 1000, generator=torch.Generator().manual_seed(0)))
    moved = {}
    for name, rows in (("persistent", persistent), ("noise", noise)):
        mean, credit = torch.zeros(1000), torch.zeros(1000)
        outs = [gate_persistent_signs(row.clone(), mean, credit, decay, t + 1)
                for t, row in enumerate(rows)]
        moved[name] = float(torch.stack(outs).abs().mean())
    assert moved["persistent"] == 1.0
    # |mean| of independent signs at decay 0.95: about sqrt(0.05 / 1.95) * sqrt(2 / pi) = 0.13
    assert 0.08 < moved["noise"] < 0.2


def test_moves_add_up_to_the_credit_granted():
    """Over any run each coordinate moves at whole units of the credit granted, the rest
    kept: moves + what is left = the sum of the bias-corrected |mean|."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.sign(torch.randn(60, 50, generator=generator) + 0.3)
    mean, credit, moves = torch.zeros(50), torch.zeros(50), torch.zeros(50)
    for t, row in enumerate(rows):
        moves += gate_persistent_signs(row.clone(), mean, credit, 0.9, t + 1).abs()
    granted, running = torch.zeros(50), torch.zeros(50)
    for t, row in enumerate(rows):
        running = 0.9 * running + 0.1 * row
        granted += (running.abs() * (1 + SHARE_ROUNDING) / (1 - 0.9 ** (t + 1))).clamp(max=1)
    torch.testing.assert_close(moves + credit, granted, rtol=1e-5, atol=1e-4)
    assert moves.sum() > 0.5 * granted.sum()
    assert (credit >= 0).all() and (credit < 1).all()


def test_a_nan_stays_nan_and_counts_as_zero_in_the_mean():
    mean, credit = torch.zeros(3), torch.zeros(3)
    out = gate_persistent_signs(torch.tensor([1.0, float("nan"), -1.0]), mean, credit, 0.9, 1)
    assert torch.isnan(out[1]) and out[0] == 1 and out[2] == -1
    assert torch.isfinite(mean).all() and torch.isfinite(credit).all() and mean[1] == 0


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(decay=1.0), "decay must be in"),
    (dict(decay=0.0), "decay must be in"),
    (dict(gated_steps=0), "gated_steps must be at least 1"),
    (dict(mean=torch.zeros(5)), "one shape"),
])
def test_bad_input_raises_before_anything_is_written(kwargs, pattern):
    signs, mean, credit = torch.tensor([1.0, -1.0, 1.0, 0.0]), torch.full((4,), 0.5), torch.full((4,), 0.7)
    arguments = dict(signs=signs, mean=mean, credit=credit, decay=0.9, gated_steps=3)
    arguments.update(kwargs)
    kept = {name: value.clone() for name, value in arguments.items() if isinstance(value, torch.Tensor)}
    with pytest.raises(ValueError, match=pattern):
        gate_persistent_signs(**arguments)
    for name, value in kept.items():
        torch.testing.assert_close(arguments[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("settings_,pattern", [
    (dict(output="sum", sign_persistence=0.9), "sign_persistence gates the signs"),
    (dict(output="sign", sign_persistence=1.0), "sign_persistence must be a number"),
    (dict(output="sign", sign_persistence=-0.1), "sign_persistence must be a number"),
])
def test_bad_settings_raise_clear_errors(settings_, pattern):
    with pytest.raises(ValueError, match=pattern):
        SegmentSparseState(**settings_)


def test_the_setting_keeps_its_buffers_and_is_checked_at_load():
    state = SegmentSparseState(output="sign", sign_persistence=0.9)
    assert state.settings()["sign_persistence"] == 0.9
    assert SIGN_MEAN in state.plan.tensor_names and SIGN_CREDIT in state.plan.tensor_names
    assert SIGN_MEAN not in SegmentSparseState(output="sign").plan.tensor_names
    saved = dict(type="SegmentSparseState", settings=dict(sign_persistence=0.5), step=0, stats={})
    with pytest.raises(ValueError, match="sign_persistence=0.5"):
        state.load_state_dict(dict(saved, world_size=1, ranks={}))


def test_a_resize_takes_the_agreed_buffers_from_the_first_rank_and_splits_the_residual():
    def plan(residual, mean):
        return [{"keys": ["0.0"], "numels": [2], "extra": {},
                 "tensors": {"residual": torch.tensor(residual), SIGN_MEAN: torch.tensor(mean),
                             SIGN_CREDIT: torch.tensor([0.25, 0.5])}}]
    merged = redistribute([plan([1.0, 2.0], [0.5, -0.5]), plan([3.0, 4.0], [0.5, -0.5])], 4)
    torch.testing.assert_close(merged[0]["tensors"]["residual"], torch.tensor([1.0, 1.5]))
    torch.testing.assert_close(merged[0]["tensors"][SIGN_MEAN], torch.tensor([0.5, -0.5]))
    torch.testing.assert_close(merged[0]["tensors"][SIGN_CREDIT], torch.tensor([0.25, 0.5]))


def assert_ranks_identical(results):
    for result in results[1:]:
        np.testing.assert_array_equal(result["params"], results[0]["params"])
        np.testing.assert_array_equal(result["applied"], results[0]["applied"])


@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_,world_size", [
    ("sparse", SIGN, 2),
    ("sparse", dict(SIGN, wire_dtype="int8"), 3),
    ("two_level", dict(SIGN, machines=2), 4),
])
def test_every_rank_moves_the_same_coordinates_and_fewer_than_without_the_gate(hook, settings_,
                                                                                world_size):
    gated = run_ranks(world_size, train, hook, dict(settings_, sign_persistence=0.9), 12)
    plain = run_ranks(world_size, train, hook, settings_, 12)
    assert_ranks_identical(gated)
    compressed = slice(settings_["warmup_steps"], None)
    moved = np.abs(gated[0]["applied"][compressed])
    assert set(np.unique(moved)) <= {0.0, 1.0}
    assert moved.sum() < np.abs(plain[0]["applied"][compressed]).sum()
    assert moved.sum() > 0
