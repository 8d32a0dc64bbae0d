"""``offload="auto"`` with ``activation_checkpointing_policy="auto"`` under the Trainer and Fabric: the
choice made before the first step from the plan of the module's ``training_step`` on its first batch
stays within the budget, is the plan's fastest fitting configuration, is the same on every rank (each
rank given a different budget: the smallest decides), and trains as DDP does, step by step."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from lightning_zeroq import ZeroConfig
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel
from lightning_zeroq.planning.choose import PLAN_MARGIN, choose
from lightning_zeroq.zero.policies import Host, OnDevice
from tests.integration.lightning.test_parity import _assert_same

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16, ffn_hidden=48, norm="rmsnorm",
                mlp="swiglu", bias=False, learned_positions=False, tie_embeddings=False, init="torch")
BASE = dict(stage=3, stage3_param_persistence_threshold=40, offload="auto", activation_checkpointing_policy="auto")
BATCH = 2


def _lit():
    import lightning as L

    class GPTLit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPTModel(CFG)

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            logits = self.gpt(tokens)
            loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size).float(), targets.reshape(-1))
            self.log("loss", loss)
            return {"loss": loss}

        def validation_step(self, batch, batch_idx):
            tokens, targets = batch
            logits = self.gpt(tokens)
            self.log("val_loss", F.cross_entropy(logits.reshape(-1, CFG.vocab_size).float(), targets.reshape(-1)))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return GPTLit()


def _data(world: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH * 4 * world, CFG.block_size + 1), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


@functools.lru_cache(maxsize=None)
def _planned(world: int = 2) -> list:
    """Every candidate's plan for the module and one batch (no budget to fit)."""
    module, forward = _module_and_forward()
    return list(choose(module, ZeroConfig(**BASE, offload_memory_budget=100), forward, world_size=world).planned)


def _module_and_forward():
    """The module and its loss on the first batch, on the meta device (``self.log`` quiet)."""
    torch.manual_seed(0)
    module = _lit()
    tokens, targets = next(iter(_data(1)))

    def forward(m):
        m.log = lambda *args, **kwargs: None
        try:
            return m.training_step((tokens.to("meta"), targets.to("meta")), 0)["loss"]
        finally:
            del m.log

    return module, forward


def _mixed_budget(planned: list) -> int:
    """A budget only configurations with both some offload and some recomputation fit."""
    plain = [n.device_total for c, n in planned if isinstance(c.optimizer, OnDevice) or c.recompute_share == 0]
    return int(min(plain) * (1 + PLAN_MARGIN)) - 1


def _fit_body(budgets: list[float]) -> tuple:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.integration.lightning.test_parity import _Recorder

    world, rank = dist.get_world_size(), dist.get_rank()
    snaps = {}
    for arm in ("auto", "ddp"):
        torch.manual_seed(0)
        module = _lit()
        recorder = _Recorder()
        strategy = ZeroQStrategy(**BASE, offload_memory_budget=budgets[rank]) if arm == "auto" else "ddp"
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[recorder])
        trainer.fit(module, _data(world))
        snaps[arm] = recorder.snapshots
        if arm == "auto":
            engine = trainer.strategy.engine
            chosen = (engine.config.offload_optimizer, engine.config.offload_parameters,
                      sum(getattr(b, "_zeroq_recomputed", False) for b in module.gpt.blocks))
    _assert_same(snaps["auto"], snaps["ddp"], 1e-5)
    return chosen


def test_the_choice_fits_the_smallest_budget_and_trains_as_ddp(dist_pool):
    planned = _planned()
    budget = _mixed_budget(planned)
    fitting = [(c, n) for c, n in planned if n.device_total * (1 + PLAN_MARGIN) <= budget]
    assert fitting, "the test's model must leave configurations that fit"
    best = min(range(len(fitting)), key=lambda i: (fitting[i][1].step_s, i))
    chosen, need = fitting[best]
    assert need.device_total <= budget and not isinstance(chosen.optimizer, OnDevice) and chosen.recompute_share > 0
    gib = 2**30
    # rank 1 has twice the budget: the smaller one decides, on both ranks alike
    results = dist_pool(2).run(_fit_body, [budget / gib, 2 * budget / gib])
    assert results[0] == results[1], results
    offload, params, recomputing = results[0]
    assert offload and isinstance(chosen.optimizer, Host)
    assert params == (not isinstance(chosen.parameters, OnDevice))
    assert recomputing == round(chosen.recompute_share * CFG.n_layer)


def _fabric_body() -> tuple:
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy

    tokens, targets = next(iter(_data(1)))

    def loss_of(model, x=tokens, y=targets):
        device = next(model.parameters()).device
        logits = model(x.to(device))
        return F.cross_entropy(logits.reshape(-1, CFG.vocab_size).float(), y.to(device).reshape(-1))

    fields = {k: v for k, v in BASE.items()}
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroQFabricStrategy(**fields))
    fabric.launch()
    with pytest.raises(ValueError, match="pass plan_forward="):  # before anything is sharded
        fabric.setup(GPTModel(CFG))
    budget = _mixed_budget(_planned()) / 2**30
    strategy = ZeroQFabricStrategy(**fields, offload_memory_budget=budget,
                                   plan_forward=lambda m: loss_of(m, tokens.to("meta"), targets.to("meta")))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = GPTModel(CFG)
    reference = GPTModel(CFG)
    reference.load_state_dict(model.state_dict())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        loss = loss_of(model)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = loss_of(reference)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    config = strategy.engine.config
    return config.offload_optimizer, sum(getattr(b, "_zeroq_recomputed", False) for b in model.blocks)


