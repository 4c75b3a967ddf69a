"""quantize / dequantize: compiled == reference, bit for bit."""

import pytest
import torch

from hetero_comm import ops, reference
from kernel_cases import (BACKENDS, device, compiled_with_strict_checks,  # noqa: F401
                          non_contiguous, random_tensor, to_device, untouched)

QUANT_DTYPES = {torch.int8: 127, torch.int16: 32767, torch.int32: 2**31 - 1}
SHAPES = ((0, 8), (3, 0), (1, 1), (7, 5), (100, 64), (1000, 257))


def blocks_with_scales(shape, seed):
    x = random_tensor(shape[0] * shape[1], torch.float32, seed=seed, scale=3.0).view(shape)
    scale = x.abs().amax(dim=1) if shape[1] else torch.ones(shape[0])
    if shape[0] > 2:
        scale[1] = 0.0          # a zero scale quantizes to zeros, never NaN
        scale[2] *= 0.5         # values beyond the scale clamp to +-levels
    return x, scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantize_and_dequantize_match_reference(shape, dtype, device):
    x, scale = blocks_with_scales(shape, seed=shape[0])
    for levels in sorted({1, 3, QUANT_DTYPES[dtype] // 3, QUANT_DTYPES[dtype]}):
        q = ops.quantize(x.to(device), scale.to(device), levels, dtype).cpu()
        assert q.dtype == dtype and q.shape == x.shape
        assert torch.equal(q, reference.quantize(x, scale, levels, dtype)), levels
        assert int(q.abs().max()) <= levels if q.numel() else True
        x_hat = ops.dequantize(q.to(device), scale.to(device), levels).cpu()
        assert x_hat.dtype == torch.float32
        assert torch.equal(x_hat, reference.dequantize(q, scale, levels))
        assert not bool(torch.isnan(x_hat).any())


def test_quantize_rounds_half_to_even_and_clamps(device):
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 200.0, -200.0]])
    scale = torch.tensor([127.0])   # factor 1: q = round(x)
    expected = [0, 2, 2, 0, -2, -2, 3, 127, -127]
    assert ops.quantize(x.to(device), scale.to(device), 127, torch.int8).tolist() == [expected]
    assert reference.quantize(x, scale, 127, torch.int8).tolist() == [expected]


def test_quantize_error_is_at_most_half_a_step(device):
    x, scale = blocks_with_scales((200, 64), seed=3)
    scale = x.abs().amax(dim=1)
    x_d, scale_d = x.to(device), scale.to(device)
    for dtype, levels in ((torch.int8, 127), (torch.int16, 16383)):
        x_hat = ops.dequantize(ops.quantize(x_d, scale_d, levels, dtype), scale_d, levels).cpu()
        step = (scale / levels).unsqueeze(1)
        assert bool(((x_hat - x).abs() <= step * 0.5 + 1e-6 * scale.unsqueeze(1)).all())


def test_large_levels_stay_within_int32(device):
    x = torch.tensor([[1.0, -1.0, 0.999999]])
    q = ops.quantize(x.to(device), torch.tensor([1.0], device=device), 2**31 - 1, torch.int32).cpu()
    assert q[0, 0] <= 2**31 - 1 and q[0, 1] >= -(2**31 - 1)
    assert torch.equal(q, reference.quantize(x, torch.tensor([1.0]), 2**31 - 1, torch.int32))


def test_quantize_reads_non_contiguous_input(device):
    x, scale = blocks_with_scales((50, 16), seed=9)
    strided = x.to(device).t().contiguous().t()
    assert not strided.is_contiguous()
    q = ops.quantize(strided, non_contiguous(scale, device), 127, torch.int8)
    assert torch.equal(q.cpu(), reference.quantize(x, scale, 127, torch.int8))
    x_hat = ops.dequantize(q.t().contiguous().t(), non_contiguous(scale, device), 127)
    assert torch.equal(x_hat.cpu(), reference.dequantize(q.cpu(), scale, 127))


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(levels=0), r"levels must be an integer in \[1, 127\]"),
    (dict(levels=128), r"levels must be an integer in \[1, 127\]"),
    (dict(dtype=torch.int64), "dtype must be int8, int16 or int32"),
    (dict(dtype=torch.float32), "dtype must be int8, int16 or int32"),
    (dict(scale=torch.ones(3)), r"scale must have one entry per block \(4\)"),
    (dict(scale=torch.tensor([1.0, -1.0, 1.0, 1.0])), "scale must be finite and >= 0"),
    (dict(scale=torch.tensor([1.0, float("nan"), 1.0, 1.0])), "scale must be finite and >= 0"),
    (dict(scale=torch.tensor([1.0, float("inf"), 1.0, 1.0])), "scale must be finite and >= 0"),
    (dict(x=torch.ones(4, 8, dtype=torch.float64)), "x must have dtype"),
    (dict(x=torch.ones(32)), "x must be 2-D"),
    (dict(x=torch.tensor([[1.0, float("nan")]] * 4)), "x must be finite"),
])
def test_quantize_rejects_bad_input(backend, case, match, device):
    args = dict(x=torch.ones(4, 8), scale=torch.ones(4), levels=127, dtype=torch.int8) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    with untouched(args["x"], args["scale"]), pytest.raises((ValueError, TypeError), match=match):
        backend.quantize(**args)


