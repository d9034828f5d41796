"""The runtime: supervisor, schedulers, checkpoints."""
