"""The family matrix: every decoder family transformers ships, measured against transformers' own model.

The full matrix (``scripts/family_matrix.py``: every model type of transformers'
causal-LM mapping, every decoder family at sp 2, those whose layers pass a
window, a soft-cap or sinks, use MLA or hold other token mixers also at sp 4 and
dp_shard 2 x sp 2; minutes on 2 cores) writes the checked-in
``ulysses_dtensor/integrations/hf/matrix/results.json``. The suite checks that file
against the installed code, cheaply:

* it covers exactly the installed transformers' causal-LM mapping, for its
  version, every status valid, every passing family within the tolerances on
  every mesh it needs, at least 100 decoder families passing;
* a sample of families is measured again live (a tiny model of the family's own
  config class through ``parallelize_hf_model`` against transformers' own
  unsharded model, each packed document alone: fp32, 2 rows x 29 tokens, the loss
  and EVERY parameter's gradient): a fixed representative set (Mamba-2, Mamba,
  short convolutions, MLA, sinks + windows + router loss, a family refused at
  run time) plus two families that rotate daily at sp 2, and one windowed family
  (rotating too) at dp_shard 2 x sp 2 -- each must give the checked-in status,
  errors within the tolerances, the same collectives per forward and the same
  patterns (``ULYSSES_FAMILY_SAMPLE=a,b`` names the rotating ones instead);
* every refusal raises with its reason: every refused model type through the
  family check, and every decoder family refused by a structural check through
  ``parallelize_hf_model`` itself, with or without ``allow_untested``.

(The family table of docs/transformers-models.md is the generated one: ``tests/test_family_table.py``.)
``ULYSSES_FAMILY_MATRIX_OUT=<file>`` runs the full matrix instead
(:func:`test_full_matrix`; ``scripts/family_matrix.py`` sets it).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

from distributed import run_ranks  # noqa: E402
from test_hf_integration import build_pmesh, registry_restored  # noqa: E402

from ulysses_dtensor.integrations.hf.matrix import runs as family_runs  # noqa: E402
from ulysses_dtensor.integrations.hf.matrix.results import RESULTS_PATH  # noqa: E402

STATUSES = ("pass", "refused", "fail", "text path")
MIN_PASSING = 100
# Measured live every run: one of each kind of layer the matrix runs beyond plain attention, and
# a family refused at run time (an attention mask of its own reaches Ulysses attention).
FIXED_SAMPLE = ("bamba", "jamba", "lfm2", "deepseek_v2", "granitemoe_swa", "doge")
ROTATING = 2
SAMPLE_ENV = "ULYSSES_FAMILY_SAMPLE"
# The full matrix (scripts/family_matrix.py), per pooled task: minutes on a loaded 2-core machine.
FULL_TIMEOUT_S = 1200


def _results() -> dict:
    return json.loads(RESULTS_PATH.read_text())


def _installed() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------------------
# (a) the checked-in results hold for the installed transformers
# ---------------------------------------------------------------------------


def test_results_cover_the_installed_transformers():
    from ulysses_dtensor.integrations.hf.matrix import check as family_check
    from ulysses_dtensor.integrations.hf.matrix import tiny_configs as family_matrix

    doc = _results()
    assert doc["transformers"] == _installed(), (
        f"results.json is for transformers {doc['transformers']}, this is {_installed()}: "
        "regenerate it with python scripts/family_matrix.py")
    families = doc["families"]
    assert sorted(families) == sorted(family_matrix.causal_lm_types()), \
        sorted(set(families) ^ set(family_matrix.causal_lm_types()))
    assert doc["tolerances"] == {"loss_rel": family_check.LOSS_RTOL, "grad_rel": family_check.GRAD_RTOL}
    sp2 = family_runs.mesh_name(family_runs.FIRST_MESH)
    extra = {family_runs.mesh_name(d) for d in family_runs.EXTRA_MESHES}
    for model_type, entry in families.items():
        assert entry["status"] in STATUSES, (model_type, entry["status"])
        assert entry["category"] == family_matrix.category(model_type), model_type
        if entry["status"] == "pass":
            assert entry["category"] == "decoder", model_type
            meshes = entry["meshes"]
            want = {sp2} | (extra if family_runs.needs_extra_meshes(entry) else set())
            assert set(meshes) == want, (model_type, sorted(meshes))
            for name, m in meshes.items():
                assert m["loss_rel"] <= family_check.LOSS_RTOL and m["grad_rel"] <= family_check.GRAD_RTOL, \
                    (model_type, name, m)
                assert m["forward"], (model_type, name)  # the exchange ran
        elif entry["status"] == "text path":
            assert entry["category"] == "multimodal", model_type
            assert families[entry["text"]]["status"] == "pass", model_type  # else refused with its reason
        else:
            assert entry["reason"], model_type
    by = Counter((e["category"], e["status"]) for e in families.values())
    print("\nresults.json (transformers " + doc["transformers"] + "): " + ", ".join(
        f"{c} {s} {n}" for (c, s), n in sorted(by.items())))
    assert by[("decoder", "pass")] >= MIN_PASSING, by
    assert by[("decoder", "fail")] == 0, [t for t, e in families.items() if e["status"] == "fail"]
    hybrids = sorted(t for t, e in families.items() if e["status"] == "pass" and set(e.get("mixers", ())) - {
        "gated delta-net"})
    assert len(hybrids) >= 5, hybrids  # Mamba-2, Mamba, short convolutions


# ---------------------------------------------------------------------------
# (b) a sample measured again, live
# ---------------------------------------------------------------------------


def _rotating(candidates: list[str], n: int, salt: str) -> list[str]:
    """``n`` of ``candidates``, the day's (or those :data:`SAMPLE_ENV` names)."""
    named = [t for t in os.environ.get(SAMPLE_ENV, "").split(",") if t in candidates]
    if named:
        return named[:n]
    day = datetime.date.today().toordinal()
    return random.Random(f"{day}-{salt}").sample(sorted(candidates), n)


