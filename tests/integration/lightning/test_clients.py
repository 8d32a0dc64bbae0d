"""Real clients users bring, against DDP at 1e-5 (fp32, two gloo ranks): LitGPT's own Fabric training
loop (``litgpt.pretrain.fit``: its gradient accumulation under ``no_backward_sync``, its clipping, its
learning-rate schedule, its validation) with the zeroq Fabric strategy; LitGPT's ``GPT`` and Hugging
Face's ``LlamaForCausalLM`` under the Trainer. Tiny configurations built from code, nothing downloaded."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration.lightning import test_async_exact
from tests.integration.lightning.test_async_exact import SEQ, STAGE3_WRAP, STEPS, VOCAB

def _litgpt_config():
    """Without biases: the key projection's bias gets a gradient that is zero but for rounding (attention
    is shift-invariant), on which Adam steps by about its learning rate whatever the noise's size, so
    any two summation orders (ZeRO-2 sums each micro-batch's reduced gradient, DDP the local ones
    first) part at once. Llama has no biases either."""
    from litgpt.config import Config

    return Config(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, bias=False)


def _litgpt():
    from litgpt.model import GPT

    return GPT(_litgpt_config())


MODELS = {"litgpt": _litgpt, "llama": test_async_exact._llama}
ZEROQ = {1: {"stage": 1, "reduce_bucket_size": 600}, 2: {"stage": 2, "reduce_bucket_size": 600},
         3: {"stage": 3, "stage3_param_persistence_threshold": 40},
         "3_offload": {"stage": 3, "stage3_param_persistence_threshold": 40, "offload_optimizer": True,
                       "offload_parameters": True}}


def _pretrain_fit(arm) -> dict[str, torch.Tensor]:
    """LitGPT's ``fit`` for 4 optimizer steps of 2 micro-batches per rank; the full weights after it."""
    import lightning as L
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.model import GPT
    from litgpt.pretrain import fit

    from lightning_zeroq import ZeroQFabricStrategy

    kind = "ddp" if arm == "ddp" else ZeroQFabricStrategy(**ZEROQ[arm], **(
        {"stage3_wrap_classes": ["Block"]} if str(arm).startswith("3") else {}))
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=kind, precision="32-true")
    fabric.launch()  # the pool's processes exist: this joins their process group
    config = _litgpt_config()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    model = fabric.setup(model)
    # lr 1e-3: stage 2 reduces each micro-batch's gradient and sums the shards (ZeRO-2's design), DDP sums
    # the local gradients first; Adam turns that rounding into weight differences in proportion to lr.
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    micro, devices = 2, dist.get_world_size()
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=micro * devices * 2,
                      micro_batch_size=micro, max_tokens=micro * SEQ * devices * 2 * 4, max_norm=0.5,
                      lr_warmup_steps=2, min_lr=1e-4)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    with tempfile.TemporaryDirectory() as out:
        fit(fabric, devices, state, loader, loader, Path(out), None, train,
            EvalArgs(interval=1000, max_iters=1, initial_validation=False))
    assert state["step_count"] == 4, state
    if arm == "ddp":
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {n: t.clone() for n, t in fabric.strategy.full_state_dict().items()}


def _pretrain_body(arm) -> None:
    ours, ddp = _pretrain_fit(arm), _pretrain_fit("ddp")
    assert ours.keys() == ddp.keys()
    for name, p in ddp.items():
        diff = (ours[name] - p).abs().max().item()
        assert diff <= 1e-5, f"{name} differs from DDP by {diff}"


@pytest.mark.parametrize("arm", [1, 2, 3, "3_offload"])
def test_litgpt_pretrain_fit_with_zeroq_matches_ddp(dist_pool, arm):
    pytest.importorskip("litgpt")
    dist_pool(2).run(_pretrain_body, arm)


def _trainer_fit(kind: str, arm) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    if arm == "ddp":
        strategy = "ddp"
    else:
        options = dict(ZEROQ[arm])
        if str(arm).startswith("3"):
            options["stage3_wrap_classes"] = STAGE3_WRAP[kind]
        strategy = ZeroQStrategy(**options)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2 * STEPS, SEQ), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens.roll(-1, 1)), batch_size=2)
    real = test_async_exact.MODELS[kind]
    test_async_exact.MODELS[kind] = MODELS[kind]  # the Trainer's module of that file, with this model
    try:
        module = test_async_exact._lit_module(kind)
    finally:
        test_async_exact.MODELS[kind] = real
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, gradient_clip_val=0.5,
                        accumulate_grad_batches=2, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, data)
    if arm == "ddp":
        return module.losses, {n: p.detach().clone() for n, p in module.named_parameters()}
    with trainer.strategy.gathered_parameters(module):
        return module.losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def _trainer_body(kind: str, arm) -> None:
    (losses, ours), (ref_losses, ddp) = _trainer_fit(kind, arm), _trainer_fit(kind, "ddp")
    assert len(losses) == len(ref_losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a.item() - b.item()) <= 1e-5, f"step {step + 1}: loss {a.item()} vs DDP {b.item()}"
    assert ours.keys() == ddp.keys()
    for name, p in ddp.items():
        diff = (ours[name] - p).abs().max().item()
        assert diff <= 1e-5, f"{name} differs from DDP by {diff}"


CLIENTS = [pytest.param(kind, arm, id=f"{kind}-{arm}", marks=[pytest.mark.hf] if kind == "llama" else [])
           for kind in ("litgpt", "llama") for arm in (1, 2, 3, "3_offload") if kind in MODELS]


@pytest.mark.parametrize("kind, arm", CLIENTS)
def test_clients_under_the_trainer_match_ddp(dist_pool, kind, arm):
    pytest.importorskip("litgpt" if kind == "litgpt" else "transformers")
    dist_pool(2).run(_trainer_body, kind, arm)
