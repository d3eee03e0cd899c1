"""The long-context memory switches: sequence tiling of the loss and the MLP,
checkpointed blocks whose saved inputs live in host memory or, through a bounded staging
area, in a file on a local disk (``offload_dir``), and full checkpointing that keeps the
attention kernels' outputs (``save_attention``)."""
