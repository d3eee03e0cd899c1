"""Library versions checked at start (ulysses_dtensor/integrations/versions.py), and the
trainers' old name ``UlyssesTrainer`` (two classes had it; issue 53), kept for a release.

The checks' logic runs on members of the standard library (no library imported, milliseconds);
the table itself is checked against pyproject.toml's pins, the installed versions, and
the installed libraries' code (every listed member there: imports transformers, TRL and
torchtitan in this process, seconds).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from ulysses_dtensor.integrations import versions
from ulysses_dtensor.integrations.versions import (
    ALLOW_ENV,
    PRIVATE_MEMBERS,
    TESTED,
    Member,
    UntestedVersionError,
    UntestedVersionWarning,
    check_library,
    missing_members,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Spec:  # a dataclass field without a default: no class attribute, still a member
    run: object

# Members of the standard library standing in for a library's: one of each kind.
PRESENT = (
    Member("json.decoder:JSONDecoder.raw_decode", ("s", "idx")),  # a method, its leading parameters
    Member("json:dumps", keywords=("indent",)),  # a module global, a parameter passed by name
    Member("json.decoder:JSONDecoder.scan_once", in_source=True),  # set in __init__: found in the source
    Member(f"{__name__}:_Spec.run"),
)


@pytest.fixture
def fresh(monkeypatch):
    """Nothing looked up or warned yet in this process, no override, local rank 0; ``trl``
    reported as 9.9.0 with the members of the standard library above."""
    monkeypatch.setattr(versions, "_found", {})
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda lib: "9.9.0" if lib == "trl" else real(lib))
    monkeypatch.setitem(PRIVATE_MEMBERS, "trl", {"GRPOTrainer": PRESENT, "SFTTrainer": PRESENT[:1]})
    return monkeypatch


def _with_member(monkeypatch, member: Member) -> None:
    monkeypatch.setitem(PRIVATE_MEMBERS, "trl", {"GRPOTrainer": (*PRESENT, member), "SFTTrainer": PRESENT[:1]})
    monkeypatch.setattr(versions, "_found", {})


def test_another_version_with_every_member_warns_once(fresh):
    with pytest.warns(UntestedVersionWarning) as caught:
        check_library("trl", "GRPOTrainer", user="UlyssesGRPOTrainer")
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("trl==9.9.0 is installed; UlyssesGRPOTrainer was tested with trl==1.16.0. The "
                              "private trl members it relies on are all there, so it runs"), message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the same library says nothing again
        check_library("trl", "GRPOTrainer", user="UlyssesGRPOTrainer")
        check_library("trl", "SFTTrainer", user="UlyssesSFTTrainer")


def test_only_local_rank_0_warns(fresh):
    fresh.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_library("trl", "GRPOTrainer")


@pytest.mark.parametrize("member, why", [
    (Member("json.decoder:JSONDecoder._gone"), "gone"),
    (Member("json:loads", ("obj",)), "parameters (s, cls, object_hook"),  # another leading parameter
    (Member("json:dumps", keywords=("gone",)), "no parameter 'gone'"),
    (Member("json.decoder:JSONDecoder._gone_attr", in_source=True), "gone"),
    (Member("json.gone:Decoder.decode"), "json.gone does not import (ModuleNotFoundError"),
    (Member("json.decoder:GoneDecoder.decode"), "json.decoder.GoneDecoder is gone"),
])
def test_a_missing_member_is_refused_by_name(fresh, member, why):
    _with_member(fresh, member)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal, not a warning
        with pytest.raises(UntestedVersionError) as e:
            check_library("trl", "GRPOTrainer", user="UlyssesGRPOTrainer")
    message = str(e.value)
    assert message.startswith(f"UlyssesGRPOTrainer relies on private trl members that trl==9.9.0 (installed) "
                              f"lacks: {member.name} ({why}"), message
    assert message.endswith("It was tested with trl==1.16.0: install trl==1.16.0, or set "
                            f"{ALLOW_ENV}=trl to run it anyway (it may fail or compute wrong results)."), message
    # Only the part that relies on the member is refused; the tested version is never looked at.
    with pytest.warns(UntestedVersionWarning):
        check_library("trl", "SFTTrainer")
    fresh.setattr(versions, "installed_version", lambda lib: "1.16.0")
    check_library("trl", "GRPOTrainer")


@pytest.mark.parametrize("value", ["trl", "peft, trl", "all"])
def test_the_override_turns_the_refusal_into_a_warning(fresh, value):
    _with_member(fresh, Member("json.decoder:JSONDecoder._gone"))
    fresh.setenv(ALLOW_ENV, value)
    with pytest.warns(UntestedVersionWarning) as caught:
        check_library("trl", "GRPOTrainer", user="UlyssesGRPOTrainer")
    (message,) = [str(w.message) for w in caught]
    assert message == (f"trl==9.9.0 is installed; UlyssesGRPOTrainer was tested with trl==1.16.0 and relies on "
                       f"private members it lacks: json.decoder.JSONDecoder._gone (gone). Running anyway "
                       f"({ALLOW_ENV}={value}): it may fail or compute wrong results.")
    fresh.setenv(ALLOW_ENV, "peft")  # another library's override is not this one's
    with pytest.raises(UntestedVersionError):
        check_library("trl", "GRPOTrainer")


def test_a_library_that_is_not_installed_is_left_to_its_import(fresh):
    fresh.setattr(versions, "installed_version", lambda lib: None)
    _with_member(fresh, Member("json.decoder:JSONDecoder._gone"))
    check_library("trl")


def _pins() -> dict[str, str]:
    """``name==version`` in pyproject.toml's dependencies and extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                     for r in extra)]:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^;,\s]+)", requirement)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def test_tested_versions_are_pyprojects_pins_and_the_installed_ones():
    pins = _pins()
    assert {"trl", "torchtitan"} <= pins.keys(), pins
    assert {k: TESTED[k] for k in pins if k in TESTED} == {k: v for k, v in pins.items() if k in TESTED}
    for library, tested in TESTED.items():
        found = versions.installed_version(library)
        assert found in (None, tested), f"{library}=={found} is installed, the table says {tested}"
    assert set(PRIVATE_MEMBERS) == set(TESTED)


