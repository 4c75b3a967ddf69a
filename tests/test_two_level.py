"""The two-level sync (issue 36) on real gloo ranks: machines of 2 and 3 ranks, 2 and 3
machines, against the flat hooks; the automatic density's arithmetic on its own."""

import math
import re
import statistics

import numpy as np
import pytest
import torch

from hetero_comm.hooks import DCT, AutoDensity, MachineLayout
from hetero_comm.hooks._auto_density import (AGREE_EVERY, FIT_STEPS, MAX_BANDWIDTH, DensityController,
                                             bandwidth_bounds)
from hetero_comm.hooks.two_level import Shares
from lab.baselines import dequantize_int4, quantize_int4
from lab.launch import run_ranks
from lab.training import TrainConfig, run_training
from hook_workers import (auto_density_agreement, hook_warnings, integer_gradient_steps,
                          prepared_by_two_level, train, train_recording_warnings,
                          two_level_construction_error, two_level_with_this_ranks_layout)

SPARSE = dict(segment_size=16, density=0.05, warmup_steps=2)


def assert_ranks_identical(results):
    for r in results[1:]:
        np.testing.assert_array_equal(r["params"], results[0]["params"])
        np.testing.assert_array_equal(r["applied"], results[0]["applied"])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,machines", [(4, 2), (4, 1), (2, 2), (4, 4)])
def test_without_compression_equals_flat_dense_allreduce_bitwise(world_size, machines):
    """Integer gradients in float64 and weights 1/4 or 1/2: every order of summing is exact,
    so the two-level sum must equal the flat allreduce bit for bit."""
    flat = run_ranks(world_size, integer_gradient_steps, "dense", {}, 4)
    two_level = run_ranks(world_size, integer_gradient_steps, "two_level_dense",
                          dict(machines=machines, warmup_steps=1), 4)
    for result in two_level:
        np.testing.assert_array_equal(result, flat[0])
    assert np.abs(flat[0]).max() > 1  # the gradients are not trivial


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("optimizer_name, kept", [
    ("adamw", dict(betas=[0.9, 0.999])),
    ("sgd_momentum", dict(momentum=0.9)),
])
def test_dense_between_machines_leaves_the_optimizer_as_dense_training_has_it(optimizer_name, kept):
    """The exchange hands the plain sum, so preparing an optimizer changes nothing (the sparse
    exchange with a sign step or momentum correction does change it)."""
    dense = run_ranks(4, prepared_by_two_level, dict(machines=2), optimizer_name, True)
    assert dense == [kept] * 4
    sparse_settings = dict(output="sign") if optimizer_name == "adamw" else dict(momentum=0.9)
    sparse = run_ranks(4, prepared_by_two_level, dict(sparse_settings, machines=2), optimizer_name)
    assert sparse[0] != kept


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size,machines", [(4, 2), (6, 3), (6, 2)])
def test_without_compression_matches_flat_dense_on_a_real_model(world_size, machines):
    """The plain sum is handed on, its dense warm-up step's too."""
    options = dict(dtype=torch.float64)
    flat = run_ranks(world_size, train, "dense", {}, 5, options)
    two_level = run_ranks(world_size, train, "two_level_dense",
                          dict(machines=machines), 5, options)
    assert_ranks_identical(two_level)
    np.testing.assert_allclose(two_level[0]["applied"], flat[0]["applied"], rtol=0, atol=1e-15)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("settings_", [
    SPARSE,
    dict(SPARSE, wire_dtype="int8"),
    dict(SPARSE, wire_dtype="int8", int8_sum="two_phase"),  # the owner's rounding fed back
    dict(SPARSE, basis=DCT(block_size=8), segment_size=4),
    dict(SPARSE, momentum=0.9),
    dict(SPARSE, inside_dtype="bfloat16"),
])
@pytest.mark.parametrize("world_size,machines", [(4, 2), (6, 3)])
def test_conservation_law(settings_, world_size, machines):
    """Applied updates plus what every rank still holds back equals everything produced; every
    rank applies the same."""
    results = run_ranks(world_size, train, "two_level", dict(settings_, machines=machines), 10)
    produced = sum(r["produced"] for r in results).sum(axis=0)
    held = sum(r["held_back"] for r in results)
    applied = results[0]["applied"].sum(axis=0)
    if settings_.get("momentum"):  # the velocity is held too: what is applied lags, not lost
        assert np.abs(held).max() > 1e-3
    elif settings_.get("inside_dtype") == "bfloat16":  # that rounding is not fed back
        # each step: every rank's contribution and the machine's sum rounded to 8 bits
        steps_magnitude = sum(np.abs(r["produced"]) for r in results) + np.abs(results[0]["applied"])
        bound = 2.0 ** -7 * steps_magnitude.sum(axis=0) + 1e-5
        assert (np.abs(applied + held - produced) <= bound).all()
    else:
        np.testing.assert_allclose(applied + held, produced, rtol=1e-4, atol=1e-5)
    assert np.abs(held).max() > 1e-3
    assert_ranks_identical(results)
    stats = results[0]["stats"]
    assert stats["steps"] == 10 and stats["compression_ratio"] > 2
    assert stats["bytes_inside_machines"] > 0


