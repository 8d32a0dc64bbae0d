"""lightning_zeroq: a ZeRO sharded-optimizer strategy for PyTorch Lightning, for the Trainer and Fabric.

``import lightning_zeroq`` registers the strategy names (``"zeroq"``, ``"zeroq_stage_1"``, ...) with
both of Lightning's registries: ``Trainer(strategy="zeroq")`` gets ``ZeroQStrategy`` and
``Fabric(strategy="zeroq")`` gets ``ZeroQFabricStrategy``. Importing initializes no CUDA and compiles
nothing.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.fabric import ZeroQFabricPrecision, ZeroQFabricStrategy
from lightning_zeroq.precision import ZeroQPrecision
from lightning_zeroq.strategy import ZeroQStrategy
from lightning_zeroq.zero.engine import ZeroEngine
from lightning_zeroq.zero.optimizers import register_elementwise_optimizer

ZeroQStrategy.register_strategies(StrategyRegistry)
ZeroQFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "ZeroConfig",
    "ZeroEngine",
    "ZeroQFabricPrecision",
    "ZeroQFabricStrategy",
    "ZeroQPrecision",
    "ZeroQStrategy",
    "register_elementwise_optimizer",
]
__version__ = "0.1.0"
