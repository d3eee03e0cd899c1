"""A test hook: end or freeze a rank after a given step, once, to test restarts.

``ULYSSES_DTENSOR_TEST_FAULT="KILL:3:6"`` makes rank 3 SIGKILL itself after step 6
(its checkpoint, if due, saved); ``STOP`` instead freezes it with SIGSTOP, the
way a node that lost its network looks to its peers (alive, connections open,
silent). Several faults are comma separated: ``"STOP:2:9,STOP:3:9"``. Each fires
once per dump folder: before firing, the rank writes
``<dump_folder>/test_fault-<SIGNAL>-<rank>-<step>`` holding its pid and the time,
so the restarted attempt, which runs the step again, goes on. Without the
variable this is one dictionary lookup per step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

__all__ = ["FAULT_ENV", "inject_test_fault"]

FAULT_ENV = "ULYSSES_DTENSOR_TEST_FAULT"
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


def inject_test_fault(step: int, dump_folder: Path) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    rank = int(os.environ.get("RANK", 0))
    for fault in spec.split(","):
        name, fault_rank, fault_step = fault.strip().split(":")
        if int(fault_rank) != rank or int(fault_step) != step:
            continue
        latch = Path(dump_folder) / f"test_fault-{name}-{rank}-{step}"
        # Written whole, then linked into place: a test polling for the latch never
        # reads it half-written, and link() fails where it exists (fires once).
        draft = latch.with_name(f".{latch.name}.{os.getpid()}")
        draft.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        try:
            os.link(draft, latch)
        except FileExistsError:
            continue
        finally:
            draft.unlink()
        os.kill(os.getpid(), _SIGNALS[name])
