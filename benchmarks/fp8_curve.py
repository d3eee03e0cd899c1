"""Does FP8 training track bf16? The debug model's loss curves, side by side.

    python benchmarks/fp8_curve.py --out /tmp/fp8_curve                 # train both (2 CPU ranks), compare
    python benchmarks/fp8_curve.py --bf16 A/metrics.jsonl --fp8 B/metrics.jsonl   # compare two runs

Trains ``train_configs/debug_model.toml`` twice on the same data and seed, bf16 compute, with
and without ``[float8]`` (rowwise; emulated where no FP8 GPU is present), then prints one JSON
object: the final losses, the largest relative gap between the two curves (raw and smoothed
over 10 steps), the steps each curve reaches a few loss levels, and whether any step was
non-finite; with ``--plot`` the two curves and their gap as a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(dump: Path, nproc: int, steps: int, fp8: bool, emulate: bool) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "ulysses_dtensor.train", "--config", str(ROOT / "train_configs" / "debug_model.toml"),
           "--job.dump_folder", str(dump), "--training.steps", str(steps),
           "--training.mixed_precision_param", "bfloat16", "--checkpoint.enable", "false",
           "--metrics.log_freq", "50"]
    if fp8:
        cmd += ["--float8.enable", "true"] + (["--float8.emulate", "true"] if emulate else [])
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dump / "metrics.jsonl"


def _losses(path: Path) -> list[float | None]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r.get("loss") for r in rows]


def _smooth(values: list[float], k: int = 10) -> list[float]:
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def compare(bf16: list, fp8: list) -> dict:
    finite = all(v is not None for v in bf16 + fp8)
    n = min(len(bf16), len(fp8))
    a, b = bf16[:n], fp8[:n]
    gap = [abs(x - y) / x for x, y in zip(a, b)] if finite else []
    sgap = [abs(x - y) / x for x, y in zip(_smooth(a), _smooth(b))] if finite else []

    def reached(curve, level):
        return next((i + 1 for i, v in enumerate(_smooth(curve)) if v <= level), None) if finite else None

    levels = [4.0, 3.0, 2.5]
    return {
        "bench": "fp8_curve", "steps": n, "all_finite": finite,
        "final_loss": {"bf16": a[-1], "fp8": b[-1]},
        "max_rel_gap": max(gap) if gap else None,
        "max_rel_gap_smoothed_10": max(sgap) if sgap else None,
        "final_rel_gap": gap[-1] if gap else None,
        "step_reaching_smoothed_loss": {str(lv): {"bf16": reached(a, lv), "fp8": reached(b, lv)} for lv in levels},
    }


def _plot(bf16: list, fp8: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, min(len(bf16), len(fp8)) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=[3, 1])
    top.plot(steps, bf16[:len(steps)], label="bf16", lw=1)
    top.plot(steps, fp8[:len(steps)], label="FP8 rowwise", lw=1)
    top.set_ylabel("loss")
    top.legend()
    top.set_title("debug model, 2 CPU ranks (sp 2), FP8 emulated")
    bottom.plot(steps, [100 * (y - x) / x for x, y in zip(bf16, fp8)], lw=0.8, color="gray")
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_ylabel("FP8 - bf16 (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for the two runs (trains them)")
    p.add_argument("--bf16", help="metrics.jsonl of a bf16 run (with --fp8: compare, no training)")
    p.add_argument("--fp8", help="metrics.jsonl of the FP8 run")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--no-emulate", action="store_true", help="on an FP8 GPU: real FP8 matmuls")
    p.add_argument("--plot", help="write the curves to this PNG")
    a = p.parse_args(argv)
    if a.bf16 and a.fp8:
        bf16_path, fp8_path = Path(a.bf16), Path(a.fp8)
    elif a.out:
        out = Path(a.out)
        bf16_path = _train(out / "bf16", a.nproc, a.steps, False, False)
        fp8_path = _train(out / "fp8", a.nproc, a.steps, True, not a.no_emulate)
    else:
        p.error("give --out (train both) or --bf16 and --fp8 (compare)")
    bf16, fp8 = _losses(bf16_path), _losses(fp8_path)
    print(json.dumps(compare(bf16, fp8)))
    if a.plot:
        _plot(bf16, fp8, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
