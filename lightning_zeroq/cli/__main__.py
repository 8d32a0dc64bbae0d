"""``python -m lightning_zeroq.cli``: the same as ``zeroq-train``."""

from lightning_zeroq.cli.train import main

main()
