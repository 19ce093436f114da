"""Runtime: KV cache, model runners, sampling and the engine that drives them."""
