"""``torch.optim`` bound to the shards: elementwise optimizers bound to master segments (``binding.py``) and
optimizers that need whole matrices, such as Muon (``matrix.py``)."""
