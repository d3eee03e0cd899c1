"""scripts/gpu_check.sh: its benchmark commands parse, and its test piece finds GPU tests.

The script itself needs a GPU; on CPU this keeps its command lines from rotting.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from script_module import load_script

REPO = Path(__file__).resolve().parents[1]


def _pieces() -> dict[str, str]:
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--list"], capture_output=True,
                         text=True, check=True, env={"PYTHON": "python", "PATH": "/usr/bin:/bin"}).stdout
    rows = [line.split(None, 1) for line in out.splitlines()[1:]]
    return {name: cmd for name, cmd in rows}


def _parser(script: str):
    return load_script(REPO / script).parse_args


def test_benchmark_commands_parse():
    pieces = _pieces()
    assert list(pieces)[:3] == ["tests", "smoke", "attn"] and len(pieces) == 7
    parsed = 0
    for name, cmd in pieces.items():
        cmd = cmd.replace("$b", "sdpa")
        for part in cmd.replace("for b in", ";").replace("; do", ";").replace("; done", ";").split("&&"):
            for sub in part.split(";"):
                words = shlex.split(sub)
                if len(words) > 1 and words[1].startswith("benchmarks/"):
                    args = _parser(words[1])(words[2:])
                    assert args.device == "cuda", (name, sub)
                    parsed += 1
    assert parsed == 7  # smoke 2, attn 1, train 4


def test_the_gpu_tests_carry_the_marker_the_script_selects():
    import test_attention
    import test_gpu_training

    def marks(obj):
        return {m.name for m in getattr(obj, "pytestmark", [])}

    assert "gpu" in marks(test_gpu_training)
    assert "gpu" in marks(test_attention.test_gpu_backends_match_reference_bf16)
    assert "-m gpu" in _pieces()["tests"]
