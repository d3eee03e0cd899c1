"""Sequence parallelism itself: the mesh, the Ulysses exchange, ring attention
(USP) with its layout and kernels, tensor parallelism inside a block, the batch
slicing and the loss that keep results equal to one device, the per-token values,
whole-sequence joins and GRPO losses of policy-gradient training, packed documents,
and the counting and timing of the collectives these add."""
