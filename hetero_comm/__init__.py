"""hetero_comm: compressed DDP and FSDP2 communication for slow networks and unequal machines.

:func:`compress` sets up compressed gradient sync in one call, the recipe chosen from the
optimizer, for a DDP model or an FSDP2 model sharded inside each machine
(:mod:`hetero_comm.fsdp`). Kernels: :mod:`hetero_comm.ops` (compiled, with
:mod:`hetero_comm.reference` as the pure-PyTorch definition and fallback); :class:`BufferPool`
for allocation-free steady state.
"""

import importlib

from . import ops
from ._backend import extension_load_error, extension_loaded, kernel_backend
from .buffer_pool import BufferPool
from .recipes import compress

__all__ = ["compress", "ops", "reference", "kernel_backend", "extension_loaded",
           "extension_load_error", "BufferPool"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # hetero_comm.reference on first use: training with the compiled kernels never loads it.
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'hetero_comm' has no attribute {name!r}")
