"""``zeroq-convert`` for serving a fine-tuned PEFT model without ZeroQ: ``--hf`` writes Hugging Face's directory
(``save_pretrained``'s names and shards) with each LoRA module merged, which ``LlamaForCausalLM.from_pretrained``
loads and whose logits are the unmerged PEFT model's within 1e-5; ``--adapters-only`` writes the trainable
parameters alone. A tiny Llama (built from code, nothing downloaded) with LoRA on every linear layer of its blocks
is trained 3 steps under Fabric (stage 3, 2 ranks), saved with and without ``exclude_frozen_parameters``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq.cli.convert import main

pytestmark = [pytest.mark.launch, pytest.mark.hf]
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("safetensors")

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TOL = 1e-5


def _base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def _peft(base=None, **lora):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base if base is not None else _base(), LoraConfig(**{**LORA, **lora}))


def _train(root: str) -> dict:
    """Rank 0 saves the base (``save_pretrained``) and the adapter's config; every rank trains the same PEFT model
    3 steps under Fabric, saved as ``excluded`` (``exclude_frozen_parameters=True``; also ``no_optimizer``) and
    ``whole``. Returns the trained weights (every name, full) of both runs."""
    import lightning as L
    from lightning_zeroq import ZeroQFabricStrategy

    rank, out = dist.get_rank(), {}
    for name, exclude in (("excluded", True), ("whole", False)):
        base = _base()
        if rank == 0 and exclude:
            base.save_pretrained(os.path.join(root, "base"))
        model = _peft(base)
        if rank == 0 and exclude:
            model.peft_config["default"].save_pretrained(os.path.join(root, "adapter"))
        strategy = ZeroQFabricStrategy(stage=3, stage3_param_persistence_threshold=0, exclude_frozen_parameters=exclude)
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fabric.launch()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
        assert fabric.strategy.engine.parts.frozen is not None  # the blocks' base is sharded with them
        for step in range(3):
            tokens = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
            fabric.backward(model(input_ids=tokens, labels=tokens).loss)
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(os.path.join(root, name), {"model": model, "optimizer": optimizer})
        if exclude:
            fabric.save(os.path.join(root, "no_optimizer"), {"model": model})
        out[name] = fabric.strategy.full_state_dict()
    return out


@pytest.fixture(scope="module")
def trained(dist_pool, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("export")
    weights = dist_pool(2).run(_train, str(root))[0]
    return root, weights


TOKENS = torch.randint(0, TINY["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(99))


@torch.no_grad()
def _peft_logits(weights: dict, **lora) -> torch.Tensor:
    """The reference: the unmerged PEFT model's forward with the trained weights."""
    model = _peft(**lora)
    model.load_state_dict(weights, strict=True)
    return model.eval()(input_ids=TOKENS).logits


@torch.no_grad()
def _served_logits(directory: Path) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(directory).eval()(input_ids=TOKENS).logits


def _written(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote model")]


@pytest.mark.parametrize("saved, base", [("excluded", True), ("whole", False), ("whole", True)],
                         ids=["excluded+base", "whole", "whole+base"])
def test_the_merged_export_serves_as_the_peft_model(trained, tmp_path, capsys, saved, base):
    root, weights = trained
    out = tmp_path / "served"
    args = [str(root / saved), str(out), "--hf", "--peft-config", str(root / "adapter")]
    assert main(args + (["--base", str(root / "base")] if base else [])) == 0
    assert _written(capsys) == ["wrote model.safetensors (21 tensors, 0.1 MiB) [1/1]"]
    if not base:  # no --base: the user copies the base model's config.json, as the command's note says
        (out / "config.json").write_bytes((root / "base" / "config.json").read_bytes())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(_base().state_dict()) and f.metadata() == {"format": "pt"}
    reference = _peft_logits(weights[saved])
    served = _served_logits(out)
    assert (reference - _served_logits(root / "base")).abs().max() > 1e-3  # the adapter changes the model
    worst = (served - reference).abs().max().item()
    print(f"{saved}{'+base' if base else ''}: merged export vs the PEFT model's forward, max |logits diff| = {worst:.3g}")
    assert worst <= TOL, worst


def test_shards_and_index_as_save_pretrained_writes_them(trained, tmp_path, capsys):
    root, weights = trained
    out = tmp_path / "sharded"
    assert main([str(root / "excluded"), str(out), "--hf", "--peft-config", str(root / "adapter"),
                 "--base", str(root / "base"), "--max-shard-size", "20KB"]) == 0
    lines = _written(capsys)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert [re.sub(r" \(.*\)", "", line) for line in lines] == [f"wrote {f} [{i}/{count}]" for i, f in
                                                                enumerate(files, 1)]
    assert not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "model.safetensors.index.json", "config.json",
                                                            "generation_config.json"])
    from safetensors import safe_open

    total, where = 0, {}
    for file in files:
        with safe_open(str(out / file), framework="pt") as f:
            size = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
            assert size <= 20_000 or len(list(f.keys())) == 1, (file, size)
            total += size
            where.update(dict.fromkeys(f.keys(), file))
    assert index["weight_map"] == where and set(where) == set(_base().state_dict())
    assert index["metadata"]["total_size"] == total
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in _base().parameters())
    # save_pretrained's own cut of the same tensors at the same size: the same files, each with the same tensors
    reference = tmp_path / "reference"
    merged = _peft()
    merged.load_state_dict(weights["excluded"])
    merged.merge_and_unload().save_pretrained(reference, max_shard_size="20KB")
    theirs = json.loads((reference / "model.safetensors.index.json").read_text())
    assert theirs["weight_map"] == index["weight_map"] and theirs["metadata"]["total_size"] == total
    assert (_served_logits(out) - _peft_logits(weights["excluded"])).abs().max() <= TOL


