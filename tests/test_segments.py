"""segment_accumulate_, select_segments, pack_segments_, pack_quantized_segments_,
unpack_segments: compiled == reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_comm import ops, reference
from kernel_cases import (BACKENDS, device, GRAD_DTYPES, SIZES, compiled_with_strict_checks,  # noqa: F401
                          non_contiguous, random_tensor, to_device, untouched)

# Around the CUDA accumulate kernels' regimes: a group of 1, 8 or 32 lanes, or a whole block,
# per segment.
SEGMENT_SIZES = (1, 3, 8, 64, 65, 256, 1000, 2049, 5000)


# ---------------------------------------------------------------------- segment_accumulate_
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("segment_size", SEGMENT_SIZES)
def test_segment_accumulate_matches_reference(numel, segment_size, dtype, device):
    residual = random_tensor(numel, torch.float32, seed=numel)
    grad = random_tensor(numel, dtype, seed=numel + 1)
    compiled_residual, reference_residual = residual.to(device, copy=True), residual.clone()
    compiled = ops.segment_accumulate_(compiled_residual, grad.to(device), segment_size)
    expected = reference.segment_accumulate_(reference_residual, grad, segment_size)
    # The update is one float32 add per element: bit-identical.
    assert torch.equal(compiled_residual.cpu(), reference_residual)
    assert compiled.shape == ((numel + segment_size - 1) // segment_size,)
    assert compiled.device.type == device and compiled.dtype == torch.float32
    torch.testing.assert_close(compiled.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_segment_accumulate_reads_non_contiguous_grad(device):
    grad = random_tensor(5000, torch.bfloat16, seed=3)
    a, b = torch.zeros(5000, device=device), torch.zeros(5000, device=device)
    torch.testing.assert_close(ops.segment_accumulate_(a, non_contiguous(grad, device), 64),
                               ops.segment_accumulate_(b, grad.to(device), 64), rtol=0, atol=0)
    assert torch.equal(a, b)


def test_segment_accumulate_accumulates_over_steps(device):
    residual = torch.zeros(1000, device=device)
    grads = [random_tensor(1000, torch.float32, seed=s) for s in range(5)]
    for grad in grads:
        importance = ops.segment_accumulate_(residual, grad.to(device), 100)
    total = torch.stack(grads).sum(0)
    torch.testing.assert_close(residual.cpu(), total)
    torch.testing.assert_close(importance.cpu(), total.view(10, 100).norm(dim=1))


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(residual=torch.zeros(10, dtype=torch.float16)), "residual must have dtype float"),
    (dict(grad=torch.zeros(10, dtype=torch.int32)), "grad must have dtype"),
    (dict(residual=torch.zeros(2, 5)), "residual must be 1-D"),
    (dict(grad=torch.zeros(11)), "grad must have as many elements as residual"),
    (dict(segment_size=0), "segment_size must be an integer >= 1"),
    (dict(segment_size=-4), "segment_size must be an integer >= 1"),
    (dict(residual=torch.zeros(20)[::2]), "residual is written in place and must be contiguous"),
])
def test_segment_accumulate_rejects_bad_input(backend, case, match, device):
    args = dict(residual=torch.ones(10), grad=torch.ones(10), segment_size=4) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    with untouched(args["residual"], args["grad"]), pytest.raises((ValueError, TypeError), match=match):
        backend.segment_accumulate_(**args)


# -------------------------------------------------------------------------- select_segments
def _importance_cases():
    generator = torch.Generator().manual_seed(7)
    yield "empty", torch.empty(0)
    yield "single", torch.tensor([3.0])
    yield "all_equal", torch.full((100,), 2.5)
    yield "signed_zeros", torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -0.0])
    yield "negative", -torch.rand(500, generator=generator)
    yield "few_values", torch.randint(0, 4, (1000,), generator=generator).float()
    yield "random", torch.rand(10_000, generator=generator)
    yield "random_large", torch.rand(300_000, generator=generator)
    yield "ties_large", torch.randint(0, 50, (300_000,), generator=generator).float()
    yield "huge_range", torch.tensor([1e38, -1e38, 1e-38, -1e-45, 3.0e-41, 0.0, 7.0])


@pytest.mark.parametrize("name, importance", list(_importance_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_select_segments_matches_reference(name, importance, device):
    count = importance.numel()
    on_device = importance.to(device)
    for k in sorted({0, 1, 2, count // 100, count // 3, count - 1, count} & set(range(count + 1))):
        compiled = ops.select_segments(on_device, k)
        assert compiled.dtype == torch.int64 and compiled.shape == (k,) and compiled.device.type == device
        assert torch.equal(compiled.cpu(), reference.select_segments(importance, k)), f"{name}, k={k}"


def test_select_segments_ties_go_to_lower_index(device):
    importance = torch.tensor([1.0, 5.0, 3.0, 5.0, 3.0, 3.0, 0.0], device=device)
    assert ops.select_segments(importance, 3).tolist() == [1, 2, 3]
    assert ops.select_segments(importance, 4).tolist() == [1, 2, 3, 4]
    assert ops.select_segments(torch.tensor([0.0, -0.0, -0.0, 0.0], device=device), 2).tolist() == [0, 1]


def test_select_segments_result_is_the_top_k(device):
    importance = torch.rand(50_000, generator=torch.Generator().manual_seed(1))
    picked = ops.select_segments(importance.to(device), 500).cpu()
    assert bool((picked[1:] > picked[:-1]).all())
    assert set(picked.tolist()) == set(torch.topk(importance, 500).indices.tolist())


def test_select_segments_reads_non_contiguous_input(device):
    importance = torch.rand(5001, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ops.select_segments(non_contiguous(importance, device), 50).cpu(),
                       reference.select_segments(importance, 50))


# The device fixture is a constant: sharing it across examples is safe.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, 2.5, -3.0, 1e30, 7e-42]), max_size=300),
       k_fraction=st.floats(0, 1))
def test_select_segments_agrees_with_reference_on_tie_heavy_inputs(values, k_fraction, device):
    importance = torch.tensor(values, dtype=torch.float32)
    k = round(k_fraction * importance.numel())
    assert torch.equal(ops.select_segments(importance.to(device), k).cpu(),
                       reference.select_segments(importance, k))


@BACKENDS
@pytest.mark.parametrize("importance, k, match", [
    (torch.rand(10), -1, r"k must be an integer in \[0, 10\]"),
    (torch.rand(10), 11, r"k must be an integer in \[0, 10\]"),
    (torch.tensor([1.0, float("nan"), 2.0]), 1, "importance must be finite"),
    (torch.tensor([1.0, float("inf")]), 1, "importance must be finite"),
    # large enough for the CPU kernel's sample, which then holds NaNs (every 16th value)
    (torch.rand(20_000).index_fill_(0, torch.arange(0, 20_000, 16), float("nan")), 100,
     "importance must be finite"),
    (torch.rand(10, dtype=torch.float64), 1, "importance must have dtype float"),
    (torch.rand(2, 5), 1, "importance must be 1-D"),
])
def test_select_segments_rejects_bad_input(backend, importance, k, match, device):
    importance = importance.to(device)
    with untouched(importance), pytest.raises((ValueError, TypeError), match=match):
        backend.select_segments(importance, k)


# ------------------------------------------------------------------ pack / unpack segments
def _selections(segments: int):
    generator = torch.Generator().manual_seed(segments)
    yield torch.empty(0, dtype=torch.int64)
    if segments:
        yield torch.arange(segments)                       # k = S, includes the short last one
        yield torch.tensor([segments - 1])                 # only the (maybe short) last segment
        chosen = torch.randperm(segments, generator=generator)[: max(1, segments // 7)]
        yield torch.sort(chosen).values


@pytest.mark.parametrize("out_dtype", [None, *GRAD_DTYPES])
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("segment_size", SEGMENT_SIZES)
def test_pack_and_unpack_match_reference(numel, segment_size, out_dtype, device):
    segments = (numel + segment_size - 1) // segment_size
    for indices in _selections(segments):
        residual = random_tensor(numel, torch.float32, seed=numel)
        compiled_residual, reference_residual = residual.to(device, copy=True), residual.clone()
        packed_numel = indices.numel() * segment_size
        # NaN: an element the kernel failed to write would show.
        out = lambda dev: None if out_dtype is None else torch.full(
            (packed_numel,), float("nan"), dtype=out_dtype, device=dev)
        given = out(device)
        packed = ops.pack_segments_(compiled_residual, indices.to(device), segment_size, out=given)
        expected = reference.pack_segments_(reference_residual, indices, segment_size, out=out("cpu"))
        assert given is None or packed is given
        assert packed.dtype == (out_dtype or torch.float32) and packed.shape == (packed_numel,)
        assert torch.equal(packed.cpu(), expected)
        assert torch.equal(compiled_residual.cpu(), reference_residual)
        # Nothing is lost: what was packed plus what stayed behind (zero, or the rounding
        # error of a 16-bit out) is the original residual, exactly, in float32 arithmetic.
        restored = reference.unpack_segments(expected.float(), indices, segment_size, numel)
        assert torch.equal(restored + reference_residual, residual)
        # Unpack from every packed dtype into this out dtype, with two scales.
        for packed_dtype, scale in ((torch.float32, 0.5), (torch.bfloat16, -1 / 3), (torch.float16, 2.0)):
            source = expected.to(packed_dtype)
            unpack_out = lambda dev: None if out_dtype is None else torch.full(
                (numel,), float("nan"), dtype=out_dtype, device=dev)
            unpacked = ops.unpack_segments(source.to(device), indices.to(device), segment_size, numel,
                                           scale=scale, out=unpack_out(device))
            assert torch.equal(unpacked.cpu(), reference.unpack_segments(
                source, indices, segment_size, numel, scale=scale, out=unpack_out("cpu")))


def test_pack_pads_a_short_last_segment_with_zeros(device):
    residual = torch.arange(1.0, 11.0, device=device)  # segments of 4: [1..4], [5..8], [9, 10]
    packed = ops.pack_segments_(residual, torch.tensor([0, 2], device=device), 4)
    assert packed.tolist() == [1.0, 2.0, 3.0, 4.0, 9.0, 10.0, 0.0, 0.0]
    assert residual.tolist() == [0.0] * 4 + [5.0, 6.0, 7.0, 8.0] + [0.0, 0.0]


@pytest.mark.parametrize("out_dtype", GRAD_DTYPES)
def test_pack_leaves_what_out_cannot_represent_in_the_residual(out_dtype, device):
    values = [1 / 3, float("inf"), float("-inf"), 70_000.0, -1e-30, 2.0 ** -30, 1 + 2.0 ** -20, 0.1]
    residual = torch.tensor(values + [5.0, 6.0])
    compiled_residual, reference_residual = residual.to(device, copy=True), residual.clone()
    indices = torch.tensor([0, 1])
    packed = ops.pack_segments_(compiled_residual, indices.to(device), 8,
                                out=torch.empty(16, dtype=out_dtype, device=device)).cpu()
    expected_packed = reference.pack_segments_(reference_residual, indices, 8,
                                               out=torch.empty(16, dtype=out_dtype))
    assert torch.equal(packed, expected_packed)
    compiled_residual = compiled_residual.cpu()
    assert same_bits_or_both_nan(compiled_residual, reference_residual)
    expected = residual[:10] - residual[:10].to(out_dtype).float()
    if out_dtype == torch.float32:
        expected = torch.zeros(10)  # written as 0, so an infinity does not leave NaN
    assert same_bits_or_both_nan(compiled_residual, expected)


def same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so -0.0 != 0.0), except that any NaN equals any NaN: inf - inf is
    0xFFC00000 on x86 and 0x7FFFFFFF on a GPU."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32),
                                                            b[~nan].view(torch.int32))


# ------------------------------------------------------------------ pack_quantized_segments_
QUANT_DTYPES = (torch.int8, torch.int16, torch.int32)


def _segment_scales(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """Scales around the data's (unit normal) range: some clip, one is 0 (all sent as 0), one
    so small that levels / scale overflows float32."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(indices.numel(), generator=generator) * 4
    if indices.numel() > 2:
        scale[0], scale[1] = 0.0, 1e-40
    return scale


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("segment_size", SEGMENT_SIZES)
def test_pack_quantized_matches_reference_and_the_ops_it_fuses(numel, segment_size, dtype, device):
    segments = (numel + segment_size - 1) // segment_size
    levels = {torch.int8: 42, torch.int16: 1000, torch.int32: 2**31 - 1}[dtype]
    for indices in _selections(segments):
        residual = random_tensor(numel, torch.float32, seed=numel)
        scale = _segment_scales(indices, seed=segment_size)
        compiled_residual, reference_residual = residual.to(device, copy=True), residual.clone()
        given = torch.full((indices.numel() * segment_size,), 7, dtype=dtype, device=device)
        packed = ops.pack_quantized_segments_(compiled_residual, indices.to(device), segment_size,
                                              scale.to(device), levels, dtype, out=given)
        expected = reference.pack_quantized_segments_(reference_residual, indices, segment_size, scale,
                                                      levels, dtype)
        assert packed is given and torch.equal(packed.cpu(), expected)
        assert torch.equal(compiled_residual.cpu(), reference_residual)
        # Bit for bit what the unfused ops give (the int8 wire's earlier path): pack, quantize,
        # and keep value - dequantized in the residual.
        unfused_residual = residual.clone()
        values = reference.pack_segments_(unfused_residual, indices, segment_size).view(-1, segment_size)
        q = reference.quantize(values, scale, levels, dtype)
        assert torch.equal(q.view(-1), expected)
        error = values - reference.dequantize(q, scale, levels)
        unfused_residual += reference.unpack_segments(error.view(-1), indices, segment_size, numel)
        assert torch.equal(reference_residual, unfused_residual)


