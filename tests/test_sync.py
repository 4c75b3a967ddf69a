"""Group synchronisation (:mod:`hetero_comm.sync`): grouping, the staleness bookkeeping on a
simulated clock, and real gloo runs (equality with synchronous training, conservation of every
contribution, checkpoint and resume, a stalled group, bad settings)."""

import heapq

import numpy as np
import pytest
import torch

from lab.baselines import decode_top_k_2bit, encode_top_k_2bit
from lab.launch import run_ranks
from hetero_comm.sync import (Contribution, Grouping, SparseWire, VersionBook, groups_from_sites,
                              groups_from_speeds, inverse_staleness, periods_for_speeds)
from hetero_comm.sync.parts import ForwardClock, split_into_parts
from hetero_comm.sync.wire import Wire, pack_codes, unpack_codes

import sync_workers


# ----- grouping ------------------------------------------------------------------------------
def test_groups_from_sites_keeps_each_site_together_in_order_of_first_rank():
    grouping = groups_from_sites(["b", "a", "b", "a", "c"])
    assert grouping.groups == ((0, 2), (1, 3), (4,))
    assert grouping.leaders == (0, 1, 4)
    assert grouping.group_of(3) == 1


def test_groups_from_speeds_cuts_at_the_large_gaps():
    speeds = [10.0, 3.0, 9.0, 2.9, 1.0]
    assert groups_from_speeds(speeds, max_spread=1.5).groups == ((0, 2), (1, 3), (4,))
    assert groups_from_speeds(speeds, num_groups=2).groups == ((0, 2), (1, 3, 4))
    assert groups_from_speeds(speeds, num_groups=1).groups == ((0, 1, 2, 3, 4),)
    assert groups_from_speeds([5.0, 5.0, 5.0]).groups == ((0, 1, 2),)


def test_sample_share_weights_groups_by_their_ranks_batches():
    grouping = Grouping(((0, 1), (2,)), batch_sizes=(30, 30, 20))
    assert grouping.sample_share(0) == pytest.approx(0.75)
    assert grouping.sample_share(1) == pytest.approx(0.25)
    assert Grouping(((0,), (1, 2))).sample_share(1) == pytest.approx(2 / 3)


def test_periods_keep_every_groups_rounds_at_the_slowest_groups_pace():
    grouping = Grouping(((0, 1), (2, 3), (4,)))
    # group speeds are their slowest ranks': 9, 3 and 4.5
    assert periods_for_speeds(grouping, [10.0, 9.0, 3.0, 3.5, 4.5], 4) == (12, 4, 6)
    assert periods_for_speeds(grouping, [1.0] * 5, 3) == (3, 3, 3)


@pytest.mark.parametrize("make, match", [
    (lambda: periods_for_speeds(Grouping(((0,), (1,))), [1.0], 4), "one value per rank"),
    (lambda: periods_for_speeds(Grouping(((0,), (1,))), [1.0, 1.0], 0), "period"),
    (lambda: Grouping(((0,), (2,))), "every rank"),
    (lambda: Grouping(((0, 1), (1,))), "every rank"),
    (lambda: Grouping(((0,), ())), "non-empty"),
    (lambda: Grouping(((0,), (1,)), batch_sizes=(4,)), "one entry per rank"),
    (lambda: Grouping(((0,), (1,)), batch_sizes=(4, 0)), "batch_sizes"),
    (lambda: groups_from_speeds([1.0, 0.0]), "speeds"),
    (lambda: groups_from_speeds([1.0, 2.0], num_groups=3), "num_groups"),
    (lambda: groups_from_speeds([1.0, 2.0], max_spread=1.0), "max_spread"),
    (lambda: groups_from_sites([]), "one label per rank"),
])
def test_bad_groupings_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----- versions and staleness, without transport ----------------------------------------------
def test_staleness_counts_the_receivers_versions_the_contribution_did_not_see():
    fast = VersionBook(2, 0, max_staleness=4)
    for _ in range(3):
        fast.record_made()
    # The slow group's first contribution saw none of the fast group's 3: the one made in the
    # same round does not count, so it is 2 versions stale, scaled by 1 / 3.
    assert fast.accept(Contribution(1, 0, (0, 0), None)) == (2, pytest.approx(1 / 3))
    # Its second saw all three: not stale.
    assert fast.accept(Contribution(1, 1, (3, 1), None)) == (0, 1.0)
    with pytest.raises(RuntimeError, match="lost or repeated"):
        fast.accept(Contribution(1, 1, (3, 1), None))
    with pytest.raises(RuntimeError, match="lost or repeated"):
        fast.accept(Contribution(1, 3, (3, 3), None))
    with pytest.raises(ValueError, match="cannot be applied"):
        fast.accept(Contribution(0, 3, (3, 0), None))
    stats = fast.stats()
    assert stats["contributions_applied"] == 2 and stats["max_staleness_seen"] == 2
    assert stats["mean_scale"] == pytest.approx((1 / 3 + 1) / 2)


