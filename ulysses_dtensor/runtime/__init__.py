"""Processes and how a run ends: process-group lifetime, restarts under torchrun,
peers that died or hang, and the one-line errors a user can act on."""
