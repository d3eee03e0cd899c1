"""benchmarks/bench_data.py --quick: raw vs prepared loading, the same rows, the need arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_data_quick(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_data.py"), "--quick",
                           "--dir", str(tmp_path / "bench")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    by = {}
    for r in recs:
        by.setdefault(r["bench"], []).append(r)
    (prep,) = by["data_prepare"]
    manifest = json.loads((tmp_path / "bench" / "store" / "manifest.json").read_text())
    assert prep["tokens"] == manifest["tokens"] and prep["documents"] == by["data_corpus"][0]["documents"]
    loaders = {(r["path"], r["dp"], r["rank"]): r for r in by["data_loader"] if r.get("packing", "stream") == "stream"}
    (bfd_loader,) = [r for r in by["data_loader"] if r.get("packing") == "bfd"]
    assert bfd_loader["tokens_per_s_per_rank"] > 0
    assert {("prepared", 1, 0), ("raw", 1, 0), ("prepared", 8, 0), ("prepared", 8, 7), ("raw", 8, 0)} <= set(loaders)
    for key, r in loaders.items():
        assert r["tokens_per_s_per_rank"] > 0 and r["time_to_first_step_s"] > 0, key
        if key[2] == 0 and r["seq"] == 1024:
            assert r["same_rows_as_prepared"] is True, key  # raw and store give the same rows
    # SFT rows of 64K: the end-to-end cut splits samples, best fit only those longer than a row
    # and pads a few percent; the best-fit loader keeps the headroom
    stream, *bfd = by["data_packing"]
    assert stream["packing"] == "stream" and stream["samples_split"] > stream["longer_than_row"] > 0
    for r in bfd:
        assert r["samples_split"] == r["longer_than_row"] and 0 < r["pad_share"] < 0.05, r
    assert bfd[-1]["pad_share"] <= bfd[0]["pad_share"]  # a larger window packs tighter
    assert all(n["bfd_headroom"] > 10 for n in by["data_need"])
    # the need: flops_per_token = 6 N + 12 L H d S / 2, and the cluster's tokens/s from it
    for n in by["data_need"]:
        fpt = 6 * n["params_no_embedding"] + 6 * 32 * 32 * 128 * n["seq_len"]
        assert n["flops_per_token"] == fpt
        cluster = 8 * 989e12 * n["mfu"] / fpt
        assert abs(n["rank_tokens_per_s"] - cluster * n["sp"] / 8) < 0.1
        assert n["headroom"] > 10  # the prepared loader beats the need by 10x, even here