@pytest.mark.multirank
def test_each_rank_holds_back_only_its_share():
    results = run_ranks(4, train, "two_level", dict(SPARSE, machines=2), 6)
    held = np.stack([r["held_back"] for r in results])
    nonzero = np.abs(held) > 0
    assert not (nonzero[0] & nonzero[1]).any() and not (nonzero[2] & nonzero[3]).any()
    assert nonzero[0].any() and nonzero[1].any()


@pytest.mark.multirank
def test_buckets_whose_shares_send_more_than_they_save_warn_once_naming_the_whole_bucket():
    """Segments of one value: each rank's share of the 1,247-value bucket sends 4 bytes of
    importance a value, at least its dense bytes; the warning names the whole bucket, so that
    the min_compress_numel it advises sends that bucket dense. Segments of 16 at 5% send far
    less than dense and do not warn."""
    costly = "sent at least the bytes a dense allreduce would"
    tiny = dict(density=0.5, segment_size=1, warmup_steps=1, machines=2)
    for warned in run_ranks(4, hook_warnings, "two_level", tiny, 5):
        found = [w for w in warned if costly in w]
        assert len(found) == 1, warned  # once, not every step
        assert "bucket(s) 0 (1247 values)" in found[0] and "min_compress_numel=1248" in found[0]
    for settings_ in (dict(tiny, min_compress_numel=1248), dict(SPARSE, machines=2)):
        for warned in run_ranks(4, hook_warnings, "two_level", settings_, 5):
            assert not any(costly in w for w in warned), warned


@pytest.mark.multirank
def test_unequal_rank_weights():
    weights = [0.1, 0.2, 0.3, 0.4]
    flat = run_ranks(4, train, "dense", {}, 4, dict(weights=weights, dtype=torch.float64))
    two_level = run_ranks(4, train, "two_level_dense", dict(machines=2), 4,
                          dict(weights=weights, dtype=torch.float64))
    np.testing.assert_allclose(two_level[0]["applied"], flat[0]["applied"], rtol=0, atol=1e-15)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("checkpoint_from", ["rank0", "own"])
@pytest.mark.parametrize("settings_", [SPARSE, dict(SPARSE, wire_dtype="int8", momentum=0.9)])
def test_resume_continues_exactly(settings_, checkpoint_from):
    settings_ = dict(settings_, machines=2)
    uninterrupted = run_ranks(4, train, "two_level", settings_, 9)
    resumed = run_ranks(4, train, "two_level", settings_, 9,
                        dict(resume_at=5, checkpoint_from=checkpoint_from))
    for a, b in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(a["params"], b["params"])
        np.testing.assert_array_equal(a["held_back"], b["held_back"])


