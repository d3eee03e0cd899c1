"""The kernel table `auto` resolves by: every row on CPU with the machine mocked,
the refusals of the backends named explicitly, the run banner, and the choice
holding through an activation-checkpoint recompute.

No GPU ran here: a row's kernel is checked against the float64 reference by the
gpu-marked tests and scripts/gpu_attention_matrix.py when one is lent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention import (  # noqa: F401 - cuda_checks_off is a fixture
    DOC_LENGTHS,
    cuda_checks_off,
    docs_from_lengths,
    grads_vs_reference,
    make_qkv,
    reference_attention,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from ulysses_dtensor.attention import (
    Capabilities,
    Case,
    auto_choice,
    dense,
    describe_choice,
    local_attention,
)
from ulysses_dtensor.attention import capabilities as C
from ulysses_dtensor.attention import kernel_table as T
from ulysses_dtensor.attention import select as S

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = torch.device("cuda")

H100 = Capabilities.target("H100", "2.11")  # CUDA 13 wheel: cuDNN 9.15.1
B200 = Capabilities.target("B200", "2.11")
A100 = Capabilities.target("A100", "2.11")
OLD_CUDNN = Capabilities.target("H100", "2.11", cuda="12.8")  # cuDNN 9.10.2
CPU = Capabilities(device_type="cpu")


@pytest.fixture
def fresh_resolution():
    S._RESOLVED.clear()
    yield
    S._RESOLVED.clear()


# --------------------------------------------------------------------------- #
# Every row: (machine, case) -> kernel, and the row that decided
# --------------------------------------------------------------------------- #

ROW_CASES = [
    # id, machine, case, kernel, row
    ("cpu", CPU, Case(FP32), "sdpa", "cpu"),
    ("cpu-docs", CPU, Case(BF16, documents=True), "sdpa", "cpu"),
    ("h100-fp32", H100, Case(FP32), "sdpa", "fp32"),
    ("h100-sinks", H100.with_(flash_attn=True), Case(sinks=True, window=True), "flex", "sinks"),
    ("h100-softcap-fa2", H100.with_(flash_attn=True), Case(softcap=True, documents=True), "flash_attn",
     "softcap_flash_attn"),
    ("h100-softcap", H100, Case(softcap=True), "flex", "softcap"),
    ("h100-softcap-hd288-fa2", H100.with_(flash_attn=True), Case(head_dim=288, softcap=True), "flex", "softcap"),
    ("h100-hd512", H100, Case(head_dim=512), "sdpa", "head_dim_over_256"),
    ("h100-mla-v288", H100, Case(head_dim=64, v_head_dim=288, documents=True), "sdpa", "head_dim_over_256"),
    ("b200-docs-fa4", B200.with_(fa4=True, flash_attn=True), Case(documents=True), "fa4", "masked_fa4_sm100"),
    ("b200-docs-fa4-hd256", B200.with_(fa4=True), Case(head_dim=256, documents=True), "varlen", "masked_varlen"),
    ("h100-docs-fa4-fa2", H100.with_(fa4=True, flash_attn=True), Case(documents=True), "flash_attn",
     "masked_flash_attn"),
    ("h100-window", H100, Case(window=True), "varlen", "masked_varlen"),
    ("h100-docs", H100, Case(documents=True), "varlen", "masked_varlen"),
    ("torch2.10-window", H100.with_(varlen_window=False, torch_version=(2, 10)), Case(window=True), "flex", "masked"),
    ("torch2.9-docs", H100.with_(varlen=False, varlen_window=False, torch_version=(2, 9)), Case(documents=True),
     "flex", "masked"),
    ("h100-plain", H100, Case(), "cudnn", "plain_cudnn_sm90"),
    ("h100-plain-fp16", H100, Case(FP16, head_dim=64), "cudnn", "plain_cudnn_sm90"),
    ("h100-plain-fa2", H100.with_(flash_attn=True, fa4=True), Case(), "cudnn", "plain_cudnn_sm90"),
    ("h100-mla-192-128", H100, Case(head_dim=192, v_head_dim=128), "cudnn", "plain_cudnn_sm90"),
    ("h100-mla-24-16", H100, Case(head_dim=24, v_head_dim=16), "cudnn", "plain_cudnn_sm90"),
    ("h100-hd36", H100, Case(head_dim=36), "cudnn", "plain_cudnn_sm90"),  # padded to 40
    ("b200-plain", B200.with_(fa4=True), Case(), "cudnn", "plain_cudnn_sm100"),
    ("h100-old-cudnn-fa4", OLD_CUDNN.with_(fa4=True), Case(), "fa4", "plain_fa4"),
    ("h100-hd256-fa2", H100.with_(flash_attn=True), Case(head_dim=256), "flash_attn", "plain_flash_attn"),
    ("a100-fa2", A100.with_(flash_attn=True), Case(), "flash_attn", "plain_flash_attn"),
    ("a100", A100, Case(), "varlen", "plain_varlen"),
    ("a100-mla-192-128", A100, Case(head_dim=192, v_head_dim=128), "varlen", "plain_varlen"),
    ("l40s", Capabilities.target("L40S"), Case(), "varlen", "plain_varlen"),
    ("rtx-pro-6000", Capabilities.target("RTX PRO 6000"), Case(), "varlen", "plain_varlen"),
    ("h100-old-cudnn", OLD_CUDNN, Case(), "varlen", "plain_varlen"),
    ("h100-deprioritized", H100.with_(cudnn_deprioritized=True), Case(), "varlen", "plain_varlen"),
    ("h100-cudnn-off", H100.with_(cudnn_sdp_enabled=False), Case(), "varlen", "plain_varlen"),
    ("h100-deterministic", H100.with_(deterministic=True), Case(), "varlen", "plain_varlen"),
    ("h100-hidden-cudnn", H100.with_(cudnn=91002, cudnn_bundled=91501), Case(), "varlen", "plain_varlen"),
    ("h100-no-cudnn", H100.with_(cudnn=None), Case(), "varlen", "plain_varlen"),
    ("h100-hd256", H100, Case(head_dim=256), "varlen", "plain_varlen"),
    ("unknown-gpu", Capabilities(device_type="cuda"), Case(), "varlen", "plain_varlen"),
    ("torch2.9-h100", Capabilities.target("H100", "2.9"), Case(), "sdpa", "plain"),
]


@pytest.mark.parametrize("caps,case,kernel,row", [c[1:] for c in ROW_CASES], ids=[c[0] for c in ROW_CASES])
def test_each_row_of_the_table(caps, case, kernel, row):
    choice = auto_choice(case, caps)
    assert (choice.backend, choice.row) == (kernel, row), choice.reason
    assert choice.reason.startswith(case.name() + ": ")
    assert choice.memory in T.MEMORY


def test_every_row_is_tested_and_names_its_figures():
    assert {c[4] for c in ROW_CASES} == {r.name for r in T.ROWS}
    assert len({r.name for r in T.ROWS}) == len(T.ROWS)
    for r in T.ROWS:
        assert r.when and r.why and r.source and r.backend in S.BACKENDS, r.name
    assert T.ROWS[-1].applies(Case(), CPU)  # the last row takes every case


def test_memory_class_of_each_choice():
    # What the planner asks: O(S) with a log-sum-exp, or a dense (S, S) mask / scores.
    assert auto_choice(Case(documents=True), H100).memory == "lse"
    assert auto_choice(Case(), H100).memory == "lse"
    assert auto_choice(Case(FP32, documents=True), H100).memory == "dense_mask"
    assert auto_choice(Case(FP32, sinks=True), H100).memory == "dense_scores"
    assert auto_choice(Case(head_dim=512, window=True), H100).memory == "dense_mask"
    assert auto_choice(Case(sinks=True), H100).memory == "lse"  # flex
    assert T.memory_class("cudnn", Case(window=True)) == "dense_mask"


def test_the_trap_is_named_in_the_reason():
    plain = auto_choice(Case(), H100.with_(cudnn=91002, cudnn_bundled=91501))
    assert plain.why.startswith("cuDNN attention not used: cuDNN 9.10.2 is not above 9.15.0")
    assert "hides the wheel's 9.15.1 -> FlashAttention-2 (torch's varlen)" in plain.why
    assert "TORCH_CUDNN_SDPA_DEPRIORITIZED is set -> FlashAttention-4" in auto_choice(
        Case(), H100.with_(cudnn_deprioritized=True, fa4=True)).why
    # Off Hopper cuDNN is not a trap: FlashAttention-2 is the faster kernel there.
    assert auto_choice(Case(), A100).why == "FlashAttention-2 (torch's varlen)"
    assert auto_choice(Case(documents=True), H100).why == "FlashAttention-2 on cu_seqlens, O(S)"


# --------------------------------------------------------------------------- #
# Capabilities: probing this machine, describing another
# --------------------------------------------------------------------------- #


def test_target_machines_and_versions():
    assert (H100.sm, H100.cudnn, H100.torch_version) == ((9, 0), 91501, (2, 11))
    assert Capabilities.target("sm100").sm == (10, 0)
    assert Capabilities.target("NVIDIA B300 SXM").sm == (10, 3)
    assert Capabilities.target("gh200").sm == (9, 0)
    assert Capabilities.target("H100", cudnn="9.19.0").cudnn == 91900
    assert Capabilities.target("H100", "2.11", packages=("fa4",)).fa4
    assert not Capabilities.target("H100", "2.10", packages=("fa4",)).fa4  # no FA4 route before 2.11
    assert not Capabilities.target("H100", "2.10").varlen_window
    with pytest.raises(ValueError, match=r"unknown GPU 'V100'; give one of .*h100.*'smXY'"):
        Capabilities.target("V100")
    with pytest.raises(ValueError, match=r"unknown packages \['flash_attn_3'\]; valid: flash_attn, fa4"):
        Capabilities.target("H100", packages=("flash_attn_3",))
    assert (C.cudnn_version_int("9.15.1.9"), C.cudnn_version_str(91501), C.cudnn_version_str(8907)) == (
        91501, "9.15.1", "8.9.7")
    assert H100.describe() == "sm90, torch 2.11, cuDNN 9.15.1"
    assert "(the wheel's 9.15.1 hidden)" in H100.with_(cudnn=91002, cudnn_bundled=91501).describe()


def test_probe_reads_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(C, "_bundled_cudnn", lambda: 91501)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    caps = Capabilities.read(CUDA)
    assert (caps.sm, caps.cudnn, caps.cudnn_bundled, caps.cudnn_hidden) == ((9, 0), 91002, 91501, True)
    assert caps.cudnn_deprioritized and caps.cudnn_sdp_enabled and not caps.deterministic
    assert caps.varlen and caps.varlen_window  # torch 2.13's varlen_attn takes window_size
    assert not caps.flash_attn and not caps.fa4  # not installed here
    assert Capabilities.read("cpu") == Capabilities(device_type="cpu", torch_version=caps.torch_version)


def test_probe_without_cuda_reads_a_gpu_of_unknown_capability():
    caps = Capabilities.read(CUDA)  # this machine has no CUDA
    assert caps.cuda and caps.sm is None and caps.cudnn is None
    assert auto_choice(Case(), caps).backend == "varlen"  # the FlashAttention rows, as before the table


# --------------------------------------------------------------------------- #
# Backends named explicitly: refused by name, with the reason
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "backend,device,dtype,d,dv,match",
    [
        ("cudnn", "cpu", BF16, 64, None, r"'cudnn' runs on CUDA only; got tensors on device 'cpu'"),
        ("cudnn", "cuda", FP32, 64, None, r"'cudnn' needs float16 or bfloat16 inputs \(cuDNN attention\); got torch.float32"),
        ("cudnn", "cuda", BF16, 256, None, r"'cudnn' takes head dims up to 128 .*got q/k 256, v 256"),
        ("cudnn", "cuda", BF16, 192, 64, r"'cudnn' takes head dims up to 128 .*got q/k 192, v 64"),
        ("fa4", "cpu", BF16, 64, None, r"'fa4' runs on CUDA only"),
        ("fa4", "cuda", FP16, 288, None, r"'fa4' takes head dims up to 256 \(FlashAttention kernels\); got 288"),
    ],
)
def test_named_backends_refuse_tensors_they_cannot_take(backend, device, dtype, d, dv, match):
    with pytest.raises(ValueError, match=match):
        S.resolve_backend(backend, frozenset(), torch.device(device), dtype, d, v_head_dim=dv)


def test_named_backends_refuse_what_this_machine_lacks(monkeypatch, fresh_resolution):
    machine = {"caps": OLD_CUDNN}
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: machine["caps"]))

    def refusal(backend, d=64, dv=None):
        with pytest.raises(ValueError) as e:
            S.resolve_backend(backend, frozenset(), CUDA, BF16, d, v_head_dim=dv)
        return str(e.value)

    assert refusal("cudnn") == (
        "attention backend 'cudnn' cannot run on this machine (sm90, torch 2.11, cuDNN 9.10.2): cuDNN 9.10.2 is "
        "not above 9.15.0 (earlier versions read out of bounds for sequence lengths not a multiple of 128, "
        "pytorch #169849)")
    assert "flash-attn-4 package (pip install flash-attn-4)" in refusal("fa4")
    machine["caps"] = H100.with_(deterministic=True)
    assert "cuDNN attention is not deterministic" in refusal("cudnn")
    machine["caps"] = A100.with_(fa4=True)
    assert "'fa4' cannot run on this machine (sm80, " in refusal("fa4") and "sm90 and sm100 only" in refusal("fa4")
    # What auto avoids but a named backend may still run: deprioritized cuDNN, cuDNN off Hopper, MLA 192/128.
    for caps in (H100.with_(cudnn_deprioritized=True), H100):
        machine["caps"] = caps
        assert S.resolve_backend("cudnn", frozenset(), CUDA, BF16, 192, v_head_dim=128) == "cudnn"
    machine["caps"] = A100
    assert S.resolve_backend("cudnn", frozenset(), CUDA, BF16, 64) == "cudnn"
    assert "q/k 192 with v 128 on sm90/sm100" in refusal("cudnn", 192, 128)
    # Patterns their kernels have no option for.
    with pytest.raises(ValueError, match=r"'cudnn' cannot apply attention sinks .*: sdpa, flex$"):
        S.resolve_backend("cudnn", frozenset({"sinks"}), CUDA, BF16, 64)
    with pytest.raises(ValueError, match=r"'fa4' cannot apply attention-logit soft-capping .*: sdpa, flex, flash_attn$"):
        S.resolve_backend("fa4", frozenset({"softcap"}), CUDA, BF16, 64)


def test_trainer_refuses_a_named_kernel_this_machine_cannot_run(monkeypatch):
    from ulysses_dtensor.models.llama import llama_args
    from ulysses_dtensor.trainer.config import ConfigError
    from ulysses_dtensor.trainer.config_checks import check_attention_kernel

    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: OLD_CUDNN))
    with pytest.raises(ConfigError, match=r"model.attn_backend='cudnn' \(head dim 8, torch.bfloat16 on cuda.*"
                                          r"cannot run on this machine .*cuDNN 9.10.2 is not above 9.15.0"):
        check_attention_kernel("cudnn", llama_args("debug"), "cuda", BF16)
    check_attention_kernel("auto", llama_args("debug"), "cuda", BF16)


def test_auto_resolves_per_call_through_the_table(monkeypatch, fresh_resolution):
    machine = {"caps": H100}
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: machine["caps"]))
    feats = frozenset
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 128) == "cudnn"
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 128, documents=True) == "varlen"
    assert S.resolve_backend("auto", feats({"window"}), CUDA, BF16, 128) == "varlen"
    assert S.resolve_backend("auto", feats({"softcap"}), CUDA, BF16, 128) == "flex"
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 192, v_head_dim=128) == "cudnn"
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 288) == "sdpa"
    machine["caps"] = OLD_CUDNN  # cached per device and case: the machine is probed once
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 128) == "cudnn"
    S._RESOLVED.clear()
    assert S.resolve_backend("auto", feats(), CUDA, BF16, 128) == "varlen"


# --------------------------------------------------------------------------- #
# The run banner
# --------------------------------------------------------------------------- #


def test_banner_says_what_ran_and_why():
    assert T.describe_run("auto", H100, BF16, 128) == (
        "cudnn (auto: sm90, torch 2.11, cuDNN 9.15.1; plain causal: cuDNN 1.7-2.3x FlashAttention-2 on Hopper "
        "(transformers #48163)); packed documents: varlen (FlashAttention-2 on cu_seqlens, O(S))")
    hidden = H100.with_(cudnn=91002, cudnn_bundled=91501)
    assert T.describe_run("auto", hidden, BF16, 128) == (
        "varlen (auto: sm90, torch 2.11, cuDNN 9.10.2 (the wheel's 9.15.1 hidden); plain causal: cuDNN attention "
        "not used: cuDNN 9.10.2 is not above 9.15.0 (earlier versions read out of bounds for sequence lengths not "
        "a multiple of 128, pytorch #169849); a system cuDNN earlier on LD_LIBRARY_PATH hides the wheel's 9.15.1 "
        "-> FlashAttention-2 (torch's varlen))")
    assert T.describe_run("auto", CPU, FP32, 8) == (
        "sdpa (auto: cpu, torch 2.11; plain causal: the only kernel with a backward off CUDA)")
    assert T.describe_run("varlen", H100, BF16, 128) == "varlen (named; sm90, torch 2.11, cuDNN 9.15.1)"
    assert describe_choice("auto", Case(head_dim=192, v_head_dim=128), B200).startswith(
        "cudnn (auto: sm100, torch 2.11, cuDNN 9.15.1; plain causal, MLA 192/128: cuDNN 9.19 1.24-1.98x")


def test_the_trainer_prints_the_attention_line(monkeypatch):
    from ulysses_dtensor.trainer import loop
    from ulysses_dtensor.trainer.config import JobConfig

    cfg = JobConfig()
    cfg.training.mixed_precision_param = "bfloat16"
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: OLD_CUDNN.with_(cudnn_bundled=91501)))
    line = loop._attention_banner(cfg, 512, CUDA)
    assert line.startswith("varlen (auto: sm90, torch 2.11, cuDNN 9.10.2 (the wheel's 9.15.1 hidden); plain causal: "
                           "cuDNN attention not used: ")
    assert "-> FlashAttention-2" in line
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: H100))
    assert loop._attention_banner(cfg, 512, CUDA).startswith("cudnn (auto: sm90, torch 2.11, cuDNN 9.15.1; plain")


# --------------------------------------------------------------------------- #
# One kernel for the forward and the recompute
# --------------------------------------------------------------------------- #


class SdpaRecorder:
    """Stands in for F.scaled_dot_product_attention: records which SDPA backends were
    enabled at each call, then computes with what a CPU has (math)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, ...]] = []
        self.real = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention", self)

    def __call__(self, *args, **kwargs):
        flags = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                 "math": torch.backends.cuda.math_sdp_enabled()}
        self.calls.append(tuple(n for n, on in flags.items() if on))
        with sdpa_kernel([SDPBackend.MATH]):
            return self.real(*args, **kwargs)