def sample() -> tuple[list[str], str]:
    """(families measured at sp 2, the windowed family measured at dp_shard 2 x sp 2)."""
    families = _results()["families"]
    passing = [t for t, e in families.items() if e["status"] == "pass" and t not in FIXED_SAMPLE]
    windowed = [t for t in passing if "window" in families[t].get("patterns", ())]
    return [*FIXED_SAMPLE, *_rotating(passing, ROTATING, "sp2")], _rotating(windowed, 1, "dp")[0]


def _sample_worker(rank: int, world: int, model_types: list[str], dims: tuple) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs trip transformers' sanity warnings
    with registry_restored():
        refs = {t: family_runs.family_reference(t) for t in model_types}  # the same on every rank
        return family_runs.run_mesh(model_types, dims, refs, world, build_pmesh)


def _check_run(model_type: str, mesh: str, got: dict, entry: dict) -> str | None:
    """What of one live run differs from the checked-in entry (None: nothing)."""
    from ulysses_dtensor.integrations.hf.matrix import check as family_check

    if entry["status"] == "refused":
        want = entry["reason"]
        return None if want == f"{mesh}: {got.get('error')}" else f"refused with {want!r}, now {got}"
    if "error" in got:
        return f"error {got['error']}"
    if not (got["loss_rel"] <= family_check.LOSS_RTOL and got["grad_rel"] <= family_check.GRAD_RTOL):
        return f"loss rel. err. {got['loss_rel']:.1e}, gradient {got['grad_rel']:.1e} ({got['worst']})"
    want = entry["meshes"][mesh]
    if got["forward"] != want["forward"]:
        return f"forward collectives {got['forward']}, checked in {want['forward']}"
    if got["patterns"] != entry["patterns"]:
        return f"patterns {got['patterns']}, checked in {entry['patterns']}"
    return None


def test_a_sample_of_families_measures_as_checked_in():
    families = _results()["families"]
    at_sp2, windowed = sample()
    runs = {family_runs.mesh_name(family_runs.FIRST_MESH): (at_sp2, run_ranks(2, _sample_worker, at_sp2,
                                                                                  family_runs.FIRST_MESH)[0])}
    dims = family_runs.EXTRA_MESHES[1]
    runs[family_runs.mesh_name(dims)] = ([windowed], run_ranks(4, _sample_worker, [windowed], dims)[0])
    problems = []
    for mesh, (model_types, got) in runs.items():
        for model_type in model_types:
            run = got[model_type]
            print(f"{model_type:16s} {mesh:18s} " + (run.get("error") or
                  f"loss {run['loss_rel']:.1e} grad {run['grad_rel']:.1e} {run['patterns']}"))
            problem = _check_run(model_type, mesh, run, families[model_type])
            if problem:
                problems.append(f"{model_type} ({mesh}): {problem}")
    assert not problems, (f"measured again, these families no longer match results.json (sample "
                          f"{SAMPLE_ENV}={','.join(at_sp2[len(FIXED_SAMPLE):] + [windowed])}; regenerate with "
                          "scripts/family_matrix.py if the change is intended):\n" + "\n".join(problems))


# ---------------------------------------------------------------------------
# (c) refusals raise with their reason
# ---------------------------------------------------------------------------


def _structural(model_type: str, entry: dict) -> bool:
    """A decoder family refused by a check that reads the model (not its run, its config or an override)."""
    from ulysses_dtensor.integrations.hf.matrix.tiny_configs import OVERRIDES

    reason = entry.get("reason", "")
    runs = tuple(f"{family_runs.mesh_name(d)}:" for d in (family_runs.FIRST_MESH, *family_runs.EXTRA_MESHES))
    return entry["category"] == "decoder" and entry["status"] == "refused" and not (
        model_type in OVERRIDES and OVERRIDES[model_type].refused) and \
        not reason.startswith(("does not build", "transformers' own model fails", *runs))


