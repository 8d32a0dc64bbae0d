"""``checkpoint/hf_export.py`` without processes: PEFT's names unwrapped, the LoRA scale as PEFT sets it (patterns,
rsLoRA), the adapter config read or refused, shard sizes parsed and cut as ``huggingface_hub`` cuts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_zeroq.checkpoint.convert import ConvertError
from lightning_zeroq.checkpoint.hf_export import LoraSettings, _Output, _shards, hf_name, parse_size


@pytest.mark.parametrize("name, served", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("model.base_model.model.model.norm.weight", "model.norm.weight"),  # a LightningModule's attribute before it
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("base_model.model.lm_head.original_module.weight", None),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # not PEFT's: as it is
])
def test_peft_names_become_the_base_models(name, served):
    assert hf_name(name) == served


def test_the_scale_is_peft_s():
    lora = LoraSettings(r=8, lora_alpha=16, rank_pattern={"q_proj": 4}, alpha_pattern={r"layers\.1\..*v_proj": 2})
    assert lora.scale("model.layers.0.self_attn.k_proj", 8) == 2.0
    assert lora.scale("model.layers.0.self_attn.q_proj", 4) == 4.0
    assert lora.scale("model.layers.1.self_attn.v_proj", 8) == 0.25
    assert lora.scale("model.layers.0.self_attn.v_proj", 8) == 2.0
    assert LoraSettings(r=4, lora_alpha=8, use_rslora=True).scale("x", 4) == 8 / math.sqrt(4)
    assert LoraSettings(lora_alpha=8).scale("x", 2) == 4.0  # r: the factors' rank
    with pytest.raises(ConvertError, match=r"x's LoRA factors have rank 2, but the flags say r=4"):
        LoraSettings(r=4, lora_alpha=8).scale("x", 2)
    with pytest.raises(ConvertError, match="needs lora_alpha: pass --peft-config"):
        LoraSettings().scale("x", 2)


def test_the_adapter_config_is_read_or_refused(tmp_path):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"a": 2}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    lora = LoraSettings.from_peft_config(tmp_path)
    assert (lora.r, lora.lora_alpha, lora.use_rslora, lora.rank_pattern) == (4, 8.0, True, {"a": 2})
    assert lora.replace(lora_alpha=16.0, r=None).lora_alpha == 16.0 and lora.replace(r=None) is lora
    for bad, says in [({**config, "use_dora": True}, "use_dora=true"), ({**config, "peft_type": "IA3"}, "IA3 adapter"),
                      ({**config, "lora_alpha": 0}, "lora_alpha=0 must be a positive number")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps(bad))
        with pytest.raises(ConvertError, match=says):
            LoraSettings.from_peft_config(tmp_path / "adapter_config.json")
    with pytest.raises(ConvertError, match="could not be read as a PEFT adapter_config.json"):
        LoraSettings.from_peft_config(tmp_path / "missing.json")


def test_shard_sizes_parse_and_cut_as_huggingface_hub_does():
    assert (parse_size("5GB"), parse_size("500MB"), parse_size("2GiB"), parse_size(123)) == (5 * 10**9, 5 * 10**8,
                                                                                             2 * 2**30, 123)
    for bad in ("big", "0MB", -1):
        with pytest.raises(ConvertError, match="is not a size"):
            parse_size(bad)
    outputs = [_Output(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5, 8])]
    # huggingface_hub 1.3.7's split_torch_state_dict_into_shards of these at 80 bytes: a tensor over the limit is a
    # shard of its own at once, before the shard being filled
    assert [[o.name for o in shard] for shard in _shards(outputs, 80)] == [["t2"], ["t0", "t1"], ["t3", "t4", "t5"]]
