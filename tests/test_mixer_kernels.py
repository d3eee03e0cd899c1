"""The hybrid mixers' GPU kernels (``ulysses_dtensor.mixers``: kernel_choice, dispatch,
fla_kernels, mamba_kernels).

* CPU, capabilities mocked: which kernel runs for each device, dtype, shape and set of
  importable packages, and the reason given (the decision table, row by row).
* CPU, kernels emulated: with every decision made as on CUDA, each package's function is
  replaced by a torch emulator of its documented contract (layouts, ``cu_seqlens`` /
  ``seq_idx`` dtypes and shapes asserted). The dispatchers' results through the emulators
  equal the torch path's (so the flattening into one row, transposes, groups, ``D``, the
  softplus and the activations are right), and every call's keywords bind to the
  installed package's real function as named parameters (fla-core here; causal-conv1d and
  mamba-ssm need CUDA builds: skipped where absent).
The GPU parity tests are in tests/test_mixer_kernels_gpu.py.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

from ulysses_dtensor.mixers import dispatch, kernel_choice
from ulysses_dtensor.mixers.fla_kernels import fla_cu_seqlens
from ulysses_dtensor.mixers.gated_delta import (
    causal_conv_documents,
    chunk_gated_delta_rule_documents,
)
from ulysses_dtensor.mixers.kernel_choice import (
    KERNEL_FUNCTIONS,
    choose_conv,
    choose_gated_delta,
    choose_selective_scan,
    choose_ssd,
    describe_mixer_kernels,
)
from ulysses_dtensor.mixers.ssm_scan import selective_scan_documents, ssd_documents

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ALL = frozenset(KERNEL_FUNCTIONS)
FLA = frozenset({"fla.chunk_gated_delta_rule", "fla.causal_conv1d"})
MAMBA = frozenset({"causal_conv1d_fn", "mamba_chunk_scan_combined", "selective_scan_fn"})

# ---------------------------------------------------------------------------
# The decision table, each row with CUDA and the packages mocked
# ---------------------------------------------------------------------------

ROWS = [
    # (function, args, importable kernels, kernel that runs, words of the reason)
    (choose_gated_delta, ("cpu", BF16, 128, 128), ALL, "torch", "CUDA only"),
    (choose_gated_delta, ("cuda", BF16, 128, 128), frozenset(), "torch", "fla-core not importable"),
    (choose_gated_delta, ("cuda", BF16, 128, 128), FLA, "fla.chunk_gated_delta_rule", "cu_seqlens"),
    (choose_gated_delta, ("cuda", F16, 64, 32), FLA, "fla.chunk_gated_delta_rule", "float16"),
    (choose_gated_delta, ("cuda", F32, 128, 128), FLA, "torch", "TF32"),
    (choose_gated_delta, ("cuda", None, 128, 128), FLA, "torch", "mixed dtypes"),
    (choose_gated_delta, ("cuda", BF16, 288, 128), FLA, "torch", "up to 256"),
    (choose_gated_delta, ("cuda", BF16, 128, 17), FLA, "torch", "even head dims"),
    (choose_conv, ("cpu", BF16, 64, 4), ALL, "torch", "CUDA only"),
    (choose_conv, ("cuda", BF16, 64, 4), ALL, "causal_conv1d_fn", "seq_idx"),
    (choose_conv, ("cuda", F32, 64, 4), ALL, "causal_conv1d_fn", "float32"),
    (choose_conv, ("cuda", BF16, 64, 5), ALL, "fla.causal_conv1d", "widths 2-4"),
    (choose_conv, ("cuda", BF16, 12, 4), ALL, "fla.causal_conv1d", "divisible by 8"),
    (choose_conv, ("cuda", BF16, 64, 4), FLA, "fla.causal_conv1d", "causal-conv1d not importable"),
    (choose_conv, ("cuda", BF16, 64, 4), frozenset(), "torch", "pip install causal-conv1d or fla-core"),
    (choose_conv, ("cuda", F64, 64, 4), ALL, "torch", "float64"),
    (choose_ssd, ("cpu", BF16), ALL, "torch", "CUDA only"),
    (choose_ssd, ("cuda", BF16), ALL, "mamba_chunk_scan_combined", "seq_idx"),
    (choose_ssd, ("cuda", F32), ALL, "torch", "TF32"),
    (choose_ssd, ("cuda", BF16), FLA, "torch", "mamba-ssm not importable"),
    (choose_selective_scan, ("cpu", BF16, 16, False), ALL, "torch", "CUDA only"),
    (choose_selective_scan, ("cuda", BF16, 16, False), ALL, "selective_scan_fn", "one document per row"),
    (choose_selective_scan, ("cuda", F32, 16, False), ALL, "selective_scan_fn", "float32"),
    (choose_selective_scan, ("cuda", BF16, 16, True), ALL, "torch", "cannot restart the state"),
    (choose_selective_scan, ("cuda", BF16, 512, False), ALL, "torch", "states up to 256"),
    (choose_selective_scan, ("cuda", BF16, 16, False), FLA, "torch", "mamba-ssm not importable"),
]


@pytest.mark.parametrize("choose, args, kernels, kernel, words", ROWS,
                         ids=[f"{r[0].__name__}-{'-'.join(map(str, r[1]))}-{len(r[2])}pkgs" for r in ROWS])
def test_decision_table(choose, args, kernels, kernel, words):
    choice = choose(*args, kernels=kernels)
    assert (choice.kernel, words in choice.reason) == (kernel, True), choice


def test_inside_torch_compile_the_torch_code_runs():
    """A compiled layer (transformers' hybrid families compile fullgraph) cannot call the
    kernels: fla-core's entry points disable compile, the CUDA extensions are opaque."""
    for choose, args in [(choose_gated_delta, (BF16, 128, 128)), (choose_conv, (BF16, 64, 4)), (choose_ssd, (BF16,)),
                         (choose_selective_scan, (BF16, 16, False))]:
        choice = choose("cuda", *args, kernels=ALL, compiling=True)
        assert (choice.kernel, "inside torch.compile" in choice.reason) == ("torch", True), choice
        assert choose("cuda", *args, kernels=ALL).kernel != "torch"


def test_banner_says_what_runs_and_why():
    ops = {"conv", "gated_delta", "ssd", "selective"}
    assert describe_mixer_kernels(ops, "cpu", BF16) == (
        "torch for every op (tensors on cpu: the kernels run on CUDA only)")
    line = describe_mixer_kernels(ops, "cuda", BF16, kernels=FLA)
    assert line == (
        "causal conv: fla.causal_conv1d (CUDA, bfloat16, documents as cu_seqlens; causal-conv1d not importable); "
        "gated delta rule: fla.chunk_gated_delta_rule (CUDA, bfloat16, documents as cu_seqlens); "
        "Mamba-2 scan: torch (mamba-ssm not importable; pip install mamba-ssm); "
        "selective scan: torch (mamba-ssm not importable; pip install mamba-ssm)"), line
    line = describe_mixer_kernels({"selective"}, "cuda", F32, kernels=ALL)
    assert line.endswith("; selective scan with packed documents: torch"), line
    with pytest.raises(ValueError, match=r"unknown mixer ops \['scan'\]; known: \['conv', 'gated_delta'"):
        describe_mixer_kernels({"scan"}, "cpu", BF16)


def test_mixers_of_a_model_name_their_ops():
    from ulysses_dtensor.integrations.hf.mixers.layer_types import mixer_ops

    def named(name):
        return type(name, (torch.nn.Module,), {})()

    model = torch.nn.ModuleList([named("Qwen3NextGatedDeltaNet"), named("JambaMambaMixer"), torch.nn.Linear(2, 2)])
    assert mixer_ops(model) == {"conv", "gated_delta", "selective"}
    assert mixer_ops(torch.nn.Linear(2, 2)) == frozenset()


def test_trainer_banner_has_a_mixers_line_for_hybrid_models():
    from types import SimpleNamespace

    from ulysses_dtensor.trainer.loop import _mixer_banner

    cfg = SimpleNamespace(training=SimpleNamespace(mixed_precision_param="bfloat16"))
    hybrid = torch.nn.ModuleList([type("BambaMixer", (torch.nn.Module,), {})()])
    assert _mixer_banner(hybrid, torch.device("cpu"), cfg) == (
        "  mixers: torch for every op (tensors on cpu: the kernels run on CUDA only)\n")
    assert _mixer_banner(torch.nn.Linear(2, 2), torch.device("cpu"), cfg) == ""


def test_on_cpu_no_kernel_package_is_imported(monkeypatch):
    """CPU tensors decide "torch" before any probe: a kernel package's import costs seconds
    and, for fla-core, warns that Triton has no driver."""
    monkeypatch.setattr(dispatch, "_DECIDED", {})
    monkeypatch.setattr(kernel_choice, "load_kernel", lambda name: pytest.fail(f"imported {name} on CPU"))
    x = torch.randn(1, 5, 8)
    assert dispatch.causal_conv(x, torch.randn(8, 4), None).shape == x.shape
    assert dispatch.kernel_for("gated_delta", "cpu", BF16, 8, 8) == "torch"


# ---------------------------------------------------------------------------
# The kernels' documented contracts, emulated in torch
# ---------------------------------------------------------------------------


def _documents_of(cu_seqlens, total: int):
    assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, cu_seqlens  # fla: LongTensor [N + 1]
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == total and bool((cu_seqlens.diff() > 0).all()), cu_seqlens
    return torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())[None]


