"""lightning_zeroq: a ZeRO sharded-optimizer strategy for PyTorch Lightning.

``import lightning_zeroq`` registers the strategy names (``"zeroq"``, ``"zeroq_stage_1"``, ...) with
Lightning. Importing initializes no CUDA and compiles nothing.
"""

from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine, register_elementwise_optimizer

__all__ = ["ZeroConfig", "ZeroEngine", "register_elementwise_optimizer"]
__version__ = "0.1.0"
