"""The Lightning Trainer integration: ``ZeroQStrategy`` (``strategy``), its launcher, and the
checkpoint glue between the Trainer's checkpoint dictionary and the checkpoint format (``checkpoint``)."""
