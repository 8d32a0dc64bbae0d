"""A callback or hook that writes the weights between optimizer steps, under zeroq against DDP on 2 ranks.

``on_train_batch_end`` scales every parameter in place under ``no_grad`` (what a max-norm clamp, a projection
or a pruning mask does) and records the weights it leaves; DDP runs the same fit. Under zeroq the next step
must start from the write, as DDP's does: every batch's weights and the module after fit within 1e-6 of DDP's
(fp32, ``32-true``), stages 1 and 2 synchronous, offloaded, asynchronous and speculative+asynchronous, with
gradient accumulation (a write after a batch that does not step), and stage 3: its persistent units take a
plain write alike, its freed units are written inside ``lightning_zeroq.gathered_parameters(writeback=True)``
(a plain write of a freed parameter is refused where it is made). With ``bf16-mixed`` the working weights are
bf16 copies of the masters: the step refuses the write on every rank, in one line naming the parameter and
the fix. Fabric: the same write between ``optimizer.step()`` calls against Fabric's DDP.

``test_weight_callbacks.py``, beside this file, covers the weight-averaging callbacks, checkpoints and hooks that
read the weights.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import pytest
import torch

from tests.conformance.harness import on_ranks

TOL = 1e-6
BATCHES = 4
MODES = {
    "sync": {},
    "offload": {"offload_optimizer": True},
    "async": {"offload_optimizer": True, "offload_async_step": True},
    "speculative_async": {"offload_optimizer": True, "offload_speculative_step": True, "offload_async_step": True},
}
KERNEL = ("offload_async_step", "offload_speculative_step")  # these need the host kernel
STAGE3_FREED = {"stage": 3, "stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}


def _model():
    from torch import nn

    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))


def _data():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], 1))


def fit_with_writes(options: Optional[dict], precision: str = "32-true", accumulate: int = 1) -> dict:
    """One fit whose ``on_train_batch_end`` scales every weight in place; ``options`` a ``ZeroConfig`` (None:
    DDP). Returns the weights after each write and the module after fit, or the error the fit raised."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_zeroq

    gather = bool(options) and options.get("stage3_param_persistence_threshold") == 0
    seen: list[list[torch.Tensor]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.02, eps=1e-3)

        @torch.no_grad()
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            with lightning_zeroq.gathered_parameters(self, writeback=True) if gather else contextlib.nullcontext():
                for p in self.parameters():
                    p.mul_(0.9)
                seen.append([p.detach().float().clone() for p in self.parameters()])

    torch.manual_seed(11)
    model = Model()
    strategy: Any = "ddp" if options is None else lightning_zeroq.ZeroQStrategy(**options)
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                         limit_train_batches=BATCHES, accumulate_grad_batches=accumulate, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    try:
        trainer.fit(model, DataLoader(_data(), batch_size=4))
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None, "batch_end": seen, "final": [p.detach().float().clone() for p in model.parameters()]}


_RESULTS: dict[Any, Any] = {}


def _fit(dist_pool: Any, key: Any, *args: Any) -> list:
    if key not in _RESULTS:
        _RESULTS[key] = on_ranks(dist_pool, fit_with_writes, *args)
    return _RESULTS[key]


def _assert_close(ours: list, ddp: list, where: str) -> None:
    assert len(ours) == len(ddp), f"{where}: {len(ours)} entries, DDP {len(ddp)}"
    for i, (a, b) in enumerate(zip(ours, ddp)):
        if isinstance(b, list):
            _assert_close(a, b, f"{where}[{i}]")
            continue
        diff = float((a - b).abs().max())
        assert diff <= TOL, f"{where}[{i}]: max difference from DDP {diff:.3g} > {TOL}"


def _cases() -> list:
    cases = []
    for stage in (1, 2):
        for mode in MODES:
            cases.append(pytest.param({"stage": stage, **MODES[mode]}, 1, id=f"stage{stage}-{mode}"))
    cases.append(pytest.param({"stage": 2}, 2, id="stage2-sync-accumulate"))
    cases.append(pytest.param({"stage": 2, **MODES["async"]}, 2, id="stage2-async-accumulate"))
    cases.append(pytest.param({"stage": 3}, 1, id="stage3-persistent"))
    cases.append(pytest.param(STAGE3_FREED, 1, id="stage3-freed-gathered"))
    return cases


