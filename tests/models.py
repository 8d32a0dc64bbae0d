"""Tiny models and data shared by the tests, with every feature real models have."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, DIM, SEQ = 32, 16, 6


class RichModel(nn.Module):
    """Tied embedding/head, a block used twice, a frozen layer, a layer used only on some steps, a
    layer never used, a buffer, and a LayerNorm (a small parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(DIM, DIM)
        self.never = nn.Linear(DIM, 3)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM))

    def forward(self, tokens: Tensor, use_sometimes: bool = False) -> Tensor:
        h = self.embed(tokens)
        h = self.block(h)
        h = self.block(h)
        h = h + self.frozen(h)
        if use_sometimes:
            h = h + self.sometimes(h)
        h = self.norm(h) * self.gain
        return self.head(h)

    def loss(self, batch: tuple[Tensor, Tensor, bool]) -> Tensor:
        tokens, targets, use_sometimes = batch
        logits = self(tokens, use_sometimes)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def make_batch(step: int, micro: int, rank: int, batch_size: int = 4) -> tuple[Tensor, Tensor, bool]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    # "sometimes" is used by some ranks on some micro-batches, and by none on step 1.
    use_sometimes = step != 1 and (step + micro + rank) % 3 == 0
    return tokens, targets, use_sometimes


def param_groups(model: nn.Module, adam: bool = True) -> list[dict]:
    first = [*model.embed.parameters(), *model.block.parameters()]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids and p.requires_grad]
    return [
        {"params": first, "lr": 2e-2, "weight_decay": 0.1},
        {"params": rest, "lr": 1e-2, "weight_decay": 0.0},
    ]
