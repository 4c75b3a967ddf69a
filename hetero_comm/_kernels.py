"""The names of hetero_comm's kernels, defined once.

``KERNELS`` lists every public kernel: ``hetero_comm.ops`` and ``hetero_comm.reference`` both
export exactly these names. Each kernel is registered as two operators in
``csrc/hetero_comm.cpp``: itself and its out= form (``*_into_``), which writes a given buffer;
``KERNEL_OPS`` lists them all (a test checks it against the registered schemas). Imports
nothing of hetero_comm, so any module may import it.
"""

__all__ = ["KERNELS", "KERNEL_OPS", "into_form"]

KERNELS = (
    "segment_accumulate_",
    "select_segments",
    "pack_segments_",
    "pack_quantized_segments_",
    "unpack_segments",
    "dct_encode",
    "dct_decode",
    "quantize",
    "dequantize",
)


def into_form(kernel: str) -> str:
    """The name of ``kernel``'s out= operator: ``pack_segments_`` -> ``pack_segments_into_``."""
    return kernel.rstrip("_") + "_into_"


KERNEL_OPS = tuple(op for kernel in KERNELS for op in (kernel, into_form(kernel)))
