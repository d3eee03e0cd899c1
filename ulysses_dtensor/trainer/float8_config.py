"""The trainer's ``[float8]`` section as the library's
:class:`~ulysses_dtensor.precision.float8.Float8Options` (None when off)."""

from __future__ import annotations

from ..precision.float8 import Float8Options
from .config_schema import ConfigError

__all__ = ["float8_options"]


def float8_options(cfg) -> Float8Options | None:
    f = cfg.float8
    if not f.enable:
        return None
    try:
        return Float8Options(enable=True, recipe_name=f.recipe_name, filter_fqns=tuple(f.filter_fqns),
                             emulate=f.emulate, enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather)
    except ValueError as e:
        raise ConfigError(str(e).replace("float8 ", "float8.", 1)) from None