@BACKENDS
def test_pack_quantized_keeps_the_rounding_error_and_any_nan_in_the_residual(backend, device):
    #         segment 0 (scale 1, 4 levels: step 0.25)  segment 1 (not sent)  segment 2, short
    values = [0.3, -0.125, 2.0, float("nan"), 5.0, 6.0, 7.0, 8.0, float("inf"), -0.6]
    residual = torch.tensor(values, device=device)
    packed = backend.pack_quantized_segments_(residual, torch.tensor([0, 2], device=device), 4,
                                              torch.tensor([1.0, 0.5], device=device), 4, torch.int8)
    # round_half_even(0.3 * 4) = 1, (-0.5) -> -0 , 2.0 clips at 4 levels, NaN is sent as 0;
    # inf clips at 4, -0.6 * 8 = -4.8 clips at -4; the short segment is padded with zeros.
    assert packed.cpu().tolist() == [1, 0, 4, 0, 4, -4, 0, 0]
    left = residual.cpu()
    assert left[[0, 1, 2]].tolist() == pytest.approx([0.05, -0.125, 1.0])
    assert torch.isnan(left[3]) and left[8] == float("inf")
    assert left[4:8].tolist() == [5.0, 6.0, 7.0, 8.0]
    assert left[9].item() == pytest.approx(-0.1)