def _segments_of(seq_idx, batch: int, seq: int):
    if seq_idx is None:
        return torch.zeros(batch, seq, dtype=torch.long)
    assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seq), seq_idx
    return seq_idx.long()


def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    batch, seq, heads, k_dim = q.shape
    assert k.shape == q.shape and v.shape[:2] == (batch, seq) and v.shape[2] % heads == 0
    assert g.shape == beta.shape == v.shape[:3]
    assert scale == k_dim**-0.5 and use_qk_l2norm_in_kernel and initial_state is None and not output_final_state
    segments = torch.zeros(batch, seq, dtype=torch.long)
    if cu_seqlens is not None:
        assert batch == 1, "cu_seqlens takes the documents flattened into one row"
        segments = _documents_of(cu_seqlens, seq)
    return chunk_gated_delta_rule_documents(q, k, v, g, beta, segments), None


def _act(name):
    assert name in (None, "silu", "swish"), name
    return None if name is None else F.silu


def fla_causal_conv1d(x, weight, bias=None, activation=None, backend="triton", cu_seqlens=None):
    batch, seq, channels = x.shape
    assert weight.shape[0] == channels and backend == "triton"
    segments = torch.zeros(batch, seq, dtype=torch.long)
    if cu_seqlens is not None:
        assert batch == 1, "cu_seqlens takes the documents flattened into one row"
        segments = _documents_of(cu_seqlens, seq)
    return causal_conv_documents(x, weight, bias, segments, _act(activation)), None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
    batch, channels, seq = x.shape
    assert x.stride(1) == 1, "seq_idx needs the channel-last layout"
    assert weight.shape[0] == channels and 2 <= weight.shape[1] <= 4 and channels % 8 == 0
    segments = _segments_of(seq_idx, batch, seq)
    return causal_conv_documents(x.transpose(1, 2), weight, bias, segments, _act(activation)).transpose(1, 2)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, seq_idx=None):
    batch, seq, heads, _ = x.shape
    assert dt.shape == (batch, seq, heads) and A.shape == (heads,) and A.dtype == torch.float32
    assert B.shape == C.shape and B.shape[:2] == (batch, seq) and heads % B.shape[2] == 0
    assert D is None or (D.shape == (heads,) and D.dtype == torch.float32)
    per_group = heads // B.shape[2]
    B, C = (t.repeat_interleave(per_group, dim=2) for t in (B, C))
    y = ssd_documents(x, dt, A, B, C, _segments_of(seq_idx, batch, seq), chunk_size)
    return (y if D is None else y + x.float() * D[:, None]).to(x.dtype)


