"""``exclude_frozen_parameters=True``: checkpoints of a LoRA model hold the trainable parameters, their optimizer
state and the trainer state only; resumed onto a model that holds the same frozen base, training goes on bitwise as
the uninterrupted run (stages 1, 2 and 3 under the Trainer, stage 3 under Fabric, 2 ranks); a checkpoint that lacks
a trainable parameter is still refused; the directory is at most 4x the trainable bytes, plus 5%.

Stages 1 and 2 keep the frozen parameters whole on every rank, stage 3 shards those of each block with the block's
unit (``zero/frozen.py``) and keeps the embedding's and the head's whole: both kinds are left out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.checkpoint.checkpointer import open_checkpoint
from lightning_zeroq.checkpoint.engine_io import FROZEN_EXCLUDED
from lightning_zeroq.checkpoint.store import MANIFEST_FILE, MODEL_KEY, OPTIMIZER_KEY
from lightning_zeroq.ranks import LOCAL
from tests.models import LoraModel, TokenDataset, make_batch

pytestmark = pytest.mark.launch

GLOBAL_BATCH, STEPS_PER_EPOCH = 4, 3
KINDS = {
    1: {"stage": 1, "reduce_bucket_size": 300},
    2: {"stage": 2, "reduce_bucket_size": 300},
    3: {"stage": 3, "stage3_param_persistence_threshold": 0},  # every unit gathered and freed
}


def _lora_lit(dim: int, blocks: int, rank: int):
    import lightning as L

    class LoraLit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LoraModel(dim, blocks, rank)
            self.losses: list[Tensor] = []

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            loss = self.model.loss((tokens, targets, False))
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LoraLit()


def _fit(kind: dict, epochs: int, *, exclude: bool = True, ckpt_path=None, save_to=None, dim: int = 32,
         blocks: int = 3, rank: int = 4, zero_trainable: bool = False, unfreeze: tuple[str, ...] = (), extra: bool = False) -> dict:
    """One fit of a LoRA LightningModule, every rank starting from the same base (seed 7). ``zero_trainable``: the
    trainable factors zeroed before the fit (a resumed fit must take them from the checkpoint); ``unfreeze``: these
    frozen parameters made trainable; ``extra``: one more trainable parameter than the checkpoint has."""
    import lightning as L
    from lightning_zeroq import ZeroQStrategy

    world = dist.get_world_size()
    torch.manual_seed(7)
    module = _lora_lit(dim, blocks, rank)
    for name, p in module.named_parameters():
        if name in unfreeze:
            p.requires_grad_(True)
        elif zero_trainable and p.requires_grad:
            p.data.zero_()
    if extra:
        module.model.extra = torch.nn.Parameter(torch.zeros(3))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=ZeroQStrategy(exclude_frozen_parameters=exclude, **kind))
    data = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH), batch_size=GLOBAL_BATCH // world)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    frozen = trainer.strategy.engine.parts.frozen
    return {"losses": torch.stack(module.losses) if module.losses else torch.empty(0),
            "weights": trainer.strategy.full_state_dict(),
            "sharded_frozen": len(frozen.units) if frozen is not None else 0,
            "frozen": [n for n, p in module.named_parameters() if not p.requires_grad],
            "trainable": [n for n, p in module.named_parameters() if p.requires_grad]}


def _resume(kind: dict, tmp: str) -> dict:
    ckpt = os.path.join(tmp, "epoch1.ckpt")
    whole = _fit(kind, 2)
    first = _fit(kind, 1, save_to=ckpt)
    second = _fit(kind, 2, ckpt_path=ckpt, zero_trainable=True)
    return {"whole": whole, "first": first, "second": second, "ckpt": ckpt}


def _stored(ckpt: str) -> tuple[set[str], dict]:
    """The checkpoint's model and optimizer keys, and its manifest's ``extra``."""
    opened = open_checkpoint(Path(ckpt), LOCAL)
    try:
        keys = set(opened.keys())
    finally:
        opened.close()
    return keys, json.loads((Path(ckpt) / MANIFEST_FILE).read_text())["extra"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_without_the_frozen_base_continues_bitwise(dist_pool, tmp_path, stage):
    results = dist_pool(2).run(_resume, KINDS[stage], str(tmp_path))
    for rank, r in enumerate(results):
        whole, first, second = r["whole"], r["first"], r["second"]
        assert len(whole["losses"]) == 2 * STEPS_PER_EPOCH and len(second["losses"]) == STEPS_PER_EPOCH
        assert torch.equal(torch.cat([first["losses"], second["losses"]]), whole["losses"]), rank
        assert whole["weights"].keys() == second["weights"].keys()
        for name, value in whole["weights"].items():
            assert torch.equal(second["weights"][name], value), (rank, name)
        if stage == 3:  # the blocks' frozen parts and the embedding's and head's, sharded on their own
            assert whole["sharded_frozen"] == 5, whole["sharded_frozen"]
    keys, extra = _stored(results[0]["ckpt"])
    frozen, trainable = results[0]["whole"]["frozen"], results[0]["whole"]["trainable"]
    assert any(n.startswith("model.blocks.") for n in frozen) and "model.head.weight" in frozen
    assert extra[FROZEN_EXCLUDED] == frozen
    model = {k[len(MODEL_KEY) + 1:] for k in keys if k.startswith(MODEL_KEY + ".")}
    assert model == set(trainable), sorted(model ^ set(trainable))
    state = {k for k in keys if k.startswith(f"{OPTIMIZER_KEY}.state.")}
    assert {f"{OPTIMIZER_KEY}.state.{n}.{s}" for n in trainable for s in ("exp_avg", "exp_avg_sq", "step")} == state


def _refusals(kind: dict, tmp: str) -> list[str]:
    ckpt = os.path.join(tmp, "epoch1.ckpt")
    _fit(kind, 1, save_to=ckpt)
    said = []
    # A parameter frozen when it was saved (so left out) that this model trains: its values are not there.
    with pytest.raises(CheckpointError) as info:
        _fit(kind, 2, ckpt_path=ckpt, unfreeze=("model.head.weight",))
    said.append(str(info.value))
    # A trainable parameter the checkpoint lacks: refused as without exclude_frozen_parameters.
    with pytest.raises(CheckpointError) as info:
        _fit(kind, 2, ckpt_path=ckpt, extra=True)
    said.append(str(info.value))
    return said


def test_a_checkpoint_without_a_trainable_parameter_is_refused(dist_pool, tmp_path):
    for unfrozen, extra in dist_pool(2).run(_refusals, KINDS[3], str(tmp_path)):
        assert "exclude_frozen_parameters=True" in unfrozen and "'model.head.weight'" in unfrozen, unfrozen
        assert "trainable in this model" in unfrozen and "requires_grad=False" in unfrozen, unfrozen
        assert "entry of the model are not in" in extra and "'model.extra'" in extra, extra


def _fabric_run(tmp: str, steps: range, *, load: bool = False, save: bool = False) -> dict:
    import lightning as L
    from lightning_zeroq import ZeroQFabricStrategy

    ckpt = os.path.join(tmp, "fabric.ckpt")
    strategy = ZeroQFabricStrategy(exclude_frozen_parameters=True, **KINDS[3])
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    torch.manual_seed(7)
    model = LoraModel()
    if load:
        for p in model.parameters():
            if p.requires_grad:
                p.data.zero_()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load:
        fabric.load(ckpt, state)
        assert state["step"] == steps.start, state["step"]
    losses = []
    for step in steps:
        loss = model.loss(make_batch(step, 0, dist.get_rank(), uniform=True))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    if save:
        fabric.save(ckpt, {**state, "step": steps.stop})
    return {"losses": torch.stack(losses), "weights": fabric.strategy.full_state_dict()}


def _fabric_resume(tmp: str) -> dict:
    whole = _fabric_run(tmp, range(0, 6))
    first = _fabric_run(tmp, range(0, 3), save=True)
    second = _fabric_run(tmp, range(3, 6), load=True)
    return {"whole": whole, "first": first, "second": second}


def test_fabric_resume_without_the_frozen_base_continues_bitwise(dist_pool, tmp_path):
    for r in dist_pool(2).run(_fabric_resume, str(tmp_path)):
        assert torch.equal(torch.cat([r["first"]["losses"], r["second"]["losses"]]), r["whole"]["losses"])
        for name, value in r["whole"]["weights"].items():
            assert torch.equal(r["second"]["weights"][name], value), name
    keys, extra = _stored(str(tmp_path / "fabric.ckpt"))
    frozen = {n for n, p in LoraModel().named_parameters() if not p.requires_grad}
    assert set(extra[FROZEN_EXCLUDED]) == frozen
    assert not any(k[len(MODEL_KEY) + 1:] in frozen for k in keys if k.startswith(MODEL_KEY + "."))


def disk_usage(path: Path) -> tuple[int, int]:
    """A directory's bytes as ``du`` counts them: (apparent: ``du -sb``, allocated on disk: ``du -sB1``)."""
    apparent = allocated = 0
    for entry in [path, *path.rglob("*")]:
        st = entry.lstat()
        apparent, allocated = apparent + st.st_size, allocated + st.st_blocks * 512
    return apparent, allocated