def test_pack_quantized_reads_non_contiguous_indices_and_scale(device):
    residual = random_tensor(1000, torch.float32, seed=8)
    indices, scale = torch.tensor([1, 4, 15]), torch.tensor([0.5, 2.0, 3.0])
    expected_residual = residual.clone()
    expected = reference.pack_quantized_segments_(expected_residual, indices, 64, scale, 100, torch.int16)
    compiled_residual = residual.to(device)
    packed = ops.pack_quantized_segments_(compiled_residual, non_contiguous(indices, device), 64,
                                          non_contiguous(scale, device), 100, torch.int16)
    assert torch.equal(packed.cpu(), expected) and torch.equal(compiled_residual.cpu(), expected_residual)


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(indices=torch.tensor([0, 3]), scale=torch.ones(2)), r"indices must lie in \[0, 3\)"),
    (dict(indices=torch.tensor([2, 1]), scale=torch.ones(2)), "strictly increasing"),
    (dict(segment_size=0), "segment_size must be an integer >= 1"),
    (dict(residual=torch.ones(20)[::2]), "must be contiguous"),
    (dict(residual=torch.ones(10, dtype=torch.float16)), "residual must have dtype"),
    (dict(scale=torch.ones(3)), r"scale must have one entry per block \(2\)"),
    (dict(scale=torch.tensor([1.0, -1.0])), "scale must be finite and >= 0"),
    (dict(scale=torch.tensor([1.0, float("inf")])), "scale must be finite and >= 0"),
    (dict(scale=torch.ones(2, dtype=torch.float64)), "scale must have dtype"),
    (dict(levels=0), "levels must be an integer in \\[1, 127\\]"),
    (dict(levels=128), "levels must be an integer in \\[1, 127\\]"),
    (dict(dtype=torch.float32), "dtype must be int8, int16 or int32"),
    (dict(out=torch.zeros(7, dtype=torch.int8)), r"out must have shape \[8\]; got \[7\]"),
    (dict(out=torch.zeros(8, dtype=torch.int8), scale=torch.tensor([1.0, -1.0])), "scale must be finite"),
    (dict(out=torch.zeros(16, dtype=torch.int8)[::2]), "must be contiguous"),
])
def test_pack_quantized_rejects_bad_input(backend, case, match, device):
    args = dict(residual=torch.arange(1.0, 11.0), indices=torch.tensor([0, 2]), segment_size=4,
                scale=torch.ones(2), levels=10, dtype=torch.int8) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    guarded = [args["residual"]] + ([args["out"]] if "out" in args else [])
    with untouched(*guarded), pytest.raises((ValueError, TypeError), match=match):
        backend.pack_quantized_segments_(**args)


