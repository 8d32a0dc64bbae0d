"""The ZeRO engine: ``ZeroEngine`` shards a module's parameters (stages 1, 2 and 3) and steps an optimizer on
them; ``README.md`` here maps the rooms, ``docs/DESIGN.md`` the mechanism. Plain PyTorch, the Lightning
strategies and the tests drive it alike; it imports neither Lightning nor ``lightning_zeroq.planning``."""

from lightning_zeroq.zero.engine import ZeroEngine, owning_engine
from lightning_zeroq.zero.optim.binding import register_elementwise_optimizer
from lightning_zeroq.zero.optim.matrix import MatrixRule, register_matrix_optimizer
from lightning_zeroq.zero.state_dict import ShardedView

__all__ = [
    "MatrixRule",
    "ShardedView",
    "ZeroEngine",
    "owning_engine",
    "register_elementwise_optimizer",
    "register_matrix_optimizer",
]
