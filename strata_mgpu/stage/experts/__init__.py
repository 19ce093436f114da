"""A stage's routed experts: the device ring they stream through, the ones resident in VRAM, the
parts of a layer each device computes, the stage's `ExpertBackend`, and what it lends a helper."""
