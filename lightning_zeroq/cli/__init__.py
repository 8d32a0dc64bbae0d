"""``zeroq-train`` (``train``): Hydra recipes in, a Lightning run with ``ZeroQStrategy`` out, with its demo
model (``gpt``), its data (``data``), its run config and preflight checks (``config``), and ``conf``/``recipes``
(links to the top of the repository)."""
