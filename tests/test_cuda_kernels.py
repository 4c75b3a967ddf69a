"""CUDA kernels (cuda/*.cu): each hetero_comm.ops kernel on a GPU equals the reference on CPU.

Runs only on a machine with a GPU and an extension built with its CUDA kernels; elsewhere
every test is skipped with the reason.
"""

import os

import pytest
import torch

import hetero_comm
from hetero_comm import ops, reference
from hetero_comm._python_pool import PythonBufferPool, pool_device
from kernel_cases import GRAD_DTYPES, random_tensor, untouched


def _skip_reason() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    backend = hetero_comm.kernel_backend("cuda")
    if backend != "compiled":
        # A build asked to include CUDA must not pass as green by skipping everything.
        assert os.environ.get("HETERO_COMM_BUILD_CUDA") != "1", (
            "HETERO_COMM_BUILD_CUDA=1 but the CUDA kernels are not registered: "
            f"{hetero_comm._backend.load_error}")
        return f"the CUDA kernels are not built (kernel_backend('cuda') is {backend!r})"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "runs")

SIZES = (0, 1, 7, 255, 256, 257, 4099, 70_001, 300_007)
SEGMENT_SIZES = (1, 3, 8, 64, 65, 256, 2048, 2049, 5000)


def cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


def cuda_non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The values of the 1-D ``t`` on the GPU, as every other element of a larger tensor
    (``.to("cuda")`` of a strided CPU view would come back contiguous)."""
    wide = torch.zeros(2 * t.numel(), dtype=t.dtype, device="cuda")
    wide[::2] = cuda(t)
    view = wide[::2]
    assert t.numel() <= 1 or not view.is_contiguous()
    return view


@pytest.mark.parametrize("numel", [5_000_001])
def test_large_inputs_take_the_grid_stride_loops_more_than_once(numel):
    # Launches are capped near 2.1M threads: these sizes make each thread loop.
    grad = random_tensor(numel, torch.float32, seed=1)
    residual = torch.zeros(numel)
    on_gpu = cuda(residual)
    for segment_size in (1, 8):
        on_gpu.zero_()
        importance = ops.segment_accumulate_(on_gpu, cuda(grad), segment_size)
        expected = reference.segment_accumulate_(torch.zeros(numel), grad, segment_size)
        torch.testing.assert_close(importance.cpu(), expected, rtol=1e-5, atol=1e-6)
    importance = torch.rand(3_000_000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ops.select_segments(cuda(importance), 30_000).cpu(),
                       reference.select_segments(importance, 30_000))
    x = random_tensor(3_000_000, torch.float32, seed=3).view(3000, 1000)
    scale = x.abs().amax(dim=1)
    assert torch.equal(ops.quantize(cuda(x), cuda(scale), 127, torch.int8).cpu(),
                       reference.quantize(x, scale, 127, torch.int8))


def test_kernels_run_on_the_current_stream():
    x = random_tensor(100_000, torch.float32, seed=4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        coeffs = ops.dct_encode(cuda(x), 256, 32)
        decoded = ops.dct_decode(coeffs, 256, x.numel())
    stream.synchronize()
    torch.testing.assert_close(decoded.cpu(), reference.dct_decode(reference.dct_encode(x, 256, 32), 256,
                                                                   x.numel()), rtol=0, atol=1e-4)


def test_regressions_found_in_review():
    # ceil(n / segment_size) must not overflow; 0 * inf (a tiny scale) quantizes to 0.
    residual = cuda(torch.zeros(10))
    importance = ops.segment_accumulate_(residual, cuda(torch.ones(10)), 2**63 - 1)
    torch.testing.assert_close(importance.cpu(), torch.tensor([10 ** 0.5]))
    x = torch.tensor([[0.0, 1e-37, -1e-37]])
    q = ops.quantize(cuda(x), cuda(torch.tensor([1e-37])), 127, torch.int8)
    assert q.cpu().tolist() == [[0, 127, -127]]


# ---------------------------------------------------------------------- segment_accumulate_
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("segment_size", SEGMENT_SIZES)
def test_segment_accumulate(numel, segment_size, dtype):
    residual = random_tensor(numel, torch.float32, seed=numel)
    grad = random_tensor(numel, dtype, seed=numel + 1)
    on_gpu = cuda(residual)
    importance = ops.segment_accumulate_(on_gpu, cuda(grad), segment_size)
    expected = reference.segment_accumulate_(residual, grad, segment_size)
    assert importance.device.type == "cuda" and importance.dtype == torch.float32
    assert torch.equal(on_gpu.cpu(), residual)  # one float32 add per element: exact
    torch.testing.assert_close(importance.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_segment_accumulate_reads_non_contiguous_grad():
    grad = random_tensor(5000, torch.bfloat16, seed=3)
    a, b = torch.zeros(5000, device="cuda"), torch.zeros(5000, device="cuda")
    strided = cuda_non_contiguous(grad)
    torch.testing.assert_close(ops.segment_accumulate_(a, strided, 64),
                               ops.segment_accumulate_(b, cuda(grad), 64), rtol=0, atol=0)
    assert torch.equal(a, b)


def test_segment_accumulate_rejects_bad_input_untouched():
    residual = torch.ones(10, device="cuda")
    with untouched(residual), pytest.raises(ValueError, match="grad must have as many elements"):
        ops.segment_accumulate_(residual, torch.ones(11, device="cuda"), 4)
    with untouched(residual), pytest.raises(ValueError, match="all tensors must be on one device"):
        torch.ops.hetero_comm.segment_accumulate_.default(residual, torch.ones(10), 4)


# -------------------------------------------------------------------------- select_segments
def _importance_cases():
    generator = torch.Generator().manual_seed(0)
    yield "empty", torch.zeros(0)
    yield "single", torch.tensor([3.0])
    yield "random", torch.rand(1000, generator=generator)
    yield "ties", torch.randint(0, 4, (5000,), generator=generator).float()
    signed_zeros = torch.zeros(300)
    signed_zeros[::3] = -0.0
    signed_zeros[7] = 1.0
    yield "signed_zeros", signed_zeros
    yield "all_equal", torch.full((10_000,), 2.5)
    yield "negative", torch.randn(3000, generator=generator)
    # Several tiles and a threshold bin shared by many keys.
    yield "large", torch.randint(0, 1000, (300_007,), generator=generator).float() / 7
    yield "huge_range", torch.randn(100_000, generator=generator) * torch.logspace(-30, 30, 100_000)


@pytest.mark.parametrize("name, importance", list(_importance_cases()),
                         ids=[name for name, _ in _importance_cases()])
def test_select_segments(name, importance):
    count = importance.numel()
    for k in sorted({0, 1, count // 100, count // 3, count - 1, count} & set(range(count + 1))):
        selected = ops.select_segments(cuda(importance), k)
        assert selected.device.type == "cuda" and selected.dtype == torch.int64
        assert torch.equal(selected.cpu(), reference.select_segments(importance, k)), (name, k)


def test_select_segments_is_deterministic():
    importance = cuda(torch.randint(0, 3, (200_000,)).float())
    first = ops.select_segments(importance, 50_000)
    for _ in range(3):
        assert torch.equal(ops.select_segments(importance, 50_000), first)


def test_select_segments_reads_non_contiguous_input():
    importance = torch.rand(3001)
    strided = cuda_non_contiguous(importance)
    assert torch.equal(ops.select_segments(strided, 100).cpu(),
                       reference.select_segments(importance, 100))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_select_segments_rejects_non_finite(bad):
    importance = torch.rand(5000)
    importance[4321] = bad
    with pytest.raises(ValueError, match="importance must be finite"):
        ops.select_segments(cuda(importance), 10)


# ---------------------------------------------------------------- pack / unpack segments
@pytest.mark.parametrize("out_dtype", (None,) + GRAD_DTYPES)
@pytest.mark.parametrize("numel", (1, 7, 257, 4099, 70_001))
@pytest.mark.parametrize("segment_size", (1, 3, 64, 1000))
def test_pack_segments(numel, segment_size, out_dtype):
    residual = random_tensor(numel, torch.float32, seed=numel)
    segments = -(-numel // segment_size)
    for k in sorted({0, 1, segments // 4, segments}):
        indices = torch.randperm(segments, generator=torch.Generator().manual_seed(k))[:k].sort().values
        out = None if out_dtype is None else torch.empty(k * segment_size, dtype=out_dtype)
        expected_residual = residual.clone()
        expected = reference.pack_segments_(expected_residual, indices, segment_size, out=out)
        on_gpu = cuda(residual)
        gpu_out = None if out is None else torch.full_like(cuda(out), float("nan"))
        packed = ops.pack_segments_(on_gpu, cuda(indices), segment_size, out=gpu_out)
        if gpu_out is not None:
            assert packed is gpu_out
        assert packed.dtype == expected.dtype and packed.shape == expected.shape
        assert torch.equal(packed.cpu(), expected)  # copies and one rounding: exact
        assert torch.equal(on_gpu.cpu(), expected_residual)


@pytest.mark.parametrize("packed_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", (None,) + GRAD_DTYPES)
@pytest.mark.parametrize("numel", (0, 1, 7, 257, 4099, 70_001))
@pytest.mark.parametrize("segment_size", (1, 3, 64, 1000))
def test_unpack_segments(numel, segment_size, packed_dtype, out_dtype):
    segments = -(-numel // segment_size)
    for k, scale in sorted({(0, 1.0), (1, 0.5), (segments // 3, 1 / 3), (segments, -2.0)}):
        if k > segments:
            continue
        indices = torch.randperm(segments, generator=torch.Generator().manual_seed(k))[:k].sort().values
        packed = random_tensor(k * segment_size, packed_dtype, seed=k)
        out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
        expected = reference.unpack_segments(packed, indices, segment_size, numel, scale, out=out)
        gpu_out = None if out is None else torch.full_like(cuda(out), float("nan"))
        result = ops.unpack_segments(cuda(packed), cuda(indices), segment_size, numel, scale,
                                     out=gpu_out)
        assert result.dtype == expected.dtype and result.shape == expected.shape
        # Every element written (no NaN left); float32(packed) * float32(scale), as PyTorch
        # multiplies by a Python float, then one rounding to the output dtype: exact.
        assert torch.equal(result.cpu(), expected)


def test_unpack_reads_non_contiguous_packed():
    packed = random_tensor(3 * 64, torch.float16, seed=1)
    indices = torch.tensor([0, 5, 9])
    strided = cuda_non_contiguous(packed)
    assert torch.equal(ops.unpack_segments(strided, cuda(indices), 64, 640).cpu(),
                       reference.unpack_segments(packed, indices, 64, 640))


def test_pack_rejects_bad_indices_untouched():
    residual = cuda(torch.arange(100.0))
    for indices, match in [([3, 2], "strictly increasing"), ([0, 25], r"indices must lie in \[0, 25\)")]:
        with untouched(residual), pytest.raises(ValueError, match=match):
            ops.pack_segments_(residual, cuda(torch.tensor(indices)), 4)
    out = torch.empty(8, device="cuda")
    with untouched(residual, out), pytest.raises(ValueError, match="out must have shape"):
        ops.pack_segments_(residual, cuda(torch.tensor([1])), 4, out=out)


# ---------------------------------------------------------------------------------- DCT
def _dct_tolerance(expected: torch.Tensor) -> dict:
    # The reference is a float32 matmul; both sides are accurate to float32 rounding of the
    # block's magnitude.
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    return {"rtol": 1e-5, "atol": 1e-5 * max(scale, 1.0)}


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", (0, 1, 7, 1000, 4099))
@pytest.mark.parametrize("block_size", (1, 2, 8, 64, 1024))
def test_dct_encode_and_decode(numel, block_size, dtype):
    x = random_tensor(numel, dtype, seed=numel)
    for keep in sorted({0, 1, block_size // 2, block_size}):
        coeffs = ops.dct_encode(cuda(x), block_size, keep)
        expected = reference.dct_encode(x, block_size, keep)
        assert coeffs.shape == expected.shape and coeffs.dtype == torch.float32
        torch.testing.assert_close(coeffs.cpu(), expected, **_dct_tolerance(expected))
        decoded = ops.dct_decode(cuda(expected), block_size, numel)
        expected_decoded = reference.dct_decode(expected, block_size, numel)
        assert decoded.shape == (numel,)
        torch.testing.assert_close(decoded.cpu(), expected_decoded, **_dct_tolerance(expected_decoded))


def _float64_dct(x: torch.Tensor, block_size: int, keep: int) -> torch.Tensor:
    """DCT-II of x's zero-padded blocks in float64, only the first `keep` rows of the basis
    (the reference builds the whole B x B basis: 32 GiB at B = 65536)."""
    blocks = -(-x.numel() // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float64)
    padded[: x.numel()] = x.double()
    n = torch.arange(block_size, dtype=torch.float64)
    k = torch.arange(keep, dtype=torch.float64).view(-1, 1)
    basis = torch.cos(torch.pi * (2 * n + 1) * k / (2 * block_size)) * (2.0 / block_size) ** 0.5
    if keep:
        basis[0] /= 2 ** 0.5
    return padded.view(blocks, block_size) @ basis.T


@pytest.mark.parametrize("block_size, keep", [(512, 512), (4096, 100), (65536, 16)])
def test_dct_accuracy_against_float64(block_size, keep):
    # The kernel sums in float64 with float64 cosines: float32 rounding of the result only.
    x = random_tensor(70_000, torch.float32, seed=9)
    coeffs = ops.dct_encode(cuda(x), block_size, keep).cpu().double()
    exact = _float64_dct(x, block_size, keep)
    assert float((coeffs - exact).abs().max()) <= 1e-6 * float(exact.abs().max())


def test_dct_round_trip_with_every_coefficient():
    x = random_tensor(8192, torch.float32, seed=5)
    coeffs = ops.dct_encode(cuda(x), 4096, 4096)
    torch.testing.assert_close(ops.dct_decode(coeffs, 4096, 8192).cpu(), x, rtol=1e-5, atol=1e-5)


def test_dct_reads_non_contiguous_input():
    x = random_tensor(1000, torch.float32, seed=2)
    strided = cuda_non_contiguous(x)
    torch.testing.assert_close(ops.dct_encode(strided, 64, 8), ops.dct_encode(cuda(x), 64, 8),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", (0, 1, 7, 1000, 4099))
@pytest.mark.parametrize("block_size", (1, 8, 64, 1024))
def test_dct_out_forms_write_the_given_buffers(numel, block_size, dtype):
    x = random_tensor(numel, dtype, seed=numel + 1)
    blocks = -(-numel // block_size)
    for keep in sorted({0, 1, block_size // 2, block_size}):
        expected = reference.dct_encode(x, block_size, keep, out=torch.empty(blocks, keep))
        out = torch.full((blocks, keep), float("nan"), device="cuda")
        assert ops.dct_encode(cuda(x), block_size, keep, out=out) is out
        torch.testing.assert_close(out.cpu(), expected, **_dct_tolerance(expected))
        # One kernel behind both forms: the out= form equals the allocating one bit for bit.
        assert torch.equal(out, ops.dct_encode(cuda(x), block_size, keep))

        expected_decoded = reference.dct_decode(expected, block_size, numel, out=torch.empty(numel))
        decoded = torch.full((numel,), float("nan"), device="cuda")
        assert ops.dct_decode(cuda(expected), block_size, numel, out=decoded) is decoded
        torch.testing.assert_close(decoded.cpu(), expected_decoded,
                                   **_dct_tolerance(expected_decoded))
        assert torch.equal(decoded, ops.dct_decode(cuda(expected), block_size, numel))


def test_dct_out_forms_read_non_contiguous_input():
    x = random_tensor(1000, torch.float16, seed=6)
    out = torch.full((16, 8), float("nan"), device="cuda")
    ops.dct_encode(cuda_non_contiguous(x), 64, 8, out=out)
    assert torch.equal(out, ops.dct_encode(cuda(x), 64, 8))
    coeffs = ops.dct_encode(cuda(x), 64, 64)
    strided = torch.zeros(16, 128, device="cuda")[:, ::2]
    strided.copy_(coeffs)
    decoded = torch.full((1000,), float("nan"), device="cuda")
    ops.dct_decode(strided, 64, 1000, out=decoded)
    assert torch.equal(decoded, ops.dct_decode(coeffs, 64, 1000))


@pytest.mark.parametrize("op, out, match", [
    ("encode", lambda: torch.zeros(3, 8, device="cuda"), "out must have shape"),
    ("encode", lambda: torch.zeros(2, 8, dtype=torch.float64, device="cuda"), "out must have dtype"),
    ("encode", lambda: torch.zeros(2, 16, device="cuda")[:, ::2], "must be contiguous"),
    ("encode", lambda: torch.zeros(2, 8), "all tensors must be on one device"),
    ("decode", lambda: torch.zeros(100, dtype=torch.float16, device="cuda"), "out must have dtype"),
    ("decode", lambda: torch.zeros(200, device="cuda")[::2], "must be contiguous"),
    ("decode", lambda: torch.zeros(100), "all tensors must be on one device"),
])
def test_dct_out_forms_reject_bad_buffers_untouched(op, out, match):
    # The ops themselves (not the ops.* wrappers), so the CUDA kernel's checks are the ones hit.
    out = out()
    x = cuda(random_tensor(100, torch.float32, seed=1))
    coeffs = cuda(random_tensor(2 * 8, torch.float32, seed=2).view(2, 8))
    with untouched(out, x, coeffs), pytest.raises((ValueError, TypeError), match=match):
        if op == "encode":
            torch.ops.hetero_comm.dct_encode_into_.default(x, 64, out)
        else:
            torch.ops.hetero_comm.dct_decode_into_.default(coeffs, 64, out)


# ----------------------------------------------------------------------------- quantize
QUANT_CASES = [(torch.int8, 1), (torch.int8, 7), (torch.int8, 127), (torch.int16, 32767),
               (torch.int32, 1000), (torch.int32, 2 ** 31 - 1)]


@pytest.mark.parametrize("dtype, levels", QUANT_CASES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1), (7, 33), (100, 1000)])
def test_quantize_and_dequantize_are_bit_identical(shape, dtype, levels):
    x = random_tensor(shape[0] * shape[1], torch.float32, seed=shape[0]).view(shape)
    scale = x.abs().amax(dim=1) if shape[1] else torch.ones(shape[0])
    if shape[0] > 2:
        scale[1] = 0.0          # a zero scale quantizes its block to zero
        scale[2] *= 0.5         # values beyond the scale are clamped
    q = ops.quantize(cuda(x), cuda(scale), levels, dtype)
    expected = reference.quantize(x, scale, levels, dtype)
    assert q.dtype == dtype and torch.equal(q.cpu(), expected)
    x_hat = ops.dequantize(cuda(expected), cuda(scale), levels)
    assert torch.equal(x_hat.cpu(), reference.dequantize(expected, scale, levels))


def test_quantize_rounds_half_to_even():
    x = (torch.arange(-40, 40, dtype=torch.float32) + 0.5).view(2, 40)
    scale = torch.full((2,), 100.0)
    q = ops.quantize(cuda(x), cuda(scale), 100, torch.int32)
    assert torch.equal(q.cpu(), reference.quantize(x, scale, 100, torch.int32))
    assert torch.equal(q.cpu(), torch.round(x).to(torch.int32))


def test_quantize_reads_non_contiguous_input():
    x = random_tensor(20 * 30, torch.float32, seed=4).view(20, 30)
    scale = x.abs().amax(dim=1)
    q = ops.quantize(cuda(x).t().contiguous().t(), cuda(scale), 127, torch.int8)
    assert torch.equal(q.cpu(), reference.quantize(x, scale, 127, torch.int8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_rejects_non_finite(bad):
    x = torch.ones(4, 8)
    x[2, 3] = bad
    with pytest.raises(ValueError, match=r"x must be finite \(found NaN or infinity\)"):
        ops.quantize(cuda(x), cuda(torch.ones(4)), 127, torch.int8)


def test_quantize_rejects_bad_scale():
    x = cuda(torch.ones(2, 3))
    with pytest.raises(ValueError, match="scale must be finite and >= 0"):
        ops.quantize(x, cuda(torch.tensor([1.0, -1.0])), 127, torch.int8)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ops.quantize(x, torch.ones(2), 127, torch.int8)


@pytest.mark.parametrize("dtype, levels", QUANT_CASES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1), (7, 33), (100, 1000)])
def test_quantize_out_forms_write_the_given_buffers(shape, dtype, levels):
    x = random_tensor(shape[0] * shape[1], torch.float32, seed=shape[1]).view(shape)
    scale = x.abs().amax(dim=1) if shape[1] else torch.ones(shape[0])
    if shape[0] > 2:
        scale[1] = 0.0
        scale[2] *= 0.5
    expected = reference.quantize(x, scale, levels, dtype, out=torch.empty(shape, dtype=dtype))
    # iinfo.min is never a quantized value (|q| <= levels <= iinfo.max): an unwritten element
    # would show.
    q = torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device="cuda")
    assert ops.quantize(cuda(x), cuda(scale), levels, dtype, out=q) is q
    assert torch.equal(q.cpu(), expected)
    assert torch.equal(q, ops.quantize(cuda(x), cuda(scale), levels, dtype))

    expected_x_hat = reference.dequantize(expected, scale, levels, out=torch.empty(shape))
    x_hat = torch.full(shape, float("nan"), device="cuda")
    assert ops.dequantize(cuda(expected), cuda(scale), levels, out=x_hat) is x_hat
    assert torch.equal(x_hat.cpu(), expected_x_hat)
    assert torch.equal(x_hat, ops.dequantize(cuda(expected), cuda(scale), levels))


def test_quantize_out_forms_read_non_contiguous_input():
    x = random_tensor(20 * 30, torch.float32, seed=4).view(20, 30)
    scale = x.abs().amax(dim=1)
    q = torch.empty(20, 30, dtype=torch.int16, device="cuda")
    ops.quantize(cuda(x).t().contiguous().t(), cuda(scale), 1000, torch.int16, out=q)
    assert torch.equal(q.cpu(), reference.quantize(x, scale, 1000, torch.int16))
    x_hat = torch.empty(20, 30, device="cuda")
    ops.dequantize(q.t().contiguous().t(), cuda(scale), 1000, out=x_hat)
    assert torch.equal(x_hat.cpu(), reference.dequantize(q.cpu(), scale, 1000))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape, where", [((4, 8), (2, 3)), ((300, 1000), (299, 999)),
                                          ((300, 1000), (0, 0))])
def test_quantize_out_rejects_non_finite_untouched(shape, where, bad):
    # The finiteness check runs before the first write: the caller's out keeps its contents.
    x = torch.ones(shape)
    x[where] = bad
    out = cuda(torch.randint(-100, 100, shape, generator=torch.Generator().manual_seed(0),
                             dtype=torch.int8))
    x_gpu, scale = cuda(x), cuda(torch.ones(shape[0]))
    with untouched(out, x_gpu, scale), \
            pytest.raises(ValueError, match=r"x must be finite \(found NaN or infinity\)"):
        ops.quantize(x_gpu, scale, 127, torch.int8, out=out)
    # Also when x is read through a contiguous copy.
    strided = torch.zeros(shape[0], 2 * shape[1], device="cuda")[:, ::2]
    strided.copy_(x_gpu)
    with untouched(out), pytest.raises(ValueError, match="x must be finite"):
        ops.quantize(strided, scale, 127, torch.int8, out=out)


@pytest.mark.parametrize("op, case, match", [
    ("quantize", dict(out=lambda: torch.zeros(4, 9, dtype=torch.int8, device="cuda")),
     r"out must have shape \[4, 8\]"),
    ("quantize", dict(out=lambda: torch.zeros(4, 16, dtype=torch.int8, device="cuda")[:, ::2]),
     "must be contiguous"),
    ("quantize", dict(out=lambda: torch.zeros(4, 8, dtype=torch.float32, device="cuda")),
     "out must have dtype"),
    ("quantize", dict(out=lambda: torch.zeros(4, 8, dtype=torch.int8)),
     "all tensors must be on one device"),
    ("quantize", dict(levels=200, out=lambda: torch.zeros(4, 8, dtype=torch.int8, device="cuda")),
     r"levels must be an integer in \[1, 127\]"),
    ("dequantize", dict(out=lambda: torch.zeros(5, 8, device="cuda")),
     r"out must have shape \[4, 8\]"),
    ("dequantize", dict(out=lambda: torch.zeros(4, 8, dtype=torch.float64, device="cuda")),
     "out must have dtype"),
    ("dequantize", dict(out=lambda: torch.zeros(4, 8)), "all tensors must be on one device"),
])
def test_quantize_out_forms_reject_bad_buffers_untouched(op, case, match):
    # The ops themselves (not the ops.* wrappers), so the CUDA kernel's checks are the ones hit.
    out = case["out"]()
    levels = case.get("levels", 127)
    x, scale = cuda(torch.ones(4, 8)), cuda(torch.ones(4))
    q = cuda(torch.ones(4, 8, dtype=torch.int8))
    with untouched(out, x, scale, q), pytest.raises((ValueError, TypeError), match=match):
        if op == "quantize":
            torch.ops.hetero_comm.quantize_into_.default(x, scale, levels, out)
        else:
            torch.ops.hetero_comm.dequantize_into_.default(q, scale, levels, out)


def test_segment_accumulate_and_select_out_forms():
    grad = random_tensor(100_003, torch.bfloat16, seed=31)
    residual, importance = cuda(torch.zeros(100_003)), cuda(torch.full((391,), float("nan")))
    assert ops.segment_accumulate_(residual, cuda(grad), 256, out=importance) is importance
    expected = reference.segment_accumulate_(torch.zeros(100_003), grad, 256)
    torch.testing.assert_close(importance.cpu(), expected, rtol=1e-5, atol=1e-6)
    indices = cuda(torch.full((40,), -1, dtype=torch.int64))
    assert ops.select_segments(importance, 40, out=indices) is indices
    assert torch.equal(indices.cpu(), reference.select_segments(importance.cpu(), 40))


# ------------------------------------------------------------ value checks without host syncs
@pytest.fixture
def strict_checks_off():
    previous = ops.set_strict_checks(False)
    yield
    ops.set_strict_checks(previous)


def _every_op_once(out_forms: dict) -> None:
    """One call of every op (and of every out= form, writing the buffers in ``out_forms``)."""
    n, segment_size = 100_003, 256
    residual = out_forms["residual"]
    grad = out_forms["grad"]
    importance = ops.segment_accumulate_(residual, grad, segment_size)
    ops.segment_accumulate_(residual, grad, segment_size, out=out_forms["importance"])
    indices = ops.select_segments(importance, 40)
    ops.select_segments(importance, 40, out=out_forms["indices"])
    packed = ops.pack_segments_(residual, indices, segment_size)
    ops.pack_segments_(residual, indices, segment_size, out=out_forms["packed"])
    ops.unpack_segments(packed, indices, segment_size, n, 0.5)
    ops.unpack_segments(out_forms["packed"], indices, segment_size, n, 0.5, out=out_forms["flat"])
    coeffs = ops.dct_encode(grad, 256, 32)
    ops.dct_encode(grad, 256, 32, out=out_forms["coeffs"])
    ops.dct_decode(coeffs, 256, n)
    ops.dct_decode(coeffs, 256, n, out=out_forms["flat"])
    scale = coeffs.abs().amax(dim=1)
    q = ops.quantize(coeffs, scale, 127, torch.int8)
    ops.quantize(coeffs, scale, 127, torch.int8, out=out_forms["q"])
    ops.dequantize(q, scale, 127)
    ops.dequantize(q, scale, 127, out=out_forms["x_hat"])


def test_no_op_synchronises_with_the_host(strict_checks_off):
    n = 100_003
    blocks = -(-n // 256)
    buffers = {
        "residual": torch.zeros(n, device="cuda"), "grad": cuda(random_tensor(n, torch.bfloat16, 1)),
        "importance": torch.empty(blocks, device="cuda"),
        "indices": torch.empty(40, dtype=torch.int64, device="cuda"),
        "packed": torch.empty(40 * 256, dtype=torch.float16, device="cuda"),
        "flat": torch.empty(n, device="cuda"), "coeffs": torch.empty(blocks, 32, device="cuda"),
        "q": torch.empty(blocks, 32, dtype=torch.int8, device="cuda"),
        "x_hat": torch.empty(blocks, 32, device="cuda"),
    }
    _every_op_once(buffers)  # warm-up: backend lookup, caching allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _every_op_once(buffers)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_strict_checks_do_synchronise():
    # The sync-debug test above can fail: strict checks read indices back to the host.
    previous = ops.set_strict_checks(True)
    residual = torch.zeros(100, device="cuda")
    indices = torch.tensor([1, 3], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.pack_segments_(residual, indices, 4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        ops.set_strict_checks(previous)


def test_bad_indices_without_strict_checks_stay_inside_the_buffers(strict_checks_off):
    residual = cuda(torch.arange(1.0, 101.0))            # 25 segments of 4
    packed = ops.pack_segments_(residual, cuda(torch.tensor([-1, 2, 25, 1 << 40])), 4)
    expected = torch.zeros(16)
    expected[4:8] = torch.arange(9.0, 13.0)               # only segment 2 is in range
    assert torch.equal(packed.cpu(), expected)
    kept = torch.arange(1.0, 101.0)
    kept[8:12] = 0
    assert torch.equal(residual.cpu(), kept)
    flat = ops.unpack_segments(cuda(torch.ones(12)), cuda(torch.tensor([-5, 24, 99])), 4, 98)
    expected_flat = torch.zeros(98)
    expected_flat[96:] = 1.0                              # the short last segment, 2 elements
    assert torch.equal(flat.cpu(), expected_flat)


def test_non_finite_values_without_strict_checks(strict_checks_off):
    x = torch.full((4, 8), 0.5)
    x[0, 1], x[0, 2], x[0, 3] = float("nan"), float("inf"), float("-inf")
    scale = torch.tensor([1.0, float("nan"), float("inf"), -1.0])
    q = ops.quantize(cuda(x), cuda(scale), 127, torch.int8).cpu()
    assert q[0].tolist() == [64, 0, 127, -127, 64, 64, 64, 64]   # 63.5 rounds half to even
    assert q[1:].abs().sum() == 0                                 # bad scales: factor 0
    importance = torch.rand(1000)
    importance[10] = float("nan")
    importance[20] = float("inf")
    importance[30] = -float("nan")
    selected = ops.select_segments(cuda(importance), 999).cpu()
    assert 30 not in selected.tolist() and {10, 20} <= set(selected.tolist())
    assert ops.select_segments(cuda(importance), 1).cpu().tolist() == [10]


# --------------------------------------------------------------------------- pool devices
@pytest.mark.parametrize("make_pool", [hetero_comm.BufferPool, PythonBufferPool], ids=["compiled", "python"])
def test_pool_shares_buffers_between_cuda_and_cuda_with_the_current_index(make_pool):
    pool = make_pool()
    current = f"cuda:{torch.cuda.current_device()}"
    for device in ["cuda", current, "cuda", torch.device("cuda"), current]:
        buffer = pool.acquire(1000, torch.float32, device)
        assert buffer.device == torch.device(current)
        pool.release(buffer)
    assert pool.stats()["allocations"] == 1 and pool.stats()["reuses"] == 4
    assert pool_device("cuda") == torch.device(current)
