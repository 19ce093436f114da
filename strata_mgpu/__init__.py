"""strata-mgpu: serve Mixture-of-Experts GGUF models with experts streamed from pinned host RAM."""

__version__ = "0.1.0"