@pytest.mark.multirank
def test_non_finite_gradient_is_handed_on_as_nan_on_every_rank():
    """A NaN in rank 1's gradient at step 4: every rank of both machines gets the bucket as
    NaN (the worker skips that step, as a GradScaler would), one warning and one count each;
    the error feedback restarts, so from step 5 on applied plus held back is what was
    produced."""
    results = run_ranks(4, train_recording_warnings, "two_level", dict(SPARSE, machines=2), 8,
                        dict(nan_at=(1, 4)))
    for result in results:
        assert "error" not in result, result.get("error")
        assert np.isnan(result["applied"][4]).all()
        assert np.isfinite(np.delete(result["applied"], 4, axis=0)).all()
        assert result["stats"]["non_finite_buckets"] == 1
        assert len(result["warnings"]) == 1 and "at step 4" in result["warnings"][0]
    assert_ranks_identical(results)
    produced = sum(r["produced"] for r in results)[5:].sum(axis=0)
    held = sum(r["held_back"] for r in results)
    np.testing.assert_allclose(results[0]["applied"][5:].sum(axis=0) + held, produced,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.multirank
def test_automatic_density_stays_in_its_bounds_and_ranks_agree():
    settings_ = dict(SPARSE, machines=2, density=AutoDensity(floor=0.02, ceiling=0.3),
                     wire_dtype="int8")
    results = run_ranks(4, train, "two_level", settings_, 10)
    assert_ranks_identical(results)
    densities = {r["stats"]["density"] for r in results}
    assert len(densities) == 1 and 0.02 <= densities.pop() <= 0.3


@pytest.mark.multirank
@pytest.mark.parametrize("resume_at", [5, 6])  # with an agreement in flight, or just read
def test_the_agreement_takes_each_rails_least_seconds_every_few_steps_and_resumes_exactly(resume_at):
    """Two machines of two rails (four ranks): every AGREE_EVERY-th proposal is agreed (the
    same on every rank, returned once, a step later) and moves the density within its bounds;
    each step's seconds become the least its rail measured (the first machine's, which waited
    for no one; not the other rail's, which sent other bytes) once its agreement is read; a copy
    resumed mid-run agrees and reads alike."""
    steps = 14
    results = run_ranks(4, auto_density_agreement, steps, resume_at, 2)
    agreed = results[0]["agreed"][0]
    returned = [step for step, value in enumerate(agreed) if value is not None]
    assert returned == list(range(1, steps, AGREE_EVERY))
    assert len({agreed[step] for step in returned}) > 2 and all(0.02 < agreed[step] < 0.5 for step in returned[1:])
    read = returned[-1] - 1  # the steps agreed on by the last read: 0 .. read
    for result in results:
        assert result["agreed"][0] == agreed and result["agreed"][1] == agreed[resume_at:]
        for index, first in ((0, 0), (1, resume_at)):
            least = result["least"][index]
            assert least[:read + 1 - first] == pytest.approx(result["expected"][first:read + 1])
            assert all(value is None for value in least[read + 1 - first:])
    assert results[1]["expected"][4] != pytest.approx(results[0]["expected"][4])  # rails differ


@pytest.mark.multirank
def test_a_rank_that_exchanges_nothing_has_no_say():
    """A rank whose shares are all empty measures nothing and would propose its density as it
    is, holding every rank below there; the other moves it up from the floor alike."""
    results = run_ranks(2, auto_density_agreement, 18, 99, 1, 1, 0.02)
    agreed = [value for value in results[0]["agreed"][0] if value is not None]
    assert results[1]["agreed"][0] == results[0]["agreed"][0]
    assert agreed == sorted(agreed) and agreed[-1] > 0.1  # up towards 25 KB a step


@pytest.mark.multirank
def test_int4_baseline_is_close_to_dense_and_identical_on_every_rank():
    flat = run_ranks(4, train, "dense", {}, 4)
    int4 = run_ranks(4, train, "int4_qgz", dict(machines=2, block=32), 4)
    assert_ranks_identical(int4)
    error = np.abs(int4[0]["applied"] - flat[0]["applied"]).max() / np.abs(flat[0]["applied"]).max()
    assert 0 < error < 0.3  # two int4 roundings of 7 levels, no error feedback


@pytest.mark.slow
@pytest.mark.multirank
def test_composes_with_dropped_units_and_dynamic_batches():
    config = TrainConfig(hook="two_level", hook_settings=dict(density=0.1, segment_size=16, machines=2),
                         workers=4, epochs=1, max_steps=8, global_batch=64, dropout=0.5,
                         dropout_kind="unit", skip_dropped=True, batching="dynamic", replan_every=3)
    record = run_training(config, timeout=300)
    assert record["ranks_identical"] and record["steps"] == 8
    assert math.isfinite(record["history"]["loss"][-1])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,settings_,pattern", [
    (3, dict(machines=[0, 0, 1]), "machines of unequal rank counts are not supported"),
    (2, dict(machines=[0]), "machines has 1 labels but the process group has 2 ranks"),
    (4, dict(machines=3), "does not divide the 4 ranks"),
    (2, dict(machines="two"), "one label per rank"),
    (2, dict(machines=1, density="fast"), "density must be a number"),
    (2, dict(machines=1, inside_dtype="float8"), "inside_dtype must be one of"),
])
@pytest.mark.misuse
def test_bad_layouts_and_settings_raise_clear_errors(world_size, settings_, pattern):
    for kind, message in run_ranks(world_size, two_level_construction_error, settings_):
        assert kind == "ValueError" and re.search(pattern, message), message


