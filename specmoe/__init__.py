"""specmoe: a research testbed for decoding offloaded Mixture-of-Experts models."""

__version__ = "0.1.0"
