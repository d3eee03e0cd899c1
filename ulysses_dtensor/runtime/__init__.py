"""Processes: process-group lifetime, restarts under torchrun, peers that died
or hang, an error's message once per node whichever rank exits first, steps whose
loss or gradients are not finite, the CUDA allocator's setting, and "did you
mean" for a mistyped name in an error message."""
