"""A stage's host memory: exactly-sized pinned buffers, the expert arena, the KV buffer pool."""
