"""What the engine counts: the host (``host.py``) and device (``device.py``) bytes a configuration needs,
checked when the engine is built and when the optimizer is attached, and read by ``lightning_zeroq.planning``."""
