"""What the Lightning and Fabric integrations share: option handling and engine construction (``strategy``),
the precision plugin (``precision``) and the watchdog that ends every rank of a stalled job (``watchdog``).
The library (``zero``, ``swap``, ``ops``, ``checkpoint``, ``config``) never imports it."""
