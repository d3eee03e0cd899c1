"""The family matrix's results for one transformers version, checked in, and what they say of a model.

``results.json`` (next to this file) holds, for every model type
transformers maps to a causal LM, what the matrix measured (``scripts/family_matrix.py`` rewrites it;
``tests/test_family_matrix.py`` checks it against the installed code and re-measures a sample): its category,
its status -- ``pass`` (loss and every gradient equal to transformers' own
unsharded model on every mesh tried), ``refused`` (with the reason), ``fail``
(with the measured difference), ``text path`` (a multimodal model whose text
family passes) -- the patterns its layers passed, and the worst errors per mesh.

:func:`family_status` reads a model's family off them. A family measured for
ANOTHER transformers version counts as not measured: the installed code is
what runs.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

__all__ = ["RESULTS_ENV", "RESULTS_PATH", "FamilyStatus", "family_status", "load_results", "refusal_reason", "summary"]

RESULTS_PATH = Path(__file__).with_name("results.json")
# Environment variable naming another results file (a matrix measured elsewhere; tests).
RESULTS_ENV = "ULYSSES_FAMILY_MATRIX_RESULTS"


def load_results(path: Path | None = None) -> dict:
    """The results (``{"transformers": version, "families": {...}}``; empty when absent): ``path``,
    else the file named by :data:`RESULTS_ENV`, else the checked-in one."""
    return _read(Path(path or os.environ.get(RESULTS_ENV) or RESULTS_PATH))


@functools.lru_cache(maxsize=4)
def _read(path: Path) -> dict:
    if not Path(path).is_file():
        return {"transformers": None, "families": {}}
    return json.loads(Path(path).read_text())


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


@dataclass(frozen=True)
class FamilyStatus:
    """Where a model's family stands: ``measured`` (the matrix passed it for the installed
    transformers), ``refused`` (with ``detail``: the reason), or ``unmeasured`` (a family
    newer than the matrix, or another transformers version: check it at start)."""

    model_type: str
    state: str
    detail: str = ""

    def banner(self) -> str:
        return f"{self.model_type}: {self.detail}" if self.detail else self.model_type


def summary(entry: dict) -> str:
    """One line of a passing entry: its meshes and worst errors."""
    meshes = entry.get("meshes", {})
    loss = max((m["loss_rel"] for m in meshes.values()), default=0.0)
    grad = max((m["grad_rel"] for m in meshes.values()), default=0.0)
    return f"{', '.join(meshes)}; worst loss rel. err. {loss:.1e}, gradient {grad:.1e}"


def refusal_reason(entry: dict) -> str:
    if entry.get("status") == "fail":
        return f"it differs from transformers' own model under Ulysses SP ({entry.get('reason', '')})"
    return entry.get("reason", "")


def family_status(model: nn.Module, results: dict | None = None) -> FamilyStatus:
    """The matrix's word on ``model``'s family (its text family for a multimodal model)."""
    results = load_results() if results is None else results
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    version = results.get("transformers")
    families = results.get("families", {})
    installed = _installed_transformers()
    if version != installed:
        return FamilyStatus(model_type, "unmeasured",
                            f"the family matrix measured transformers {version}, this is {installed}")
    entry = families.get(model_type)
    if entry is None:
        text = model.config.get_text_config()
        if text is not model.config and getattr(text, "model_type", None) in families:
            entry = families[text.model_type]
            model_type = f"{model_type} (text model {text.model_type})"
    if entry is None:
        return FamilyStatus(model_type, "unmeasured", f"not in the family matrix of transformers {version}")
    status = entry.get("status")
    if status == "text path":
        text_entry = families.get(entry.get("text"), {})
        if text_entry.get("status") == "pass":
            return FamilyStatus(model_type, "measured",
                                f"text path, measured as {entry['text']} (transformers {version}: {summary(text_entry)})")
        return FamilyStatus(model_type, "refused", f"its text model {entry.get('text')}: {refusal_reason(text_entry)}")
    if status == "pass":
        return FamilyStatus(model_type, "measured", f"measured by the family matrix (transformers {version}: "
                                                    f"{summary(entry)})")
    return FamilyStatus(model_type, "refused", refusal_reason(entry))
