"""``checkpoint/pretrained.py`` without processes: PEFT's names, name maps, allowances, what a path holds, and
what ``match`` says of a checkpoint that does not fit the model (one line per problem, with the fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zeroq.checkpoint.agree import CheckpointError, agree_once
from lightning_zeroq.ranks import LOCAL
from lightning_zeroq.checkpoint.pretrained import (Stored, Wanted, adapter_names, allowance, check_path, locate, match,
                                                   name_mapper, peft_name_map)


@pytest.mark.parametrize("name, key", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
     "model.layers.0.self_attn.q_proj.lora_A.default.weight"),
    ("base_model.model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("model.base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),  # inside a LightningModule
    ("base_model.model.lm_head.original_module.weight", "lm_head.weight"),
    ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),  # not PEFT's: as it is
])
def test_peft_names_become_the_plain_models(name, key):
    assert peft_name_map(name) == key


def test_a_dict_maps_the_longest_matching_prefix():
    mapper = name_mapper({"model.": "", "model.model.": "model.", "": "x."}, "f(name_map=...)")
    assert mapper("model.model.layers.0.w") == "model.layers.0.w"
    assert mapper("model.lm_head.weight") == "lm_head.weight"
    assert mapper("head.weight") == "x.head.weight"
    assert name_mapper(None, "f")("a.b") == "a.b"
    assert name_mapper("peft", "f") is peft_name_map
    assert name_mapper(str.upper, "f")("a") == "A"


@pytest.mark.parametrize("value, says", [
    ("lora", "'lora' is no name map; pass 'peft'"),
    ({"model.": 1}, "'model.': 1 is not a pair of strings"),
    (3, "a int is no name map"),
])
def test_bad_name_maps_are_one_line(value, says):
    with pytest.raises(ValueError, match=r"^f\(name_map=\.\.\.\): " + says.replace("(", r"\(")) as info:
        name_mapper(value, "f(name_map=...)")
    assert len(str(info.value).splitlines()) == 1


class _Tuner(nn.Module):
    """What PEFT's tuner layers look like to the loader: ``adapter_layer_names`` and dicts of adapters."""

    adapter_layer_names = ("lora_A", "lora_B")

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})


def test_adapters_are_the_tuner_layers_adapter_parameters():
    model = nn.Sequential(_Tuner(), nn.Linear(4, 4))
    assert adapter_names(model) == {"0.lora_A.default.weight", "0.lora_B.default.weight"}
    allowed = allowance(["adapters", "1.*"], "f(allow_missing=...)", model)
    assert allowed("0.lora_A.default.weight") and allowed("1.bias")
    assert not allowed("0.base_layer.weight")
    assert allowance(None, "f", model)("x") is False
    assert allowance("*.inv_freq", "f", None)("rotary.inv_freq")
    assert allowance(lambda n: n == "a", "f", None)("a")


@pytest.mark.parametrize("value, module, says", [
    ("adapters", None, "'adapters' names the model's adapter parameters, which are never unexpected"),
    (3, nn.Linear(1, 1), "3 is neither glob patterns"),
    (["a", 2], nn.Linear(1, 1), r"\['a', 2\] is neither glob patterns"),
])
def test_bad_allowances_are_one_line(value, module, says):
    with pytest.raises(ValueError, match=r"^f\(allow=\.\.\.\): " + says):
        allowance(value, "f(allow=...)", module)