def test_the_installed_versions_pass_silently_and_have_every_member(monkeypatch):
    """The table names real members: each is there in the tested versions' code."""
    monkeypatch.setattr(versions, "_found", {})
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    present = [lib for lib in TESTED if versions.installed_version(lib) is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntestedVersionWarning)
        for lib in present:
            check_library(lib)
    for lib in present:
        assert missing_members(lib) == [], lib


def _needs(*modules: str) -> None:
    if any(importlib.util.find_spec(m) is None for m in modules):
        pytest.skip(f"needs {', '.join(modules)}")


def test_each_integration_checks_its_libraries_first(fresh):
    """The trainers and parallelize_hf_model refuse before they touch their arguments."""
    _needs("transformers", "trl", "accelerate")
    from ulysses_dtensor.integrations.hf import UlyssesHFTrainer, parallelize_hf_model
    from ulysses_dtensor.integrations.trl import UlyssesDPOTrainer, UlyssesGRPOTrainer, UlyssesSFTTrainer

    fresh.setattr(versions, "installed_version", lambda lib: "99.0")
    gone = (Member("json.decoder:JSONDecoder._gone"),)
    for lib, parts in PRIVATE_MEMBERS.items():
        fresh.setitem(PRIVATE_MEMBERS, lib, {part: gone for part in parts})
    assert UlyssesHFTrainer.version_checks == (("transformers", "Trainer"), ("accelerate", "Accelerator"))
    for cls, part in ((UlyssesSFTTrainer, "SFTTrainer"), (UlyssesGRPOTrainer, "GRPOTrainer"),
                      (UlyssesDPOTrainer, "DPOTrainer")):
        assert cls.version_checks == (*UlyssesHFTrainer.version_checks, ("trl", part))
    for make, who in ((lambda: UlyssesHFTrainer(model=None), "UlyssesHFTrainer"),
                      (lambda: UlyssesGRPOTrainer(None), "UlyssesGRPOTrainer"),
                      (lambda: UlyssesDPOTrainer(model=None), "UlyssesDPOTrainer"),
                      (lambda: parallelize_hf_model(None, None), "parallelize_hf_model")):
        with pytest.raises(UntestedVersionError, match=rf"^{who} relies on private transformers members"):
            make()
    fresh.setenv(ALLOW_ENV, "transformers,accelerate")
    with pytest.warns(UntestedVersionWarning), pytest.raises(UntestedVersionError,
                                                             match=r"^UlyssesSFTTrainer relies on private trl"):
        UlyssesSFTTrainer(model=None)


@pytest.mark.parametrize("module, new", [
    ("ulysses_dtensor.integrations.hf", "UlyssesHFTrainer"),
    ("ulysses_dtensor.integrations.hf.ulysses_trainer", "UlyssesHFTrainer"),
    ("ulysses_dtensor.integrations.hf.ulysses_trainer.mixin", "UlyssesHFTrainer"),
    ("ulysses_dtensor.integrations.torchtitan", "UlyssesTorchtitanTrainer"),
    ("ulysses_dtensor.integrations.torchtitan.trainer", "UlyssesTorchtitanTrainer"),
])
def test_the_old_trainer_name_warns_and_is_the_new_class(module, new):
    _needs("torchtitan" if "torchtitan" in module else "transformers")
    cls = getattr(importlib.import_module(module), new)  # imported first: only the alias warns below
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(module)}\.UlyssesTrainer is deprecated: use {new}"):
        exec(f"from {module} import UlyssesTrainer", namespace)
    assert namespace["UlyssesTrainer"] is cls
    with pytest.raises(AttributeError, match="UlyssesTrainerr"):
        getattr(importlib.import_module(module), "UlyssesTrainerr")
