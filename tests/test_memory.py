"""The memory planner (hetero_comm.memory): plans change no value (bitwise gradients with
keep, swap and recompute on a CNN and a transformer), the swap spaces return every byte, the
integer program finds the exhaustive optimum of the cost model, and bad input is refused."""

import copy
import itertools
import re
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memory_workers
from lab.launch import run_ranks
from hetero_comm.memory.plan import partial_frees_memory
from hetero_comm.memory import (CHOICES, FileSwap, MemoryMeter, MemoryPlan, MemoryProfile,
                                apply_memory_plan, candidate_plans, chain_blocks, exhaustive_memory_plan,
                                plan_memory, predict, profile_memory, rule_choices, tune_memory_plan)
from hetero_comm.pipeline import LayerProfile
from kernel_cases import device  # noqa: F401  (a fixture: the CPU; test_cuda_memory.py reruns on CUDA)


class CausalBlock(nn.Module):
    """Pre-norm attention and MLP, with dropout (recomputing must replay its random mask)."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(0.1)

    def forward(self, h):
        batch, length, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, length, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True)
        h = h + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return h + self.dropout(self.mlp(self.norm2(h)))


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, tokens):
        return self.embed(tokens)


def transformer(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(Embed(32, 16), CausalBlock(16), CausalBlock(16), nn.LayerNorm(16),
                         nn.Linear(16, 32)).to(dtype)


def cnn(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1).to(memory_format=torch.channels_last), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * 8 * 8, 10))).to(dtype)


def batch(model_name, dtype):
    generator = torch.Generator().manual_seed(1)
    if model_name == "cnn":
        return torch.randn(4, 3, 16, 16, generator=generator, dtype=dtype), \
            torch.randint(0, 10, (4,), generator=generator)
    tokens = torch.randint(0, 32, (3, 12), generator=generator)
    return tokens, torch.randint(0, 32, (3 * 12,), generator=generator)


def gradients_after_steps(model, inputs, targets, steps=2):
    """Per training step (the second after an SGD update): the loss, the gradients, and the
    buffers after it (BatchNorm's running statistics)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)  # dropout's masks
    results = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()],
                        [b.clone() for b in model.buffers()]))
        optimizer.step()
    return results


def assert_same_steps(got, expected):
    """Bit for bit: every step's loss, gradients and buffers."""
    assert len(got) == len(expected)
    for (loss, grads, buffers), (want_loss, want_grads, want_buffers) in zip(got, expected):
        assert torch.equal(loss, want_loss)
        assert len(grads) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert len(buffers) == len(want_buffers)
        assert all(torch.equal(b, w) for b, w in zip(buffers, want_buffers))


