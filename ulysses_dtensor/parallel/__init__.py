"""Sequence parallelism itself: the mesh, the Ulysses exchange (whole, or chunk by
chunk over a rank's heads), ring attention (USP) with its layout, steps and
kernels, tensor parallelism inside a block, the batch slicing and the loss that
keep results equal to one device, the per-token values, whole-sequence joins and
GRPO losses of policy-gradient training, and the counting and timing of the
collectives these add. (Packed documents' ids live one layer down, in
:mod:`ulysses_dtensor.attention.documents`.)"""
