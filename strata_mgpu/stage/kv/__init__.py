"""A stage's KV: the two-tier cache (older cells in pinned host RAM) and the allocation of its
sequences' caches within the VRAM plan."""