def test_the_bound_counts_arrived_contributions_and_a_custom_rule_is_used():
    book = VersionBook(2, 0, max_staleness=1, staleness_scale=lambda tau: 0.0 if tau > 1 else 1.0)
    for _ in range(3):
        book.record_made()
    assert book.lagging_group() == 1
    assert book.lagging_group({1: 1}) == 1 and book.lagging_group({1: 2}) is None
    assert book.accept(Contribution(1, 0, (0, 0), None)) == (2, 0.0)
    assert book.stats()["dropped"] == 1
    bad = VersionBook(2, 0, staleness_scale=lambda tau: 2.0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        bad.accept(Contribution(1, 0, (0, 0), None))
    with pytest.raises(ValueError, match="max_staleness"):
        VersionBook(2, 0, max_staleness=-1)
    with pytest.raises(ValueError, match="staleness_scale"):
        VersionBook(2, 0, staleness_scale=0.5)


def simulate(round_seconds, delay, max_staleness, rounds):
    """Groups that make a contribution every ``round_seconds[g]`` of a simulated clock; a
    message arrives ``delay`` later; a group over the bound polls every ``delay`` until the
    contribution it needs has arrived. Returns the books and every application (receiver, its
    made, the contribution, tau, scale)."""
    num = len(round_seconds)
    books = [VersionBook(num, g, max_staleness=max_staleness) for g in range(num)]
    inbox = {g: [] for g in range(num)}  # (arrival time, contribution)
    events = [(round_seconds[g], g, "make") for g in range(num)]
    applications = []
    while events:
        now, g, phase = heapq.heappop(events)
        book = books[g]
        if phase == "make":
            if book.made >= rounds:
                continue
            seen = book.seen()
            version = book.record_made()
            for h in range(num):
                if h != g:
                    inbox[h].append((now + delay, Contribution(g, version, seen, None)))
        arrived = {h: sum(1 for t, c in inbox[g] if c.source == h and t <= now) for h in range(num)}
        if book.lagging_group(arrived) is not None:
            heapq.heappush(events, (now + delay, g, "wait"))
            continue
        for t, c in sorted((m for m in inbox[g] if m[0] <= now), key=lambda m: (m[1].source, m[1].version)):
            made = book.made
            tau, scale = book.accept(c)
            applications.append((g, made, c, tau, scale))
            inbox[g].remove((t, c))
        heapq.heappush(events, (now + round_seconds[g], g, "make"))
    return books, applications


def test_simulated_clock_staleness_rule_and_bound():
    books, applications = simulate([1.0, 3.0], delay=0.25, max_staleness=2, rounds=12)
    for receiver, made, contribution, tau, scale in applications:
        assert tau == max(0, made - contribution.seen[receiver] - 1)
        assert scale == pytest.approx(inverse_staleness(tau))
    fast_taus = [tau for receiver, _, _, tau, _ in applications if receiver == 0]
    slow_taus = [tau for receiver, _, _, tau, _ in applications if receiver == 1]
    # The slow group's contributions are stale for the fast one (it runs ahead, up to the bound);
    # the fast group's are at most one version stale for the slow one (a message in flight).
    assert max(fast_taus) == 2 and max(slow_taus) <= 1
    assert max(fast_taus) <= 2 + 1
    # Every contribution of the slow group (made before the fast one stopped) was applied once.
    assert books[0].applied[1] == len(fast_taus)
    assert books[1].applied[0] == len(slow_taus)


def test_zero_staleness_bound_is_lockstep_with_no_staleness():
    _, applications = simulate([1.0, 2.7, 1.3], delay=0.5, max_staleness=0, rounds=6)
    assert applications and all(tau == 0 for *_, tau, _ in applications)


# ----- the layer-wise soft deadline, without transport --------------------------------------------
def test_parts_are_consecutive_layers_of_at_least_the_minimum_size():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 2))  # 40, 72 and 18 parameters
    params = list(model.parameters())
    each = split_into_parts(model, params, 1)
    assert [(p.start, p.end) for p in each] == [(0, 40), (40, 112), (112, 130)]
    assert [p.modules for p in each] == [(model[0],), (model[2],), (model[3],)]
    merged = split_into_parts(model, params, 50)
    assert [(p.start, p.end) for p in merged] == [(0, 112), (112, 130)]
    assert merged[0].modules == (model[0], model[2])
    assert [(p.start, p.end) for p in split_into_parts(model, params, 10_000)] == [(0, 130)]


