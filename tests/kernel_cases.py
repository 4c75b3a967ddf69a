"""Helpers shared by the kernel tests: input generation, backends, untouched-input checks."""

from __future__ import annotations

import contextlib
import inspect
import os

import pytest
import torch

import hetero_comm
from hetero_comm import ops, reference

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Sizes below, at and around a segment, non-multiples, and large enough for several threads.
SIZES = (0, 1, 7, 256, 257, 1000, 70_001, 300_007)

# Both backends must reject bad input with the same exception types and wording.
BACKENDS = pytest.mark.parametrize("backend", [ops, reference], ids=["compiled", "reference"])


def cuda_skip_reason() -> str:
    """Why the CUDA kernels cannot be tested here ("" if they can). A build asked to include
    CUDA (HETERO_COMM_BUILD_CUDA=1) on a machine with a GPU fails instead of skipping."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    backend = hetero_comm.kernel_backend("cuda")
    if backend != "compiled":
        assert os.environ.get("HETERO_COMM_BUILD_CUDA") != "1", (
            "HETERO_COMM_BUILD_CUDA=1 but the CUDA kernels are not registered: "
            f"{hetero_comm._backend.load_error}")
        return f"the CUDA kernels are not built (kernel_backend('cuda') is {backend!r})"
    return ""


@pytest.fixture
def device() -> str:
    """The device a kernel test runs on: the CPU; tests/test_cuda_kernel_cases.py reruns every
    test that takes it with ``"cuda"``."""
    return "cpu"


def tests_taking_device(*modules) -> dict:
    """The test functions of ``modules`` that take the ``device`` fixture, by name, for a module
    that reruns them on another device (names must not repeat across ``modules``)."""
    tests = {}
    for module in modules:
        for name, test in vars(module).items():
            if name.startswith("test_") and "device" in inspect.signature(test).parameters:
                assert name not in tests, f"{name} is defined in two of the modules"
                tests[name] = test
    return tests


@pytest.fixture(autouse=True)
def compiled_with_strict_checks(request):
    """For kernel tests: fail unless the compiled kernels serve the test's device, and turn
    strict checks on (so CUDA rejects bad values like CPU; see ops.set_strict_checks)."""
    require_compiled(request.getfixturevalue("device") if "device" in request.fixturenames else "cpu")
    previous = ops.set_strict_checks(True)
    yield
    ops.set_strict_checks(previous)


def to_device(t, device: str):
    """``t`` on ``device`` with the same strides (``.to`` would make a strided view
    contiguous); anything but a tensor unchanged."""
    if not isinstance(t, torch.Tensor) or t.device.type == device:
        return t
    moved = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    return moved.copy_(t)


def require_compiled(device: str = "cpu") -> None:
    """Fail (not skip) unless the compiled kernels serve ``device``: comparing the reference
    with itself would prove nothing."""
    assert hetero_comm.kernel_backend(device) == "compiled", (
        f"the compiled kernels are not registered for {device}: {hetero_comm._backend.load_error}")


def random_tensor(numel: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * scale).to(dtype)


def non_contiguous(t: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """The values of the 1-D ``t`` in a strided view on ``device`` (every other element of a
    larger tensor)."""
    wide = torch.empty(t.numel() * 2, dtype=t.dtype, device=device)
    wide[::2] = t
    view = wide[::2]
    assert t.numel() <= 1 or not view.is_contiguous()
    return view


@contextlib.contextmanager
def untouched(*tensors: torch.Tensor):
    """Assert that the block leaves every given tensor bit-for-bit unchanged."""
    before = [_bytes(t) for t in tensors]
    yield
    for t, saved in zip(tensors, before):
        assert torch.equal(_bytes(t), saved), "a rejected call modified its input"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of the raw bytes (so NaN compares equal to itself)."""
    return t.detach().clone().contiguous().view(-1).view(torch.uint8)