@BACKENDS
@pytest.mark.parametrize("case, match", [
    (dict(levels=0), "levels must be an integer >= 1"),
    (dict(q=torch.ones(4, 8)), "q must have dtype"),
    (dict(q=torch.ones(32, dtype=torch.int8)), "q must be 2-D"),
    (dict(scale=torch.ones(5)), "scale must have one entry per block"),
])
def test_dequantize_rejects_bad_input(backend, case, match, device):
    args = dict(q=torch.ones(4, 8, dtype=torch.int8), scale=torch.ones(4), levels=127) | case
    args = {name: to_device(value, device) for name, value in args.items()}
    with untouched(args["q"], args["scale"]), pytest.raises((ValueError, TypeError), match=match):
        backend.dequantize(**args)


def test_quantize_ops_pass_opcheck(device):
    x, scale = blocks_with_scales((10, 16), seed=1)
    x, scale = x.to(device), scale.to(device)
    torch.library.opcheck(torch.ops.hetero_comm.quantize.default, (x, scale, 127, torch.int8))
    q = ops.quantize(x, scale, 127, torch.int8)
    torch.library.opcheck(torch.ops.hetero_comm.dequantize.default, (q, scale, 127))


@BACKENDS
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (1, 1), (300, 64)])
def test_quantize_out_forms_write_the_given_buffers(backend, dtype, shape, device):
    x, scale = blocks_with_scales(shape, seed=11)
    levels = QUANT_DTYPES[dtype] // 2
    # iinfo.min is never a quantized value (|q| <= levels): an unwritten element would show.
    q = torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)
    assert backend.quantize(x.to(device), scale.to(device), levels, dtype, out=q) is q
    assert torch.equal(q.cpu(), reference.quantize(x, scale, levels, dtype))
    x_hat = torch.full(shape, float("nan"), device=device)
    assert backend.dequantize(q, scale.to(device), levels, out=x_hat) is x_hat
    assert torch.equal(x_hat.cpu(), reference.dequantize(q.cpu(), scale, levels))


@BACKENDS
@pytest.mark.parametrize("op, case, match", [
    ("quantize", dict(out=torch.zeros(4, 8, dtype=torch.int16)), "out must have dtype"),
    ("quantize", dict(out=torch.zeros(4, 9, dtype=torch.int8)), "out must have"),
    ("quantize", dict(out=torch.zeros(4, 16, dtype=torch.int8)[:, ::2]), "must be contiguous"),
    ("quantize", dict(out=torch.zeros(4, 8, dtype=torch.int8),
                      x=torch.tensor([[float("inf")] * 8] * 4)), "x must be finite"),
    ("dequantize", dict(out=torch.zeros(4, 8, dtype=torch.float64)), "out must have dtype"),
    ("dequantize", dict(out=torch.zeros(5, 8)), "out must have"),
])
def test_quantize_out_forms_reject_bad_buffers(backend, op, case, match, device):
    case = {name: to_device(value, device) for name, value in case.items()}
    if op == "quantize":
        args = dict(x=torch.ones(4, 8, device=device), scale=torch.ones(4, device=device), levels=127,
                    dtype=torch.int8) | case
        tensors = (args["x"], args["scale"], args["out"])
    else:
        args = dict(q=torch.ones(4, 8, dtype=torch.int8, device=device), scale=torch.ones(4, device=device),
                    levels=127) | case
        tensors = (args["q"], args["scale"], args["out"])
    with untouched(*tensors), pytest.raises((ValueError, TypeError), match=match):
        getattr(backend, op)(**args)


def test_quantize_out_ops_pass_opcheck(device):
    x, scale = blocks_with_scales((10, 16), seed=1)
    x, scale = x.to(device), scale.to(device)
    q = torch.empty(10, 16, dtype=torch.int8, device=device)
    torch.library.opcheck(torch.ops.hetero_comm.quantize_into_.default, (x, scale, 127, q))
    torch.library.opcheck(torch.ops.hetero_comm.dequantize_into_.default,
                          (ops.quantize(x, scale, 127, torch.int8), scale, 127, torch.empty(10, 16, device=device)))


@BACKENDS
def test_a_scale_too_small_for_a_finite_factor_still_maps_zero_to_zero(backend, device):
    # levels / scale overflows float32 to inf; 0 * inf must quantize to 0, not to +levels.
    x = torch.tensor([[0.0, 1e-37, -1e-37, 5e-38]], device=device)
    q = backend.quantize(x, torch.tensor([1e-37], device=device), 127, torch.int8)
    assert q.tolist() == [[0, 127, -127, 127]]


@BACKENDS
def test_out_overlapping_x_is_rejected(backend, device):
    x = torch.ones(4, 8, device=device)
    aliased = x.view(-1).view(torch.int8)[:32].view(4, 8)   # int8 view of x's own bytes
    with untouched(x), pytest.raises(ValueError, match="out must not overlap x"):
        backend.quantize(x, torch.ones(4, device=device), 127, torch.int8, out=aliased)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_quantize_and_dequantize_views_at_any_alignment(offset, device):
    # The CUDA kernels take four values per access where the rows and pointers allow; views
    # that start inside such a group must give the same bits through the per-value path.
    x, scale = blocks_with_scales((50, 64), seed=4)

    def view_at_offset(values, dtype):
        wide = torch.zeros(offset + values.numel(), dtype=dtype, device=device)
        view = wide[offset:].view(values.shape)
        view.copy_(values)
        return view

    x_view = view_at_offset(x, torch.float32)
    q_out = view_at_offset(torch.zeros(x.shape, dtype=torch.int8), torch.int8)
    ops.quantize(x_view, scale.to(device), 127, torch.int8, out=q_out)
    assert torch.equal(q_out.cpu(), reference.quantize(x, scale, 127, torch.int8))
    x_hat = view_at_offset(torch.zeros(x.shape), torch.float32)
    ops.dequantize(q_out, scale.to(device), 127, out=x_hat)
    assert torch.equal(x_hat.cpu(), reference.dequantize(q_out.cpu(), scale, 127))
