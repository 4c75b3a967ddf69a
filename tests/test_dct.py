"""dct_encode / dct_decode: compiled == reference == scipy's orthonormal DCT-II."""

import numpy as np
import pytest
import scipy.fft
import torch

from hetero_comm import ops, reference
from kernel_cases import BACKENDS, GRAD_DTYPES, non_contiguous, random_tensor, require_compiled, untouched

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SIZES = (0, 1, 5, 8, 1000, 4099, 70_001)


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled()


def scipy_encode(x: torch.Tensor, block_size: int, keep: int) -> np.ndarray:
    padded = np.zeros(-(-x.numel() // block_size) * block_size)
    padded[: x.numel()] = x.double().numpy()
    return scipy.fft.dct(padded.reshape(-1, block_size), type=2, norm="ortho", axis=1)[:, :keep]


def dct_tolerance(block_size: int) -> float:
    # The documented bound for unit-variance data: Lee's algorithm multiplies by twiddles up
    # to ~B/pi, so the float32 error grows linearly with B (measured ~1.2e-7 * B, inverse).
    return 3e-7 * block_size + 2e-6


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dct_encode_matches_scipy_and_reference(numel, block_size, dtype):
    x = random_tensor(numel, dtype, seed=numel + block_size)
    for keep in sorted({0, 1, block_size // 8, block_size}):
        coeffs = ops.dct_encode(x, block_size, keep)
        assert coeffs.dtype == torch.float32 and coeffs.shape == (-(-numel // block_size), keep)
        exact = scipy_encode(x, block_size, keep)
        np.testing.assert_allclose(coeffs.numpy(), exact, rtol=0, atol=dct_tolerance(block_size))
        torch.testing.assert_close(coeffs, reference.dct_encode(x, block_size, keep),
                                   rtol=0, atol=2 * dct_tolerance(block_size))


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dct_decode_matches_scipy_and_reference(numel, block_size):
    blocks = -(-numel // block_size)
    for keep in sorted({0, 1, block_size // 8, block_size}):
        coeffs = random_tensor(blocks * keep, torch.float32, seed=keep).view(blocks, keep)
        decoded = ops.dct_decode(coeffs, block_size, numel)
        full = np.zeros((blocks, block_size))
        full[:, :keep] = coeffs.double().numpy()
        exact = scipy.fft.idct(full, type=2, norm="ortho", axis=1).reshape(-1)[:numel]
        assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
        np.testing.assert_allclose(decoded.numpy(), exact, rtol=0, atol=dct_tolerance(block_size))
        torch.testing.assert_close(decoded, reference.dct_decode(coeffs, block_size, numel),
                                   rtol=0, atol=2 * dct_tolerance(block_size))


@pytest.mark.parametrize("block_size", (8, 256, 1024))
def test_dct_round_trip_with_all_coefficients_is_lossless(block_size):
    x = random_tensor(10_007, torch.float32, seed=5)
    back = ops.dct_decode(ops.dct_encode(x, block_size, block_size), block_size, x.numel())
    torch.testing.assert_close(back, x, rtol=0, atol=4 * dct_tolerance(block_size))


def test_dct_keeps_smooth_signals_in_few_coefficients():
    # A slowly varying signal lives in the low frequencies: 1/8 of the coefficients suffice.
    x = torch.sin(torch.linspace(0, 20, 64 * 100))
    back = ops.dct_decode(ops.dct_encode(x, 64, 8), 64, x.numel())
    assert float((back - x).norm() / x.norm()) < 0.01


def test_dct_reads_non_contiguous_input():
    x = random_tensor(1000, torch.float32, seed=6)
    assert torch.equal(ops.dct_encode(non_contiguous(x), 64, 16), ops.dct_encode(x, 64, 16))
    coeffs = ops.dct_encode(x, 64, 16)
    transposed = coeffs.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert torch.equal(ops.dct_decode(transposed, 64, 1000), ops.dct_decode(coeffs, 64, 1000))


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(block_size=0), "block_size must be a power of two"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(block_size=1 << 17), "block_size must be a power of two"),
    (dict(keep=-1), r"keep must be an integer in \[0, 64\]"),
    (dict(keep=65), r"keep must be an integer in \[0, 64\]"),
    (dict(x=torch.ones(10, dtype=torch.float64)), "x must have dtype"),
    (dict(x=torch.ones(2, 5)), "x must be 1-D"),
])
def test_dct_encode_rejects_bad_input(backend, case, match):
    args = dict(x=torch.ones(100), block_size=64, keep=8) | case
    with untouched(args["x"]), pytest.raises((ValueError, TypeError), match=match):
        backend.dct_encode(**args)


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(block_size=48), "block_size must be a power of two"),
    (dict(numel=-5), "numel must be an integer >= 0"),
    (dict(numel=200), r"coeffs must have shape \[ceil\(numel / block_size\) = 4"),
    (dict(coeffs=torch.ones(2, 65)), "keep <= 64"),
    (dict(coeffs=torch.ones(16)), "coeffs must be 2-D"),
    (dict(coeffs=torch.ones(2, 8, dtype=torch.float16)), "coeffs must have dtype"),
])
def test_dct_decode_rejects_bad_input(backend, case, match):
    args = dict(coeffs=torch.ones(2, 8), block_size=64, numel=100) | case
    with untouched(args["coeffs"]), pytest.raises((ValueError, TypeError), match=match):
        backend.dct_decode(**args)


def test_dct_ops_pass_opcheck():
    x = random_tensor(1000, torch.float32, seed=8)
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode.default, (x, 64, 8))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode.default, (torch.rand(16, 8), 64, 1000))


@BACKENDS
@pytest.mark.parametrize("block_size, keep", [(8, 8), (64, 2), (64, 8), (256, 32), (1024, 16)])
def test_dct_out_forms_write_the_given_buffers(backend, block_size, keep):
    x = random_tensor(5001, torch.bfloat16, seed=block_size)
    blocks = -(-x.numel() // block_size)
    out = torch.full((blocks, keep), 7.0)
    assert backend.dct_encode(x, block_size, keep, out=out) is out
    torch.testing.assert_close(out, reference.dct_encode(x, block_size, keep), rtol=0,
                               atol=2 * dct_tolerance(block_size))
    decoded = torch.full((x.numel(),), 7.0)
    assert backend.dct_decode(out, block_size, x.numel(), out=decoded) is decoded
    torch.testing.assert_close(decoded, reference.dct_decode(out, block_size, x.numel()), rtol=0,
                               atol=2 * dct_tolerance(block_size))


@BACKENDS
@pytest.mark.parametrize("op, out, match", [
    ("encode", torch.zeros(2, 7), "out must have"),
    ("encode", torch.zeros(3, 8), "out must have"),
    ("encode", torch.zeros(2, 8, dtype=torch.float64), "out must have dtype"),
    ("encode", torch.zeros(2, 16)[:, ::2], "must be contiguous"),
    ("decode", torch.zeros(99), "out must have"),
    ("decode", torch.zeros(100, dtype=torch.float16), "out must have dtype"),
])
def test_dct_out_forms_reject_bad_buffers(backend, op, out, match):
    x, coeffs = torch.ones(100), torch.ones(2, 8)
    with untouched(out, x, coeffs), pytest.raises((ValueError, TypeError), match=match):
        if op == "encode":
            backend.dct_encode(x, 64, 8, out=out)
        else:
            backend.dct_decode(coeffs, 64, 100, out=out)


def test_dct_out_ops_pass_opcheck():
    x = random_tensor(1000, torch.float32, seed=8)
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode_into_.default, (x, 64, torch.empty(16, 8)))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode_into_.default,
                          (torch.rand(16, 8), 64, torch.empty(1000)))


@BACKENDS
def test_dct_out_overlapping_the_input_is_rejected(backend):
    buffer = torch.zeros(200)
    coeffs, out = buffer[:16].view(2, 8), buffer[10:110]
    with untouched(buffer), pytest.raises(ValueError, match="out must not overlap coeffs"):
        backend.dct_decode(coeffs, 64, 100, out=out)
    x, coeffs_out = buffer[:100], buffer[50:66].view(2, 8)
    with untouched(buffer), pytest.raises(ValueError, match="out must not overlap x"):
        backend.dct_encode(x, 64, 8, out=coeffs_out)
