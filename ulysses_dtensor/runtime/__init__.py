"""Processes: process-group lifetime, restarts under torchrun, peers that died
or hang, and "did you mean" for a mistyped name in an error message."""