def test_fabric_plans_from_plan_forward_and_trains_as_torch(dist_pool):
    offload, recomputing = dist_pool(1).run(_fabric_body)[0]
    assert offload and recomputing > 0


def test_a_configuration_that_cannot_fit_stops_before_launch_naming_the_nearest_that_fits():
    from lightning_zeroq.planning.choose import check_fits

    module, forward = _module_and_forward()
    config = ZeroConfig(stage=3, stage3_param_persistence_threshold=40)
    planned = _planned(world=1)
    plain = next(n for c, n in planned if isinstance(c.optimizer, OnDevice) and c.recompute_share == 0
                 and isinstance(c.parameters, OnDevice))
    check_fits(module, config, forward, device=torch.device("cpu"), param_dtype=torch.float32,
               device_bytes=plain.device_total)  # room for the planned peak: nothing raised
    with pytest.raises(ValueError, match=r"needs about .* of device memory at its peak \(.* of it activations\), "
                                         r"and the GPU has .* free; the fastest that fits: .*recomputing"):
        check_fits(module, config, forward, device=torch.device("cpu"), param_dtype=torch.float32,
                   device_bytes=_mixed_budget(planned))
    with pytest.raises(ValueError, match="no offload or checkpointing setting of stage 3 fits"):
        check_fits(module, config, forward, device=torch.device("cpu"), param_dtype=torch.float32, device_bytes=1000)
    assert all(p.device.type == "cpu" for p in module.parameters())  # the plan put every parameter back


def _validate_body() -> dict:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroQStrategy(**BASE), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(_lit(), _data(1))
    config = trainer.strategy.engine.config
    return {**metrics, "offload": config.offload_optimizer or config.offload_parameters}


def test_evaluation_alone_keeps_everything_on_the_device(dist_pool):
    # validate() without a fit has no optimizer state to place and reads no batch to plan from
    got = dist_pool(1).run(_validate_body)[0]
    assert got["val_loss"] > 0 and not got["offload"], got


def _reading_lit(count_targets: bool):
    """``_lit``'s module whose ``training_step`` reads its loss's value for the log (``.item()``), and with
    ``count_targets`` also an integer count it slices by (a value the meta device cannot give)."""
    module = _lit()
    module.values = []  # what the step saw, as a user's step keeps a list or a counter

    def training_step(batch, batch_idx):
        tokens, targets = batch
        if count_targets:
            kept = int((targets >= 0).sum().item())
            tokens, targets = tokens.reshape(-1)[:kept].reshape(tokens.shape), targets.reshape(-1)[:kept].reshape(targets.shape)
        logits = module.gpt(tokens)
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size).float(), targets.reshape(-1))
        module.log("loss_value", loss.item())
        module.values.append(float(loss))
        return loss

    module.training_step = training_step
    return module


def _reading_fit_body(count_targets: bool) -> object:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.integration.lightning.test_parity import _Recorder

    world = dist.get_world_size()
    snaps, values = {}, {}
    for arm in ("auto", "ddp"):
        torch.manual_seed(0)
        module = _reading_lit(count_targets)
        recorder = _Recorder()
        strategy = ZeroQStrategy(**BASE, offload_memory_budget=100) if arm == "auto" else "ddp"
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[recorder])
        try:
            trainer.fit(module, _data(world))
        except ValueError as error:
            return str(error)
        snaps[arm] = recorder.snapshots
        values[arm] = module.values
    _assert_same(snaps["auto"], snaps["ddp"], 1e-5)
    # the plan's trace ends at the loss's read: the step's own list holds the real steps only, as under DDP
    assert len(values["auto"]) == len(values["ddp"]) and values["auto"] == pytest.approx(values["ddp"], abs=1e-5), values
    return "trained as DDP"


def test_auto_plans_a_training_step_that_logs_its_loss_value_and_trains_as_ddp(dist_pool):
    # loss.item() for the log: the meta device has no value, and the plan needs none (the trace ends there)
    assert dist_pool(2).run(_reading_fit_body, False) == ["trained as DDP"] * 2


def test_auto_stops_before_launch_on_every_rank_where_training_step_needs_a_value(dist_pool):
    # an integer count the step slices by cannot be planned on the meta device: one line, every rank alike
    said = dist_pool(2).run(_reading_fit_body, True)
    assert said[0] == said[1] and "\n" not in said[0], said
    assert said[0].startswith("offload='auto' plans from one micro-batch traced on the meta device, and this one "
                              "cannot run there (RuntimeError: "), said
    assert "pass plan_forward=lambda model: <one micro-batch's loss" in said[0], said


def test_auto_says_what_its_budget_was_and_gives_no_step_time_it_could_not_plan():
    module, forward = _module_and_forward()
    line = choose(module, ZeroConfig(**BASE), forward, apply=False).line  # a CPU device: nothing calibrated
    assert "of no device budget (a CPU device: device memory not checked)" in line, line
    assert "step time not planned (no GPU to measure the rates on)" in line and "0.000" not in line, line
    line = choose(module, ZeroConfig(**BASE, offload_memory_budget="1GiB"), forward, apply=False).line
    assert "of offload_memory_budget='1GiB' (1.0 GiB)" in line and "none" not in line, line
    from lightning_zeroq.planning.estimate import Machine

    line = choose(module, ZeroConfig(**BASE), forward, apply=False, machine=Machine()).line  # rates given
    step = float(line.split("step ~")[1].split(" s")[0])
    assert step > 0, line
