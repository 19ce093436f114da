"""One stage on one device: its device context and streams, its VRAM plan, its host memory, its
experts, its KV and its decode graphs, composed into a `Stage` by `build.build_stage`."""
