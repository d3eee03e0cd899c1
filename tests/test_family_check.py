"""A family the matrix has not measured is checked at start; the matrix's word is final otherwise.

``parallelize_hf_model`` on 2 pooled ranks (sp 2) with a results document in
which the family is absent (a family newer than the matrix): a tiny model of the
model's own config class is measured on the mesh against transformers' own (the
comparison of the family matrix) and the model runs, ``model.family_status``
saying "verified at start" with the measured errors -- for the three families the
issue found refused by the old list (EXAONE-4, OLMo-3, GLM-4-MoE). A broken
exchange (document ids dropped) is refused with the measured difference; a
family the matrix failed is refused with its reason; ``allow_untested=True``
skips the check and says so; a measured family says so. The check's cost is printed.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

from distributed import destroy_subgroups, run_ranks  # noqa: E402
from test_hf_integration import build_pmesh, registry_restored  # noqa: E402


class _results:
    """Use ``doc`` as the family matrix's results inside the block."""

    def __init__(self, doc: dict, tmp):
        self.doc, self.path = doc, tmp

    def __enter__(self):
        import os

        from ulysses_dtensor.integrations.hf.matrix import results as family_results

        self.key = family_results.RESULTS_ENV
        self.saved = os.environ.get(self.key)
        self.path = self.path.with_name(f"{self.path.stem}-{abs(hash(json.dumps(self.doc)))}.json")
        self.path.write_text(json.dumps(self.doc))
        os.environ[self.key] = str(self.path)

    def __exit__(self, *exc):
        import os

        if self.saved is None:
            os.environ.pop(self.key, None)
        else:
            os.environ[self.key] = self.saved


def _worker(rank: int, world: int, tmp: str) -> dict:
    from pathlib import Path

    import transformers

    from ulysses_dtensor.integrations.hf.matrix import tiny_configs as family_matrix
    from ulysses_dtensor.integrations.hf import parallelize_hf_model
    from ulysses_dtensor.integrations.hf.attention_function import UlyssesCore

    transformers.logging.set_verbosity_error()
    path = Path(tmp) / f"results{rank}.json"
    version = transformers.__version__
    empty = {"transformers": version, "families": {}}
    out = {}

    def model(model_type):
        return family_matrix.tiny_model(family_matrix.tiny_config(model_type))

    def refusal(model_type) -> str:
        """The error parallelize_hf_model gives the family on a fresh sp 2 mesh, or "no error"."""
        destroy_subgroups()
        pmesh, _ = build_pmesh(world, (1, 1, 2))
        try:
            parallelize_hf_model(model(model_type), pmesh)
        except ValueError as e:
            return str(e)
        return "no error"

    with registry_restored():
        # Measured: the checked-in matrix says so.
        pmesh, _ = build_pmesh(world, (1, 1, 2))
        out["llama"] = parallelize_hf_model(model("llama"), pmesh).family_status
        # Newer than the matrix: checked at start on this mesh, then it runs.
        with _results(empty, path):
            for model_type in ("exaone4", "olmo3", "glm4_moe"):
                destroy_subgroups()  # the previous mesh's gloo groups (threads, sockets) go first
                pmesh, _ = build_pmesh(world, (1, 1, 2))
                start = time.perf_counter()
                m = parallelize_hf_model(model(model_type), pmesh)
                out[model_type] = (m.family_status, time.perf_counter() - start)
            # Another transformers version counts as not measured.
            with _results({**empty, "transformers": "0.0"}, path):
                destroy_subgroups()
                pmesh, _ = build_pmesh(world, (1, 1, 2))
                out["other version"] = parallelize_hf_model(model("llama"), pmesh).family_status
            # A broken exchange: documents attend to each other; measured and refused.
            forward = UlyssesCore.forward
            UlyssesCore.forward = lambda self, q, k, v, document_ids=None, **kw: forward(self, q, k, v, None, **kw)
            try:
                out["broken"] = refusal("olmo3")
            finally:
                UlyssesCore.forward = forward
            destroy_subgroups()
            pmesh, _ = build_pmesh(world, (1, 1, 2))
            out["untested"] = parallelize_hf_model(model("olmo3"), pmesh, allow_untested=True).family_status
        # A family the matrix failed: refused with the measured difference, before anything runs.
        failed = {"transformers": version, "families": {"llama": {
            "status": "fail", "category": "decoder", "reason": "sp 2: loss rel. err. 3.0e-03, gradient 1.0e+00"}}}
        with _results(failed, path):
            out["failed"] = refusal("llama")
    return out


def test_families_newer_than_the_matrix_are_checked_at_start(tmp_path):
    out = run_ranks(2, _worker, str(tmp_path))[0]
    for key, value in out.items():
        print(key, value)
    assert out["llama"].state == "measured" and "measured by the family matrix" in out["llama"].detail
    for model_type in ("exaone4", "olmo3", "glm4_moe"):
        status, seconds = out[model_type]
        assert status.state == "verified", status
        assert "verified at start" in status.detail and "loss rel. err." in status.detail, status
        assert seconds < 30, seconds  # a second or two on an idle 2-core machine
    assert out["other version"].state == "verified" and "measured transformers 0.0" in out["other version"].detail
    assert "checked at start on this mesh" in out["broken"] and "differs from transformers' own" in out["broken"], \
        out["broken"]
    assert out["untested"].state == "untested" and "allow_untested=True" in out["untested"].detail
    assert "refused by the family matrix" in out["failed"] and "loss rel. err. 3.0e-03" in out["failed"], out["failed"]
