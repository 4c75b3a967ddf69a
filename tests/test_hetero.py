"""Batch planning, sampling and the speed-driven controller for unequal ranks, exactly
weighted gradients, and the CPU quota that makes a rank slow for real."""

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from hetero_comm.hetero import DynamicBatchController, HeteroSampler, plan_batch_sizes
from hetero_comm.hooks import AllreduceState
from lab.launch import run_ranks
from lab.throttle import CpuQuota, cpu_quota_unavailable
from hook_workers import controlled_training, flat, global_batch, make_model, weighted_step

speeds = st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(throughputs=speeds, extra=st.integers(0, 5000))
def test_plan_sums_exactly_and_follows_speed(throughputs, extra):
    batch = len(throughputs) + extra
    sizes = plan_batch_sizes(throughputs, batch)
    assert sum(sizes) == batch and min(sizes) >= 1
    for i in range(len(sizes)):
        for j in range(len(sizes)):
            if throughputs[i] > throughputs[j]:
                assert sizes[i] >= sizes[j]
    assert plan_batch_sizes(list(throughputs), batch) == sizes  # deterministic
    total = sum(Fraction(v) for v in throughputs)
    exact = [batch * Fraction(v) / total for v in throughputs]
    if min(exact) >= 1:  # the minimum of 1 does not bind: largest remainder is within 1
        assert all(abs(b - e) < 1 for b, e in zip(sizes, exact))


def test_plan_rounding_rule():
    assert plan_batch_sizes([1, 1, 1], 10) == [4, 3, 3]  # ties to the lower rank
    assert plan_batch_sizes([3, 1], 64) == [48, 16]
    assert plan_batch_sizes([1, 2, 3.6], 13) == [2, 4, 7]  # 1.97, 3.94, 7.09: floors 1, 3, 7
    assert plan_batch_sizes([1000, 1, 1], 4) == [2, 1, 1]  # the minimum binds
    assert plan_batch_sizes([1000, 1], 1, minimum=0) == [1, 0]


@pytest.mark.parametrize("args,match", [
    (([], 8), "at least one rank"),
    (([1.0, 0.0], 8), "rank 1 has 0.0"),
    (([1.0, -2.0], 8), "finite and > 0"),
    (([1.0, float("nan")], 8), "finite and > 0"),
    (([1.0, float("inf")], 8), "finite and > 0"),
    (([1.0, 1.0, 1.0], 2), r"global_batch_size must be an integer >= 3"),
    (([1.0], 2.5), "global_batch_size"),
])
def test_plan_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        plan_batch_sizes(*args)