@pytest.mark.parametrize(("options", "accumulate"), _cases())
def test_a_write_in_on_train_batch_end_is_kept_as_under_ddp(dist_pool, request, options: dict,
                                                            accumulate: int) -> None:
    if any(options.get(k) for k in KERNEL):
        request.getfixturevalue("host_kernel")
    ddp = _fit(dist_pool, ("ddp", accumulate), None, "32-true", accumulate)
    ours = _fit(dist_pool, (repr(sorted(options.items())), accumulate), options, "32-true", accumulate)
    for rank, (mine, theirs) in enumerate(zip(ours, ddp)):
        assert mine["error"] is None, mine["error"]
        assert len(theirs["batch_end"]) == BATCHES
        _assert_close(mine["batch_end"], theirs["batch_end"], f"rank {rank} batch_end")
        _assert_close(mine["final"], theirs["final"], f"rank {rank} final")


@pytest.mark.parametrize("options", [{"stage": 2}, {"stage": 1, **MODES["async"]}], ids=["stage2", "stage1-async"])
def test_a_write_of_bf16_working_weights_is_refused_on_every_rank(dist_pool, request, options: dict) -> None:
    if any(options.get(k) for k in KERNEL):
        request.getfixturevalue("host_kernel")
    for r in on_ranks(dist_pool, fit_with_writes, options, "bf16-mixed"):
        message = r["error"]
        assert message is not None, "the write was taken into the masters or undone in silence"
        assert "model.0.weight" in message and "rank(s) [0, 1]" in message, message
        assert "gathered_parameters(module, writeback=True)" in message and "\n" not in message, message


# --------------------------------------------------------------------------- Fabric


def fabric_writes_between_steps(options: dict) -> float:
    """Fabric with zeroq and Fabric with DDP in lockstep, the same write after every ``optimizer.step()``."""
    import lightning as L
    import torch.distributed as dist
    from torch import nn

    from lightning_zeroq import ZeroQFabricStrategy

    def launched(strategy: Any) -> Any:
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fabric.launch()  # the pool's processes exist already: this joins their process group
        return fabric

    torch.manual_seed(11)
    plain = _model()
    zq, ddp = launched(ZeroQFabricStrategy(**options)), launched("ddp")
    model, opt = zq.setup(plain, torch.optim.Adam(plain.parameters(), lr=0.02, eps=1e-3))
    ref_plain = copy.deepcopy(_model())
    ref_plain.load_state_dict({k: v.detach().clone() for k, v in zq.strategy.full_state_dict().items()})
    ref_model, ref_opt = ddp.setup(ref_plain, torch.optim.Adam(ref_plain.parameters(), lr=0.02, eps=1e-3))
    data = _data()
    worst = 0.0
    for step in range(BATCHES):
        x, y = data[8 * step + 4 * dist.get_rank(): 8 * step + 4 * dist.get_rank() + 4]
        zq.backward(nn.functional.mse_loss(model(x), y))
        ddp.backward(nn.functional.mse_loss(ref_model(x), y))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters()):
                p.mul_(0.9)
                q.mul_(0.9)
                worst = max(worst, float((p - q).abs().max()))
    full = zq.strategy.full_state_dict()
    for name, q in ref_model.module.named_parameters():
        worst = max(worst, float((full[name] - q.detach()).abs().max()))
    return worst


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fabric_a_write_between_steps_is_kept_as_under_ddp(dist_pool, request, mode: str) -> None:
    options = {"stage": 2, **MODES[mode]}
    if any(options.get(k) for k in KERNEL):
        request.getfixturevalue("host_kernel")
    assert all(worst <= TOL for worst in on_ranks(dist_pool, fabric_writes_between_steps, options))
