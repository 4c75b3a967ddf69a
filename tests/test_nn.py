"""Unit dropout with shared masks (hetero_comm.nn) and hooks that skip the dropped rows:
single-process layer tests, then real gloo ranks (world size 2 and 3)."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from hetero_comm.hooks import DCT, AllreduceState, SegmentSparseState
from hetero_comm.hooks._dropped import KeptPart, kept_layout
from hetero_comm.hooks._plan import PlanBucket
from lab.launch import run_ranks
from hetero_comm.nn import SlicedLinear, UnitDropout, UnitDropoutSet, convert_dropout
from dropout_workers import agree_on_seed, make_dropout_model, train_unit_dropout

SPARSE = dict(segment_size=4, density=0.1, warmup_steps=2)
DCT_QUANT = dict(block_size=8, keep_ratio=0.25, bits=8, warmup_steps=2)


# ------------------------------------------------------------------ the layers, one process
def test_masks_are_per_step_per_layer_and_reproducible_from_the_seed():
    units = UnitDropoutSet(seed=5)
    a, b = UnitDropout(0.5, 64, units), UnitDropout(0.5, 64, units)
    first = units.kept_units(a, "cpu")
    assert torch.equal(first, units.kept_units(a, "cpu"))  # constant within a step
    assert not torch.equal(first, units.kept_units(b, "cpu"))  # layers draw apart
    units.next_step()
    assert not torch.equal(first, units.kept_units(a, "cpu"))  # a new mask each step
    again = UnitDropoutSet(seed=5)
    a2 = UnitDropout(0.5, 64, again)
    assert torch.equal(first, again.kept_units(a2, "cpu"))
    again.load_state_dict(units.state_dict())
    assert torch.equal(units.kept_units(a, "cpu"), again.kept_units(a2, "cpu"))
    with pytest.raises(ValueError, match="saved with seed 5; this set has 6"):
        UnitDropoutSet(seed=6).load_state_dict(units.state_dict())


def test_inverted_scaling_keeps_the_expected_activation_and_eval_turns_it_off():
    units = UnitDropoutSet(seed=0)
    layer = UnitDropout(0.3, 40, units)
    x = torch.randn(3, 40)
    total = torch.zeros_like(x)
    for _ in range(2000):
        out = layer(x)
        kept = units.kept_units(layer, "cpu")
        dropped = torch.ones(40, dtype=torch.bool)
        dropped[kept] = False
        assert (out[:, dropped] == 0).all()  # whole units, for the whole batch
        torch.testing.assert_close(out[:, kept], x[:, kept] / 0.7)
        total += out
        units.next_step()
    # Mean of 2000 Bernoulli(0.7) / 0.7 draws: standard error 0.0147 per unit.
    assert (total / 2000 / x - 1).abs().max() < 0.08
    layer.eval()
    assert layer(x) is x


def test_sliced_linear_equals_the_masked_computation_forward_and_backward():
    torch.manual_seed(0)
    for p in (0.0, 0.25, 0.5, 0.9):
        masked = make_dropout_model()
        sliced = make_dropout_model()
        convert_dropout(masked, p, seed=3, skip_compute=False)
        convert_dropout(sliced, p, seed=3, skip_compute=True)
        assert isinstance(sliced[0], SlicedLinear) and type(masked[0]) is nn.Linear
        assert sliced.state_dict().keys() == masked.state_dict().keys()
        x = torch.randn(16, 20)
        out_masked, out_sliced = masked(x), sliced(x)
        torch.testing.assert_close(out_sliced, out_masked)
        out_masked.square().sum().backward()
        out_sliced.square().sum().backward()
        for pm, ps in zip(masked.parameters(), sliced.parameters()):
            torch.testing.assert_close(ps.grad, pm.grad)
        kept = [layer.unit_set.kept_units(layer, "cpu").numpy() for layer in (sliced[2], sliced[5])]
        grads = np.concatenate([p.grad.reshape(-1).numpy() for p in sliced.parameters()])
        if p > 0:
            assert (grads[dropped_mask(kept)] == 0).all() and dropped_mask(kept).any()


def test_kept_layout_only_for_layers_that_dropped_this_step():
    model = make_dropout_model()
    units = convert_dropout(model, 0.5, seed=1)
    params = list(model.parameters())
    assert kept_layout(units, params) is None  # no training forward yet
    model(torch.randn(2, 20))
    layout = kept_layout(units, params)
    kept0 = units.kept_units(units.layers[0], "cpu").numel()
    kept1 = units.kept_units(units.layers[1], "cpu").numel()
    assert layout.numel == kept0 * 21 + kept1 * (kept0 + 1) + 5 * kept1 + 5
    flat = torch.arange(1, 1 + sum(p.numel() for p in params), dtype=torch.float32)
    compact = layout.gather(flat, torch.empty(layout.numel))
    restored = layout.expand(compact, torch.full_like(flat, -1.0))
    dropped = torch.from_numpy(dropped_mask([units.kept_units(layer, "cpu").numpy() for layer in units.layers]))
    assert (restored[dropped] == 0).all() and torch.equal(restored[~dropped], flat[~dropped])
    held = torch.full_like(flat, 7.0)
    layout.scatter(compact, held)  # the dropped rows keep what they held
    assert (held[dropped] == 7.0).all() and torch.equal(held[~dropped], flat[~dropped])
    units.next_step()
    assert kept_layout(units, params) is None  # this step's forward has not run
    model.eval()
    model(torch.randn(2, 20))
    assert kept_layout(units, params) is None


@pytest.mark.parametrize("make, match", [
    (lambda u: UnitDropout(1.0, 4, u), r"p must be a number in \[0, 1\)"),
    (lambda u: UnitDropout(-0.1, 4, u), r"p must be a number in \[0.0, 1.0\]"),
    (lambda u: UnitDropout(0.5, 4, u, producer=nn.Linear(3, 5)), "out_features == units"),
    (lambda u: UnitDropoutSet(seed=-1), "seed must be an integer"),
])
def test_bad_settings_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(UnitDropoutSet(seed=0))


def test_convert_refuses_a_layer_it_cannot_slice():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Dropout(0.5), nn.Linear(8, 2),
                          nn.ReLU(), nn.Dropout(0.5))
    with pytest.raises(ValueError, match="'2' cannot be made a unit dropout"):
        convert_dropout(model, layers=["2"], seed=0)
    with pytest.raises(ValueError, match=r"no nn.Dropout named \['9'\]"):
        convert_dropout(model, layers=["9"], seed=0)
    units = convert_dropout(model, seed=0)  # '2' stays standard dropout, '5' is converted
    assert type(model[2]) is nn.Dropout and isinstance(model[5], UnitDropout)
    assert len(units.layers) == 1
    with pytest.raises(ValueError, match="found no nn.Dropout"):
        convert_dropout(nn.Sequential(nn.Linear(2, 2)), seed=0)
    with pytest.raises(ValueError, match="expected 8 units"):
        UnitDropout(0.5, 8, units).train()(torch.randn(2, 7))


def test_hook_states_check_what_they_skip_by():
    with pytest.raises(TypeError, match="UnitDropoutSet"):
        AllreduceState().skip_dropped_units(object())
    SegmentSparseState(wire_dtype="int8").skip_dropped_units(UnitDropoutSet(seed=0))  # composes


# ------------------------------------------------------------------- real ranks (gloo)
def assert_same_masks_and_parameters(results):
    for r in results[1:]:
        for step_a, step_b in zip(r["kept"], results[0]["kept"]):
            for a, b in zip(step_a, step_b):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r["params"], results[0]["params"])


def dropped_mask(kept_per_layer):
    """Which elements of the flat parameters (make_dropout_model's layout) were dropped: the
    rows of each dropout's producer, the columns of its consumer."""
    units0, units1 = np.ones(30, dtype=bool), np.ones(17, dtype=bool)
    units0[kept_per_layer[0]] = False
    units1[kept_per_layer[1]] = False
    first = np.repeat(units0[:, None], 21, axis=1)  # weight and bias, by row
    second = units1[:, None] | np.append(units0, False)[None, :]  # rows by units1, columns by units0
    last = np.append(np.repeat(units1[None, :], 5, axis=0), np.zeros((5, 1), dtype=bool), axis=1)
    return np.concatenate([first[:, :20].ravel(), first[:, 20], second[:, :30].ravel(), second[:, 30],
                           last[:, :17].ravel(), last[:, 17]])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_dense_sync_of_kept_rows_equals_the_allreduce_of_masked_gradients(world_size):
    results = run_ranks(world_size, train_unit_dropout, "dense", {}, 6)
    assert_same_masks_and_parameters(results)
    produced = sum(r["produced"] for r in results)
    np.testing.assert_allclose(results[0]["applied"], produced, rtol=1e-5, atol=1e-7)
    dropped_elements = 0
    for step, kept in enumerate(results[0]["kept"]):
        dropped = dropped_mask(kept)
        assert dropped.sum() > 0
        assert (results[0]["applied"][step][dropped] == 0).all()
        dropped_elements += dropped.sum()
    stats = results[0]["stats"]
    assert stats["bytes_dense"] - stats["bytes_sent"] == 4 * dropped_elements
    assert results[0]["warned_masks"] is False
    plain = run_ranks(world_size, train_unit_dropout, "dense", {}, 6, dict(skip=False))
    np.testing.assert_allclose(plain[0]["params"], results[0]["params"], rtol=1e-6, atol=1e-7)
    assert plain[0]["stats"]["bytes_sent"] == stats["bytes_dense"]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("hook, settings_", [
    ("sparse", SPARSE), ("sparse", dict(SPARSE, basis=DCT(4))),
    ("sparse", dict(SPARSE, momentum=0.9)), ("sparse", dict(SPARSE, wire_dtype="int8")),
    ("dct", DCT_QUANT),
])
@pytest.mark.parametrize("world_size", [2, 3])
def test_compressed_sync_of_kept_rows_keeps_error_feedback_exact(hook, settings_, world_size):
    """What was applied plus what every rank holds back equals what was produced, dropped
    rows get exactly zero update, and fewer bytes go out than without skipping."""
    results = run_ranks(world_size, train_unit_dropout, hook, settings_, 12)
    assert_same_masks_and_parameters(results)
    produced = sum(r["produced"] for r in results)
    held = sum(r["held_back"] for r in results)
    applied = results[0]["applied"]
    if not settings_.get("momentum"):  # momentum correction feeds back the velocity, not g
        np.testing.assert_allclose(applied.sum(axis=0) + held, produced.sum(axis=0), rtol=1e-4, atol=1e-5)
    for step, kept in enumerate(results[0]["kept"]):
        assert (applied[step][dropped_mask(kept)] == 0).all()
    plain = run_ranks(world_size, train_unit_dropout, hook, settings_, 12, dict(skip=False))
    assert results[0]["stats"]["bytes_sent"] < 0.8 * plain[0]["stats"]["bytes_sent"]
    assert results[0]["stats"]["bytes_dense"] == plain[0]["stats"]["bytes_dense"]


@pytest.mark.multirank
@pytest.mark.parametrize("hook, settings_", [("dense", {}), ("sparse", SPARSE)])
def test_unequal_rank_weights(hook, settings_):
    """Ranks weighted 0.7 / 0.3 (as unequal batches are): the kept part is the weighted sum."""
    results = run_ranks(2, train_unit_dropout, hook, settings_, 8, dict(weights=(0.7, 0.3)))
    assert_same_masks_and_parameters(results)
    produced = sum(r["produced"] for r in results)
    held = sum(r["held_back"] for r in results)
    np.testing.assert_allclose(results[0]["applied"].sum(axis=0) + held, produced.sum(axis=0),
                               rtol=1e-4, atol=1e-5)
    if hook == "dense":
        np.testing.assert_allclose(results[0]["applied"], produced, rtol=1e-5, atol=1e-7)


@pytest.mark.multirank
@pytest.mark.parametrize("device_side_checks", [False, True])
@pytest.mark.parametrize("settings_", [SPARSE, dict(SPARSE, momentum=0.9)])
def test_non_finite_gradient_in_the_kept_part(settings_, device_side_checks):
    """Rank 1's gradient NaN at step 4 while units are dropped (the kept part sent compact):
    every rank gets NaN in what it applies at that step and nothing fails; the run goes on
    finite and alike on both ranks, and every pooled buffer is given back."""
    options = dict(nan_at=(1, 4), device_side_checks=device_side_checks)
    results = run_ranks(2, train_unit_dropout, "sparse", settings_, 8, options)
    assert_same_masks_and_parameters(results)
    for result in results:
        assert dropped_mask(result["kept"][4]).any()  # the bucket was sent compact
        assert np.isnan(result["applied"][4]).any()
        assert np.isfinite(np.delete(result["applied"], 4, axis=0)).all()
        assert np.isfinite(result["params"]).all() and np.isfinite(result["held_back"]).all()
        assert result["stats"]["non_finite_buckets"] >= 1
        assert result["buffers_in_use"] == 0
        assert not result["warned_masks"]  # the skipped step kept the masks: no false alarm


@pytest.mark.multirank
def test_resume_continues_the_masks_and_error_feedback_exactly():
    straight = run_ranks(2, train_unit_dropout, "sparse", SPARSE, 8)
    resumed = run_ranks(2, train_unit_dropout, "sparse", SPARSE, 8, dict(resume_at=5))
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a["params"], b["params"])
        assert a["units_step"] == b["units_step"] == 8


