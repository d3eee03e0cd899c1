"""Measure every transformers family again and rewrite the checked-in results and the docs' family table.

Runs ``tests/test_family_matrix.py::test_full_matrix`` with ``ULYSSES_FAMILY_MATRIX_OUT`` (the
pooled ranks measure every family of the installed transformers on every mesh it needs;
the suite itself skips it and re-measures a sample only), writes ``ulysses_dtensor/integrations/hf/matrix/results.json``, then
``scripts/family_table.py`` rewrites the family table of ``docs/transformers-models.md``. Run it after a
transformers upgrade or a change to the integration that moves a family::

    python scripts/family_matrix.py            # a few minutes on 2 cores
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "ulysses_dtensor" / "integrations" / "hf" / "matrix" / "results.json"
TEST = "tests/test_family_matrix.py::test_full_matrix"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "family_results.json"
        env = dict(os.environ, ULYSSES_FAMILY_MATRIX_OUT=str(out), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", TEST]
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode or not out.is_file():
            raise SystemExit("the family matrix did not run to the end: nothing written")
        RESULTS.write_text(out.read_text())
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "family_table.py")], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
