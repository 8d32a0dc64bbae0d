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


def make_batch(
    step: int, micro: int, rank: int, batch_size: int = 4, uniform: bool = False
) -> tuple[Tensor, Tensor, bool]:
    """``uniform``: every rank takes the same path (stage 3 gathers are collectives, so with stage 3,
    as with FSDP and DeepSpeed, all ranks must run the same modules in each forward)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    # "sometimes" is used by some ranks on some micro-batches, and by none on step 1.
    use_sometimes = step != 1 and (step + micro + (0 if uniform else rank)) % 3 == 0
    return tokens, targets, use_sometimes


class MostGathered:
    """Counts, before each forward of ``modules``, how many of the stage-3 ``units`` hold their full
    buffer (in use or prefetched); ``most`` is the largest count seen."""

    def __init__(self, modules, units) -> None:
        self.units, self.most = list(units), 0
        for module in modules:
            module.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        from lightning_zeroq.zero.unit import UnitState

        self.most = max(self.most, sum(u.state is not UnitState.SHARDED for u in self.units))


def param_groups(model: nn.Module, adam: bool = True) -> list[dict]:
    first = [*model.embed.parameters(), *model.block.parameters()]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids and p.requires_grad]
    return [
        {"params": first, "lr": 2e-2, "weight_decay": 0.1},
        {"params": rest, "lr": 1e-2, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------- Lightning


def _lightning():
    import lightning as L

    return L


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.targets = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.tokens[i], self.targets[i]


def make_token_lit(net: nn.Module, lr: float = 1e-2):
    """A LightningModule training ``net`` (tokens to logits over ``VOCAB``) with cross-entropy and AdamW at
    ``lr``, keeping every training loss (``losses``)."""
    L = _lightning()

    class TokenLit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = net
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            loss = F.cross_entropy(self.model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return TokenLit()


def make_lit_module(optim: str = "adamw", scheduler: bool = False, manual_backwards: tuple[int, ...] = ()):
    """A LightningModule around ``RichModel``. ``manual_backwards``: manual optimization with that many
    backward passes per step, cycling (each on a slice of the batch)."""
    L = _lightning()

    class RichLit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = RichModel()
            self.automatic_optimization = not manual_backwards
            self.losses: list[float] = []

        def _loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
            # the same on every rank (stage 3 needs all ranks to run the same modules)
            use_sometimes = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready % 3 == 1
            return self.model.loss((tokens, targets, use_sometimes))

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            if self.automatic_optimization:
                loss = self._loss(tokens, targets)
                self.losses.append(float(loss.detach()))
                self.log("loss", loss, sync_dist=True)
                return loss
            opt = self.optimizers()
            n = manual_backwards[batch_idx % len(manual_backwards)]
            for micro in range(n):
                rows = slice(micro % len(tokens), micro % len(tokens) + 1)
                self.manual_backward(self._loss(tokens[rows], targets[rows]) / n)
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            groups = param_groups(self.model)
            opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optim](groups)
            if not scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return RichLit()


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` base plus trainable low-rank factors (LoRA): ``base(x) + (x A^T) B^T``."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim_in) * 0.2)
        self.lora_b = nn.Parameter(torch.randn(dim_out, rank) * 0.2)  # not zero: every factor learns from step 0

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoraBlock(nn.Module):
    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(False)
        self.attn = LoraLinear(dim, dim, rank)
        self.ff = LoraLinear(dim, 2 * dim, rank)
        self.out = nn.Linear(2 * dim, dim)
        self.out.requires_grad_(False)

    def forward(self, h: Tensor) -> Tensor:
        h = h + torch.tanh(self.attn(self.norm(h)))
        return h + self.out(F.gelu(self.ff(h)))


class LoraModel(nn.Module):
    """A fine-tuning model: a frozen embedding and head, blocks whose frozen base carries LoRA factors."""

    def __init__(self, dim: int = 32, blocks: int = 3, rank: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(LoraBlock(dim, rank) for _ in range(blocks))
        self.head = nn.Linear(dim, VOCAB)
        self.head.requires_grad_(False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loss(self, batch: tuple[Tensor, Tensor, bool]) -> Tensor:
        tokens, targets, _ = batch
        return F.cross_entropy(self(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))


def frozen_bytes_at_rest(model: nn.Module, engine) -> tuple[int, int]:
    """(bytes of the frozen parameters' storages this rank holds now, bytes of every frozen parameter whole):
    the storages themselves, each counted once (a stage-3 frozen part's stored shards and whatever storage
    a frozen parameter still points at)."""
    seen: dict[int, int] = {}
    with torch._C.DisableTorchFunctionSubclass():  # a freed stage-3 parameter refuses reads of its storage
        for p in model.parameters():
            if not p.requires_grad:
                storage = p.untyped_storage()
                if storage.nbytes() > p.element_size():  # not a freed parameter's one-element placeholder
                    seen[storage.data_ptr()] = storage.nbytes()
    frozen = engine.parts.frozen
    for part in frozen.units if frozen is not None else []:
        storage = part.master.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return sum(n for ptr, n in seen.items() if ptr != 0), whole


class FrozenTowerModel(LoraModel):
    """``LoraModel`` with a first block that has nothing to train (a frozen tower) and, built with a low
    ``stage3_param_persistence_threshold``, an embedding and a head large enough to be sharded on their own;
    the head sits after trainable blocks, so the backward runs through it."""

    def __init__(self, dim: int = 32, blocks: int = 3) -> None:
        super().__init__(dim, blocks)
        self.blocks[0].requires_grad_(False)