@BACKENDS
def test_pack_quantized_rejects_overlaps_and_an_out_of_another_dtype(backend, device):
    storage = torch.arange(40.0, device=device)
    indices = torch.tensor([0, 1], device=device)
    with untouched(storage), pytest.raises(ValueError, match="residual must not overlap scale"):
        backend.pack_quantized_segments_(storage[:20], indices, 4, storage[18:20], 10, torch.int8)
    residual = torch.arange(20.0, device=device)
    with untouched(residual), pytest.raises((ValueError, TypeError), match="out must have dtype"):
        backend.pack_quantized_segments_(residual, indices, 4, torch.ones(2, device=device), 10, torch.int8,
                                         out=torch.zeros(8, dtype=torch.int16, device=device))


def test_pack_quantized_ops_pass_opcheck(device):
    hc = torch.ops.hetero_comm
    residual = random_tensor(1000, torch.float32, 1).to(device)
    indices, scale = torch.tensor([0, 3, 31], device=device), torch.tensor([1.0, 2.0, 0.5], device=device)
    torch.library.opcheck(hc.pack_quantized_segments_.default, (residual.clone(), indices, 32, scale, 63,
                                                                torch.int8))
    torch.library.opcheck(hc.pack_quantized_segments_into_.default,
                          (residual.clone(), indices, 32, scale, 1000,
                           torch.empty(96, dtype=torch.int16, device=device)))


