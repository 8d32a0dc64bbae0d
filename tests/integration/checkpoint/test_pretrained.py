"""Pretrained weights into a built engine (``lightning_zeroq.load_pretrained``, ``checkpoint/pretrained.py``).

A tiny Llama is saved once as a sharded Hugging Face checkpoint (six safetensors files and their index), one
``model.safetensors``, a LitGPT-style ``lit_model.pth`` (also nested under ``"model"``) and a DCP directory;
each loads into engines whose ranks start from other random weights, at 2 and 3 gloo ranks, and the engine's
full state is bitwise ``from_pretrained``'s. What each rank reads is counted: from safetensors and torch files
exactly its own ranges (its shards' bytes, in the file's dtype) and the tensors it holds whole, never more than
one tensor's box at a time; from DCP the stored items that hold its ranges. Bad inputs are one line, the same
on every rank, before any weight changes. A PEFT LoRA model loads its base from the plain checkpoint.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq
from lightning_zeroq import ZeroQFabricStrategy, ZeroQStrategy, peft_name_map
from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine
from lightning_zeroq.zero.state_dict import ShardedView

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.launch, pytest.mark.hf]

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = torch.arange(24).reshape(2, 12) % 64


def _llama(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def _lora(seed: int):
    import peft

    model = _llama(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("pretrained")
    model = _llama(1234)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    paths = {"hf": root / "hf", "single": root / "single", "lit": root / "lit_model.pth",
             "nested": root / "nested" / "lit_model.pth", "dcp": root / "dcp"}
    model.save_pretrained(paths["hf"], max_shard_size="20KB")
    model.save_pretrained(paths["single"])
    torch.save(state, paths["lit"])
    paths["nested"].parent.mkdir()
    torch.save({"model": state, "iter_num": 7}, paths["nested"])
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process saves, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(paths["dcp"]), no_dist=True)
    reference = transformers.LlamaForCausalLM.from_pretrained(paths["hf"])
    with torch.no_grad():
        logits = reference(TOKENS).logits
    # The bad inputs: each one thing wrong.
    bad = root / "bad"
    bad.mkdir()
    lacking = dict(state)
    del lacking["model.layers.1.mlp.down_proj.weight"]
    save_file(lacking, bad / "missing.safetensors", metadata={"format": "pt"})
    save_file({**state, "model.layers.2.mlp.down_proj.weight": torch.zeros(32, 64)}, bad / "unexpected.safetensors",
              metadata={"format": "pt"})
    save_file({**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(48, 32)}, bad / "shape.safetensors",
              metadata={"format": "pt"})
    save_file({**state, "model.norm.weight": torch.zeros(32, dtype=torch.int32)}, bad / "dtype.safetensors",
              metadata={"format": "pt"})
    shutil.copytree(paths["hf"], bad / "truncated")
    shard = bad / "truncated" / "model-00003-of-00006.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    shutil.copytree(paths["hf"], bad / "lost_shard")
    (bad / "lost_shard" / "model-00004-of-00006.safetensors").unlink()
    return {"paths": {k: str(v) for k, v in paths.items()}, "bad": str(bad), "reference": reference.state_dict(),
            "logits": logits, "largest": max(v.numel() * v.element_size() for v in state.values()),
            "total": sum(v.numel() * v.element_size() for v in state.values())}


def _load(path: str, stage: int, **kwargs) -> dict:
    rank = dist.get_rank()
    model = _llama(100 + rank)  # another start on every rank: the engine takes rank 0's, the load replaces it
    engine = ZeroEngine(model, ZeroConfig(stage=stage))
    report = lightning_zeroq.load_pretrained(model, path, **kwargs)
    with torch.no_grad():
        logits = model(TOKENS).logits
    view = ShardedView(engine.parts, None)
    ranges = {pv.name: pv.part.numel for pv in view.params if pv.part is not None}
    whole = {k: v.numel() * v.element_size() for k, v in view.unmanaged().items() if isinstance(v, torch.Tensor)}
    return {"full": engine.full_state_dict(), "report": report, "ranges": ranges, "whole": whole, "logits": logits}


def _check(results: list[dict], saved: dict) -> list[int]:
    """Every rank holds from_pretrained's weights, bitwise, and computes its logits; returns each rank's share."""
    shares = []
    for r in results:
        assert set(r["full"]) == set(saved["reference"])
        for name, value in saved["reference"].items():
            assert torch.equal(r["full"][name], value), name
        torch.testing.assert_close(r["logits"], saved["logits"], rtol=0, atol=1e-6)
        share = sum(n * 4 for n in r["ranges"].values()) + sum(r["whole"].values())  # the checkpoint is fp32
        assert r["report"].share_bytes == share
        shares.append(share)
    assert sum(shares) >= saved["total"]  # together the ranks read the whole checkpoint
    return shares


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_safetensors_load_into_stage_3_reading_only_each_ranks_ranges(dist_pool, saved, world_size):
    results = dist_pool(world_size).run(_load, saved["paths"]["hf"], 3)
    shares = _check(results, saved)
    for r, share in zip(results, shares):
        report = r["report"]
        assert report.kind == "safetensors" and report.loaded == len(saved["reference"])
        assert report.bytes_read == share  # exactly its own ranges, nothing around them
        assert share <= saved["total"] / world_size + saved["largest"]  # its shards and at most one tensor more
        assert report.largest_read <= saved["largest"]


@pytest.mark.parametrize("stage, which", [(1, "single"), (2, "hf")])
def test_safetensors_load_into_stages_1_and_2(dist_pool, saved, stage, which):
    results = dist_pool(2).run(_load, saved["paths"][which], stage)
    for r, share in zip(results, _check(results, saved)):
        assert r["report"].bytes_read == share < saved["total"]


@pytest.mark.parametrize("which", ["lit", "nested"])
def test_a_torch_state_dict_file_loads_memory_mapped(dist_pool, saved, which):
    results = dist_pool(2).run(_load, saved["paths"][which], 3)
    for r, share in zip(results, _check(results, saved)):
        assert r["report"].kind == "torch" and r["report"].bytes_read == share < saved["total"]
        assert r["report"].largest_read <= saved["largest"]


@pytest.mark.parametrize("world_size, stage", [(2, 3), (3, 2)])
def test_a_dcp_directory_loads_through_the_checkpoint_reader(dist_pool, saved, world_size, stage):
    from lightning_zeroq.checkpoint.safe import read_metadata

    items: dict[str, int] = {}
    for index, info in read_metadata(Path(saved["paths"]["dcp"])).storage_data.items():
        items[index.fqn] = items.get(index.fqn, 0) + info.length
    results = dist_pool(world_size).run(_load, saved["paths"]["dcp"], stage)
    _check(results, saved)
    for r in results:
        report = r["report"]
        assert report.kind == "dcp"
        # DCP's items are read whole: here (saved by one process) each tensor is one item.
        assert report.bytes_read == sum(items[name] for name in r["ranges"]) + sum(
            items[name] for name in r["whole"])
        assert report.bytes_read < sum(items.values())
        assert report.largest_read <= max(items.values())


def _bad_inputs(bad: str, hf: str, lora_hf: str) -> dict:
    model = _llama(100 + dist.get_rank())
    engine = ZeroEngine(model, ZeroConfig(stage=3))
    before = engine.full_state_dict()
    out = {}
    for case, path in [("missing", f"{bad}/missing.safetensors"), ("unexpected", f"{bad}/unexpected.safetensors"),
                       ("shape", f"{bad}/shape.safetensors"), ("dtype", f"{bad}/dtype.safetensors"),
                       ("truncated", f"{bad}/truncated"), ("lost_shard", f"{bad}/lost_shard"),
                       ("nowhere", f"{bad}/nowhere"), ("index_file", f"{bad}/lost_shard/model.safetensors.index.json")]:
        try:
            lightning_zeroq.load_pretrained(model, path)
            out[case] = None
        except CheckpointError as error:
            out[case] = str(error)
    after = engine.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    lora = _lora(100 + dist.get_rank())
    lora_engine = ZeroEngine(lora, ZeroConfig(stage=3))  # noqa: F841  (alive while it loads)
    for case, kwargs in [("lora_names", {}), ("lora_adapters", {"name_map": peft_name_map})]:
        try:
            lightning_zeroq.load_pretrained(lora, lora_hf, **kwargs)
            out[case] = None
        except CheckpointError as error:
            out[case] = str(error)
    return out


BAD = {  # case: what its one line must say
    "missing": ["'model.layers.1.mlp.down_proj.weight'", "not in the checkpoint", "allow_missing"],
    "unexpected": ["'model.layers.2.mlp.down_proj.weight'", "the model lacks", "allow_unexpected"],
    "shape": ["'model.layers.0.mlp.up_proj.weight'", "(64, 32)", "(48, 32)", "build the model from the checkpoint"],
    "dtype": ["'model.norm.weight'", "torch.int32", "torch.float32"],
    "truncated": ["model-00003-of-00006.safetensors", "truncated", "download it again"],
    "lost_shard": ["model-00004-of-00006.safetensors", "not in", "download it again"],
    "nowhere": ["nowhere does not exist", "model.safetensors"],
    "index_file": ["model-00004-of-00006.safetensors", "download it again"],
    "lora_names": ["base_model.model.", "name_map=\"peft\"", "\nthe checkpoint holds 21 tensor(s) the model lacks"],
    "lora_adapters": ["lora_A.default.weight", "allow_missing=\"adapters\""],
}


def test_bad_inputs_are_one_line_on_every_rank_before_any_weight_changes(dist_pool, saved):
    pytest.importorskip("peft")
    results = dist_pool(2).run(_bad_inputs, saved["bad"], saved["paths"]["hf"], saved["paths"]["hf"])
    assert all(r["unchanged"] for r in results)
    for case, words in BAD.items():
        message = results[0][case]
        assert message is not None, case
        assert all(r[case] == message for r in results), (case, [r[case] for r in results])  # the same on every rank
        # A PEFT model's names against a plain checkpoint are two problems: its tensors missing, the checkpoint's
        # unexpected (a header line, then one line each); every other case is one line.
        assert len(message.splitlines()) == (3 if case == "lora_names" else 1), (case, message)
        assert message.startswith("Loading pretrained weights from "), message
        for word in words:
            assert word in message, (case, word, message)


def _peft(path: str, stage: int) -> dict:
    lora = _lora(100 + dist.get_rank())
    engine = ZeroEngine(lora, ZeroConfig(stage=stage))
    before = engine.full_state_dict()
    report = lightning_zeroq.load_pretrained(lora, path, name_map=peft_name_map, allow_missing="adapters")
    return {"before": before, "after": engine.full_state_dict(), "report": report,
            "frozen": engine.parts.frozen is not None}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_peft_lora_model_loads_its_base_from_the_plain_checkpoint(dist_pool, saved, stage):
    pytest.importorskip("peft")
    for r in dist_pool(2).run(_peft, saved["paths"]["hf"], stage):
        adapters = {n for n in r["after"] if ".lora_" in n}
        assert len(adapters) == 2 * 2 * 2  # q and v of two layers, A and B
        assert r["frozen"] == (stage == 3)  # stage 3 shards the frozen base with its block's unit
        for name, value in r["after"].items():
            if name in adapters:
                assert torch.equal(value, r["before"][name]), name  # as initialized
            else:
                assert torch.equal(value, saved["reference"][peft_name_map(name)]), name
        assert sorted(r["report"].missing) == sorted(adapters)
        assert r["report"].loaded == len(saved["reference"])


def _strategy(front: str, path: str) -> dict:
    import lightning as L

    world = dist.get_world_size()
    options = {"stage": 3, "pretrained": path, "pretrained_name_map": {"model.": ""}}
    if front == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroQFabricStrategy(**options))
        fabric.launch()  # the pool's processes: this joins their process group
        holder = torch.nn.Module()
        holder.model = _llama(100 + dist.get_rank())
        holder, _ = fabric.setup(holder, torch.optim.SGD(holder.parameters(), lr=0.1))
        return fabric.strategy.full_state_dict()

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama(100 + dist.get_rank())

        def training_step(self, batch, batch_idx):
            return self.model(batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_start(self) -> None:  # before the first step
            self.seen = self.trainer.strategy.full_state_dict()

    lit = Lit()
    data = torch.utils.data.TensorDataset(TOKENS.repeat(2, 1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ZeroQStrategy(**options), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    return lit.seen


@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_the_strategy_option_loads_right_after_the_engine_is_built(dist_pool, saved, front):
    for full in dist_pool(2).run(_strategy, front, saved["paths"]["hf"]):
        assert set(full) == {f"model.{k}" for k in saved["reference"]}
        for name, value in saved["reference"].items():
            assert torch.equal(full[f"model.{name}"], value), name


# ------------------------------------------------------------------ one process, no process group


def test_a_module_without_an_engine_loads_whole(saved):
    model = _llama(5)
    report = lightning_zeroq.load_pretrained(model, saved["paths"]["single"])
    assert report.bytes_read == saved["total"] and report.loaded == len(saved["reference"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["reference"][name]), name


def test_a_submodule_loads_with_names_relative_to_it(saved):
    holder = torch.nn.Module()
    holder.model = _llama(5)
    holder.head = torch.nn.Linear(3, 3)
    head = holder.head.weight.detach().clone()
    engine = ZeroEngine(holder, ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    lightning_zeroq.load_pretrained(holder.model, saved["paths"]["lit"])
    full = engine.full_state_dict()
    assert torch.equal(full["head.weight"], head)  # outside the submodule: untouched
    for name, value in saved["reference"].items():
        assert torch.equal(full[f"model.{name}"], value), name


def test_a_meta_module_without_an_engine_is_refused_in_one_line(saved):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"meta device.*pretrained=<path>") as info:
        lightning_zeroq.load_pretrained(model, saved["paths"]["hf"])
    assert len(str(info.value).splitlines()) == 1
