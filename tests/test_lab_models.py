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


def test_cnn_with_batch_norm_classifies_flat_digits():
    model = make_model(64, "cnn_bn")
    assert "cnn_bn" in DIGITS_MODELS
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.randn(5, 64)).shape == (5, 10)


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.25, 0.5, 0.75, 1.0] + [1.0] * 10),
    # (as the cosine, they would reach 0 one step after the last)
    ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]),
    # stable until the last fifth of the 10 steps after the warm-up, then linear towards 0
    ("wsd", [0.25, 0.5, 0.75, 1.0] + [1.0] * 9 + [0.5]),
    ("step", [0.25, 0.5, 0.75, 1.0] + [1.0] * 5 + [0.1] * 3 + [0.01] * 2),
])
def test_schedules_rise_over_the_warm_up_then_follow_their_shape(schedule, expected):
    factor = TrainConfig(lr_schedule=schedule, lr_warmup_steps=4).lr_factor(14)
    assert [round(factor(step), 6) for step in range(14)] == pytest.approx(expected)


def test_adam_is_torchs_adam_with_decoupled_decay():
    config = TrainConfig(optimizer="adam", weight_decay=0.01, lr=1e-3)
    config.validate()
    optimizer, _ = config.make_optimizer([torch.nn.Parameter(torch.zeros(3))], 10)
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.param_groups[0]["decoupled_weight_decay"] is True
