"""The workloads the demo, benchmarks and tests train: the digits data set (scikit-learn's:
1,797 8x8 images, 10 classes, shipped with the package) with small MLPs and CNNs, and bytes of
real text with a small transformer (:mod:`~hetero_comm.lab.text`). Nothing is downloaded."""

from typing import Tuple

import torch
import torch.nn as nn

from .text import TinyGPT, load_text_split

__all__ = ["MODELS", "DIGITS_MODELS", "load_digits_split", "make_model", "make_workload"]

DIGITS_MODELS = ("mlp", "cnn", "cnn_wide")
MODELS = DIGITS_MODELS + ("gpt",)  # gpt: the text workload


def make_workload(model: str, hidden: int, seed: int, dropout: float = 0.0):
    """``(x_train, y_train, x_test, y_test, module)`` for ``model``: the digits for the digit
    models, text windows for ``"gpt"`` (``hidden`` is its width). Targets are class or byte
    indices: the loss is the cross-entropy of the logits' last dimension either way.
    ``dropout``: see :func:`make_model`."""
    if model == "gpt":
        return (*load_text_split(), TinyGPT(width=hidden))
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
    all in that layer), for slow links, where its steps are bound by the gradient exchange."""
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
    raise ValueError(f"kind must be one of {DIGITS_MODELS}; got {kind!r}")
