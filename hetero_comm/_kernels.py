"""The names of hetero_comm's kernels, defined once.

``KERNELS`` lists every public kernel: ``hetero_comm.ops`` and ``hetero_comm.reference`` both
export exactly these names. Each kernel is registered as two operators in
``csrc/hetero_comm.cpp``: itself and its out= form (``*_into_``), which writes a given buffer
(the sparse codec's steps, :data:`CODEC_KERNELS`, and the other kernels of
:data:`CPU_ONLY_KERNELS`, only as themselves); ``KERNEL_OPS`` lists them all (a test checks it against the registered schemas). Imports
nothing of hetero_comm, so any module may import it.
"""

__all__ = ["KERNELS", "CODEC_KERNELS", "CPU_ONLY_KERNELS", "KERNEL_OPS", "into_form",
           "ops_served_on"]

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
    "sparse_encode_",
    "sparse_pack_",
    "sparse_unpack_",
    "gradient_sketch_",
)
# The sparse codec's steps write only buffers they are given: one operator each, no out= form.
CODEC_KERNELS = ("sparse_encode_", "sparse_pack_", "sparse_unpack_")
# Operators compiled for the CPU only, each writing a buffer it is given (no out= form); on a
# GPU their reference runs.
CPU_ONLY_KERNELS = CODEC_KERNELS + ("gradient_sketch_",)


def into_form(kernel: str) -> str:
    """The name of ``kernel``'s out= operator: ``pack_segments_`` -> ``pack_segments_into_``."""
    return kernel.rstrip("_") + "_into_"


KERNEL_OPS = tuple(op for kernel in KERNELS
                   for op in ((kernel,) if kernel in CPU_ONLY_KERNELS else (kernel, into_form(kernel))))


def ops_served_on(device_type: str) -> tuple:
    """The operators a compiled build implements for ``device_type``: all of them on the CPU;
    on CUDA all but :data:`CPU_ONLY_KERNELS` (the sparse codec's steps are the CPU path; a GPU
    bucket goes through the separate kernels)."""
    if device_type == "cpu":
        return KERNEL_OPS
    return tuple(op for op in KERNEL_OPS if op not in CPU_ONLY_KERNELS)
