"""DDP communication hooks on real gloo ranks (world size 2 and 3, CPU)."""

import math
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hetero_comm.hooks import (DCT, AllreduceState, DCTQuantState, SegmentSparseState, allreduce_hook,
                               dct_quant_hook, segment_sparse_hook)
from hetero_comm import reference
from hetero_comm.hooks._sparse_parts import DctSegments
from hetero_comm.hooks.segment_sparse import int8_levels
from hetero_comm.hooks.dct_quant import pack_int16_pairs, quantization_levels, unpack_int16_pair_sums
from lab.launch import run_ranks
from hook_workers import (disagreeing_states, hook_warnings, load_into_another_model, loaded,
                          loaded_residual_total,
                          share_one_state, train, train_recording_warnings)

SPARSE = dict(segment_size=16, density=0.05, warmup_steps=2)
DCT_QUANT = dict(block_size=16, keep_ratio=0.25, bits=8, warmup_steps=2)


def weighted_sum(results):
    """sum_i w_i g_i per step, from what each rank produced (already weighted)."""
    return sum(r["produced"] for r in results)


def assert_ranks_identical(results):
    for r in results[1:]:
        np.testing.assert_array_equal(r["params"], results[0]["params"])
        np.testing.assert_array_equal(r["applied"], results[0]["applied"])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("basis", ["elements", "dct"])
def test_sparse_at_full_density_equals_dense_allreduce(world_size, basis):
    settings_ = dict(segment_size=16, density=1.0, warmup_steps=1,
                     basis=DCT(block_size=8) if basis == "dct" else basis)
    results = run_ranks(world_size, train, "sparse", settings_, 5)
    dense = run_ranks(world_size, train, "dense", {}, 5)
    # The DCT basis adds the float32 rounding of a transform and its inverse.
    atol = 1e-7 if basis == "elements" else 1e-6
    np.testing.assert_allclose(results[0]["applied"], weighted_sum(results), rtol=1e-5, atol=atol)
    np.testing.assert_allclose(results[0]["params"], dense[0]["params"], rtol=1e-5, atol=atol)
    np.testing.assert_allclose(results[0]["held_back"], 0.0, atol=atol)
    assert_ranks_identical(results)
    assert dense[0]["stats"]["compression_ratio"] == 1.0


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bits", [16, 32])
def test_dct_keeping_every_coefficient_is_within_quantization_error(world_size, bits):
    block = 16
    results = run_ranks(world_size, train, "dct", dict(block_size=block, keep_ratio=1.0, bits=bits,
                                                   warmup_steps=1), 5)
    expected, applied = weighted_sum(results), results[0]["applied"]
    levels = quantization_levels(bits, world_size)
    # Per coefficient each rank rounds by at most scale / (2 levels), scale <= sqrt(B) max|x|,
    # and the orthonormal inverse spreads at most sqrt(B) times that onto one element;
    # error feedback carries last step's rounding (the same bound) into this step; plus the
    # float32 rounding of the transform itself (about 1e-7 * B relative, see dct_encode).
    largest = max(np.abs(r["produced"]).max() for r in results) * 2
    bound = 2 * world_size * block * largest / (2 * levels) + 1e-6 * block * largest
    assert np.abs(applied - expected).max() <= bound
    assert bound < 1e-2 * np.abs(expected).max()
    assert_ranks_identical(results)


@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [
    ("sparse", SPARSE),
    ("sparse", dict(SPARSE, wire_dtype="float16", density_warmup_steps=3)),
    ("sparse", dict(SPARSE, basis=DCT(8))),
    ("sparse", dict(SPARSE, basis=DCT(4))),
    ("sparse", dict(SPARSE, wire_dtype="int8")),
    ("sparse", dict(SPARSE, wire_dtype="int8", basis=DCT(8))),
    ("sparse", dict(SPARSE, large_gradient_density=0.5, large_gradient_fall=1.5)),
    ("dct", DCT_QUANT),
    ("dct", dict(DCT_QUANT, bits=16)),
    ("dct", dict(DCT_QUANT, bits=32)),
])
@pytest.mark.parametrize("world_size", [2, 3])
def test_conservation_law(hook, settings_, world_size):
    """Applied updates plus what every rank still holds back equals everything produced."""
    results = run_ranks(world_size, train, hook, settings_, 12)
    produced = weighted_sum(results).sum(axis=0)
    held = sum(r["held_back"] for r in results)
    applied = results[0]["applied"].sum(axis=0)
    if settings_.get("wire_dtype") == "float16":
        # The allreduce sums in float16: rounding the sum (half an ulp of each applied value)
        # happens after every rank's error feedback and is not held back by anyone.
        bound = 2.0 ** -11 * np.abs(results[0]["applied"]).sum(axis=0) + 1e-5
        assert (np.abs(applied + held - produced) <= bound).all()
    else:
        np.testing.assert_allclose(applied + held, produced, rtol=1e-4, atol=1e-5)
    assert np.abs(held).max() > 1e-3  # something really was held back (compression happened)
    assert_ranks_identical(results)
    stats = results[0]["stats"]
    assert stats["steps"] == 12 and stats["compression_ratio"] > 1


