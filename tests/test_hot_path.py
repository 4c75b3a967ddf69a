"""The hook's hot path: what a recipe adds to each DDP bucket, counted so that it cannot creep
back (times are the benchmarks': benchmarks/bench_hook_cost.py)."""

import pytest

import numpy as np

from hook_workers import fused_and_separate, op_calls_per_bucket, step_cut_short
from lab.launch import run_ranks

# encode, the importance's allreduce, pack, the wire's allreduce, unpack: five; the bound
# leaves room for three more, no more (issue 61's aim).
MAX_OP_CALLS_PER_BUCKET = 8


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd_momentum"])
def test_a_recipe_adds_at_most_eight_operator_calls_per_bucket_on_every_thread(optimizer_name,
                                                                             world_size):
    for counted in run_ranks(world_size, op_calls_per_bucket, optimizer_name):
        assert counted["buckets"] >= 4  # small buckets: the per-bucket cost is what shows
        assert counted["ratio"] > 4  # it compressed
        assert 0 < counted["per_bucket"] <= MAX_OP_CALLS_PER_BUCKET, counted


# (fuse_below, min_compress_numel, nan_at, world_size): the whole model (34K values in buckets of
# 5.2-6.3K) in one group; groups
# closed mid-step; dense buckets between grouped ones; a NaN in one bucket; three ranks
FUSED_CASES = {"one group": (None, 0, None, 2), "groups mid-step": (9000, 0, None, 2),
               "dense between": (9000, 5210, None, 2), "a NaN bucket": (9000, 0, 3, 2),
               "three ranks": (9000, 0, None, 3)}


@pytest.mark.multirank
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd_momentum"])
def test_small_buckets_exchanged_together_train_as_when_exchanged_alone(optimizer_name, case):
    """Consecutive small buckets share one allreduce of their importances and one of their
    wires, each keeping its own selection: the same training as bucket by bucket (bitwise at 2
    ranks, where a float sum of two does not depend on its order; within rounding at 3) with
    fewer collectives."""
    fuse_below, min_compress_numel, nan_at, world_size = FUSED_CASES[case]
    for result in run_ranks(world_size, fused_and_separate, optimizer_name, fuse_below,
                            min_compress_numel, nan_at):
        assert np.isfinite(result["fused"]).all() and np.isfinite(result["separate"]).all()
        assert not np.array_equal(result["fused"], result["initial"])  # it trained
        assert result["buckets"] >= 3
        assert result["fused_calls"] < result["separate_calls"]
        if fuse_below is None:  # the whole small model: one group (the SGD recipe's gradient
            # watch adds its allreduce of one float a step)
            assert result["fused_calls"] == 2 + optimizer_name.startswith("sgd")
        if world_size == 2:
            np.testing.assert_array_equal(result["fused"], result["separate"])
        else:
            np.testing.assert_allclose(result["fused"], result["separate"], rtol=1e-5, atol=1e-6)


@pytest.mark.multirank
def test_a_step_cut_short_leaves_nothing_in_flight_for_the_next():
    """A backward that raises midway leaves buckets of that step in the exchange's pipeline:
    the next step's first bucket drops them (their futures fail) instead of grouping them with
    its own, and training goes on alike on every rank."""
    results = run_ranks(2, step_cut_short)
    for result in results:
        assert result["in_flight"] > 0  # the cut step left work behind
        assert result["discarded"] == 1
        assert result["failed"] == result["in_flight"] and result["undone"] == 0
        assert np.isfinite(result["params"]).all()
        assert result["ratio"] > 4
    np.testing.assert_array_equal(results[0]["params"], results[1]["params"])
