"""Cut one profiled training step into the library's regions (``runtime/regions.py``).

Input: the events of a ``torch.profiler.profile`` around exactly one step, and
the step's wall time. Output: a table whose rows are what a reader asks about
(attention, exchange layout copies, projections, MLP, norms, loss, offload
copies, FSDP copies, clip, optimizer, ...) with columns forward / recompute /
backward, plus host syncs on the side, and rows for what no region claims and
for the time the device waited, so that the rows add up to the step.

How time is attributed (each unit of device time exactly once):

* device mode (CUDA): every kernel / memcpy / memset is attached by the profiler
  to the CPU op that launched it; that op's nearest enclosing mark decides;
  CPU mode: every op's self CPU time, likewise.
* the nearest mark is a library region (``ud.<name>``, ``ud.<name>.recompute``
  when entered during a backward: activation-checkpoint recompute), an autograd
  node being evaluated (``autograd::engine::evaluate_function: XBackward0``:
  backward), FSDP2's own ``FSDP::...`` annotations, or the optimizer's
  ``Optimizer.step#...`` / ``Optimizer.zero_grad#...``;
* a backward node goes to the region of the forward op that created it: the
  profiler records the autograd sequence number (and thread) of each forward op
  and of each node evaluated in backward. A recomputed forward's nodes map to the
  recompute's region, whose backward is the region's backward too.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ulysses_dtensor.runtime.regions import split_region_name  # noqa: E402

EVALUATE = "autograd::engine::evaluate_function: "
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")

# (row, the regions it holds). Rows without regions come from other marks.
ROWS = [
    ("attention", ("attention",)),
    ("exchange layout copies", ("ulysses.layout", "hf.attention")),
    ("all-to-all", ("ulysses.all_to_all",)),
    ("projections q/k/v/o", ("proj.qkv", "proj.o")),
    ("rope", ("rope",)),
    ("mlp", ("mlp",)),
    ("norms", ("norm",)),
    ("loss (output head)", ("loss",)),
    ("embedding", ("embedding",)),
    ("offload copies", ("offload.copy_out", "offload.copy_in")),
    ("fsdp gathers / reduces", ()),
    ("clip", ("step.clip",)),
    ("optimizer", ("step.optimizer",)),
    ("step, no finer region", ("step.forward", "step.backward")),
    ("other (no region)", ()),
]
ROW_OF = {r: row for row, regions in ROWS for r in regions}
PHASES = ("forward", "recompute", "backward")
FSDP_ROW, OPTIMIZER_ROW, OTHER_ROW = "fsdp gathers / reduces", "optimizer", "other (no region)"


def _is_device(e) -> bool:
    return getattr(e.device_type, "name", str(e.device_type)) != "CPU"


def _mark(e):
    """(kind, value) when ``e`` is a mark that decides attribution, else None."""
    name = e.name
    split = split_region_name(name)
    if split is not None:
        return "region", split
    if name.startswith(EVALUATE):
        return "backward", e
    if name.startswith("FSDP::"):
        return "row", FSDP_ROW
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "row", OPTIMIZER_ROW
    return None


def _owner(e):
    """The nearest mark at or above ``e`` (memoized on the event)."""
    chain = []
    node, found = e, None
    while node is not None:
        cached = getattr(node, "_ud_owner", False)
        if cached is not False:
            found = cached
            break
        chain.append(node)
        found = _mark(node)
        if found is not None:
            break
        node = node.cpu_parent
    for n in chain:
        n._ud_owner = found
    return found


def _node_key(e):
    """(forward thread, sequence number) of an evaluated autograd node."""
    if e.sequence_nr is not None and e.sequence_nr >= 0:
        return (e.fwd_thread, e.sequence_nr)
    for child in e.cpu_children:  # the node's own call carries them in some versions
        if child.sequence_nr is not None and child.sequence_nr >= 0:
            return (child.fwd_thread, child.sequence_nr)
    return None


def region_table(events, step_s: float, *, device: bool) -> dict:
    """The step cut into rows; ``events``: ``prof.events()`` of one step; ``step_s``: its wall time.

    ``device=True`` attributes device (kernel / copy) time, False self CPU time.
    Returns ``{"rows": {row: {"forward", "recompute", "backward", "total" (ms),
    "calls", "kernels"}}, "host_syncs": {...}, "totals": {...}, "unmapped_backward": {...}}``.
    """
    cpu = [e for e in events if not _is_device(e) and not getattr(e, "is_async", False)]
    annotation_names = {e.name for e in cpu if getattr(e, "is_user_annotation", False)}
    # Forward ops by (thread, sequence number) -> their region.
    made_in: dict = {}
    for e in cpu:
        if e.sequence_nr is None or e.sequence_nr < 0 or e.name.startswith(EVALUATE):
            continue
        owner = _owner(e)
        if owner is not None and owner[0] == "region":
            made_in.setdefault((e.thread, e.sequence_nr), owner[1][0])

    rows = {row: {p: 0.0 for p in PHASES} | {"calls": 0, "kernels": 0} for row, _ in ROWS}
    unmapped: dict = defaultdict(float)
    attributed = 0.0
    for e in cpu:
        split = split_region_name(e.name)
        if split is not None:
            rows[ROW_OF.get(split[0], OTHER_ROW)]["calls"] += 1
        if device:
            own = e.name if getattr(e, "is_user_annotation", False) else None
            kernels = [k for k in e.kernels if k.name != own]  # not the annotation's own device span
            us, n = sum(k.duration for k in kernels), len(kernels)
        else:
            us, n = e.self_cpu_time_total, 1
        if us <= 0:
            continue
        attributed += us
        owner = _owner(e)
        if owner is None:
            row, phase = OTHER_ROW, "forward"
        elif owner[0] == "region":
            name, recompute = owner[1]
            row = ROW_OF.get(name, OTHER_ROW)
            phase = "recompute" if recompute else "forward"
            if name == "step.backward":
                phase = "backward"
        elif owner[0] == "backward":
            node = owner[1]
            base = made_in.get(_node_key(node))
            phase = "backward"
            if base is None:
                row = OTHER_ROW
                unmapped[node.name[len(EVALUATE):]] += us
            else:
                row = ROW_OF.get(base, OTHER_ROW)
        else:
            row, phase = owner[1], "forward"
        rows[row][phase] += us
        rows[row]["kernels"] += n

    syncs: dict = defaultdict(lambda: {"count": 0, "host_ms": 0.0, "in": defaultdict(int)})
    for e in cpu:
        if e.name in SYNC_NAMES or e.name == "cudaMemcpy":
            s = syncs[e.name]
            s["count"] += 1
            s["host_ms"] += e.time_range.elapsed_us() / 1e3
            owner = _owner(e)
            where = OTHER_ROW if owner is None else (
                ROW_OF.get(owner[1][0], OTHER_ROW) if owner[0] == "region" else
                "backward" if owner[0] == "backward" else owner[1])
            s["in"][where] += 1

    step_us = step_s * 1e6
    if device:
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if _is_device(e) and not getattr(e, "is_user_annotation", False) and e.name not in annotation_names]
        total = sum(b - a for a, b in spans)
        busy = _union(spans)
    else:
        total = busy = attributed
    for r in rows.values():
        r["total"] = sum(r[p] for p in PHASES)
        for k in (*PHASES, "total"):
            r[k] = round(r[k] / 1e3, 3)
    return {
        "unit": "device (kernel, copy) time" if device else "self CPU time",
        "rows": rows,
        "host_syncs": {k: {"count": v["count"], "host_ms": round(v["host_ms"], 3), "in": dict(v["in"])}
                       for k, v in syncs.items()},
        "unmapped_backward": {k: round(v / 1e3, 3) for k, v in sorted(unmapped.items(), key=lambda kv: -kv[1])[:12]},
        "totals": {
            "step_ms": round(step_us / 1e3, 3),
            "attributed_ms": round(attributed / 1e3, 3),
            # Device work the profiler linked to no CPU op (0 in CPU mode).
            "unlinked_ms": round((total - attributed) / 1e3, 3),
            "work_ms": round(total / 1e3, 3),
            # Work on several streams at once (counted in the rows, once per stream).
            "concurrent_ms": round((total - busy) / 1e3, 3),
            # The device (or in CPU mode, the profiled thread) doing nothing the profiler saw.
            "idle_ms": round((step_us - busy) / 1e3, 3),
        },
    }


def _union(spans) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def format_table(table: dict) -> str:
    """Markdown: one line per row with time, then unlinked / concurrent / idle, then the step."""
    t = table["totals"]
    step = t["step_ms"] or 1.0
    ops = "kernels" if table["unit"].startswith("device") else "ops"
    lines = [f"| region ({table['unit']}) | forward ms | recompute ms | backward ms | total ms | share | calls "
             f"| {ops} |",
             "|---|---|---|---|---|---|---|---|"]
    for row, r in table["rows"].items():
        if r["total"] or r["calls"]:
            lines.append(f"| {row} | {r['forward']:.1f} | {r['recompute']:.1f} | {r['backward']:.1f} | "
                         f"{r['total']:.1f} | {100 * r['total'] / step:.1f} % | {r['calls']} | {r['kernels']} |")
    for label, key, sign in (("device work linked to no op", "unlinked_ms", 1),
                             ("minus: on several streams at once", "concurrent_ms", -1),
                             ("idle (waiting for the host)", "idle_ms", 1)):
        if t[key]:
            lines.append(f"| {label} | | | | {sign * t[key]:.1f} | {100 * sign * t[key] / step:.1f} % | | |")
    lines.append(f"| **step** | | | | **{t['step_ms']:.1f}** | 100 % | | |")
    if table["host_syncs"]:
        syncs = "; ".join(f"{k} x{v['count']} ({v['host_ms']:.1f} ms on the host; in "
                          f"{', '.join(f'{w} {n}' for w, n in v['in'].items())})"
                          for k, v in table["host_syncs"].items())
        lines.append(f"\nHost syncs: {syncs}.")
    return "\n".join(lines)


def rows_sum_ms(table: dict) -> float:
    """What the table's lines add up to: rows + unlinked - concurrent + idle (= the step)."""
    t = table["totals"]
    return sum(r["total"] for r in table["rows"].values()) + t["unlinked_ms"] - t["concurrent_ms"] + t["idle_ms"]
