"""kvfleet runtime: the prefix-KV cache library that lives inside every replica, and its tools.

The pure core (break-even arithmetic, keys, index, policies, routing) never imports torch;
only the modules that touch tensors do.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