@settings(max_examples=200, deadline=None)
@given(world_size=st.integers(1, 5), num_samples=st.integers(1, 300), data=st.data())
def test_sampler_covers_the_dataset_once_per_epoch(world_size, num_samples, data):
    global_batch_size = data.draw(st.integers(world_size, max(world_size, 64)))
    sizes = plan_batch_sizes(data.draw(st.lists(st.floats(0.1, 10), min_size=world_size,
                                                max_size=world_size)), global_batch_size)
    drop_last = data.draw(st.booleans())
    samplers = [HeteroSampler(num_samples, global_batch_size, r, world_size, sizes, seed=3,
                              drop_last=drop_last) for r in range(world_size)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        batches = [list(s) for s in samplers]
        assert len({len(b) for b in batches}) == 1  # the same number of steps on every rank
        used = [i for b in batches for step in b for i in step]
        assert len(used) == len(set(used))  # disjoint
        expected = num_samples if not drop_last else num_samples // global_batch_size * global_batch_size
        assert len(used) == expected
        for step, step_sizes in enumerate(samplers[0].step_sizes()):
            assert [len(b[step]) for b in batches] == step_sizes
        weights = [s.rank_weights() for s in samplers]
        for step in range(len(batches[0])):
            assert sum(w[step] for w in weights) == pytest.approx(1.0)
    again = HeteroSampler(num_samples, global_batch_size, 0, world_size, sizes, seed=3,
                          drop_last=drop_last)
    again.set_epoch(1)
    assert list(again) == batches[0]  # deterministic for a seed


@settings(max_examples=100, deadline=None)
@given(world_size=st.integers(2, 4), num_samples=st.integers(8, 200), data=st.data())
def test_sampler_sizes_changed_mid_epoch_still_cover_once(world_size, num_samples, data):
    """Every rank switches to new sizes at the same steps: still a disjoint cover, equal
    step counts, and each step cut by the sizes in force when it was produced."""
    global_batch_size = data.draw(st.integers(world_size, max(world_size, num_samples // 2)))
    samplers = [HeteroSampler(num_samples, global_batch_size, r, world_size, seed=1)
                for r in range(world_size)]
    iterators = [iter(s) for s in samplers]
    used = []
    for step in range(samplers[0].num_steps()):
        if data.draw(st.booleans()):
            speeds = data.draw(st.lists(st.floats(0.1, 10), min_size=world_size,
                                        max_size=world_size))
            for s in samplers:
                s.set_batch_sizes(plan_batch_sizes(speeds, global_batch_size))
        expected = samplers[0].sizes_of_step(step)
        batches = [next(it) for it in iterators]
        assert [len(b) for b in batches] == expected
        used += [i for b in batches for i in b]
    assert all(next(it, None) is None for it in iterators)
    assert sorted(used) == list(range(num_samples))


def test_sampler_first_epoch_is_an_equal_split_and_validates():
    sampler = HeteroSampler(100, 10, 1, 3)
    assert sampler.batch_sizes == [4, 3, 3]
    with pytest.raises(ValueError, match="summing to global_batch_size"):
        sampler.set_batch_sizes([5, 5, 1])
    with pytest.raises(ValueError, match="rank must be"):
        HeteroSampler(100, 10, 3, 3)
    with pytest.raises(ValueError, match="global_batch_size must be"):
        HeteroSampler(100, 2, 0, 3)


@pytest.mark.multirank
@pytest.mark.parametrize("sizes", [[5, 19], [2, 9, 21]])
def test_weighted_gradient_equals_the_global_batch_gradient(sizes):
    """Unequal local batches with rank_weight = b_i / B give exactly the gradient of the mean
    loss over the concatenated global batch."""
    results = run_ranks(len(sizes), weighted_step, sizes, "dense", {})
    model = make_model()
    x, y = global_batch(sum(sizes))
    nn.functional.mse_loss(model(x), y).backward()
    expected = flat(p.grad for p in model.parameters())
    for r in results:
        np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e-7)


def _check_exact_global_gradients(results, num_samples, rtol):
    """Every step's applied gradient (on every rank) is the gradient of the mean loss over
    that step's global batch, and every epoch uses every sample exactly once."""
    model = make_model()
    x, y = global_batch(num_samples)
    used = []
    for step in range(len(results[0]["steps"])):
        index = [i for r in results for i in r["steps"][step][0]]
        used += index
        model.zero_grad()
        nn.functional.mse_loss(model(x[index]), y[index]).backward()
        expected = flat(p.grad for p in model.parameters())
        for r in results:
            np.testing.assert_allclose(r["steps"][step][1], expected, rtol=rtol, atol=rtol / 100)
        assert sum(r["steps"][step][2] for r in results) == pytest.approx(1.0)
    assert len(used) % num_samples == 0
    for epoch in range(len(used) // num_samples):
        assert sorted(used[epoch * num_samples:(epoch + 1) * num_samples]) == list(range(num_samples))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,hook,settings,rtol", [
    (2, "dense", {}, 1e-5),
    (3, "dense", {}, 1e-5),
    (2, "sparse", dict(density=1.0, segment_size=16), 1e-5),
    # lossless but for float32 rounding in the transform and 32-bit quantization
    (3, "dct", dict(block_size=32, keep_ratio=1.0, bits=32), 1e-4),
])
def test_controller_plans_from_compute_and_keeps_gradients_exact(world_size, hook, settings, rtol):
    """Per-sample costs 1 : 2 : 4 (simulated clock); every hook call first 'waits' 5 s, over
    several buckets. The plan after the equal first epoch is proportional to the compute
    speed alone (the waiting is excluded), every rank makes the same plan, and every step's
    gradient is the global batch's, the final partial batch included."""
    costs = [1e-3, 2e-3, 4e-3][:world_size]
    num_samples, global_batch_size = 203, 40
    options = dict(num_samples=num_samples, global_batch_size=global_batch_size,
                   costs=[costs, costs], hook_wait=5.0, bucket_cap_mb=0.002)
    results = run_ranks(world_size, controlled_training, hook, settings, options)
    _check_exact_global_gradients(results, num_samples, rtol)
    first = results[0]["history"][0]  # made at the start of epoch 1, from epoch 0
    assert sum(first["samples"]) == num_samples
    for rank in range(world_size):
        assert first["compute_seconds"][rank] == pytest.approx(first["samples"][rank] * costs[rank])
        assert first["speeds"][rank] == pytest.approx(1 / costs[rank])
    planned = plan_batch_sizes([1 / c for c in costs], global_batch_size)
    assert first["batch_sizes"] == planned
    for r in results:
        assert r["history"] == results[0]["history"]
        epoch_1_first_step = r["steps"][len(r["steps"]) // 2][0]
        assert len(epoch_1_first_step) == planned[results.index(r)]


@pytest.mark.multirank
def test_controller_smooths_bounds_and_replans_within_an_epoch():
    """replan_every=2 with smoothing 0.5 and max_change 0.25; rank 1 turns 3x slower in the
    second epoch. Speeds follow the moving average exactly, no rank's batch moves more than
    the bound (plus one sample of rounding) at a re-plan, and gradients stay exact."""
    fast, slow = [1e-3, 1e-3], [1e-3, 3e-3]
    num_samples, global_batch_size = 160, 32
    options = dict(num_samples=num_samples, global_batch_size=global_batch_size,
                   costs=[fast, slow, slow],
                   controller=dict(replan_every=2, smoothing=0.5, max_change=0.25))
    results = run_ranks(2, controlled_training, "dense", {}, options)
    _check_exact_global_gradients(results, num_samples, 1e-5)
    history = results[0]["history"]
    assert results[1]["history"] == history
    previous_speeds, previous_sizes = None, [16, 16]
    for plan in history:
        fresh = [n / t for n, t in zip(plan["samples"], plan["compute_seconds"])]
        expected = fresh if previous_speeds is None else [
            0.5 * f + 0.5 * p for f, p in zip(fresh, previous_speeds)]
        assert plan["speeds"] == pytest.approx(expected)
        for now, before in zip(plan["batch_sizes"], previous_sizes):
            assert abs(now - before) <= max(1, 0.25 * before) + 1
        previous_speeds, previous_sizes = plan["speeds"], plan["batch_sizes"]
    assert history[-1]["batch_sizes"][0] > history[-1]["batch_sizes"][1]  # rank 1 got less
    # 5 steps an epoch: re-plans after steps 2 and 4, and at the epoch's end for step 5
    assert [(h["epoch"], h["step"]) for h in history] == [(e, s) for e in range(3) for s in (2, 4, 5)]


def test_controller_rejects_bad_settings_and_misuse():
    sampler = HeteroSampler(100, 10, 0, 2)
    state = AllreduceState()
    with pytest.raises(TypeError, match="HeteroSampler"):
        DynamicBatchController([0, 1], state)
    with pytest.raises(TypeError, match="rank_weight"):
        DynamicBatchController(sampler, object())
    for kwargs, match in [(dict(replan_every=0), "replan_every"), (dict(smoothing=0.0), "smoothing"),
                          (dict(smoothing=1.5), "smoothing"), (dict(max_change=-1), "max_change"),
                          (dict(max_change=float("inf")), "max_change")]:
        with pytest.raises(ValueError, match=match):
            DynamicBatchController(sampler, state, **kwargs)
    controller = DynamicBatchController(sampler, state)
    with pytest.raises(RuntimeError, match="set_epoch"):
        with controller.step(5):
            pass
    controller.set_epoch(0)
    with pytest.raises(ValueError, match=r"num_samples must be an integer in \[0, 10\]"):
        with controller.step(11):
            pass
    assert state.rank_weight is None  # a rejected step changed nothing


def test_controller_state_dict_round_trip():
    sampler = HeteroSampler(100, 10, 0, 2)
    controller = DynamicBatchController(sampler, AllreduceState())
    controller.speeds = [3.0, 1.0]
    sampler.set_batch_sizes([8, 2])
    saved = controller.state_dict()
    other = DynamicBatchController(HeteroSampler(100, 10, 0, 2), AllreduceState())
    other.load_state_dict(saved)
    assert other.speeds == [3.0, 1.0] and other.sampler.batch_sizes == [8, 2]
    with pytest.raises(ValueError, match="speeds for 2 ranks"):
        DynamicBatchController(HeteroSampler(100, 10, 0, 3), AllreduceState()).load_state_dict(saved)


@pytest.mark.skipif(cpu_quota_unavailable() is not None,
                    reason=f"CPU quota unavailable: {cpu_quota_unavailable()}")
def test_cpu_quota_throttles_a_real_process_and_cleans_up():
    """A busy process under a quota of 0.2 cores is held back by the kernel (its throttled
    time grows), the cgroup holds the configured share, and it is gone afterwards, also
    when the body raises."""
    busy = [sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"]
    with CpuQuota(0.2) as quota:
        path = quota.path
        with open(os.path.join(path, "cpu.cfs_quota_us")) as q, \
                open(os.path.join(path, "cpu.cfs_period_us")) as p:
            assert int(q.read()) / int(p.read()) == pytest.approx(0.2)
        worker = subprocess.Popen(busy)
        quota.add(worker.pid)
        worker.wait()
        assert quota.throttled_seconds() > 0.3  # busy for 1 s wall, allowed 0.2 s of it
    assert not os.path.exists(path)
    with pytest.raises(ZeroDivisionError):
        with CpuQuota(0.5) as quota:
            path = quota.path
            1 / 0
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="cores must be"):
        CpuQuota(0)
