"""The public kernel API: thin typed wrappers over ``torch.ops.hetero_comm.*``.

Each function has the signature and semantics of the function of the same name in
:mod:`hetero_comm.reference` (whose docstrings are the specification) and runs the compiled
kernel when one is registered for the input's device type, else that reference.

Argument checks and host syncs. Shapes, dtypes, devices and scalar settings are always
checked, before anything is written. The checks that read tensor values (indices in range
and strictly increasing; scale finite and >= 0; x finite in :func:`quantize`; importance
finite in :func:`select_segments`) always run on CPU tensors, where they are free. On a GPU
they would copy to the host and synchronise on every call, so the compiled CUDA kernels run
them only while strict checks are on (:func:`set_strict_checks`; off by default). Without
them no CUDA kernel reads or writes outside its buffers, and bad values give:

* ``pack_segments_`` / ``unpack_segments``: an index outside ``[0, S)`` is skipped (its packed
  segment is zeros; nothing is written for it); with duplicate indices the values of the
  repeated segments are unspecified.
* ``quantize``: a NaN in ``x`` quantizes to 0, an infinity to ``+-levels``; a block whose
  scale is NaN, infinite or negative quantizes to 0 (its factor is 0, and so is ``inf * 0``).
* ``dequantize``: multiplies by ``scale / levels`` as given (a NaN scale gives NaN).
* ``select_segments``: a NaN ranks by its bits, above ``+inf`` with the sign bit clear and
  below ``-inf`` with it set; the result is still deterministic.

The pure-PyTorch references always run every check, on every device.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ._backend import extension_loaded, kernel_backend
from ._checks import check_int
from ._kernels import KERNELS
from ._layout import dct_coeffs_shape, num_segments

__all__ = [*KERNELS, "set_strict_checks", "num_segments"]

_strict_checks = False


def set_strict_checks(enabled: bool) -> bool:
    """Turn the value checks of the compiled CUDA kernels on or off; returns the previous
    setting. On, a bad index, scale or non-finite input on a GPU raises ``ValueError`` like on
    CPU, at the cost of a host sync per call (see the module docstring). Process-wide; CPU
    kernels and the references always check.

    Example::

        >>> previous = hetero_comm.ops.set_strict_checks(True)   # e.g. while debugging
    """
    global _strict_checks
    previous, _strict_checks = _strict_checks, bool(enabled)
    if extension_loaded():
        torch.ops.hetero_comm._set_strict_checks(_strict_checks)
    return previous


def _reference():
    """:mod:`hetero_comm.reference`, imported on the first call that falls back to it (with
    the compiled kernels in place, training never loads it)."""
    return importlib.import_module(".reference", __package__)


def _compiled(tensor: torch.Tensor) -> bool:
    return kernel_backend(tensor.device) == "compiled"


def segment_accumulate_(residual: torch.Tensor, grad: torch.Tensor, segment_size: int,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``residual += grad`` in place; returns float32 [S] per-segment L2 norms.

    Args:
        residual: float32 [n], contiguous, updated in place.
        grad: float32, bfloat16 or float16 [n].
        segment_size: elements per segment, >= 1.
        out: optional float32 [ceil(n / segment_size)], contiguous.

    Returns:
        importance: ``out``, or a new float32 [ceil(n / segment_size)].
    """
    if not _compiled(residual):
        return _reference().segment_accumulate_(residual, grad, segment_size, out=out)
    if out is None:
        return torch.ops.hetero_comm.segment_accumulate_.default(residual, grad, segment_size)
    torch.ops.hetero_comm.segment_accumulate_into_.default(residual, grad, segment_size, out)
    return out


