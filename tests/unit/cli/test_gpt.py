"""The package's GPT (``lightning_zeroq.cli.gpt``): the demo model of ``zeroq-train`` and, with Llama-like options,
the model of the step-time benchmarks."""

import pytest
import torch
import torch.nn.functional as F

from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

LLAMA_LIKE = dict(norm="rmsnorm", mlp="swiglu", bias=False, learned_positions=False, tie_embeddings=False,
                  init="torch")


def test_the_benchmark_shape_has_953m_parameters():
    # benchmarks/step_time.py's default model: d=2048, 16 layers, SwiGLU 5632, vocabulary 32000, untied head
    with torch.device("meta"):
        model = GPTModel(GPTConfig(vocab_size=32000, n_embd=2048, n_layer=16, n_head=16, ffn_hidden=5632,
                                   **LLAMA_LIKE))
    assert sum(p.numel() for p in model.parameters()) == 953_223_168


def test_llama_like_options_compute_rmsnorm_swiglu_blocks():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_embd=16, n_layer=2, n_head=2, ffn_hidden=24, **LLAMA_LIKE)
    model = GPTModel(cfg)
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())
    assert not hasattr(model, "pos_emb") and model.head.weight is not model.tok_emb.weight
    tokens = torch.randint(0, 50, (2, 200))  # longer than block_size: no position table to overflow
    x = model.tok_emb.weight[tokens]
    for blk in model.blocks:
        h = F.rms_norm(x, (16,), blk.ln_1.weight)
        q, k, v = (t.view(2, 200, 2, 8).transpose(1, 2) for t in (h @ blk.attn.qkv.weight.T).split(16, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 200, 16)
        x = x + a @ blk.attn.proj.weight.T
        gate, up = (F.rms_norm(x, (16,), blk.ln_2.weight) @ blk.mlp.fc.weight.T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ blk.mlp.proj.weight.T
    expected = F.rms_norm(x, (16,), model.ln_f.weight) @ model.head.weight.T
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


def test_the_default_is_gpt2_with_a_bounded_context():
    model = GPTModel(GPTConfig(vocab_size=50, n_embd=16, n_layer=1, n_head=2, block_size=8))
    assert model.head.weight is model.tok_emb.weight and model.blocks[0].mlp.fc.bias is not None
    block = model.blocks[0]
    assert torch.equal(block.ln_1.weight.detach(), torch.ones(16)) and not block.attn.qkv.bias.detach().any()
    with pytest.raises(ValueError, match="sequence length 9 exceeds GPTConfig.block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("field, value", [("norm", "batchnorm"), ("mlp", "relu"), ("init", "xavier"),
                                          ("ffn_hidden", -1), ("bias", "no")])
def test_bad_model_options_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}={value!r}"):
        GPTConfig(**{field: value})