def plan_of(model, choices):
    names, _ = chain_blocks(model)
    return MemoryPlan(names, tuple(choices), 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pattern", ["all_swap", "all_recompute", "all_partial", "mixed", "alternate"])
def test_planned_steps_are_bitwise_the_unplanned(model_name, dtype, pattern, tmp_path):
    make = cnn if model_name == "cnn" else transformer
    inputs, targets = batch(model_name, dtype)
    expected = gradients_after_steps(make(dtype), inputs, targets)
    model = make(dtype)
    count = len(model)
    choices = {"all_swap": ["swap"] * count, "all_recompute": ["recompute"] * count,
               "all_partial": ["partial"] * count, "mixed": [CHOICES[i % len(CHOICES)] for i in range(count)],
               "alternate": [("swap", "recompute")[i % 2] for i in range(count)]}[pattern]
    with apply_memory_plan(model, plan_of(model, choices), swap_directory=str(tmp_path)):
        got = gradients_after_steps(model, inputs, targets)
    assert_same_steps(got, expected)


def test_remove_restores_the_blocks_and_a_plan_applies_once(tmp_path):
    model = cnn()
    plan = plan_of(model, ["swap", "recompute", "keep", "swap"])
    applied = apply_memory_plan(model, plan, swap_directory=str(tmp_path))
    with pytest.raises(ValueError, match="already has a memory plan"):
        apply_memory_plan(model, plan)
    applied.remove()
    assert all("forward" not in block.__dict__ for block in model)
    assert not model[1]._forward_hooks  # the prefetch trigger went too
    apply_memory_plan(model, plan, swap_directory=str(tmp_path)).remove()


def test_swapping_frees_the_saved_activations_until_the_backward(tmp_path):
    """GELU's output is saved by the next Linear, inside block 1: kept, it lives until the
    backward; swapped, it is freed once written (block 1's input, GELU's, stays either way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Sequential(nn.GELU(), nn.Linear(256, 64)))
    inputs = torch.randn(32, 64)
    outputs = {}
    model[1][0].register_forward_hook(lambda module, args, output: outputs.update(
        gelu=weakref.ref(output.untyped_storage()), gelu_input=weakref.ref(args[0].untyped_storage())))

    def alive_after_forward(space=None):
        loss = model(inputs).sum()
        if space is not None:
            space.drain()
        alive = {name: ref() is not None for name, ref in outputs.items()}
        loss.backward()
        return alive

    assert alive_after_forward() == dict(gelu=True, gelu_input=True)
    with apply_memory_plan(model, plan_of(model, ["keep", "swap"]), swap_directory=str(tmp_path)) as applied:
        assert alive_after_forward(applied.space) == dict(gelu=False, gelu_input=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_file_swap_returns_every_byte_of_any_view(dtype, tmp_path):
    space = FileSwap(str(tmp_path))
    base = (torch.randn(7, 9) * 100).to(dtype)
    view = base.t()[2:, 1:]
    from hetero_comm.memory.modes import _SwappedStorage, _SwappedTensor
    from hetero_comm.memory.swap import storage_bytes
    packed = _SwappedTensor(_SwappedStorage(space.offload(storage_bytes(view))), view)
    restored = packed.restore(space)
    assert restored.dtype == dtype and restored.stride() == view.stride()
    assert torch.equal(restored, view)
    again = _SwappedTensor(packed.storage, base)  # another tensor saved from the same storage
    assert again.restore(space).untyped_storage().data_ptr() == restored.untyped_storage().data_ptr()
    del restored, again
    assert torch.equal(packed.restore(space), view)  # fetched again once nothing holds it
    space.close()


def test_file_swap_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        FileSwap(str(tmp_path / "missing"))


def test_profile_counts_what_each_block_saves():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    profile = profile_memory(model, torch.randn(32, 64), swap_bytes_per_s=1e9, repeats=1,
                             min_sample_s=0)
    assert profile.names == ("0", "1", "2")
    # Linear saves its input (for its weight's gradient), ReLU its output; nothing else.
    assert profile.saves_input == (True, False, True)
    assert profile.saves_output == (False, True, False)
    assert profile.internal_bytes == (0, 0, 0)
    assert profile.layers.output_bytes == (32 * 128 * 4, 32 * 128 * 4, 32 * 8 * 4)
    assert profile.swap_bytes(1) == 32 * 128 * 4
    for peaks in profile.forward_peak_bytes + profile.backward_peak_bytes:
        assert len(peaks) == len(CHOICES) and all(peak >= 0 for peak in peaks)
    assert profile.partial_kept_bytes == (0, 0, 0) and profile.partial_recompute_s == (0.0, 0.0, 0.0)


def test_a_partial_recomputation_keeps_the_products_and_frees_the_rest(device):
    """A linear, GELU, linear block saves the first product's output (for the GELU) and the
    GELU's (for the second product): partially recomputed it keeps the first and reruns the GELU."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device)
    profile = profile_memory([block], torch.randn(512, 256, device=device), swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    product_bytes = 512 * 512 * 4
    assert profile.internal_bytes == (2 * product_bytes,)
    if device == "cuda":  # the allocator's count is exact
        assert profile.partial_kept_bytes[0] == pytest.approx(product_bytes, rel=0.05)
    else:  # the resident set can keep freed heap pages after a long process: bounds only
        assert 0 < profile.partial_kept_bytes[0] <= 2 * product_bytes
    assert profile.partial_recompute_s[0] > 0 and profile.layers.recompute_s[0] > 0


def test_profile_refuses_blocks_that_are_not_a_chain_of_modules():
    with pytest.raises(TypeError, match="block '1'.*not an nn.Module"):
        chain_blocks([nn.Linear(2, 2), lambda x: x])

    class TwoOutputs(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(TypeError, match="block 'pair'.*one tensor"):
        profile_memory([("pair", TwoOutputs())], torch.randn(2, 2), swap_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="distinct"):
        chain_blocks([("a", nn.ReLU()), ("a", nn.ReLU())])


def test_apply_refuses_a_plan_made_for_other_blocks():
    with pytest.raises(ValueError, match="made for blocks"):
        apply_memory_plan(nn.Sequential(nn.ReLU(), nn.ReLU()), plan_of(cnn(), ["keep"] * 4))
    with pytest.raises(ValueError, match="choice of block"):
        MemoryPlan(("a",), ("offload",), 0, 0, 0, 0)


@st.composite
def small_profiles(draw):
    count = draw(st.integers(1, 5))
    sizes = st.integers(0, 100)

    def column(strategy):
        return tuple(draw(st.lists(strategy, min_size=count, max_size=count)))

    layers = LayerProfile(column(st.floats(0.01, 1.0)), column(st.floats(0.01, 2.0)),
                          column(st.integers(1, 50)), column(sizes), column(st.integers(0, 20)), 8,
                          recompute_s=column(st.floats(0.005, 1.2)))
    per_mode = st.tuples(*[sizes] * len(CHOICES))
    return MemoryProfile(tuple(f"b{i}" for i in range(count)), layers, column(sizes),
                         column(st.booleans()), column(st.booleans()), column(per_mode),
                         column(per_mode), column(sizes), column(st.floats(0.0, 0.5)),
                         draw(st.floats(10.0, 1000.0)), draw(st.booleans()))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_profiles(), st.floats(0.3, 1.2))
def test_the_integer_program_finds_the_exhaustive_optimum(profile, budget_share):
    unplanned_peak, _ = predict(profile, ("keep",) * profile.num_blocks)
    budget = budget_share * unplanned_peak
    best = exhaustive_memory_plan(profile, budget)
    if best is None:
        with pytest.raises(ValueError, match="no plan fits"):
            plan_memory(profile, budget)
        return
    plan = plan_memory(profile, budget)
    assert plan.predicted_peak_bytes <= budget * (1 + 1e-9)
    assert plan.predicted_step_s == pytest.approx(predict(profile, best)[1], rel=1e-6, abs=1e-9)
    seed = plan_memory(profile, budget, method="rule") if predict(
        profile, rule_choices(profile))[0] <= budget else None
    if seed is not None:  # the swap-or-recompute rule fits too; it is never faster than the optimum
        assert seed.predicted_peak_bytes <= budget * (1 + 1e-9)
        # (the optimum within the integer program's relative gap, 1e-7, as checked above)
        assert seed.predicted_step_s >= plan.predicted_step_s * (1 - 1e-6) - 1e-9


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_profiles(), st.floats(0.3, 1.2), st.integers(1, 4))
def test_candidates_are_the_best_few_plans_that_fit(profile, budget_share, count):
    """The first ``count`` candidates are the exhaustive search's ``count`` fastest predicted
    (or all that fit); the rest are the no-swap optimum and the swap-or-recompute rule; all distinct."""
    budget = budget_share * predict(profile, ("keep",) * profile.num_blocks)[0]
    allowed = [choices for choices in itertools.product(CHOICES, repeat=profile.num_blocks)
               if all(choice != "partial" or partial_frees_memory(profile, l) for l, choice in enumerate(choices))]
    fitting = sorted(predict(profile, choices)[1] for choices in allowed if predict(profile, choices)[0] <= budget)
    if not fitting:
        with pytest.raises(ValueError, match="no plan fits"):
            candidate_plans(profile, budget, count)
        return
    plans = candidate_plans(profile, budget, count)
    assert plans[0].predicted_step_s == pytest.approx(plan_memory(profile, budget).predicted_step_s, rel=1e-6, abs=1e-9)
    assert len({plan.choices for plan in plans}) == len(plans) <= count + 2
    assert all(plan.predicted_peak_bytes <= budget * (1 + 1e-9) for plan in plans)
    times = [plan.predicted_step_s for plan in plans]
    assert times == sorted(times)
    best = min(count, len(fitting))
    assert times[:best] == pytest.approx(fitting[:best], rel=1e-6, abs=1e-9)


def wide_mlp():
    """Blocks whose saved activations (512 KiB each) stand well above the resident set's noise."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                           for _ in range(4)])


def halfway_budget(profile):
    """Halfway between recomputing every block and keeping every block (predicted peaks)."""
    least, most = (predict(profile, (choice,) * profile.num_blocks)[0] for choice in ("recompute", "keep"))
    return (least + most) / 2


def test_tune_runs_the_candidates_and_keeps_the_fastest_that_fits(tmp_path):
    model = wide_mlp()
    inputs, targets = torch.randn(256, 128), torch.randn(256, 128)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls = []

    def step():  # notes how each block runs in this call: the plan in effect
        calls.append(tuple(getattr(block.__dict__.get("forward"), "func", step).__name__ for block in model))
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()

    profile = profile_memory(model, inputs, swap_directory=str(tmp_path), swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    budget = halfway_budget(profile)
    tuned = tune_memory_plan(model, profile, budget, step, candidates=2, steps=2, warmup=1,
                             swap_directory=str(tmp_path))
    expected = candidate_plans(profile, budget, 2)
    assert [trial.plan.choices for trial in tuned.trials] == [plan.choices for plan in expected]
    # Two rounds; in each, every plan in turn for a warm-up and a timed step.
    assert len(calls) == 2 * 2 * len(expected)
    turns = calls[::2]
    assert turns == calls[1::2] and turns[:len(expected)] == turns[len(expected):]
    assert len(set(turns)) == len(expected)  # distinct plans, each its own turn
    fitting = [trial for trial in tuned.trials if trial.peak_bytes <= budget]
    assert fitting and tuned.plan is min(fitting, key=lambda trial: trial.step_s).plan
    assert all(trial.step_s > 0 and trial.peak_bytes > 0 for trial in tuned.trials)
    assert all("forward" not in block.__dict__ for block in model)  # every trial's plan removed
    assert tuned.format().count("\n") == len(tuned.trials) and "*" in tuned.format()


def test_tune_refuses_when_the_step_adds_more_than_the_budget(tmp_path):
    model = wide_mlp()
    inputs = torch.randn(256, 128)
    extra = []

    def step():  # holds 64 MiB more than the blocks' profile knows of, while the step runs
        extra.append(torch.ones(16 << 20))
        model(inputs).sum().backward()
        extra.clear()

    profile = profile_memory(model, inputs, swap_directory=str(tmp_path), swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    with pytest.raises(ValueError, match="stayed within the budget"):
        tune_memory_plan(model, profile, halfway_budget(profile), step,
                         candidates=1, steps=1, warmup=0, swap_directory=str(tmp_path))
    with pytest.raises(ValueError, match="steps"):
        tune_memory_plan(model, profile, 1e9, step, steps=0)
    assert all("forward" not in block.__dict__ for block in model)


def make_profile(count=3, internal=100, output=10, forward_s=0.01, swap_bytes_per_s=1e4, recompute_s=None):
    layers = LayerProfile((forward_s,) * count, (2 * forward_s,) * count, (output,) * count,
                          (internal,) * count, (0,) * count, 8,
                          recompute_s=() if recompute_s is None else (recompute_s,) * count)
    # A partial recomputation here frees nothing and costs a forward: never worth choosing.
    return MemoryProfile(tuple(f"b{i}" for i in range(count)), layers, (internal,) * count,
                         (True,) * count, (False,) * count,
                         ((internal + output, internal + output, output, internal + output),) * count,
                         ((2 * output, 2 * output + internal, 2 * output + internal, 2 * output),) * count,
                         (internal,) * count, (forward_s,) * count, swap_bytes_per_s)


def test_the_seed_rule_swaps_what_is_slow_to_compute_and_recomputes_the_rest():
    slow_link = make_profile(swap_bytes_per_s=1e3)  # 100 bytes: 0.2 s out and back > 0.01 s
    assert rule_choices(slow_link) == ("recompute",) * 3
    fast_link = make_profile(swap_bytes_per_s=1e6)  # 0.0002 s < 0.01 s
    assert rule_choices(fast_link) == ("swap",) * 3
    assert plan_memory(fast_link).choices == ("swap",) * 3


def test_predict_counts_each_block_once():
    profile = make_profile()
    keep_peak, keep_s = predict(profile, ("keep",) * 3)
    recompute_peak, recompute_s = predict(profile, ("recompute",) * 3)
    assert recompute_peak < keep_peak
    assert recompute_s == pytest.approx(keep_s + 3 * 0.01)
    with pytest.raises(ValueError, match="one choice per block"):
        predict(profile, ("keep",))


def test_plan_memory_refuses_an_impossible_budget_and_bad_settings():
    profile = make_profile()
    with pytest.raises(ValueError, match="no plan fits a budget"):
        plan_memory(profile, 1)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_memory(profile, -5)
    with pytest.raises(ValueError, match="method"):
        plan_memory(profile, 1e9, method="greedy")
    no_swap = plan_memory(profile, 0.7 * predict(profile, ("keep",) * 3)[0], allow_swap=False)
    assert "swap" not in no_swap.choices and "recompute" in no_swap.choices


@pytest.mark.parametrize("recompute_s", [None, 0.1, 0.4])
def test_recompute_is_priced_as_the_pipeline_planner_prices_it(recompute_s):
    """Both planners charge a recomputed layer the profile's measured recomputation (one more
    forward when it was not measured), the swap-or-recompute rule compares that with the transfer, and the
    step time rises by it."""
    from hetero_comm.pipeline import Cluster, DeviceKind
    from hetero_comm.pipeline.cost import stage_estimates
    profile = make_profile(count=1, forward_s=0.25, recompute_s=recompute_s)
    cluster = Cluster((DeviceKind("d", profile.layers),), 1)
    kept, recomputed = (stage_estimates(cluster, cluster.devices, [0, 1], [flag], 1, "gpipe")[0]
                        for flag in (False, True))
    extra_pipeline = recomputed.backward_s - kept.backward_s
    extra_memory = predict(profile, ("recompute",))[1] - predict(profile, ("keep",))[1]
    expected = 0.25 if recompute_s is None else recompute_s
    assert extra_pipeline == pytest.approx(extra_memory) == pytest.approx(expected)
    # 100 bytes out and back at 1,000 B/s: 0.2 s, between the cheap recomputation and the others.
    seed = rule_choices(make_profile(count=1, forward_s=0.25, recompute_s=recompute_s, swap_bytes_per_s=1e3))
    assert seed == (("swap",) if expected > 0.2 else ("recompute",))


class _LastHidden(nn.Module):
    """An LSTM as a block: one tensor in, its hidden states out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def other_families():
    """Models unlike the benchmark's: torch's own encoder layers, residual BatchNorm blocks, an LSTM."""
    torch.manual_seed(0)
    encoder = nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
                              for _ in range(3)], nn.Flatten(), nn.Linear(16 * 6, 5))
    resnet = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _Residual(8), _Residual(8),
                           nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)))
    recurrent = nn.Sequential(_LastHidden(8), _LastHidden(8), nn.Sequential(nn.Flatten(), nn.Linear(8 * 6, 5)))
    generator = torch.Generator().manual_seed(3)
    return {"encoder": (encoder, torch.randn(4, 6, 16, generator=generator)),
            "resnet": (resnet, torch.randn(4, 3, 8, 8, generator=generator)),
            "lstm": (recurrent, torch.randn(4, 6, 8, generator=generator))}