@pytest.mark.misuse
@pytest.mark.multirank
def test_ranks_passing_different_layouts_all_raise_instead_of_waiting():
    layouts = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1]]
    for kind, message in run_ranks(4, two_level_with_this_ranks_layout, layouts, timeout=120):
        assert kind == "ValueError", message
        assert "rank 2: [0, 1, 0, 1]" in message and "every rank must pass the same machine layouts" in message


@pytest.mark.parametrize("numel,local_size,unit", [(1, 2, 16), (100, 2, 16), (4096, 3, 64),
                                                   (33, 4, 8), (7, 1, 4)])
def test_shares_partition_the_bucket_in_whole_units(numel, local_size, unit):
    covered = []
    for rank in range(local_size):
        shares = Shares(numel, local_size, rank, unit)
        assert (shares.start % unit == 0 or shares.start == numel) and shares.start <= shares.stop <= numel
        covered.extend(range(shares.start, shares.stop))
    assert covered == list(range(numel))
    flat = torch.arange(numel, dtype=torch.float32)
    staged = torch.full((local_size * shares.slot,), float("nan"))
    shares.stage(flat, staged, 0.5)
    assert (shares.flags(staged) == 0).all()
    out = torch.empty(numel)
    shares.unstage(staged, out)
    torch.testing.assert_close(out, flat * 0.5)


def test_machine_layout_groups_ranks_by_label():
    layout = MachineLayout(["b", "a", "b", "a"])
    assert layout.machines == 2 and layout.local_size == 2
    assert layout.ranks_of_machine == ((0, 2), (1, 3))
    assert layout.rail(1) == (2, 3) and layout.local_rank(3) == 1


def test_automatic_density_hides_the_exchange_and_follows_a_changing_link():
    """Synthetic measurements: a link of 1 MB/s and a 0.1 s window afford 100 KB a step."""
    auto = DensityController(AutoDensity(0.01, 0.5), wire_bytes_per_value=1, segment_size=512)
    values = 2_000_000  # per step, between machines
    density = 0.5

    def step(bandwidth, window=0.1):
        nonlocal density
        sent = values * auto.bytes_per_value(density)
        auto.add_exchange(int(sent), sent / bandwidth, 0.0)
        density = auto.propose(window, window, density)
        return density

    for _ in range(12):
        step(1e6)
    assert math.isclose(values * auto.bytes_per_value(density), 1e6 * 0.1, rel_tol=0.05)
    for _ in range(6):  # the link becomes 4x faster: followed within 6 steps
        step(4e6)
    assert math.isclose(values * auto.bytes_per_value(density), 4e5, rel_tol=0.1)
    for _ in range(20):  # far too slow: the floor
        step(1e3)
    assert density == 0.01


