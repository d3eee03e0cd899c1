"""The torchtitan release this plug-in is written against, checked before any import of it.

torchtitan changes its extension points between releases (0.3.0 replaced TOML
configs with Python config functions and removed ``TrainSpec``). At the tested
version (:data:`~ulysses_dtensor.integrations.versions.TESTED`) nothing else
happens here; another one is checked for the hooks and functions the plug-in
relies on (:mod:`ulysses_dtensor.integrations.versions`): a warning when they
are all there, else one message naming what is gone instead of an error deep
inside torchtitan's trainer.
"""

from __future__ import annotations

from ..versions import TESTED, check_version, installed_version

TORCHTITAN_VERSION = TESTED["torchtitan"]
_INSTALL = f"pip install 'ulysses-dtensor[torchtitan]' (torchtitan=={TORCHTITAN_VERSION}, Python >= 3.11)"


def installed_torchtitan_version() -> str | None:
    return installed_version("torchtitan")


def check_torchtitan_version(found: str | None) -> None:
    """ImportError when torchtitan is not installed; at another version than the tested one,
    a warning, or UntestedVersionError when the plug-in's hooks are gone from it."""
    if found is None:
        raise ImportError(
            f"ulysses_dtensor.integrations.torchtitan needs torchtitan=={TORCHTITAN_VERSION}, "
            f"which is not installed: {_INSTALL}"
        )
    check_version("torchtitan", found, user="the Ulysses torchtitan plug-in (UlyssesTorchtitanTrainer)")


def require_torchtitan() -> None:
    check_torchtitan_version(installed_torchtitan_version())