@pytest.mark.parametrize("family", ["encoder", "resnet", "lstm"])
@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_trains_other_model_families_bit_for_bit(family, choice, tmp_path):
    model, inputs = other_families()[family]
    targets = torch.arange(inputs.shape[0]) % 5
    expected = gradients_after_steps(copy.deepcopy(model), inputs, targets)
    with apply_memory_plan(model, plan_of(model, [choice] * len(model)), swap_directory=str(tmp_path)):
        got = gradients_after_steps(model, inputs, targets)
    assert_same_steps(got, expected)


@pytest.mark.parametrize("family", ["encoder", "resnet", "lstm"])
def test_other_model_families_profile_plan_and_train_the_same(family, tmp_path):
    model, inputs = other_families()[family]
    targets = torch.arange(inputs.shape[0]) % 5
    before = copy.deepcopy(model)
    profile = profile_memory(model, inputs, swap_directory=str(tmp_path), swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    # Profiling trains nothing: weights, BatchNorm's statistics and gradients as they were.
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    assert all(p.grad is None for p in model.parameters())
    assert all(0 <= kept <= internal for kept, internal in zip(profile.partial_kept_bytes, profile.internal_bytes))
    assert all(seconds >= 0 for seconds in profile.partial_recompute_s + profile.layers.recompute_s)
    plan = plan_memory(profile, halfway_budget(profile))
    assert plan.predicted_peak_bytes <= halfway_budget(profile)
    expected = gradients_after_steps(copy.deepcopy(model), inputs, targets)
    with apply_memory_plan(model, plan, swap_directory=str(tmp_path)):
        got = gradients_after_steps(model, inputs, targets)
    assert_same_steps(got, expected)


@pytest.mark.slow
def test_the_memory_plan_example_runs_as_written():
    """The example, briefly: profile, tune in turns on a copy, train with the plan, and the
    trained weights and statistics equal the unplanned run's."""
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "memory_plan_example.py"
    result = subprocess.run([sys.executable, str(example), "--steps", "2", "--width", "8", "--batch", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weights and BatchNorm statistics equal to the unplanned run's: True" in result.stdout, result.stdout
    assert re.search(r"planned: +peak [\d.]+ MiB \((0\.\d\d)x\)", result.stdout), result.stdout


def test_a_block_that_changes_a_product_in_place_profiles_and_plans_without_partial(tmp_path):
    """torch refuses a partial recomputation when a kept product's output is changed in place
    (a ReLU(inplace=True) after a Linear): such a block gets keep's figures, and no plan picks it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True)) for _ in range(3)])
    inputs = torch.randn(32, 64)
    profile = profile_memory(model, inputs, swap_directory=str(tmp_path), swap_bytes_per_s=1e9,
                             repeats=1, min_sample_s=0)
    assert profile.partial_kept_bytes == profile.internal_bytes
    assert profile.partial_recompute_s == profile.layers.forward_s
    for budget in (halfway_budget(profile), predict(profile, ("keep",) * 3)[0]):
        assert "partial" not in plan_memory(profile, budget).choices


def test_forcing_partial_recomputation_on_such_a_block_names_it_in_the_error(tmp_path):
    """A hand-made plan that forces it anyway: torch's refusal comes in the backward, and the
    error names the block and what to do."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)))
    with apply_memory_plan(model, plan_of(model, ["keep", "partial"])):
        output = model(torch.randn(4, 8))
        with pytest.raises(RuntimeError, match=r"block '1' is partially recomputed, but its "
                                               r"forward changes in place .*mutated"):
            output.sum().backward()


class _SigmoidScaledInPlace(nn.Module):
    """Linear, then sigmoid (which saves its output) scaled in place: autograd refuses its
    backward without a plan."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        y = torch.sigmoid(self.linear(x))
        y.mul_(2.0)
        return y


class _ScalesItsInputInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return self.linear(x.mul_(0.5))


class _Sigmoid(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x)


@pytest.mark.parametrize("blocks,swapped", [
    (lambda: [_SigmoidScaledInPlace(), nn.Linear(6, 1)], 0),
    # the next block scales its input, which the swapped block saved, in place
    (lambda: [nn.Linear(6, 6), _Sigmoid(), _ScalesItsInputInPlace()], 1),
])
def test_a_swapped_block_whose_saved_tensor_changes_in_place_is_refused_by_name(
        blocks, swapped, tmp_path):
    """Unplanned, autograd refuses these backward passes; swapped, the copy would be taken
    before or after the change depending on timing. The plan raises in the forward (the
    block's own, or the next block's), naming the block."""
    model = nn.Sequential(*blocks())
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()  # the unplanned model: autograd's own refusal
    choices = ["keep"] * len(model)
    choices[swapped] = "swap"
    with apply_memory_plan(model, plan_of(model, choices), swap_directory=str(tmp_path)):
        with pytest.raises(RuntimeError, match=rf"block '{swapped}' is swapped, but a tensor its "
                                               rf"forward saved .* was changed in place"):
            model(x)


@pytest.mark.parametrize("choice", ["recompute", "partial"])
def test_a_recomputed_block_whose_saved_tensor_changes_in_place_is_refused_by_name(choice, tmp_path):
    """torch.utils.checkpoint accepts this forward and its recomputed backward uses the changed
    value; the plan raises in the forward, naming the block, where autograd would refuse the
    unplanned backward."""
    model = nn.Sequential(nn.Linear(6, 6), _SigmoidScaledInPlace(), nn.Linear(6, 1))
    with apply_memory_plan(model, plan_of(model, ["keep", choice, "keep"])):
        with pytest.raises(RuntimeError, match=r"block '1' is recomputed in the backward, but its "
                                               r"forward changed a tensor in place"):
            model(torch.randn(4, 6))


def test_in_place_activations_that_change_nothing_saved_still_recompute_bitwise(tmp_path):
    """ReLU(inplace=True) after a convolution or a linear layer saves its own result (the usual
    CNN block): recomputed, the gradients are the unplanned ones, bit for bit."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True)),
                             nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)), nn.Linear(8, 1))
    x = torch.randn(5, 6)
    expected = make()
    expected(x).sum().backward()
    model = make()
    with apply_memory_plan(model, plan_of(model, ["recompute", "recompute", "keep"])):
        model(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), expected.parameters()))


