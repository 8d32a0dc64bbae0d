"""Before launch: what a configuration needs (``estimate.py``, ``zeroq-plan``), the rates its step time comes
from (``calibrate.py``) and the choice of ``offload="auto"`` / ``activation_checkpointing_policy="auto"`` /
``activation_offloading_policy="auto"`` (``choose.py``). Reads the engine's own arithmetic (``zero/``); the engine
never imports this package."""
