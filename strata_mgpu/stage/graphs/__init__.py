"""A stage's decode steps as CUDA graphs: one capture, and the graphs of every batch bucket."""
