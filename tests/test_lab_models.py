"""The lab's residual CNN and GRU language model: shapes, sizes, and one short run each."""

import pytest
import torch

from lab.data import DIGITS_MODELS, MODELS, make_model, make_workload
from lab.text import GRULanguageModel
from lab.training import TrainConfig, run_training


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_resnet_classifies_flat_digits_with_20k_to_80k_parameters():
    assert "resnet" in DIGITS_MODELS and "resnet" in MODELS
    model = make_model(256, "resnet")  # TrainConfig's default width: 16 base channels
    assert 20_000 <= parameters(model) <= 80_000
    assert model(torch.randn(5, 64)).shape == (5, 10)
    assert parameters(make_model(512, "resnet")) > 3 * parameters(model)  # hidden sets the width


def test_resnet_gradients_reach_every_parameter():
    model = make_model(128, "resnet")
    model(torch.randn(4, 64)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_gru_workload_is_the_text_split_with_byte_logits():
    x_train, y_train, x_val, y_val, model = make_workload("gru", 32, seed=0)
    gpt_split = make_workload("gpt", 32, seed=0)[:4]
    assert all(torch.equal(a, b) for a, b in zip((x_train, y_train, x_val, y_val), gpt_split))
    assert isinstance(model, GRULanguageModel) and model.rnn.hidden_size == 32
    assert model(x_train[:3]).shape == (3, x_train.shape[1], 256)


def test_text_models_refuse_dropout():
    with pytest.raises(ValueError, match="dropout"):
        make_workload("gru", 32, seed=0, dropout=0.1)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("options", [
    dict(model="resnet", hidden=128, optimizer="sgd", lr=0.05, global_batch=64),
    dict(model="gru", hidden=32, optimizer="adamw", lr=3e-3, global_batch=32),
])
def test_new_models_train_under_the_sparse_hook(options):
    record = run_training(TrainConfig(hook="sparse", hook_settings=dict(density=0.1),
                                      epochs=1, max_steps=20, **options))
    assert record["ranks_identical"] and record["steps"] == 20
    first, last = record["history"]["loss"][0], record["history"]["loss"][-1]
    assert last < first
