"""Per-GPU memory of a training layout (estimate; T5 activations in t5) and ``megalith memory`` (cli)."""
