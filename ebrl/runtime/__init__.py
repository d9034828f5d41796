"""The runtime: the scheduler and its stages, their processes, placement and resources, checkpoints."""
