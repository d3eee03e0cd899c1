"""torchtitan's own trainer through our module: the same trajectory with and without Ulysses.

Writes an offline tokenizer and text dataset, makes one seed checkpoint, then
runs ``torchtitan.train --module ulysses_dtensor.integrations.torchtitan
--config <config>`` twice from it for a few steps: one process with
``ulysses.degree 1``, and ``--nproc`` processes with ``ulysses.degree
<nproc / (tp x pp)>`` and torchtitan's own tensor / pipeline / expert
parallelism (``--tp``, ``--pp``, ``--ep``). Prints one JSON object with both
loss / grad-norm trajectories and exits non-zero when they differ by more than
the tolerance.

On CUDA the runs are the unmodified ``python -m torchtitan.train`` under
torchrun (the README launch line). torchtitan's trainer has no CPU path (it
picks "cuda" when it finds no accelerator), so without CUDA each rank runs this
file with ``--worker``, which points torchtitan's device helpers at the CPU and
gloo before starting its trainer: a check harness, not part of the plug-in.

    python scripts/torchtitan_check.py --nproc 2            # CPU: about a minute
    python scripts/torchtitan_check.py --nproc 4 --tp 2     # tp 2 x sp 2
    python scripts/torchtitan_check.py --nproc 4 --pp 2     # pp 2 x sp 2 (torchtitan's 1F1B)
    python scripts/torchtitan_check.py --nproc 4 --ep 2 --config qwen3_moe_debug_ulysses
    python scripts/torchtitan_check.py --nproc 8 --bf16     # 8 GPUs, mixed precision
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+)\s+grad_norm:\s*([-\d.naif]+)")


def make_assets(root: str) -> tuple[str, str]:
    """A word-level tokenizer (bos/eos, 203 ids) and 400 short documents, all local."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(200)]
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assets = os.path.join(root, "tokenizer")
    os.makedirs(assets, exist_ok=True)
    tok.save(os.path.join(assets, "tokenizer.json"))
    with open(os.path.join(assets, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    rng = random.Random(0)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for _ in range(400):
            text = " ".join(rng.choice(words[:50]) for _ in range(rng.randint(20, 300)))
            f.write(json.dumps({"text": text}) + "\n")
    return assets, data


def run_worker(argv: list[str]) -> None:
    """One torchrun rank: torchtitan's train.main(), on the CPU when there is no CUDA."""
    import torch

    if not torch.cuda.is_available():
        import torch.distributed as dist
        import torchtitan.tools.utils as tt_utils

        class _CpuDevice:
            """The calls torchtitan's trainer and metrics make on their device module."""

            class _Props:
                total_memory = 1 << 36
                name = "cpu"

            set_device = staticmethod(lambda *a: None)
            device_count = staticmethod(lambda: 1)
            current_device = staticmethod(lambda: 0)
            get_device_name = staticmethod(lambda *a: "cpu")
            get_device_properties = staticmethod(lambda *a: _CpuDevice._Props())
            reset_peak_memory_stats = staticmethod(lambda *a: None)
            empty_cache = staticmethod(lambda: None)
            synchronize = staticmethod(lambda *a: None)
            memory_stats = staticmethod(lambda *a: {})

        # Before the trainer modules import these names.
        tt_utils.device_type, tt_utils.device_module = "cpu", _CpuDevice
        tt_utils.get_local_device = lambda: torch.device("cpu")
        dist.Backend.default_device_backend_map["cpu"] = "gloo"
    from torchtitan.train import main

    sys.argv = [sys.argv[0], *argv]
    main()


def trajectory(log: str) -> list[tuple[int, float, float]]:
    clean = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = {}
    for m in STEP_LINE.finditer(clean):
        steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return [(s, *steps[s]) for s in sorted(steps)]


def torchrun(nproc: int, args: list[str], cuda: bool) -> str:
    # The last rank logs: under pipeline parallelism only the last stage holds the loss.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--local-ranks-filter={nproc - 1}"]
    cmd += ["-m", "torchtitan.train"] if cuda else [os.path.abspath(__file__), "--worker"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", LOG_RANK=str(nproc - 1))
    done = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"torchrun failed ({done.returncode}): {' '.join(cmd + args)}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done.stdout + done.stderr


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the Ulysses run (ulysses.degree x tp x pp)")
    ap.add_argument("--tp", type=int, default=1, help="torchtitan's tensor_parallel_degree in the Ulysses run")
    ap.add_argument("--pp", type=int, default=1, help="torchtitan's pipeline_parallel_degree in the Ulysses run")
    ap.add_argument("--ep", type=int, default=1, help="torchtitan's expert_parallel_degree in the Ulysses run")
    ap.add_argument("--config", default="llama3_debugmodel_ulysses")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bf16", action="store_true", help="torchtitan's bf16 mixed precision (default fp32)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--rtol", type=float, default=None, help="default 1e-4 (fp32), 3e-2 (bf16)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more torchtitan options")
    opts = ap.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    rtol = opts.rtol if opts.rtol is not None else (3e-2 if opts.bf16 else 1e-4)
    root = tempfile.mkdtemp(prefix="tt-check-")
    try:
        assets, data = make_assets(root)
        common = [
            "--module", "ulysses_dtensor.integrations.torchtitan", "--config", opts.config,
            "--hf_assets_path", assets, "--dataloader.dataset_path", data,
            "--training.seq_len", str(opts.seq_len), "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "bfloat16" if opts.bf16 else "float32",
            "--ulysses.attention_backend", opts.attention_backend, "--debug.seed", "42",
            "--checkpoint.enable", "--checkpoint.folder", "ckpt", "--checkpoint.interval", "100000",
            "--metrics.log_freq", "1", *opts.extra,
        ]
        seed_dir = os.path.join(root, "seed")
        torchrun(1, common + ["--dump_folder", seed_dir, "--ulysses.degree", "1",
                              "--checkpoint.create_seed_checkpoint", "--training.steps", "1"], cuda)
        sp = opts.nproc // (opts.tp * opts.pp)
        parallel = ["--parallelism.tensor_parallel_degree", str(opts.tp), "--parallelism.pipeline_parallel_degree",
                    str(opts.pp), "--parallelism.expert_parallel_degree", str(opts.ep)]
        runs = {}
        for nproc, degree, extra in ((1, 1, []), (opts.nproc, sp, parallel)):
            run_dir = os.path.join(root, f"run{nproc}")
            shutil.copytree(os.path.join(seed_dir, "ckpt"), os.path.join(run_dir, "ckpt"))
            log = torchrun(nproc, common + extra + ["--dump_folder", run_dir, "--ulysses.degree", str(degree),
                                                    "--training.steps", str(opts.steps)], cuda)
            runs[nproc] = trajectory(log)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ref, run = runs[1], runs[opts.nproc]
    ok = len(ref) == len(run) == opts.steps and all(
        abs(a[1] - b[1]) <= rtol * abs(a[1]) for a, b in zip(ref, run)
    )
    print(json.dumps({
        "device": torch.cuda.get_device_name() if cuda else "cpu (gloo, check harness)",
        "torch": torch.__version__, "config": opts.config, "nproc": opts.nproc,
        "mesh": {"sp": sp, "tp": opts.tp, "pp": opts.pp, "ep": opts.ep},
        "bf16": opts.bf16, "rtol": rtol, "one_rank": ref, f"ranks{opts.nproc}": run, "match": ok,
    }))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
