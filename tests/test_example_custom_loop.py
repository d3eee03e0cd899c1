"""scripts/example_custom_loop.py trains on 4 CPU ranks (dp 2 x sp 2) and learns.

Its ``train()`` runs on the pooled gloo ranks (what its ``main()`` calls after
``init_process_group``): a torchrun launch costs seconds of interpreter start-up
and imports on 2 cores, and test_train.py's README command is the suite's
torchrun launch test.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re

import torch

from distributed import run_ranks
from script_module import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "scripts", "example_custom_loop.py")


def _example_worker(rank: int, world: int, argv: list[str]) -> str:
    example = load_script(EXAMPLE)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.train(example.parse_args(argv), torch.device("cpu"))
    return out.getvalue()


def test_example_custom_loop_trains_on_4_cpu_ranks():
    printed = run_ranks(4, _example_worker, ["--sp_size", "2", "--max_steps", "8"])
    # Only rank 0 prints, once per step.
    assert printed[1:] == ["", "", ""], printed
    steps = re.findall(r"^step (\d+) loss ([-+.\deEinfa]+) grad_norm", printed[0], re.M)
    assert [int(s) for s, _ in steps] == list(range(1, 9)), printed[0]
    losses = [float(v) for _, v in steps]
    assert all(math.isfinite(v) for v in losses), losses
    assert 5.0 < losses[0] < 8.0, losses  # about ln(512) = 6.24 at init
    assert losses[-1] < losses[0] - 0.3, losses
