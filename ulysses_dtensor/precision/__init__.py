"""Compute precision of the model's matmuls: FP8 linear layers (torchao's float8 training),
with the dynamic scales made independent of the mesh under sequence parallelism."""