def test_one_step_whose_codec_ate_the_window_does_not_move_the_density():
    """Such a step affords nothing; the median of the last five steps ignores it (a running
    mean in log space halved the density, seen at 1 Gbit/s in bench_two_level)."""
    auto = DensityController(AutoDensity(0.01, 0.5), wire_bytes_per_value=1, segment_size=512)
    values, density = 2_000_000, 0.5
    for step in range(14):
        sent = values * auto.bytes_per_value(density)
        codec = 0.2 if step == 12 else 0.0
        auto.add_exchange(int(sent), sent / 1e6, codec)
        before, density = density, auto.propose(0.1, 0.1, density)
    assert math.isclose(density, before, rel_tol=1e-9)
    assert math.isclose(values * auto.bytes_per_value(density), 1e5, rel_tol=0.05)


def drive_link(auto: DensityController, values: int, density: float, steps: int, seconds_for) -> float:
    """``steps`` steps of ``values`` values a step over a synthetic link whose exchange of
    ``sent`` bytes takes ``seconds_for(sent)``, a 0.1 s window each: the density they end at."""
    for _ in range(steps):
        sent = values * auto.bytes_per_value(density)
        auto.add_exchange(int(sent), seconds_for(sent), 0.0)
        density = auto.propose(0.1, 0.1, density)
    return density


def test_automatic_density_sees_through_a_latency_that_does_not_grow_with_the_bytes():
    """A 1 Gbit/s link (125 MB/s) whose collectives also wait 37 ms (latency, the other
    machine's ranks): a 0.1 s window affords 12.5 MB. Bytes over seconds would settle at 7.9 MB
    (where 0.037 + bytes / 125e6 = 0.1); the slope of seconds against bytes finds 125 MB/s."""
    auto = DensityController(AutoDensity(0.01, 1.0), wire_bytes_per_value=1, segment_size=512)
    values = 20_000_000
    density = drive_link(auto, values, 1.0, 30, lambda sent: 0.037 + sent / 125e6)
    assert math.isclose(values * auto.bytes_per_value(density), 12.5e6, rel_tol=0.05)
    resumed = DensityController(AutoDensity(0.01, 1.0), wire_bytes_per_value=1, segment_size=512)
    resumed.load_state_dict(auto.state_dict())
    for run in (auto, resumed):  # the fit is part of the checkpoint: both continue alike
        run.add_exchange(int(values * run.bytes_per_value(density)), 0.2, 0.0)
    assert auto.propose(0.1, 0.1, density) == resumed.propose(0.1, 0.1, density)


def test_a_fast_reading_gives_way_when_the_link_slows_under_noise():
    """Read on a fast link, then the link is 10x slower with seconds jittered around the wire
    time: the old reading is dropped and the density follows the slow link."""
    auto = DensityController(AutoDensity(0.01, 1.0), wire_bytes_per_value=1, segment_size=512)
    values = 20_000_000
    density = drive_link(auto, values, 1.0, 30, lambda sent: 0.037 + sent / 125e6)
    noise = torch.Generator().manual_seed(1)
    density = drive_link(auto, values, density, 60,
                         lambda sent: (1 + 0.5 * float(torch.rand(1, generator=noise))) * sent / 12.5e6)
    # 12.5 MB/s x 0.1 s = 1.25 MB a step; the jitter (up to half the wire time) hides a little
    # more than that from the reading of what the link carries at most, and the middle (0.1,
    # 2 MB a step) is shown too much
    assert 0.01 < density < auto.middle and values * auto.bytes_per_value(density) <= 1.25e6 * 1.25


def spread_exchanges(seconds_for, steps: int = 16) -> list:
    """(bytes, seconds) of ``steps`` exchanges of 1-4 MB, ``seconds_for(bytes, noise)`` each."""
    noise = torch.Generator().manual_seed(0)
    return [(sent, seconds_for(sent, float(torch.rand(1, generator=noise))))
            for sent in (1e6 * (1 + step % 4) for step in range(steps))]


