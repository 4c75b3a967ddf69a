"""Loads the compiled extension and reports which backend serves each device type."""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch

from ._kernels import ops_served_on

logger = logging.getLogger("hetero_comm")

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def why_not_loaded(error: BaseException, package_dir: str) -> str:
    """What a user can do about ``error``, raised importing ``_C`` from ``package_dir``."""
    built = any(name.startswith("_C.") and name.endswith((".so", ".pyd"))
                for name in os.listdir(package_dir))
    source_tree = os.path.exists(os.path.join(os.path.dirname(package_dir), "setup.py"))
    if not built and source_tree:
        return (f"hetero_comm was imported from its source tree ({package_dir}), which holds no "
                f"compiled extension; build it there with `pip install -e .` (what `make quick` "
                f"does), or run from outside the source tree to use an installed hetero_comm")
    if not built:
        return ("this installation has no compiled extension (built with "
                "HETERO_COMM_NO_EXTENSION=1, or without a C++ compiler); reinstall with a "
                "compiler to get the compiled kernels")
    return (f"the compiled extension in {package_dir} did not load ({error}); it was probably "
            f"built against another torch than the {torch.__version__} running now: rebuild it "
            f"with `pip install --no-build-isolation -e .` (or `pip install --no-build-isolation .`)")


load_error: Optional[BaseException] = None
try:
    from . import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
except (ImportError, OSError) as error:  # missing build, or built against another torch
    load_error = error
    logger.warning("hetero_comm runs on its pure-PyTorch reference kernels, which are slower: "
                   "%s", why_not_loaded(error, os.path.dirname(os.path.abspath(__file__))))

_backend_by_type: dict = {}


def extension_load_error() -> Optional[BaseException]:
    """Why ``hetero_comm._C`` could not be imported (``None``: it was)."""
    return load_error


def extension_loaded() -> bool:
    """Whether ``hetero_comm._C`` was imported (the ``torch.ops.hetero_comm`` ops exist)."""
    return load_error is None


def kernel_backend(device: Union[str, torch.device] = "cpu") -> str:
    """Return ``"compiled"`` if every kernel that device type runs has a compiled
    implementation for it (:func:`._kernels.ops_served_on`), else ``"reference"`` (the
    pure-PyTorch fallback is used)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    backend = _backend_by_type.get(device_type)
    if backend is None:
        key = _DISPATCH_KEYS.get(device_type)
        compiled = extension_loaded() and key is not None and all(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"hetero_comm::{op}", key)
            for op in ops_served_on(device_type))
        backend = _backend_by_type[device_type] = "compiled" if compiled else "reference"
    return backend
