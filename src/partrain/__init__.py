"""partrain: how to parallelize a training job on this hardware, how fast it will be, and run it."""

__version__ = "0.1.0"
