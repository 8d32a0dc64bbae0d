"""Lightning's own tests (Lightning-AI/pytorch-lightning 2.6), ported to run against zeroq on 2 gloo ranks."""
