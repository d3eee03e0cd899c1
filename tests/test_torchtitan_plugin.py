"""The torchtitan plug-in: torchtitan 0.3.0's own Llama-3 / Qwen3 under our Ulysses.

Parity (CPU, gloo, fp32): torchtitan's Llama-3 and Qwen3 decoders (their
debug-model architecture, shrunk to 2 layers, dim 64, 8 heads and 2 kv heads so
that kv heads < sp 4) parallelized by the plug-in's ``parallelize_fn`` (our
Ulysses at ``layers.*.attention.inner_attention``, then torchtitan's own AC and
FSDP2 over dp_shard x sp) under sp 2, sp 4, dp_shard 2 x sp 2 and HSDP 2 x sp 2,
fed by the plug-in's batch step and torchtitan's own token-weighted loss, give
the loss and every parameter gradient of the same model unsharded in one
process. Sequences of 29 tokens (divisible by neither 2 nor 4), packed
documents, ignored labels; our inner attention and torchtitan's own SDPA. The
collective count and bytes per layer are the Ulysses minimum.

torchtitan's trainer itself needs CUDA: the ``gpu`` test runs it through our
module (``scripts/torchtitan_check.py``, which also runs it on CPU ranks through
a harness, too slow for this suite).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from distributed import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="needs the torchtitan extra: pip install 'ulysses-dtensor[torchtitan]'",
)

SEED = 1234
BATCH, SEQ = 2, 29
VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 2, 2
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# torchtitan's decoders, small
# ---------------------------------------------------------------------------


def tiny_model_config(family: str, attention: str):
    """torchtitan's debug-model architecture at test size; ``attention``: ours ('sdpa') or 'model' (its SDPA)."""
    from functools import partial

    from torch import nn
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.param_init import skip_param_init

    from ulysses_dtensor.integrations.torchtitan.attention import OVERRIDE_TARGET

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    if family == "llama3":
        from torchtitan.models.llama3 import _build_llama3_layers
        from torchtitan.models.llama3.model import Llama3Model

        cfg = Llama3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
            layers=_build_llama3_layers(
                n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=128,
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
                attn_backend="flex",
            ),
        )
    else:
        from torchtitan.models.qwen3 import _build_qwen3_layers, _qwen3_norm
        from torchtitan.models.qwen3.model import Qwen3Model

        head_dim = 16  # Qwen3: heads * head_dim != dim, q/k norms, tied embeddings
        cfg = Qwen3Model.Config(
            dim=DIM, vocab_size=VOCAB, norm=_qwen3_norm(DIM), enable_weight_tying=True,
            tok_embeddings=Embedding.Config(
                num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": skip_param_init}
            ),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
            layers=_build_qwen3_layers(
                n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim,
                hidden_dim=128, attn_backend="flex",
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6),
            ),
        )
    if attention == "model":  # torchtitan's own SDPA (causal, no document masks)
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    else:  # ours, installed by the plug-in's torchtitan override
        replaced = apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, {"backend": attention})]), cfg)
        assert len(replaced) == LAYERS, replaced
    return cfg


