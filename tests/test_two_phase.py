"""The int8 wire's two-phase sum (all-to-all, each owner's exact sum rounded once, all-gather):
every rank ends with the same bytes, and what the ranks' and the owners' rounding dropped plus
the sum delivered is what the ranks contributed, at any number of ranks."""

import pytest
import torch

import hook_workers
from hetero_comm.hooks._two_phase import TWO_PHASE_LEVELS, owned_bounds, two_phase_wire_bytes
from lab.byte_count import link_bytes
from lab.launch import run_ranks

pytestmark = pytest.mark.multirank


def test_chunks_cover_the_segments_once_and_differ_by_at_most_one():
    for k in (1, 5, 64, 1000):
        for world_size in (1, 2, 3, 8, 64):
            bounds = owned_bounds(k, world_size)
            sizes = [end - start for start, end in zip(bounds, bounds[1:])]
            assert bounds[0] == 0 and bounds[-1] == k and min(sizes) >= 0
            assert max(sizes) - min(sizes) <= 1
    assert two_phase_wire_bytes(10, 4, 3) == 10 * 4 + 4 * (4 + 4)


def check_conservation(results, k, segment):
    contributed = sum(result["values"] for result in results)
    dropped = sum(result["dropped"] for result in results)
    owner_errors = torch.zeros(k, segment)
    for result in results:
        start, stop = result["owned"]
        owner_errors[start:stop] += result["owner_error"]
    decoded = results[0]["decoded"]
    torch.testing.assert_close(decoded + dropped + owner_errors, contributed, rtol=0,
                               atol=1e-5 * contributed.abs().max().item())
    for result in results[1:]:  # every rank holds the same bytes
        assert torch.equal(result["wire"], results[0]["wire"])
        assert torch.equal(result["scale"], results[0]["scale"])
    # the owner's rounding is at most half a step of its own scale
    steps = results[0]["scale"].view(-1, 1) / TWO_PHASE_LEVELS
    assert (owner_errors.abs() <= steps * 0.5 * (1 + 1e-5)).all()


@pytest.mark.parametrize("world_size,k", [(2, 7), (3, 10), (8, 5), (8, 21)])
def test_the_sum_conserves_what_the_ranks_sent(world_size, k):
    check_conservation(run_ranks(world_size, hook_workers.two_phase_sum_parts, k, 6), k, 6)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [16, 64])
def test_the_sum_conserves_at_many_ranks(world_size):
    """64 ranks: beyond the 63 the int8 allreduce can sum; 3 segments, so most own none."""
    k = 3 if world_size == 64 else 40
    check_conservation(run_ranks(world_size, hook_workers.two_phase_sum_parts, k, 4, timeout=300),
                       k, 4)


def test_the_labs_byte_counter_sees_every_collective_the_two_phases_use():
    """bench_convergence's bytes a step come from this counter: an all-to-all or all-gather it
    missed would overstate the two-phase sum's compression."""
    # on the link at 2 ranks: an allreduce its input, an all-gather its input (the other rank's
    # copy), a reduce-scatter half its input, an all-to-all what it sends to the other rank
    assert run_ranks(2, hook_workers.bytes_counted_by_the_lab) == [
        (40 + 12 + 8 + 16 + 12 + 6, 40 + 12 + 4 + 8 + 12 + 4),
        (40 + 12 + 8 + 16 + 12 + 6, 40 + 12 + 4 + 8 + 12 + 2)]


def test_link_bytes_of_each_collective_at_8_ranks():
    assert link_bytes("all_reduce", 100, 8) == 175
    assert link_bytes("all_gather_into_tensor", 10, 8) == 70
    assert link_bytes("reduce_scatter_tensor", 80, 8) == 70
    assert link_bytes("all_to_all_single", 80, 8) == 70
    assert link_bytes("all_to_all_single", 80, 8, kept=20) == 60
    assert link_bytes("all_reduce", 100, 1) == 0
    with pytest.raises(ValueError, match="broadcast"):
        link_bytes("broadcast", 10, 8)


@pytest.mark.parametrize("numel,segment", [(100, 8), (96, 8), (5, 8), (1000, 1)])
def test_the_owners_rounding_is_added_to_exactly_its_segments(numel, segment):
    """In place on plain segments (the short last one included): the same as spreading the
    values over a zero vector (unpack_segments) and adding it."""
    from hetero_comm import ops
    from hetero_comm.hooks._two_phase import add_to_residual

    count = -(-numel // segment)
    generator = torch.Generator().manual_seed(numel)
    for chosen in (torch.tensor([count - 1]), torch.randperm(count, generator=generator)[:max(1, count // 3)].sort().values,
                   torch.tensor([], dtype=torch.int64)):
        residual = torch.randn(numel, generator=generator)
        values = torch.randn(chosen.numel() * segment, generator=generator)
        expected = residual + ops.unpack_segments(values, chosen, segment, numel)
        add_to_residual(residual, values, chosen, segment)
        torch.testing.assert_close(residual, expected, rtol=0, atol=1e-6)


def test_auto_sums_in_two_phases_beyond_the_ranks_an_allreduce_can_sum():
    from hetero_comm.hooks import SegmentSparseState

    for int8_sum, ranks, two_phase, levels in [("auto", 63, False, 2), ("auto", 64, True, 127),
                                               ("auto", 1000, True, 127), ("two_phase", 2, True, 127),
                                               ("allreduce", 8, False, 15)]:
        state = SegmentSparseState(wire_dtype="int8", int8_sum=int8_sum)
        state.exchange_size = lambda ranks=ranks: ranks
        assert state.sums_in_two_phases() is two_phase and state.int8_levels() == levels
    state = SegmentSparseState(wire_dtype="int8", int8_sum="allreduce")
    state.exchange_size = lambda: 64
    with pytest.raises(ValueError, match="at most 63 ranks"):
        state.int8_levels()