def selective_scan_fn(u, delta, A, B, C, D=None, delta_bias=None, delta_softplus=False):
    batch, channels, seq = u.shape
    assert delta.shape == u.shape and delta.dtype == u.dtype and A.shape[0] == channels and A.dtype == torch.float32
    assert B.shape == C.shape == (batch, A.shape[1], seq) and B.dtype == u.dtype
    assert D.dtype == delta_bias.dtype == torch.float32 and delta_softplus
    dt = F.softplus(delta.float() + delta_bias[:, None])
    y = selective_scan_documents(u.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                                 torch.zeros(batch, seq, dtype=torch.long))
    return (y + u.transpose(1, 2).float() * D).to(u.dtype).transpose(1, 2)


EMULATORS = {"fla.chunk_gated_delta_rule": fla_chunk_gated_delta_rule, "fla.causal_conv1d": fla_causal_conv1d,
             "causal_conv1d_fn": causal_conv1d_fn, "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
             "selective_scan_fn": selective_scan_fn}


@pytest.fixture
def emulated_cuda(monkeypatch):
    """Decisions made as on CUDA in bfloat16 with ``available`` importable (set it); the
    kernels are the emulators above, recording each call as (kernel, kwargs)."""
    state = {"available": ALL, "calls": []}

    def kernel_for(op, device_type, dtype, *args, compiling=False):
        return dispatch._CHOOSE[op]("cuda", BF16, *args, kernels=state["available"]).kernel

    monkeypatch.setattr(dispatch, "kernel_for", kernel_for)
    for name, fake in EMULATORS.items():
        def record(*args, _name=name, _fake=fake, **kwargs):
            assert not args, f"{_name}: pass every argument by keyword (checked against its signature)"
            state["calls"].append((_name, kwargs))
            return _fake(**kwargs)
        monkeypatch.setitem(kernel_choice._LOADED, name, record)
    return state