def _llama(backend: str, checkpointed: bool = True):
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import checkpoint_block

    torch.manual_seed(0)
    model = Llama(llama_args("debug", attn_backend=backend))
    model.init_weights()
    model.to(BF16)  # the table gives 16-bit plain causal attention to cuDNN (float32 stays on sdpa)
    if checkpointed:  # full activation checkpointing, as parallelize_llama applies it
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_block(block, int(name), "full", None)
    return model


def _step(model, ids):
    loss = model(ids, labels=ids, num_valid_tokens=ids.numel())
    loss.backward()
    # checkpoint_wrapper keeps a block under `_checkpoint_wrapped_module`.
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_forward_and_recompute_run_the_kernel_auto_chose(monkeypatch, fresh_resolution):
    # auto on these CPU tensors sees an H100 with cuDNN 9.15.1 and picks cuDNN attention;
    # the recorder computes with the math kernel and records SDPA's switches at every call.
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: H100))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    recorder = SdpaRecorder(monkeypatch)
    loss, grads = _step(_llama("auto"), ids)
    layers = 2
    assert recorder.calls == [("cudnn",)] * (2 * layers)  # the forward, then each block's recompute
    assert set(S._RESOLVED.values()) == {"cudnn"}

    # The same loss and gradients as the model without checkpointing, on sdpa (the same math kernel).
    recorder.calls.clear()
    ref_loss, ref_grads = _step(_llama("sdpa", checkpointed=False), ids)
    assert recorder.calls == [("cudnn", "flash", "efficient", "math")] * layers
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, atol=0, rtol=0, msg=n)


