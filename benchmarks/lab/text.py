"""A byte-level language-model workload on real English text that ships with Python itself:
the reference topics of the ``pydoc`` help system (``pydoc_data.topics``, about 470 KB), so
nothing is downloaded. The models: a small causal transformer (GPT-style, pre-norm) and a GRU
(:data:`TEXT_MODELS`)."""

from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn

__all__ = ["load_text_split", "TinyGPT", "GRULanguageModel", "TEXT_MODELS"]

VOCAB = 256  # bytes


def load_text_split(context: int = 64, validation_share: float = 0.1
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``context + 1`` bytes: inputs are the first ``context``
    bytes, targets the same shifted by one. The last ``validation_share`` of the text (in
    sorted topic order) is held out.

    Returns:
        x_train, y_train, x_val, y_val: int64 [windows, context].
    """
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)
    split = int(len(data) * (1 - validation_share))

    def windows(part: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        count = (len(part) - 1) // context
        chunks = part[: count * context + 1]
        x = chunks[:-1].view(count, context)
        y = chunks[1:].view(count, context)
        return x, y

    return (*windows(data[:split]), *windows(data[split:]))


class TinyGPT(nn.Module):
    """Causal transformer over bytes: ``width``-wide embeddings and learnt positions,
    ``layers`` pre-norm blocks of ``heads``-head attention and a 4x MLP, a tied output layer.
    Returns logits [batch, context, 256]."""

    def __init__(self, width: int = 128, layers: int = 4, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.position[:length]
        h = self.blocks(h, mask=self.causal[:length, :length], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


class GRULanguageModel(nn.Module):
    """Recurrent byte-level language model: ``width``-wide byte embeddings, ``layers`` layers
    of :class:`torch.nn.GRU` of ``width`` units, and a linear layer to the 256 bytes' logits.
    Returns logits [batch, context, 256]."""

    def __init__(self, width: int = 128, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, layers, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.head(h)


# The text workload's models by name, each built from its width.
TEXT_MODELS: Dict[str, Callable[..., nn.Module]] = {"gpt": TinyGPT, "gru": GRULanguageModel}