def test_every_refused_family_is_refused_with_its_reason():
    import torch
    from transformers import PretrainedConfig

    from ulysses_dtensor.integrations.hf.matrix import tiny_configs as family_matrix
    from ulysses_dtensor.integrations.hf import parallelize_hf_model
    from ulysses_dtensor.integrations.hf.families import check_known_family
    from ulysses_dtensor.parallel.mesh import ParallelDims

    families = _results()["families"]
    problems = []
    # The family check: every refused model type, by its model_type alone.
    for model_type, entry in families.items():
        if entry["status"] not in ("refused", "fail"):
            continue
        config = PretrainedConfig()
        config.model_type = model_type
        try:
            check_known_family(SimpleNamespace(config=config), allow_untested=False)
            problems.append(f"{model_type}: not refused")
        except ValueError as e:
            if entry["reason"] not in str(e):
                problems.append(f"{model_type}: {e}")
    # parallelize_hf_model itself, with and without allow_untested: the structural refusals still hold.
    stand_in = SimpleNamespace(dims=ParallelDims(sp=2, dp_shard=1, world_size=2))
    structural = sorted(t for t, e in families.items() if _structural(t, e))
    for model_type in structural:
        with torch.device("meta"):
            model = family_matrix.tiny_model(family_matrix.tiny_config(model_type), noise=False)
        for allow in (False, True):
            try:
                parallelize_hf_model(model, stand_in, allow_untested=allow)
                problems.append(f"{model_type} (allow_untested={allow}): not refused")
            except ValueError as e:
                if families[model_type]["reason"] not in str(e):
                    problems.append(f"{model_type} (allow_untested={allow}): {e}")
    print(f"\n{sum(e['status'] == 'refused' for e in families.values())} refusals raised with their reason; "
          f"{len(structural)} structural ones through parallelize_hf_model")
    assert len(structural) >= 20, structural
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# The full matrix (scripts/family_matrix.py): only with ULYSSES_FAMILY_MATRIX_OUT
# ---------------------------------------------------------------------------


def _first_worker(rank: int, world: int):
    """Every family's structure and reference; the sp 2 runs. Rank 0 returns them, with the
    references of the families the extra meshes need, and its CPU seconds."""
    import time

    import torch
    import transformers

    from ulysses_dtensor.integrations.hf.matrix import tiny_configs as family_matrix

    transformers.logging.set_verbosity_error()
    with registry_restored():
        cpu = time.process_time()
        infos, refs = family_runs.references(list(family_matrix.causal_lm_types()), rank, world)
        cpu_refs = time.process_time() - cpu
        measured = sorted(t for t in infos if t in refs)
        runs = family_runs.run_mesh(measured, family_runs.FIRST_MESH, refs, world, build_pmesh)
        cpu = {"references": cpu_refs, "sp 2": time.process_time() - cpu - cpu_refs}
    if rank:
        return None
    extra = [t for t in measured if family_runs.needs_extra_meshes({**infos[t], **runs.get(t, {})})]
    return infos, runs, {t: refs[t] for t in extra}, transformers.__version__, torch.__version__, cpu


def _extra_worker(rank: int, world: int, refs: dict):
    import time

    import transformers
    from distributed import destroy_subgroups

    transformers.logging.set_verbosity_error()
    out, cpu = {}, {}
    with registry_restored():
        for dims in family_runs.EXTRA_MESHES:
            start = time.process_time()
            out[family_runs.mesh_name(dims)] = family_runs.run_mesh(sorted(refs), dims, refs, world, build_pmesh)
            cpu[family_runs.mesh_name(dims)] = time.process_time() - start
            destroy_subgroups()  # this mesh's groups, before the next mesh's
    return out, cpu


def _summary(doc: dict) -> str:
    fams = doc["families"]
    by = Counter((e["category"], e["status"]) for e in fams.values())
    lines = [f"{cat:16s} {status:10s} {n}" for (cat, status), n in sorted(by.items())]
    lines.append("hybrid (mixers) passing: " + ", ".join(sorted(
        t for t, e in fams.items() if e.get("mixers") and e["status"] == "pass")))
    return "\n".join(lines)


@pytest.mark.slow
def test_full_matrix(capsys):
    """Every family on every mesh it needs, written to ``ULYSSES_FAMILY_MATRIX_OUT``."""
    out = os.environ.get("ULYSSES_FAMILY_MATRIX_OUT")
    if not out:
        pytest.skip("the full matrix runs from scripts/family_matrix.py (ULYSSES_FAMILY_MATRIX_OUT=<file>)")
    infos, runs, extra_refs, tf_version, torch_version, cpu = run_ranks(2, _first_worker, timeout=FULL_TIMEOUT_S)[0]
    extra, cpu_extra = run_ranks(4, _extra_worker, extra_refs, timeout=FULL_TIMEOUT_S)[0]
    runs_by_mesh = {family_runs.mesh_name(family_runs.FIRST_MESH): runs, **extra}
    doc = family_runs.assemble(infos, runs_by_mesh, tf_version, torch_version)
    with capsys.disabled():
        print("\nfamily matrix (transformers " + tf_version + "):\n" + _summary(doc))
        print(f"CPU seconds of rank 0: {cpu} (2 ranks), {cpu_extra} (4 ranks; {len(extra_refs)} families)")
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
