"""strata-mgpu: serve Mixture-of-Experts GGUF models with experts streamed from pinned host RAM."""

__version__ = "0.1.0"

from strata_mgpu import env as _env

_env.default_omp_wait_policy()  # before torch is imported: libgomp reads it as it loads
