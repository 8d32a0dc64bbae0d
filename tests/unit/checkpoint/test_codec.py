"""The trainer state's JSON codec (``lightning_zeroq/checkpoint/codec.py``): values it must keep."""

import json

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

import lightning_zeroq.lightning.checkpoint  # noqa: F401  (registers Lightning's and OmegaConf's types)
from lightning_zeroq.checkpoint import codec


def test_omegaconf_hyperparameters_and_their_type_round_trip():
    # Lightning's dump_checkpoint stores OmegaConf hyperparameters with checkpoint["hparams_type"] =
    # type(hparams), the class DictConfig itself; before, every save of such a module was refused.
    state = {"hyper_parameters": OmegaConf.create({"lr": 0.1, "layers": [1, 2]}), "hparams_type": DictConfig,
             "other": ListConfig}
    back = codec.loads(codec.dumps(state))
    assert back["hparams_type"] is DictConfig and back["other"] is ListConfig
    assert isinstance(back["hyper_parameters"], DictConfig) and back["hyper_parameters"] == state["hyper_parameters"]


def test_a_class_that_is_not_registered_is_still_refused():
    class Mine:
        pass

    with pytest.raises(codec.UnsupportedValue, match=r"checkpoint\['hparams_type'\] is a"):
        codec.dumps({"hparams_type": Mine})


@pytest.fixture
def probe(monkeypatch):
    """An environment secret and a resolver the process registered (as ``eval`` is in a common Hydra
    idiom); ``calls`` records every call of the resolver."""
    calls: list = []
    monkeypatch.setenv("ZEROQ_TEST_SECRET", "hunter2-secret")
    OmegaConf.register_new_resolver("zeroq_probe", lambda *args: calls.append(args) or "ran", replace=True)
    yield calls
    OmegaConf.clear_resolver("zeroq_probe")


@pytest.mark.parametrize("value,key", [("${oc.env:ZEROQ_TEST_SECRET}", "db.password"),
                                       ("${zeroq_probe:1}", "db.password"),
                                       ("token=${oc.env:ZEROQ_TEST_SECRET}", "db.password"),
                                       ("\\\\${oc.env:ZEROQ_TEST_SECRET}", "db.password"),  # \\ is no escape
                                       ("\\${x} ${zeroq_probe:3}", "db.password"),
                                       ("${zeroq_probe:2}", "layers[1]")])
def test_interpolations_in_loaded_omegaconf_state_are_never_resolved(probe, value, key):
    plain = {"db": {"password": "plain", "port": 5432}, "layers": [1, 2]}
    if key == "db.password":
        plain["db"]["password"] = value
    else:
        plain["layers"][1] = value
    crafted = json.dumps({"hyper_parameters": {codec.TAG: "type", "name": "DictConfig", "value": plain}})
    try:
        back = codec.loads(crafted)
    except ValueError as error:
        outcome = str(error)
    else:  # what a logger does with hparams (Lightning's save_hparams_to_yaml resolves them)
        outcome = f"loaded: {OmegaConf.to_container(back['hyper_parameters'], resolve=True)}"
    assert probe == [] and "hunter2-secret" not in outcome, outcome
    assert f"checkpoint['hyper_parameters'] holds the OmegaConf interpolation {value!r} at {key}" in outcome, outcome


def test_omegaconf_hyperparameters_are_stored_resolved_and_literals_kept(probe):
    config = OmegaConf.create({
        "model": {"dim": 8, "layers": [{"width": "${model.dim}"}, {"width": 4}], "name": "net-${model.dim}"},
        "paths": ["a\\b", "${model.name}"],
        "literal": "\\${not.an.interpolation} and a\\\\${model.dim}",
        "missing": "???",
        "empty": {}, "none": None, "flag": True, "rate": 0.5,
    })
    back = codec.loads(codec.dumps({"hyper_parameters": config, "hparams_type": DictConfig}))["hyper_parameters"]
    assert isinstance(back, DictConfig) and isinstance(back.model.layers, ListConfig)
    assert OmegaConf.to_container(back, resolve=True) == OmegaConf.to_container(config, resolve=True)
    assert back.model.layers[0].width == 8 and back.paths[1] == "net-8" and back.literal == config.literal
    assert OmegaConf.is_missing(back, "missing") and probe == []
    listed = codec.loads(codec.dumps(OmegaConf.create([1, {"a": [2, 3]}])))
    assert isinstance(listed, ListConfig) and OmegaConf.to_container(listed) == [1, {"a": [2, 3]}]


def test_an_omegaconf_value_that_cannot_be_resolved_fails_the_save_naming_it():
    config = OmegaConf.create({"model": {"dim": "${nowhere.dim}"}})
    with pytest.raises(codec.UnsupportedValue, match=r"checkpoint\['hyper_parameters'\] .*DictConfig.*nowhere"):
        codec.dumps({"hyper_parameters": config})


def test_a_piece_of_the_sharded_model_state_in_the_trainer_state_is_named_as_ours():
    """The engine's own objects (a parameter's chunks) found inside the trainer state: the message says what
    ZeroQ stores where, instead of asking to keep the user's values out."""
    import torch

    from lightning_zeroq.checkpoint.chunks import LocalChunks

    chunks = LocalChunks(torch.Size([4, 2]), torch.float32, 0, 4)
    with pytest.raises(codec.UnsupportedValue) as info:
        codec.encode({"ema": {"current": {"w": chunks}}}, "the checkpoint")
    message = str(info.value)
    assert message.startswith("the checkpoint['ema']['current']['w'] is a lightning_zeroq.checkpoint.chunks.LocalChunks")
    assert "part of the module's sharded state" in message and "'current_model_state'" in message
    assert "Keep such values out" not in message