def test_a_shared_parameter_belongs_to_the_first_layer_that_registers_it():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    parts = split_into_parts(model, list(model.parameters()), 1)
    assert [(p.start, p.end, p.modules) for p in parts] == [(0, 40, (model.embed,))]


def test_forward_clock_measures_the_time_before_each_part_in_training_passes_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
    params = list(model.parameters())
    clock = ForwardClock(model, split_into_parts(model, params, 1))
    inputs = torch.randn(64, 256)
    with torch.no_grad():
        model(inputs)
    assert clock.before == [0.0, 0.0, 0.0]  # evaluation is not measured
    model(inputs).sum().backward()
    first, second, third = clock.before
    assert 0.0 <= first <= second < third  # two matrix products run before the third layer
    clock.remove()
    model(inputs)
    assert clock.before == [first, second, third]


def test_late_parts_are_applied_at_the_next_round_one_version_staler():
    book = VersionBook(2, 0, max_staleness=0, num_parts=3)
    book.record_made()
    # Round 1: parts 0 and 1 of the other group's contribution 0 are in by their deadlines,
    # part 2 is not.
    here = {(0, 0), (0, 1)}
    assert book.missing_parts(1, here) == [(0, 2)]
    for part in (0, 1):
        assert book.accept(Contribution(1, 0, (0, 0), None, part=part)) == (0, 1.0)
    assert book.lagging_group() is None  # opened: the bound counts it
    assert book.applied == [1, 0] and book.seen() == (1, 1)  # opened counts as seen
    assert book.missing_parts(1, set()) == [(0, 2)]
    with pytest.raises(RuntimeError, match="partly applied"):
        book.state_dict()
    # Round 2: the late part, then all of contribution 1.
    book.record_made()
    assert book.missing_parts(1, {(0, 2), (1, 0)}, below=2) == [(1, 1), (1, 2)]
    assert book.accept(Contribution(1, 0, (0, 0), None, part=2)) == (1, 0.5)
    for part in range(3):
        assert book.accept(Contribution(1, 1, (1, 1), None, part=part)) == (0, 1.0)
    with pytest.raises(RuntimeError, match="lost or repeated"):
        book.accept(Contribution(1, 1, (1, 1), None, part=2))
    with pytest.raises(ValueError, match="part 3"):
        book.accept(Contribution(1, 2, (2, 2), None, part=3))
    stats = book.stats()
    assert stats["late_parts"] == 1 and stats["parts_applied"] == 6
    assert stats["contributions_applied"] == 2 and stats["mean_scale"] == pytest.approx(5.5 / 6)
    assert book.missing_parts(1, set()) == []
    state = book.state_dict()
    restored = VersionBook(2, 0, max_staleness=0, num_parts=3)
    restored.load_state_dict(state)
    assert restored.stats() == stats
    with pytest.raises(ValueError, match="3 parts; this run's have 1"):
        VersionBook(2, 0).load_state_dict(state)