def global_batch(docs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and positions as torchtitan's text dataset yields them.

    Labels are shifted within each document (input = doc[:-1], label =
    doc[1:]); a few labels are ignored (as its chat dataset masks prompts).
    """
    g = torch.Generator().manual_seed(7)
    inputs, labels, positions = [], [], []
    for _ in range(BATCH):
        n_cuts = 2 if docs else 0
        cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:n_cuts].add(1).tolist())
        bounds = [0, *cuts, SEQ]
        row_in, row_lab, row_pos = [], [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            doc = torch.randint(0, VOCAB, (b - a + 1,), generator=g)
            row_in.append(doc[:-1])
            row_lab.append(doc[1:])
            row_pos.append(torch.arange(b - a))
        inputs.append(torch.cat(row_in))
        labels.append(torch.cat(row_lab))
        positions.append(torch.cat(row_pos))
    labels = torch.stack(labels)
    labels[:, 3] = -100
    return torch.stack(inputs), labels, torch.stack(positions)


def canonical(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@functools.lru_cache(maxsize=None)
def reference(family: str, attention: str, docs: bool) -> dict:
    """Loss and gradients of the unsharded model in this process (and its initial weights)."""
    from torchtitan.components.loss import CrossEntropyLoss

    from ulysses_dtensor.integrations.torchtitan.batch import shard_for_sp

    torch.manual_seed(SEED)
    model = tiny_model_config(family, attention).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, labels, positions = global_batch(docs)
    inputs, labels, extra, _ = shard_for_sp(inputs, labels, {"positions": positions}, model=model)
    pred = model(inputs, **extra)
    loss, _ = CrossEntropyLoss.Config().build()(pred, labels, (labels != -100).sum())
    loss.backward()
    return {"init": init, "loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------------------
# The plug-in on torchtitan's ParallelDims (cp axis = sp), every rank
# ---------------------------------------------------------------------------


def build_parallel_dims(world: int, dp_replicate: int, dp_shard: int, sp: int):
    import torchtitan.distributed.parallel_dims as pd

    dims = pd.ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=sp, tp=1, pp=1, ep=1, world_size=world,
        spmd_backend="partial_dtensor",
    )
    # torchtitan picks its device type at import ("cuda" where none is found).
    with mock.patch.object(pd, "device_type", "cpu"):
        dims.build_mesh()
    return dims


def run_case(world: int, case: dict, meshes: dict) -> dict:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.protocols.model_spec import ModelSpec

    from ulysses_dtensor.comm_stats import CollectiveCounter
    from ulysses_dtensor.integrations.torchtitan.batch import shard_for_sp
    from ulysses_dtensor.integrations.torchtitan.parallelize import ulysses_model_spec
    from ulysses_dtensor.ulysses import exchange_bytes_per_rank

    family, attention, docs = case["model"], case.get("attention", "sdpa"), case.get("docs", True)
    sp, pack = case["sp"], case.get("pack_qkv", False)
    degrees = (case.get("dp_replicate", 1), case.get("dp_shard", 1), sp)
    if degrees not in meshes:  # process groups are costly: one set per mesh and task
        meshes[degrees] = build_parallel_dims(world, *degrees)
    dims = meshes[degrees]
    ref = reference(family, attention, docs)

    cfg = tiny_model_config(family, attention)
    with torch.device("meta"):
        model = cfg.build()
    spec = ModelSpec(name=family, flavor="tiny", model=cfg, parallelize_fn=None, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    ac = {"selective": SelectiveAC.Config(), "full": FullAC.Config()}.get(case.get("ac"))
    ulysses_model_spec(spec, pack_qkv=pack).parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None),
        compile_config=CompileConfig(enable=False),
        ac_config=ac,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (rope caches)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name  # FSDP2 over dp_shard x sp (HSDP: x dp_replicate)
            full = ref["init"][canonical(name)]
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())

    # The trainer's step: this data rank's rows, global valid-token count over
    # the batch mesh, then the plug-in's sp slice.
    inputs, labels, positions = global_batch(docs)
    batch_mesh = dims.get_optional_mesh("batch")
    if batch_mesh is not None:
        per = BATCH // batch_mesh.size()
        rows = slice(batch_mesh.get_local_rank() * per, (batch_mesh.get_local_rank() + 1) * per)
        inputs, labels, positions = inputs[rows], labels[rows], positions[rows]
    valid = (labels != -100).sum()
    if batch_mesh is not None:
        valid = funcol.all_reduce(valid, "sum", batch_mesh.get_group()).wait()
    sp_mesh = dims.get_optional_mesh("cp")
    local_in, local_lab, extra, _ = shard_for_sp(inputs, labels, {"positions": positions}, model=model, sp_mesh=sp_mesh)

    with CollectiveCounter() as counter:
        pred = model(local_in, **extra)
        loss, _ = CrossEntropyLoss.Config().build()(pred, local_lab, valid)
        loss.backward()
    total = funcol.all_reduce(loss.detach(), "sum", dims.get_mesh("loss").get_group()).wait().item()

    figures = {"case": case, "loss_rel": abs(total - ref["loss"]) / abs(ref["loss"])}
    grads = {canonical(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    assert set(grads) == set(ref["grads"]), (case, set(grads) ^ set(ref["grads"]))
    figures["grad_abs"] = max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items())
    assert figures["loss_rel"] < 1e-5, (case, total, ref["loss"])
    for n, g in ref["grads"].items():
        torch.testing.assert_close(grads[n], g, **GRAD_TOL, msg=lambda m: f"{case}: grad {n}: {m}")

    # Ulysses minimum per layer: q, k, v and the output forward (q, k, v in
    # one with pack_qkv), the same backward, each O(n d / P) bytes; nothing
    # else through functional collectives (no all-gather of the sequence).
    # torchtitan's selective AC saves the exchanged tensors (no replay); full
    # AC replays the forward exchanges in backward.
    forward = 2 if pack else 4
    per_layer = 2 * forward + (forward if case.get("ac") == "full" else 0)
    assert counter.counts() == {"all_to_all_single": per_layer * LAYERS}, (case, counter.counts())
    head_dim = DIM // HEADS if family == "llama3" else 16
    shape = (local_in.shape[0], local_in.shape[1] * sp, HEADS, KV_HEADS, head_dim, sp, 4)
    expected = LAYERS * exchange_bytes_per_rank(*shape)
    if case.get("ac") == "full":
        expected += LAYERS * exchange_bytes_per_rank(*shape, backward=False)
    assert counter.sent_bytes("all_to_all_single") == expected, (case, counter.sent_bytes(), expected)
    return figures


def parity_worker(rank: int, world: int, cases: list) -> list:
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    previous = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    try:
        out, meshes = [], {}
        for case in cases:
            t0 = time.perf_counter()
            figures = run_case(world, case, meshes)
            figures["s"] = round(time.perf_counter() - t0, 2)
            out.append(figures)
        return out
    finally:
        set_spmd_backend(previous)
        # torchtitan's AC turns dynamo's LRU cache off process-wide.
        torch._C._dynamo.eval_frame._set_lru_cache(True)


def _report(results: list) -> None:
    for figures in results[0]:
        print(figures)


def test_parity_sp2():
    results = run_ranks(2, parity_worker, [
        {"model": "llama3", "sp": 2},  # packed documents, kv heads split
        {"model": "qwen3", "sp": 2, "pack_qkv": True},
        {"model": "llama3", "sp": 2, "attention": "model", "docs": False},  # torchtitan's own SDPA
    ])
    _report(results)


def test_parity_sp4_dp2_sp2_hsdp():
    results = run_ranks(4, parity_worker, [
        {"model": "llama3", "sp": 4},  # kv heads 2 < sp 4: replicated
        {"model": "qwen3", "sp": 4, "ac": "selective"},
        {"model": "llama3", "dp_shard": 2, "sp": 2, "ac": "full"},
        {"model": "qwen3", "dp_shard": 2, "sp": 2},
        {"model": "qwen3", "dp_replicate": 2, "sp": 2, "pack_qkv": True},  # HSDP
    ])
    _report(results)


# ---------------------------------------------------------------------------
# Configs: stock torchtitan configs with Ulysses on; clear errors
# ---------------------------------------------------------------------------


def config_worker(rank: int, world: int) -> dict | None:
    """On rank 0 of a live gloo world (torchtitan already imported there): configs and their errors."""
    if rank != 0:
        return None
    import contextlib
    import dataclasses
    import io
    from types import SimpleNamespace

    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ulysses_dtensor.integrations.torchtitan import config_registry as registry
    from ulysses_dtensor.integrations.torchtitan.attention import OVERRIDE_TARGET, UlyssesInnerAttention
    from ulysses_dtensor.integrations.torchtitan.metrics import max_loss_config
    from ulysses_dtensor.integrations.torchtitan.parallelize import parallelize_ulysses
    from ulysses_dtensor.integrations.torchtitan.trainer import UlyssesConfig, UlyssesTrainer, prepare_config

    out: dict = {}
    module = ["--module", "ulysses_dtensor.integrations.torchtitan", "--config", "llama3_debugmodel_ulysses"]
    cfg = ConfigManager().parse_args(
        module + ["--ulysses.degree", "4", "--ulysses.attention_backend", "sdpa", "--ulysses.pack_qkv"]
    )
    stock = llama3_debugmodel()
    out["parsed"] = {
        "type": type(cfg).__qualname__,
        "ulysses": dataclasses.asdict(cfg.ulysses),
        "validator": type(cfg.validator).__qualname__,
        "spmd_backend": cfg.parallelism.spmd_backend,
        "load_balancer": cfg.parallelism.context_parallel_load_balancer,
        "cuda_graphs_off": cfg.training.disable_cuda_graphs,
        # Everything else is torchtitan's stock debug config.
        "stock_training": dataclasses.replace(cfg.training, disable_cuda_graphs=stock.training.disable_cuda_graphs)
        == stock.training,
        "stock_rest": all(
            getattr(cfg, f) == getattr(stock, f)
            for f in ("optimizer", "lr_scheduler", "dataloader", "activation_checkpoint", "loss")
        ),
        "stock_model": (cfg.model_spec.name, cfg.model_spec.flavor) == ("llama3", "debugmodel"),
    }

    # What UlyssesTrainer.__init__ does, then what torchtitan's Trainer.__init__
    # does with the override imports (before it builds the model).
    out["metrics"] = {  # torchtitan's stock metrics settings, in the Ulysses processor's config
        "type": type(cfg.metrics).__qualname__,
        "stock_fields": all(getattr(cfg.metrics, f.name) == getattr(stock.metrics, f.name)
                            for f in dataclasses.fields(stock.metrics)),
        # a hand-made config with torchtitan's own is converted too
        "converted": type(max_loss_config(stock.metrics)).__qualname__,
    }
    prepare_config(cfg)
    applied = apply_overrides(cfg.override, cfg)
    inner = [layer.attention.inner_attention for layer in cfg.model_spec.model.layers]
    fn = cfg.model_spec.parallelize_fn
    out["prepared"] = {
        "overrides": len(applied),
        "fqns_ok": all("model_spec.model.layers." in line for line in applied),
        "inner_ok": all(isinstance(i, UlyssesInnerAttention.Config) and i.backend == "sdpa" for i in inner),
        "parallelize_ok": fn.func is parallelize_ulysses and fn.keywords == {"pack_qkv": True},
    }
    out["registry"] = {name: getattr(registry, name)().ulysses.degree for name in registry.__all__ if name != "ulysses_config"}

    # torchtitan's ParallelDims with the Ulysses degree on its cp axis (this
    # world has 2 ranks; the process group exists, so nothing is initialised).
    base = registry.llama3_debugmodel_ulysses()
    dims = UlyssesTrainer.init_distributed(SimpleNamespace(config=base))
    out["dims"] = {"cp": dims.cp, "dp_shard": dims.dp_shard, "world": dims.world_size}

    def error(make) -> str:
        try:
            make()
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return "no error"

    class OtherMetrics(MetricsProcessor):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

    par, train = base.parallelism, base.training
    out["errors"] = {
        "metrics": error(lambda: max_loss_config(OtherMetrics.Config())),
        "cp": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, context_parallel_degree=2))),
        "balancer": error(lambda: dataclasses.replace(
            base, parallelism=dataclasses.replace(par, context_parallel_load_balancer="headtail"))),
        "spmd": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, spmd_backend="spmd_types"))),
        "tp": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, tensor_parallel_degree=2))),
        "heads": error(lambda: dataclasses.replace(base, ulysses=UlyssesConfig(degree=3))),
        "backend": error(lambda: UlyssesConfig(attention_backend="flash")),
        "cuda_graphs": error(lambda: dataclasses.replace(
            base, training=dataclasses.replace(train, disable_cuda_graphs=False))),
        "seq_len": error(lambda: dataclasses.replace(base, training=dataclasses.replace(train, seq_len=2046))),
        "override": error(lambda: dataclasses.replace(
            base, override=dataclasses.replace(base.override, imports=[OVERRIDE_TARGET]))),
        "world": error(lambda: UlyssesTrainer.init_distributed(
            SimpleNamespace(config=dataclasses.replace(base, ulysses=UlyssesConfig(degree=4))))),
    }
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.suppress(SystemExit):
        ConfigManager().parse_args(module + ["--parallelism.context_parallel_degree", "2"])
    out["cli_error"] = stderr.getvalue()
    return out


def test_configs_and_errors():
    out = run_ranks(2, config_worker)[0]
    parsed = out["parsed"]
    assert parsed["type"] == "UlyssesTrainer.Config"
    assert parsed["ulysses"] == {"degree": 4, "attention_backend": "sdpa", "pack_qkv": True}
    assert parsed["validator"] == "UlyssesValidator.Config"
    assert (parsed["spmd_backend"], parsed["load_balancer"], parsed["cuda_graphs_off"]) == ("partial_dtensor", None, True)
    assert parsed["stock_training"] and parsed["stock_rest"] and parsed["stock_model"], parsed
    assert out["prepared"] == {"overrides": 6, "fqns_ok": True, "inner_ok": True, "parallelize_ok": True}
    assert out["registry"] == {
        "llama3_debugmodel_ulysses": 2, "llama3_8b_ulysses": 8, "qwen3_debugmodel_ulysses": 2,
        "qwen3_1_7b_ulysses": 8, "qwen3_14b_ulysses": 8,
    }
    assert out["dims"] == {"cp": 2, "dp_shard": 1, "world": 2}
    assert out["metrics"] == {"type": "UlyssesMetricsProcessor.Config", "stock_fields": True,
                              "converted": "UlyssesMetricsProcessor.Config"}

    errors = out["errors"]
    expected = {
        "metrics": ["OtherMetrics.Config would log torchtitan's max loss", "UlyssesMetricsProcessor",
                    "MetricsProcessor.Config"],
        "cp": ["context_parallel_degree=2", "ulysses.degree"],
        "balancer": ["context_parallel_load_balancer='headtail'", "set it to None"],
        "spmd": ["spmd_backend='spmd_types'", "'partial_dtensor'"],
        "tp": ["tensor_parallel_degree=2", "set it to 1"],
        "heads": ["ulysses.degree=3", "heads=16", "valid sp for 16 heads: [1, 2, 4, 8, 16]"],
        "backend": ["ulysses.attention_backend", "'flash'", "flash_attn"],
        "cuda_graphs": ["disable_cuda_graphs=False", "set training.disable_cuda_graphs=True"],
        "seq_len": ["training.seq_len=2046", "2 * ulysses.degree = 4"],
        "override": [OVERRIDE_TARGET_NAME, "ulysses.attention_backend"],
        "world": ["world size 2", "ulysses.degree=4"],
    }
    for name, fragments in expected.items():
        for fragment in fragments:
            assert fragment in errors[name], (name, errors[name])
    assert "context_parallel_degree=2" in " ".join(out["cli_error"].split()), out["cli_error"]


OVERRIDE_TARGET_NAME = "ulysses_dtensor.integrations.torchtitan.attention.ulysses_inner_attention"


def test_torchtitan_version_errors():
    from ulysses_dtensor.integrations.torchtitan._requirements import check_torchtitan_version

    check_torchtitan_version("0.3.0")
    with pytest.raises(ImportError, match=r"needs torchtitan==0\.3\.0, which is not installed: pip install"):
        check_torchtitan_version(None)
    with pytest.raises(ImportError, match=r"supports torchtitan==0\.3\.0 only .* found torchtitan==0\.4\.0"):
        check_torchtitan_version("0.4.0")


# ---------------------------------------------------------------------------
# torchtitan's trainer (CUDA): the README launch through our module
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchtitan's trainer needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "model"])  # ours (flash_attn / varlen), torchtitan's flex
def test_gpu_trainer_through_our_module(backend):
    """torchrun -m torchtitan.train --module <ours>: sp N (GPUs, a power of 2 up to 8) follows sp 1 from one seed checkpoint."""
    nproc = 1 << (min(torch.cuda.device_count(), 8).bit_length() - 1)  # divides the debug model's 16 heads
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "torchtitan_check.py")
    done = subprocess.run(
        [sys.executable, script, "--nproc", str(nproc), "--bf16", "--steps", "3", "--attention-backend", backend],
        capture_output=True, text=True, timeout=3000,
    )
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