SIZE = {"dim": 256, "blocks": 4, "rank": 32}
"""LoRA factors of 8K-16K elements (a rank-16 adapter of a 4096-wide model has 64K): each stored chunk costs about a
kilobyte beside its data (DCP's ``torch.save`` record, its metadata and checksum), which factors of a few hundred
elements (rank 4 here) would not amortize."""


def _save_both(kind: dict, tmp: str) -> None:
    for exclude in (True, False):
        _fit(kind, 1, exclude=exclude, save_to=os.path.join(tmp, f"exclude-{exclude}"), **SIZE)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_adapters_only_checkpoint_is_at_most_four_times_the_trainable_bytes(dist_pool, tmp_path, stage):
    dist_pool(2).run(_save_both, KINDS[stage], str(tmp_path))
    model = LoraModel(**SIZE)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    apparent, allocated = disk_usage(tmp_path / "exclude-True")
    whole = disk_usage(tmp_path / "exclude-False")
    print(f"stage {stage}: trainable {trainable} B, frozen {frozen} B; exclude_frozen_parameters=True: {apparent} B "
          f"apparent, {allocated} B allocated ({allocated / trainable:.2f}x the trainable bytes); False: {whole[0]} B "
          f"apparent, {whole[1]} B allocated")
    assert 3 * trainable < apparent and max(apparent, allocated) <= 4 * trainable * 1.05
    assert whole[0] > apparent + frozen  # the whole checkpoint holds the base