@pytest.mark.parametrize("packed_dtype", GRAD_DTYPES)
def test_unpack_reads_non_contiguous_packed(packed_dtype, device):
    packed = random_tensor(3 * 64, packed_dtype, seed=4)
    indices = torch.tensor([0, 5, 9])
    assert torch.equal(ops.unpack_segments(non_contiguous(packed, device), indices.to(device), 64, 620).cpu(),
                       reference.unpack_segments(packed, indices, 64, 620))


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(indices=torch.tensor([0, 3])), r"indices must lie in \[0, 3\)"),
    (dict(indices=torch.tensor([-1])), r"indices must lie in \[0, 3\)"),
    (dict(indices=torch.tensor([2, 1])), "strictly increasing"),
    (dict(indices=torch.tensor([1, 1])), "strictly increasing"),
    (dict(indices=torch.tensor([1], dtype=torch.int32)), "indices must have dtype"),
    (dict(segment_size=0), "segment_size must be an integer >= 1"),
    (dict(residual=torch.ones(10, dtype=torch.float64)), "residual must have dtype"),
    (dict(residual=torch.ones(20)[::2]), "must be contiguous"),
    (dict(out=torch.zeros(7)), r"out must have shape \[8\]; got \[7\]"),
    (dict(out=torch.zeros(8, dtype=torch.int32)), "out must have dtype"),
    (dict(indices=torch.tensor([2, 1]), out=torch.zeros(8, dtype=torch.bfloat16)), "strictly increasing"),
    (dict(indices=torch.tensor([0, 3]), out=torch.zeros(8, dtype=torch.float16)), r"indices must lie in"),
])
def test_pack_rejects_bad_input(backend, case, match, device):
    args = dict(residual=torch.arange(1.0, 11.0), indices=torch.tensor([0, 2]), segment_size=4) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    guarded = [args["residual"]] + ([args["out"]] if "out" in args else [])
    with untouched(*guarded), pytest.raises((ValueError, TypeError), match=match):
        backend.pack_segments_(**args)


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(packed=torch.ones(7)), "packed must have k \\* segment_size = 8"),
    (dict(packed=torch.ones(8, dtype=torch.int8)), "packed must have dtype"),
    (dict(indices=torch.tensor([0, 3])), r"indices must lie in \[0, 3\)"),
    (dict(numel=-1), "numel must be an integer >= 0"),
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(out=torch.zeros(11)), "out must have (shape \\[10\\]|numel = 10)"),
    (dict(out=torch.zeros(20)[::2]), "must be contiguous"),
])
def test_unpack_rejects_bad_input(backend, case, match, device):
    args = dict(packed=torch.ones(8), indices=torch.tensor([0, 2]), segment_size=4, numel=10) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    guarded = [args["packed"]] + ([args["out"]] if "out" in args else [])
    with untouched(*guarded), pytest.raises((ValueError, TypeError), match=match):
        backend.unpack_segments(**args)