def test_the_bandwidth_is_read_from_the_slope_taken_high_and_low_by_its_error():
    # seconds on a line: the line's bandwidth, at least and at most
    line = bandwidth_bounds(spread_exchanges(lambda sent, _: 0.05 + sent / 1e8))
    assert math.isclose(line[0], 1e8, rel_tol=1e-6) and math.isclose(line[1], 1e8, rel_tol=1e-6)
    # flat seconds (latency, waiting) while the bytes spread 4x: 3 MB more cost nothing
    # measurable, the link is fast (at least 3 MB per two standard errors of 20 ms noise)
    flat = bandwidth_bounds(spread_exchanges(lambda sent, u: 0.05 + 0.02 * u))
    assert flat[0] > 1e8 and flat[1] == math.inf
    # a 1e8 B/s line under noise ten times its spread: little evidence either way
    noisy = bandwidth_bounds(spread_exchanges(lambda sent, u: 0.05 + sent / 1e8 + 0.3 * u))
    assert noisy[0] < 0.2e8 and noisy[1] == math.inf
    # a slow line (1e6 B/s) under the same noise: shown slow, at most a few MB/s
    slow = bandwidth_bounds(spread_exchanges(lambda sent, u: 0.05 + sent / 1e6 + 0.3 * u))
    assert slow[0] < 1e6 < slow[1] < 2e6
    # bytes that do not spread: nothing can be read
    assert bandwidth_bounds([(1e6, 0.05 + 0.01 * i) for i in range(16)]) is None
    flat_exact = bandwidth_bounds([(1e6 * (1 + i % 2), 0.05) for i in range(16)])
    assert flat_exact == (MAX_BANDWIDTH, math.inf)


def drive_with_agreement_lag(auto: DensityController, values: int, density: float, steps: int,
                             seconds_for, window: float = 0.04, codec: float = 0.0) -> list:
    """As the hook runs it: the proposal of every AGREE_EVERY-th step is agreed at the next
    step's end and runs from the step after that. The densities the steps ran at."""
    ran, posted = [], None
    for step in range(steps):
        ran.append(density)
        sent = values * auto.bytes_per_value(density)
        auto.add_exchange(int(sent), seconds_for(sent), codec)
        proposal = auto.propose(window, window, density)
        if posted is not None:
            density, posted = posted, None
        if step % AGREE_EVERY == 0:
            posted = proposal
    return ran


@pytest.mark.parametrize("segment_size", [256, 512])
def test_a_latency_bound_exchange_pinned_at_the_floor_probes_and_rises(segment_size):
    """Seconds that are all latency (50 ms, longer than the 40 ms window): bytes over seconds
    reads a slow link and pins the floor, where the bytes never spread. One probe at twice the
    bytes (proposed at the first agreement once FIT_STEPS steps are kept, it runs until the
    next one applies) shows the seconds do not grow, and the density climbs to the ceiling."""
    auto = DensityController(AutoDensity(0.01, 0.25), wire_bytes_per_value=1, segment_size=segment_size)
    ran = drive_with_agreement_lag(auto, 1_000_000, 0.01, 40, lambda sent: 0.05 + sent / 125e6)
    probe = 2 * 0.01 + 4 / segment_size / 1  # twice the floor's bytes
    start = math.ceil((FIT_STEPS - 1) / AGREE_EVERY) * AGREE_EVERY + 2
    assert ran[:start] == [0.01] * start  # pinned until the probe runs
    assert all(math.isclose(density, probe) for density in ran[start:start + AGREE_EVERY])
    assert ran[start + AGREE_EVERY] > probe and ran[-1] == 0.25


@pytest.mark.parametrize("segment_size", [256, 512])
def test_a_slow_link_at_the_floor_pays_one_probe_in_40_steps(segment_size):
    """A link that is slow for real (100 KB/s): each probe reads it and the floor returns; the
    reading lasts until the probe leaves the last FIT_STEPS steps and FIT_STEPS more, and a
    probe runs from one agreement to the next (AGREE_EVERY steps)."""
    auto = DensityController(AutoDensity(0.01, 0.25), wire_bytes_per_value=1, segment_size=segment_size)
    ran = drive_with_agreement_lag(auto, 1_000_000, 0.01, 120, lambda sent: sent / 1e5)
    probes = [step for step, density in enumerate(ran) if density > 0.01]
    assert max(ran) == 2 * 0.01 + 4 / segment_size
    starts = [step for step in probes if step - 1 not in probes]
    assert len(probes) == len(starts) * AGREE_EVERY and len(starts) == 3
    assert starts[1] - starts[0] == starts[2] - starts[1] == 2 * FIT_STEPS + 2 * AGREE_EVERY


