"""``torch.optim.Muon`` under Fabric (its one optimizer over a model of matrices): the optimizer on the host
trains bitwise as on the device, every loss and weight, with accumulation and clipping, stages 2 and 3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_zeroq  # noqa: F401  (registers the strategy names)

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
DIM = 24


def _train(stage: int, offload: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy

    extra = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(),
                      strategy=ZeroQFabricStrategy(stage=stage, offload_optimizer=offload, **extra))
    fabric.launch()  # the pool's processes: joins their process group
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Tanh(), nn.Linear(2 * DIM, DIM, bias=False))
    model, optimizer = fabric.setup(model, torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.95,
                                                            weight_decay=0.1, nesterov=stage == 2))
    losses = []
    for step in range(4):
        for micro in range(2):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + micro + 100 * dist.get_rank()))
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(x).pow(2).mean()
                fabric.backward(loss / 2)
            losses.append(float(loss.detach()))
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
    return losses, fabric.strategy.full_state_dict()


def _host_against_device(stage: int) -> int:
    device = _train(stage, offload=False)
    host = _train(stage, offload=True)
    assert host[0] == device[0]
    assert all(torch.equal(host[1][k], device[1][k]) for k in device[1])
    return len(host[0])


@pytest.mark.parametrize("stage", [2, 3])
def test_the_optimizer_on_the_host_trains_as_on_the_device(dist_pool, stage):
    assert dist_pool(2).run(_host_against_device, stage) == [8, 8]