def _documents(batch: int, seq: int):
    """Documents starting mid-chunk, at a chunk start, and one of a single token (chunks of 8)."""
    starts = [[0, 5, 16, 30], [0, 8, 9, 24]][:batch]
    docs = torch.zeros(batch, seq, dtype=torch.long)
    for r, row in enumerate(starts):
        for i, (a, b) in enumerate(zip(row, row[1:] + [seq])):
            docs[r, a:b] = i + 10 * r
    return docs


class _Rand:
    """Seeded float64 inputs: the same values for the kernel path and the torch path."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def n(self, *shape):
        return torch.randn(*shape, generator=self.g, dtype=F64)

    def u(self, *shape):
        return torch.rand(*shape, generator=self.g, dtype=F64)


BATCH, SEQ = 2, 37


def _ops(seed: int):
    """Each dispatcher with inputs of its own (value heads != key heads, heads != groups)."""
    r, b, s = _Rand(seed), BATCH, SEQ
    return {
        "gated_delta": lambda docs: dispatch.gated_delta_rule(
            r.n(b, s, 2, 8), r.n(b, s, 2, 8), r.n(b, s, 4, 6), -r.u(b, s, 4), r.u(b, s, 4), docs),
        "conv_silu": lambda docs: dispatch.causal_conv(r.n(b, s, 16), r.n(16, 4), r.n(16), docs, "silu"),
        "conv_gelu": lambda docs: dispatch.causal_conv(r.n(b, s, 16), r.n(16, 4), None, docs, F.gelu),
        "conv_wide": lambda docs: dispatch.causal_conv(r.n(b, s, 12), r.n(12, 5), None, docs, "swish"),
        "ssd": lambda docs: dispatch.ssd_scan(
            r.n(b, s, 4, 3), F.softplus(r.n(b, s, 4)), -r.u(4) - 0.5, r.n(b, s, 2, 5), r.n(b, s, 2, 5), 8, r.n(4),
            docs),
        "selective": lambda docs: dispatch.selective_scan(
            r.n(b, s, 16), r.n(b, s, 16), r.n(16), -r.u(16, 4) - 0.5, r.n(b, s, 4), r.n(b, s, 4), r.n(16), docs),
    }


# The kernel each op runs (None: the torch code), by packages importable and whether documents are packed.
EVERY = {"gated_delta": "fla.chunk_gated_delta_rule", "conv_silu": "causal_conv1d_fn",
         "conv_gelu": "causal_conv1d_fn", "conv_wide": "fla.causal_conv1d", "ssd": "mamba_chunk_scan_combined",
         "selective": "selective_scan_fn"}
FLA_ONLY = {**dict.fromkeys(EVERY, "fla.causal_conv1d"), "gated_delta": "fla.chunk_gated_delta_rule",
            "ssd": None, "selective": None}
EXPECTED = {("all", False): EVERY, ("all", True): {**EVERY, "selective": None},
            ("fla only", False): FLA_ONLY, ("fla only", True): FLA_ONLY}


@pytest.mark.parametrize("available", ["all", "fla only"])
def test_kernel_paths_compute_what_the_torch_path_computes(emulated_cuda, available):
    emulated_cuda["available"] = ALL if available == "all" else FLA
    for documents in (None, _documents(BATCH, SEQ)):
        for op in EVERY:
            emulated_cuda["calls"].clear()
            got = _ops(1)[op](documents)
            ran = [name for name, _ in emulated_cuda["calls"]]
            with pytest.MonkeyPatch.context() as m:  # the torch path: no emulator runs
                m.setattr(dispatch, "kernel_for", lambda *a, **kw: "torch")
                want = _ops(1)[op](documents)
            expected = EXPECTED[(available, documents is not None)][op]
            assert ran == ([expected] if expected else []), (op, documents is not None, ran)
            assert got.dtype == want.dtype and got.shape == want.shape, op
            # The torch code computes in float32 inside: one row of chunks vs two rows rounds differently.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, op=op: f"{op}: {m}")


def test_cu_seqlens_are_built_once_per_batch():
    """The document count costs a host sync on CUDA: once per batch, shared by every layer."""
    docs = _documents(BATCH, SEQ)
    cu = fla_cu_seqlens(docs)
    assert cu.tolist() == [0, 5, 16, 30, 37, 45, 46, 61, 74] and cu.dtype == torch.int64
    assert fla_cu_seqlens(docs) is cu  # the next layer's call
    assert fla_cu_seqlens(docs.clone()) is not cu  # a new batch


def _real(name):
    """The installed package's function, or a skip naming what is absent and why."""
    dist, module, attr = KERNEL_FUNCTIONS[name]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla-core warns, on CPU, that Triton has no driver
            return getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - an extension built for another torch fails in many ways
        pytest.skip(f"{dist} is not importable here ({type(e).__name__}: {e}); "
                    f"{'its kernels need a CUDA build' if dist != 'fla-core' else 'pip install fla-core==0.6.0'}")


