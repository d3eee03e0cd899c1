"""UlyssesHFTrainer / UlyssesSFTTrainer: a Trainer or TRL script, changed in one place, trains the
same losses at 1 process as at dp_shard 2 x sp 2 and at sp 4.

The scripts are the shipped examples (``scripts/example_hf_trainer.py``,
``scripts/example_trl_sft.py``), run unchanged with different command lines inside pooled
gloo ranks: a world of 1 for the reference, a world of 4 for the meshes. Tiny models
(hidden 32, 2-4 layers, 4 heads / 2 kv heads, a byte-level vocabulary of 257) of three
families are written once per module: Llama (dense), Qwen3-MoE (MoE with its router
loss) and Qwen3-Next (gated delta-nets + full attention, MoE). fp32, 3 steps, a global
batch of 4 documents on every mesh; relative error of every step's logged loss <= 1e-5,
the same logged value on every rank.

* the Trainer with transformers' padding-free ``DataCollatorWithFlattening``: every
  family on both meshes, Llama also on dp_replicate 2 x ring 2 (HSDP with ring
  attention); at 1 process it equals transformers' own ``Trainer`` (the same script with
  the import swapped back); the evaluation loss and the predictions gathered back to
  whole sequences equal the reference's, and the saved directory loads with
  ``from_pretrained`` and gives the trained logits; a run resumed on sp 4 from the
  dp_shard 2 x sp 2 checkpoint of step 1 logs the same losses at steps 2 and 3;
* TRL's SFTTrainer: packing (best-fit decreasing, padding-free) on Llama, padded rows on
  Qwen3-MoE (TRL's router loss, without the padding), LoRA with packing on Qwen3-Next
  (resumed too; the adapter loaded with peft's ``PeftModel.from_pretrained`` gives the
  trained logits); at 1 process the first two equal TRL's own SFTTrainer (which refuses
  to pack Qwen3-Next without the causal-conv1d kernel); every variant on every family
  with ``ULYSSES_HF_TRAINER_ALL=1``; the quick tier's run: LoRA on sp 2, resumed;
* memory switches on two runs (:data:`MEMORY_SWITCHES`); ``accelerate launch`` of one
  process (the trainer makes its own world of one);
* a step with a non-finite loss or gradient skipped on every rank, and the run stopped;
* refusals: TrainingArguments, batches and objects that cannot run, one message each.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("transformers", "trl", "peft", "datasets")):
    pytest.skip("needs the hf, lora and trl extras", allow_module_level=True)

import torch  # noqa: E402
from distributed import destroy_subgroups, run_ranks  # noqa: E402
from script_module import load_script  # noqa: E402
from test_hf_integration import registry_restored  # noqa: E402

# Light at import: transformers' Trainer and TRL are imported in the pooled ranks (preloaded there).
from ulysses_dtensor.integrations.hf.ulysses_trainer import UlyssesArguments  # noqa: E402
from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import (  # noqa: E402
    check_training_arguments,
    parallelize_options,
)
from ulysses_dtensor.integrations.hf.ulysses_trainer.batches import (  # noqa: E402
    ROW_LENGTHS,
    check_same_batch,
    count_targets,
    gather_sequence,
    sp_batch,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # make_tiny_hf_model
EOS_ID = 256  # the byte tokenizer's one special token (EOS, padding)
TRAINER_SCRIPT, SFT_SCRIPT = ROOT / "scripts" / "example_hf_trainer.py", ROOT / "scripts" / "example_trl_sft.py"
FAMILIES = ("llama", "qwen3_moe", "qwen3_next")
RTOL = 1e-5
STEPS, GLOBAL_ROWS = 3, 4
# Meshes of the 4-rank world, as UlyssesArguments flags, and their data-parallel size.
MESHES = {
    "dp_shard 2 x sp 2": (["--sp_size", "2"], 2),
    "sp 4": (["--sp_size", "4"], 1),
    # HSDP (replicated over 2, sharded over sp) with ring attention (ring 2 x ulysses 1).
    "dp_replicate 2 x ring 2": (["--sp_size", "2", "--ring_size", "2", "--dp_replicate_size", "2"], 2),
}
# The memory switches on some runs (the numbers must not move): tiled MLP (MoE blocks) and
# tiled loss; checkpointed layers' inputs in host memory.
MEMORY_SWITCHES = {
    ("Trainer", "qwen3_moe", "sp 4"): ["--tiled_mlp", "--mlp_tiles", "3", "--loss_chunks", "3"],
    ("SFT", "padded rows", "dp_shard 2 x sp 2"): ["--offload_activations", "--tiled_mlp", "--loss_chunks", "2"],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
# accelerate reads a launcher's variables; the pooled ranks' group is up already (never used to connect).
LAUNCHER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# -- tiny model directories -----------------------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer without merges (256 ids) and one special token (EOS and padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def write_tiny_model(out: Path, family: str) -> None:
    """The family matrix's tiny model of ``family`` over the byte vocabulary, with its tokenizer
    (MoE families return their router loss: the Trainer trains on it too)."""
    from ulysses_dtensor.integrations.hf.matrix.tiny_configs import tiny_config, tiny_model

    tokenizer = byte_tokenizer()
    config = tiny_config(family)
    config.vocab_size = len(tokenizer)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    if hasattr(config, "output_router_logits"):
        # A coefficient that makes the router loss a tenth of the loss: a router loss counted
        # wrong (over the padding, over one rank's tokens) shows in every step's loss.
        config.output_router_logits, config.router_aux_loss_coef = True, 0.2
    tiny_model(config, attn_implementation="sdpa").save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    for family in FAMILIES:
        write_tiny_model(root / family, family)
    return {family: root / family for family in FAMILIES}


# -- running the scripts on pooled ranks ------------------------------------------------------


@contextlib.contextmanager
def script_run():
    """One script run in a pooled rank, and what it would leave behind put back: accelerate's
    process-wide state, transformers' attention registry and log level, this run's meshes,
    the environment (no network, no progress bars, the launcher's variables accelerate reads)."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.utils import logging as hf_logging

    saved_env = {k: os.environ.get(k) for k in (*OFFLINE, *LAUNCHER)}
    saved_level = hf_logging.get_verbosity()
    os.environ.update(OFFLINE)
    for key, value in LAUNCHER.items():
        os.environ.setdefault(key, value)
    hf_logging.set_verbosity_error()
    try:
        with registry_restored():
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        destroy_subgroups()
        hf_logging.set_verbosity(saved_level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stock(trainer_class):
    """The script's trainer swapped back to the library's own: the script before the change."""
    return lambda *args, ulysses_args=None, **kwargs: trainer_class(*args, **kwargs)


def _evaluating_first(trainer_class):
    """The script's trainer, evaluating before it trains (a baseline evaluation): FSDP2 left
    gathered by that forward would make the optimizer hold the gathered head and last
    block, which then never train (seen before prediction_step reset FSDP)."""
    class EvaluatingFirst(trainer_class):
        def train(self, *args, **kwargs):
            self.evaluate()
            return super().train(*args, **kwargs)

    return EvaluatingFirst


def _run_scripts(rank: int, world: int, script: str, runs: list[tuple[list[str], str | None]]) -> list[dict]:
    """Each (argv, stock) of ``runs`` through the script's ``main``; ``stock`` names the library
    trainer to run instead of ours ("Trainer" / "SFTTrainer"), or "evaluate first": ours,
    evaluating before training."""
    results = []
    for argv, stock in runs:
        module = load_script(script)
        ours = "UlyssesHFTrainer"
        if stock == "evaluate first":
            setattr(module, ours, _evaluating_first(getattr(module, ours)))
        elif stock == "Trainer":
            from transformers import Trainer

            setattr(module, ours, _stock(Trainer))
        elif stock == "SFTTrainer":
            from trl import SFTTrainer

            module.UlyssesSFTTrainer = _stock(SFTTrainer)
        with script_run():
            results.append(module.main(argv))
    return results


def _common(out: Path, model: Path, rows_per_rank: int, *extra: str) -> list[str]:
    return ["--model_dir", str(model), "--output_dir", str(out), "--use_cpu", "--max_steps", str(STEPS),
            "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--learning_rate", "3e-3",
            "--per_device_train_batch_size", str(rows_per_rank), "--per_device_eval_batch_size", "1",
            "--save_strategy", "no", "--seed", "7", *extra]


def _assert_same_losses(got: dict, want: dict, what: str) -> float:
    """Every step's loss within RTOL; returns the worst relative error."""
    assert sorted(got) == sorted(want), (what, got, want)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= RTOL, f"{what}: losses {got} vs {want} (worst relative error {worst:.1e})"
    return worst


def _same_on_every_rank(results: list[list[dict]]) -> list[dict]:
    """The logged losses are the global token mean on every rank: rank 0's, checked."""
    for r, mine in enumerate(results[1:], 1):
        for a, b in zip(results[0], mine):
            assert a["losses"] == b["losses"], f"rank {r} logged {b['losses']}, rank 0 {a['losses']}"
    return results[0]


# -- the Trainer -----------------------------------------------------------------------------------


def _trainer_runs(tmp: Path, dirs: dict, world: int) -> dict:
    """label -> (argv, stock) of the Trainer script's runs in a world of ``world`` ranks."""
    if world == 1:
        runs = {(family, "1 process"): (_common(tmp / f"t-{family}-1", dirs[family], GLOBAL_ROWS, "--do_eval",
                                                 "--predict", "true"), None) for family in FAMILIES}
        runs[("llama", "Trainer")] = (_common(tmp / "t-llama-stock", dirs["llama"], GLOBAL_ROWS, "--do_eval",
                                              "--predict", "true"), "Trainer")
        return runs
    runs = {}
    for family in FAMILIES:
        for mesh in MESHES if family == "llama" else ("dp_shard 2 x sp 2", "sp 4"):
            flags, dp = MESHES[mesh]
            extra = [*flags, *MEMORY_SWITCHES.get(("Trainer", family, mesh), [])]
            if mesh == "dp_shard 2 x sp 2":  # evaluated and predicted; Llama's checkpointed after every step
                extra += ["--do_eval", "--predict", "true"]
                if family == "llama":
                    extra += ["--save_strategy", "steps", "--save_steps", "1"]
            out = tmp / f"t-{family}-{mesh.replace(' ', '')}"
            variant = "evaluate first" if (family, mesh) == ("llama", "sp 4") else None
            runs[(family, mesh)] = (_common(out, dirs[family], GLOBAL_ROWS // dp, *extra), variant)
    # Resumed on another mesh (sp 4) from the dp_shard 2 x sp 2 run's checkpoint of step 1.
    ckpt = tmp / "t-llama-dp_shard2xsp2" / "checkpoint-1"
    runs[("llama", "resumed on sp 4")] = (_common(tmp / "t-llama-resumed", dirs["llama"], GLOBAL_ROWS, "--sp_size",
                                                  "4", "--resume_from_checkpoint", str(ckpt)), None)
    return runs


def _run_all(script: Path, runs_by_world: dict) -> dict:
    """label -> result of every run, the world of 1 first (references), then the world of 4."""
    got = {}
    for world, runs in runs_by_world.items():
        results = run_ranks(world, _run_scripts, str(script), list(runs.values()))
        got.update(zip(runs, _same_on_every_rank(results)))
    return got


def _check_mesh_runs(got: dict, what: str) -> list[str]:
    """Every mesh's losses (and evaluation) against the 1-process run; the figures."""
    lines = []
    for (case, mesh), result in got.items():
        if mesh in ("1 process", "Trainer", "SFTTrainer") or mesh.startswith("resumed"):
            continue
        ref = got[(case, "1 process")]
        worst = _assert_same_losses(result["losses"], ref["losses"], f"{what} {case} on {mesh}")
        if "eval_loss" in result:
            assert math.isclose(result["eval_loss"], ref["eval_loss"], rel_tol=RTOL), (case, mesh, result, ref)
        if "predictions" in result:
            # Whole sequences (not one rank's slice), every data-parallel rank's rows once.
            assert result["predictions"].shape == ref["predictions"].shape, (case, mesh)
            torch.testing.assert_close(torch.as_tensor(result["predictions"]), torch.as_tensor(ref["predictions"]),
                                       rtol=1e-4, atol=1e-4)
        lines.append(f"{what} {case} {mesh}: worst loss rel. err. {worst:.1e}")
    return lines


def _check_resumed(got: dict, case: str, what: str) -> str:
    resumed, whole = got[(case, "resumed on sp 4")]["losses"], got[(case, "dp_shard 2 x sp 2")]["losses"]
    later = range(2, STEPS + 1)  # step 1's loss is the checkpoint's log
    worst = _assert_same_losses({s: resumed[s] for s in later}, {s: whole[s] for s in later}, f"{what} resumed")
    return f"{what} {case} resumed on sp 4 from dp_shard 2 x sp 2 step 1: worst loss rel. err. {worst:.1e}"


def test_trainer_script_same_losses_on_every_mesh(model_dirs, tmp_path):
    got = _run_all(TRAINER_SCRIPT, {1: _trainer_runs(tmp_path, model_dirs, 1), 4: _trainer_runs(tmp_path,
                                                                                               model_dirs, 4)})
    # Our run in one process is transformers' own Trainer's.
    ours, stock = got[("llama", "1 process")], got[("llama", "Trainer")]
    lines = [f"Trainer llama 1 process vs transformers' Trainer: worst loss rel. err. "
             f"{_assert_same_losses(ours['losses'], stock['losses'], 'vs Trainer'):.1e}"]
    assert math.isclose(ours["eval_loss"], stock["eval_loss"], rel_tol=RTOL), (ours["eval_loss"], stock["eval_loss"])
    torch.testing.assert_close(torch.as_tensor(ours["predictions"]), torch.as_tensor(stock["predictions"]),
                               rtol=1e-4, atol=1e-4)
    lines += _check_mesh_runs(got, "Trainer")
    lines.append(_check_resumed(got, "llama", "Trainer"))
    print("\n" + "\n".join(lines))
    # The saved directory is a from_pretrained model with the trained weights; checkpoints hold the state.
    out = tmp_path / "t-llama-dp_shard2xsp2"
    _assert_from_pretrained_logits(out, got[("llama", "dp_shard 2 x sp 2")])
    from ulysses_dtensor.integrations.hf.ulysses_trainer.checkpoints import STATE_DIR

    assert (out / "checkpoint-1" / STATE_DIR / ".metadata").is_file()


# -- TRL's SFTTrainer -------------------------------------------------------------------------------

# case -> (family, the script's flags)
SFT_CASES = {
    "packing": ("llama", ["--packing", "--max_length", "64"]),
    "padded rows": ("qwen3_moe", ["--max_length", "64"]),  # the router told each row's length
    "LoRA + packing": ("qwen3_next", ["--packing", "--max_length", "64", "--lora_r", "4", "--learning_rate", "3e-2"]),
}


def _sft_runs(tmp: Path, dirs: dict, world: int) -> dict:
    runs = {}
    for case, (family, flags) in SFT_CASES.items():
        name = case.replace(" ", "").replace("+", "-")
        common = [*flags, "--bf16", "false"]
        if world == 1:
            predict = ["--predict", "true"] if case == "LoRA + packing" else []
            runs[(case, "1 process")] = (_common(tmp / f"s-{name}-1", dirs[family], GLOBAL_ROWS, *common,
                                                 "--do_eval", *predict), None)
            if case != "LoRA + packing":  # TRL refuses to pack Qwen3-Next without the causal-conv1d kernel
                runs[(case, "SFTTrainer")] = (_common(tmp / f"s-{name}-stock", dirs[family], GLOBAL_ROWS, *common),
                                              "SFTTrainer")
            continue
        for mesh in ("dp_shard 2 x sp 2", "sp 4"):
            flags_, dp = MESHES[mesh]
            extra = [*common, *flags_, *MEMORY_SWITCHES.get(("SFT", case, mesh), [])]
            if mesh == "dp_shard 2 x sp 2":
                extra += ["--do_eval"]
                if case == "LoRA + packing":
                    extra += ["--predict", "true", "--save_strategy", "steps", "--save_steps", "1"]
            runs[(case, mesh)] = (_common(tmp / f"s-{name}-{mesh.replace(' ', '')}", dirs[family], GLOBAL_ROWS // dp,
                                          *extra), None)
    if world == 1:
        return runs
    family, flags = SFT_CASES["LoRA + packing"]
    ckpt = tmp / "s-LoRA-packing-dp_shard2xsp2" / "checkpoint-1"
    runs[("LoRA + packing", "resumed on sp 4")] = (_common(
        tmp / "s-LoRA-resumed", dirs[family], GLOBAL_ROWS, *flags, "--bf16", "false", "--sp_size", "4",
        "--resume_from_checkpoint", str(ckpt)), None)
    return runs


def test_sft_script_same_losses_on_every_mesh(model_dirs, tmp_path):
    got = _run_all(SFT_SCRIPT, {1: _sft_runs(tmp_path, model_dirs, 1), 4: _sft_runs(tmp_path, model_dirs, 4)})
    lines = []
    for case in ("packing", "padded rows"):  # our run in one process is TRL's own SFTTrainer's
        worst = _assert_same_losses(got[(case, "1 process")]["losses"], got[(case, "SFTTrainer")]["losses"],
                                    f"{case} vs SFTTrainer")
        lines.append(f"SFT {case} 1 process vs TRL's SFTTrainer: worst loss rel. err. {worst:.1e}")
    lines += _check_mesh_runs(got, "SFT")
    lines.append(_check_resumed(got, "LoRA + packing", "SFT"))
    print("\n" + "\n".join(lines))
    # The adapter loads with peft on the base model and gives the trained logits.
    family = SFT_CASES["LoRA + packing"][0]
    out = tmp_path / "s-LoRA-packing-dp_shard2xsp2"
    assert (out / "adapter_model.safetensors").is_file() and not list(out.glob("model*.safetensors"))
    _assert_from_pretrained_logits(out, got[("LoRA + packing", "dp_shard 2 x sp 2")], base=model_dirs[family])


SFT_VARIANTS = {"packing": ["--packing", "--max_length", "64"], "padded rows": ["--max_length", "64"],
                "LoRA + packing": SFT_CASES["LoRA + packing"][1]}


@pytest.mark.slow
def test_sft_every_family_and_variant(model_dirs, tmp_path):
    """Every SFT variant on every family (the default suite runs each variant on one):
    ``ULYSSES_HF_TRAINER_ALL=1``, about 3 minutes on 2 cores."""
    if not os.environ.get("ULYSSES_HF_TRAINER_ALL"):
        pytest.skip("the whole cross runs with ULYSSES_HF_TRAINER_ALL=1")
    runs = {1: {}, 4: {}}
    for family in FAMILIES:
        for variant, flags in SFT_VARIANTS.items():
            name = f"{family}-{variant}".replace(" ", "").replace("+", "-")
            common = [*flags, "--bf16", "false"]
            runs[1][(f"{variant} {family}", "1 process")] = (_common(tmp_path / f"a-{name}-1", model_dirs[family],
                                                                      GLOBAL_ROWS, *common), None)
            for mesh in ("dp_shard 2 x sp 2", "sp 4"):
                mesh_flags, dp = MESHES[mesh]
                runs[4][(f"{variant} {family}", mesh)] = (_common(
                    tmp_path / f"a-{name}-{mesh.replace(' ', '')}", model_dirs[family], GLOBAL_ROWS // dp, *common,
                    *mesh_flags), None)
    print("\n" + "\n".join(_check_mesh_runs(_run_all(SFT_SCRIPT, runs), "SFT")))


def _assert_from_pretrained_logits(directory: Path, result: dict, base: Path | None = None) -> None:
    """Each evaluation row's documents, each alone, through the saved model (``from_pretrained``;
    a peft adapter on ``base``) give the logits the trained model predicted under SP."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base or directory, dtype=torch.float32)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, directory)
    model.eval()
    predictions = torch.as_tensor(result["predictions"])
    checked = 0
    for row, ids in enumerate(result["eval_input_ids"]):
        ids = torch.as_tensor(ids)
        starts = [0] + [i for i in range(1, len(ids)) if ids[i - 1] == EOS_ID] + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):  # packed rows: one document after another
            with torch.no_grad():
                want = model(input_ids=ids[None, a:b]).logits[0]
            torch.testing.assert_close(predictions[row, a:b], want, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= len(result["eval_input_ids"])


def test_sft_lora_sp2_checkpoints_and_resumes(tmp_path):
    """The quick tier's run, the docs' CPU commands: ``scripts/make_tiny_hf_model.py``'s Llama (a BPE
    tokenizer), TRL's packed LoRA fine-tuning on 2 ranks (sp 2) with a checkpoint every step;
    resumed from step 1 it logs the same losses at steps 2 and 3."""
    from make_tiny_hf_model import make_tiny_hf_model

    model = tmp_path / "tiny-llama"
    make_tiny_hf_model(model, "llama")
    flags = ["--packing", "--max_length", "64", "--lora_r", "4", "--learning_rate", "3e-2", "--bf16", "false",
             "--sp_size", "2"]
    first = _common(tmp_path / "sft", model, GLOBAL_ROWS, *flags, "--save_strategy", "steps", "--save_steps", "1")
    resumed = _common(tmp_path / "sft-resumed", model, GLOBAL_ROWS, *flags, "--resume_from_checkpoint",
                      str(tmp_path / "sft" / "checkpoint-1"))
    whole, again = _same_on_every_rank(run_ranks(2, _run_scripts, str(SFT_SCRIPT), [(first, None), (resumed, None)]))
    later = range(2, STEPS + 1)
    _assert_same_losses({s: again["losses"][s] for s in later}, {s: whole["losses"][s] for s in later}, "resumed")
    assert (tmp_path / "sft" / "adapter_model.safetensors").is_file()


def test_accelerate_launch_runs_the_sft_script_alone(model_dirs, tmp_path):
    """``accelerate launch`` (one CPU process: no launcher's process group, the trainer makes a
    world of one) trains, logs and saves."""
    import subprocess

    out = tmp_path / "launched"
    argv = _common(out, model_dirs["llama"], GLOBAL_ROWS, "--max_length", "64", "--bf16", "false", "--num_docs", "8")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu",
                           "--num_processes", "1", str(SFT_SCRIPT), *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("losses "))
    losses = eval(line.split(";")[0].removeprefix("losses "))  # noqa: S307 - the script's own printout
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values()), line
    assert (out / "config.json").is_file() and list(out.glob("model*.safetensors")), sorted(out.iterdir())


# -- non-finite steps -------------------------------------------------------------------------------


def _run_injected(rank: int, world: int, script: str, runs: list[tuple[list[str], str]]) -> list[str | None]:
    """Each (argv, faults) of ``runs`` through the script with runtime/nonfinite.py's test hook
    set; the NonFiniteError's message, or None when the run finished."""
    from ulysses_dtensor.runtime.nonfinite import NONFINITE_FAULT_ENV, NonFiniteError

    allocator = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "ULYSSES_DTENSOR_ALLOC_DEFAULT")
    saved = {k: os.environ.pop(k, None) for k in allocator}  # unset: the trainer sets its default
    out = []
    for argv, faults in runs:
        os.environ[NONFINITE_FAULT_ENV] = faults
        try:
            with script_run():
                load_script(script).main(argv)
            out.append(None)
        except NonFiniteError as e:
            out.append(str(e))
        finally:
            del os.environ[NONFINITE_FAULT_ENV]
    out.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    for key, value in saved.items():
        os.environ.pop(key, None)
        if value is not None:
            os.environ[key] = value
    return out


def test_nonfinite_steps_are_skipped_and_stop_the_trainer(model_dirs, tmp_path):
    """UlyssesHFTrainer on sp 2, a checkpoint every step. A NaN in rank 1's gradient shard only at
    step 3 (one skip allowed): step 3 is skipped on both ranks -- no checkpoint-3, and the model
    saved after train() is checkpoint-2's, bit for bit. A NaN loss on rank 0 at step 2 with
    max_nonfinite_steps 0: train() raises on both ranks with one message naming step 2, rank 0's
    loss and checkpoint-1, and writes no checkpoint-2. PYTORCH_CUDA_ALLOC_CONF unset, the trainer
    set its default."""
    from safetensors.torch import load_file

    skip = tmp_path / "skip"
    stop = tmp_path / "stop"
    every_step = ["--sp_size", "2", "--save_strategy", "steps", "--save_steps", "1"]
    runs = [(_common(skip, model_dirs["llama"], GLOBAL_ROWS, *every_step, "--max_nonfinite_steps", "1"), "grad:1:3"),
            (_common(stop, model_dirs["llama"], GLOBAL_ROWS, *every_step, "--max_nonfinite_steps", "0"), "loss:0:2")]
    results = run_ranks(2, _run_injected, str(TRAINER_SCRIPT), runs)
    assert results[0] == results[1]
    finished, stopped, allocator = results[0]
    assert allocator == "expandable_segments:True"  # unset before: UlyssesHFTrainer's default
    assert finished is None
    assert sorted(p.name for p in skip.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    saved, step2 = (load_file(d / "model-00001-of-00001.safetensors") for d in (skip, skip / "checkpoint-2"))
    assert saved.keys() == step2.keys() and all(torch.equal(saved[k], step2[k]) for k in saved)
    assert stopped == (
        "training stopped at step 2: 1 step in a row with a non-finite loss or gradient norm (step 2; "
        "UlyssesArguments.max_nonfinite_steps=0 stops at the first); no update of that step was applied. Step 2: "
        f"loss not finite on rank 0. Last checkpoint: {stop / 'checkpoint-1'}; resume_from_checkpoint="
        f"'{stop / 'checkpoint-1'}' resumes there: change what diverged first (e.g. a lower learning_rate), or it "
        "will diverge again."), stopped
    assert sorted(p.name for p in stop.glob("checkpoint-*")) == ["checkpoint-1"]


# -- what cannot run is refused, by name ------------------------------------------------------------


def _training_args(**overrides):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    for key, value in overrides.items():  # set after construction: some would be rejected on CPU first
        setattr(args, key, value)
    return args


REFUSED_ARGUMENTS = [
    (dict(deepspeed="ds_config.json"), "deepspeed"),
    (dict(fsdp=["full_shard"]), "fsdp"),
    (dict(parallelism_config=object()), "parallelism_config"),
    (dict(fp16=True), "fp16"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    (dict(average_tokens_across_devices=False), "average_tokens_across_devices"),
    (dict(optim="adafactor"), "optim"),
    (dict(torch_compile_mode="max-autotune"), "torch_compile_mode"),
    (dict(push_to_hub=True), "push_to_hub"),
    (dict(train_sampling_strategy="batch_rebalance"), "train_sampling_strategy"),
    (dict(activation_checkpointing_kwargs={"use_reentrant": True}), "activation_checkpointing_kwargs"),
    (dict(label_names=["targets"]), "label_names"),
]


@pytest.mark.parametrize("overrides, name", REFUSED_ARGUMENTS, ids=[n for _, n in REFUSED_ARGUMENTS])
def test_training_arguments_that_cannot_run_are_refused_by_name(overrides, name):
    with pytest.raises(ValueError, match=rf"TrainingArguments\.{name}=.* is not supported by UlyssesHFTrainer: "):
        check_training_arguments(_training_args(**overrides))


def test_training_arguments_translate_to_the_parallelize_options():
    check_training_arguments(_training_args())  # the defaults run
    plain = parallelize_options(_training_args(), UlyssesArguments())
    assert (plain["memory"].ac_mode, plain["compile"], plain["param_dtype"]) == ("none", False, torch.float32)
    full = parallelize_options(_training_args(activation_checkpointing=True, torch_compile=True, bf16=True),
                               UlyssesArguments(tiled_mlp=True, sp_size=2))
    assert (full["memory"].ac_mode, full["compile"], full["param_dtype"], full["memory"].tiled_mlp) == (
        "full", True, torch.bfloat16, True)
    every = parallelize_options(_training_args(activation_checkpointing=True,
                                               activation_checkpointing_kwargs={"every_n_layers": 2}),
                                UlyssesArguments())
    assert (every["memory"].ac_mode, every["memory"].selective_ac) == ("selective", 2)
    offload = parallelize_options(_training_args(activation_checkpointing_kwargs={"offload": True}),
                                  UlyssesArguments())
    assert (offload["memory"].ac_mode, offload["memory"].offload_activations) == ("full", True)
    assert plain["float8"] is None
    fp8 = parallelize_options(_training_args(), UlyssesArguments(float8=True, float8_recipe="tensorwise",
                                                                 float8_filter_fqns="lm_head, gate",
                                                                 float8_emulate=True, float8_fsdp_all_gather=True))
    assert (fp8["float8"].recipe_name, fp8["float8"].filter_fqns, fp8["float8"].emulate,
            fp8["float8"].enable_fsdp_float8_all_gather) == ("tensorwise", ("lm_head", "gate"), True, True)
    with pytest.raises(ValueError, match="UlyssesArguments: float8 enable_fsdp_float8_all_gather=true needs "
                                         "recipe_name='tensorwise'"):
        UlyssesArguments(float8=True, float8_fsdp_all_gather=True)
    for bad, match in [(dict(sp_size=0), "sp_size=0"), (dict(sp_size=4, ring_size=3), "ring_size=3 must divide"),
                       (dict(attn_backend="flash"), "attn_backend='flash'"), (dict(dp_shard_size=0), "dp_shard_size")]:
        with pytest.raises(ValueError, match=match):
            UlyssesArguments(**bad)


def test_batches_that_cannot_run_are_refused_and_right_padding_runs():
    ids = torch.arange(12).reshape(2, 6)
    with pytest.raises(ValueError, match="batch key 'pixel_values'"):
        sp_batch({"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(2, 3)}, need_labels=True)
    left = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    with pytest.raises(ValueError, match="padding on the left or inside rows"):
        sp_batch({"input_ids": ids, "labels": ids, "attention_mask": left}, need_labels=True)
    with pytest.raises(ValueError, match="custom mask"):
        sp_batch({"input_ids": ids, "attention_mask": torch.zeros(2, 1, 6, 6)}, need_labels=False)
    with pytest.raises(ValueError, match="no position_ids"):
        sp_batch({"input_ids": ids, "labels": ids, "cu_seq_lens_q": torch.tensor([0, 6])}, need_labels=True)
    with pytest.raises(ValueError, match="has no labels"):
        sp_batch({"input_ids": ids}, need_labels=True)
    # Right padding: the mask goes, the padding's labels are ignored; the targets are counted once.
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    batch = sp_batch({"input_ids": ids, "labels": ids, "attention_mask": right}, need_labels=True)
    assert set(batch) == {"input_ids", "labels", ROW_LENGTHS} and batch["labels"][0, 4:].eq(-100).all()
    assert batch[ROW_LENGTHS].tolist() == [4, 6]  # what MoE routers count
    assert int(count_targets(batch)) == 3 + 5
    # Packed documents (positions restart): no target across a document edge; shift_labels unshifted.
    packed = {"input_ids": ids[:1], "labels": ids[:1], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    assert int(count_targets(sp_batch(packed, need_labels=True))) == 4
    shifted = sp_batch({"input_ids": ids[:1], "shift_labels": torch.tensor([[1, 2, -100, 4, 5, -100]])},
                       need_labels=True)
    assert shifted["labels"].tolist() == [[-100, 1, 2, -100, 4, 5]] and int(count_targets(shifted)) == 4


def _refusals_one_process(rank: int, world: int, model_dir: str, out: str) -> list[str]:
    """The trainer objects refused in one process, each message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
    from trl import SFTConfig

    from ulysses_dtensor.integrations.hf import UlyssesHFTrainer
    from ulysses_dtensor.integrations.trl import UlyssesSFTTrainer

    messages = []
    with script_run():
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
        attempts = [
            lambda: UlyssesHFTrainer(model_init=lambda: model, args=args, train_dataset=rows),
            lambda: UlyssesHFTrainer(model=model, args=args, train_dataset=rows,
                                     compute_loss_func=lambda outputs, labels, num_items_in_batch: 0),
            lambda: UlyssesHFTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                                     train_dataset=rows, optimizers=(torch.optim.SGD([torch.zeros(1)], lr=0.1), None)),
            lambda: UlyssesHFTrainer(model=model, args=args, train_dataset=rows, ulysses_args={"sp_size": 2}),
            lambda: UlyssesHFTrainer(model=model, args=args, train_dataset=rows, ulysses_args=UlyssesArguments(
                sp_size=2)),
        ]
        from datasets import Dataset

        sft_args = SFTConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=1, bf16=False, loss_type="dft")
        attempts.append(lambda: UlyssesSFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                                                  args=sft_args, processing_class=tokenizer,
                                                  train_dataset=Dataset.from_list([{"text": "a b c"}])))
        for attempt in attempts:
            try:
                attempt()
            except (ValueError, TypeError) as e:
                messages.append(str(e))
            else:
                messages.append("not refused")
            destroy_subgroups()
    return messages


def _refusals_four_ranks(rank: int, world: int, model_dir: str, out: str) -> list[str]:
    """What only several ranks can get wrong: different weights, different batches."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    from ulysses_dtensor.integrations.hf.ulysses_trainer.mixin import UlyssesHFTrainer

    messages = []
    with script_run():
        torch.manual_seed(rank)  # every rank its own random model
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1)
        try:
            UlyssesHFTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2]}],
                             ulysses_args=UlyssesArguments(sp_size=2))
        except ValueError as e:
            messages.append(str(e))
        destroy_subgroups()
        from torch.distributed.device_mesh import init_device_mesh

        sp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))["sp"]
        try:  # the sp ranks of a group given different batches (rank 3's differs)
            ids = torch.full((1, 8), 3 if rank == 3 else 1)
            check_same_batch({"input_ids": ids}, sp.get_group(), 2)
            messages.append("same")
        except ValueError as e:
            messages.append(str(e))
        # The whole sequence back from the slices (a ring layout undone): the rank's rows, whole.
        local = torch.arange(8).reshape(1, 8)[:, sp.get_local_rank() * 4:(sp.get_local_rank() + 1) * 4]
        messages.append(gather_sequence(local, sp.get_group(), 2, 1, 7).tolist())
    return messages


