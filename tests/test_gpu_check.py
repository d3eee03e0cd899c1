"""scripts/gpu_check.sh: its benchmark commands parse, its test piece finds GPU
tests, and its attention matrix (scripts/gpu_attention_matrix.py) runs and
records its rows.

The script itself needs a GPU; on CPU this keeps its command lines from rotting.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import torch

from distributed import run_ranks
from script_module import load_script

REPO = Path(__file__).resolve().parents[1]


def _pieces() -> dict[str, str]:
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--list"], capture_output=True,
                         text=True, check=True, env={"PYTHON": "python", "PATH": "/usr/bin:/bin"}).stdout
    rows = [line.split(None, 1) for line in out.splitlines()[1:]]
    return {name: cmd for name, cmd in rows}


def _parser(script: str):
    return load_script(REPO / script).parse_args


MATRIX = "scripts/gpu_attention_matrix.py"


def test_benchmark_commands_parse():
    pieces = _pieces()
    assert list(pieces)[:7] == ["tests", "matrix", "matrix_flex", "matrix_flex_fp32", "ring_documents", "smoke",
                                "attn"]
    assert len(pieces) == 11
    parsed = 0
    for name, cmd in pieces.items():
        cmd = cmd.replace("$b", "sdpa")
        for part in cmd.replace("for b in", ";").replace("; do", ";").replace("; done", ";").split("&&"):
            for sub in part.split(";"):
                words = shlex.split(sub)
                if len(words) > 1 and (words[1].startswith("benchmarks/") or words[1] == MATRIX):
                    args = _parser(words[1])(words[2:])
                    assert args.device == "cuda", (name, sub)
                    parsed += 1
    assert parsed == 11  # matrix 4, smoke 2, attn 1, train 4
    # Between them the matrix pieces run every backend on every pattern, head dim and dtype
    # (flex split by dtype: it compiles per row, 5-18 s each on an H200, 60 rows in all).
    matrix = load_script(REPO / MATRIX)
    local = [matrix.parse_args(shlex.split(pieces[p])[2:]) for p in ("matrix", "matrix_flex", "matrix_flex_fp32")]
    covered = {(b, d) for a in local for b in a.backends for d in a.dtypes}
    assert covered == {(b, d) for b in matrix.BACKENDS for d in ("float32", "bfloat16")}
    assert len(covered) == sum(len(a.backends) * len(a.dtypes) for a in local)  # each pair once
    assert all(a.patterns == list(matrix.PATTERNS) for a in local)
    assert {64, 80, 96, 128} < set(matrix.HEAD_DIMS) and any(d % 8 for d in matrix.HEAD_DIMS)


def test_attention_matrix_records_what_ran_on_cpu():
    import io
    import json

    matrix = load_script(REPO / MATRIX)
    out = io.StringIO()
    args = matrix.parse_args(["local", "--device", "cpu", "--backends", "sdpa", "varlen", "--patterns", "documents",
                              "mla", "vwide", "--head-dims", "36", "--dtypes", "float32", "--seq", "48"])
    assert matrix.run_local(args, out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["backend"], r["pattern"], r["status"]) for r in rows] == [
        ("sdpa", "documents", "passed"), ("sdpa", "mla", "passed"), ("sdpa", "vwide", "passed"),
        ("varlen", "documents", "refused"), ("varlen", "mla", "refused"), ("varlen", "vwide", "refused")]
    assert rows[1]["head_dim"] == 54 and rows[1]["v_head_dim"] == 36 and "CUDA only" in rows[3]["reason"]
    assert rows[2]["head_dim"] == 36 and rows[2]["v_head_dim"] == 72
    assert all(r["out_err"] < 1e-5 and r["grad_err"] < 1e-5 for r in rows[:3])


def _ring_rows(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    matrix = load_script(REPO / MATRIX)
    rows = []
    args = matrix.parse_args(["ring", "--device", "cpu", "--head-dims", "20", "--dtypes", "float32", "--seq", "32"])
    matrix.ring_rows(rank, init_device_mesh("cpu", (world,), mesh_dim_names=("ring",)), args, torch.device("cpu"),
                     rows.append)
    return rows


def test_attention_matrix_ring_rows_on_cpu():
    rows = run_ranks(2, _ring_rows)[0]
    assert [(r["upstream_grad"], r["status"]) for r in rows] == [("random", "passed"), ("sum", "passed")], rows
    assert rows[0]["ran"] == {"plain": "cpu_flash", "documents": "cpu_flash"}


def test_the_gpu_tests_carry_the_marker_the_script_selects():
    import test_attention
    import test_gpu_training

    def marks(obj):
        return {m.name for m in getattr(obj, "pytestmark", [])}

    assert "gpu" in marks(test_gpu_training)
    assert "gpu" in marks(test_attention.test_gpu_backends_match_reference_bf16)
    assert "-m gpu" in _pieces()["tests"]


def test_attention_matrix_marks_a_missing_package_unavailable(monkeypatch):
    # On the lent H200 flash-attn was not installed: those rows are not failures of ours.
    import importlib.util

    matrix = load_script(REPO / MATRIX)
    monkeypatch.setattr(matrix, "resolve_backend", lambda *a, **k: "flash_attn")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    row = matrix.local_row("flash_attn", "documents", 64, torch.float32, "cpu", 48)
    assert row["status"] == "unavailable" and "flash-attn" in row["reason"]


def test_the_lease_wrapper_runs_pieces_that_exist():
    import re

    text = (REPO / "scripts" / "gpu_check_lease.sh").read_text()
    named = re.findall(r'gpu_check\.sh "\$out/[abfc]" ([a-z_0-9 ]+?) 2>', text)
    named += re.search(r"timing=\(([a-z_0-9 ]+)\)", text).group(1).split()
    names = {n for group in named for n in group.split()}
    assert {"tests", "matrix", "matrix_flex", "ring_documents", "smoke", "attn"} <= names
    assert names <= set(_pieces())
    usage = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check_lease.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "OUT_DIR" in usage.stdout