def test_no_probe_above_the_floor():
    """A density settled between the bounds whose bytes stop spreading: the lower bound takes
    over when the fit expires, no probe step."""
    auto = DensityController(AutoDensity(0.01, 0.5), wire_bytes_per_value=1, segment_size=512)
    ran = drive_with_agreement_lag(auto, 2_000_000, 0.5, 120, lambda sent: sent / 1e6, window=0.1)
    assert 0.01 < ran[20] < 0.5  # settled, and never probed:
    assert all(math.isclose(density, ran[20], rel_tol=1e-9) for density in ran[20:])


def jittered(seconds_for, seed: int = 0, jitter: float = 0.004):
    """``seconds_for`` plus up to ``jitter`` seconds of waiting, uniformly at random."""
    noise = torch.Generator().manual_seed(seed)
    return lambda sent: seconds_for(sent) + jitter * float(torch.rand(1, generator=noise))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("codec", [0.0, 0.002])
def test_kilobytes_lost_in_jitter_run_at_the_middle_not_the_floor(seed, codec):
    """bench_two_level's MLP over 1 Gbit/s: 3-13 KB a step (24-100 us of wire) under 1.5 ms of
    latency and 0-4 ms of waiting, 1 ms a step to give the exchange (all of it, or less than
    the codec's 2 ms). No reading shows the link fast enough (bytes over seconds: 2 MB/s), nor
    too slow for the middle: the middle, after the first probe."""
    auto = DensityController(AutoDensity(0.055, 0.242), wire_bytes_per_value=1, segment_size=256)
    ran = drive_with_agreement_lag(auto, 42_500, 0.242, 120,
                                   jittered(lambda sent: 0.0015 + sent / 125e6, seed),
                                   window=0.001, codec=codec)
    assert auto.middle == pytest.approx(math.sqrt(0.055 * 0.242))
    assert statistics.median(ran[40:]) == pytest.approx(auto.middle)


@pytest.mark.parametrize("seed", range(3))
def test_a_link_shown_too_slow_for_the_middle_goes_below_it(seed):
    """The same exchange over 0.5 MB/s: the middle's 5.6 KB take 11 ms, the floor's 3.2 KB
    6.4 ms, a difference the 0-4 ms of waiting cannot hide: the floor."""
    auto = DensityController(AutoDensity(0.055, 0.242), wire_bytes_per_value=1, segment_size=256)
    ran = drive_with_agreement_lag(auto, 42_500, 0.242, 120,
                                   jittered(lambda sent: 0.0015 + sent / 0.5e6, seed), window=0.001)
    assert statistics.median(ran[40:]) == 0.055


def test_without_a_window_the_exchange_takes_a_quarter_of_the_compute():
    """One bucket leaves no backward window: 0.4 s of compute affords 0.1 s of a 1 MB/s link."""
    auto = DensityController(AutoDensity(0.01, 0.5), wire_bytes_per_value=1, segment_size=512)
    density, values = 0.5, 2_000_000
    for _ in range(12):
        sent = values * auto.bytes_per_value(density)
        auto.add_exchange(int(sent), sent / 1e6, 0.0)
        density = auto.propose(0.0, 0.4, density)
    assert math.isclose(values * auto.bytes_per_value(density), 1e5, rel_tol=0.05)


def test_int4_quantization_round_trips_within_half_a_step():
    values = torch.randn(1000)
    packed, scales = quantize_int4(values, 64)
    assert packed.dtype == torch.uint8 and packed.numel() == 16 * 64 // 2
    back = dequantize_int4(packed, scales, 1000)
    step = torch.repeat_interleave(scales, 64)[:1000]
    assert (torch.abs(back - values) <= step / 2 + 1e-6).all()

