"""sparse_encode_, sparse_pack_, sparse_unpack_ (the sparse codec's three steps): compiled ==
reference, what they keep, and bad input rejected before anything is written."""

import math

import pytest
import torch

from hetero_comm import ops, reference
from hetero_comm._layout import dct_coeffs_shape
from kernel_cases import (BACKENDS, GRAD_DTYPES, compiled_with_strict_checks,  # noqa: F401
                          random_tensor, untouched)

# (numel, segment_size, block_size): segments of elements (short last segments, one segment,
# several threads' worth) and DCT groups (a short last group, blocks of 8 and 64).
LAYOUTS = [(0, 4, 0), (1, 4, 0), (1000, 16, 0), (1003, 7, 0), (70_001, 256, 0), (300_007, 512, 0),
           (1000, 4, 8), (1003, 3, 8), (70_001, 16, 64), (300_007, 512, 64)]
WIRES = [(torch.float32, 0), (torch.bfloat16, 0), (torch.float16, 0), (torch.int8, 63),
         (torch.int16, 1000)]


def segments_of(numel, segment_size, block_size):
    return reference._codec_segments(numel, segment_size, block_size)


def coefficients_for(numel, segment_size, block_size):
    if not block_size:
        return None
    return torch.full(dct_coeffs_shape(numel, block_size, block_size, segment_size), math.nan)


def encoded(backend, residual, grad, segment_size, block_size, **settings):
    """(residual, importance, coefficients, velocity) after ``backend.sparse_encode_``."""
    residual = residual.clone()
    velocity = settings.pop("velocity", None)
    velocity = None if velocity is None else velocity.clone()
    importance = torch.full((segments_of(residual.numel(), segment_size, block_size),), math.nan)
    coefficients = coefficients_for(residual.numel(), segment_size, block_size)
    backend.sparse_encode_(residual, grad, segment_size, importance, block_size=block_size,
                           coefficients=coefficients, velocity=velocity, **settings)
    return residual, importance, coefficients, velocity


def dct_tolerance(block_size):
    """The fast transform against the reference's matrix product (see test_dct.py)."""
    return 3e-7 * block_size + 2e-6


# ------------------------------------------------------------------------------- encode
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel,segment_size,block_size", LAYOUTS)
@pytest.mark.parametrize("momentum", [None, "plain", "nesterov"])
def test_encode_matches_reference(numel, segment_size, block_size, dtype, momentum):
    residual = random_tensor(numel, torch.float32, seed=numel)
    grad = random_tensor(numel, dtype, seed=numel + 1)
    settings = dict(weight=0.25)
    if momentum:
        settings.update(velocity=random_tensor(numel, torch.float32, seed=numel + 2),
                        momentum=0.9, nesterov=momentum == "nesterov")
    compiled = encoded(ops, residual, grad, segment_size, block_size, **settings)
    expected = encoded(reference, residual, grad, segment_size, block_size, **settings)
    # The residual and velocity: one float32 product or sum per rounding, in the same order.
    assert torch.equal(compiled[0], expected[0])
    if momentum:
        assert torch.equal(compiled[3], expected[3])
    if block_size:
        torch.testing.assert_close(compiled[2], expected[2], rtol=0, atol=dct_tolerance(block_size) * 4)
        torch.testing.assert_close(compiled[1], expected[1], rtol=1e-5, atol=dct_tolerance(block_size) * 8)
    else:
        torch.testing.assert_close(compiled[1], expected[1], rtol=1e-5, atol=1e-6)
    assert not grad.isnan().any()


def test_encode_adds_the_weighted_gradient_and_measures_its_segments():
    residual, grad = torch.zeros(10), torch.arange(10.0)
    importance = torch.empty(3)
    ops.sparse_encode_(residual, grad, 4, importance, weight=0.5)
    assert torch.equal(residual, grad * 0.5)
    expected = torch.stack([(grad[:4] * 0.5).norm(), (grad[4:8] * 0.5).norm(), (grad[8:] * 0.5).norm()])
    torch.testing.assert_close(importance, expected)
    assert torch.equal(grad, torch.arange(10.0))  # not written


