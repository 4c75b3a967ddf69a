"""The one call on FSDP2 with CUDA tensors: 2 gloo ranks sharing one GPU as 2 machines of one
rank each (mesh (2, 1)). FSDP runs the exchange inside its all-reduce stream; these tests ask
that the exchange sending every value equals native HSDP bitwise, that the replicas end
bitwise equal and identical runs repeat bitwise (a race between FSDP's streams and the
exchange would break either), and that both recipes train. Skipped without a GPU and an
extension built with CUDA."""

import pytest
import torch

import fsdp_workers
from kernel_cases import cuda_skip_reason
from lab.launch import run_ranks

if cuda_skip_reason():
    pytest.skip(cuda_skip_reason(), allow_module_level=True)
pytestmark = [pytest.mark.cuda, pytest.mark.multirank]

SHAPE = (2, 1)


def test_exchange_sending_every_value_equals_native_hsdp_bitwise_on_cuda():
    assert run_ranks(2, fsdp_workers.dense_equals_native, "float32", 4, SHAPE, "cuda") == [True] * 2


@pytest.mark.parametrize("kind,optimizer,lr", [("transformer", "adamw", 3e-3), ("mlp", "sgd", 0.05)])
def test_recipe_on_cuda_repeats_bitwise_with_replicas_equal(kind, optimizer, lr):
    first = run_ranks(2, fsdp_workers.recipe_against_dense, kind, optimizer, lr, 30, SHAPE, "cuda")
    second = run_ranks(2, fsdp_workers.recipe_against_dense, kind, optimizer, lr, 30, SHAPE, "cuda")
    for result in first:
        assert result["replicas_equal"]
        assert result["stats"]["steps"] == 30 and result["stats"]["dense_fallbacks"] == 0
        assert sum(result["compressed"][-5:]) / 5 < result["compressed"][0] * 0.7  # it learns
    assert first[0]["compressed"] == second[0]["compressed"]
    assert all(torch.equal(a, b) for a, b in zip(first[0]["parameters"], second[0]["parameters"]))
