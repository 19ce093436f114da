"""Several stages: the layer split, the hand-over through mapped host memory (exchange), the
PeerPrefill helper and its share rule."""