@pytest.mark.multirank
@pytest.mark.parametrize("basis", ["elements", DCT(8)])
@pytest.mark.parametrize("device_side_checks", [False, True], ids=["codec", "parts"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_conservation_law_of_the_two_phase_int8_sum(basis, device_side_checks, world_size):
    """The int8 wire summed in two phases (the owners' rounding kept in their residuals), on
    the CPU codec and on the GPU's part-by-part path (forced here)."""
    settings_ = dict(SPARSE, wire_dtype="int8", int8_sum="two_phase", basis=basis)
    results = run_ranks(world_size, train, "sparse", settings_, 12,
                        dict(device_side_checks=device_side_checks))
    produced = weighted_sum(results).sum(axis=0)
    held = sum(r["held_back"] for r in results)
    np.testing.assert_allclose(results[0]["applied"].sum(axis=0) + held, produced, rtol=1e-4,
                               atol=1e-5)
    assert np.abs(held).max() > 1e-3
    assert_ranks_identical(results)
    # the two phases really ran: other roundings (127 steps, not 127 // W) and more bytes
    # handed in (the all-gather's chunk and scales) than the allreduce of the same settings
    allreduce = run_ranks(world_size, train, "sparse", dict(settings_, int8_sum="allreduce"), 12,
                          dict(device_side_checks=device_side_checks))
    assert not np.array_equal(results[0]["applied"], allreduce[0]["applied"])
    assert results[0]["stats"]["bytes_sent"] > allreduce[0]["stats"]["bytes_sent"]


@pytest.mark.multirank
@pytest.mark.parametrize("basis", ["elements", "dct"])
def test_sign_output_is_the_sign_of_the_sum(basis):
    """At full density the sum delivered is the weighted sum of what every rank produced;
    output="sign" delivers its sign, and every rank applies the same."""
    settings_ = dict(SPARSE, density=1.0, basis=basis, output="sign")
    results = run_ranks(2, train, "sparse", settings_, 6)
    compressed = slice(settings_["warmup_steps"], None)  # the dense warm-up sends sums
    expected = np.sign(weighted_sum(results)[compressed])
    applied = results[0]["applied"][compressed]
    if basis == "elements":
        np.testing.assert_array_equal(applied, expected)
    else:  # a transform's rounding may flip the sign of a sum within ~1e-6 of zero
        tiny = np.abs(weighted_sum(results)[compressed]) < 1e-5
        np.testing.assert_array_equal(applied[~tiny], expected[~tiny])
    assert_ranks_identical(results)


def segments_of_blocks(by_block: torch.Tensor, size: int) -> torch.Tensor:
    """Plain coefficients [blocks, B] as the DCT segments [groups * B, size]: row g * B + f is
    frequency f of blocks g * size .. (g + 1) * size (the last group padded with zeros)."""
    blocks, block = by_block.shape
    padded = torch.zeros(-(-blocks // size) * size, block)
    padded[:blocks] = by_block
    return padded.view(-1, size, block).transpose(1, 2).reshape(-1, size)


def blocks_of_segments(by_segment: torch.Tensor, blocks: int, block: int) -> torch.Tensor:
    """Inverse of :func:`segments_of_blocks`, the padding dropped."""
    size = by_segment.shape[1]
    return by_segment.reshape(-1, block, size).transpose(1, 2).reshape(-1, block)[:blocks]


@pytest.mark.parametrize("numel,block,group", [(1, 4, 2), (100, 8, 3), (1000, 64, 4), (4096, 16, 16)])
def test_dct_segments_are_one_frequency_of_a_group_of_blocks(numel, block, group):
    generator = torch.Generator().manual_seed(numel)
    residual, contribution, other = (torch.randn(numel, generator=generator) for _ in range(3))
    state = SegmentSparseState(basis=DCT(block), segment_size=group)
    segments = DctSegments(state, residual, torch.empty(numel))
    blocks, size = -(-numel // block), segments.segment
    importance = torch.empty(segments.count)
    expected = segments_of_blocks(reference.dct_encode(residual + contribution, block, block), size)
    segments.accumulate(contribution, importance)
    torch.testing.assert_close(segments.vector.view(-1, size), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(importance, expected.norm(dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(importance.norm(), residual.norm())  # orthonormal: norms carry over
    # What stays unsent goes back into the residual; clear() zeroes segments of another vector.
    sent = torch.tensor([0, segments.count - 1])
    segments.vector.view(-1, size)[sent] = 0.0
    expected[sent] = 0.0
    segments.keep_unsent()
    torch.testing.assert_close(residual, reference.dct_decode(blocks_of_segments(expected, blocks, block),
                                                              block, numel), rtol=0, atol=1e-4)
    cleared = segments_of_blocks(reference.dct_encode(other, block, block), size)
    cleared[sent] = 0.0
    segments.clear(state, other, sent)
    torch.testing.assert_close(other, reference.dct_decode(blocks_of_segments(cleared, blocks, block),
                                                           block, numel), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("variant", [
    dict(basis="elements"),
    dict(basis=DCT(4)),
    dict(wire_dtype="int8", segment_size=512, min_segments_per_bucket=150),  # the SGD recipe's wire and cut
    dict(basis=DCT(8), segment_size=64, min_segments_per_bucket=40),  # fewer blocks
])
def test_unequal_rank_weights_and_uneven_buckets(variant):
    weights = [0.2, 0.3, 0.5]
    options = dict(weights=weights, bucket_cap_mb=0.002)  # several uneven buckets
    sparse = dict(SPARSE, **variant)
    if "wire_dtype" not in variant:  # at full density the float32 wire is the weighted sum
        for hook, settings_ in (("dense", {}), ("sparse", dict(sparse, density=1.0))):
            results = run_ranks(3, train, hook, settings_, 4, options)
            np.testing.assert_allclose(results[0]["applied"], weighted_sum(results), rtol=1e-5, atol=1e-6)
    results = run_ranks(3, train, "sparse", sparse, 8, options)
    produced = weighted_sum(results).sum(axis=0)
    held = sum(r["held_back"] for r in results)
    np.testing.assert_allclose(results[0]["applied"].sum(axis=0) + held, produced, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [("sparse", dict(SPARSE, density=1.0)),
                                            ("sparse", dict(SPARSE, density=1.0, basis="dct")),
                                            ("dct", dict(DCT_QUANT, keep_ratio=1.0, bits=32))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients(hook, settings_, dtype):
    results = run_ranks(2, train, hook, settings_, 4, dict(dtype=dtype))
    dense = weighted_sum(results)
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    np.testing.assert_allclose(results[0]["applied"], dense, rtol=4 * tolerance, atol=1e-3)
    assert_ranks_identical(results)


@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [("sparse", SPARSE), ("dct", DCT_QUANT)])
def test_no_sync_gradient_accumulation(hook, settings_):
    results = run_ranks(2, train, hook, settings_, 12, dict(no_sync_every=3))
    produced = weighted_sum(results).sum(axis=0)
    held = sum(r["held_back"] for r in results)
    np.testing.assert_allclose(results[0]["applied"].sum(axis=0) + held, produced, rtol=1e-4, atol=1e-5)
    assert_ranks_identical(results)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [
    ("sparse", SPARSE),
    ("sparse", dict(SPARSE, momentum=0.9)),
    ("sparse", dict(SPARSE, basis=DCT(8), output="sign")),
    ("sparse", dict(SPARSE, basis=DCT(8), output="sign", scale_sign_step=True)),
    ("sparse", dict(SPARSE, wire_dtype="int8", momentum=0.9)),
    ("sparse", dict(SPARSE, basis=DCT(8), momentum=0.9)),
    # each bucket's segment size from its own size (0.002 MB: buckets of a few hundred elements)
    ("sparse", dict(SPARSE, wire_dtype="int8", momentum=0.9, segment_size=512, min_segments_per_bucket=150)),
    # the watch's running mean and the sum in flight at the checkpoint (decisions from step 7)
    ("sparse", dict(SPARSE, momentum=0.9, large_gradient_density=0.5, large_gradient_fall=1.5)),
    ("dct", DCT_QUANT),
])
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.002])
def test_resume_from_state_dict_continues_exactly(hook, settings_, bucket_cap_mb):
    """A new model, DDP and hook state loaded from rank 0's checkpoint on every rank (as
    frameworks do; the checkpoint sees DDP's provisional bucket layout again) ends bitwise
    where the uninterrupted run ends."""
    options = dict(bucket_cap_mb=bucket_cap_mb, return_state_dict=True)
    uninterrupted = run_ranks(2, train, hook, settings_, 10, options)
    resumed = run_ranks(2, train, hook, settings_, 10, dict(options, resume_at=6))
    for a, b in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(a["params"], b["params"])
        np.testing.assert_array_equal(a["held_back"], b["held_back"])
        if "large_gradient" in a["stats"]:  # the watch's running mean goes on as it would have
            watched = [loaded(run["state_dict"])["large_gradient"] for run in (a, b)]
            assert watched[0] == watched[1] and watched[0]["readings"] == 7


@pytest.mark.multirank
@pytest.mark.parametrize("device_side_checks", [False, True])
def test_non_finite_gradient_in_a_bucket_of_several_plan_buckets(device_side_checks):
    """A resumed run's first step sees DDP's provisional buckets, each sent as several plan
    buckets; a NaN in rank 1's gradient there: every rank gets NaN in what it applies at that
    step and nothing fails, the parts sent before the non-finite one give their buffers back
    once their sums arrive, and the run goes on finite and alike on both ranks."""
    options = dict(bucket_cap_mb=0.002, resume_at=6, nan_at=(1, 6), count_part_routes=True,
                   device_side_checks=device_side_checks)
    results = run_ranks(2, train_recording_warnings, "sparse", SPARSE, 9, options)
    for result in results:
        assert "error" not in result, result.get("error")
        assert 6 in result["part_routes"]  # the path under test was taken
        assert np.isnan(result["applied"][6]).any()
        assert np.isfinite(np.delete(result["applied"], 6, axis=0)).all()
        assert np.isfinite(result["params"]).all()
        assert result["stats"]["non_finite_buckets"] >= 1
    assert_ranks_identical(results)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("basis", [dict(basis="elements"), dict(basis=DCT(4))])
def test_momentum_correction_at_full_density_clears_the_whole_velocity(basis, nesterov):
    """Every segment sent: momentum correction clears the whole velocity each step (in the
    DCT basis, every coefficient), so the result is the weighted sum of the gradients (with
    Nesterov's update ``g + m u``, 1 + m times it after the dense warm-up steps); with sparse
    sends the ranks stay identical."""
    options = dict(weights=[0.25, 0.75], bucket_cap_mb=0.002)
    settings = dict(SPARSE, momentum=0.9, nesterov=nesterov, **basis)
    full = run_ranks(2, train, "sparse", dict(settings, density=1.0), 4, options)
    factor = np.where(np.arange(4) < SPARSE["warmup_steps"], 1.0, 1.9 if nesterov else 1.0)
    np.testing.assert_allclose(full[0]["applied"], factor[:, None] * weighted_sum(full),
                               rtol=1e-5, atol=1e-6)
    assert_ranks_identical(run_ranks(2, train, "sparse", settings, 6, options))


@pytest.mark.multirank
def test_resume_with_each_rank_loading_its_own_checkpoint():
    uninterrupted = run_ranks(3, train, "sparse", SPARSE, 8)
    resumed = run_ranks(3, train, "sparse", SPARSE, 8, dict(resume_at=5, checkpoint_from="own"))
    for a, b in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(a["params"], b["params"])
        np.testing.assert_array_equal(a["held_back"], b["held_back"])


@pytest.mark.multirank
def test_state_dict_into_another_world_size_keeps_what_is_held_back():
    """Rank 0's dict of 2 ranks, loaded by 1 and by 3 ranks: together they hold back what the
    2 did. Rank 1's dict alone cannot serve another rank, and no dict of several ranks can be
    loaded before the process group exists (it could not tell this rank's part)."""
    results = run_ranks(2, train, "sparse", SPARSE, 6, dict(return_state_dict=True))
    checkpoint = loaded(results[0]["state_dict"])
    assert checkpoint["world_size"] == 2 and sorted(checkpoint["ranks"]) == [0, 1]
    saved_total = sum(r["held_back"].sum() for r in results)
    assert np.abs(results[0]["held_back"]).max() > 1e-3  # there was something to keep
    for world_size in (1, 3):
        totals = run_ranks(world_size, loaded_residual_total, "sparse", SPARSE, results[0]["state_dict"])
        assert sum(totals) == pytest.approx(saved_total, rel=1e-5)
    with pytest.raises(RuntimeError, match="load it after init_process_group"):
        SegmentSparseState(**SPARSE).load_state_dict(checkpoint)
    with pytest.raises(RuntimeError, match=r"ValueError: this state_dict holds the part of rank\(s\) \[1\] of 2"):
        run_ranks(1, loaded_residual_total, "sparse", SPARSE, results[1]["state_dict"])


@pytest.mark.multirank
def test_a_state_dict_loaded_for_another_model_says_what_differs():
    saved = run_ranks(2, train, "sparse", SPARSE, 4, dict(return_state_dict=True))[0]["state_dict"]
    messages = run_ranks(2, load_into_another_model, "sparse", SPARSE, saved)
    pattern = r"parameter \d+\.\d+ has \d+ elements but the loaded state_dict has \d+: it is for another model"
    assert all(re.search(pattern, m) for m in messages), messages


def test_settings_are_keyword_only_and_the_process_group_is_checked():
    with pytest.raises(TypeError, match="positional"):
        SegmentSparseState(0.1)
    with pytest.raises(TypeError, match="positional"):
        DCTQuantState(256)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        SegmentSparseState(process_group=0.1)


@pytest.mark.parametrize("hook,state,expected", [
    (segment_sparse_hook, DCTQuantState(), "segment_sparse_hook takes a SegmentSparseState state; got a DCTQuantState"),
    (dct_quant_hook, AllreduceState(), "dct_quant_hook takes a DCTQuantState state; got a AllreduceState"),
    (allreduce_hook, SegmentSparseState(), "allreduce_hook takes a AllreduceState state; got a SegmentSparseState"),
])
def test_a_hook_refuses_another_hooks_state(hook, state, expected):
    with pytest.raises(TypeError, match=expected):
        hook(state, None)


@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [("dense", {}), ("sparse", SPARSE)])
def test_one_state_serves_one_model(hook, settings_):
    messages = run_ranks(2, share_one_state, hook, settings_)
    assert all("already serves another model" in m for m in messages), messages


@pytest.mark.multirank
@pytest.mark.parametrize("hook,settings_", [("sparse", SPARSE), ("sparse", dict(SPARSE, basis="dct")),
                                            ("sparse", dict(SPARSE, wire_dtype="int8")), ("dct", DCT_QUANT)])
def test_steady_state_steps_allocate_no_work_buffers(hook, settings_):
    results = run_ranks(2, train, hook, settings_, 10)
    allocations = results[0]["pool_allocations"]
    assert allocations[3] > 0
    assert allocations[-1] == allocations[3]


NON_FINITE_CASES = [
    ("sparse", SPARSE),
    ("sparse", dict(SPARSE, density=1.0, wire_dtype="float16")),
    ("sparse", dict(SPARSE, basis=DCT(8))),
    ("sparse", dict(SPARSE, wire_dtype="int8")),
    ("dct", DCT_QUANT),
]


@pytest.mark.multirank
@pytest.mark.parametrize("device_side_checks", [False, True])
@pytest.mark.parametrize("hook,settings_", NON_FINITE_CASES)
def test_non_finite_gradient_is_handed_on_as_nan_and_the_bucket_restarts(hook, settings_,
                                                                        device_side_checks):
    """A NaN in rank 1's gradient at step 4 (as a GradScaler's overflow makes): every rank gets
    the bucket as NaN, as DDP's allreduce would hand it on, and the worker skips that step as a
    GradScaler does. The bucket's error feedback restarts from zero, so from step 5 on what
    was applied plus what is held back is again what was produced. One warning names the
    step; ``stats()`` counts one bucket. ``device_side_checks``: CUDA's way (forced here), the
    flag read without a host sync: one NaN in the bucket, the count and the restart at a later
    hook call, once the flag has reached the host (here at once: the next bucket, step 5's)."""
    options = dict(nan_at=(1, 4), device_side_checks=device_side_checks)
    results = run_ranks(2, train_recording_warnings, hook, settings_, 8, options)
    for result in results:
        assert "error" not in result, result.get("error")
        nan = np.isnan(result["applied"][4])  # the (single) bucket
        assert nan.any() if device_side_checks else nan.all()  # the device's way: one element
        assert np.isfinite(np.delete(result["applied"], 4, axis=0)).all()
        assert np.isfinite(result["params"]).all()
        assert result["stats"]["non_finite_buckets"] == 1
        assert len(result["warnings"]) == 1, result["warnings"]
        assert ("non-finite gradient (NaN or infinity) in DDP bucket 0 on at least one rank at "
                "step 4") in result["warnings"][0]
        assert "handed on holding NaN" in result["warnings"][0]
    assert_ranks_identical(results)  # NaN where the other rank has NaN
    produced = weighted_sum(results)[5:].sum(axis=0)
    held = sum(r["held_back"] for r in results)
    applied = results[0]["applied"][5:].sum(axis=0)
    # float16 wire: the allreduce's float16 sum rounds what no rank holds back
    atol = 2e-3 if settings_.get("wire_dtype") == "float16" else 1e-5
    np.testing.assert_allclose(applied + held, produced, rtol=1e-4, atol=atol)


@pytest.mark.multirank
def test_stats_count_bytes_on_the_wire():
    results = run_ranks(2, train, "sparse", SPARSE, 6)
    stats = results[0]["stats"]
    numel = results[0]["params"].size
    dense = numel * 4
    segments = math.ceil(numel / 16)
    k = math.ceil(0.05 * segments)
    # 2 dense warm-up steps, then 4 steps of importance (S float32) + k segments (float32).
    assert stats["bytes_dense"] == 6 * dense
    assert stats["bytes_sent"] == 2 * dense + 4 * (segments * 4 + k * 16 * 4)
    assert stats["compression_ratio"] == pytest.approx(dense / (segments * 4 + k * 16 * 4))
    assert stats["encode_seconds"] > 0 and stats["decode_seconds"] > 0


@pytest.mark.multirank
def test_int8_wire_sends_a_byte_per_value_and_sums_exact_integers():
    """Per compressed step: the importance (S float32) and k segments of one byte each. At
    full density, in the first compressed step (nothing carried over from the dense one), the
    applied sum is within half a step per rank of the exact sum (3 ranks, 42 steps each way of
    a scale shared by every rank, 4x the ranks' mean RMS of the segment)."""
    results = run_ranks(3, train, "sparse", dict(SPARSE, wire_dtype="int8"), 6)
    stats, numel = results[0]["stats"], results[0]["params"].size
    segments = math.ceil(numel / 16)
    k = math.ceil(0.05 * segments)
    assert stats["bytes_sent"] == 2 * numel * 4 + 4 * (segments * 4 + k * 16)
    assert_ranks_identical(results)

    # Segments of one element: the scale is 4x the mean |value| over ranks (no rank exceeds
    # it, so nothing is clipped) and the check does not depend on DDP's bucket layout.
    full = run_ranks(3, train, "sparse", dict(SPARSE, wire_dtype="int8", density=1.0, warmup_steps=1,
                                              segment_size=1), 3)
    ranks = [r["produced"][1] for r in full]
    step = 4 * sum(np.abs(a) for a in ranks) / 3 / 42
    error = np.abs(full[0]["applied"][1] - sum(ranks))
    assert (error <= 1.5 * step * (1 + 1e-5) + 1e-12).all()
    assert (error > 1e-3 * step).any()  # the integers do round
    assert_ranks_identical(full)


def test_int8_wire_refuses_a_world_its_integers_cannot_sum():
    assert int8_levels(2) == 63 and int8_levels(3) == 42 and int8_levels(63) == 2
    with pytest.raises(ValueError, match="at most 63 ranks.*int8_sum='two_phase'"):
        int8_levels(64)


def _optimizer(kind, **settings):
    parameters = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": parameters[:1]}, {"params": parameters[1:], **settings.pop("second", {})}]
    return getattr(torch.optim, kind)(groups, lr=1e-3, **settings)


@pytest.mark.parametrize("output,optimizer,warns", [
    ("momentum correction", lambda: _optimizer("SGD", momentum=0.0), None),
    ("momentum correction", lambda: _optimizer("SGD", momentum=0.0, second={"momentum": 0.9}),
     r"momentum=0.0 in every parameter group \(or call state.prepare_optimizer\(optimizer\)\); "
     r"found momentum \[0.0, 0.9\]"),
    ("sign", lambda: _optimizer("AdamW", betas=(0.0, 0.0)), None),
    ("sign", lambda: _optimizer("Adam", betas=(0.0, 0.0)), None),
    ("sign", lambda: _optimizer("AdamW"), r"betas=\(0.0, 0.0\).*found betas \[\(0.9, 0.999\)\]"),
    ("sign", lambda: _optimizer("AdamW", betas=(0.0, 0.0), second={"betas": (0.9, 0.999)}),
     r"found betas \[\(0.0, 0.0\), \(0.9, 0.999\)\]"),  # one group left at the defaults
    ("sign", lambda: _optimizer("SGD", momentum=0.9), "Adam or AdamW take with betas.*got SGD"),
    ("sign", lambda: _optimizer("Adam", betas=(0.0, 0.0), weight_decay=0.01),
     "Adam's weight_decay 0.01, added to the gradient"),
    ("sum", lambda: _optimizer("AdamW"), None),
    ("sum", lambda: _optimizer("SGD", momentum=0.9), None),
])
def test_check_optimizer_warns_when_the_step_does_not_suit_the_output(output, optimizer, warns):
    state = (SegmentSparseState(density=0.1, momentum=0.9) if output == "momentum correction"
             else SegmentSparseState(density=0.1, basis="dct", output=output))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.check_optimizer(optimizer())
        AllreduceState().check_optimizer(optimizer())  # any optimizer suits a dense hook
    messages = [str(w.message) for w in caught]
    if warns is None:
        assert messages == []
    else:
        assert len(messages) == 1 and re.search(warns, messages[0]), messages
        assert caught[0].category is UserWarning


@pytest.mark.parametrize("make,match", [
    (lambda: SegmentSparseState(density=0.0), r"density must be a number in \(0.0, 1.0\]"),
    (lambda: SegmentSparseState(density=1.5), "density"),
    (lambda: SegmentSparseState(segment_size=0), r"segment_size must be an integer in \[1, 1048576\]"),
    (lambda: SegmentSparseState(momentum=1.0), "momentum"),
    (lambda: SegmentSparseState(nesterov=True), r"nesterov=True needs momentum > 0"),
    (lambda: SegmentSparseState(momentum=0.9, nesterov=1), "nesterov must be True or False"),
    (lambda: SegmentSparseState(wire_dtype="int4"), "wire_dtype must be one of"),
    (lambda: SegmentSparseState(warmup_steps=0), r"warmup_steps must be an integer >= 1"),
    (lambda: SegmentSparseState(min_compress_numel=-1), "min_compress_numel"),
    (lambda: SegmentSparseState(rank_weight=-0.5), "rank_weight"),
    (lambda: SegmentSparseState(density_warmup_steps=-1), "density_warmup_steps"),
    (lambda: SegmentSparseState(basis="wavelet"), "basis must be 'elements', 'dct' or a DCT"),
    (lambda: SegmentSparseState(output="mean"), "output must be one of"),
    (lambda: SegmentSparseState(wire_dtype="int8", int8_sum="ring"), "int8_sum must be one of"),
    (lambda: SegmentSparseState(int8_sum="two_phase"), r"int8_sum='two_phase' says how the int8 "
                                                       r"wire is summed; this state's wire is float32"),
    (lambda: SegmentSparseState(min_segments_per_bucket=-1), "min_segments_per_bucket"),
    (lambda: SegmentSparseState(large_gradient_density=1.5), "large_gradient_density"),
    (lambda: SegmentSparseState(large_gradient_fall=1.0), r"large_gradient_fall must be a number in \(1.0"),
    (lambda: DCTQuantState(block_size=100), "block_size must be a power of two"),
    (lambda: DCTQuantState(block_size=1), "block_size"),
    (lambda: DCTQuantState(keep_ratio=0.0), "keep_ratio"),
    (lambda: DCTQuantState(bits=12), "bits must be one of 8, 16, 32"),
    (lambda: AllreduceState(rank_weight=float("nan")), "rank_weight"),
])
def test_bad_settings_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_state_pickles_without_process_group_and_checks_checkpoint_settings():
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    state = SegmentSparseState(process_group=group, density=0.02)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.density == 0.02
    with pytest.raises(ValueError, match="saved with density=0.02"):
        SegmentSparseState(density=0.05).load_state_dict(state.state_dict())
    fitted = SegmentSparseState(process_group=group, density=0.02, min_segments_per_bucket=150)
    with pytest.raises(ValueError, match="saved with min_segments_per_bucket=150"):
        SegmentSparseState(density=0.02).load_state_dict(fitted.state_dict())
    with pytest.raises(ValueError, match="saved by 'SegmentSparseState'"):
        DCTQuantState().load_state_dict(state.state_dict())


def test_density_schedule_and_cycling_band():
    state = SegmentSparseState(density=0.01, density_warmup_steps=3, warmup_steps=2)
    densities = [state.density_at(step) for step in range(7)]
    assert densities[:2] == [1.0, 1.0] and densities[5:] == [0.01, 0.01]
    assert densities[2] > densities[3] > densities[4] > 0.01
    for steps_taken, expected in ((0, 1.0), (2, 1.0), (3, densities[2]), (9, 0.01)):
        state.step = steps_taken  # stats() reports the density of the last step taken
        assert state.stats()["density"] == expected
    dct = DCTQuantState(block_size=16, keep_ratio=0.25)
    seen = set()
    for step in range(12):
        band = dct.frequencies(step).tolist()
        assert band[:2] == [0, 1] and len(band) == 4 and band == sorted(set(band))
        seen.update(band)
        assert dct.frequencies_on(step, torch.device("cpu")).tolist() == band
    assert seen == set(range(16))  # every frequency is sent eventually
    assert len(dct._bands_on_device) == 7  # the band repeats: 14 frequencies, 2 per step
    assert DCTQuantState(block_size=16, keep_ratio=1.0).frequencies_on(5, torch.device("cpu")) is None


@pytest.mark.multirank
@pytest.mark.parametrize("settings_, warned", [
    (dict(segment_size=64, density=0.1), True),  # one bucket of 1,247 elements: 20 segments
    (dict(segment_size=8, density=0.1), False),  # 156 segments
    (dict(segment_size=64, density=1.0), False),  # every segment sent: no selection
    (dict(segment_size=64, density=0.1, basis="dct"), False),  # measured not to help the DCT basis
    (dict(segment_size=64, density=0.1, min_segments_per_bucket=150), False),  # cut into 156 of 8
])
def test_too_few_segments_per_bucket_warns_once_with_a_size_that_fits(settings_, warned):
    results = run_ranks(2, hook_warnings, "sparse", dict(settings_, warmup_steps=1), 4)
    for messages in results:
        messages = [m for m in messages if "sent at least the bytes" not in m]  # (another test's)
        if not warned:
            assert messages == []
            continue
        assert len(messages) == 1, messages  # once, not every step
        assert "1247 elements of bucket 0 make only 20 segments of 64" in messages[0]
        # 1247 // 150 = 8: 156 segments of 8
        assert "use min_segments_per_bucket=150 (here segments of 8)" in messages[0]
        assert "min_compress_numel=9600" in messages[0]  # or 150 segments of 64: dense below


@pytest.mark.parametrize("numel, minimum, expected", [
    (85_002, 150, 512),  # 167 segments of 512: enough
    (76_799, 150, 512),  # exactly 150 (the last one short)
    (76_000, 150, 256),  # 149 of 512 -> 297 of 256
    (13_834, 150, 64),  # the digits CNN's bucket: 217 segments
    (1_247, 150, 8),
    (299, 150, 1),  # single elements, fewer than asked: the warning's case
    (1_247, 0, 512),  # 0: segment_size everywhere
])
def test_min_segments_per_bucket_picks_the_largest_power_of_two_that_gives_them(numel, minimum,
                                                                                  expected):
    state = SegmentSparseState(segment_size=512, min_segments_per_bucket=minimum)
    assert state.segment_size_for(numel) == expected
    if minimum and 1 < expected < 512:  # enough segments, and the largest size that gives them
        assert math.ceil(numel / expected) >= minimum > math.ceil(numel / (2 * expected))


@pytest.mark.parametrize("numel, block, expected", [
    (38_400, 64, 300),  # 600 blocks: 2 groups of 300, not 512 + 88 real blocks of 512
    (98_304, 64, 512),  # 1,536 blocks: 3 whole groups of 512
    (6_500_000, 64, 511),  # 101,563 blocks: 199 groups
    (1_669, 64, 27),  # one group of every block
    (1, 64, 1),
])
def test_dct_groups_share_the_blocks_evenly(numel, block, expected):
    """The DCT basis cuts as many groups as segments of ``segment_size`` blocks would, then
    shares the blocks evenly among them, so the last group is not mostly padding."""
    state = SegmentSparseState(segment_size=512, basis=DCT(block))
    group = state.segment_size_for(numel)
    assert group == expected
    blocks = math.ceil(numel / block)
    groups = math.ceil(blocks / 512)
    assert math.ceil(blocks / group) == groups  # as many segments as groups of 512 give
    assert groups * group - blocks < groups  # padding: under one block per group


@pytest.mark.parametrize("numel, block, minimum", [(85_002, 64, 150), (1_247, 16, 150),
                                                   (76_000, 64, 150), (299, 64, 150), (4_096, 8, 40)])
def test_min_segments_per_bucket_cuts_dct_segments_into_fewer_blocks(numel, block, minimum):
    """With basis="dct" a segment is one frequency of ``segment_size`` blocks: the option cuts
    segments of fewer blocks, a power of two before the groups are evened out, so that the
    bucket has ``minimum`` of them."""
    state = SegmentSparseState(segment_size=512, basis=DCT(block),
                               min_segments_per_bucket=minimum)
    group = state.segment_size_for(numel)
    blocks = math.ceil(numel / block)

    def count(blocks_per_segment):
        return math.ceil(blocks / blocks_per_segment) * block

    groups = count(group) // block
    assert groups * group - blocks < groups  # evened out: under one block of padding per group
    if count(512) >= minimum:
        assert count(group) == count(512) and group <= 512
    elif count(1) >= minimum:  # enough, and within 4x of the bound numel / minimum gives
        assert count(group) >= minimum and 4 * group > blocks * block // minimum
    else:
        assert group == 1


@pytest.mark.multirank
def test_min_segments_per_bucket_trains_as_the_fitting_segment_size_does():
    """The test model's one bucket (1,247 elements) with segments of 512 and at least 150 of
    them is the same run, bitwise, as segments of 8 (the SGD recipe's settings)."""
    recipe = dict(density=0.08, momentum=0.9, wire_dtype="int8", warmup_steps=1)
    fitted = run_ranks(2, train, "sparse", dict(recipe, segment_size=512, min_segments_per_bucket=150), 6)
    by_hand = run_ranks(2, train, "sparse", dict(recipe, segment_size=8), 6)
    coarse = run_ranks(2, train, "sparse", dict(recipe, segment_size=512), 6)
    for a, b, c in zip(fitted, by_hand, coarse):
        np.testing.assert_array_equal(a["applied"], b["applied"])
        np.testing.assert_array_equal(a["params"], b["params"])
        np.testing.assert_array_equal(a["held_back"], b["held_back"])
        assert not np.array_equal(a["applied"], c["applied"])  # the option did change the cut


def test_a_bucket_under_150_elements_is_told_to_go_dense():
    state = SegmentSparseState(density=0.1, segment_size=64)
    expected = (r"100 elements of bucket 3 make only 2 segments of 64; .*: "
                r"send buckets this small dense \(min_compress_numel=9600\)$")
    with pytest.warns(UserWarning, match=expected):
        state.warn_coarse_segments(3, 100, 64, 2)  # no segment size gives 150 segments


@settings(max_examples=200, deadline=None)
@given(world_size=st.integers(1, 8), data=st.data())
def test_int16_pairs_sum_exactly_through_int32(world_size, data):
    levels = quantization_levels(16, world_size)
    m = data.draw(st.integers(1, 41))
    ranks = [torch.tensor(data.draw(st.lists(st.integers(-levels, levels), min_size=m, max_size=m)),
                          dtype=torch.int16) for _ in range(world_size)]
    words = sum(pack_int16_pairs(q, levels, torch.empty((m + 1) // 2, dtype=torch.int32))
                for q in ranks)
    summed = unpack_int16_pair_sums(words, levels, world_size, m, torch.empty(m, dtype=torch.int32))
    torch.testing.assert_close(summed, sum(q.int() for q in ranks), rtol=0, atol=0)


@pytest.mark.multirank
def test_buckets_that_send_more_than_they_save_warn_once_naming_them():
    """Segments of one value (too few values for more): the importance alone is 4 bytes a
    value, what the dense allreduce sends."""
    tiny = dict(density=0.5, segment_size=1, warmup_steps=1)
    everything = dict(density=1.0, segment_size=64, warmup_steps=1)  # every value, plus importance
    for settings_ in (tiny, everything):
        for warned in run_ranks(2, hook_warnings, "sparse", settings_, 5):
            costly = [w for w in warned if "sent at least the bytes a dense allreduce would" in w]
            assert len(costly) == 1, warned  # once, not every step
            assert "bucket(s) 0 (1247 values)" in costly[0]
            assert "min_compress_numel=1248" in costly[0] and "bucket_cap_mb" in costly[0]
    for warned in run_ranks(2, hook_warnings, "sparse", dict(SPARSE, warmup_steps=1), 5):
        assert not any("sent at least the bytes" in w for w in warned), warned


@pytest.mark.parametrize("hook,settings,rank_settings,named", [
    ("sparse", dict(density=0.1, segment_size=16), dict(density=0.2), "'density': 0.2"),
    ("sparse", dict(density=0.1, segment_size=16), dict(wire_dtype="int8"), "'wire_dtype': 'int8'"),
    ("dct", dict(), dict(keep_ratio=0.5), "'keep_ratio': 0.5"),
    ("two_level", dict(machines=1, density=0.1, segment_size=16), dict(segment_size=32),
     "'segment_size': 32"),
])
@pytest.mark.misuse
def test_states_built_differently_on_the_ranks_raise_on_every_rank_at_the_first_bucket(
        hook, settings, rank_settings, named):
    """A state's settings are compared across the ranks once, at the first bucket: ranks that
    differ raise on every rank, naming each rank's, before anything is exchanged."""
    for raised, message in run_ranks(2, disagreeing_states, hook, settings, rank_settings):
        assert raised == "ValueError" and "settings differ" in message, message
        assert named in message


@pytest.mark.misuse
def test_ranks_grouping_small_buckets_differently_raise_on_every_rank():
    """How many values small buckets gather before one exchange is the library's, not a
    setting; ranks whose libraries differ in it would issue different collectives, so it is
    compared with the settings."""
    for raised, message in run_ranks(2, disagreeing_states, "sparse",
                                     dict(density=0.1, segment_size=16), {}, 1024):
        assert raised == "ValueError" and "'fuse_below_numel': 1024" in message, message


@pytest.mark.misuse
def test_a_rank_weight_of_its_own_is_not_a_disagreement():
    results = run_ranks(2, disagreeing_states, "sparse", dict(density=0.1, segment_size=16),
                        dict(rank_weight=0.25))
    assert results == [("no error", "")] * 2
