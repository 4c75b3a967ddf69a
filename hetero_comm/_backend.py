"""Loads the compiled extension and reports which backend serves each device type."""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from ._kernels import KERNEL_OPS

logger = logging.getLogger("hetero_comm")

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

load_error: Optional[BaseException] = None
try:
    from . import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
except (ImportError, OSError) as error:  # missing build, or built against another torch
    load_error = error
    logger.warning("compiled kernels unavailable (%s); falling back to the "
                   "pure-PyTorch reference kernels", error)

_backend_by_type: dict = {}


def extension_load_error() -> Optional[BaseException]:
    """Why ``hetero_comm._C`` could not be imported (``None``: it was)."""
    return load_error


def extension_loaded() -> bool:
    """Whether ``hetero_comm._C`` was imported (the ``torch.ops.hetero_comm`` ops exist)."""
    return load_error is None


def kernel_backend(device: Union[str, torch.device] = "cpu") -> str:
    """Return ``"compiled"`` if every kernel has a compiled implementation for the device
    type of ``device``, else ``"reference"`` (the pure-PyTorch fallback is used)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    backend = _backend_by_type.get(device_type)
    if backend is None:
        key = _DISPATCH_KEYS.get(device_type)
        compiled = extension_loaded() and key is not None and all(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"hetero_comm::{op}", key)
            for op in KERNEL_OPS)
        backend = _backend_by_type[device_type] = "compiled" if compiled else "reference"
    return backend