@pytest.mark.parametrize("name", [None, "float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wire_formats_give_the_receiver_what_the_sender_counts_as_sent(name, dtype):
    wire = Wire(name, dtype)
    g = torch.Generator().manual_seed(0)
    for numel in (1, 255, 256, 257, 1000):
        values = torch.randn(numel, generator=g, dtype=dtype) * 10.0 ** torch.randint(
            -3, 3, (numel,), generator=g)
        values[:min(numel, 300) // 2] = 0.0  # a block of zeros when numel >= 256 + 128
        payload = torch.full((wire.payload_bytes(numel),), 0xAB, dtype=torch.uint8)
        sent = wire.encode_(values, payload)
        assert sent.dtype == dtype and sent.shape == values.shape
        torch.testing.assert_close(wire.decode(payload, numel).to(dtype), sent, rtol=0, atol=0)
        if name == "int8":  # each block within half a step of 1/127 of its largest magnitude
            assert wire.payload_bytes(numel) == -(-numel // 256) * 260
            for start in range(0, numel, 256):
                block = values[start:start + 256]
                step = block.abs().max().item() / 127
                assert (sent[start:start + 256] - block).abs().max().item() <= step / 2 * (1 + 1e-5)
        elif name in (None, "float32") and dtype == torch.float32 or name is None:
            assert torch.equal(sent, values)
    with pytest.raises(ValueError, match="wire_dtype"):
        Wire("int4", torch.float32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("segment_size", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sparse_wire_sends_the_largest_segments_and_decodes_what_it_counts_as_sent(
        bits, segment_size, dtype):
    wire, levels = SparseWire(0.1, bits, segment_size), 2 ** (bits - 1) - 1
    g = torch.Generator().manual_seed(bits * 100 + segment_size)
    for numel in (1, 5, 63, 64, 65, 1000, 4097):
        values = (torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
            -3, 3, (numel,), generator=g)).to(dtype)
        payload = torch.full((wire.payload_bytes(numel),), 0xAB, dtype=torch.uint8)
        sent = wire.encode_(values, payload)
        assert sent.dtype == dtype and sent.shape == values.shape
        torch.testing.assert_close(wire.decode(payload, numel).to(dtype), sent, rtol=0, atol=0)
        segments = -(-numel // segment_size)
        selected = min(segments, max(1, -(-segments // 10)))
        assert wire.payload_bytes(numel) == 8 * selected + -(-selected * segment_size * bits // 8)
        padded = torch.zeros(segments * segment_size, dtype=torch.float64)
        padded[:numel] = values.double()
        norms = padded.float().view(segments, segment_size).norm(dim=1)
        chosen = torch.zeros(segments, dtype=torch.bool)  # ties go to the lower index
        chosen[norms.sort(descending=True, stable=True).indices[:selected]] = True
        sent_padded = torch.zeros_like(padded)
        sent_padded[:numel] = sent.double()
        blocks, sent_blocks = padded.view(segments, segment_size), sent_padded.view(segments, segment_size)
        assert torch.equal(sent_blocks[~chosen], torch.zeros_like(sent_blocks[~chosen]))
        for block, sent_block in zip(blocks[chosen], sent_blocks[chosen]):
            largest = block.abs().max().item()  # within half a step, and the dtype's rounding
            tolerance = largest / levels / 2 * (1 + 1e-5) + largest * torch.finfo(dtype).eps
            assert (sent_block - block).abs().max().item() <= tolerance


def test_sparse_wire_refuses_bad_settings_and_non_finite_values():
    for kwargs, name in [(dict(density=0.0), "density"), (dict(density=1.5), "density"),
                         (dict(density=0.1, bits=3), "bits"), (dict(density=0.1, bits=2.0), "bits"),
                         (dict(density=0.1, segment_size=0), "segment_size"),
                         (dict(density=0.1, feedback_decay=1.5), "feedback_decay")]:
        with pytest.raises(ValueError, match=name):
            SparseWire(**kwargs)
    wire = SparseWire(0.5, 4, 2)
    values = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    payload = torch.full((wire.payload_bytes(4),), 0xAB, dtype=torch.uint8)
    with pytest.raises(FloatingPointError, match="NaN or infinity"):
        wire.encode_(values, payload)
    assert bool((payload == 0xAB).all()) and torch.isnan(values[1])  # nothing written or changed
    with pytest.raises(ValueError, match="bytes"):
        wire.decode(payload[:-1], 4)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_codes_pack_to_bytes_and_back(bits):
    g = torch.Generator().manual_seed(bits)
    for count in (0, 1, 7, 8, 9, 1000):
        codes = torch.randint(0, 2 ** bits, (count,), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-count * bits // 8)
        assert torch.equal(unpack_codes(packed, bits, count), codes)
    assert pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).item() == 0b00111001


def test_sparseloco_baseline_sends_k_values_a_chunk_on_four_levels_of_its_scale():
    g = torch.Generator().manual_seed(0)
    for numel, chunk, k in [(1, 4, 4), (1000, 64, 8), (1000, 64, 5), (4096 * 3 + 5, 4096, 64)]:
        values = torch.randn(numel, generator=g)
        payload, sent = encode_top_k_2bit(values, chunk, k)
        chunks = -(-numel // chunk)
        assert payload.dtype == torch.uint8
        assert payload.numel() == chunks * (4 + 2 * k) + -(-chunks * k // 4)
        assert torch.equal(decode_top_k_2bit(payload, numel, chunk, k), sent)
        padded = torch.zeros(chunks * chunk)
        padded[:numel] = values
        decoded = torch.zeros(chunks * chunk)  # the padding's values are sent but not kept
        decoded[:numel] = sent
        valid = torch.arange(chunks * chunk) < numel
        for row, sent_row, kept in zip(padded.view(chunks, chunk), decoded.view(chunks, chunk),
                                       valid.view(chunks, chunk)):
            top = row.abs().topk(k).indices
            outside = torch.ones(chunk, dtype=torch.bool)
            outside[top] = False
            assert not bool(sent_row[outside].any())
            levels = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0]) * row.abs().max()
            nearest = levels[(row[top].unsqueeze(1) - levels).abs().argmin(dim=1)]
            torch.testing.assert_close(sent_row[top][kept[top]], nearest[kept[top]])


@pytest.mark.multirank
def test_sparseloco_baseline_leaves_every_rank_with_the_same_model():
    sites = ((0,), (1, 2))
    results = run_ranks(3, sync_workers.sparseloco_run, sites, 6, timeout=120)
    for result in results:
        np.testing.assert_array_equal(result["final"], results[0]["final"])
    assert not np.array_equal(results[0]["final"], results[0]["initial"])
    numel = results[0]["final"].size
    assert results[0]["bytes_sent"] == 3 * (-(-numel // 16)) * (4 + 2 * 4 + 1)  # 3 rounds


# ----- real gloo ranks -------------------------------------------------------------------------
@pytest.mark.multirank
def test_one_group_is_exactly_ddp():
    for with_sync, plain in run_ranks(2, sync_workers.one_group_against_ddp, 5, timeout=120):
        assert torch.equal(with_sync, plain)


@pytest.mark.multirank
@pytest.mark.parametrize("groups", [((0,), (1,)), ((0, 1), (2, 3))], ids=["2x1", "2x2"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_lockstep_groups_equal_synchronous_training(groups, momentum):
    world_size = sum(len(g) for g in groups)
    results = run_ranks(world_size, sync_workers.train_against_reference, groups, 6, momentum, 0,
                        timeout=120)
    for result in results:
        torch.testing.assert_close(result["params"], result["reference"], rtol=1e-12, atol=1e-12)
        assert result["stats"]["mean_staleness"] == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("wire_dtype, layer_deadline", [
    ("float32", False), ("bfloat16", False), ("int8", False), ("float32", True), ("int8", True),
    (SparseWire(0.25, 2, 4), False), (SparseWire(0.25, 4, 4), True),
    (SparseWire(0.1, 8, 1, feedback_decay=0.5), False)], ids=str)
def test_no_contribution_is_lost_or_counted_twice(wire_dtype, layer_deadline):
    groups, row_factors = ((0,), (1, 2)), (1, 8)
    results = run_ranks(3, sync_workers.conservation_run, groups, 12, row_factors, 2, wire_dtype,
                        layer_deadline, timeout=120)
    grouping = Grouping(groups)
    leaders = {g: results[grouping.leaders[g]] for g in range(2)}
    parts = leaders[0]["parts"]
    assert len(parts) == (2 if layer_deadline else 1)  # the model's two Linear layers
    expected_final = np.zeros_like(leaders[0]["final"])
    for g, leader in leaders.items():
        other = 1 - g
        assert all(source == other for source, *_ in leader["applied"])
        for k in range(len(parts)):  # each part of each contribution exactly once, in order
            versions = [version for _, version, part, *_ in leader["applied"] if part == k]
            assert versions == list(range(leaders[other]["made"]))
        made_by_other = leaders[other]["made"]
        assert leader["checkpoint"]["book"]["part_applied"][other] == [made_by_other] * len(parts)
        reached = leader["initial"] + leader["own"]
        for _, _, part, tau, scale, payload in leader["applied"]:
            start, end = parts[part]
            reached[start:end] += scale * payload
        # what the other group applied (unscaled) is what this one counted as sent, in order
        received = [payload for _, _, _, _, _, payload in sorted(
            leaders[other]["applied"], key=lambda record: record[1:3])]  # (version, part)
        assert len(received) == len(leader["sent"]) == leader["made"] * len(parts)
        for sent, payload in zip(leader["sent"], received):
            np.testing.assert_array_equal(sent, payload)
        expected_final += grouping.sample_share(g) * reached
    for result in results:  # close() averaged the groups: the same model everywhere
        np.testing.assert_allclose(result["final"], expected_final, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(results[1]["final"], results[2]["final"])


@pytest.mark.multirank
@pytest.mark.parametrize("wire_dtype", [None, SparseWire(0.25, 2, 4)], ids=str)
def test_resume_equals_an_uninterrupted_run(tmp_path, wire_dtype):
    groups = ((0,), (1, 2))
    through = run_ranks(3, sync_workers.checkpoint_run, groups, str(tmp_path), 6, 6, "through",
                        wire_dtype, timeout=120)
    run_ranks(3, sync_workers.checkpoint_run, groups, str(tmp_path), 6, 6, "save", wire_dtype,
              timeout=120)
    resumed = run_ranks(3, sync_workers.checkpoint_run, groups, str(tmp_path), 6, 6, "resume",
                        wire_dtype, timeout=120)
    for a, b in zip(through, resumed):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.multirank
def test_a_stalled_group_raises_a_clear_error():
    message, _ = run_ranks(2, sync_workers.stalled_group, timeout=120)
    # The training thread's wait or the receiver's (both 3 s) runs out first.
    assert "stalled or died" in message and ("group 1 (ranks [1])" in message or
                                            "waited 3 s for the staleness bound" in message)


@pytest.mark.misuse
@pytest.mark.multirank
def test_bad_settings_raise_clear_errors():
    messages = run_ranks(2, sync_workers.bad_settings, timeout=120)[0]
    assert "covers 3 ranks; the job has 2" in messages["world_size"]
    assert "period" in messages["period"]
    assert "one value per group (2)" in messages["periods"]
    assert "period" in messages["period_of_other_group"]
    assert "max_staleness" in messages["max_staleness"]
    assert "wire_dtype" in messages["wire_dtype"]
    assert "lr_scale" in messages["lr_scale"]
    assert "must be a Grouping" in messages["grouping_type"]
    assert "no parameters" in messages["no_parameters"]
    assert "flush()" in messages["state_dict_before_flush"]
    assert "layer_deadline must be True or False" in messages["layer_deadline"]
    assert "part_bytes" in messages["part_bytes"]


@pytest.mark.multirank
def test_dynamic_batches_inside_groups_keep_the_step_exact():
    """The batch controller on each group's process group: unequal, re-planned splits inside a
    group, and the lockstep groups still make exactly the synchronous step on both groups'
    global batches."""
    for result, reference, sizes in run_ranks(4, sync_workers.with_dynamic_batches, 5, timeout=120):
        torch.testing.assert_close(result, reference, rtol=1e-12, atol=1e-12)
        assert sizes[0] in (2, 6)  # the unequal split the sampler started with


@pytest.mark.misuse
@pytest.mark.parametrize("what,named", [("groups", "'groups'"), ("period", "'periods'")])
def test_ranks_building_group_sync_differently_raise_on_every_rank(what, named):
    """Different groupings would block in dist.new_group (each rank creating other groups):
    the settings are compared first, and every rank raises naming them."""
    for message in run_ranks(3, sync_workers.ranks_disagree, what, timeout=120):
        assert "GroupSync settings differ" in message and named in message, message
