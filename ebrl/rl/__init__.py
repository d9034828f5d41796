"""RL algorithms over action chunks."""
