"""The trainer state's JSON codec (``lightning_zeroq/checkpoint/codec.py``): values it must keep."""

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
