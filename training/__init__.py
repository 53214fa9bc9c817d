"""Training: models, parallelism, data loading, optimizer, trainer, checkpoints."""
