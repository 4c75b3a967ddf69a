"""The hooks on CUDA tensors (gloo ranks sharing one GPU): what only a GPU shows.

On CUDA a future's callback runs on a stream of its own. Issue 12 saw the DCT hook end with
different parameters on two ranks and differ between two identical runs (a race between the
callback and the hook's error-feedback step, and buffers going back to the pool while the
callback still used them); ``CUDA_LAUNCH_BLOCKING=1`` hid it. These tests repeat identical
runs with several buckets in flight and ask for bitwise equality. Skipped without a GPU and
an extension built with CUDA.
"""

import numpy as np
import pytest
import torch

import compress_workers
from lab.launch import run_ranks
from hook_workers import recipe_step_host_syncs, steady_step_host_syncs, train_on_cuda
from kernel_cases import cuda_skip_reason

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)
pytestmark = [pytest.mark.cuda, pytest.mark.multirank]

CASES = [
    ("dct", dict(block_size=256, keep_ratio=0.125, bits=8, warmup_steps=2)),
    ("dct", dict(block_size=64, keep_ratio=0.25, bits=16, warmup_steps=2)),
    ("sparse", dict(density=0.05, segment_size=64, warmup_steps=2)),
    ("sparse", dict(density=0.05, segment_size=64, basis="dct", output="sign", warmup_steps=2)),
    ("sparse", dict(density=0.1, segment_size=64, basis="dct", output="sign", wire_dtype="int8",
                    warmup_steps=2)),
    ("sparse", dict(density=0.1, segment_size=64, basis="dct", output="sign", wire_dtype="int8",
                    int8_sum="two_phase", warmup_steps=2)),
]


@pytest.mark.parametrize("hook,settings", CASES)
def test_identical_runs_end_bitwise_equal_on_every_rank(hook, settings):
    first = run_ranks(2, train_on_cuda, hook, settings, 12)
    second = run_ranks(2, train_on_cuda, hook, settings, 12)
    np.testing.assert_array_equal(first[0], first[1])  # the ranks agree
    np.testing.assert_array_equal(first[0], second[0])  # and the runs


@pytest.mark.parametrize("hook,settings", CASES + [
    ("sparse", dict(density=0.05, segment_size=64, wire_dtype="int8", warmup_steps=2))])
def test_a_steady_state_step_never_waits_for_the_gpu(hook, settings):
    """Issue 12: no host synchronisation in a hook's steady-state step (non-finite checks are
    device flags read later; kernel checks copy nothing without strict checks)."""
    assert run_ranks(1, steady_step_host_syncs, hook, settings)[0] == "ok"


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd_momentum", "sgd"])
def test_a_recipe_step_never_waits_for_the_gpu(optimizer_name):
    """The hooks as ``hetero_comm.compress`` sets them up, the optimizer wrapper included."""
    assert run_ranks(1, recipe_step_host_syncs, optimizer_name)[0] == "ok"


TWO_LEVEL_CASES = [
    dict(machines=2, density=0.1, segment_size=64, basis="dct", output="sign", wire_dtype="int8",
         warmup_steps=2),
    dict(machines=2, density=0.05, segment_size=64, inside_dtype="bfloat16", warmup_steps=2),
]


@pytest.mark.parametrize("settings", TWO_LEVEL_CASES)
def test_two_level_runs_end_bitwise_equal_on_every_rank(settings):
    """Issue 36: the two-level hook's exchange thread issues its collectives and kernels on the
    thread's own current stream; 2 machines x 2 ranks on one GPU, repeated."""
    first = run_ranks(4, train_on_cuda, "two_level", settings, 12)
    second = run_ranks(4, train_on_cuda, "two_level", settings, 12)
    for result in first[1:]:
        np.testing.assert_array_equal(result, first[0])
    np.testing.assert_array_equal(first[0], second[0])


def test_two_level_without_compression_matches_the_flat_allreduce():
    flat = run_ranks(4, train_on_cuda, "dense", {}, 6)
    two_level = run_ranks(4, train_on_cuda, "two_level_dense",
                          dict(machines=2, warmup_steps=1), 6)
    np.testing.assert_allclose(two_level[0], flat[0], rtol=0, atol=1e-6)
    assert not np.array_equal(flat[0], run_ranks(4, train_on_cuda, "dense", {}, 1)[0])  # it trained


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_compress_under_a_grad_scaler_on_cuda(optimizer):
    """torch.amp's float16 recipe on the GPU: the overflowing buckets are found on the device
    (no host read) and handed on as NaN, so the scaler backs off as with DDP's own allreduce;
    the ranks end bitwise equal and the loss falls."""
    dense = run_ranks(2, compress_workers.grad_scaler_steps, optimizer, False, "cuda")[0]
    ranks = run_ranks(2, compress_workers.grad_scaler_steps, optimizer, True, "cuda")
    losses, scales, params, non_finite = ranks[0]
    assert torch.equal(params, ranks[1][2]) and torch.isfinite(params).all()
    assert non_finite == ranks[1][3] >= 1
    first_applied = next(i for i in range(1, len(dense[1])) if dense[1][i] == dense[1][i - 1])
    assert scales[:first_applied + 1] == dense[1][:first_applied + 1]
    assert sum(losses[-5:]) < 0.25 * sum(losses[:5])
