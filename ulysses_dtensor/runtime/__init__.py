"""Processes: process-group lifetime, restarts under torchrun, peers that died
or hang, steps whose loss or gradients are not finite, the CUDA allocator's
setting, and "did you mean" for a mistyped name in an error message."""