def test_what_a_path_holds(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert locate(tmp_path / "dcp") == ("dcp", tmp_path / "dcp")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert locate(tmp_path / "hf") == ("safetensors", tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text("{}")
    assert locate(tmp_path / "hf") == ("safetensors_index", tmp_path / "hf" / "model.safetensors.index.json")
    (tmp_path / "lit").mkdir()
    (tmp_path / "lit" / "lit_model.pth").write_bytes(b"")
    assert locate(tmp_path / "lit") == ("torch", tmp_path / "lit" / "lit_model.pth")
    assert locate(tmp_path / "lit" / "lit_model.pth") == ("torch", tmp_path / "lit" / "lit_model.pth")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no checkpoint this reads; pass a Hugging Face checkpoint"):
        locate(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"inside a torch.distributed.checkpoint directory; pass the directory"):
        locate(tmp_path / "dcp" / ".metadata")


def test_a_path_must_exist_and_be_local(tmp_path):
    assert check_path(str(tmp_path), "f") == tmp_path
    with pytest.raises(ValueError, match=r"^f: .*nowhere does not exist; pass the path of a Hugging Face"):
        check_path(tmp_path / "nowhere", "f")
    with pytest.raises(ValueError, match=r"^f: 'hf://org/model' names a remote file system"):
        check_path("hf://org/model", "f")
    with pytest.raises(ValueError, match=r"^f: 3 is not a path"):
        check_path(3, "f")


def _wanted(name: str, shape=(4, 2), dtype=torch.float32) -> Wanted:
    return Wanted([name], [name], shape, dtype, 8)


ENTRIES = {"model.a.weight": Stored((4, 2), torch.bfloat16), "model.b.weight": Stored((4, 2), torch.float32)}


def test_match_plans_each_key_and_counts_this_ranks_bytes():
    plan = match([_wanted("model.a.weight"), _wanted("model.b.weight")], ENTRIES, lambda n: n, lambda n: False,
                 lambda n: False)
    assert not plan.errors and plan.keys == {"model.a.weight": "model.a.weight", "model.b.weight": "model.b.weight"}
    assert plan.share == 8 * 2 + 8 * 4  # its elements in the checkpoint's dtypes


@pytest.mark.parametrize("wanted, mapper, says", [
    ([_wanted("x.model.a.weight"), _wanted("x.model.b.weight")], None,
     ("2 tensor(s) of the model are not in the checkpoint: 'x.model.a.weight', 'x.model.b.weight'; the checkpoint has "
     "'model.a.weight': name_map={'x.': ''} may be the map.")),
    ([_wanted("a.weight"), _wanted("model.b.weight")], None,
     ("1 tensor(s) of the model are not in the checkpoint: 'a.weight'; the checkpoint has 'model.a.weight': "
     "name_map={'': 'model.'} may be the map.")),
    ([_wanted("model.a.weight", (2, 4)), _wanted("model.b.weight")], None,
     ("'model.a.weight' has shape (2, 4) in the model but (4, 2) in the checkpoint: the checkpoint is another "
     "configuration's; build the model from the checkpoint's config.")),
    ([_wanted("model.a.weight", dtype=torch.int64), _wanted("model.b.weight")], None,
     ("'model.a.weight' is torch.bfloat16 in the checkpoint, the model's 'model.a.weight' is torch.int64: it cannot "
     "hold those values; check name_map (is it another tensor?).")),
    ([_wanted("model.a.weight")], None,
     ("the checkpoint holds 1 tensor(s) the model lacks: 'model.b.weight'; check name_map, or ignore them with "
     "allow_unexpected=[...] (glob patterns).")),
    ([_wanted("model.a.weight"), _wanted("model.b.weight")], lambda n: None,
     "name_map returned None for 'model.a.weight'; it must return the checkpoint's key (a str)."),
])
def test_match_says_each_problem_in_one_line_with_its_fix(wanted, mapper, says):
    plan = match(wanted, ENTRIES, mapper or (lambda n: n), lambda n: False, lambda n: False)
    assert plan.errors[0] == says
    renamed = "name_map={" in says  # the model's names missing, the checkpoint's then unexpected: a second line
    assert len(plan.errors) == 1 + renamed and (not renamed or "the model lacks" in plan.errors[1])


def test_allowed_missing_and_unexpected_are_reported_not_refused():
    plan = match([_wanted("model.a.weight"), _wanted("lora.weight")], ENTRIES, lambda n: n,
                 lambda n: n.startswith("lora"), lambda n: n == "model.b.weight")
    assert not plan.errors and plan.missing == ["lora.weight"] and plan.unexpected == ["model.b.weight"]


def test_tied_names_read_whichever_is_in_the_checkpoint():
    tied = Wanted(["model.a.weight", "lm_head.weight"], ["model.a.weight", "lm_head.weight"], (4, 2),
                  torch.float32, 8)
    plan = match([tied, _wanted("model.b.weight")], ENTRIES, lambda n: n, lambda n: False, lambda n: False)
    assert not plan.errors and plan.keys["model.a.weight"] == "model.a.weight" and "lm_head.weight" not in plan.keys


def test_agree_once_says_one_problem_in_one_line():
    with pytest.raises(CheckpointError) as info:
        agree_once(["a is\nmissing; fix it"], "Loading x", LOCAL)
    assert str(info.value) == "Loading x: a is missing; fix it"
    with pytest.raises(CheckpointError) as info:
        agree_once(["one", "two"], "Loading x", LOCAL)
    assert str(info.value) == "Loading x:\none\ntwo"
    assert agree_once([], "Loading x", LOCAL, payload=3) == [3]


# ------------------------------------------------------------------ the readers, in one process


def _tally():
    from lightning_zeroq.checkpoint.pretrained import Tally

    return Tally("t", 1 << 40, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_each_reader_reads_exactly_a_flat_range_box_by_box(tmp_path, dtype):
    from safetensors.torch import save_file

    from lightning_zeroq.checkpoint.chunks import LocalChunks
    from lightning_zeroq.checkpoint.pretrained import SafetensorsSource, TorchFileSource

    state = {"a": (torch.arange(3 * 5 * 7) * 3 - 50).to(dtype).reshape(3, 5, 7), "b": torch.arange(11).to(dtype),
             "s": torch.tensor(4).to(dtype)}
    save_file(state, tmp_path / "m.safetensors")
    torch.save({"model": state, "step": 3}, tmp_path / "lit_model.pth")
    for source in (SafetensorsSource(tmp_path / "m.safetensors", index=False), TorchFileSource(tmp_path / "lit_model.pth")):
        assert not source.problems and {k: (e.shape, e.dtype) for k, e in source.entries.items()} == {
            k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        for start, stop in [(0, 105), (3, 4), (6, 71), (34, 36), (70, 105)]:
            target = torch.full((stop - start,), -1.0, dtype=torch.float64)
            whole = torch.zeros(11, dtype=torch.float64)
            tally = _tally()
            source.read([("a", LocalChunks(torch.Size((3, 5, 7)), torch.float64, start, stop - start, target=target)),
                         ("b", whole)], tally)
            assert torch.equal(target, state["a"].reshape(-1)[start:stop].double())
            assert torch.equal(whole, state["b"].double())
            assert tally.read == (stop - start + 11) * state["a"].element_size()  # exactly the range and the whole
        scalar = torch.zeros(1, dtype=torch.float64)
        source.read([("s", LocalChunks(torch.Size(()), torch.float64, 0, 1, target=scalar))], _tally())
        assert scalar.item() == 4
        source.close()


def test_what_is_wrong_with_a_torch_file_is_one_line(tmp_path):
    from lightning_zeroq.checkpoint.pretrained import TorchFileSource

    torch.save({"a": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "garbage.pt").write_bytes(b"hello world")
    torch.save({"a": torch.ones(2), "opt": torch.optim.SGD}, tmp_path / "object.pt")
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    data = (tmp_path / "list.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    says = {"legacy.pt": "saved in torch's legacy format, which cannot be memory-mapped",
            "garbage.pt": "is no torch.save file (it starts with neither a zip nor a pickle header)",
            "object.pt": "holds objects other than tensors and plain values (torch.optim.sgd.SGD)",
            "list.pt": "holds a list, not a state dict",
            "cut.pt": "cannot be read (RuntimeError: PytorchStreamReader failed reading zip archive"}
    for name, words in says.items():
        problems = TorchFileSource(tmp_path / name).problems
        assert len(problems) == 1 and words in problems[0] and "\n" not in problems[0], (name, problems)


def test_what_is_wrong_with_a_safetensors_checkpoint_is_one_line(tmp_path):
    import json

    from safetensors.torch import save_file

    from lightning_zeroq.checkpoint.pretrained import SafetensorsSource

    save_file({"a": torch.ones(4, 4)}, tmp_path / "one.safetensors")
    save_file({"b": torch.ones(4)}, tmp_path / "two.safetensors")
    data = (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])

    def index(weight_map) -> SafetensorsSource:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return SafetensorsSource(tmp_path / "model.safetensors.index.json", index=True)

    assert not index({"a": "one.safetensors", "b": "two.safetensors"}).problems
    cases = [
        (index({"a": "one.safetensors", "b": "three.safetensors"}), "names 1 file(s) that are not in"),
        (index({"a": "two.safetensors"}), "places 1 tensor(s) in files that do not hold them: 'a' in two.safetensors"),
        (index({"a": "../one.safetensors"}), "names the file '../one.safetensors', which is not a file beside it"),
        (index({"a": "cut.safetensors"}), "cut.safetensors cannot be read (SafetensorError"),
        (SafetensorsSource(tmp_path / "cut.safetensors", index=False), "the file is truncated or damaged"),
    ]
    (tmp_path / "bad.safetensors.index.json").write_text("{not json")
    cases.append((SafetensorsSource(tmp_path / "bad.safetensors.index.json", index=True), "cannot be read"))
    for source, words in cases:
        assert len(source.problems) == 1 and words in source.problems[0], (words, source.problems)
        source.close()
