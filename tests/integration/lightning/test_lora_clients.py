"""LoRA fine-tuning clients under ``Trainer(strategy=ZeroQStrategy(...))`` against ``Trainer(strategy="ddp")``
(fp32, gloo): Hugging Face PEFT over ``LlamaForCausalLM`` and LitGPT's LoRA ``GPT`` (``tests/lora_clients.py``),
stages 1-3, with gradient accumulation and clipping in every case, the optimizer (stage 3: and the parameters)
on the host, the asynchronous host step, compiled decoder layers and Hugging Face's gradient checkpointing.
Every micro-batch's loss and the adapters after every optimizer step are within 1e-6 of DDP's; the frozen base
is bitwise the initial one after ``fit`` (in the module handed back and in ``full_state_dict()``); in stage 3 it
is sharded, one frozen part per decoder layer, freed between steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from tests import lora_clients as clients

STEPS, ACCUMULATE = 3, 2


def _module(client: str, layers: str):
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = clients.prepare(client, clients.build(client), layers)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = clients.loss(client, self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return clients.optimizer(self)

    return Lit()


def _recorder(client: str, stage: int, zeroq: bool):
    import lightning as L

    from lightning_zeroq.zero.unit import UnitState

    class Recorder(L.Callback):
        """The adapters after every optimizer step; stage 3: the frozen parts, checked after the first."""

        def __init__(self) -> None:
            self.adapters: list[dict[str, torch.Tensor]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % ACCUMULATE:
                return
            if zeroq:
                full = trainer.strategy.full_state_dict()  # collective, every rank is here
            else:
                full = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.adapters.append(clients.split(full, pl_module)[0])
            if zeroq and stage == 3 and batch_idx + 1 == ACCUMULATE:
                engine = trainer.strategy.engine
                clients.check_frozen_sharded(client, pl_module.model, engine)
                assert all(part.state is UnitState.SHARDED for part in engine.parts.frozen.units)

    return Recorder()


def _fit(client: str, stage: int, arm: str, layers: str) -> dict:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    zeroq = stage > 0
    strategy = ZeroQStrategy(**clients.zeroq_options(stage, arm)) if zeroq else "ddp"
    if layers == "compiled":
        torch._dynamo.reset()
    graphs = clients.graphs()
    module, recorder = _module(client, layers), _recorder(client, stage, zeroq)
    base = clients.split({n: p.detach().clone() for n, p in module.named_parameters()}, module)[1]
    data = torch.utils.data.DataLoader(clients.batches(STEPS * ACCUMULATE, dist.get_rank()), batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[recorder],
                        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=clients.CLIP)
    trainer.fit(module, data)
    after = {n: p.detach().clone() for n, p in module.named_parameters()}
    out = {"losses": module.losses, "adapters": recorder.adapters, "base": base, "after": after,
           "graphs": clients.graphs() - graphs}
    if zeroq:
        out["full"] = trainer.strategy.full_state_dict()  # the fit's engine, after fit
        if arm == "async":
            out["async_steps"] = trainer.strategy.engine.parts.async_step.steps
    return out


def _body(client: str, stage: int, arm: str, layers: str) -> float:
    ours, ddp = _fit(client, stage, arm, layers), _fit(client, 0, "plain", layers)
    assert len(ours["losses"]) == len(ddp["losses"]) == STEPS * ACCUMULATE
    for i, (a, b) in enumerate(zip(ours["losses"], ddp["losses"])):
        assert abs(a - b) <= 1e-6, f"micro-batch {i}: loss {a} vs DDP {b}"
    assert len(ours["adapters"]) == len(ddp["adapters"]) == STEPS
    worst = max(clients.compare(a, b, f"after step {s + 1}") for s, (a, b) in enumerate(zip(ours["adapters"],
                                                                                            ddp["adapters"])))
    assert ddp["adapters"][-1].keys() and all(v.abs().max() > 0 for n, v in ddp["adapters"][-1].items()
                                               if "lora_B" in n)  # every adapter trained
    trainable = {n: t for n, t in ours["after"].items() if n not in ours["base"]}
    worst = max(worst, clients.compare(trainable, ddp["adapters"][-1], "after fit"))
    for name, before in ours["base"].items():
        assert torch.equal(ours["after"][name], before), f"the frozen {name} changed (the module after fit)"
        assert torch.equal(ours["full"][name], before), f"the frozen {name} changed (full_state_dict after fit)"
    if arm == "async":
        assert ours["async_steps"] == STEPS, ours["async_steps"]
    if layers == "compiled":  # the decoder layers really ran compiled, under zeroq and under DDP
        assert ours["graphs"] > 0 and ddp["graphs"] > 0, (ours["graphs"], ddp["graphs"])
    return worst


# (client, stage, arm, world size, layers). With Fabric's (tests/integration/fabric/test_lora_clients.py), for
# both clients: every stage on the device, with offload and with the asynchronous step, at 2 and 3 ranks; here
# PEFT compiled in stage 3 and under reentrant gradient checkpointing in stage 3 with offload, there LitGPT
# compiled in stage 3 with offload and PEFT checkpointed (reentrant in stage 2, not in stage 3).
MATRIX = [
    (client, stage, arm, world, "eager")
    for client in clients.CLIENTS
    for stage, arm, world in ((1, "plain", 3), (1, "offload", 2), (2, "plain", 2), (2, "async", 3), (3, "plain", 2),
                              (3, "offload", 3), (3, "async", 2))
] + [("peft", 3, "plain", 2, "compiled"), ("peft", 3, "offload", 3, "reentrant")]


@pytest.mark.parametrize(("client", "stage", "arm", "world", "layers"), [clients.param(*case) for case in MATRIX])
def test_lora_clients_under_the_trainer_match_ddp(dist_pool, request, client, stage, arm, world, layers):
    clients.require(client, arm, request)
    worst = dist_pool(world).run(_body, client, stage, arm, layers)
    assert max(worst) <= 1e-6, worst
