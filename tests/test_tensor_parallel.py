"""Tensor-parallel layers (hetero_comm.tensor_parallel): shard sizes by speed, then real gloo
ranks (2 and 3, uneven shards, chunked overlap, 2-D with DDP) whose outputs and gradients must
equal the whole model's, and the errors for bad input."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

from lab.launch import run_ranks
from hetero_comm.tensor_parallel import find_mlps, shard_range, shard_sizes
from tensor_parallel_workers import (bad_input_messages, single_layers_match_whole, speeds_disagree,
                                     split_mlps_match_whole,
                                     tune_chunks_agrees, two_dimensional_matches_whole)

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@given(st.integers(1, 5000), st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6), st.integers(1, 8))
def test_shard_sizes_cover_the_layer_in_proportion(total, speeds, multiple):
    total = max(total - total % multiple, multiple * len(speeds))
    sizes = shard_sizes(total, speeds, multiple)
    assert sum(sizes) == total and len(sizes) == len(speeds)
    assert all(size >= multiple and size % multiple == 0 for size in sizes)
    shares = [total // multiple * speed / sum(speeds) for speed in speeds]
    if min(shares) >= 1:  # then each shard is within one multiple of its exact share
        assert all(abs(size / multiple - share) < 1 for size, share in zip(sizes, shares))


def test_shard_sizes_and_ranges():
    assert shard_sizes(1024, [2.0, 1.0]) == (683, 341)
    assert shard_sizes(1024, [1, 1, 1, 1], multiple=64) == (256,) * 4
    assert [shard_range((3, 5, 2), r) for r in range(3)] == [(0, 3), (3, 8), (8, 10)]
    with pytest.raises(ValueError, match="speeds\\[1\\]"):
        shard_sizes(10, [1.0, 0.0])
    with pytest.raises(ValueError, match="cannot give each"):
        shard_sizes(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="multiple of multiple"):
        shard_sizes(10, [1.0], multiple=4)
    with pytest.raises(ValueError, match="no shard"):
        shard_range((3, 5), 2)


def test_find_mlps_finds_linear_activation_linear_blocks():
    model = nn.Sequential(nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                          nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)))
    assert find_mlps(model) == ["1"]


@pytest.fixture(scope="module")
def split_results():
    results = {}
    for world_size in (2, 3):
        for dtype in (torch.float64, torch.float32):
            for chunks, uneven in ((1, False), (3, True)):
                results[world_size, dtype, chunks, uneven] = run_ranks(
                    world_size, split_mlps_match_whole, dtype, chunks, uneven, timeout=300)
    return results


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunks,uneven", [(1, False), (3, True)])
def test_split_mlps_equal_the_whole_model(split_results, world_size, dtype, chunks, uneven):
    for rank, result in enumerate(split_results[world_size, dtype, chunks, uneven]):
        for name, error in result["errors"].items():
            assert error <= TOLERANCE[dtype], (rank, name, error)
        if uneven:  # speeds 1, 2, 3: the fastest rank holds the most neurons
            assert result["sizes"]["1"] == shard_sizes(13, [1.0, 2.0, 3.0][:world_size])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_column_and_row_parallel_linear_equal_the_whole_layers(world_size):
    for rank, result in enumerate(run_ranks(world_size, single_layers_match_whole, torch.float64,
                                            timeout=300)):
        for name, error in result["errors"].items():
            assert error <= 1e-12, (rank, name, error)


@pytest.mark.multirank
def test_tensor_times_data_parallel_trains_like_the_whole_model():
    for rank, result in enumerate(run_ranks(4, two_dimensional_matches_whole, 2, timeout=300)):
        for name, error in result["errors"].items():
            assert error <= 1e-12, (rank, name, error)


@pytest.mark.misuse
@pytest.mark.multirank
def test_bad_setups_are_clear_errors():
    messages = run_ranks(2, bad_input_messages, timeout=120)[0]
    expected = {
        "sizes short": "ValueError: ColumnParallelLinear: shard sizes (3, 2) must be integers >= 1 "
                       "that sum to the layer's 6 features",
        "sizes per rank": "ValueError: RowParallelLinear: 1 shard sizes for 2 ranks",
        "not linear": "TypeError: ColumnParallelLinear's layer must be an nn.Linear; got Conv1d",
        "activation with parameters": "TypeError: the activation must be a module without parameters",
        "mismatched mlp": "ValueError: fc1 gives 6 features, fc2 takes 5",
        "in-place activation": "ValueError: the activation ReLU(inplace=True) works in place",
        "random activation": "ValueError: the activation Dropout(p=0.1, inplace=False) (at '1' in the "
                             "activation) draws random numbers",
        "in-place hardtanh": "ValueError: the activation Hardtanh(min_val=-1.0, max_val=1.0, "
                             "inplace=True) works in place",
        "randomized leaky relu": "ValueError: the activation RReLU(lower=0.125, upper=0.3333333333333333)"
                                 " draws random numbers",
        "not an mlp": "ValueError: the model has no nn.Sequential(Linear, activation, Linear) block",
        "named block not linear": "TypeError: 0.0 is a Conv1d, not an nn.Linear",
        "missing block": "ValueError: the model has no submodule 'head'",
        "the model is the block": "ValueError: the model itself is an nn.Sequential(Linear, "
                                  "activation, Linear) block, which parallelize_mlps cannot replace",
        "speeds per rank": "ValueError: 1 speeds for 2 ranks in the group",
        "groups do not divide": "ValueError: tensor_parallel_size must be an integer in [1, 2]; got 3",
    }
    for case, start in expected.items():
        assert messages[case].startswith(start), (case, messages[case])


@pytest.mark.multirank
def test_tune_chunks_sets_one_count_every_rank_agrees_on():
    results = run_ranks(2, tune_chunks_agrees, timeout=300)
    chosen = {result[0] for result in results}
    assert len(chosen) == 1 and chosen <= {1, 2, 4}
    for _, chunks, unchanged, errors in results:
        assert chunks == chosen and unchanged  # float64, the same pieces' sums: equal either way
        assert "chunk count must be" in errors[0] and "at least one candidate" in errors[1]
        assert "no TensorParallelMLP block" in errors[2]


@pytest.mark.misuse
def test_ranks_splitting_differently_raise_on_every_rank_with_the_model_unchanged():
    for message, unchanged in run_ranks(2, speeds_disagree):
        assert "parallelize_mlps settings differ" in message and "'shards'" in message, message
        assert unchanged
