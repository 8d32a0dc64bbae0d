"""LoRA fine-tuning clients under ``Fabric(strategy=ZeroQFabricStrategy(...))`` against ``Fabric(strategy="ddp")``
(fp32, gloo), in lockstep in the same processes: Hugging Face PEFT over ``LlamaForCausalLM`` and LitGPT's LoRA
``GPT`` (``tests/lora_clients.py``), stages 1-3, every step 2 micro-batches (the first inside
``no_backward_sync``) and clipped by the global norm, the optimizer (stage 3: and the parameters) on the host,
the asynchronous host step, compiled decoder layers, Hugging Face's gradient checkpointing. Every micro-batch's
loss, the gradient norm and the adapters after every step are within 1e-6 of DDP's; the frozen base is bitwise
the initial one; in stage 3 it is sharded, one frozen part per decoder layer, freed between steps. Under the
Trainer: ``tests/integration/lightning/``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from tests import lora_clients as clients

STEPS, ACCUMULATE = 3, 2


def _launched(strategy):
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision="32-true")
    fabric.launch()  # processes exist already (the pool); this joins the existing process group
    return fabric


def _body(client: str, stage: int, arm: str, layers: str) -> float:
    from lightning_zeroq import ZeroQFabricStrategy
    from lightning_zeroq.zero.unit import UnitState

    rank = dist.get_rank()
    zq = _launched(ZeroQFabricStrategy(**clients.zeroq_options(stage, arm)))
    ddp = _launched("ddp")
    if layers == "compiled":
        torch._dynamo.reset()
    graphs = clients.graphs()
    # Seed 0: the same model in both arms, on every rank.
    model, ref = (clients.prepare(client, clients.build(client), layers) for _ in range(2))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model, opt = zq.setup(model, clients.optimizer(model))
    ref_model, ref_opt = ddp.setup(ref, clients.optimizer(ref))
    engine = zq.strategy.engine
    if stage == 3:
        clients.check_frozen_sharded(client, model.module, engine)
    data, worst = clients.batches(STEPS * ACCUMULATE, rank), 0.0
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            batch = data[step * ACCUMULATE + micro]
            last = micro == ACCUMULATE - 1
            with zq.no_backward_sync(model, enabled=not last):
                loss = clients.loss(client, model, batch)
                zq.backward(loss / ACCUMULATE)
            with ddp.no_backward_sync(ref_model, enabled=not last):
                ref_loss = clients.loss(client, ref_model, batch)
                ddp.backward(ref_loss / ACCUMULATE)
            assert abs(loss.item() - ref_loss.item()) <= 1e-6, (step, micro, loss.item(), ref_loss.item())
        norm = zq.clip_gradients(model, opt, max_norm=clients.CLIP)
        ref_norm = ddp.clip_gradients(ref_model, ref_opt, max_norm=clients.CLIP)
        assert abs(float(norm) - float(ref_norm)) <= 1e-6 * float(ref_norm), (step, float(norm), float(ref_norm))
        assert float(ref_norm) > clients.CLIP, (step, float(ref_norm))  # the step clipped
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        full = zq.strategy.full_state_dict()
        trainable = {n: p.detach() for n, p in ref_model.module.named_parameters() if p.requires_grad}
        assert trainable and full.keys() == {n for n, _ in ref_model.module.named_parameters()}
        worst = max(worst, clients.compare({n: full[n] for n in trainable}, trainable, f"after step {step + 1}"))
        if stage == 3:
            assert all(part.state is UnitState.SHARDED for part in engine.parts.frozen.units)
    assert all(v.abs().max() > 0 for n, v in trainable.items() if "lora_B" in n)  # every adapter trained
    for name, before in base.items():
        assert torch.equal(full[name], before), f"the frozen {name} changed"
    if arm == "async":  # every step was asynchronous
        assert engine.parts.async_step.steps == STEPS, engine.parts.async_step.steps
    if layers == "compiled":
        assert clients.graphs() > graphs  # the decoder layers really ran compiled
    return worst


# (client, stage, arm, world size, layers): with the Trainer's (tests/integration/lightning/test_lora_clients.py),
# for both clients every stage on the device, with offload and with the asynchronous step, at 2 and 3 ranks.
MATRIX = [
    (client, stage, arm, world, "eager")
    for client in clients.CLIENTS
    for stage, arm, world in ((1, "async", 2), (2, "offload", 3), (3, "plain", 3), (3, "offload", 2), (3, "async", 3))
] + [("litgpt", 3, "offload", 3, "compiled"), ("peft", 2, "plain", 2, "reentrant"),
     ("peft", 3, "async", 2, "checkpointed")]


@pytest.mark.parametrize(("client", "stage", "arm", "world", "layers"), [clients.param(*case) for case in MATRIX])
def test_lora_clients_under_fabric_match_ddp(dist_pool, request, client, stage, arm, world, layers):
    clients.require(client, arm, request)
    worst = dist_pool(world).run(_body, client, stage, arm, layers)
    assert max(worst) <= 1e-6, worst
