"""lightning_zeroq: a ZeRO sharded-optimizer strategy for PyTorch Lightning, for the Trainer and Fabric.

``import lightning_zeroq`` registers the strategy names (``"zeroq"``, ``"zeroq_stage_1"``, ...) with
both of Lightning's registries: ``Trainer(strategy="zeroq")`` gets ``ZeroQStrategy`` and
``Fabric(strategy="zeroq")`` gets ``ZeroQFabricStrategy``. Importing initializes no CUDA and compiles
nothing.
"""

import logging

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.fabric.strategy import ZeroQFabricPrecision, ZeroQFabricStrategy
from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.lightning.strategy import ZeroQStrategy

from lightning_zeroq.zero.engine import ZeroEngine, owning_engine
from lightning_zeroq.planning.choose import choose
from lightning_zeroq.zero.optim.matrix import MatrixRule, register_matrix_optimizer
from lightning_zeroq.zero.optim.binding import register_elementwise_optimizer
from lightning_zeroq.planning.estimate import Machine
from lightning_zeroq.planning.estimate import estimate_training as plan

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


__all__ = [
    "ZeroConfig",
    "ZeroEngine",
    "ZeroQFabricPrecision",
    "ZeroQFabricStrategy",
    "ZeroQPrecision",
    "ZeroQStrategy",
    "Machine",
    "MatrixRule",
    "choose",
    "gathered_parameters",
    "plan",
    "register_elementwise_optimizer",
    "register_matrix_optimizer",
]

from lightning_zeroq._version import __version__ as __version__  # noqa: E402  (its one source; pyproject reads it)
