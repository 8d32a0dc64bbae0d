"""A GPT-style language model: ``GPT``, the LightningModule the Hydra recipes train, and ``GPTModel``, the
same network as a plain ``nn.Module`` (the benchmarks wrap it in DDP, FSDP2, DeepSpeed or ZeroQ).

Shape: token embedding + learned position embedding, ``n_layer`` pre-norm transformer blocks
(norm -> causal self-attention -> residual, norm -> MLP -> residual), a final norm and a linear head
over the vocabulary, optionally tied to the token embedding (the strategy handles tied parameters).
Attention is ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``, so the fused
kernels are used wherever torch has them. The defaults are GPT-2's (LayerNorm, GELU MLP, biases, learned
positions, tied head); ``norm="rmsnorm"``, ``mlp="swiglu"``, ``bias=False``, ``learned_positions=False``
and ``tie_embeddings=False`` give the Llama-like blocks of the step-time benchmarks.

Initialization follows GPT-2 (``init="gpt2"``): normal(0, ``init_std``) for weights, residual output
projections scaled by ``1/sqrt(2 * n_layer)`` so the residual stream does not grow with depth;
``init="torch"`` keeps the layers' own initialization.

Optimization: AdamW with weight decay on matrices only (two param groups), linear warm-up then cosine
decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``, stepped every optimizer step. AdamW's update
is elementwise, so ``ZeroQStrategy`` can shard it.

The configs are kw-only dataclasses validated in ``__post_init__`` (``ValueError`` naming field, value and
fix); ``lightning_zeroq.cli`` registers them as Hydra schemas. This module does not import Hydra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn

from lightning_zeroq.validation import check_bool, check_choice, check_int


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of the GPT."""

    vocab_size: int = 256
    """Number of token ids (256 for the byte-level tokenizer of ``lightning_zeroq.cli.data``)."""

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
    """Standard deviation of the normal initialization of weights (``init="gpt2"``)."""

    ffn_hidden: int = 0
    """Hidden width of the MLP; 0: ``mlp_ratio * n_embd``."""

    norm: str = "layernorm"
    """``layernorm`` (with a bias when ``bias``) or ``rmsnorm``."""

    mlp: str = "gelu"
    """``gelu`` (one hidden projection) or ``swiglu`` (gate and up projections, SiLU gate)."""

    bias: bool = True
    """Biases in the linear layers and LayerNorms."""

    learned_positions: bool = True
    """A learned position embedding of ``block_size`` rows; without it the model has no position input
    besides causal attention and accepts any sequence length."""

    init: str = "gpt2"
    """``gpt2`` (see the module docstring) or ``torch`` (each layer's default initialization)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            check_int("GPTConfig", name, getattr(self, name), 1)
        check_int("GPTConfig", "ffn_hidden", self.ffn_hidden, 0)
        check_choice("GPTConfig", "norm", self.norm, ("layernorm", "rmsnorm"))
        check_choice("GPTConfig", "mlp", self.mlp, ("gelu", "swiglu"))
        check_choice("GPTConfig", "init", self.init, ("gpt2", "torch"))
        for name in ("bias", "learned_positions", "tie_embeddings"):
            check_bool("GPTConfig", name, getattr(self, name))
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


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd)
    return nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


def _dropout(cfg: GPTConfig) -> nn.Module:
    return nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = _dropout(cfg)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, head, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """``gelu``: proj(gelu(fc(x))); ``swiglu``: fc gives gate and up, proj(silu(gate) * up)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_hidden or cfg.mlp_ratio * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        self.fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = _dropout(cfg)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.dropout(self.proj(F.silu(gate) * up))
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def add_layers(module: Any, cfg: GPTConfig) -> None:
    """The GPT's layers as attributes of ``module`` (``GPTModel`` or the LightningModule ``GPT``), initialized."""
    module.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
    if cfg.learned_positions:
        module.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
    module.drop = _dropout(cfg)
    module.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
    module.ln_f = _norm(cfg)
    module.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
    if cfg.tie_embeddings:
        module.head.weight = module.tok_emb.weight
    if cfg.init == "gpt2":
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.startswith("ln") or ".ln_" in name:
                nn.init.ones_(param)
            else:
                std = residual_std if name.endswith("proj.weight") else cfg.init_std
                nn.init.normal_(param, mean=0.0, std=std)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) plus trainable low-rank factors: ``base(x) + (alpha / rank) B A x``,
    with ``A`` drawn as Kaiming's uniform and ``B`` zero, so the model starts as the base (LoRA, Hu et al.)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.scaling = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The factors' initial values (the base keeps its own ``reset_parameters``): also what stage 3 runs
        when it materializes a model built on the meta device."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scaling * F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Freeze ``model`` and wrap every ``nn.Linear`` inside its blocks in a ``LoRALinear`` (the parameter names
    become ``blocks.0.attn.qkv.base.weight``, ``...qkv.lora_a``): only the factors train."""
    check_int("add_lora", "rank", rank, 1)
    model.requires_grad_(False)
    blocks: Any = model.blocks
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank, alpha))
    return model


def logits(module: Any, cfg: GPTConfig, idx: Tensor) -> Tensor:
    """The forward pass of the layers ``add_layers`` put on ``module``: logits for token ids ``idx``."""
    x = module.tok_emb(idx)
    if cfg.learned_positions:
        seq = idx.shape[1]
        if seq > cfg.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds GPTConfig.block_size={cfg.block_size}; "
                "raise model.block_size or shorten data.seq_len."
            )
        x = x + module.pos_emb(torch.arange(seq, device=idx.device))
    x = module.drop(x)
    for block in module.blocks:
        x = block(x)
    return module.head(module.ln_f(x))


class GPTModel(nn.Module):
    """The GPT of ``GPTConfig`` as a plain ``nn.Module``: token ids in, logits out."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        add_layers(self, cfg)

    def forward(self, idx: Tensor) -> Tensor:
        return logits(self, self.cfg, idx)


class GPT(L.LightningModule):
    """The GPT of ``GPTConfig`` trained with next-token cross-entropy and ``OptimConfig``'s AdamW.

    ``training_step`` takes a ``(batch, seq_len + 1)`` tensor of token ids: inputs are all but the last
    token, targets all but the first.
    """

    def __init__(self, model: GPTConfig, optim: OptimConfig) -> None:
        super().__init__()
        self.cfg, self.optim_cfg = model, optim
        add_layers(self, model)

    def forward(self, idx: Tensor) -> Tensor:
        return logits(self, self.cfg, idx)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
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
