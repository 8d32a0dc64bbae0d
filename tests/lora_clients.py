"""LoRA fine-tuning clients users bring, tiny and built from code (nothing downloaded), for the parity tests
under the Trainer (``tests/integration/lightning/test_lora_clients.py``) and Fabric
(``tests/integration/fabric/test_lora_clients.py``):

- ``peft``: Hugging Face PEFT's ``get_peft_model`` over ``LlamaForCausalLM``, LoRA on every projection of
  attention and MLP (``base_layer`` nested in PEFT's ``lora.Linear``, the decoder layers given their mask and
  rotary embeddings, computed once in the model, by keyword);
- ``litgpt``: LitGPT's ``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable`` (its fused ``qkv``
  ``LoRAQKVLinear``, the rope cache as buffers).

Both fp32, each with 2 decoder layers: stage 3 (default unit plan) makes each layer a unit whose frozen base is
the unit's frozen part, with the layer's adapters its trainable parameters; embedding, final norm and head are
frozen and stay whole. The model is built from seed 0, so every rank builds the same one; the data differ per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SEQ, LAYERS = 64, 16, 2
CLIENTS = ("peft", "litgpt")
BLOCK = {"peft": "LlamaDecoderLayer", "litgpt": "Block"}
"""Each client's decoder layer: the unit stage 3 finds by itself (``unit_plan.auto_wrap_classes``)."""
IMPORTS = {"peft": ("peft", "transformers"), "litgpt": ("litgpt",)}
LR, CLIP = 1e-2, 0.05
"""A clip small enough that every step clips (the adapters' gradient norm is larger from the second step on)."""


def build(client: str) -> nn.Module:
    torch.manual_seed(0)
    if client == "peft":
        import peft
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        return peft.get_peft_model(LlamaForCausalLM(config), lora)
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    # No biases: a key projection's bias gets a gradient that is zero but for rounding (attention is
    # shift-invariant), on which Adam steps by about its learning rate whatever the noise (see test_clients.py).
    config = Config(n_layer=LAYERS, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    block_size=SEQ, bias=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True,
                    lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True, lora_head=False)
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    return model


def blocks(client: str, model: nn.Module) -> list[nn.Module]:
    """The decoder layers (``model`` as ``build`` returned it)."""
    return [m for m in model.modules() if type(m).__name__ == BLOCK[client]]


LAYERS_RUN = ("eager", "compiled", "reentrant", "checkpointed")
"""How the decoder layers run: as written; each compiled (``block.compile()``, torchtitan's recipe); under
Hugging Face's gradient checkpointing (PEFT only), reentrant (``use_reentrant=True``, with
``enable_input_require_grads`` as PEFT's k-bit recipe sets it) or not (the default)."""


def prepare(client: str, model: nn.Module, layers: str) -> nn.Module:
    """``model`` with its decoder layers run as ``layers`` says (``LAYERS_RUN``), before any strategy takes it."""
    if layers == "compiled":
        for block in blocks(client, model):
            block.compile()
    elif layers in ("reentrant", "checkpointed"):
        assert client == "peft", "gradient checkpointing here is Hugging Face's"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": layers == "reentrant"})
        model.config.use_cache = False  # (what transformers does, with a warning, at the first forward)
        if layers == "reentrant":
            model.enable_input_require_grads()  # a reentrant checkpoint backpropagates only to inputs needing it
    return model


def logits(client: str, model: nn.Module, tokens: Tensor) -> Tensor:
    if client == "peft":
        return model(input_ids=tokens).logits
    return model(tokens)


def loss(client: str, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    tokens, targets = batch
    return F.cross_entropy(logits(client, model, tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))


def batches(n: int, rank: int) -> list[tuple[Tensor, Tensor]]:
    """``n`` micro-batches of 2 sequences, different on every rank."""
    g = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randint(0, VOCAB, (n, 2, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the adapters. ``eps=1e-3``: Adam moves an element by about ``lr * g / (|g| + eps)``, so where a
    gradient is near ``eps`` (an adapter's first nonzero gradient after ``lora_B`` left zero), another order of
    summing it (ZeRO's reduce-scatter of each micro-batch, DDP's all-reduce of the sum) is amplified up to
    ``lr / eps`` times (6e-6 seen with torch's default 1e-8, LitGPT, stage 3); at 1e-3 the 1e-6 bound tests the
    engine, not Adam's conditioning (as ``tests/integration/engine/test_parity.py`` does)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1, eps=1e-3)


def zeroq_options(stage: int, arm: str) -> dict:
    """``plain``: on the device; ``offload``: optimizer (stage 3: and parameters) on the host; ``async``: that
    with the asynchronous host step. Stage 3 keeps its default unit plan (each decoder layer a unit)."""
    options: dict = {"stage": stage, "reduce_bucket_size": 500}  # stages 1 and 2: several units
    if arm in ("offload", "async"):
        options.update(offload_optimizer=True, offload_parameters=stage == 3, offload_async_step=arm == "async")
    return options


def graphs() -> int:
    """The graphs dynamo compiled in this process so far (``torch.compile`` of the decoder layers)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def check_frozen_sharded(client: str, model: nn.Module, engine) -> None:
    """Stage 3 shards the frozen base: one frozen part per decoder layer, the layer's frozen weights."""
    frozen = engine.parts.frozen
    assert frozen is not None, "stage 3 built no frozen part"
    layers = blocks(client, model)
    assert len(layers) == LAYERS and len(frozen.units) == LAYERS, (len(layers), len(frozen.units))
    for layer in layers:
        base = {id(p) for p in layer.parameters() if not p.requires_grad}
        assert any({id(p) for p in part.params} == base for part in frozen.units), type(layer).__name__


def split(named: dict[str, Tensor], model: nn.Module) -> tuple[dict, dict]:
    """``named`` (parameters by name) as (trainable, frozen), by ``model``'s ``requires_grad``."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return ({n: t for n, t in named.items() if n in trainable}, {n: t for n, t in named.items() if n not in trainable})


def compare(got: dict[str, Tensor], want: dict[str, Tensor], what: str, atol: float = 1e-6) -> float:
    """Worst absolute difference; fails above ``atol`` naming the parameter."""
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys())[:4])
    worst = 0.0
    for name, value in want.items():
        diff = (got[name].float().cpu() - value.float().cpu()).abs().max().item()
        assert diff <= atol, f"{what}: {name} differs from DDP by {diff}"
        worst = max(worst, diff)
    return worst


def param(client: str, stage: int, arm: str, world: int, layers: str):
    """One case of a client test matrix as a ``pytest.param``: PEFT's in the pass with transformers installed
    (``hf``: pyproject's extra, ``.ci/run``'s tier)."""
    import pytest

    marks = [pytest.mark.hf] if client == "peft" else []
    name = f"{client}-stage{stage}-{arm}-{world}ranks" + ("" if layers == "eager" else f"-{layers}")
    return pytest.param(client, stage, arm, world, layers, id=name, marks=marks)


def require(client: str, arm: str, request) -> None:
    """Skip unless ``client``'s packages are installed and, for the asynchronous arm, the host kernel matches torch
    here (the ``host_kernel`` fixture of ``tests/conftest.py``)."""
    import pytest

    for module in IMPORTS[client]:
        pytest.importorskip(module)
    if arm == "async":
        request.getfixturevalue("host_kernel")