def select_segments(importance: torch.Tensor, k: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices of the ``k`` largest values, ascending; ties go to the lower index.

    Args:
        importance: float32 [S], finite.
        k: 0 <= k <= S.
        out: optional int64 [k], contiguous.

    Returns:
        ``out``, or a new int64 [k]; strictly increasing, the same on every machine for the
        same input.
    """
    if not _compiled(importance):
        return _reference().select_segments(importance, k, out=out)
    if out is None:
        return torch.ops.hetero_comm.select_segments.default(importance, k)
    _check_out_matches(out, "k = out.numel() =", k, out.numel())
    torch.ops.hetero_comm.select_segments_into_.default(importance, out)
    return out


def pack_segments_(residual: torch.Tensor, indices: torch.Tensor, segment_size: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather the selected segments (zero-padded to ``segment_size``); each selected element
    ``v`` of ``residual`` becomes ``v - float32(packed value)``: 0 for a float32 ``out``, the
    rounding error for bfloat16/float16.

    Args:
        residual: float32 [n], contiguous, modified in place.
        indices: int64 [k], strictly increasing, in [0, S).
        segment_size: elements per segment, >= 1.
        out: optional float32/bfloat16/float16 [k * segment_size], contiguous.

    Returns:
        packed: ``out``, or a new float32 [k * segment_size].
    """
    if not _compiled(residual):
        return _reference().pack_segments_(residual, indices, segment_size, out=out)
    if out is None:
        return torch.ops.hetero_comm.pack_segments_.default(residual, indices, segment_size)
    torch.ops.hetero_comm.pack_segments_into_.default(residual, indices, segment_size, out)
    return out


def pack_quantized_segments_(residual: torch.Tensor, indices: torch.Tensor, segment_size: int,
                             scale: torch.Tensor, levels: int, dtype: torch.dtype,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather the selected segments as integers (:func:`quantize`'s rule, ``scale[j]`` for
    segment ``indices[j]``, zero-padded to ``segment_size``); each selected element ``v`` of
    ``residual`` becomes ``v - dequantized integer``, its rounding error. NaN and infinity are
    allowed (sent as 0 and ``+-levels``; they stay in the residual).

    Args:
        residual: float32 [n], contiguous, modified in place.
        indices: int64 [k], strictly increasing, in [0, S).
        segment_size: elements per segment, >= 1.
        scale: float32 [k], finite, >= 0.
        levels: 1 <= levels <= max of ``dtype``.
        dtype: torch.int8, torch.int16 or torch.int32.
        out: optional ``dtype`` [k * segment_size], contiguous.

    Returns:
        packed: ``out``, or a new ``dtype`` [k * segment_size].
    """
    if not _compiled(residual):
        return _reference().pack_quantized_segments_(residual, indices, segment_size, scale, levels, dtype,
                                                  out=out)
    if out is None:
        return torch.ops.hetero_comm.pack_quantized_segments_.default(residual, indices, segment_size,
                                                                      scale, levels, dtype)
    _check_out_matches(out, "dtype", dtype, out.dtype)
    torch.ops.hetero_comm.pack_quantized_segments_into_.default(residual, indices, segment_size, scale,
                                                                levels, out)
    return out


def unpack_segments(packed: torch.Tensor, indices: torch.Tensor, segment_size: int, numel: int,
                    scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scatter ``scale * packed`` to the selected segments of a zeroed flat tensor.

    Args:
        packed: float32/bfloat16/float16 [k * segment_size].
        indices: int64 [k], strictly increasing, in [0, ceil(numel / segment_size)).
        segment_size: elements per segment, >= 1.
        numel: length of the result.
        scale: factor applied to the packed values.
        out: optional float32/bfloat16/float16 [numel], contiguous; every element is written.

    Returns:
        ``out``, or a new float32 [numel].
    """
    if not _compiled(packed):
        return _reference().unpack_segments(packed, indices, segment_size, numel, scale, out=out)
    if out is None:
        return torch.ops.hetero_comm.unpack_segments.default(packed, indices, segment_size, numel, scale)
    _check_out_matches(out, "numel =", numel, out.numel())
    torch.ops.hetero_comm.unpack_segments_into_.default(packed, indices, segment_size, scale, out)
    return out


def _check_out_matches(out: torch.Tensor, what: str, expected, actual) -> None:
    """The `*_into_` ops read a size or dtype from ``out``; make sure it is the one asked for."""
    if expected != actual:
        raise ValueError(f"out must have {what} {expected}; got {actual}")


def dct_encode(x: torch.Tensor, block_size: int, keep: int, group: Optional[int] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Blockwise orthonormal DCT-II keeping the ``keep`` lowest frequencies.

    Args:
        x: float32/bfloat16/float16 [n].
        block_size: a power of two in [1, 65536].
        keep: 0 <= keep <= block_size.
        group: None for the plain layout; >= 1 for the grouped one, where coefficient ``k`` of
            block ``b`` is at ``[b // group, k, b % group]`` (padding blocks zero).
        out: optional float32 tensor of the layout's shape, contiguous.

    Returns:
        coeffs: ``out``, or a new float32 [ceil(n / block_size), keep] (plain) or
        [ceil(ceil(n / block_size) / group), keep, group] (grouped).
    """
    if not _compiled(x):
        return _reference().dct_encode(x, block_size, keep, group, out=out)
    if out is None:
        return torch.ops.hetero_comm.dct_encode.default(x, block_size, keep, group)
    # The _into_ op reads the layout from out: check it is the one asked for.
    if group is not None:
        check_int("group", group, 1)
    ndim = 2 if group is None else 3
    if out.dim() != ndim:
        raise ValueError(f"out must be {ndim}-D; got a tensor of shape {tuple(out.shape)}")
    _check_out_matches(out, "keep = out.shape[1] =", keep, out.shape[1])
    if group is not None:
        _check_out_matches(out, "group = out.shape[2] =", group, out.shape[2])
    torch.ops.hetero_comm.dct_encode_into_.default(x, block_size, out)
    return out


def dct_decode(coeffs: torch.Tensor, block_size: int, numel: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`dct_encode` (missing coefficients are zero).

    Args:
        coeffs: float32 [ceil(numel / block_size), keep] (plain) or
            [ceil(ceil(numel / block_size) / group), keep, group] (grouped).
        block_size: a power of two in [1, 65536].
        numel: length of the result.
        out: optional float32 [numel], contiguous.

    Returns:
        x_hat: ``out``, or a new float32 [numel].
    """
    if not _compiled(coeffs):
        return _reference().dct_decode(coeffs, block_size, numel, out=out)
    if out is None:
        return torch.ops.hetero_comm.dct_decode.default(coeffs, block_size, numel)
    _check_out_matches(out, "numel =", numel, out.numel())
    torch.ops.hetero_comm.dct_decode_into_.default(coeffs, block_size, out)
    return out


def quantize(x: torch.Tensor, scale: torch.Tensor, levels: int, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-block quantization to integers in [-levels, levels], round half to even.

    Args:
        x: float32 [num_blocks, m], finite.
        scale: float32 [num_blocks], finite, >= 0.
        levels: 1 <= levels <= max of ``dtype``.
        dtype: torch.int8, torch.int16 or torch.int32.
        out: optional ``dtype`` [num_blocks, m], contiguous.

    Returns:
        q: ``out``, or a new ``dtype`` [num_blocks, m].
    """
    if not _compiled(x):
        return _reference().quantize(x, scale, levels, dtype, out=out)
    if out is None:
        return torch.ops.hetero_comm.quantize.default(x, scale, levels, dtype)
    _check_out_matches(out, "dtype", dtype, out.dtype)
    torch.ops.hetero_comm.quantize_into_.default(x, scale, levels, out)
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, levels: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``float32(q) * float32(scale / levels)`` per block.

    Args:
        q: int8/int16/int32 [num_blocks, m].
        scale: float32 [num_blocks], finite, >= 0.
        levels: >= 1.
        out: optional float32 [num_blocks, m], contiguous.

    Returns:
        x_hat: ``out``, or a new float32 [num_blocks, m].
    """
    if not _compiled(q):
        return _reference().dequantize(q, scale, levels, out=out)
    if out is None:
        return torch.ops.hetero_comm.dequantize.default(q, scale, levels)
    torch.ops.hetero_comm.dequantize_into_.default(q, scale, levels, out)
    return out


def _codec_compiled(tensor: torch.Tensor) -> bool:
    """The sparse codec's kernels are compiled for the CPU only (CUDA runs the reference)."""
    return tensor.device.type == "cpu" and _compiled(tensor)


def sparse_encode_(residual: torch.Tensor, grad: torch.Tensor, segment_size: int,
                   importance: torch.Tensor, *, weight: float = 1.0,
                   velocity: Optional[torch.Tensor] = None, momentum: float = 0.0,
                   nesterov: bool = False, block_size: int = 0,
                   coefficients: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sparse codec's first step: this step's contribution (``weight * grad``, or with
    ``velocity`` momentum correction's) into the residual, and each segment's importance
    (``block_size`` > 0: of the residual's DCT coefficients, left in ``coefficients``).

    Args:
        residual: float32 [n], contiguous, updated in place.
        grad: float32, bfloat16 or float16 [n] (not written).
        segment_size: elements per segment (DCT: blocks per group), >= 1.
        importance: float32 [S], contiguous, written.
        weight, velocity, momentum, nesterov, block_size, coefficients: see
            :func:`hetero_comm.reference.sparse_encode_`.

    Returns:
        ``importance``.
    """
    if not _codec_compiled(residual):
        return _reference().sparse_encode_(residual, grad, segment_size, importance, weight=weight,
                                           velocity=velocity, momentum=momentum, nesterov=nesterov,
                                           block_size=block_size, coefficients=coefficients)
    torch.ops.hetero_comm.sparse_encode_.default(residual, grad, weight, velocity, momentum, nesterov,
                                                 segment_size, block_size, coefficients, importance)
    return importance


def sparse_pack_(residual: torch.Tensor, importance: torch.Tensor, segment_size: int,
                 indices: torch.Tensor, wire: torch.Tensor, *, block_size: int = 0,
                 coefficients: Optional[torch.Tensor] = None,
                 velocity: Optional[torch.Tensor] = None, levels: int = 0,
                 scale: Optional[torch.Tensor] = None, scale_factor: float = 0.0) -> bool:
    """The sparse codec's second step: the ``indices.numel()`` most important segments onto
    ``wire`` (``levels`` > 0: as integers with the agreed ``scale``), the rest kept in the
    residual, the sent velocity restarted. Writes nothing and returns False if the importance
    is not finite.

    Args:
        residual: float32 [n], contiguous, updated in place.
        importance: float32 [S], summed over the ranks.
        segment_size: as for :func:`sparse_encode_`.
        indices: int64 [k], contiguous, written.
        wire: [k * segment_size], contiguous, written.
        block_size, coefficients, velocity, levels, scale, scale_factor: see
            :func:`hetero_comm.reference.sparse_pack_`.

    Returns:
        Whether the importance was finite.
    """
    if not _codec_compiled(residual):
        return _reference().sparse_pack_(residual, importance, segment_size, indices, wire,
                                         block_size=block_size, coefficients=coefficients,
                                         velocity=velocity, levels=levels, scale=scale,
                                         scale_factor=scale_factor)
    return torch.ops.hetero_comm.sparse_pack_.default(residual, coefficients, velocity, importance,
                                                      segment_size, block_size, scale_factor, levels,
                                                      indices, scale, wire)


def sparse_unpack_(wire: torch.Tensor, indices: torch.Tensor, segment_size: int,
                   grad: torch.Tensor, *, levels: int = 0, scale: Optional[torch.Tensor] = None,
                   block_size: int = 0, coefficients: Optional[torch.Tensor] = None,
                   sign: bool = False) -> torch.Tensor:
    """The sparse codec's last step: the summed ``wire`` scattered back into every element of
    ``grad`` (through the inverse DCT with ``block_size`` > 0), or its sign with ``sign``.

    Args:
        wire: [k * segment_size], as :func:`sparse_pack_` wrote it, summed.
        indices: int64 [k], strictly increasing.
        segment_size: as for :func:`sparse_encode_`.
        grad: float32, bfloat16 or float16 [n], contiguous, written.
        levels, scale, block_size, coefficients, sign: see
            :func:`hetero_comm.reference.sparse_unpack_`.

    Returns:
        ``grad``.
    """
    if not _codec_compiled(grad):
        return _reference().sparse_unpack_(wire, indices, segment_size, grad, levels=levels,
                                           scale=scale, block_size=block_size,
                                           coefficients=coefficients, sign=sign)
    torch.ops.hetero_comm.sparse_unpack_.default(wire, indices, scale, levels, segment_size,
                                                 block_size, sign, coefficients, grad)
    return grad


def gradient_sketch_(grad: torch.Tensor, salt: int, sketch: torch.Tensor) -> None:
    """Add a count sketch of ``grad`` into ``sketch[:-1]`` and ``sum(grad ** 2)`` into
    ``sketch[-1]``, in place: element ``j`` goes into slot ``j % (len(sketch) - 1)`` with the
    sign of a hash of ``(j, salt)``, the same on every rank (so sketches of gradients add up
    to the sketch of their sum).

    Args:
        grad: float32, bfloat16 or float16 [n], n < 2**31.
        salt: an integer in [0, 2**32 - 1].
        sketch: float32 [slots + 1], slots >= 1, contiguous, sharing no memory with ``grad``.

    Compiled for the CPU (a fixed-order sum, whatever the thread count); elsewhere the
    reference runs.
    """
    if not _codec_compiled(grad):
        return _reference().gradient_sketch_(grad, salt, sketch)
    torch.ops.hetero_comm.gradient_sketch_.default(grad, salt, sketch)


# Shape/dtype-only implementations, so the ops work under torch.compile and opcheck.
if extension_loaded():

    @torch.library.register_fake("hetero_comm::gradient_sketch_")
    def _gradient_sketch_fake(grad, salt, sketch):
        return None

    @torch.library.register_fake("hetero_comm::segment_accumulate_")
    def _segment_accumulate_fake(residual, grad, segment_size):
        return residual.new_empty(num_segments(residual.numel(), segment_size))

    @torch.library.register_fake("hetero_comm::segment_accumulate_into_")
    def _segment_accumulate_into_fake(residual, grad, segment_size, out):
        return None

    @torch.library.register_fake("hetero_comm::select_segments_into_")
    def _select_segments_into_fake(importance, out):
        return None

    @torch.library.register_fake("hetero_comm::select_segments")
    def _select_segments_fake(importance, k):
        return importance.new_empty(k, dtype=torch.int64)

    @torch.library.register_fake("hetero_comm::pack_segments_")
    def _pack_segments_fake(residual, indices, segment_size):
        return residual.new_empty(indices.numel() * segment_size)

    @torch.library.register_fake("hetero_comm::pack_segments_into_")
    def _pack_segments_into_fake(residual, indices, segment_size, out):
        return None

    @torch.library.register_fake("hetero_comm::pack_quantized_segments_")
    def _pack_quantized_segments_fake(residual, indices, segment_size, scale, levels, dtype):
        return residual.new_empty(indices.numel() * segment_size, dtype=dtype)

    @torch.library.register_fake("hetero_comm::pack_quantized_segments_into_")
    def _pack_quantized_segments_into_fake(residual, indices, segment_size, scale, levels, out):
        return None

    @torch.library.register_fake("hetero_comm::unpack_segments")
    def _unpack_segments_fake(packed, indices, segment_size, numel, scale=1.0):
        return packed.new_empty(numel, dtype=torch.float32)

    @torch.library.register_fake("hetero_comm::unpack_segments_into_")
    def _unpack_segments_into_fake(packed, indices, segment_size, scale, out):
        return None

    @torch.library.register_fake("hetero_comm::dct_encode")
    def _dct_encode_fake(x, block_size, keep, group=None):
        return x.new_empty(dct_coeffs_shape(x.numel(), block_size, keep, group), dtype=torch.float32)

    @torch.library.register_fake("hetero_comm::dct_decode")
    def _dct_decode_fake(coeffs, block_size, numel):
        return coeffs.new_empty(numel)

    @torch.library.register_fake("hetero_comm::dct_encode_into_")
    def _dct_encode_into_fake(x, block_size, out):
        return None

    @torch.library.register_fake("hetero_comm::dct_decode_into_")
    def _dct_decode_into_fake(coeffs, block_size, out):
        return None

    @torch.library.register_fake("hetero_comm::quantize_into_")
    def _quantize_into_fake(x, scale, levels, out):
        return None

    @torch.library.register_fake("hetero_comm::dequantize_into_")
    def _dequantize_into_fake(q, scale, levels, out):
        return None

    @torch.library.register_fake("hetero_comm::quantize")
    def _quantize_fake(x, scale, levels, dtype):
        return x.new_empty(x.shape, dtype=dtype)

    @torch.library.register_fake("hetero_comm::dequantize")
    def _dequantize_fake(q, scale, levels):
        return q.new_empty(q.shape, dtype=torch.float32)

    @torch.library.register_fake("hetero_comm::sparse_encode_")
    def _sparse_encode_fake(residual, grad, weight, velocity, momentum, nesterov, segment_size,
                            block_size, coefficients, importance):
        return None

    @torch.library.register_fake("hetero_comm::sparse_unpack_")
    def _sparse_unpack_fake(wire, indices, scale, levels, segment_size, block_size, sign,
                            coefficients, grad):
        return None

    # sparse_pack_ has no fake: its result (whether the importance was finite) depends on values.