def test_trainer_objects_that_cannot_run_are_refused_by_name(model_dirs, tmp_path):
    one = run_ranks(1, _refusals_one_process, str(model_dirs["llama"]), str(tmp_path / "one"))[0]
    expected = [
        "UlyssesHFTrainer needs model=: model_init=",
        "compute_loss_func= is not supported by UlyssesHFTrainer",
        "optimizers=(optimizer, scheduler) is not supported by UlyssesHFTrainer",
        "ulysses_args must be a UlyssesArguments, got dict",
        "UlyssesArguments(dp_replicate_size=1, dp_shard_size=-1, sp_size=2, ring_size=1) on 1 processes:",
        "SFTConfig.loss_type='dft' is not supported by UlyssesSFTTrainer",
    ]
    for message, want in zip(one, expected):
        assert want in message, (want, message)
    four = run_ranks(4, _refusals_four_ranks, str(model_dirs["llama"]), str(tmp_path / "four"))
    for rank, (weights, batches, whole) in enumerate(four):
        assert "the model's weights differ between ranks (first: model.embed_tokens.weight)" in weights, weights
        if rank < 2:
            assert batches == "same"
        else:
            assert "sp ranks of one group received different batches (sp rank 1 differs" in batches, batches
        assert whole == [list(range(7))]
