"""dct_encode / dct_decode: compiled == reference == scipy's orthonormal DCT-II."""

import numpy as np
import pytest
import scipy.fft
import torch

from hetero_comm import ops, reference
from kernel_cases import (BACKENDS, device, GRAD_DTYPES, compiled_with_strict_checks,  # noqa: F401
                          non_contiguous, random_tensor, to_device, untouched)

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SIZES = (0, 1, 5, 8, 1000, 4099, 70_001)


def scipy_encode(x: torch.Tensor, block_size: int, keep: int) -> np.ndarray:
    padded = np.zeros(-(-x.numel() // block_size) * block_size)
    padded[: x.numel()] = x.double().numpy()
    return scipy.fft.dct(padded.reshape(-1, block_size), type=2, norm="ortho", axis=1)[:, :keep]


def dct_tolerance(block_size: int) -> float:
    # The documented bound for unit-variance data: Lee's algorithm multiplies by twiddles up
    # to ~B/pi, so the float32 error grows linearly with B (measured ~1.2e-7 * B, inverse).
    return 3e-7 * block_size + 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dct_encode_matches_scipy_and_reference(numel, block_size, dtype, device):
    x = random_tensor(numel, dtype, seed=numel + block_size)
    for keep in sorted({0, 1, block_size // 8, block_size}):
        coeffs = ops.dct_encode(x.to(device), block_size, keep).cpu()
        assert coeffs.dtype == torch.float32 and coeffs.shape == (-(-numel // block_size), keep)
        exact = scipy_encode(x, block_size, keep)
        np.testing.assert_allclose(coeffs.numpy(), exact, rtol=0, atol=dct_tolerance(block_size))
        torch.testing.assert_close(coeffs, reference.dct_encode(x, block_size, keep),
                                   rtol=0, atol=2 * dct_tolerance(block_size))


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_dct_decode_matches_scipy_and_reference(numel, block_size, device):
    blocks = -(-numel // block_size)
    for keep in sorted({0, 1, block_size // 8, block_size}):
        coeffs = random_tensor(blocks * keep, torch.float32, seed=keep).view(blocks, keep)
        decoded = ops.dct_decode(coeffs.to(device), block_size, numel).cpu()
        full = np.zeros((blocks, block_size))
        full[:, :keep] = coeffs.double().numpy()
        exact = scipy.fft.idct(full, type=2, norm="ortho", axis=1).reshape(-1)[:numel]
        assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
        np.testing.assert_allclose(decoded.numpy(), exact, rtol=0, atol=dct_tolerance(block_size))
        torch.testing.assert_close(decoded, reference.dct_decode(coeffs, block_size, numel),
                                   rtol=0, atol=2 * dct_tolerance(block_size))


@pytest.mark.parametrize("block_size", (8192, 65536))
def test_dct_of_blocks_above_4096_matches_scipy(block_size, device):
    # up to the largest block the kernels accept (2**16), with a short last block
    x = random_tensor(block_size + 1000, torch.float32, seed=block_size)
    blocks = 2
    for keep in (16, block_size):
        coeffs = ops.dct_encode(x.to(device), block_size, keep).cpu()
        np.testing.assert_allclose(coeffs.numpy(), scipy_encode(x, block_size, keep), rtol=0,
                                   atol=dct_tolerance(block_size))
        decoded = ops.dct_decode(coeffs.to(device), block_size, x.numel()).cpu()
        full = np.zeros((blocks, block_size))
        full[:, :keep] = coeffs.double().numpy()
        exact = scipy.fft.idct(full, type=2, norm="ortho", axis=1).reshape(-1)[:x.numel()]
        np.testing.assert_allclose(decoded.numpy(), exact, rtol=0, atol=dct_tolerance(block_size))


@pytest.mark.parametrize("block_size", (8, 256, 1024))
def test_dct_round_trip_with_all_coefficients_is_lossless(block_size, device):
    x = random_tensor(10_007, torch.float32, seed=5)
    back = ops.dct_decode(ops.dct_encode(x.to(device), block_size, block_size), block_size, x.numel())
    torch.testing.assert_close(back.cpu(), x, rtol=0, atol=4 * dct_tolerance(block_size))


def test_dct_keeps_smooth_signals_in_few_coefficients(device):
    # A slowly varying signal lives in the low frequencies: 1/8 of the coefficients suffice.
    x = torch.sin(torch.linspace(0, 20, 64 * 100))
    back = ops.dct_decode(ops.dct_encode(x.to(device), 64, 8), 64, x.numel()).cpu()
    assert float((back - x).norm() / x.norm()) < 0.01


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_dct_reads_non_contiguous_input(dtype, device):
    x = random_tensor(1000, dtype, seed=6)
    assert torch.equal(ops.dct_encode(non_contiguous(x, device), 64, 16), ops.dct_encode(x.to(device), 64, 16))
    coeffs = ops.dct_encode(x.to(device), 64, 16)
    transposed = coeffs.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert torch.equal(ops.dct_decode(transposed, 64, 1000), ops.dct_decode(coeffs, 64, 1000))
    grouped = ops.dct_encode(x.to(device), 64, 16, 3)
    strided = grouped.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert torch.equal(ops.dct_decode(strided, 64, 1000), ops.dct_decode(grouped, 64, 1000))


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
def test_dct_encode_rejects_bad_input(backend, case, match, device):
    args = dict(x=torch.ones(100), block_size=64, keep=8) | case
    args = {name: to_device(value, device) for name, value in args.items()}
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
def test_dct_decode_rejects_bad_input(backend, case, match, device):
    args = dict(coeffs=torch.ones(2, 8), block_size=64, numel=100) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    with untouched(args["coeffs"]), pytest.raises((ValueError, TypeError), match=match):
        backend.dct_decode(**args)


def test_dct_ops_pass_opcheck(device):
    x = random_tensor(1000, torch.float32, seed=8).to(device)
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode.default, (x, 64, 8))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode.default, (torch.rand(16, 8, device=device), 64, 1000))


@BACKENDS
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("block_size, keep", [(1, 1), (8, 8), (64, 2), (64, 8), (256, 32), (1024, 16)])
def test_dct_out_forms_write_the_given_buffers(backend, block_size, keep, dtype, device):
    x = random_tensor(5001, dtype, seed=block_size)
    blocks = -(-x.numel() // block_size)
    out = torch.full((blocks, keep), float("nan"), device=device)
    assert backend.dct_encode(x.to(device), block_size, keep, out=out) is out
    torch.testing.assert_close(out.cpu(), reference.dct_encode(x, block_size, keep), rtol=0,
                               atol=2 * dct_tolerance(block_size))
    # One kernel behind both forms: the out= form equals the allocating one bit for bit.
    assert torch.equal(out, backend.dct_encode(x.to(device), block_size, keep))
    decoded = torch.full((x.numel(),), float("nan"), device=device)
    assert backend.dct_decode(out, block_size, x.numel(), out=decoded) is decoded
    torch.testing.assert_close(decoded.cpu(), reference.dct_decode(out.cpu(), block_size, x.numel()), rtol=0,
                               atol=2 * dct_tolerance(block_size))
    assert torch.equal(decoded, backend.dct_decode(out, block_size, x.numel()))


@BACKENDS
@pytest.mark.parametrize("op, out, match", [
    ("encode", torch.zeros(2, 7), "out must have"),
    ("encode", torch.zeros(3, 8), "out must have"),
    ("encode", torch.zeros(2, 8, dtype=torch.float64), "out must have dtype"),
    ("encode", torch.zeros(2, 16)[:, ::2], "must be contiguous"),
    ("decode", torch.zeros(99), "out must have"),
    ("decode", torch.zeros(100, dtype=torch.float16), "out must have dtype"),
])
def test_dct_out_forms_reject_bad_buffers(backend, op, out, match, device):
    x, coeffs = torch.ones(100, device=device), torch.ones(2, 8, device=device)
    out = to_device(out, device)
    with untouched(out, x, coeffs), pytest.raises((ValueError, TypeError), match=match):
        if op == "encode":
            backend.dct_encode(x, 64, 8, out=out)
        else:
            backend.dct_decode(coeffs, 64, 100, out=out)


def test_dct_out_ops_pass_opcheck(device):
    x = random_tensor(1000, torch.float32, seed=8).to(device)
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode_into_.default,
                          (x, 64, torch.empty(16, 8, device=device)))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode_into_.default,
                          (torch.rand(16, 8, device=device), 64, torch.empty(1000, device=device)))


@BACKENDS
def test_dct_out_overlapping_the_input_is_rejected(backend, device):
    buffer = torch.zeros(200, device=device)
    coeffs, out = buffer[:16].view(2, 8), buffer[10:110]
    with untouched(buffer), pytest.raises(ValueError, match="out must not overlap coeffs"):
        backend.dct_decode(coeffs, 64, 100, out=out)
    x, coeffs_out = buffer[:100], buffer[50:66].view(2, 8)
    with untouched(buffer), pytest.raises(ValueError, match="out must not overlap x"):
        backend.dct_encode(x, 64, 8, out=coeffs_out)


def plain_of_grouped(grouped: torch.Tensor, blocks: int) -> torch.Tensor:
    """[groups, keep, group] -> [blocks, keep], dropping the padding blocks."""
    groups, keep, group = grouped.shape
    return grouped.transpose(1, 2).reshape(groups * group, keep)[:blocks]


@BACKENDS
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block_size, keep, group", [
    (1, 1, 1), (8, 8, 3), (64, 64, 512), (64, 8, 8), (256, 32, 7), (1024, 16, 2), (64, 0, 4)])
def test_dct_grouped_layout_is_the_plain_one_rearranged(backend, numel, block_size, keep, group,
                                                        dtype, device):
    # The same transform whichever layout, padding blocks zero, decode inverse: bit for bit on
    # the CPU and, for blocks of <= 64 values, on CUDA (the same arithmetic); larger CUDA blocks
    # go through different cuBLAS products (a batched one for the grouped layout), whose float32
    # sums may round differently.
    x = random_tensor(numel, dtype, seed=numel + group).to(device)
    blocks = -(-numel // block_size)
    plain = backend.dct_encode(x, block_size, keep)
    grouped = backend.dct_encode(x, block_size, keep, group)
    assert grouped.shape == (-(-blocks // group), keep, group) and grouped.is_contiguous()

    def assert_same_transform(actual, expected):
        if device == "cpu" or block_size <= 64:
            assert torch.equal(actual, expected)
        else:
            torch.testing.assert_close(actual, expected, rtol=0, atol=dct_tolerance(block_size))

    assert_same_transform(plain_of_grouped(grouped, blocks), plain)
    padding = grouped.transpose(1, 2).reshape(grouped.shape[0] * group, keep)[blocks:]
    assert padding.numel() == (-(-blocks // group) * group - blocks) * keep and not padding.any()
    out = torch.full(grouped.shape, float("nan"), device=device)
    assert backend.dct_encode(x, block_size, keep, group, out=out) is out
    assert torch.equal(out, grouped)
    decoded = torch.full((numel,), float("nan"), device=device)
    assert backend.dct_decode(grouped, block_size, numel, out=decoded) is decoded
    assert_same_transform(decoded, backend.dct_decode(plain, block_size, numel))
    torch.testing.assert_close(grouped.cpu(), reference.dct_encode(x.cpu(), block_size, keep, group),
                               rtol=0, atol=2 * dct_tolerance(block_size))


@BACKENDS
@pytest.mark.parametrize("keep", (64, 1))  # the fast transform and (on the CPU) the direct product
def test_dct_decode_ignores_the_grouped_padding(backend, keep, device):
    x = random_tensor(1000, torch.float32, seed=9).to(device)
    grouped = backend.dct_encode(x, 64, keep, 5)  # 16 blocks: the last group holds 1 and 4 padding
    expected = backend.dct_decode(grouped, 64, 1000)
    grouped[-1, :, 1:] = 7.0
    assert torch.equal(backend.dct_decode(grouped, 64, 1000), expected)


@BACKENDS
@pytest.mark.parametrize("group, out_shape, match", [
    (0, (1, 8, 3), "group must be an integer >= 1"),
    (3, (2, 8, 3), "out must have"),
    (2, (1, 8, 3), "out must have"),
    (None, (1, 8, 2), "out must be 2-D"),
    (2, (2, 8), "out must be 3-D"),
])
def test_dct_grouped_encode_rejects_bad_input(backend, group, out_shape, match, device):
    x, out = torch.ones(100, device=device), torch.zeros(out_shape, device=device)
    with untouched(x, out), pytest.raises((ValueError, TypeError), match=match):
        backend.dct_encode(x, 64, 8, group, out=out)
    if group == 0:
        with untouched(x), pytest.raises(ValueError, match=match):
            backend.dct_encode(x, 64, 8, group)


@BACKENDS
@pytest.mark.parametrize("shape, match", [
    ((1, 8, 1), r"grouped coeffs must have shape \[.* = 2"),
    ((1, 8, 0), "group >= 1"),
    ((1, 65, 2), "keep <= 64"),
    ((1, 8, 1, 2), r"coeffs must be 2-D \[blocks, keep\] or 3-D"),
])
def test_dct_grouped_decode_rejects_bad_input(backend, shape, match, device):
    coeffs, out = torch.ones(shape, device=device), torch.zeros(100, device=device)
    with untouched(coeffs, out), pytest.raises((ValueError, TypeError), match=match):
        backend.dct_decode(coeffs, 64, 100, out=out)


def test_dct_grouped_ops_pass_opcheck(device):
    x = random_tensor(1000, torch.float32, seed=8).to(device)
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode.default, (x, 64, 8, 3))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode.default, (torch.rand(6, 8, 3, device=device), 64, 1000))
    torch.library.opcheck(torch.ops.hetero_comm.dct_encode_into_.default,
                          (x, 64, torch.empty(6, 8, 3, device=device)))
    torch.library.opcheck(torch.ops.hetero_comm.dct_decode_into_.default,
                          (torch.rand(6, 8, 3, device=device), 64, torch.empty(1000, device=device)))
