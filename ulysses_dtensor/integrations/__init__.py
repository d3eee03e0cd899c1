"""Plug-ins that bring Ulysses SP into other frameworks (each needs its extra)."""