# ------------------------------------------------------------------ ranks under DDP
@pytest.mark.misuse
@pytest.mark.multirank
def test_tuning_under_ddp_runs_equally_many_steps_on_every_rank(tmp_path):
    """Ranks whose budgets and candidate counts differ would run different numbers of DDP
    steps, and the rank with more would wait in DDP's allreduce forever: each runs the most any
    rank runs, so all finish, each with its own plan, the replicas still equal."""
    results = run_ranks(2, memory_workers.tune_under_ddp, [0.5, 0.9], [1, 4], str(tmp_path),
                        timeout=120)
    assert [result[0] for result in results] == ["tuned", "tuned"]
    assert results[0][2] == results[1][2] >= 3  # equally many steps (rank 1 runs more plans)
    assert all(result[3] for result in results)


@pytest.mark.misuse
@pytest.mark.multirank
def test_a_rank_on_which_nothing_fits_makes_every_rank_raise_before_a_step(tmp_path):
    results = run_ranks(2, memory_workers.tune_under_ddp, [0.5, -5.0], [2, 2], str(tmp_path),
                        timeout=120)
    assert results[0][0] == "ValueError" and "no plan fits on rank(s) 1" in results[0][1]
    assert results[1][0] == "ValueError" and "budget" in results[1][1]
    assert [result[2] for result in results] == [0, 0]


@pytest.mark.multirank
def test_one_rank_tunes_alone_with_no_process_group(tmp_path):
    """process_group=None: no comparison with the other ranks, which are busy elsewhere (with
    the default group, rank 0 would wait for them and raise after the set-up timeout)."""
    results = run_ranks(2, memory_workers.tune_alone_on_rank_0, str(tmp_path), timeout=60)
    assert results[1] is None and len(results[0]) == 4