@pytest.mark.parametrize("how", ["flags", "rslora-config", "rslora-flag"])
def test_the_scale_comes_from_the_config_or_the_flags(trained, tmp_path, how):
    root, weights = trained
    out = tmp_path / how
    args = [str(root / "whole"), str(out), "--hf", "--base", str(root / "base")]
    rslora = how.startswith("rslora")
    if how == "flags":
        args += ["--lora-alpha", "8", "--lora-r", "4"]
    elif how == "rslora-config":
        config = json.loads((root / "adapter" / "adapter_config.json").read_text())
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
        args += ["--peft-config", str(tmp_path / "adapter_config.json")]
    else:
        args += ["--peft-config", str(root / "adapter"), "--use-rslora"]
    assert main(args) == 0
    assert (_served_logits(out) - _peft_logits(weights["whole"], use_rslora=rslora)).abs().max() <= TOL


VARIANTS = {
    # LoRA on the embedding (lora_embedding_A/B), the head trained as a copy (modules_to_save), saved without the
    # frozen base.
    "llama-embedding-copy": {"lora": {"target_modules": ["embed_tokens", "q_proj", "v_proj"],
                                      "modules_to_save": ["lm_head"]}, "exclude": True},
    # GPT-2's Conv1D layers store their weight (in, out): fan_in_fan_out; with a bias on every lora_B (lora_bias).
    "gpt2-fan-in-fan-out-bias": {"lora": {"target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True,
                                          "lora_bias": True}, "exclude": False},
}


def _variant_model(kind: str):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind.startswith("gpt2"):
        base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    else:
        base = _base()
    return base, lambda: get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                         **VARIANTS[kind]["lora"]))


