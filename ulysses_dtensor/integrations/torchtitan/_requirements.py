"""The torchtitan release this plug-in is written against, checked before any import of it.

torchtitan changes its extension points between releases (0.3.0 replaced TOML
configs with Python config functions and removed ``TrainSpec``), so another
version fails here with one message instead of deep inside its trainer.
"""

from __future__ import annotations

import importlib.metadata

TORCHTITAN_VERSION = "0.3.0"
_INSTALL = "pip install 'ulysses-dtensor[torchtitan]' (torchtitan==0.3.0, Python >= 3.11)"


def installed_torchtitan_version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_torchtitan_version(found: str | None) -> None:
    """Raise unless ``found`` is the torchtitan version this plug-in supports."""
    if found is None:
        raise ImportError(
            f"ulysses_dtensor.integrations.torchtitan needs torchtitan=={TORCHTITAN_VERSION}, "
            f"which is not installed: {_INSTALL}"
        )
    if found != TORCHTITAN_VERSION:
        raise ImportError(
            f"ulysses_dtensor.integrations.torchtitan supports torchtitan=={TORCHTITAN_VERSION} "
            f"only (its config, model-spec and trainer APIs change between releases); found "
            f"torchtitan=={found}: {_INSTALL}"
        )


def require_torchtitan() -> None:
    check_torchtitan_version(installed_torchtitan_version())
