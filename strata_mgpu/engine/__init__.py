"""The engine: requests, scheduling, sampling, and the ModelRunner protocol it drives."""