@pytest.mark.parametrize("name", sorted(KERNEL_FUNCTIONS))
def test_calls_bind_to_the_installed_functions(emulated_cuda, name):
    """Every keyword our calls pass is a named parameter of the installed function (not
    swallowed by a ``**kwargs``), and the call binds (nothing required is missing)."""
    real = _real(name)
    for documents in (None, _documents(BATCH, SEQ)):
        for run in _ops(2).values():
            run(documents)
    calls = [kwargs for kernel, kwargs in emulated_cuda["calls"] if kernel == name]
    assert calls, f"no call of {name} recorded"
    params = inspect.signature(real).parameters
    named = {p for p, v in params.items() if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)}
    for kwargs in calls:
        assert set(kwargs) <= named, f"{name}: {sorted(set(kwargs) - named)} not parameters of {sorted(named)}"
        inspect.signature(real).bind(**kwargs)
    if name.startswith("fla."):
        from importlib.metadata import version

        assert version("fla-core") == "0.6.0", "the conventions in mixers/fla_kernels.py were read in fla-core 0.6.0"


def test_transformers_references_keep_their_torch_path_on_a_cpu_torch():
    """tests/transformers_torch_paths.py: with fla-core installed, transformers would bind
    Qwen3-Next's gated delta rule to fla's Triton kernel, which fails without a GPU."""
    _real("fla.chunk_gated_delta_rule")  # skips where fla-core is absent: nothing to guard against
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build of torch: fla's kernels are the reference there")
    from transformers.models.qwen3_next import modeling_qwen3_next as own

    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    v, g, beta = torch.randn(1, 5, 2, 8), -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    out, _ = own.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, chunk_gated_delta_rule_documents(q, k, v, g, beta, torch.zeros(1, 5).long()))