@pytest.mark.multirank
def test_ranks_agree_on_the_seed_or_say_they_do_not():
    drawn = run_ranks(3, agree_on_seed, [None, None, None])
    assert drawn[0] == drawn[1] == drawn[2]
    assert run_ranks(2, agree_on_seed, [4, 4]) == [4, 4]
    errors = run_ranks(2, agree_on_seed, [4, 5])
    assert all("every rank must pass the same seed" in e for e in errors)


@pytest.mark.multirank
def test_masks_that_never_change_are_reported():
    """Without attach(optimizer) the same units stay dropped: the hook state warns."""
    results = run_ranks(2, train_unit_dropout, "dense", {}, 3, dict(attach=False))
    assert results[0]["warned_masks"] is True and results[0]["units_step"] == 0


def test_a_kept_part_resets_the_bucket_it_was_gathered_from():
    """A non-finite flag read on the device later resets the plan bucket, not the compact copy
    (whose buffers are back in the pool by then)."""
    part = PlanBucket(("a", "b"), (3, 2))
    part.tensors["residual"] = torch.arange(5.0)
    kept = KeptPart(part, 4)
    kept.tensors["residual"] = scratch = torch.ones(4)
    kept.reset()
    assert torch.equal(part.tensors["residual"], torch.zeros(5))
    assert torch.equal(scratch, torch.ones(4))
