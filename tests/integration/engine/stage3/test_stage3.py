"""Stage 3 specifics: units freed between uses, changing control flow, meta-device construction,
evaluation and checkpoints through the Trainer."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.reducer import Reducer
from lightning_zeroq.zero.unit import UnitState
from tests.models import DIM, SEQ, VOCAB, MostGathered

ORDERS = [[0, 1, 2], [0, 1, 2], [2, 0, 1], [0, 2], [1, 2, 0], [0, 1, 2], [2], [0, 1, 2]]


class PathModel(nn.Module):
    """Three blocks run in an order that changes from step to step (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = self.embed(tokens)
        for i in order:
            h = h + self.blocks[i](h)
        return self.head(h)


def _loss(model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(next(model.parameters()).device)
    logits = model(tokens, ORDERS[step % len(ORDERS)])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


def _path_body(prefetch: bool, device: str = "cpu") -> int:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    model = PathModel().to(dev)
    ref = DistributedDataParallel(copy.deepcopy(model), device_ids=[dev.index] if dev.type == "cuda" else None,
                                  find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=100, stage3_prefetch=prefetch))
    transient = [u for u in engine.parts.units if not u.persistent]
    assert [u.module for u in transient] == list(model.blocks)  # found automatically
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    gathered = MostGathered(model.blocks, transient)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(len(ORDERS)):
            engine.backward(_loss(model, step, rank))
            engine.clip_grad_norm_(1.0)
            engine.step()
            _loss(ref, step, rank).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            assert all(u.state is UnitState.SHARDED for u in transient), "units must be freed after the step"
            assert all(u.flat.untyped_storage().nbytes() == 0 for u in transient)
            full = engine.full_state_dict()
            for name, p in ref.module.named_parameters():
                assert (full[name] - p.detach().cpu()).abs().max() < 1e-5, (step, name)
    assert gathered.most <= (2 if prefetch else 1)  # the unit in use plus at most one prefetched
    path_warnings = [w for w in caught if "different path" in str(w.message)]
    assert len(path_warnings) == (1 if prefetch else 0)  # a warning at most, once, never an error
    with torch.no_grad():  # evaluation: gathers and frees without backward
        _loss(model, 0, rank)
    assert sum(u.state is not UnitState.SHARDED for u in transient) <= int(prefetch)  # at most the prefetched next unit
    return gathered.most


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "on-demand"])
def test_changing_control_flow_matches_ddp(dist_pool, world_size, prefetch):
    dist_pool(world_size).run(_path_body, prefetch)


def _make_meta_lit():
    import lightning as L

    class MetaLit(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = PathModel()
                self.built_on = self.model.head.weight.device.type

        def training_step(self, batch, batch_idx):
            return _loss(self.model, batch_idx, self.global_rank)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", _loss(self.model, 0, 0), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self.model(batch[0][:1], [0, 1, 2]).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return MetaLit()


def _trainer(**kw):
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    strategy = ZeroQStrategy(stage=3, stage3_param_persistence_threshold=100)
    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, **kw)


