"""FP8 linear layers under SP (torchao float8, emulated on CPU): the same numbers on every mesh.

The layer-level property first: two sp ranks each run half of a sequence through a
stack of FP8 linear layers; their outputs, summed weight gradients and input gradients
must equal one process running the whole sequence. Rowwise scales are per token, so
this holds as it is; tensorwise scales hold it only because the input and output-gradient
amax are reduced over the sp group -- without that reduction the same run differs (the
test shows it, so it can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks

pytest.importorskip("torchao")

from ulysses_dtensor.precision.float8 import (  # noqa: E402
    Float8Options,
    convert_to_float8,
    precompute_fp8_weight_scales,
)

SEQ, DIM = 64, 64


def _stack(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 96, bias=False), nn.GELU(), nn.Linear(96, DIM, bias=False),
                         nn.Linear(DIM, 8, bias=False))  # the last: 8 outputs, not % 16: left in high precision


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, SEQ, DIM, generator=g) * torch.linspace(0.1, 3.0, SEQ).view(1, SEQ, 1)  # amax varies by token
    w = torch.randn(1, SEQ, 8, generator=g)
    return x, w


def _step(model, x, w):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * w).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _halves_worker(rank: int, world: int, recipe: str, reduce: bool):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _stack()
    with pytest.warns(UserWarning, match="emulate=true"):
        report = convert_to_float8(model, Float8Options(enable=True, recipe_name=recipe, emulate=True,
                                                        filter_fqns=()),
                                   device="cpu", sp_mesh=mesh if reduce else None)
    x, w = _data()
    part = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    out, x_grad, grads = _step(model, x[:, part], w[:, part])
    for g in grads:  # what FSDP's reduce-scatter does over the sp ranks: sum the shares
        dist.all_reduce(g)
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out)
    xgs = [torch.empty_like(x_grad) for _ in range(world)]
    dist.all_gather(xgs, x_grad)
    return report.converted, len(report.wrong_size), torch.cat(outs, 1), torch.cat(xgs, 1), grads


def _reference(recipe: str):
    model = _stack()
    convert_to_float8(model, Float8Options(enable=True, recipe_name=recipe, emulate=True, filter_fqns=()),
                      device="cpu")
    return _step(model, *_data())


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


@pytest.mark.filterwarnings("ignore:float8 emulate")
@pytest.mark.parametrize("recipe, reduce, equal", [
    ("rowwise", False, True), ("rowwise_with_gw_hp", False, True),
    ("tensorwise", True, True), ("tensorwise", False, False),
])
def test_halves_of_a_sequence_equal_the_whole(recipe, reduce, equal):
    converted, wrong_size, out, x_grad, grads = run_ranks(2, _halves_worker, recipe, reduce)[0]
    assert (converted, wrong_size) == (2, 1)
    ref_out, ref_x_grad, ref_grads = _reference(recipe)
    diffs = [_max_diff(out, ref_out), _max_diff(x_grad, ref_x_grad)] + [_max_diff(g, r) for g, r in zip(grads, ref_grads)]
    if equal:  # float32 reduction order of the summed weight gradients only
        assert max(diffs) < 1e-5, (recipe, diffs)
    else:  # each half scaled by its own amax: FP8 rounding differs visibly
        assert max(diffs) > 1e-3, (recipe, diffs)


def test_refusals_name_what_would_be_valid():
    with pytest.raises(ValueError, match=r"float8 recipe_name='blockwise'; valid: rowwise, rowwise_with_gw_hp, "
                                         r"tensorwise"):
        Float8Options(enable=True, recipe_name="blockwise")
    with pytest.raises(ValueError, match=r"enable_fsdp_float8_all_gather=true needs recipe_name='tensorwise'"):
        Float8Options(enable=True, enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match=r"float8 on cpu: FP8 matmuls need a GPU of compute capability 8.9 or newer"
                                         r".*emulate=true"):
        convert_to_float8(_stack(), Float8Options(enable=True), device="cpu")

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 32))

    moe = nn.Module()
    moe.experts = Experts()
    with pytest.raises(ValueError, match=r"float8: 1 MoE expert modules hold their experts as fused 3-D weights "
                                         r"\(first: 'experts'\).*filter_fqns \+= \['experts'\]"):
        convert_to_float8(moe, Float8Options(enable=True, emulate=True), device="cpu")
    # Filtered by name: left in high precision, counted.
    model = _stack()
    with pytest.warns(UserWarning):
        report = convert_to_float8(model, Float8Options(enable=True, emulate=True, filter_fqns=("0",)), device="cpu")
    assert (report.converted, report.filtered, report.wrong_size) == (1, ["0"], ["3"])
    assert report.describe() == ("float8 rowwise (emulated: tests only): 1 linear layers in FP8; 2 left in high "
                                 "precision (1 by filter_fqns, 1 with a size not divisible by 16)")


# --------------------------------------------------------------------------- #
# The debug Llama in FP8 under SP + FSDP2 against one process
# --------------------------------------------------------------------------- #

SEQ_LM, ROWS, STEPS = 32, 4, 2  # 32 tokens: no padding at sp 2 or 4 (padding would join a tensorwise amax)


def _lm_batch(step: int, vocab: int) -> dict:
    from test_parallelize import global_batch

    batch = global_batch(step, vocab)  # 1-3 packed documents per row
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, vocab, (ROWS, SEQ_LM), generator=g)
    pos = torch.cat([batch["position_ids"][:, :SEQ_LM - 2], torch.arange(2).expand(ROWS, 2)], 1)  # a last document
    return {"input_ids": ids, "position_ids": pos}


def _train_lm(model, pmesh, micro_rows: int | None = None, steps: int = None) -> dict:
    """Two AdamW steps (or ``steps``); with ``pmesh`` this rank's share of each global batch; without it one
    process, the rows in micro-batches of ``micro_rows`` (what each dp rank runs)."""
    from test_parallelize import _mine, canonical

    from ulysses_dtensor.models.llama_parallelize import clip_grad_norm_
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import count_valid_tokens, global_loss, sp_cross_entropy

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out = {"loss": [], "norm": []}
    for step in range(steps or STEPS):
        batch = _lm_batch(step, model.args.vocab_size)
        if pmesh is not None:
            per = ROWS // pmesh.dims.dp
            rows = slice(pmesh.dp_rank * per, (pmesh.dp_rank + 1) * per)
            parts, mesh = [shard_batch({k: v[rows] for k, v in batch.items()}, pmesh.sp)], pmesh.loss
        else:
            step_rows = micro_rows or ROWS
            parts = [shard_batch({k: v[i:i + step_rows] for k, v in batch.items()}) for i in range(0, ROWS, step_rows)]
            mesh = None
        total = sum(count_valid_tokens(p["labels"], mesh) for p in parts)
        loss_sum = 0.0
        for p in parts:
            logits = model(p["input_ids"], p["position_ids"], p["document_ids"])
            loss = sp_cross_entropy(logits, p["labels"], mesh, num_valid_tokens=total)
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        if step == 0:
            out["grads"] = {canonical(n): _mine(q.grad).clone() for n, q in model.named_parameters()}
        out["norm"].append(clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        precompute_fp8_weight_scales(model)  # as the trainer's step does (FP8 all-gathers only)
        opt.zero_grad()
        out["loss"].append(global_loss(loss_sum, mesh).item())
    return out


def _fp8(recipe: str) -> Float8Options:
    return Float8Options(enable=True, recipe_name=recipe, emulate=True)


def _fp8_mesh_worker(rank: int, world: int, cases: list) -> list:
    import warnings

    from test_parallelize import canonical
    from ulysses_dtensor import MemoryOptions, ParallelDims, parallelize_llama
    from ulysses_dtensor.models.llama import Llama, llama_args
    from shards import reference_part

    results = []
    for dims, ring, recipe, memory, micro in cases:
        warnings.simplefilter("ignore")  # torchao's emulation warning, once per model
        torch.manual_seed(0)
        ref_model = Llama(llama_args("debug"))
        ref_model.init_weights(1234)
        convert_to_float8(ref_model, _fp8(recipe), device="cpu")
        ref = _train_lm(ref_model, None, micro_rows=micro)
        pmesh = ParallelDims(*dims, world_size=world, ring=ring).build_mesh("cpu")
        with torch.device("meta"):
            model = Llama(llama_args("debug"))
        memory = dict(memory)
        compiled = memory.pop("compile", None)  # a torch.compile backend for each block, or None
        parallelize_llama(model, pmesh, memory=MemoryOptions(**memory), float8=_fp8(recipe),
                          compile=compiled is not None, compile_backend=compiled or "inductor")
        model.to_empty(device="cpu")
        model.init_weights(1234)
        out = _train_lm(model, pmesh)
        held = {canonical(n): p for n, p in model.named_parameters()}
        grad_rel = max(((out["grads"][n] - reference_part(g, held[n])).abs().max()
                        / reference_part(g, held[n]).abs().max().clamp_min(1e-12)).item()
                       for n, g in ref["grads"].items())
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(out["loss"], ref["loss"]))
        norm_rel = max(abs(a - b) / abs(b) for a, b in zip(out["norm"], ref["norm"]))
        results.append((dims, ring, recipe, model.float8_report.converted, loss_rel, norm_rel, grad_rel))
        dist.barrier()
    return results


FULL = {"ac_mode": "full", "save_attention": True, "tiled_mlp": True, "mlp_tiles": 2, "tiled_loss": True,
        "loss_chunks": 2, "head_chunks": 2}


@pytest.mark.filterwarnings("ignore:float8 emulate")
def test_fp8_llama_equals_one_process_on_every_mesh():
    """dp_shard 2 x sp 2 (rowwise, every memory switch; tensorwise: its reference runs each dp rank's
    rows as a micro-batch), sp 4 (tensorwise, documents), ring 2 x ulysses 2 (rowwise), and compiled
    blocks: losses, gradient norms and every step-1 gradient shard equal the one-process eager FP8 run."""
    cases = [((1, 2, 2), 1, "rowwise", FULL, None), ((1, 2, 2), 1, "tensorwise", {}, 2),
             ((1, 1, 4), 1, "tensorwise", {"ac_mode": "full"}, None), ((1, 1, 4), 2, "rowwise", {}, None),
             # compiled blocks (fullgraph; aot_eager: dynamo and AOT autograd trace the FP8 casts, the amax
             # all-reduces and their backward; inductor's codegen is tests/test_parallelize.py's)
             ((1, 2, 2), 1, "tensorwise", {"ac_mode": "full", "compile": "aot_eager"}, 2)]
    results = run_ranks(4, _fp8_mesh_worker, cases)[0]
    for dims, ring, recipe, converted, loss_rel, norm_rel, grad_rel in results:
        print(f"{dims} ring {ring} {recipe}: {converted} FP8 layers, loss {loss_rel:.1e}, norm {norm_rel:.1e}, "
              f"grads {grad_rel:.1e}")
        assert converted == 14, (dims, recipe)  # 7 linear layers per block x 2 blocks; the head stays
        assert loss_rel < 1e-5 and norm_rel < 1e-5 and grad_rel < 1e-4, (dims, ring, recipe, loss_rel, norm_rel,
                                                                          grad_rel)


# --------------------------------------------------------------------------- #
# FP8 all-gathers under FSDP2
# --------------------------------------------------------------------------- #


def _all_gather_worker(rank: int, world: int) -> dict:
    import sys
    import warnings
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _fsdp_traffic import FsdpTraffic

    from ulysses_dtensor import ParallelDims, parallelize_llama
    from ulysses_dtensor.models.llama import Llama, llama_args

    warnings.simplefilter("ignore")
    pmesh = ParallelDims(1, 1, world, world_size=world).build_mesh("cpu")
    out = {}
    for name, dtype, gather, steps in (("bf16", torch.bfloat16, False, 1), ("bf16_fp8_gather", torch.bfloat16, True, 1),
                                       ("fp32", torch.float32, False, 2), ("fp32_fp8_gather", torch.float32, True, 2)):
        with torch.device("meta"):
            model = Llama(llama_args("debug"))
        parallelize_llama(model, pmesh, param_dtype=dtype,
                          float8=Float8Options(enable=True, recipe_name="tensorwise", emulate=True,
                                               enable_fsdp_float8_all_gather=gather))
        model.to_empty(device="cpu")
        model.init_weights(1234)
        precompute_fp8_weight_scales(model)  # the first step's scales (then after each optimizer step)
        with FsdpTraffic() as traffic:
            res = _train_lm(model, pmesh, steps=steps)
        out[name] = {"loss": res["loss"], "gathered": traffic.sent.get("all_gather", 0)}
        fp8 = [m for m in model.modules() if type(m).__name__ in ("Float8Linear", "SPFloat8Linear")]
        out[name]["fp8_elements"] = sum(m.weight.numel() for m in fp8)  # global shapes (DTensor)
    return out


@pytest.mark.filterwarnings("ignore:float8 emulate")
def test_fp8_all_gathers_halve_the_bytes_and_keep_the_losses():
    """sp 2 (FSDP over both ranks), tensorwise: the FP8 layers' weights leave each rank in one
    byte instead of bf16's two, at every gather of a step (each block's forward; backward
    re-gathers every block but the last, which keeps its weights); with float32 parameters
    the losses of two steps equal those of FP8 with ordinary all-gathers (the same weights
    cast with the same whole-weight amax, precomputed after the optimizer step)."""
    out = run_ranks(2, _all_gather_worker)[0]
    fp8_elements = out["bf16"]["fp8_elements"]
    saved = out["bf16"]["gathered"] - out["bf16_fp8_gather"]["gathered"]
    layers = llama_args_debug_layers()
    # A gather sends (N-1)/N = 1/2 of a weight from each of 2 ranks; FP8 saves one byte an element.
    per_step = fp8_elements // 2 * (1 + (layers - 1) / layers)
    print(f"all-gather bytes sent by rank 0 in a step: bf16 {out['bf16']['gathered']:,}, with FP8 all-gathers "
          f"{out['bf16_fp8_gather']['gathered']:,} ({fp8_elements:,} FP8 weight elements: the bytes of their "
          f"gathers halve)")
    assert saved == per_step
    assert out["fp32_fp8_gather"]["loss"] == out["fp32"]["loss"]


def llama_args_debug_layers() -> int:
    from ulysses_dtensor.models.llama import llama_args

    return llama_args("debug").n_layers


def test_a_non_finite_step_names_fp8_and_the_curve_comparison_is_exact():
    """The non-finite guard's message names FP8 when the model runs it; benchmarks/fp8_curve.py's
    comparison of two loss curves (what docs/float8.md's figure comes from)."""
    import importlib.util
    from pathlib import Path

    from ulysses_dtensor.precision.float8 import Float8Report
    from ulysses_dtensor.runtime.nonfinite import NonFiniteGuard

    model = nn.Linear(16, 16)
    model.float8_report = Float8Report("tensorwise", converted=14)
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    verdict = NonFiniteGuard(3, "training.max_nonfinite_steps").check(5, torch.tensor(float("nan")),
                                                                      torch.tensor(float("nan")), model)
    assert verdict.cause() == ("loss not finite on rank 0; FP8 was on (float8 tensorwise, 14 linear layers): a "
                               "non-finite amax gives a non-finite scale, and overflow past the FP8 range starts there")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_curve.py"
    spec = importlib.util.spec_from_file_location("fp8_curve", path)
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    got = curve.compare([4.0, 3.0, 2.0], [4.4, 3.0, 2.1])
    assert got["max_rel_gap"] == pytest.approx(0.1) and got["final_rel_gap"] == pytest.approx(0.05)
    assert got["step_reaching_smoothed_loss"]["3.0"] == {"bf16": 3, "fp8": None} and got["all_finite"]  # 10-step means
    assert curve.compare([4.0, None], [4.0, 3.0])["all_finite"] is False


# --------------------------------------------------------------------------- #
# The trainer: transformers models and LoRA in FP8; MoE experts refused by name
# --------------------------------------------------------------------------- #


def _trainer_rows(rank: int, world: int, runs: list) -> dict:
    import json
    import warnings
    from pathlib import Path

    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    warnings.simplefilter("ignore")
    out = {}
    for name, argv in runs:
        train(load_config(argv))
        dump = Path(argv[argv.index("--job.dump_folder") + 1])
        out[name] = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_tiny_hf_model import make_tiny_hf_model

    root = tmp_path_factory.mktemp("fp8_hf")
    make_tiny_hf_model(root / "llama", "llama")  # dim 64, ffn 96: every projection % 16
    make_tiny_hf_model(root / "moe", "qwen3_moe")
    return root


@pytest.mark.filterwarnings("ignore:float8 emulate")
def test_fp8_in_the_trainer_transformers_path_and_lora_equal_one_process(tiny_hf, tmp_path):
    """transformers' own Llama (model.implementation = transformers) and LoRA on it (the frozen base
    in FP8, the adapters in high precision), FP8 rowwise, sp 2 against one process: the same loss
    and gradient norm at every step."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]

    def argv(name, sp, *extra):
        return ["--config", str(repo / "train_configs" / "debug_hf.toml"), "--model.hf_path", str(tiny_hf / "llama"),
                "--model.implementation", "transformers", "--job.dump_folder", str(tmp_path / name),
                "--training.steps", "3", "--training.global_batch_size", "2", "--context.schedule", "1:64",
                "--data.max_corpus_mb", "0.25", "--checkpoint.enable", "false", "--metrics.log_freq", "1",
                "--parallelism.dp_shard", "1", "--parallelism.sp", str(sp), "--float8.enable", "true",
                "--float8.emulate", "true", "--eval.interval", "0", *extra]

    lora = ("--lora.rank", "4", "--optimizer.lr", "1e-2")
    sharded = run_ranks(2, _trainer_rows, [("full", argv("full_sp2", 2)), ("lora", argv("lora_sp2", 2, *lora))])[0]
    one = _trainer_rows(0, 1, [("full", argv("full_1", 1)), ("lora", argv("lora_1", 1, *lora))])
    for name in ("full", "lora"):
        for a, b in zip(sharded[name], one[name]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (name, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (name, a["step"])
        assert sharded[name][-1]["loss"] < sharded[name][0]["loss"], name  # it trains


def test_fp8_refuses_fused_moe_experts_by_name(tiny_hf):
    import warnings

    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.integrations.hf import parallelize_hf_model
    from ulysses_dtensor.parallel.mesh import ParallelDims

    model = AutoModelForCausalLM.from_pretrained(tiny_hf / "moe")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pmesh = ParallelDims(1, 1, 1, world_size=1).build_mesh("cpu")
        with warnings.catch_warnings(), pytest.raises(ValueError, match=r"float8: \d+ MoE expert modules hold their "
                                                                       r"experts as fused 3-D weights .*experts"):
            warnings.simplefilter("ignore")
            parallelize_hf_model(model, pmesh, float8=Float8Options(enable=True, emulate=True))
    finally:
        dist.destroy_process_group()
