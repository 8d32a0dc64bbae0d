"""``zeroq-train`` (``train``): Hydra recipes in, a Lightning run with ``ZeroQStrategy`` out, with its demo
model (``gpt``), its data (``data``), its run config and preflight checks (``config``), and ``conf``/``recipes``
(the repository's top-level folders, which the wheel carries here)."""
