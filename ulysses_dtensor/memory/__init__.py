"""The long-context memory switches: sequence tiling of the loss and the MLP,
checkpointed blocks whose saved inputs live in host memory, and full
checkpointing that keeps the attention kernels' outputs (``save_attention``)."""
