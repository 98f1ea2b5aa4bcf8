"""Training: the loop, its run directory, torchrun's ranks, the built-in demo."""
