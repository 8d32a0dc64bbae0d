"""``torch.optim.Muon`` under the Trainer (automatic optimization, accumulation, clipping): ZeroQ stage 1 is
bitwise DDP's training, torch's own bf16 iteration and all; with the optimizer on the host (stages 2 and 3)
every loss and weight is bitwise the same run with the optimizer on the device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_zeroq  # noqa: F401  (registers the strategy names)

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
DIM = 24


def _fit(strategy, clip=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning as L

    class MatrixLit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Tanh(),
                                        nn.Linear(2 * DIM, DIM, bias=False), nn.Tanh(), nn.Linear(DIM, DIM, bias=False))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            loss = self.layers(x).pow(2).mean()
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.Muon(self.parameters(), lr=0.02, momentum=0.95, weight_decay=0.1)

    module = MatrixLit()
    data = torch.randn(24, DIM, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=4,
                        accumulate_grad_batches=2, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2))
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else {
        k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.losses, state


def _stage1_against_ddp() -> bool:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zeroq import ZeroQStrategy

    ddp = _fit(DDPStrategy())
    ours = _fit(ZeroQStrategy(stage=1))
    return ours[0] == ddp[0] and all(torch.equal(ours[1][k], ddp[1][k]) for k in ddp[1])


def _host_against_device(stage: int) -> bool:
    from lightning_zeroq import ZeroQStrategy

    extra = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    device = _fit(ZeroQStrategy(stage=stage, **extra), clip=0.5)
    host = _fit(ZeroQStrategy(stage=stage, offload_optimizer=True, **extra), clip=0.5)
    return host[0] == device[0] and len(host[0]) == 8 and all(torch.equal(host[1][k], device[1][k]) for k in device[1])


def test_stage_1_under_the_trainer_is_ddps_training(dist_pool):
    assert dist_pool(2).run(_stage1_against_ddp) == [True, True]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_optimizer_on_the_host_trains_as_on_the_device(dist_pool, stage):
    assert dist_pool(2).run(_host_against_device, stage) == [True, True]
