"""torchtitan-style trainer: TOML config + CLI overrides, train loop, DCP checkpoints, metrics.

Entry point: ``torchrun --nproc_per_node=N -m ulysses_dtensor.train --config FILE``.
"""

from .config import ConfigError, JobConfig, load_config, parse_config, validate_config

__all__ = ["ConfigError", "JobConfig", "load_config", "parse_config", "validate_config", "train"]


def __getattr__(name):
    if name == "train":
        from .loop import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
