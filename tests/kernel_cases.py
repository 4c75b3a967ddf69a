"""Helpers shared by the kernel tests: input generation, backends, untouched-input checks."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hetero_comm
from hetero_comm import ops, reference

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Sizes below, at and around a segment, non-multiples, and large enough for several threads.
SIZES = (0, 1, 7, 64, 255, 256, 257, 1000, 4099, 70_001, 300_007)

# Both backends must reject bad input with the same exception types and wording.
BACKENDS = pytest.mark.parametrize("backend", [ops, reference], ids=["compiled", "reference"])


def require_compiled(device: str = "cpu") -> None:
    """Fail (not skip) unless the compiled kernels serve ``device``: comparing the reference
    with itself would prove nothing."""
    assert hetero_comm.kernel_backend(device) == "compiled", (
        f"the compiled kernels are not registered for {device}: {hetero_comm._backend.load_error}")


def random_tensor(numel: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * scale).to(dtype)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The values of the 1-D ``t`` in a strided view (every other element of a larger tensor)."""
    wide = torch.empty(t.numel() * 2, dtype=t.dtype)
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