# --------------------------------------------------------------------------------- opcheck
def test_segment_ops_pass_opcheck(device):
    to = lambda *tensors: [t.to(device) for t in tensors]
    residual, grad = to(random_tensor(1000, torch.float32, 1), random_tensor(1000, torch.bfloat16, 2))
    [indices] = to(torch.tensor([0, 3, 31]))
    hc = torch.ops.hetero_comm
    torch.library.opcheck(hc.segment_accumulate_.default, (residual.clone(), grad, 32))
    torch.library.opcheck(hc.select_segments.default, (*to(torch.rand(100)), 10))
    torch.library.opcheck(hc.pack_segments_.default, (residual.clone(), indices, 32))
    torch.library.opcheck(hc.pack_segments_into_.default,
                          (residual.clone(), indices, 32, *to(torch.empty(96, dtype=torch.float16))))
    [packed] = to(torch.rand(96))
    torch.library.opcheck(hc.unpack_segments.default, (packed, indices, 32, 1000, 0.5))
    torch.library.opcheck(hc.unpack_segments_into_.default, (packed, indices, 32, 0.5, *to(torch.empty(1000))))


@BACKENDS
@pytest.mark.parametrize("segment_size", [2**40, 2**62, 2**63 - 1])
def test_huge_segment_sizes_make_one_segment(backend, segment_size, device):
    # ceil(n / segment_size) must not overflow int64.
    residual = torch.zeros(10, device=device)
    importance = backend.segment_accumulate_(residual, torch.ones(10, device=device), segment_size)
    torch.testing.assert_close(importance.cpu(), torch.tensor([10 ** 0.5]))
    assert torch.equal(residual.cpu(), torch.ones(10))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    unpacked = backend.unpack_segments(torch.empty(0, device=device), empty, segment_size, 10)
    assert torch.equal(unpacked.cpu(), torch.zeros(10))


