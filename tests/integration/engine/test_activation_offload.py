"""Activation offload (``activation_offloading_policy``): the blocks named keep what autograd saves for
their backward in host memory, or, where they also recompute, their checkpoint inputs; training a tiny GPT is
bitwise the same as without (dropout included) in stages 1-3, with a mix of offloaded, recomputed and kept blocks,
with optimizer and parameter offload, the asynchronous host step, compiled blocks and stage 3's frozen parts
(LoRA); what waits on the host
is what the blocks saved; bad values are refused; the Hydra override. Two gloo ranks; losses and parameters
compared with ``torch.equal``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel
from tests.integration.engine.test_recompute import Block, Net
from tests.models import SEQ, VOCAB

FREED = dict(stage3_wrap_classes=["Block"], stage3_param_persistence_threshold=0)
# The package's GPT, tiny: attention saves views of one projection (q, k, v, transposed), RMSNorm, SwiGLU,
# dropout on attention and the residual branches, the head tied to the embedding.
GPT = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, n_embd=16, ffn_hidden=40, dropout=0.1,
                norm="rmsnorm", mlp="swiglu", bias=False, learned_positions=False)

# Which blocks do what: none; every block offloaded; a mix of the three blocks (one offloaded, one recomputing
# with its input on the host, one recomputing); the mix the plan writes (offloaded by name, the rest recomputing).
VARIANTS = {
    "none": {},
    "offload": dict(activation_offloading_policy=[Block]),
    "mix": dict(activation_offloading_policy=["blocks.0", "blocks.1"], activation_checkpointing_policy=None,
                recompute=("blocks.1", "blocks.2")),
}


def _train_body(stage: int, variant: str, extra: dict, compiled: bool = False) -> tuple[list[float], dict, int]:
    torch.manual_seed(0)
    model = Net() if compiled else GPTModel(GPT)  # (inductor compiles the tiny GPT for minutes on 2 cores)
    if compiled:
        for block in model.blocks:
            block.compile()
    options = dict(FREED) if stage == 3 else dict(reduce_bucket_size=16 * 16)
    fields = {k: v for k, v in VARIANTS[variant].items() if k != "recompute"}
    if "recompute" in VARIANTS[variant]:
        from lightning_zeroq.zero import activation_checkpoint

        modules = dict(model.named_modules())
        activation_checkpoint.apply_to([modules[n] for n in VARIANTS[variant]["recompute"]])
    engine = ZeroEngine(model, ZeroConfig(stage=stage, activation_offloading_min_bytes=0, **options, **fields,
                                          **extra))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    torch.manual_seed(1 + dist.get_rank())  # dropout's draws, different per rank
    losses, held = [], 0
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        for micro in range(2):  # a window of two backward passes
            loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.roll(micro, 1).reshape(-1))
            if engine.parts.activations is not None:
                groups = [e.group for e in engine.parts.activations._sequence if e.group is not None]
                assert groups and all(s.device is None for g in groups for s in g.stored if s.host is not None)
                held = max(held, engine.parts.activations.pool.held)
            engine.backward(loss, boundary=micro == 1)
            losses.append(loss.item())
        engine.clip_grad_norm_(0.5)
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    engine.close()
    return losses, state, held


def _same(ours, plain) -> None:
    for (losses, state, _), (ref_losses, ref_state, _) in zip(ours, plain):
        assert losses == ref_losses
        assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in ref_state)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_blocks_train_bitwise_as_without(dist_pool, stage):
    pool = dist_pool(2)
    plain = pool.run(_train_body, stage, "none", {})
    for variant in ("offload", "mix"):
        ours = pool.run(_train_body, stage, variant, {})
        _same(ours, plain)
        assert all(held > 0 for _, _, held in ours)


@pytest.mark.parametrize("stage, extra", [
    (2, dict(offload_optimizer=True)),
    (3, dict(offload_optimizer=True, offload_parameters=True)),
    (2, dict(offload_optimizer=True, offload_async_step=True)),
    (3, dict(offload_optimizer=True, offload_async_step=True, reshard_after_forward=False)),
], ids=["stage2-optimizer", "stage3-parameters", "stage2-async", "stage3-async-keep"])
def test_with_optimizer_and_parameter_offload_and_the_asynchronous_step(dist_pool, stage, extra):
    pool = dist_pool(2)
    _same(pool.run(_train_body, stage, "mix", extra), pool.run(_train_body, stage, "none", extra))


@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_blocks(dist_pool, stage):
    """``block.compile()`` (inductor on CPU; ``test_recompute``'s blocks: linear layers, GELU, dropout): the hooks
    sit outside the compiled forward, which saves its tensors through them."""
    pool = dist_pool(2)
    _same(pool.run(_train_body, stage, "mix", {}, True), pool.run(_train_body, stage, "none", {}, True))


def test_bad_policies_are_refused_with_the_fix():
    for bad in ("Block", [], [3], [None], {"Block": 1}):
        with pytest.raises(ValueError, match=r"activation_offloading_policy=.* must be a list of module classes"):
            ZeroConfig(activation_offloading_policy=bad)
    assert ZeroConfig(activation_offloading_policy={Block, "Block", "blocks.0"}).activation_offloading_policy == [
        "Block", "blocks.0"]
    with pytest.raises(ValueError, match=r"activation_offloading_min_bytes=-1 must be an integer >= 0"):
        ZeroConfig(activation_offloading_min_bytes=-1)
    with pytest.raises(ValueError, match=r"activation_offloading_policy='auto' chooses block by block beside "
                                         r"activation_checkpointing_policy=\['Block'\].*set activation_checkpointing_policy='auto'"):
        ZeroConfig(activation_offloading_policy="auto", activation_checkpointing_policy=["Block"])
    with pytest.raises(ValueError, match=r"names \['Blok'\], which no module of the model is .*Block"):
        ZeroEngine(Net(), ZeroConfig(activation_offloading_policy=["Blok"]))
    with pytest.raises(ValueError, match=r"'blocks.0.up', inside 'blocks.0', which activation_checkpointing_policy "
                                         r"recomputes"):
        ZeroEngine(Net(), ZeroConfig(activation_offloading_policy=["blocks.0.up"], activation_checkpointing_policy=[Block]))
    with pytest.raises(ValueError, match=r"decided from a plan"):
        ZeroEngine(Net(), ZeroConfig(activation_offloading_policy="auto"))


def test_the_min_bytes_setting_without_a_policy_warns_once():
    with pytest.warns(UserWarning, match=r"activation_offloading_min_bytes=0 has no effect without activation_offloading_policy"):
        ZeroEngine(Net(), ZeroConfig(activation_offloading_min_bytes=0)).close()


def test_evaluation_and_no_grad_forwards_offload_nothing_and_close_hands_the_forward_back():
    torch.manual_seed(0)
    model = Net()
    engine = ZeroEngine(model, ZeroConfig(activation_offloading_policy=[Block], activation_offloading_min_bytes=0))
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        model(tokens)
    assert engine.parts.activations.pool.held == 0 and not engine.parts.activations._sequence
    model(tokens).sum().backward()
    assert engine.parts.activations.pool.held > 0
    engine.close()
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_a_checkpoint_around_an_offloaded_block_leaves_it_to_the_checkpoint():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = Net()
    engine = ZeroEngine(model, ZeroConfig(activation_offloading_policy=[Block], activation_offloading_min_bytes=0))
    h = model.embed(torch.randint(0, VOCAB, (2, SEQ)))
    with pytest.warns(UserWarning, match=r"ran inside saved-tensor hooks set outside it"):
        out = checkpoint(model.blocks[0], h, use_reentrant=False)
    out.sum().backward()
    assert engine.parts.activations.pool.held == 0
    engine.close()


# --------------------------------------------------------------------------- the Trainer


def _trainer_body(offloaded: bool) -> tuple[list[float], dict]:
    import lightning as L

    from lightning_zeroq import ZeroQStrategy
    from tests.models import TokenDataset, make_token_lit

    extra = dict(activation_offloading_policy=["Block"], activation_checkpointing_policy=["Block"],
                 activation_offloading_min_bytes=0) if offloaded else {}
    torch.manual_seed(0)
    lit = make_token_lit(Net())
    torch.manual_seed(1 + dist.get_rank())
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5,
                        strategy=ZeroQStrategy(stage=3, **FREED, **extra), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True)
    trainer.fit(lit, torch.utils.data.DataLoader(TokenDataset(32), batch_size=2))
    return lit.losses, {k: v.detach().clone() for k, v in lit.model.state_dict().items()}


def test_the_trainer_with_offloaded_checkpoint_inputs_trains_bitwise_as_without(dist_pool):
    """Stage 3 under the Trainer, every block recomputing with its checkpoint input on the host (DeepSpeed's
    ``cpu_checkpointing``), accumulation and clipping: every loss and the weights after ``fit`` bitwise."""
    pool = dist_pool(2)
    plain, ours = pool.run(_trainer_body, False), pool.run(_trainer_body, True)
    for (losses, state), (ref_losses, ref_state) in zip(ours, plain):
        assert losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_the_hydra_override_names_the_blocks_of_zeroq_trains_gpt():
    from lightning_zeroq.cli.train import compose_config, to_run_config

    config = to_run_config(compose_config(["zero.activation_offloading_policy=[Block]",
                                           "zero.activation_checkpointing_policy=[blocks.0]",
                                           "zero.activation_offloading_min_bytes=0"])).zero
    assert config.activation_offloading_policy == ["Block"] and config.activation_checkpointing_policy == ["blocks.0"]
    assert config.activation_offloading_min_bytes == 0
    assert to_run_config(compose_config([])).zero.activation_offloading_policy is None


def _lora(**options) -> tuple[list[float], dict, int]:
    from tests.models import LoraModel, make_batch

    torch.manual_seed(0)
    model = LoraModel()
    engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_param_persistence_threshold=0, **options))
    engine.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses = []
    for step in range(3):
        loss = model.loss(make_batch(step, 0, 0))
        engine.backward(loss, boundary=True)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    held = engine.parts.activations.pool.held if engine.parts.activations is not None else 0
    state = engine.full_state_dict()
    engine.close()
    return losses, state, held


@pytest.mark.parametrize("frozen_dtype, recompute", [(None, None), ("int8", ["LoraBlock"])])
def test_stage3_frozen_parts_stay_and_a_lora_fine_tune_is_bitwise(frozen_dtype, recompute):
    """A LoRA model's frozen base, sharded with each block (``frozen.py``), is gathered again for the backward like
    the trainable weights: never copied to the host. One process."""
    plain = _lora(frozen_dtype=frozen_dtype)
    ours = _lora(frozen_dtype=frozen_dtype, activation_offloading_policy=["LoraBlock"],
                 activation_checkpointing_policy=recompute, activation_offloading_min_bytes=0)
    _same([ours], [plain])
    assert ours[2] > 0
