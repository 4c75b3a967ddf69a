"""What only a GPU shows: grid-stride loops over large inputs, side streams, determinism of
the atomics, the float64 accuracy of the CUDA DCT, device mismatches, no host syncs (and
what the kernels do with bad values when nothing syncs), and the pool's CUDA device keys.

Every kernel test of test_segments.py, test_dct.py and test_quantize.py also runs on CUDA
(test_cuda_kernel_cases.py); this file holds only what is CUDA-specific. Runs only on a
machine with a GPU and an extension built with its CUDA kernels; elsewhere the module is
skipped once, with the reason (a build asked to include CUDA fails instead).
"""

import pytest
import torch

import hetero_comm
from hetero_comm import ops, reference
from hetero_comm._python_pool import PythonBufferPool, pool_device
from kernel_cases import cuda_skip_reason, random_tensor, untouched

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)
pytestmark = pytest.mark.cuda

from test_dct import dct_tolerance  # noqa: E402  (after the skip: imports the CPU module's helpers)


def cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


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


def test_select_segments_is_deterministic():
    importance = cuda(torch.randint(0, 3, (200_000,)).float())
    first = ops.select_segments(importance, 50_000)
    for _ in range(3):
        assert torch.equal(ops.select_segments(importance, 50_000), first)



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


def test_mixed_devices_are_rejected_untouched():
    # The ops themselves (not the ops.* wrappers), so the CUDA kernels' checks are the ones hit.
    hc = torch.ops.hetero_comm
    residual, x = torch.ones(10, device="cuda"), torch.ones(4, 8, device="cuda")
    indices = torch.tensor([0, 1], device="cuda")
    calls = [
        lambda: hc.segment_accumulate_.default(residual, torch.ones(10), 4),
        lambda: hc.pack_segments_.default(residual, torch.tensor([0, 1]), 4),
        lambda: hc.pack_segments_into_.default(residual, indices, 4, torch.empty(8)),
        lambda: hc.unpack_segments_into_.default(torch.ones(8, device="cuda"), indices, 4, 1.0, torch.empty(10)),
        lambda: hc.pack_quantized_segments_.default(residual, indices, 4, torch.ones(2), 127, torch.int8),
        lambda: hc.pack_quantized_segments_into_.default(residual, indices, 4, torch.ones(2, device="cuda"), 127,
                                                         torch.empty(8, dtype=torch.int8)),
        lambda: hc.dct_encode_into_.default(residual, 4, torch.empty(3, 2)),
        lambda: hc.dct_decode_into_.default(torch.ones(3, 2, device="cuda"), 4, torch.empty(10)),
        lambda: hc.quantize.default(x, torch.ones(4), 127, torch.int8),
        lambda: hc.quantize_into_.default(x, torch.ones(4, device="cuda"), 127, torch.empty(4, 8, dtype=torch.int8)),
        lambda: hc.dequantize_into_.default(x.to(torch.int8), torch.ones(4, device="cuda"), 127, torch.empty(4, 8)),
    ]
    for call in calls:
        with untouched(residual, x), pytest.raises(ValueError, match="all tensors must be on one device"):
            call()


@pytest.fixture
def strict_checks():
    previous = ops.set_strict_checks(True)
    yield
    ops.set_strict_checks(previous)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape, where", [((4, 8), (2, 3)), ((300, 1000), (299, 999)),
                                          ((300, 1000), (0, 0))])
def test_quantize_out_rejects_non_finite_untouched(shape, where, bad, strict_checks):
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
    segment_scale = importance[:40].abs()
    ops.pack_quantized_segments_(residual, indices, segment_size, segment_scale, 63, torch.int8)
    ops.pack_quantized_segments_(residual, indices, segment_size, segment_scale, 63, torch.int8,
                                 out=out_forms["integers"])
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
        "integers": torch.empty(40 * 256, dtype=torch.int8, device="cuda"),
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
    residual = cuda(torch.arange(1.0, 101.0))
    integers = ops.pack_quantized_segments_(residual, cuda(torch.tensor([-1, 2, 25, 1 << 40])), 4,
                                            cuda(torch.full((4,), 100.0)), 100, torch.int8)
    expected_integers = torch.zeros(16, dtype=torch.int8)
    expected_integers[4:8] = torch.arange(9, 13)          # scale 100 at 100 levels: a step of 1
    assert torch.equal(integers.cpu(), expected_integers)
    assert torch.equal(residual.cpu(), kept)              # exact integers leave zeros behind
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


@pytest.mark.parametrize("block_size, group", [(1, None), (8, None), (8, 512), (64, 3)])
def test_cuda_dct_loops_over_more_blocks_than_one_launch_has_threads(block_size, group):
    # For blocks of at most 64 values the CUDA kernels run one thread per block, at most
    # 8,192 x 128 threads a launch, and loop over the rest: 2M + 3 blocks take a second
    # round (64-value blocks: one round, a tenth of that). Compared with the CPU kernels.
    blocks = 2 * 8192 * 128 + 3 if block_size < 64 else 100_003
    numel = blocks * block_size - block_size // 2  # the last block partial (B > 1)
    x = random_tensor(numel, torch.float32, seed=11)
    expected = ops.dct_encode(x, block_size, block_size, group)
    coeffs = ops.dct_encode(x.cuda(), block_size, block_size, group)
    torch.testing.assert_close(coeffs.cpu(), expected, rtol=0, atol=dct_tolerance(block_size))
    torch.testing.assert_close(ops.dct_decode(coeffs, block_size, numel).cpu(),
                               ops.dct_decode(expected, block_size, numel), rtol=0,
                               atol=2 * dct_tolerance(block_size))
