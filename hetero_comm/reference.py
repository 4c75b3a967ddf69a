"""Pure-PyTorch reference of every hetero_comm kernel.

Each function here is the readable definition of the compiled kernel with the same name in
``csrc/<family>.cpp`` and ``cuda/<family>.cu``: the test oracle, the benchmark baseline, and
the fallback when the extension is not built. The docstrings are the specification.

Conventions shared by every kernel:

* ``n`` is the number of elements of a flat (1-D) tensor; a *segment* is ``segment_size``
  consecutive elements, the last one may be shorter, and ``S = ceil(n / segment_size)``.
* Gradients may be float32, bfloat16 or float16; residuals, importance, packed values and
  every accumulation are float32.
* Bad input raises ``ValueError`` (``TypeError`` for a wrong dtype) naming the argument,
  before anything is written, so a rejected call leaves every input untouched. The
  references check everything on every device; the compiled CUDA kernels skip the checks
  that read tensor values unless strict checks are on, to avoid a host sync per call
  (``hetero_comm.ops.set_strict_checks``; what they do with bad values is stated in
  :mod:`hetero_comm.ops`).
* Tensors that a kernel only reads may be non-contiguous (they are read through a contiguous
  copy); tensors that it writes must be contiguous.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._checks import check_int
from ._kernels import KERNELS
from ._layout import GRADIENT_DTYPES, MAX_BLOCK_SIZE, QUANT_DTYPES, dct_coeffs_shape, num_segments

__all__ = list(KERNELS)


# ----------------------------------------------------------------------------- validation
def _check_tensor(name: str, t: torch.Tensor, dtypes, ndim: int, *, writable: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got a tensor of shape {tuple(t.shape)}")
    if writable and not t.is_contiguous():
        raise ValueError(f"{name} is written in place and must be contiguous")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device; got {listed}")


def _byte_range(t: torch.Tensor) -> tuple:
    """[first, last) bytes of storage that ``t``'s elements can touch (an over-estimate for
    strided tensors)."""
    start = t.data_ptr()
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + span * t.element_size()


def _check_no_overlap(out: torch.Tensor, other: torch.Tensor, other_name: str, *,
                      written_name: str = "out") -> None:
    if out.numel() and other.numel():
        (a, b), (c, d) = _byte_range(out), _byte_range(other)
        if a < d and c < b:
            raise ValueError(f"{written_name} must not overlap {other_name} in memory")


def _check_out(out: torch.Tensor, dtypes, shape, like: torch.Tensor, like_name: str) -> None:
    """Validate a caller's ``out=`` buffer: dtype, exact shape, contiguity, device, and no
    memory shared with the input ``like``."""
    _check_tensor("out", out, dtypes, len(shape), writable=True)
    _check_same_device(**{like_name: like, "out": out})
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {list(shape)}; got {list(out.shape)}")
    _check_no_overlap(out, like, like_name)


def _check_residual_and_grad(residual: torch.Tensor, grad: torch.Tensor) -> None:
    """A float32 residual written in place and a gradient of the same length beside it."""
    _check_tensor("residual", residual, (torch.float32,), 1, writable=True)
    _check_tensor("grad", grad, GRADIENT_DTYPES, 1)
    _check_same_device(residual=residual, grad=grad)
    if grad.numel() != residual.numel():
        raise ValueError(f"grad must have as many elements as residual ({residual.numel()}); got {grad.numel()}")


def _check_block_size(block_size: int) -> None:
    if block_size <= 0 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}]; got {block_size}")


def _check_indices(indices: torch.Tensor, count: int, what: str = "segments") -> None:
    _check_tensor("indices", indices, (torch.int64,), 1)
    if indices.numel() == 0:
        return
    if int(indices.min()) < 0 or int(indices.max()) >= count:
        raise ValueError(f"indices must lie in [0, {count}) (the number of {what}); "
                         f"got values from {int(indices.min())} to {int(indices.max())}")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError("indices must be strictly increasing (sorted, no duplicates)")


def _check_scale(scale: torch.Tensor, num_blocks: int) -> None:
    _check_tensor("scale", scale, (torch.float32,), 1)
    if scale.numel() != num_blocks:
        raise ValueError(f"scale must have one entry per block ({num_blocks}); got {scale.numel()}")
    if scale.numel() and not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise ValueError("scale must be finite and >= 0")


# ------------------------------------------------------------------------------ segments
def segment_accumulate_(residual: torch.Tensor, grad: torch.Tensor, segment_size: int,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Add ``grad`` into ``residual`` in place and return the L2 norm of each segment.

    Args:
        residual: float32 [n], contiguous; updated in place to ``residual + grad``.
        grad: float32, bfloat16 or float16 [n].
        segment_size: elements per segment, >= 1.
        out: optional float32 [S], contiguous, to write the importance into.

    Returns:
        importance: ``out``, or a new float32 [S]: the L2 norm of each segment of the
        updated residual.
    """
    _check_residual_and_grad(residual, grad)
    check_int("segment_size", segment_size, 1)
    if out is not None:
        _check_out(out, (torch.float32,), (num_segments(residual.numel(), segment_size),),
                   residual, "residual")
        _check_no_overlap(out, grad, "grad")
    residual.add_(grad)
    n = residual.numel()
    full = n // segment_size
    squares = residual.square()
    sums = squares[: full * segment_size].view(full, segment_size).sum(dim=1)
    if n % segment_size:
        sums = torch.cat([sums, squares[full * segment_size:].sum().view(1)])
    return sums.sqrt() if out is None else out.copy_(sums.sqrt())


