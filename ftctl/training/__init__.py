"""The unified training loop and what it writes: metrics, checkpoints, the final result."""