def _meta_body(tmp: str) -> dict:
    from lightning.pytorch.utilities.model_summary import ModelSummary

    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (16, SEQ)), batch_size=2)
    module = _make_meta_lit()
    trainer = _trainer(max_epochs=1, enable_model_summary=False)  # 4 steps: 16 samples, 2 ranks, batch 2
    torch.manual_seed(0)
    trainer.fit(module, data)
    assert module.built_on == "meta"  # configure_model ran under the strategy's sharded context
    full = trainer.strategy.full_state_dict()
    expected_numel = sum(v.numel() for v in full.values())
    assert ModelSummary(module).total_parameters == expected_numel  # true counts, not shard sizes
    gathered = [torch.zeros_like(full["model.head.weight"]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, full["model.head.weight"].contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert all(torch.isfinite(v).all() for v in full.values())
    # evaluation entry points without gradients
    val = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    preds = trainer.predict(module, torch.utils.data.DataLoader(torch.randint(0, VOCAB, (4, SEQ)), batch_size=2))
    assert len(preds) == 1 and all(torch.isfinite(p) for p in preds)  # 2 batches over 2 ranks
    # save at the epoch's end, resume for one more epoch; compare with two epochs in one go
    ckpt = os.path.join(tmp, "s3.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = _trainer(max_epochs=2, enable_model_summary=False)
    resumed.fit(_make_meta_lit(), data, ckpt_path=ckpt)
    straight = _trainer(max_epochs=2, enable_model_summary=False)
    torch.manual_seed(0)
    straight.fit(_make_meta_lit(), data)
    a, b = resumed.strategy.full_state_dict(), straight.strategy.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resuming must continue exactly"
    return {"val": float(val)}


def test_meta_init_eval_summary_and_resume(dist_pool):
    with tempfile.TemporaryDirectory() as tmp:
        dist_pool(2).run(_meta_body, tmp)


def test_a_forward_does_not_prefetch_the_next_steps_first_unit() -> None:
    # The recorded forward order must not wrap from the last unit to the first across a step: that made
    # every forward's last unit prefetch the first unit, held through the loss and the head's backward
    # (where activations peak) and then dropped unused.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Linear"], stage3_param_persistence_threshold=0))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters()))
    transient = [u for u in engine.parts.units if not u.persistent]
    assert len(transient) == 3
    for step in range(3):
        loss = model(torch.randn(4, 8)).square().sum()
        held = [u.index for u in transient if u.state is not UnitState.SHARDED]
        assert held == [], f"step {step}: units {held} are gathered between the forward and the backward"
        engine.backward(loss)
        engine.step()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.linear(h))


class Trunk(nn.Module):
    """An embedding and a head around four blocks: the root unit (embedding and head) completes its
    gradients last in a backward, though its head gets one first. ``head_first``: the head is
    registered first (stage 2's first bucket)."""

    def __init__(self, head_first: bool = False) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(DIM, VOCAB)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*(Block() for _ in range(4)))
        if not head_first:
            self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _reduction_order_body(stage: int, offload: bool) -> list:
    """Per step: for each unit reduced, how many parameters had their gradient by then and how many
    transient units were gathered; and the order the reducer follows after the step."""
    torch.manual_seed(0)
    model = Trunk(head_first=stage == 2)
    options = dict(stage3_wrap_classes=["Block"], stage3_param_persistence_threshold=0) if stage == 3 else \
        dict(reduce_bucket_size=VOCAB * DIM + VOCAB)  # stage 2: the head is one bucket, the embedding another
    events, fired = [], [0]
    ready = Reducer._on_grad_ready

    def spy_ready(self, param):
        fired[0] += 1
        ready(self, param)

    Reducer._on_grad_ready = spy_ready  # type: ignore[method-assign]  # the gradient hooks bind it when installed
    try:
        engine = ZeroEngine(model, ZeroConfig(stage=stage, offload_optimizer=offload,
                                              offload_parameters=offload and stage == 3, **options))
    finally:
        Reducer._on_grad_ready = ready  # type: ignore[method-assign]
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    reducer = engine.parts.reducer
    reduce = reducer._reduce

    def spy_reduce(unit):
        gathered = sum(u.state is UnitState.GATHERED for u in engine.parts.units if not u.persistent)
        events[-1].append((unit.index, fired[0], gathered))
        reduce(unit)

    reducer._reduce = spy_reduce
    out, rank = [], dist.get_rank()
    for step in range(3):
        events.append([])
        fired[0] = 0
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step * 10 + rank))
        engine.backward(F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1)), boundary=True)
        engine.step()
        engine.zero_grad()
        out.append((events[-1], [u.index for u in reducer._order]))
    names = {id(p): n for n, p in model.named_parameters()}
    units = [[names[id(p)] for p in u.params] for u in engine.parts.units]
    engine.close()
    return out, units, reducer.num_params


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_stage3_reduces_each_unit_as_its_gradients_complete_from_the_first_backward(dist_pool, offload):
    """Stage 3 reduces in the reverse of the forward's gathers (the same on every rank) until the first
    step agrees on the order units completed in: each block is reduced (and freed) as soon as its
    gradients are complete, not when the root unit (first in reverse unit order), whose embedding gets
    its gradient last, completes at the backward's end, which held every block gathered again and every
    gradient on the device until then."""
    (steps, units, n), (other, _, _) = dist_pool(2).run(_reduction_order_body, 3, offload)
    root = next(i for i, names in enumerate(units) if "embed.weight" in names)
    assert root == 4 and [order for _, order in steps] == [order for _, order in other]  # every rank alike
    for events, order in steps:
        assert order == [3, 2, 1, 0, root] and [i for i, _, _ in events] == order
        assert all(fired < n for i, fired, _ in events if i != root)  # each block as its gradients complete
        assert max(gathered for _, _, gathered in events) <= 2  # the block just finished and one prefetched


def test_the_first_step_agrees_on_the_order_units_complete_in(dist_pool):
    """Stage 2, the head registered first (unit 0, last in reverse unit order, though its gradient comes
    first): the first backward holds the head's reduction until the embedding's gradient, the last,
    arrives; the first step agrees (rank 0's order, the same on every rank) and later backwards reduce
    the head first, as soon as its gradients are there."""
    (steps, units, n), (other, _, _) = dist_pool(2).run(_reduction_order_body, 2, False)
    head = next(i for i, names in enumerate(units) if "head.weight" in names)
    assert head == 0 and [order for _, order in steps] == [order for _, order in other]
    first, agreed = steps[0]
    assert [i for i, _, _ in first] == list(reversed(range(len(units))))  # reverse unit order ...
    assert [fired for i, fired, _ in first if i == head] == [n]  # ... held the head until the last gradient
    assert agreed[0] == head and sorted(agreed) == list(range(len(units)))
    for events, order in steps[1:]:
        assert order == agreed and [i for i, _, _ in events] == agreed
        assert events[0][1] == len(units[head])  # the head as soon as its own gradients are there