def select_segments(importance: torch.Tensor, k: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return the indices of the ``k`` largest importance values, in ascending order.

    Ties go to the lower index and ``-0.0`` ties with ``0.0``, so the selected set is a
    function of the values alone: every rank holding the same vector picks the same set.

    Args:
        importance: float32 [S], every value finite.
        k: number of segments to select, 0 <= k <= S.
        out: optional int64 [k], contiguous, to write the indices into.

    Returns:
        ``out``, or a new int64 [k]; strictly increasing.
    """
    _check_tensor("importance", importance, (torch.float32,), 1)
    count = importance.numel()
    check_int("k", k, 0, count)
    if out is not None:
        _check_out(out, (torch.int64,), (k,), importance, "importance")
    if count and not bool(torch.isfinite(importance).all()):
        raise ValueError("importance must be finite (found NaN or infinity)")
    # A stable descending sort keeps equal values in index order: ties go to the lower index.
    order = torch.sort(importance, descending=True, stable=True).indices[:k]
    indices = torch.sort(order).values
    return indices if out is None else out.copy_(indices)


def pack_segments_(residual: torch.Tensor, indices: torch.Tensor, segment_size: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Move the selected segments into one contiguous tensor, leaving in ``residual`` what
    the packed dtype cannot represent.

    Segment ``indices[j]`` lands at ``packed[j * segment_size : (j + 1) * segment_size]``;
    a short last segment is padded with zeros, so the packed length is always
    ``k * segment_size`` (a fixed size per ``k``, which is what a collective needs).

    Each selected element ``v`` of ``residual`` becomes ``v - float32(packed value)``: zero for
    a float32 ``out`` (written as 0, also for an infinite ``v``), the rounding error for a
    bfloat16 or float16 ``out`` (values are rounded to nearest, ties to even). That
    difference is exact in float32, so ``unpack_segments(packed) + residual`` equals the
    residual before the call on the selected segments, bit for bit (unless a value overflows
    the 16-bit range: float16 rounds it to infinity and the residual then holds minus
    infinity). Error feedback needs nothing else.

    Args:
        residual: float32 [n], contiguous; the selected segments are updated as above.
        indices: int64 [k], strictly increasing, each in [0, S).
        segment_size: elements per segment, >= 1.
        out: optional float32, bfloat16 or float16 [k * segment_size], contiguous, to write
            into instead of allocating.

    Returns:
        packed: ``out`` if given, else a new float32 [k * segment_size].
    """
    _check_tensor("residual", residual, (torch.float32,), 1, writable=True)
    check_int("segment_size", segment_size, 1)
    _check_indices(indices, num_segments(residual.numel(), segment_size))
    _check_same_device(residual=residual, indices=indices)
    packed_numel = indices.numel() * segment_size
    if out is not None:
        _check_out(out, GRADIENT_DTYPES, (packed_numel,), residual, "residual")
    else:
        out = torch.empty(packed_numel, dtype=torch.float32, device=residual.device)
    if indices.numel():
        positions, inside = _segment_positions(indices, segment_size, residual.numel())
        picked = torch.where(inside, residual[positions.clamp(max=residual.numel() - 1)], 0.0)
        out.copy_(picked.view(-1))
        if out.dtype == torch.float32:
            residual[positions[inside]] = 0
        else:
            residual[positions[inside]] = (picked - out.view_as(picked).float())[inside]
    return out


def pack_quantized_segments_(residual: torch.Tensor, indices: torch.Tensor, segment_size: int,
                             scale: torch.Tensor, levels: int, dtype: torch.dtype,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Move the selected segments into one contiguous tensor as integers, leaving each value's
    rounding error in ``residual``: :func:`pack_segments_` followed by :func:`quantize`, in one
    pass and without the separate error buffer.

    Segment ``indices[j]`` is quantized with ``scale[j]`` by :func:`quantize`'s rule (a short
    last segment is padded with zeros) and lands at ``packed[j * segment_size : (j + 1) *
    segment_size]``. Each selected element ``v`` of ``residual`` becomes ``v - x_hat``, with
    ``x_hat`` its :func:`dequantize`'d integer (a float32 product, then a float32 difference),
    so ``residual + unpack_segments(dequantize(packed))`` is the residual before the call up to
    one rounding of that sum. A NaN is allowed: it is sent as 0 and stays in the residual; an
    infinity is sent as ``+-levels`` and stays infinite there (so error feedback never hides one).

    Args:
        residual: float32 [n], contiguous; the selected segments are updated as above.
        indices: int64 [k], strictly increasing, each in [0, S).
        segment_size: elements per segment, >= 1.
        scale: float32 [k], finite and >= 0: the value sent as ``levels``, per selected segment.
        levels: 1 <= levels <= the largest value of ``dtype``.
        dtype: torch.int8, torch.int16 or torch.int32.
        out: optional ``dtype`` [k * segment_size], contiguous, written instead of allocating.

    Returns:
        packed: ``out`` if given, else a new ``dtype`` [k * segment_size].
    """
    _check_tensor("residual", residual, (torch.float32,), 1, writable=True)
    check_int("segment_size", segment_size, 1)
    _check_indices(indices, num_segments(residual.numel(), segment_size))
    _check_same_device(residual=residual, indices=indices)
    if dtype not in QUANT_DTYPES.values():
        raise TypeError(f"dtype must be int8, int16 or int32; got {dtype}")
    _check_scale(scale, indices.numel())
    _check_same_device(residual=residual, scale=scale)
    check_int("levels", levels, 1, torch.iinfo(dtype).max)
    _check_no_overlap(residual, scale, "scale", written_name="residual")
    packed_numel = indices.numel() * segment_size
    if out is not None:
        _check_out(out, (dtype,), (packed_numel,), residual, "residual")
        _check_no_overlap(out, scale, "scale")
    else:
        out = torch.empty(packed_numel, dtype=dtype, device=residual.device)
    if indices.numel():
        positions, inside = _segment_positions(indices, segment_size, residual.numel())
        picked = torch.where(inside, residual[positions.clamp(max=residual.numel() - 1)], 0.0)
        q = _quantized(picked, scale, levels, dtype)
        out.copy_(q.view(-1))
        residual[positions[inside]] = (picked - _dequantized(q, scale, levels))[inside]
    return out


def unpack_segments(packed: torch.Tensor, indices: torch.Tensor, segment_size: int, numel: int,
                    scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter packed segments back to a flat tensor; every other element is zero.

    The inverse of :func:`pack_segments_`: ``out[segment indices[j]] = scale * packed[j-th
    segment]``, the padding of a short last segment is dropped.

    Args:
        packed: float32, bfloat16 or float16 [k * segment_size].
        indices: int64 [k], strictly increasing, each in [0, ceil(numel / segment_size)).
        segment_size: elements per segment, >= 1.
        numel: length of the result, >= 0.
        scale: factor applied to the packed values (e.g. 1 / world_size).
        out: optional float32, bfloat16 or float16 [numel], contiguous; every element is
            written.

    Returns:
        ``out`` if given, else a new float32 [numel].
    """
    _check_tensor("packed", packed, GRADIENT_DTYPES, 1)
    check_int("segment_size", segment_size, 1)
    check_int("numel", numel, 0)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    _check_indices(indices, num_segments(numel, segment_size))
    _check_same_device(packed=packed, indices=indices)
    if packed.numel() != indices.numel() * segment_size:
        raise ValueError(f"packed must have k * segment_size = {indices.numel() * segment_size} "
                         f"elements; got {packed.numel()}")
    if out is not None:
        _check_out(out, GRADIENT_DTYPES, (numel,), packed, "packed")
    else:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    result = torch.zeros(numel, dtype=torch.float32, device=packed.device)
    if indices.numel():
        positions, inside = _segment_positions(indices, segment_size, numel)
        result[positions[inside]] = (packed.float().view(-1, segment_size) * scale)[inside]
    return out.copy_(result)


def _segment_positions(indices: torch.Tensor, segment_size: int, numel: int):
    """[k, segment_size] element positions of the selected segments, and which are < numel
    (a short last segment is padded)."""
    positions = indices.unsqueeze(1) * segment_size + torch.arange(segment_size, device=indices.device)
    return positions, positions < numel


def _padded_segment_view(flat: torch.Tensor, segment_size: int) -> torch.Tensor:
    """[S, segment_size] float32 copy of ``flat`` with the last segment zero-padded."""
    segments = torch.zeros(num_segments(flat.numel(), segment_size), segment_size,
                           dtype=torch.float32, device=flat.device)
    segments.view(-1)[: flat.numel()] = flat
    return segments


# ------------------------------------------------------------------------------------ DCT
def dct_basis(block_size: int, device=None) -> torch.Tensor:
    """Orthonormal DCT-II matrix, float32 [block_size, block_size]: coeffs = basis @ block."""
    n = torch.arange(block_size, dtype=torch.float64)
    k = n.view(-1, 1)
    basis = torch.cos(math.pi * (2 * n + 1) * k / (2 * block_size)) * math.sqrt(2.0 / block_size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=torch.float32, device=device)


def _grouped(plain: torch.Tensor, group: int) -> torch.Tensor:
    """Plain coefficients [blocks, keep] in the grouped layout, padding blocks zero."""
    blocks, keep = plain.shape
    groups = num_segments(blocks, group)
    padded = plain.new_zeros(groups * group, keep)
    padded[:blocks] = plain
    return padded.view(groups, group, keep).transpose(1, 2)


def dct_encode(x: torch.Tensor, block_size: int, keep: int, group: Optional[int] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Blockwise orthonormal DCT-II, keeping the ``keep`` lowest-frequency coefficients.

    ``x`` is split into ``num_blocks = ceil(n / block_size)`` blocks, the last zero-padded;
    coefficient ``k`` of a block ``v`` is ``s_k * sum_i v_i cos(pi (2i + 1) k / (2 B))`` with
    ``s_0 = sqrt(1/B)`` and ``s_k = sqrt(2/B)``, as ``scipy.fft.dct(type=2, norm="ortho")``.
    With ``group``, coefficient ``k`` of block ``b`` goes to ``[b // group, k, b % group]``
    and the last group's padding blocks are zero: one frequency of ``group`` consecutive
    blocks, the sparse hook's segment, is then contiguous.

    The compiled CPU kernel uses a fast O(B log B) transform (Lee's algorithm) whose float32
    error grows with B: for data of standard deviation sigma, about 1e-7 * B * sigma (encode)
    and up to 2e-7 * B * sigma (decode), e.g. 1.5e-4 * sigma at B = 1024 (the kernel benchmark
    prints the measured errors; the tests assert 3e-7 * B + 2e-6 for sigma = 1). The CUDA
    kernel is this matrix product (float32, so ``torch.backends.cuda.matmul.allow_tf32``
    applies) where the kept basis rows fit in 64 MB, a direct double-precision sum beyond.

    Args:
        x: float32, bfloat16 or float16 [n].
        block_size: B, a power of two in [1, 65536].
        keep: coefficients kept per block, 0 <= keep <= block_size.
        group: None (plain layout) or the blocks per group, >= 1 (grouped layout).
        out: optional float32 tensor of the layout's shape, contiguous, to write instead of
            allocating.

    Returns:
        coeffs: ``out``, or a new float32 [num_blocks, keep] (plain) or
        [ceil(num_blocks / group), keep, group] (grouped).
    """
    _check_tensor("x", x, GRADIENT_DTYPES, 1)
    _check_block_size(block_size)
    check_int("keep", keep, 0, block_size)
    if group is not None:
        check_int("group", group, 1)
    if out is not None:
        _check_out(out, (torch.float32,), dct_coeffs_shape(x.numel(), block_size, keep, group), x, "x")
    coeffs = _padded_segment_view(x, block_size) @ dct_basis(block_size, x.device)[:keep].T
    if group is not None:
        coeffs = _grouped(coeffs, group)
    return coeffs.contiguous() if out is None else out.copy_(coeffs)


def dct_decode(coeffs: torch.Tensor, block_size: int, numel: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`dct_encode`: missing high-frequency coefficients are taken as zero.

    Args:
        coeffs: float32, plain [num_blocks, keep] or grouped [ceil(num_blocks / group), keep,
            group], with num_blocks = ceil(numel / block_size) and
            keep <= block_size. A grouped layout's padding blocks are not read.
        block_size: B, a power of two in [1, 65536].
        numel: length of the result, >= 0.
        out: optional float32 [numel], contiguous, to write instead of allocating.

    Returns:
        x_hat: ``out``, or a new float32 [numel].
    """
    _check_coeffs(coeffs, block_size, numel)
    if out is not None:
        _check_out(out, (torch.float32,), (numel,), coeffs, "coeffs")
    keep, blocks = coeffs.shape[1], num_segments(numel, block_size)
    if coeffs.dim() == 3:
        coeffs = coeffs.transpose(1, 2).reshape(coeffs.shape[0] * coeffs.shape[2], keep)[:blocks]
    decoded = (coeffs.contiguous() @ dct_basis(block_size, coeffs.device)[:keep]).reshape(-1)[:numel]
    return decoded.contiguous() if out is None else out.copy_(decoded)


def _check_coeffs(coeffs: torch.Tensor, block_size: int, numel: int) -> None:
    """Plain or grouped coefficients of ``numel`` values."""
    if not isinstance(coeffs, torch.Tensor):
        raise TypeError(f"coeffs must be a torch.Tensor, got {type(coeffs).__name__}")
    if coeffs.dtype != torch.float32:
        raise TypeError(f"coeffs must have dtype float32; got {str(coeffs.dtype).replace('torch.', '')}")
    if coeffs.dim() not in (2, 3):
        raise ValueError("coeffs must be 2-D [blocks, keep] or 3-D [groups, keep, group]; got a "
                         f"tensor of shape {tuple(coeffs.shape)}")
    _check_block_size(block_size)
    check_int("numel", numel, 0)
    blocks = num_segments(numel, block_size)
    if coeffs.dim() == 2:
        if coeffs.shape[0] != blocks or coeffs.shape[1] > block_size:
            raise ValueError(f"coeffs must have shape [ceil(numel / block_size) = {blocks}, keep <= "
                             f"{block_size}]; got {tuple(coeffs.shape)}")
        return
    group = coeffs.shape[2]
    groups = num_segments(blocks, group) if group >= 1 else 0
    if group < 1 or coeffs.shape[0] != groups or coeffs.shape[1] > block_size:
        raise ValueError(f"grouped coeffs must have shape [ceil(ceil(numel / block_size) / group) = "
                         f"{groups}, keep <= {block_size}, group >= 1]; got {tuple(coeffs.shape)}")


# ------------------------------------------------------------------------------ quantize
def largest_float32_at_most(value: int) -> float:
    """The largest float32 that is <= ``value`` (float32 cannot hold every int32)."""
    as_float = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if float(as_float) > value:
        as_float = torch.nextafter(as_float, torch.tensor(0.0, dtype=torch.float32))
    return float(as_float)


def quantize(x: torch.Tensor, scale: torch.Tensor, levels: int, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize each block of ``x`` to integers in [-levels, levels].

    With ``f = float32(levels / scale)`` per block (computed in float64, 0 where scale is 0):
    ``q = round_half_to_even(clamp(x * f, -L, L))`` (``0 * f`` counts as 0 when ``f`` overflows) where ``L`` is the largest float32 not
    above ``levels``; rounding is round half to even (deterministic, no randomness).

    Args:
        x: float32 [num_blocks, m], every value finite.
        scale: float32 [num_blocks], finite and >= 0 (typically the block's max |x|).
        levels: 1 <= levels <= the largest value of ``dtype``.
        dtype: torch.int8, torch.int16 or torch.int32.
        out: optional ``dtype`` [num_blocks, m], contiguous, to write instead of allocating.

    Returns:
        q: ``out``, or a new ``dtype`` [num_blocks, m].
    """
    _check_tensor("x", x, (torch.float32,), 2)
    if dtype not in QUANT_DTYPES.values():
        raise TypeError(f"dtype must be int8, int16 or int32; got {dtype}")
    _check_scale(scale, x.shape[0])
    _check_same_device(x=x, scale=scale)
    check_int("levels", levels, 1, torch.iinfo(dtype).max)
    if out is not None:
        _check_out(out, (dtype,), tuple(x.shape), x, "x")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite (found NaN or infinity)")
    q = _quantized(x, scale, levels, dtype)
    return q if out is None else out.copy_(q)


def _quantized(x: torch.Tensor, scale: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`quantize`'s rule for validated arguments; a NaN in ``x`` becomes 0 and an
    infinity ``+-levels`` (``pack_quantized_segments_`` allows them)."""
    factor = torch.where(scale > 0, levels / scale.double(), torch.zeros_like(scale, dtype=torch.float64))
    bound = largest_float32_at_most(levels)
    # A scale so small that levels / scale overflows gives an infinite factor: 0 * inf is 0.
    scaled = torch.nan_to_num(x * factor.float().unsqueeze(1), nan=0.0).clamp_(-bound, bound)
    return torch.round(scaled).to(dtype)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """:func:`dequantize`'s rule for validated arguments."""
    return q.float() * (scale.double() / levels).float().unsqueeze(1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, levels: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Map quantized blocks back to float32: ``x_hat = float32(q) * float32(scale / levels)``.

    Args:
        q: int8, int16 or int32 [num_blocks, m].
        scale: float32 [num_blocks], finite and >= 0.
        levels: the ``levels`` passed to :func:`quantize`, >= 1.
        out: optional float32 [num_blocks, m], contiguous, to write instead of allocating.

    Returns:
        x_hat: ``out``, or a new float32 [num_blocks, m].
    """
    _check_tensor("q", q, tuple(QUANT_DTYPES.values()), 2)
    _check_scale(scale, q.shape[0])
    _check_same_device(q=q, scale=scale)
    check_int("levels", levels, 1)
    if out is not None:
        _check_out(out, (torch.float32,), tuple(q.shape), q, "q")
    x_hat = _dequantized(q, scale, levels)
    return x_hat if out is None else out.copy_(x_hat)


# ------------------------------------------------------------------------ the sparse codec
# The three steps of a sparse exchange of one flat gradient, each one kernel: encode (before
# the importance is summed over the ranks), pack (after: the agreed selection onto the wire)
# and unpack (after the wire is summed: back into the gradient). ``block_size`` 0 selects
# among segments of the residual's elements; a power of two, among segments of its grouped
# DCT coefficients (frequency f of ``segment_size`` consecutive blocks).
def _codec_segments(numel: int, segment_size: int, block_size: int) -> int:
    """The number of segments the codec cuts ``numel`` values into."""
    if block_size == 0:
        return num_segments(numel, segment_size)
    groups, keep, group = dct_coeffs_shape(numel, block_size, block_size, segment_size)
    return groups * keep


def _check_codec_settings(numel: int, segment_size: int, block_size: int,
                          coefficients: Optional[torch.Tensor], like: torch.Tensor,
                          like_name: str = "residual") -> None:
    """``segment_size``, ``block_size`` and the coefficients buffer they ask for."""
    check_int("segment_size", segment_size, 1)
    if block_size != 0:
        _check_block_size(block_size)
    if block_size == 0:
        if coefficients is not None:
            raise ValueError("coefficients is the DCT's work buffer: give it only with block_size > 0")
        return
    if coefficients is None:
        raise ValueError("block_size > 0 (the DCT basis) needs the coefficients buffer")
    shape = dct_coeffs_shape(numel, block_size, block_size, segment_size)
    _check_tensor("coefficients", coefficients, (torch.float32,), 3, writable=True)
    if tuple(coefficients.shape) != shape:
        raise ValueError(f"coefficients must have shape {list(shape)}; got {list(coefficients.shape)}")
    _check_same_device(**{like_name: like}, coefficients=coefficients)
    _check_no_overlap(coefficients, like, like_name, written_name="coefficients")


def _check_velocity(velocity: Optional[torch.Tensor], residual: torch.Tensor) -> None:
    if velocity is None:
        return
    _check_tensor("velocity", velocity, (torch.float32,), 1, writable=True)
    if velocity.numel() != residual.numel():
        raise ValueError(f"velocity must have as many elements as residual ({residual.numel()}); "
                         f"got {velocity.numel()}")
    _check_same_device(residual=residual, velocity=velocity)
    _check_no_overlap(velocity, residual, "residual", written_name="velocity")


def _segment_norms(values: torch.Tensor, segment_size: int) -> torch.Tensor:
    """The L2 norm of each segment of the flat float32 ``values``."""
    return _padded_segment_view(values, segment_size).square().sum(dim=1).sqrt()


def sparse_encode_(residual: torch.Tensor, grad: torch.Tensor, segment_size: int,
                   importance: torch.Tensor, *, weight: float = 1.0,
                   velocity: Optional[torch.Tensor] = None, momentum: float = 0.0,
                   nesterov: bool = False, block_size: int = 0,
                   coefficients: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Add this step's contribution into the residual and measure every segment's importance.

    The contribution is ``c = weight * float32(grad)``; with ``velocity`` (momentum
    correction) first ``velocity = momentum * velocity + c`` and the contribution is the
    velocity, or with ``nesterov`` ``c + momentum * velocity`` (each product and sum a float32
    rounding of its own). ``residual += contribution``. ``block_size`` 0: ``importance`` is the
    L2 norm of each segment of the residual; else the residual's grouped DCT coefficients go
    into ``coefficients`` (:func:`dct_encode` with ``keep = block_size``, ``group =
    segment_size``) and ``importance`` is the L2 norm of each of its ``segment_size``-value
    rows. ``grad`` is not written.

    Args:
        residual: float32 [n], contiguous, updated in place.
        grad: float32, bfloat16 or float16 [n].
        segment_size: elements per segment (DCT: blocks per group), >= 1.
        importance: float32 [S], contiguous, written.
        weight: finite factor on the gradient (this rank's share).
        velocity: optional float32 [n], contiguous, updated in place.
        momentum: in [0, 1), with ``velocity``.
        nesterov: with ``velocity``.
        block_size: 0, or the DCT's block, a power of two.
        coefficients: with ``block_size`` > 0, float32 of :func:`dct_encode`'s grouped shape,
            contiguous, written.

    Returns:
        ``importance``.
    """
    _check_residual_and_grad(residual, grad)
    _check_codec_settings(residual.numel(), segment_size, block_size, coefficients, residual)
    if not math.isfinite(weight):
        raise ValueError(f"weight must be finite; got {weight}")
    _check_velocity(velocity, residual)
    if velocity is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1); got {momentum}")
    if velocity is None and (momentum or nesterov):
        raise ValueError("momentum and nesterov need the velocity buffer")
    count = _codec_segments(residual.numel(), segment_size, block_size)
    _check_out_named("importance", importance, (torch.float32,), (count,), residual)
    _check_no_overlap(importance, grad, "grad", written_name="importance")
    contribution = grad.float() * weight
    if velocity is not None:
        velocity.mul_(momentum).add_(contribution)
        contribution = contribution + momentum * velocity if nesterov else velocity
    residual.add_(contribution)
    if block_size == 0:
        return importance.copy_(_segment_norms(residual, segment_size))
    dct_encode(residual, block_size, block_size, segment_size, out=coefficients)
    return importance.copy_(_segment_norms(coefficients.view(-1), segment_size))


def sparse_pack_(residual: torch.Tensor, importance: torch.Tensor, segment_size: int,
                 indices: torch.Tensor, wire: torch.Tensor, *, block_size: int = 0,
                 coefficients: Optional[torch.Tensor] = None,
                 velocity: Optional[torch.Tensor] = None, levels: int = 0,
                 scale: Optional[torch.Tensor] = None, scale_factor: float = 0.0) -> bool:
    """Put the ``k = indices.numel()`` most important segments on the wire; keep the rest.

    If any importance value is NaN or infinite, nothing is written and the result is False.
    Else ``indices`` gets :func:`select_segments` of ``importance``, and the selected segments
    of the values (``block_size`` 0: the residual; else ``coefficients``, as
    :func:`sparse_encode_` left them) go onto ``wire``: ``levels`` 0: as
    :func:`pack_segments_` (a float wire); else as :func:`pack_quantized_segments_` with
    ``scale[j] = min(importance[indices[j]] * scale_factor * t, float32 max)``, where ``t`` is
    ``sqrt(segment_size / tail)`` for a last segment of ``tail < segment_size`` values and 1
    elsewhere (each product a float32 rounding). What the wire does not carry stays in the
    values; with the DCT the residual then becomes :func:`dct_decode` of ``coefficients``. With
    ``velocity``, its selected segments (DCT: coefficients, through ``coefficients``) are set
    to zero.

    Args:
        residual: float32 [n], contiguous, updated in place.
        importance: float32 [S] (summed over the ranks).
        segment_size, block_size, coefficients: as for :func:`sparse_encode_`.
        indices: int64 [k], contiguous, written; 0 <= k <= S.
        wire: [k * segment_size], contiguous, written: float32, bfloat16 or float16 with
            ``levels`` 0, else int8, int16 or int32.
        velocity: optional float32 [n], contiguous, updated in place.
        levels: 0, or the integer steps each way, 1 <= levels <= the wire dtype's largest value.
        scale: with ``levels`` > 0, float32 [k], contiguous, written.
        scale_factor: with ``levels`` > 0, a finite factor >= 0.

    Returns:
        Whether the importance was finite (and anything was written).
    """
    _check_tensor("residual", residual, (torch.float32,), 1, writable=True)
    _check_codec_settings(residual.numel(), segment_size, block_size, coefficients, residual)
    _check_velocity(velocity, residual)
    count = _codec_segments(residual.numel(), segment_size, block_size)
    _check_tensor("importance", importance, (torch.float32,), 1)
    if importance.numel() != count:
        raise ValueError(f"importance must have one value per segment ({count}); got {importance.numel()}")
    _check_same_device(residual=residual, importance=importance)
    _check_tensor("indices", indices, (torch.int64,), 1, writable=True)
    check_int("k = indices.numel() =", indices.numel(), 0, count)
    k = indices.numel()
    if levels == 0:
        if scale is not None:
            raise ValueError("scale is the integer wire's: give it only with levels > 0")
        _check_out_named("wire", wire, GRADIENT_DTYPES, (k * segment_size,), residual)
    else:
        _check_out_named("wire", wire, tuple(QUANT_DTYPES.values()), (k * segment_size,), residual)
        check_int("levels", levels, 1, torch.iinfo(wire.dtype).max)
        if scale is None:
            raise ValueError("levels > 0 (an integer wire) needs the scale buffer")
        _check_out_named("scale", scale, (torch.float32,), (k,), residual)
        if not (math.isfinite(scale_factor) and scale_factor >= 0):
            raise ValueError(f"scale_factor must be finite and >= 0; got {scale_factor}")
    for name, written in (("indices", indices), ("wire", wire), ("scale", scale)):
        if written is not None:
            _check_no_overlap(written, importance, "importance", written_name=name)
    if count and not bool(torch.isfinite(importance).all()):
        return False
    indices.copy_(select_segments(importance, k))
    values = residual if block_size == 0 else coefficients.view(-1)
    if levels == 0:
        pack_segments_(values, indices, segment_size, out=wire)
    else:
        tail = values.numel() - (count - 1) * segment_size
        scale.copy_(importance[indices] * scale_factor)
        if tail < segment_size:
            scale.mul_(torch.where(indices == count - 1, math.sqrt(segment_size / tail), 1.0))
        scale.clamp_(max=torch.finfo(torch.float32).max)
        pack_quantized_segments_(values, indices, segment_size, scale, levels, wire.dtype, out=wire)
    if block_size:
        dct_decode(coefficients, block_size, residual.numel(), out=residual)
    if velocity is not None and block_size == 0:
        _padded_segment_positions_zeroed(velocity, indices, segment_size)
    elif velocity is not None:
        dct_encode(velocity, block_size, block_size, segment_size, out=coefficients)
        coefficients.view(-1, segment_size)[indices] = 0.0
        dct_decode(coefficients, block_size, velocity.numel(), out=velocity)
    return True


def _padded_segment_positions_zeroed(flat: torch.Tensor, indices: torch.Tensor, segment_size: int) -> None:
    """Zero the selected segments of ``flat``."""
    positions, inside = _segment_positions(indices, segment_size, flat.numel())
    flat[positions[inside]] = 0.0


def sparse_unpack_(wire: torch.Tensor, indices: torch.Tensor, segment_size: int,
                   grad: torch.Tensor, *, levels: int = 0, scale: Optional[torch.Tensor] = None,
                   block_size: int = 0, coefficients: Optional[torch.Tensor] = None,
                   sign: bool = False) -> torch.Tensor:
    """The summed wire back into the gradient: every element of ``grad`` is written.

    The wire's values (``levels`` 0: as they are; else :func:`dequantize` with ``scale``)
    are scattered to their segments, zeros elsewhere (:func:`unpack_segments`): ``block_size``
    0: into ``grad``'s elements; else into ``coefficients``, whose :func:`dct_decode` is the
    result. With ``sign`` the result is its float32 sign (-1, 0 or 1). Written into ``grad``
    in its dtype.

    Args:
        wire: [k * segment_size]: float32, bfloat16 or float16 with ``levels`` 0, else int8,
            int16 or int32.
        indices: int64 [k], strictly increasing, each in [0, S).
        segment_size, block_size, coefficients: as for :func:`sparse_encode_` (the
            coefficients are a work buffer here).
        grad: float32, bfloat16 or float16 [n], contiguous, written.
        levels: 0, or the integer wire's steps each way (>= 1).
        scale: with ``levels`` > 0, float32 [k], finite and >= 0.
        sign: hand on the sign of the result.

    Returns:
        ``grad``.
    """
    _check_tensor("grad", grad, GRADIENT_DTYPES, 1, writable=True)
    _check_codec_settings(grad.numel(), segment_size, block_size, coefficients, grad, "grad")
    count = _codec_segments(grad.numel(), segment_size, block_size)
    _check_indices(indices, count)
    _check_same_device(grad=grad, indices=indices)
    _check_same_device(grad=grad, wire=wire)
    k = indices.numel()
    if levels == 0:
        _check_tensor("wire", wire, GRADIENT_DTYPES, 1)
        if scale is not None:
            raise ValueError("scale is the integer wire's: give it only with levels > 0")
    else:
        _check_tensor("wire", wire, tuple(QUANT_DTYPES.values()), 1)
        check_int("levels", levels, 1)
        if scale is None:
            raise ValueError("levels > 0 (an integer wire) needs the scale buffer")
        _check_scale(scale, k)
    if wire.numel() != k * segment_size:
        raise ValueError(f"wire must have k * segment_size = {k * segment_size} elements; got {wire.numel()}")
    _check_no_overlap(grad, wire, "wire", written_name="grad")
    values = wire.float() if levels == 0 else _dequantized(wire.view(k, segment_size), scale, levels).view(-1)
    if block_size == 0:
        result = unpack_segments(values, indices, segment_size, grad.numel())
    else:
        unpack_segments(values, indices, segment_size, coefficients.numel(), out=coefficients.view(-1))
        result = dct_decode(coefficients, block_size, grad.numel())
    return grad.copy_(result.sign() if sign else result)


def _check_out_named(name: str, out: torch.Tensor, dtypes, shape, like: torch.Tensor) -> None:
    """A written buffer ``name``: dtype, exact shape, contiguous, on ``like``'s device and not
    sharing its memory."""
    _check_tensor(name, out, dtypes, len(shape), writable=True)
    _check_same_device(residual=like, **{name: out})
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}; got {list(out.shape)}")
    _check_no_overlap(out, like, "residual", written_name=name)


# ------------------------------------------------------------------------- the step scale
_MASK_32 = (1 << 32) - 1


def gradient_sketch_(grad: torch.Tensor, salt: int, sketch: torch.Tensor) -> None:
    """Add a count sketch of ``grad`` and its squared norm into ``sketch``: element ``j`` goes
    into slot ``j % (len(sketch) - 1)`` with the sign of a hash of ``(j, salt)``, and the last
    element gets ``sum(grad ** 2)``. The signs are the same on every rank, so the sketch of a
    sum of gradients is the sum of their sketches, and its squared norm estimates the sum's
    squared norm without bias.

    Args:
        grad: float32, bfloat16 or float16 [n], n < 2**31.
        salt: an integer in [0, 2**32 - 1] (a different one draws other signs).
        sketch: float32 [slots + 1], slots >= 1, contiguous; added to in place.
    """
    _check_tensor("grad", grad, GRADIENT_DTYPES, 1)
    _check_tensor("sketch", sketch, (torch.float32,), 1, writable=True)
    _check_same_device(grad=grad, sketch=sketch)
    if sketch.numel() < 2:
        raise ValueError(f"sketch must have at least 2 elements (its slots and the squared "
                         f"norm); got {sketch.numel()}")
    check_int("salt", salt, 0, _MASK_32)
    _check_no_overlap(sketch, grad, "grad", written_name="sketch")
    slots = sketch.numel() - 1
    values = grad.float()
    index = torch.arange(grad.numel(), dtype=torch.int64, device=grad.device)
    mixed = (index * 2654435761 + salt * 0x85EBCA6B) & _MASK_32
    mixed = mixed ^ (mixed >> 16)
    mixed = (mixed * 0x45D9F3B) & _MASK_32
    mixed = mixed ^ (mixed >> 16)
    signs = 1.0 - 2.0 * (mixed & 1).float()
    sketch[:slots].index_add_(0, index % slots, signs * values)
    sketch[slots] += values.square().sum()
