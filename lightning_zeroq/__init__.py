"""lightning_zeroq: a ZeRO sharded-optimizer strategy for PyTorch Lightning, for the Trainer and Fabric.

``import lightning_zeroq`` registers the strategy names (``"zeroq"``, ``"zeroq_stage_1"``, ...) with
both of Lightning's registries: ``Trainer(strategy="zeroq")`` gets ``ZeroQStrategy`` and
``Fabric(strategy="zeroq")`` gets ``ZeroQFabricStrategy``. Importing initializes no CUDA and compiles
nothing.
"""

import logging
from typing import Optional

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zeroq.checkpoint.pretrained import PretrainedReport, peft_name_map
from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.fabric.strategy import ZeroQFabricPrecision, ZeroQFabricStrategy
from lightning_zeroq.lightning.strategy import ZeroQStrategy
from lightning_zeroq.planning.choose import choose
from lightning_zeroq.planning.estimate import Machine
from lightning_zeroq.planning.estimate import estimate_training as plan
from lightning_zeroq.zero.engine import ZeroEngine, owning_engine
from lightning_zeroq.zero.optim.binding import register_elementwise_optimizer
from lightning_zeroq.zero.optim.matrix import MatrixRule, register_matrix_optimizer

ZeroQStrategy.register_strategies(StrategyRegistry)
ZeroQFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

# Step skips (fp16 overflow) and similar events are logged at INFO, as Lightning logs its own: to the
# console unless the application configured logging itself.
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers():
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False


def gathered_parameters(module, writeback: bool = False):
    """Collective context manager (every rank enters it): inside, ``module``'s parameters are plain
    tensors holding their full fp32 values, also with ZeRO stage 3 (like FSDP's
    ``summon_full_params`` and DeepSpeed's ``GatheredParameters``); ``writeback=True`` keeps what the
    block changed. A module no engine shards is left as it is."""
    import contextlib

    from lightning_zeroq.zero import full_params

    full_params.check_module("lightning_zeroq.gathered_parameters", module)
    engine = owning_engine(module)
    return engine.gathered_parameters(module, writeback) if engine is not None else contextlib.nullcontext()


def load_pretrained(
    model, path, *, name_map=None, allow_missing=None, allow_unexpected=None, progress_bytes: int = 1 << 30
):
    """Collective (every rank calls it): load pretrained weights into ``model`` (a module, or a ``ZeroEngine``)
    without the whole model anywhere. Where an engine shards the module (stages 1-3: after ``fabric.setup``, or
    in the Trainer from ``on_fit_start`` on), each rank reads only its own ranges of the checkpoint, memory-mapped,
    straight into its fp32 master shards and stage 3's frozen shards, and the tensors every rank holds whole
    (buffers, frozen parameters no unit shards) into the module; a module no engine shards gets every tensor
    (a module on the meta device is refused: pass ``pretrained=`` to the strategy instead).

    ``path``: a Hugging Face checkpoint (``model.safetensors``, or ``model.safetensors.index.json`` and its
    shards, or their directory), a ``torch.save`` state dict (LitGPT's ``lit_model.pth``; also under a
    ``"model"`` or ``"state_dict"`` key) or a ``torch.distributed.checkpoint`` directory. ``name_map``: the
    model's name (relative to ``model``) -> the checkpoint's key: a dict of prefixes (``{"model.": ""}``), a
    function, or ``"peft"`` (``peft_name_map``). ``allow_missing``: the model's tensors the checkpoint may lack
    (left as they are): glob patterns, a function of the name, or ``"adapters"`` (PEFT's adapter parameters).
    ``allow_unexpected``: checkpoint keys the model may lack (not read). Everything is validated on every rank
    before any weight changes; a problem is one ``CheckpointError``, the same on every rank. Returns a
    ``PretrainedReport`` (what was read, left and ignored on this rank). See docs/finetuning.md."""
    from lightning_zeroq.checkpoint import pretrained

    engine: Optional[ZeroEngine] = None
    if isinstance(model, ZeroEngine):
        if model.parts.retired:
            raise ValueError(
                "load_pretrained: this engine handed its module back (the fit ended); load into the module instead."
            )
        engine, module = model, model.parts.module
    else:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"load_pretrained takes an nn.Module or a ZeroEngine, got {type(model).__name__}.")
        engine, module = owning_engine(model), model
    return pretrained.load_pretrained(
        engine,
        module,
        path,
        name_map=name_map,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        progress_bytes=progress_bytes,
    )


__all__ = [
    "ZeroConfig",
    "ZeroEngine",
    "ZeroQFabricPrecision",
    "ZeroQFabricStrategy",
    "ZeroQPrecision",
    "ZeroQStrategy",
    "Machine",
    "MatrixRule",
    "PretrainedReport",
    "choose",
    "gathered_parameters",
    "load_pretrained",
    "peft_name_map",
    "plan",
    "register_elementwise_optimizer",
    "register_matrix_optimizer",
]

from lightning_zeroq._version import __version__ as __version__  # noqa: E402  (its one source; pyproject reads it)
