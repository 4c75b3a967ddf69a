"""The workloads the demo, benchmarks and tests train: the digits data set (scikit-learn's:
1,797 8x8 images, 10 classes, shipped with the package) with small MLPs, CNNs and a residual
CNN, and bytes of real text with a small transformer or a GRU (:mod:`~lab.text`).
Nothing is downloaded."""

from typing import Tuple

import torch
import torch.nn as nn

from .text import TEXT_MODELS, load_text_split

__all__ = ["MODELS", "DIGITS_MODELS", "DigitsResNet", "load_digits_split", "make_model", "make_workload"]

DIGITS_MODELS = ("mlp", "cnn", "cnn_wide", "cnn_bn", "resnet")
MODELS = DIGITS_MODELS + tuple(TEXT_MODELS)  # the text workload's models


def make_workload(model: str, hidden: int, seed: int, dropout: float = 0.0):
    """``(x_train, y_train, x_test, y_test, module)`` for ``model``: the digits for the digit
    models, text windows for the text models (``"gpt"``, ``"gru"``: ``hidden`` is their
    width). Targets are class or byte indices: the loss is the cross-entropy of the logits'
    last dimension either way. ``dropout``: see :func:`make_model`."""
    if model in TEXT_MODELS:
        if dropout:
            raise ValueError(f"dropout is for the 'mlp' model; got model={model!r}")
        return (*load_text_split(), TEXT_MODELS[model](width=hidden))
    return (*load_digits_split(seed), make_model(hidden, model, dropout))


def load_digits_split(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits: 1,437 training and 360 test images (a fixed shuffled split)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = len(x) - 360
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return x[:split], y[:split], x[split:], y[split:]


def make_model(hidden: int = 256, kind: str = "mlp", dropout: float = 0.0) -> nn.Module:
    """``"mlp"`` (the default model): 64 -> hidden -> hidden -> 10, with ``nn.Dropout(dropout)``
    after each hidden activation when ``dropout`` > 0 (the MLP only). ``"cnn"``: three 3x3
    convolutions (``hidden // 8``, ``hidden // 4``, ``hidden // 4`` channels) over the 8x8 image
    and a linear classifier; many more operations per parameter, so its steps are bound by
    compute, not by the gradient exchange. ``"cnn_wide"``: two 3x3 convolutions (32, 64
    channels) and a fully connected layer of ``hidden`` units (4.2M parameters at 1024, nearly
    all in that layer), for slow links, where its steps are bound by the gradient exchange.
    ``"cnn_bn"``: two 3x3 convolutions (``hidden // 8``, ``hidden // 4`` channels), each followed
    by BatchNorm, a 2x2 pooling and a linear classifier (DDP broadcasts rank 0's running
    statistics at every step). ``"resnet"``: :class:`DigitsResNet` with ``width=hidden // 16``
    (38K parameters at 256)."""
    if dropout and kind != "mlp":
        raise ValueError(f"dropout is for the 'mlp' model; got kind={kind!r}")
    if kind == "mlp":
        drop = (lambda: [nn.Dropout(dropout)]) if dropout else (lambda: [])
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), *drop(), nn.Linear(hidden, hidden),
                             nn.ReLU(), *drop(), nn.Linear(hidden, 10))
    if kind == "cnn_wide":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(64 * 64, hidden), nn.ReLU(),
                             nn.Linear(hidden, 10))
    if kind == "cnn":
        c1, c2 = max(1, hidden // 8), max(1, hidden // 4)
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c2, c2, 3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(c2 * 64, 10))
    if kind == "cnn_bn":
        c1, c2 = max(1, hidden // 8), max(1, hidden // 4)
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c2 * 16, 10))
    if kind == "resnet":
        return DigitsResNet(width=max(1, hidden // 16))
    raise ValueError(f"kind must be one of {DIGITS_MODELS}; got {kind!r}")


def _norm(channels: int) -> nn.GroupNorm:
    # GroupNorm, not BatchNorm: no running statistics, so DDP has no buffers to broadcast and
    # every byte counted is the gradient's.
    return nn.GroupNorm(4 if channels % 4 == 0 else 1, channels)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions, each normalised, added to the input (through a strided 1x1
    convolution when the block changes the channels or the resolution), then ReLU."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
            _norm(channels_out), nn.ReLU(),
            nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False), _norm(channels_out))
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                _norm(channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class DigitsResNet(nn.Module):
    """A small residual CNN on the 8x8 digits: a 3x3 stem of ``width`` channels, a residual
    block at 8x8, one to ``2 * width`` channels at 4x4 and another there, global average
    pooling and a linear classifier (38K parameters at width 16). Takes the flat 64 pixels."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), _norm(width),
                                  nn.ReLU())
        self.blocks = nn.Sequential(ResidualBlock(width, width),
                                    ResidualBlock(width, 2 * width, stride=2),
                                    ResidualBlock(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x.view(-1, 1, 8, 8)))
        return self.head(h.mean(dim=(2, 3)))
