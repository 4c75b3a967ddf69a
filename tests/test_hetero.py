"""Batch planning and sampling for unequal ranks, and exactly weighted gradients."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from hetero_comm.hetero import HeteroSampler, plan_batch_sizes
from hook_workers import flat, global_batch, make_model, spawn, weighted_step

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


def test_sampler_first_epoch_is_an_equal_split_and_validates():
    sampler = HeteroSampler(100, 10, 1, 3)
    assert sampler.batch_sizes == [4, 3, 3]
    with pytest.raises(ValueError, match="summing to global_batch_size"):
        sampler.set_batch_sizes([5, 5, 1])
    with pytest.raises(ValueError, match="rank must be"):
        HeteroSampler(100, 10, 3, 3)
    with pytest.raises(ValueError, match="global_batch_size must be"):
        HeteroSampler(100, 2, 0, 3)


@pytest.mark.parametrize("sizes", [[5, 19], [2, 9, 21]])
def test_weighted_gradient_equals_the_global_batch_gradient(sizes):
    """Unequal local batches with rank_weight = b_i / B give exactly the gradient of the mean
    loss over the concatenated global batch."""
    results = spawn(len(sizes), weighted_step, sizes, "dense", {})
    model = make_model()
    x, y = global_batch(sum(sizes))
    nn.functional.mse_loss(model(x), y).backward()
    expected = flat(p.grad for p in model.parameters())
    for r in results:
        np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e-7)
