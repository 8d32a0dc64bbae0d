"""Asynchronous and speculative host steps under the Trainer are bitwise the synchronous steps, whatever
the LightningModule does: a ``training_step`` that calls a submodule (the Trainer never calls the
LightningModule's own forward), LitGPT's ``GPT`` and Hugging Face's ``LlamaForCausalLM`` as that
submodule, a module only some ranks run with ``self.log(..., sync_dist=True)`` beside it, and a callback
that reads every weight right after each step. Stages 1-3, the model as one unit and as several, two
gloo ranks. Each loss of every step, the values the callback read and the weights after ``fit`` are
compared bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_zeroq  # noqa: F401  (registers the strategy names)

VOCAB, SEQ, STEPS = 64, 8, 5


def _submodule() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, VOCAB))


def _litgpt() -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ))


class _Branching(nn.Module):
    """A module only some ranks run (on data that differs per rank), as stages 1 and 2 allow."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.optional = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor, log) -> torch.Tensor:
        h = self.embed(tokens)
        if int(tokens[0, 0]) % 2 == dist.get_rank() % 2:
            h = h + self.optional(h)
        log(h.detach().float().mean())  # a collective of the user's, between the modules
        return self.head(h)


MODELS = {"submodule": _submodule, "litgpt": _litgpt, "llama": _llama, "branch": _Branching}
# Units: "one" keeps the default bucket (the whole model one unit); "several" cuts it small.
UNITS = {"one": {}, "several": {"reduce_bucket_size": 600, "stage3_param_persistence_threshold": 40}}
STAGE3_WRAP = {"submodule": ["Linear", "Embedding"], "litgpt": ["Block"], "llama": ["LlamaDecoderLayer"],
               "branch": ["Linear", "Embedding"]}


def _lit_module(kind: str):
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = MODELS[kind]()
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            if kind == "branch":
                logits = self.model(tokens, lambda v: self.log("h", v, sync_dist=True))
            elif kind == "llama":
                logits = self.model(input_ids=tokens).logits
            else:
                logits = self.model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
            self.log("loss", loss, sync_dist=True)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return Lit()


def _reader(stage: int):
    import lightning as L

    class Reader(L.Callback):
        """Reads every weight right after each step, through the module (as weight averaging does)."""

        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            gathered = trainer.strategy.gathered_parameters(pl_module) if stage == 3 else contextlib.nullcontext()
            with gathered:  # stage 3: outside the forward, sharded
                self.seen.append(torch.cat([p.detach().reshape(-1).float() for p in pl_module.parameters()]).clone())

    return Reader()


def _fit(kind: str, stage: int, units: str, mode: str):
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    options = dict(UNITS[units])
    if stage == 3:
        options["stage3_wrap_classes"] = STAGE3_WRAP[kind] if units == "several" else []
    if mode != "sync":
        options["offload_async_step"] = True
    if mode == "spec_async":
        options["offload_speculative_step"] = True
    strategy = ZeroQStrategy(stage=stage, offload_optimizer=True, **options)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2 * STEPS, SEQ), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens.roll(-1, 1)), batch_size=2)
    module, reader = _lit_module(kind), _reader(stage)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[reader], use_distributed_sampler=False)
    trainer.fit(module, data)
    steps = trainer.strategy.engine.parts.async_step.steps if mode != "sync" else STEPS
    return module.losses, reader.seen, {n: p.detach().clone() for n, p in module.named_parameters()}, steps


def _body(kind: str, stage: int, units: str) -> None:
    sync = _fit(kind, stage, units, "sync")
    for mode in ("async", "spec_async"):
        losses, seen, weights, steps = _fit(kind, stage, units, mode)
        assert steps == STEPS, f"{mode}: {steps} of {STEPS} steps were asynchronous"
        assert len(losses) == len(sync[0]) == STEPS
        for step, (a, b) in enumerate(zip(losses, sync[0])):
            assert torch.equal(a, b), f"{mode}: the loss of step {step + 1} differs: {a.item()} vs {b.item()}"
        for step, (a, b) in enumerate(zip(seen, sync[1])):
            assert torch.equal(a, b), f"{mode}: the weights read after step {step + 1} differ"
        assert weights.keys() == sync[2].keys()
        for name in weights:
            assert torch.equal(weights[name], sync[2][name]), f"{mode}: {name} differs after fit"


CASES = [(kind, stage, units) for kind in MODELS for stage in (1, 2, 3) for units in UNITS
         if not (kind == "branch" and (stage == 3 or units == "one"))]  # stage 3 runs the same modules everywhere


PARAMS = [pytest.param(*case, id="-".join(map(str, case)), marks=[pytest.mark.hf] if case[0] == "llama" else [])
          for case in CASES]  # Hugging Face's model: in the pass with transformers installed (pyproject.toml, hf)


@pytest.mark.usefixtures("host_kernel")  # tests/conftest.py: skips where the kernel cannot match torch
@pytest.mark.parametrize(("kind", "stage", "units"), PARAMS)
def test_async_steps_are_the_synchronous_steps_under_the_trainer(dist_pool, kind, stage, units):
    if kind == "litgpt":
        pytest.importorskip("litgpt")
    if kind == "llama":
        pytest.importorskip("transformers")
    dist_pool(2).run(_body, kind, stage, units)
