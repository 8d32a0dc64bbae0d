"""A small GPT-style language model as a LightningModule, the model the Hydra recipes train.

Shape: token embedding + learned position embedding, ``n_layer`` pre-norm transformer blocks
(LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual), a final LayerNorm and
a linear head over the vocabulary, optionally tied to the token embedding (the strategy handles tied
parameters). Attention is ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``,
so the fused kernels are used wherever torch has them.

Initialization follows GPT-2: normal(0, ``init_std``) for weights, residual output projections scaled
by ``1/sqrt(2 * n_layer)`` so the residual stream does not grow with depth.

Optimization: AdamW with weight decay on matrices only (two param groups), linear warm-up then cosine
decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``, stepped every optimizer step. AdamW's update
is elementwise, so ``ZeroQStrategy`` can shard it.

The configs are kw-only dataclasses validated in ``__post_init__`` (``ValueError`` naming field, value and
fix); ``lightning_zeroq.cli`` registers them as Hydra schemas. This module does not import Hydra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zeroq.validation import check_int


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of the GPT."""

    vocab_size: int = 256
    """Number of token ids (256 for the byte-level tokenizer of ``lightning_zeroq.data``)."""

    block_size: int = 128
    """Longest sequence the model accepts (rows of the position embedding)."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream."""

    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``n_embd``."""

    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 keeps runs bitwise reproducible)."""

    tie_embeddings: bool = True
    """Share the output head's weight with the token embedding."""

    init_std: float = 0.02
    """Standard deviation of the normal initialization of weights."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            check_int("GPTConfig", name, getattr(self, name), 1)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_head among the divisors of n_embd."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1).")
        if not self.init_std > 0.0:
            raise ValueError(f"GPTConfig.init_std={self.init_std!r} must be positive.")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-3
    """Peak learning rate."""

    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases or embeddings)."""

    beta1: float = 0.9
    """AdamW's first-moment decay."""

    beta2: float = 0.95
    """AdamW's second-moment decay."""

    warmup_steps: int = 20
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""

    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``min_lr_ratio * lr`` on the last step."""

    def __post_init__(self) -> None:
        if not self.lr > 0.0:
            raise ValueError(f"OptimConfig.lr={self.lr!r} must be positive.")
        if self.weight_decay < 0.0:
            raise ValueError(f"OptimConfig.weight_decay={self.weight_decay!r} must be >= 0.")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OptimConfig.{name}={getattr(self, name)!r} must be in [0, 1).")
        check_int("OptimConfig", "warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1].")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, head, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(L.LightningModule):
    """The GPT of ``GPTConfig`` trained with next-token cross-entropy and ``OptimConfig``'s AdamW.

    ``training_step`` takes a ``(batch, seq_len + 1)`` tensor of token ids: inputs are all but the last
    token, targets all but the first.
    """

    def __init__(self, model: GPTConfig, optim: OptimConfig) -> None:
        super().__init__()
        self.cfg, self.optim_cfg = model, optim
        self.tok_emb = nn.Embedding(model.vocab_size, model.n_embd)
        self.pos_emb = nn.Embedding(model.block_size, model.n_embd)
        self.drop = nn.Dropout(model.dropout)
        self.blocks = nn.ModuleList(Block(model) for _ in range(model.n_layer))
        self.ln_f = nn.LayerNorm(model.n_embd)
        self.head = nn.Linear(model.n_embd, model.vocab_size, bias=False)
        if model.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.startswith("ln") or ".ln_" in name:
                nn.init.ones_(param)
            else:
                std = residual_std if name.endswith("proj.weight") else self.cfg.init_std
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        seq = idx.shape[1]
        if seq > self.cfg.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.block_size={self.cfg.block_size}; "
                "raise model.block_size or shorten data.seq_len."
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        embeddings = {id(self.tok_emb.weight), id(self.pos_emb.weight)}
        trainable = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2 and id(p) not in embeddings]
        no_decay = [p for p in trainable if p.dim() < 2 or id(p) in embeddings]
        cfg = self.optim_cfg
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
        )
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        total = max(int(total), 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step``: linear warm-up, then cosine decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