def test_a_restriction_entered_around_the_model_misses_the_recompute(monkeypatch):
    # The control: what the recorder sees when the kernel is chosen outside the
    # attention call -- the recompute (in backward) runs under the default switches.
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    recorder = SdpaRecorder(monkeypatch)
    model = _llama("sdpa")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        loss = model(ids, labels=ids, num_valid_tokens=ids.numel())
    loss.backward()
    assert recorder.calls[:2] == [("cudnn",)] * 2
    assert all(call != ("cudnn",) for call in recorder.calls[2:]) and len(recorder.calls) == 4


def test_cudnn_backend_pads_crops_and_compiles_without_a_graph_break(monkeypatch, fresh_resolution):
    # On CPU the restriction lets the math kernel stand in for cuDNN; the glue is what is tested:
    # head dims padded to multiples of 8 (q/k and v apart), the real scale, v cropped, GQA.
    monkeypatch.setattr(dense, "CUDNN_SDPA", [SDPBackend.MATH])
    monkeypatch.setattr(Capabilities, "probe", staticmethod(lambda device: H100))
    monkeypatch.setattr(S, "kernel_refusal", lambda *args, **kwargs: None)
    monkeypatch.setattr(S, "_machine_refusal", S._constant_to_compile(lambda *args: ""))
    q, k, v = make_qkv(2, 24, 4, 2, 12, seed=3, dv=20)
    assert S.resolve_backend("auto", frozenset(), q.device, BF16, 12, v_head_dim=20) == "cudnn"
    out = local_attention(q, k, v, backend="cudnn")
    assert out.shape == (2, 24, 4, 20)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)
    compiled = torch.compile(lambda q, k, v: local_attention(q, k, v, backend="cudnn"), backend="eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), out, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()


def test_the_docs_table_lists_every_row_with_its_kernel():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "attention-kernels.md").read_text()
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert [f"`{r.name}`" for r in T.ROWS] == [k for k in lines if k.strip("`") in {r.name for r in T.ROWS}]
    for r in T.ROWS:
        cells = [c.strip() for c in lines[f"`{r.name}`"].split("|")]
        assert cells[3] == f"`{r.backend}`", (r.name, cells)


def test_fa4_switches_torch_to_flashattention_4_once_and_runs_the_varlen_path(monkeypatch, cuda_checks_off):  # noqa: F811
    # torch's FA4 route is process-wide: activated once (at trace time under compile), then varlen's
    # calls run it. Here torch's varlen kernel is cuda_checks_off's fake, which keeps the window contract.
    import torch.nn.attention as nn_attention

    active, switched = [None], []

    def activate(impl):
        switched.append(impl)
        active[0] = impl

    monkeypatch.setattr(nn_attention, "activate_flash_attention_impl", activate)
    monkeypatch.setattr(nn_attention, "current_flash_attention_impl", lambda: active[0])
    monkeypatch.setattr(S, "_machine_refusal", S._constant_to_compile(lambda *args: ""))
    docs = docs_from_lengths(DOC_LENGTHS)
    for window in (None, 6):
        q, k, v = make_qkv(2, 32, 8, 2, 16, seed=5)
        out = local_attention(q, k, v, backend="fa4", document_ids=docs, window=window)
        ref = reference_attention(q, k, v, True, docs, window=window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        grads_vs_reference(q, k, v, out, ref, atol=1e-5, rtol=1e-5)
    assert switched == ["FA4"]
