"""One stage on one device: its memory (VRAM budget, pinned expert arena, ring, expert cache),
the streamed experts, and decode graphs."""
