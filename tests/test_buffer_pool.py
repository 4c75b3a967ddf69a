"""BufferPool: reference counting, reuse by size class, clear errors, thread safety."""

import threading

import pytest
import torch

import hetero_comm
from hetero_comm._python_pool import PythonBufferPool, pool_device
from kernel_cases import require_compiled

POOLS = pytest.mark.parametrize("make_pool", [hetero_comm.BufferPool, PythonBufferPool],
                                ids=["compiled", "python"])


def test_the_public_pool_is_the_compiled_one():
    require_compiled()
    assert isinstance(hetero_comm.BufferPool()._impl, torch.ScriptObject)


@POOLS
def test_released_storage_is_reused_by_a_fitting_request(make_pool):
    pool = make_pool()
    first = pool.acquire(1000, torch.float32, "cpu")
    assert first.shape == (1000,) and first.dtype == torch.float32 and first.is_contiguous()
    pointer = first.data_ptr()
    pool.release(first)
    again = pool.acquire(1000, torch.float32, "cpu")
    assert again.data_ptr() == pointer
    # A different dtype of the same byte size class shares the storage too.
    pool.release(again)
    as_bytes = pool.acquire(3900, torch.uint8, "cpu")
    assert as_bytes.data_ptr() == pointer
    stats = pool.stats()
    assert stats["allocations"] == 1 and stats["reuses"] == 2
    assert stats["bytes_in_use"] == stats["bytes_reserved"] == 4096


@POOLS
def test_reference_count_keeps_a_retained_buffer_in_use(make_pool):
    pool = make_pool()
    buffer = pool.acquire(64, torch.float32)
    pool.retain(buffer)
    pool.release(buffer)
    assert pool.stats()["buffers_in_use"] == 1
    other = pool.acquire(64, torch.float32)
    assert other.data_ptr() != buffer.data_ptr()   # still held, so not handed out again
    pool.release(buffer)
    assert pool.stats()["buffers_in_use"] == 1 and pool.stats()["bytes_in_use"] == 256


@POOLS
def test_steady_state_allocates_nothing(make_pool):
    pool = make_pool()
    sizes = [(100_000, torch.float32), (5000, torch.bfloat16), (123, torch.int8)]
    for step in range(5):
        buffers = [pool.acquire(n, dtype) for n, dtype in sizes]
        for buffer in buffers:
            buffer.fill_(step)
            pool.release(buffer)
    stats = pool.stats()
    assert stats["allocations"] == 3 and stats["reuses"] == 12 and stats["bytes_in_use"] == 0


@POOLS
def test_size_classes_bound_the_waste(make_pool):
    pool = make_pool()
    for numel in (1, 64, 65, 1000, 4097, 100_001, 1 << 20):
        buffer = pool.acquire(numel, torch.float32)
        reserved = pool.stats()["bytes_in_use"]
        assert numel * 4 <= reserved <= max(256, 1.25 * numel * 4)
        pool.release(buffer)
        pool.empty_cache()
    assert pool.stats()["bytes_reserved"] == 0


@POOLS
def test_bad_releases_are_clear_errors(make_pool):
    pool = make_pool()
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.zeros(10))
    with pytest.raises(ValueError, match="did not hand out"):
        pool.retain(torch.zeros(10))
    buffer = pool.acquire(10, torch.float32)
    pool.release(buffer)
    with pytest.raises(ValueError, match="already released"):
        pool.release(buffer)
    with pytest.raises(ValueError, match="already released"):
        pool.retain(buffer)
    with pytest.raises(ValueError, match="numel must be an integer >= 0"):
        pool.acquire(-1, torch.float32)


@POOLS
def test_empty_cache_keeps_buffers_in_use(make_pool):
    pool = make_pool()
    kept = pool.acquire(1000, torch.float32)
    pool.release(pool.acquire(5000, torch.float32))
    pool.empty_cache()
    assert pool.stats()["bytes_reserved"] == pool.stats()["bytes_in_use"] == 4096
    pool.release(kept)


@POOLS
def test_concurrent_acquire_and_release(make_pool):
    pool = make_pool()
    errors = []

    def worker(seed):
        try:
            for i in range(300):
                buffer = pool.acquire(256 + (seed * 7 + i) % 5 * 256, torch.float32)
                buffer.fill_(seed)
                pool.retain(buffer)
                pool.release(buffer)
                assert bool((buffer == seed).all())   # nobody else was handed our buffer
                pool.release(buffer)
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = pool.stats()
    assert stats["buffers_in_use"] == 0 and stats["allocations"] + stats["reuses"] == 1200
    assert stats["allocations"] <= 4 * 5


def test_pool_device_names_one_device_one_way():
    assert pool_device("cpu") == pool_device("cpu:0") == pool_device(torch.device("cpu", 0)) == torch.device("cpu")
    assert pool_device("cuda:1") == torch.device("cuda", 1)   # an explicit index stays


@POOLS
def test_device_spellings_of_one_device_share_free_buffers(make_pool):
    # Free buffers are keyed by the device: "cpu" and "cpu:0" (like "cuda" and "cuda:0",
    # tested in test_cuda_kernels.py) are one device and must reuse each other's storage.
    pool = make_pool()
    for step, device in enumerate(["cpu", "cpu:0", torch.device("cpu"), "cpu:0", "cpu"]):
        buffer = pool.acquire(1000, torch.float32, device)
        assert buffer.device == torch.device("cpu")
        pool.release(buffer)
    assert pool.stats()["allocations"] == 1 and pool.stats()["reuses"] == 4
