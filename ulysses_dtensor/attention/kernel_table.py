"""Which attention kernel ``auto`` runs: one table, first matching row wins.

A row pairs a case (plain causal, packed documents, a window, soft-capping,
sinks, head dims, dtype) and a machine (:class:`~.capabilities.Capabilities`)
with a kernel, and carries the figure that put it there. :func:`auto_choice`
is a pure function of the two, so every row is tested on CPU with the
capabilities mocked (tests/test_kernel_table.py), and the memory planner asks
it about a GPU it is not on (``Capabilities.target("H100", "2.11")``).
docs/attention-kernels.md prints the table with its figures.

The kernels, by the name a config gives them:

* ``cudnn``: SDPA restricted to cuDNN attention. Plain causal on Hopper and
  sm100, where it is the fastest exact kernel; documents and windows only as a
  dense mask, so ``auto`` sends those elsewhere.
* ``fa4``: FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL), which
  torch >= 2.11 routes its flash kernels to; runs the ``varlen`` path.
* ``flash_attn`` (flash-attn 2) and ``varlen`` (torch's FlashAttention-2 varlen):
  documents as ``cu_seqlens``, windows; flash-attn also soft-caps.
* ``flex``: what only it fuses (sinks; soft-capping without flash-attn).
* ``sdpa``: CPU, float32, head dims over 256.

Memory class of each choice (:data:`MEMORY`): ``lse`` keeps O(S) per head (the
output and a log-sum-exp per query); ``dense_mask`` builds a (B, 1, S, S)
boolean mask; ``dense_scores`` (B, H, S, S) float32 scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .capabilities import Capabilities, cudnn_version_str

__all__ = [
    "MEMORY",
    "ROWS",
    "Case",
    "Choice",
    "Row",
    "auto_choice",
    "cudnn_refusal",
    "cudnn_tensor_refusal",
    "describe_choice",
    "describe_run",
    "fa4_refusal",
    "memory_class",
]

HALF = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
CUDNN_MAX_HEAD_DIM = 128
# cuDNN's one exception to 128: DeepSeek's q/k 192 with v 128, on sm90/sm100 from cuDNN 9.11
# (sdp_utils.cpp check_cudnn_tensor_shapes).
CUDNN_MLA_DIMS = (192, 128)
CUDNN_MLA_MIN = 91100
# torch prefers cuDNN attention only above 9.15.0: earlier versions read out of bounds
# for sequence lengths not a multiple of 128 (pytorch #169849; check_prefer_cudnn_attention).
CUDNN_TRUSTED_ABOVE = 91500
CUDNN_TRUSTED_TORCH = (2, 10)  # the first torch that prefers it by default
# The head dims flash-attn-4's interface lists for sm90 (and auto uses it at).
FA4_HEAD_DIMS = (64, 96, 128)

MEMORY = {
    "lse": "O(S): the output and a log-sum-exp per query",
    "dense_mask": "a dense (B, 1, S, S) boolean mask",
    "dense_scores": "dense (B, H, S, S) float32 scores",
}


def _up8(d: int) -> int:
    return -(-d // 8) * 8


@dataclass(frozen=True)
class Case:
    """One attention call as the table sees it (head dims as the model has them)."""

    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    v_head_dim: int | None = None  # None: head_dim (MLA: its own)
    documents: bool = False
    window: bool = False
    softcap: bool = False
    sinks: bool = False

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def padded(self) -> int:
        """The one head dim the FlashAttention kernels run q, k and v at."""
        return _up8(max(self.head_dim, self.dv))

    @property
    def plain(self) -> bool:
        return not (self.documents or self.window or self.softcap or self.sinks)

    def name(self) -> str:
        parts = [n for n, on in (("packed documents", self.documents), ("sliding window", self.window),
                                 ("soft-cap", self.softcap), ("sinks", self.sinks)) if on]
        text = " + ".join(parts) or "plain causal"
        if self.dv != self.head_dim:
            text += f", MLA {self.head_dim}/{self.dv}"
        elif self.head_dim > CUDNN_MAX_HEAD_DIM:
            text += f", head dim {self.head_dim}"
        return text


@dataclass(frozen=True)
class Choice:
    backend: str
    case: str  # the case's name ("plain causal", "packed documents", ...)
    why: str  # the row's reason, after the trap that sent the case past cuDNN if one did
    row: str  # the table row that decided
    memory: str  # a key of MEMORY

    @property
    def reason(self) -> str:
        return f"{self.case}: {self.why}"


@dataclass(frozen=True)
class Row:
    name: str
    when: str  # the condition, in words (docs)
    backend: str
    why: str  # in a few words, with the source: what the banner says
    source: str  # the figures behind the row, with their sources (docs)
    applies: Callable[[Case, Capabilities], bool]


# --------------------------------------------------------------------------- #
# What each fast kernel needs (also the refusals of a backend named explicitly)
# --------------------------------------------------------------------------- #


def cudnn_tensor_refusal(case: Case, caps: Capabilities) -> str | None:
    """What stops cuDNN attention taking ``case``'s tensors on ``caps`` (device, dtype,
    GPU generation, head dims); None when it can. Decided on any machine: with
    ``caps.sm`` unknown, the sm90/sm100 exceptions are allowed."""
    if not caps.cuda:
        return f"runs on CUDA only; got device '{caps.device_type}'"
    if case.dtype not in HALF:
        return f"needs float16 or bfloat16 inputs; got {case.dtype}"
    sm = caps.sm
    if sm is not None and not (8, 0) <= sm <= (12, 1):
        return f"runs on sm80-sm121; this GPU is {caps.sm_name}"
    dq, dv = _up8(case.head_dim), _up8(case.dv)
    mla_ok = ((dq, dv) == CUDNN_MLA_DIMS and (sm is None or sm[0] in (9, 10))
              and (caps.cudnn is None or caps.cudnn >= CUDNN_MLA_MIN))
    if not (max(dq, dv) <= CUDNN_MAX_HEAD_DIM or mla_ok):
        return (f"takes head dims up to {CUDNN_MAX_HEAD_DIM} (q/k 192 with v 128 on sm90/sm100, cuDNN >= 9.11); "
                f"got q/k {case.head_dim}, v {case.dv}")
    return None


def cudnn_refusal(case: Case, caps: Capabilities, *, auto: bool = True) -> str | None:
    """Why cuDNN attention is not the kernel for ``case`` on ``caps``; None when it is.
    ``auto=False``: only what stops it running (a backend named explicitly)."""
    why = cudnn_tensor_refusal(case, caps)
    if why:
        return why
    sm = caps.sm
    if auto and sm is None:
        return "this GPU's capability is unknown here"
    if auto and sm[0] not in (9, 10):
        return (f"cuDNN attention is slower than FlashAttention-2 off Hopper/sm100 ({caps.sm_name}; 0.82x on A100, "
                "0.93x on A10G, 0.88x on an sm120 RTX PRO 6000: transformers #48163)")
    if caps.cudnn is None:
        return "this torch has no cuDNN"
    if caps.cudnn <= CUDNN_TRUSTED_ABOVE:
        hidden = (f"; a system cuDNN earlier on LD_LIBRARY_PATH hides the wheel's "
                  f"{cudnn_version_str(caps.cudnn_bundled)}" if caps.cudnn_hidden else "")
        return (f"cuDNN {cudnn_version_str(caps.cudnn)} is not above 9.15.0 (earlier versions read out of bounds "
                f"for sequence lengths not a multiple of 128, pytorch #169849){hidden}")
    if not caps.cudnn_sdp_enabled:
        return "torch.backends.cuda.enable_cudnn_sdp(False) is in effect"
    if caps.deterministic:
        return "torch.use_deterministic_algorithms(True) is on and cuDNN attention is not deterministic"
    if auto and caps.cudnn_deprioritized:
        return "TORCH_CUDNN_SDPA_DEPRIORITIZED is set"
    if auto and caps.torch_version < CUDNN_TRUSTED_TORCH:
        return f"torch {caps.torch_version[0]}.{caps.torch_version[1]} predates 2.10, the first to prefer it"
    return None


def fa4_refusal(case: Case, caps: Capabilities, *, auto: bool = True) -> str | None:
    """Why FlashAttention-4 is not the kernel for ``case`` on ``caps``; None when it is."""
    if not caps.cuda:
        return f"runs on CUDA only; got device '{caps.device_type}'"
    if case.dtype not in HALF:
        return f"needs float16 or bfloat16 inputs; got {case.dtype}"
    if case.padded > FLASH_MAX_HEAD_DIM:
        return f"takes head dims up to {FLASH_MAX_HEAD_DIM}; got {max(case.head_dim, case.dv)}"
    if caps.sm is not None and caps.sm[0] not in (9, 10):
        return f"runs on sm90 and sm100 only (torch's FA4 route); this GPU is {caps.sm_name}"
    if not caps.fa4:
        return ("needs the flash-attn-4 package (pip install flash-attn-4) and a torch (>= 2.11) with "
                "torch.nn.attention.activate_flash_attention_impl('FA4')")
    if auto and (caps.sm is None or case.padded not in FA4_HEAD_DIMS):
        return f"auto runs it at head dims {FA4_HEAD_DIMS} on a known sm90/sm100 GPU only"
    return None


def _flash_ok(case: Case) -> bool:
    return case.padded <= FLASH_MAX_HEAD_DIM


def _masked(case: Case) -> bool:
    return case.documents or case.window


def _varlen_ok(case: Case, caps: Capabilities) -> bool:
    return caps.varlen and _flash_ok(case) and (caps.varlen_window or not case.window)


def memory_class(backend: str, case: Case) -> str:
    """:data:`MEMORY` key of what ``backend`` holds for ``case`` beyond q, k, v."""
    if backend == "sdpa" and (case.softcap or case.sinks):
        return "dense_scores"  # the explicit-scores path (dense.py)
    if backend in ("sdpa", "cudnn") and _masked(case):
        return "dense_mask"
    return "lse"


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #

# Each row: (name, condition in words, kernel, why -- the banner's words --, the figures behind it).
_CUDNN_HOPPER_SRC = (
    "transformers PR #48163: cuDNN attention 1.7-2.3x torch's FlashAttention-2 on H100 training shapes, same "
    "accuracy; pytorch #142132: cuDNN about FlashAttention-3's forward (631 TFLOP/s); measured here: SDPA on "
    "an H200 (torch 2.11, where SDPA prefers cuDNN) 512-551 TFLOP/s fwd+bwd, 8K-128K (benchmarks/RESULTS.md)")
_CUDNN_SM100_SRC = (
    "torch's check_prefer_cudnn_attention puts cuDNN first on sm100 too; sglang PR #33655: cuDNN 9.19 SDPA "
    "1.24-1.98x FlashAttention-4 on B200 (torch 2.11, dense shapes)")
_FA4_SRC = ("FlashAttention-4 (Zadouri et al. 2026): up to 1.3x cuDNN 9.13 and 2.7x Triton on B200 (BF16); "
            "FlashAttention-2's kernels are Ampere's")
_FA2_DOCS_SRC = ("FlashAttention-2 on cu_seqlens skips the masked blocks, O(S); cuDNN through SDPA would need a "
                 "dense (B, 1, S, S) mask (16 GiB at 128K). Measured here: the H200 run's kernel (929 tokens/s "
                 "per GPU, Llama-3-8B at 32K per GPU, benchmarks/RESULTS.md)")
_OFF_HOPPER_SRC = ("transformers PR #48163: cuDNN attention 0.82x FlashAttention-2 on A100, 0.93x on A10G, 1.00x "
                   "on L40S, 0.88x on an sm120 RTX PRO 6000")

ROWS: tuple[Row, ...] = (
    Row("cpu", "not CUDA", "sdpa",
        "the only kernel with a backward off CUDA",
        "FlexAttention is forward-only on CPU; varlen, flash-attn and cuDNN are CUDA-only",
        lambda c, m: not m.cuda),
    Row("fp32", "CUDA, float32", "sdpa",
        "the fused FlashAttention and cuDNN kernels are 16-bit only",
        "SDPA runs float32 on its memory-efficient kernel (O(S), no mask)",
        lambda c, m: c.dtype not in HALF),
    Row("sinks", "sinks", "flex",
        "only FlexAttention fuses a sink",
        "its log-sum-exp is differentiable; sdpa would build (B, H, S, S) float32 scores",
        lambda c, m: c.sinks),
    Row("softcap_flash_attn", "soft-cap, flash-attn installed", "flash_attn",
        "flash-attn's softcap argument, fused",
        "flash_attn_func(softcap=...): FlashAttention-2 with the cap applied in the kernel, O(S)",
        lambda c, m: c.softcap and m.flash_attn and _flash_ok(c)),
    Row("softcap", "soft-cap", "flex",
        "FlexAttention's score_mod, fused",
        "no other fused kernel here soft-caps (torch's varlen, cuDNN and its FA4 route have no cap)",
        lambda c, m: c.softcap),
    Row("head_dim_over_256", "head dim over 256", "sdpa",
        "no fused 16-bit kernel here takes head dims over 256",
        "FlashAttention-2/4 stop at 256, cuDNN at 128; SDPA's memory-efficient kernel takes any",
        lambda c, m: not _flash_ok(c)),
    Row("masked_fa4_sm100", "documents or window, sm100, flash-attn-4", "fa4",
        "FlashAttention-4, Blackwell's FlashAttention", _FA4_SRC,
        lambda c, m: _masked(c) and m.sm is not None and m.sm[0] == 10 and fa4_refusal(c, m) is None),
    Row("masked_flash_attn", "documents or window, flash-attn installed", "flash_attn",
        "FlashAttention-2 on cu_seqlens, O(S)", _FA2_DOCS_SRC,
        lambda c, m: _masked(c) and m.flash_attn),
    Row("masked_varlen", "documents or window, torch varlen", "varlen",
        "FlashAttention-2 on cu_seqlens, O(S)", _FA2_DOCS_SRC,
        lambda c, m: _masked(c) and _varlen_ok(c, m)),
    Row("masked", "documents or window, no FlashAttention entry point", "flex",
        "FlexAttention's block mask, O(S)", "it skips the masked blocks; sdpa would build a dense mask",
        lambda c, m: _masked(c)),
    Row("plain_cudnn_sm90", "plain, sm90, cuDNN > 9.15.0, torch >= 2.10", "cudnn",
        "cuDNN 1.7-2.3x FlashAttention-2 on Hopper (transformers #48163)", _CUDNN_HOPPER_SRC,
        lambda c, m: m.sm is not None and m.sm[0] == 9 and cudnn_refusal(c, m) is None),
    Row("plain_cudnn_sm100", "plain, sm100, cuDNN > 9.15.0, torch >= 2.10", "cudnn",
        "cuDNN 9.19 1.24-1.98x FlashAttention-4 on B200 (sglang #33655)", _CUDNN_SM100_SRC,
        lambda c, m: m.sm is not None and m.sm[0] == 10 and cudnn_refusal(c, m) is None),
    Row("plain_fa4", "plain, sm90/sm100 without cuDNN attention, flash-attn-4", "fa4",
        "FlashAttention-4", _FA4_SRC,
        lambda c, m: fa4_refusal(c, m) is None),
    Row("plain_flash_attn", "plain, flash-attn installed", "flash_attn",
        "FlashAttention-2 (flash-attn)", _OFF_HOPPER_SRC,
        lambda c, m: m.flash_attn),
    Row("plain_varlen", "plain, torch varlen", "varlen",
        "FlashAttention-2 (torch's varlen)", _OFF_HOPPER_SRC,
        _varlen_ok),
    Row("plain", "plain, no FlashAttention entry point", "sdpa",
        "SDPA's own choice", "torch < 2.10 without flash-attn",
        lambda c, m: True),
)


def _trap(case: Case, caps: Capabilities) -> str | None:
    """On Hopper/sm100, why a plain 16-bit case did not get cuDNN attention (the banner names it)."""
    if not (case.plain and caps.cuda and caps.sm is not None and caps.sm[0] in (9, 10) and case.dtype in HALF):
        return None
    return cudnn_refusal(case, caps)


def auto_choice(case: Case, caps: Capabilities) -> Choice:
    """The kernel ``auto`` runs for ``case`` on ``caps``, the row that chose it and why."""
    for row in ROWS:
        if row.applies(case, caps):
            trap = _trap(case, caps) if row.backend != "cudnn" else None
            why = row.why if trap is None else f"cuDNN attention not used: {trap} -> {row.why}"
            return Choice(row.backend, case.name(), why, row.name, memory_class(row.backend, case))
    raise AssertionError("the last row matches every case")  # pragma: no cover


def describe_choice(setting: str, case: Case, caps: Capabilities) -> str:
    """What runs ``case`` and why: ``cudnn (auto: sm90, torch 2.11, cuDNN 9.15.1; plain causal: ...)``."""
    if setting != "auto":
        return f"{setting} (named; {caps.describe()})"
    choice = auto_choice(case, caps)
    return f"{choice.backend} (auto: {caps.describe()}; {choice.reason})"


def describe_run(setting: str, caps: Capabilities, dtype: torch.dtype, head_dim: int,
                 v_head_dim: int | None = None) -> str:
    """The run banner's attention line: the kernel of the model's plain causal
    attention, and of packed documents when that differs (windows, soft-capping
    and sinks resolve per layer by the same table)."""
    plain = Case(dtype, head_dim, v_head_dim)
    text = describe_choice(setting, plain, caps)
    if setting == "auto":
        docs = auto_choice(Case(dtype, head_dim, v_head_dim, documents=True), caps)
        if docs.backend != auto_choice(plain, caps).backend:
            text += f"; {docs.case}: {docs.backend} ({docs.why})"
    return text
