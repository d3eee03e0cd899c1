"""scripts/example_custom_loop.py runs under torchrun on 4 CPU ranks and learns."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_example_custom_loop_trains_on_4_cpu_ranks():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        os.path.join(ROOT, "scripts", "example_custom_loop.py"), "--sp", "2", "--steps", "8",
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = re.findall(r"^step (\d+) loss ([-+.\deEinfa]+) grad_norm", proc.stdout, re.M)
    # Only rank 0 prints, once per step.
    assert [int(s) for s, _ in steps] == list(range(1, 9)), proc.stdout
    losses = [float(v) for _, v in steps]
    assert all(math.isfinite(v) for v in losses), losses
    assert 5.0 < losses[0] < 8.0, losses  # about ln(512) = 6.24 at init
    assert losses[-1] < losses[0] - 0.3, losses