def _save_variant(root: str, kind: str) -> dict:
    """Factors at random (``init_lora_weights=False``; a trained copy of the head perturbed), no step: saved under
    Fabric, stage 2, 2 ranks."""
    import lightning as L
    from lightning_zeroq import ZeroQFabricStrategy

    base, wrap = _variant_model(kind)
    if dist.get_rank() == 0:
        base.save_pretrained(os.path.join(root, f"{kind}-base"))
    model = wrap()
    if dist.get_rank() == 0:
        model.peft_config["default"].save_pretrained(os.path.join(root, f"{kind}-adapter"))
    for name, p in model.named_parameters():
        if ".modules_to_save." in name:
            p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    strategy = ZeroQFabricStrategy(stage=2, exclude_frozen_parameters=VARIANTS[kind]["exclude"])
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.save(os.path.join(root, kind), {"model": model, "optimizer": optimizer})
    return fabric.strategy.full_state_dict()


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_embedding_factors_lora_bias_module_copies_and_fan_in_fan_out_merge(dist_pool, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    weights = dist_pool(2).run(_save_variant, str(tmp_path), kind)[0]
    out = tmp_path / "served"
    assert main([str(tmp_path / kind), str(out), "--hf", "--peft-config", str(tmp_path / f"{kind}-adapter"),
                 "--base", str(tmp_path / f"{kind}-base")]) == 0
    _, wrap = _variant_model(kind)
    reference = wrap()
    reference.load_state_dict(weights, strict=True)
    with torch.no_grad():
        want = reference.eval()(input_ids=TOKENS).logits
        served = AutoModelForCausalLM.from_pretrained(out).eval()
        base = AutoModelForCausalLM.from_pretrained(tmp_path / f"{kind}-base").eval()
        assert (base(input_ids=TOKENS).logits - want).abs().max() > 1e-3
        worst = (served(input_ids=TOKENS).logits - want).abs().max().item()
    print(f"{kind}: merged export vs the PEFT model's forward, max |logits diff| = {worst:.3g}")
    assert worst <= TOL, worst


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeroq-convert: error: "), err
    return err


@pytest.mark.parametrize("failure", ["full-disk", "ctrl-c"])
def test_a_failure_half_way_leaves_nothing(trained, tmp_path, monkeypatch, capsys, failure):
    root, _ = trained
    from lightning_zeroq.checkpoint import hf_export

    real, calls = hf_export.read_tensor, []

    def failing(opened, key):
        calls.append(key)
        if len(calls) == 25:  # a few shards in
            raise OSError(28, "No space left on device") if failure == "full-disk" else KeyboardInterrupt()
        return real(opened, key)

    monkeypatch.setattr(hf_export, "read_tensor", failing)
    out = tmp_path / "served"
    code = main([str(root / "whole"), str(out), "--hf", "--peft-config", str(root / "adapter"), "--max-shard-size",
                 "20KB"])
    printed = capsys.readouterr()
    assert printed.out.count("wrote model-") >= 2 and len(calls) == 25  # shards were written before it failed
    if failure == "full-disk":
        assert code == 1 and "No space left on device" in printed.err and f"{out} was not written" in printed.err
    else:
        assert code == 130 and "interrupted" in printed.err
    assert os.listdir(tmp_path) == []  # neither the output nor the temporary directory


@pytest.mark.parametrize("case", ["no-base", "wrong-r", "not-empty", "no-alpha", "optimizer"])
def test_what_cannot_be_exported_is_one_line(trained, tmp_path, capsys, case):
    root, _ = trained
    out = tmp_path / "served"
    args = {"no-base": [str(root / "excluded"), str(out), "--hf", "--peft-config", str(root / "adapter")],
            "wrong-r": [str(root / "whole"), str(out), "--hf", "--lora-alpha", "8", "--lora-r", "8"],
            "not-empty": [str(root / "whole"), str(root / "base"), "--hf", "--peft-config", str(root / "adapter")],
            "no-alpha": [str(root / "whole"), str(out), "--hf"],
            "optimizer": [str(root / "whole"), str(out), "--hf", "--optimizer"]}[case]
    if case == "optimizer":
        with pytest.raises(SystemExit):
            main(args)
        assert "--hf writes the merged weights alone" in capsys.readouterr().err
        return
    before = sorted(os.listdir(root / "base"))
    assert main(args) == 1
    said = {"no-base": "exclude_frozen_parameters=True: it lacks the frozen base", "wrong-r": "rank 4, but the flags say r=8",
            "not-empty": "is a directory that is not empty", "no-alpha": "pass --peft-config adapter_config.json"}[case]
    assert said in _one_line(capsys)
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(root / "base")) == before


@pytest.mark.parametrize("saved", ["excluded", "whole"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_adapters_only_writes_the_trainable_parameters_alone(trained, tmp_path, capsys, saved, suffix):
    root, weights = trained
    out = tmp_path / f"adapters{suffix}"
    assert main([str(root / saved), str(out), "--adapters-only"]) == 0
    if suffix == ".pt":
        written = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        written = load_file(out)
    trainable = {n for n, p in _peft().named_parameters() if p.requires_grad}
    assert set(written) == trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for name, value in written.items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[saved][name]), name


def test_adapters_only_needs_the_optimizer_state_and_a_plain_export_says_what_it_lacks(trained, tmp_path, capsys):
    root, _ = trained
    assert main([str(root / "no_optimizer"), str(tmp_path / "a.pt"), "--adapters-only"]) == 1
    assert "holds no optimizer state, whose param groups name the trainable parameters" in _one_line(capsys)
    assert main([str(root / "excluded"), str(tmp_path / "all.pt")]) == 0
    said = capsys.readouterr().out
    assert "note: " in said and "exclude_frozen_parameters=True" in said and "strict=False" in said, said
    stored = torch.load(tmp_path / "all.pt", weights_only=True)
    assert stored and all(".lora_" in n for n in stored)
    assert main([str(root / "whole"), str(tmp_path / "b.pt"), "--adapters-only", "--optimizer"]) == 1
    assert "--adapters-only writes the trainable parameters alone" in _one_line(capsys)
