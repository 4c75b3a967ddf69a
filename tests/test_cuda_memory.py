"""The memory planner on CUDA: the allocator's exact counts, pinned host swap on a side stream,
and every plan bitwise the unplanned step. Skipped once where no CUDA device is visible."""

import pytest
import torch

from kernel_cases import tests_taking_device

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytestmark = pytest.mark.cuda

import test_memory  # noqa: E402  (after the skip: imported to rerun its device tests)
from hetero_comm.memory import apply_memory_plan  # noqa: E402
from test_memory import assert_same_steps, batch, cnn, gradients_after_steps, plan_of  # noqa: E402

globals().update(tests_taking_device(test_memory))


@pytest.fixture
def device() -> str:
    return "cuda"


@pytest.mark.parametrize("pattern", [("swap", "swap", "keep", "swap"), ("recompute", "swap", "swap", "keep"),
                                     ("partial", "swap", "partial", "recompute")])
def test_cuda_plans_are_bitwise_the_unplanned(pattern):
    inputs, targets = batch("cnn", torch.float32)
    inputs, targets = inputs.cuda(), targets.cuda()
    expected = gradients_after_steps(cnn().cuda(), inputs, targets)
    model = cnn().cuda()
    with apply_memory_plan(model, plan_of(model, pattern)):
        got = gradients_after_steps(model, inputs, targets)
    assert_same_steps(got, expected)


