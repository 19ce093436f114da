"""Kernels: each op as a plain torch twin and a CUDA version (cuda_src/, loaded through NVRTC)."""
