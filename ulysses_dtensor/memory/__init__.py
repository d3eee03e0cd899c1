"""The long-context memory switches: sequence tiling of the loss and the MLP,
and checkpointed blocks whose saved inputs live in host memory."""