# --------------------------------------------------------------------------------- pack
def packed(backend, residual, importance, segment_size, block_size, k, wire_dtype, levels,
           coefficients=None, velocity=None, scale_factor=0.0):
    """Every buffer ``backend.sparse_pack_`` writes, and its result."""
    residual = residual.clone()
    coefficients = None if coefficients is None else coefficients.clone()
    velocity = None if velocity is None else velocity.clone()
    indices = torch.full((k,), -1, dtype=torch.int64)
    wire = torch.zeros(k * segment_size, dtype=wire_dtype)
    scale = torch.full((k,), math.nan) if levels else None
    finite = backend.sparse_pack_(residual, importance, segment_size, indices, wire,
                                  block_size=block_size, coefficients=coefficients,
                                  velocity=velocity, levels=levels, scale=scale,
                                  scale_factor=scale_factor)
    return dict(finite=finite, residual=residual, coefficients=coefficients, velocity=velocity,
                indices=indices, wire=wire, scale=scale)


@pytest.mark.parametrize("numel,segment_size,block_size", LAYOUTS)
@pytest.mark.parametrize("wire_dtype,levels", WIRES)
@pytest.mark.parametrize("with_velocity", [False, True])
def test_pack_matches_reference(numel, segment_size, block_size, wire_dtype, levels, with_velocity):
    residual = random_tensor(numel, torch.float32, seed=numel)
    velocity = random_tensor(numel, torch.float32, seed=numel + 3) if with_velocity else None
    _, importance, coefficients, _ = encoded(reference, residual, torch.zeros(numel), segment_size,
                                             block_size)
    count = importance.numel()
    k = min(count, max(1, count // 10))
    factor = 4.0 / (2 * math.sqrt(segment_size))
    args = (residual, importance, segment_size, block_size, k, wire_dtype, levels, coefficients,
            velocity, factor if levels else 0.0)
    compiled, expected = packed(ops, *args), packed(reference, *args)
    assert compiled["finite"] and expected["finite"]
    assert torch.equal(compiled["indices"], expected["indices"])
    if levels:
        assert torch.equal(compiled["scale"], expected["scale"])
    # Packing moves values exactly; the DCT's keep-the-rest and velocity restart go through
    # the fast inverse transform (compiled) or the matrix product (reference).
    assert torch.equal(compiled["wire"], expected["wire"])
    tolerance = dict(rtol=0, atol=dct_tolerance(block_size) * 8) if block_size else dict(rtol=0, atol=0)
    torch.testing.assert_close(compiled["residual"], expected["residual"], **tolerance)
    if with_velocity:
        torch.testing.assert_close(compiled["velocity"], expected["velocity"], **tolerance)


@BACKENDS
def test_pack_sends_the_most_important_segments_and_keeps_the_rest(backend):
    residual = torch.tensor([1.0, 1.0, 5.0, 5.0, 2.0, 2.0, 9.0])
    importance = torch.tensor([1.0, 7.0, 3.0, 9.0])
    result = packed(backend, residual, importance, 2, 0, 2, torch.float32, 0,
                    velocity=torch.ones(7))
    assert result["indices"].tolist() == [1, 3]
    assert result["wire"].tolist() == [5.0, 5.0, 9.0, 0.0]  # a short last segment: zero-padded
    assert result["residual"].tolist() == [1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 0.0]
    assert result["velocity"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # restarted


@BACKENDS
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_pack_writes_nothing_for_an_importance_that_is_not_finite(backend, bad):
    residual, velocity = torch.randn(64), torch.randn(64)
    importance = torch.rand(8)
    importance[5] = bad
    indices, wire, scale = torch.zeros(2, dtype=torch.int64), torch.zeros(16, dtype=torch.int8), torch.ones(2)
    with untouched(residual, velocity, importance, indices, wire, scale):
        assert backend.sparse_pack_(residual, importance, 8, indices, wire, velocity=velocity,
                                    levels=63, scale=scale, scale_factor=1.0) is False


@BACKENDS
def test_pack_scales_a_short_last_segment_by_its_own_length(backend):
    """The scale is the agreed RMS: a last segment of 2 of 8 values has sqrt(8 / 2) times the
    RMS its norm over 8 would give."""
    importance = torch.tensor([4.0, 2.0])
    result = packed(backend, torch.ones(10), importance, 8, 0, 2, torch.int8, 63, scale_factor=0.5)
    assert result["scale"].tolist() == [2.0, 2.0]


# ------------------------------------------------------------------------------- unpack
@pytest.mark.parametrize("numel,segment_size,block_size", LAYOUTS)
@pytest.mark.parametrize("wire_dtype,levels", WIRES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("sign", [False, True])
def test_unpack_matches_reference(numel, segment_size, block_size, wire_dtype, levels, dtype, sign):
    count = segments_of(numel, segment_size, block_size)
    k = min(count, max(1, count // 7))
    generator = torch.Generator().manual_seed(numel + k)
    indices = torch.randperm(count, generator=generator)[:k].sort().values
    if levels:
        wire = torch.randint(-levels, levels + 1, (k * segment_size,), generator=generator).to(wire_dtype)
        scale = torch.rand(k, generator=generator)
    else:
        wire, scale = random_tensor(k * segment_size, wire_dtype, seed=k), None
    results = []
    for backend in (ops, reference):
        grad = torch.full((numel,), math.nan, dtype=dtype)
        backend.sparse_unpack_(wire, indices, segment_size, grad, levels=levels, scale=scale,
                               block_size=block_size, sign=sign,
                               coefficients=coefficients_for(numel, segment_size, block_size))
        results.append(grad)
    compiled, expected = results
    assert not compiled.isnan().any()
    if block_size and not sign:
        torch.testing.assert_close(compiled.float(), expected.float(), rtol=1e-2 if dtype != torch.float32 else 0,
                                   atol=dct_tolerance(block_size) * 8)
    elif block_size:  # a sign can flip only where the decoded value is within rounding of 0
        differ = compiled != expected
        assert differ.float().mean() < 1e-3
    else:
        assert torch.equal(compiled, expected)


@BACKENDS
def test_unpack_dequantizes_and_scatters_with_zeros_elsewhere(backend):
    wire = torch.tensor([2, -4, 1, 0], dtype=torch.int8)
    grad = torch.full((7,), math.nan)
    backend.sparse_unpack_(wire, torch.tensor([0, 3]), 2, grad, levels=4, scale=torch.tensor([2.0, 8.0]))
    assert grad.tolist() == [1.0, -2.0, 0.0, 0.0, 0.0, 0.0, 2.0]  # segment 3 is the short last one


# --------------------------------------------------------------------------- the three
@pytest.mark.parametrize("numel,segment_size,block_size", [(1000, 16, 0), (1003, 7, 0), (1000, 4, 8),
                                                           (5000, 8, 64)])
@BACKENDS
def test_what_is_sent_and_what_is_kept_add_up_to_the_residual_and_contribution(numel, segment_size,
                                                                           block_size, backend):
    """Error feedback's law, one rank, a float32 wire: the delivered gradient plus the kept
    residual equals the old residual plus the weighted gradient."""
    residual = random_tensor(numel, torch.float32, seed=1)
    grad = random_tensor(numel, torch.float32, seed=2)
    kept, importance, coefficients, _ = encoded(backend, residual, grad, segment_size, block_size,
                                                weight=0.5)
    k = max(1, importance.numel() // 10)
    sent = packed(backend, kept, importance, segment_size, block_size, k, torch.float32, 0,
                  coefficients=coefficients)
    delivered = torch.empty(numel)
    backend.sparse_unpack_(sent["wire"], sent["indices"], segment_size, delivered,
                           block_size=block_size, coefficients=sent["coefficients"])
    torch.testing.assert_close(delivered + sent["residual"], residual + 0.5 * grad,
                               rtol=0, atol=1e-5 if block_size else 0)
    assert delivered.count_nonzero() > 0 and sent["residual"].count_nonzero() > 0


# ---------------------------------------------------------------------------- bad input
def encode_call(**changes):
    args = dict(residual=torch.ones(10), grad=torch.ones(10), segment_size=4,
                importance=torch.zeros(3)) | changes
    return lambda backend: backend.sparse_encode_(**args), args


@BACKENDS
@pytest.mark.parametrize("changes, match", [
    (dict(residual=torch.ones(10, dtype=torch.float16)), "residual must have dtype float32"),
    (dict(grad=torch.ones(11)), "grad must have as many elements as residual"),
    (dict(segment_size=0), "segment_size must be an integer >= 1"),
    (dict(block_size=6), "block_size must be a power of two"),
    (dict(block_size=4), "block_size > 0 .the DCT basis. needs the coefficients buffer"),
    (dict(coefficients=torch.zeros(1, 4, 4)), "coefficients is the DCT's work buffer"),
    (dict(block_size=4, coefficients=torch.zeros(1, 4, 3)), r"coefficients must have shape \[1, 4, 4\]"),
    (dict(weight=math.nan), "weight must be finite"),
    (dict(velocity=torch.ones(9)), "velocity must have as many elements as residual"),
    (dict(velocity=torch.ones(10), momentum=1.0), r"momentum must be in \[0, 1\)"),
    (dict(momentum=0.9), "momentum and nesterov need the velocity buffer"),
    (dict(importance=torch.zeros(4)), r"importance must have shape \[3\]"),
    (dict(importance=torch.zeros(3, dtype=torch.float64)), "importance must have dtype float32"),
])
def test_encode_rejects_bad_input_untouched(backend, changes, match):
    call, args = encode_call(**changes)
    tensors = [value for value in args.values() if isinstance(value, torch.Tensor)]
    with untouched(*tensors), pytest.raises((ValueError, TypeError), match=match):
        call(backend)


@BACKENDS
@pytest.mark.parametrize("changes, match", [
    (dict(indices=torch.zeros(4, dtype=torch.int64)), r"k = indices.numel\(\) = must be an integer in \[0, 3\]"),
    (dict(indices=torch.zeros(1, dtype=torch.int32)), "indices must have dtype int64"),
    (dict(wire=torch.zeros(5)), r"wire must have shape \[4\]"),
    (dict(wire=torch.zeros(4, dtype=torch.int8)), "wire must have dtype float32, bfloat16, float16"),
    (dict(levels=3), "wire must have dtype int8, int16, int32"),
    (dict(levels=200, wire=torch.zeros(4, dtype=torch.int8), scale=torch.zeros(1)),
     r"levels must be an integer in \[1, 127\]"),
    (dict(levels=3, wire=torch.zeros(4, dtype=torch.int8)), "levels > 0 .an integer wire. needs the scale"),
    (dict(scale=torch.zeros(1)), "scale is the integer wire's"),
    (dict(levels=3, wire=torch.zeros(4, dtype=torch.int8), scale=torch.zeros(1), scale_factor=-1.0),
     "scale_factor must be finite and >= 0"),
    (dict(importance=torch.ones(2)), r"importance must have one value per segment \(3\)"),
])
def test_pack_rejects_bad_input_untouched(backend, changes, match):
    args = dict(residual=torch.ones(10), importance=torch.ones(3), segment_size=4,
                indices=torch.zeros(1, dtype=torch.int64), wire=torch.zeros(4)) | changes
    tensors = [value for value in args.values() if isinstance(value, torch.Tensor)]
    with untouched(*tensors), pytest.raises((ValueError, TypeError), match=match):
        backend.sparse_pack_(**args)


@BACKENDS
def test_pack_rejects_a_wire_that_overlaps_the_residual(backend):
    storage = torch.ones(14)
    residual, wire = storage[:10], storage[6:10]
    with untouched(storage), pytest.raises(ValueError, match="wire must not overlap residual"):
        backend.sparse_pack_(residual, torch.ones(3), 4, torch.zeros(1, dtype=torch.int64), wire)


@BACKENDS
@pytest.mark.parametrize("changes, match", [
    (dict(indices=torch.tensor([1, 0])), "indices must be strictly increasing"),
    (dict(indices=torch.tensor([3])), r"indices must lie in \[0, 3\)"),
    (dict(wire=torch.zeros(5)), "wire must have k [*] segment_size = 4 elements"),
    (dict(grad=torch.zeros(10, dtype=torch.int32)), "grad must have dtype"),
    (dict(levels=3, wire=torch.zeros(4, dtype=torch.int8)), "levels > 0 .an integer wire. needs the scale"),
    (dict(levels=3, wire=torch.zeros(4, dtype=torch.int8), scale=torch.tensor([math.nan])),
     "scale must be finite and >= 0"),
    (dict(scale=torch.ones(1)), "scale is the integer wire's"),
])
def test_unpack_rejects_bad_input_untouched(backend, changes, match):
    args = dict(wire=torch.zeros(4), indices=torch.tensor([1]), segment_size=4,
                grad=torch.ones(10)) | changes
    tensors = [value for value in args.values() if isinstance(value, torch.Tensor)]
    with untouched(*tensors), pytest.raises((ValueError, TypeError), match=match):
        backend.sparse_unpack_(**args)


def test_encode_and_unpack_pass_opcheck():
    residual, grad, importance = torch.randn(100), torch.randn(100), torch.empty(7)
    torch.library.opcheck(torch.ops.hetero_comm.sparse_encode_.default,
                          (residual, grad, 0.5, torch.randn(100), 0.9, False, 16, 0, None, importance))
    coefficients = torch.empty(dct_coeffs_shape(100, 8, 8, 4))
    torch.library.opcheck(torch.ops.hetero_comm.sparse_encode_.default,
                          (residual, grad, 1.0, None, 0.0, False, 4, 8, coefficients,
                           torch.empty(coefficients.shape[0] * 8)))
    wire, indices, scale = torch.randint(-5, 6, (32,), dtype=torch.int8), torch.tensor([1, 4]), torch.rand(2)
    torch.library.opcheck(torch.ops.hetero_comm.sparse_unpack_.default,
                          (wire, indices, scale, 5, 16, 0, True, None, torch.empty(100)))


# ------------------------------------------------------------------ the hook's bucket codec
class _CodecSettings:
    """What :class:`BucketCodec` reads from a hook state (the int8 wire, as both recipes)."""
    wire_dtype, output = "int8", "sum"

    def __init__(self, block_size):
        self.basis, self.dct_block_size = ("dct", block_size) if block_size else ("elements", 0)

    def int8_levels(self):
        return 63

    def sums_in_two_phases(self):
        return False

    def exchange_size(self):
        return 2


@pytest.mark.parametrize("numel,segment_size,block_size", [(4224, 66, 64), (8256, 129, 64),
                                                           (1003, 3, 8), (4160, 16, 0),
                                                           (1003, 7, 0)])
@pytest.mark.parametrize("momentum", [None, "plain", "nesterov"])
def test_bucket_codec_calls_the_compiled_ops_as_the_reference_kernels_would(
        numel, segment_size, block_size, momentum, monkeypatch):
    """The hook's codec calls the compiled ops directly (no wrapper): the same selection,
    wire, residual, velocity and bucket as the reference kernels (through ``ops`` with the
    compiled ones switched off)."""
    from hetero_comm import kernel_backend
    from hetero_comm.hooks._codec import BucketCodec
    if kernel_backend("cpu") != "compiled":
        pytest.skip("the compiled kernels are not built")
    count = (math.prod(dct_coeffs_shape(numel, block_size, block_size, segment_size)[:2])
             if block_size else -(-numel // segment_size))
    runs = []
    for compiled in (True, False):
        codec = BucketCodec(_CodecSettings(block_size), numel, max(1, count // 10), segment_size,
                            count, torch.device("cpu"))
        assert codec.compiled  # (built on the CPU with the kernels)
        codec.compiled = compiled
        monkeypatch.setattr(ops, "_codec_compiled", lambda tensor, on=compiled: on)
        residual = random_tensor(numel, torch.float32, seed=1)
        velocity = None if momentum is None else random_tensor(numel, torch.float32, seed=3)
        codec.encode(residual, random_tensor(numel, torch.float32, seed=2), 0.5, velocity,
                     0.0 if momentum is None else 0.9, momentum == "nesterov")
        assert codec.pack(residual, velocity)
        runs.append(dict(codec=codec, residual=residual, velocity=velocity))
    compiled, by_reference = runs
    assert torch.equal(compiled["codec"].indices, by_reference["codec"].indices)
    # Each codec's importance is its own encode's (the norms' sums differ by rounding, and on
    # the DCT basis the transforms), so a scale may differ in its last bit: a value at a
    # step's edge may round the other way, and the residual keeps the difference.
    wire_gap = (compiled["codec"].wire.int() - by_reference["codec"].wire.int()).abs().max()
    assert wire_gap <= 1
    tolerance = dct_tolerance(block_size) * 8 if block_size else 1e-6
    torch.testing.assert_close(compiled["residual"], by_reference["residual"], rtol=1e-5,
                               atol=tolerance)
    if momentum:
        torch.testing.assert_close(compiled["velocity"], by_reference["velocity"], rtol=1e-5,
                                   atol=tolerance)
    unpacked = []
    for run, on in zip(runs, (True, False)):  # the same summed wire into the bucket
        monkeypatch.setattr(ops, "_codec_compiled", lambda tensor, on=on: on)
        bucket = torch.full((numel,), math.nan)
        run["codec"].unpack(compiled["codec"].wire, compiled["codec"].scale, bucket)
        unpacked.append(bucket)
    torch.testing.assert_close(unpacked[0], unpacked[1], rtol=1e-5, atol=tolerance)