@BACKENDS
def test_out_buffers_overlapping_an_input_are_rejected(backend, device):
    storage = torch.arange(40.0, device=device)
    residual, out = storage[:20], storage[12:20]
    indices = torch.tensor([0, 1], device=device)
    with untouched(storage), pytest.raises(ValueError, match="out must not overlap residual"):
        backend.pack_segments_(residual, indices, 4, out=out)
    packed, flat = storage[:8], storage[4:24]
    with untouched(storage), pytest.raises(ValueError, match="out must not overlap packed"):
        backend.unpack_segments(packed, indices, 4, 20, out=flat)


@BACKENDS
def test_segment_accumulate_and_select_out_forms_write_the_given_buffers(backend, device):
    grad = random_tensor(10_000, torch.bfloat16, seed=21)
    residual, expected_residual = torch.zeros(10_000, device=device), torch.zeros(10_000)
    importance = torch.full((40,), float("nan"), device=device)
    assert backend.segment_accumulate_(residual, grad.to(device), 256, out=importance) is importance
    torch.testing.assert_close(importance.cpu(), reference.segment_accumulate_(expected_residual, grad, 256))
    assert torch.equal(residual.cpu(), expected_residual)
    indices = torch.full((5,), -1, dtype=torch.int64, device=device)
    assert backend.select_segments(importance, 5, out=indices) is indices
    assert torch.equal(indices.cpu(), reference.select_segments(importance.cpu(), 5))


@BACKENDS
@pytest.mark.parametrize("case, match", [
    ("importance_shape", r"out must have shape \[3\]"),
    ("importance_dtype", "out must have dtype"),
    ("importance_over_grad", "out must not overlap grad"),
    ("indices_k", "out must have"),
    ("indices_dtype", "out must have dtype"),
])
def test_segment_accumulate_and_select_reject_bad_out(backend, case, match, device):
    storage = torch.ones(20, device=device)
    residual, grad = torch.zeros(10, device=device), storage[:10]
    importance = torch.rand(10, device=device)
    new = lambda size, dtype=torch.float32: torch.zeros(size, dtype=dtype, device=device)
    with untouched(storage, residual, importance), pytest.raises((ValueError, TypeError), match=match):
        if case == "importance_shape":
            backend.segment_accumulate_(residual, grad, 4, out=new(4))
        elif case == "importance_dtype":
            backend.segment_accumulate_(residual, grad, 4, out=new(3, torch.float64))
        elif case == "importance_over_grad":
            backend.segment_accumulate_(residual, grad, 4, out=storage[8:11])
        elif case == "indices_k":
            backend.select_segments(importance, 3, out=new(4, torch.int64))
        else:
            backend.select_segments(importance, 3, out=new(3, torch.int32))


def test_segment_and_select_out_ops_pass_opcheck(device):
    hc = torch.ops.hetero_comm
    torch.library.opcheck(hc.segment_accumulate_into_.default,
                          (torch.zeros(1000, device=device), random_tensor(1000, torch.float32, 3).to(device), 32,
                           torch.empty(32, device=device)))
    torch.library.opcheck(hc.select_segments_into_.default,
                          (torch.rand(100, device=device), torch.empty(10, dtype=torch.int64, device=device)))
