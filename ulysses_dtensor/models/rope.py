"""Rotary position embeddings: every rope type transformers implements, computed on the fly.

There is no ``max_seq_len`` table: sequences reach millions of tokens. Inverse
frequencies and angles are formed in float64, so the angle of position 10^6 is
still exact to float32, and applied on the local slice of the sequence; with
global position ids that equals rope on the full sequence.

:class:`RopeConfig` is one rope in transformers' ``rope_parameters`` terms
(``rope_type`` and its parameters, ``rope_theta`` as ``theta``); the types and
their formulas are those of transformers 5's ``modeling_rope_utils``:

* ``default``: ``theta^(-2i/d)``;
* ``linear``: default / ``factor`` (position interpolation);
* ``dynamic``: NTK-aware, the base raised with the sequence length L beyond
  ``original_max_position_embeddings`` (transformers reads that length from
  ``config.max_position_embeddings``);
* ``yarn``: interpolate low frequencies, keep high ones, a linear ramp between
  (``beta_fast`` / ``beta_slow``), cos and sin scaled by an attention factor;
* ``llama3``: Llama 3.1's smooth low/high frequency split;
* ``longrope``: per-frequency ``short_factor`` / ``long_factor`` chosen by L,
  cos and sin scaled by an attention factor.

``dynamic`` and ``longrope`` depend on the sequence length L. transformers takes
``L = 1 + max(position_ids)`` over the batch of one forward: for packed
documents whose positions restart that is the longest document, not the row.
Here L is the same number for the WHOLE batch: under sequence parallelism the
maximum is taken over every sp rank (a rank's slice alone would give each rank
other frequencies), and the trainer pins it to the step's global batch (see
``Llama.rope_seq_len``), so every mesh and micro-batch split computes the
frequencies transformers computes for the whole global batch in one forward.
Unlike transformers' cache there is no memory of earlier, longer batches.

Two layouts of the rotated pairs within a head: ``"interleaved"`` pairs
``(2i, 2i+1)`` (Meta's original checkpoints, our flavors) and ``"half"`` pairs
``(i, i + head_dim/2)`` (the rotate-half layout Hugging Face checkpoints store).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LLAMA31_ROPE",
    "ROPE_LAYOUTS",
    "ROPE_PARAMETERS",
    "ROPE_TYPES",
    "RopeConfig",
    "RopeError",
    "apply_rope",
    "rope_cos_sin",
    "rope_frequencies",
]

ROPE_LAYOUTS = ("interleaved", "half")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# rope_type -> (required, optional) parameters besides rope_type and rope_theta, as
# transformers validates them. ``dynamic``'s original length is ours: transformers
# takes it from config.max_position_embeddings (the export writes it there).
ROPE_PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("factor", "attention_factor")),
}
_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
           "mscale_all_dim", "attention_factor")
_LISTS = ("short_factor", "long_factor")


class RopeError(ValueError):
    """A rope configuration this model cannot use; the message names the key and what is valid."""


@dataclass(frozen=True)
class RopeConfig:
    """One rope: its type, base ``theta`` and the parameters its type uses (others None).

    Build it from a transformers-style table with :meth:`from_parameters` (which
    checks every key); :meth:`parameters` gives the table back for a config.json.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise RopeError(f"rope_type={self.rope_type!r}; valid: {', '.join(ROPE_TYPES)}")
        for key in _LISTS:  # JSON gives lists; keep the config hashable
            value = getattr(self, key)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, key, tuple(value))

    # ------------------------------------------------------------ building
    @classmethod
    def from_parameters(
        cls,
        table: dict,
        *,
        where: str = "rope_parameters",
        theta: float | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int | None = None,
    ) -> RopeConfig:
        """A checked RopeConfig from ``{rope_type, rope_theta?, <parameters>}``.

        ``theta``: the base when the table has no ``rope_theta``.
        ``max_position_embeddings``: the model's, if it has one (an HF config):
        the default of ``dynamic``'s original length and of ``longrope``'s
        factor (``max_position_embeddings / original``), as in transformers.
        ``head_dim``: checks the lengths of ``longrope``'s factor lists.
        Every problem raises one :class:`RopeError` naming ``where.key``.
        """
        if not isinstance(table, dict):
            raise RopeError(f"{where} must be a table {{rope_type = ..., <its parameters>}}, got {table!r}")
        kind = table.get("rope_type")
        if kind not in ROPE_TYPES:
            shown = "missing" if kind is None else repr(kind)
            raise RopeError(f"{where}.rope_type is {shown}; valid: {', '.join(ROPE_TYPES)}")
        required, optional = ROPE_PARAMETERS[kind]
        allowed = ("rope_type", "rope_theta", *required, *optional)
        params = {k: v for k, v in table.items() if k not in ("rope_type", "rope_theta")}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise RopeError(
                f"{where}.partial_rotary_factor={params['partial_rotary_factor']!r}: this model rotates "
                "the whole head (only 1.0)")
        params.pop("partial_rotary_factor", None)
        unknown = [k for k in params if k not in allowed]
        if unknown:
            raise RopeError(
                f"{where}.{unknown[0]} is not a parameter of rope_type {kind!r}; valid: "
                f"{', '.join(allowed)}")
        if kind == "dynamic" and "original_max_position_embeddings" not in params and max_position_embeddings:
            params["original_max_position_embeddings"] = max_position_embeddings
        missing = [k for k in required if params.get(k) is None]
        if missing:
            extra = (" (the length beyond which the base grows; transformers takes it from "
                     "max_position_embeddings, which this model has none of)"
                     if missing == ["original_max_position_embeddings"] and kind == "dynamic" else "")
            raise RopeError(
                f"{where} of rope_type {kind!r} lacks {', '.join(missing)}{extra}; it needs "
                f"{', '.join(required)}" + (f" (optional: {', '.join(optional)})" if optional else ""))
        raw_theta = table.get("rope_theta", theta)
        if raw_theta is None:
            raise RopeError(f"{where} lacks rope_theta")
        values = {"theta": _number(raw_theta, f"{where}.rope_theta", minimum=0.0, strict=True)}
        for key, value in params.items():
            name = f"{where}.{key}"
            if value is None:
                continue
            if key == "original_max_position_embeddings":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise RopeError(f"{name}={value!r} must be an integer >= 1")
                values[key] = value
            elif key == "truncate":
                if not isinstance(value, bool):
                    raise RopeError(f"{name}={value!r} must be true or false")
                values[key] = value
            elif key in _LISTS:
                if not isinstance(value, (list, tuple)) or not value:
                    raise RopeError(f"{name} must be a list of numbers, got {value!r}")
                values[key] = tuple(_number(v, f"{name}[{i}]", minimum=0.0, strict=True)
                                    for i, v in enumerate(value))
            else:
                values[key] = _number(value, name)
        rope = cls(rope_type=kind, **values)
        if kind == "longrope" and rope.factor is None and max_position_embeddings:
            rope = dataclasses.replace(
                rope, factor=max_position_embeddings / rope.original_max_position_embeddings)
        rope._check_ranges(where)
        if head_dim is not None:
            rope.check_head_dim(head_dim, where)
        return rope

    def _check_ranges(self, where: str) -> None:
        """Values transformers would warn about (and so would load differently or noisily)."""
        if self.factor is not None and self.factor < 1.0:
            raise RopeError(f"{where}.factor={self.factor:g} must be >= 1 (the context extension ratio)")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise RopeError(
                f"{where}.high_freq_factor={self.high_freq_factor:g} must be greater than "
                f"low_freq_factor={self.low_freq_factor:g}")
        if self.rope_type == "yarn" and (self.beta_fast or 32) < (self.beta_slow or 1):
            raise RopeError(
                f"{where}.beta_fast={self.beta_fast or 32:g} must be >= beta_slow={self.beta_slow or 1:g}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise RopeError(f"{where}.attention_factor={self.attention_factor:g} must be > 0")
        if self.rope_type == "longrope" and self.factor is None and self.attention_factor is None:
            raise RopeError(
                f"{where} of rope_type 'longrope' needs factor (or attention_factor): transformers "
                "derives it from max_position_embeddings, which this model has none of")

    def check_head_dim(self, head_dim: int, where: str = "rope") -> None:
        """``longrope``'s factor lists have one entry per rotated pair (head_dim / 2)."""
        for key in _LISTS:
            value = getattr(self, key)
            if value is not None and len(value) != head_dim // 2:
                raise RopeError(
                    f"{where}.{key} has {len(value)} entries; this model's head_dim {head_dim} "
                    f"needs {head_dim // 2} (one per rotated pair)")

    @classmethod
    def from_dict(cls, d: dict) -> RopeConfig:
        """From :meth:`to_dict`'s output (a checkpoint's model.json)."""
        return cls(**d)

    def to_dict(self) -> dict:
        """JSON-able fields (lists for the factor tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def with_theta(self, theta: float) -> RopeConfig:
        return dataclasses.replace(self, theta=float(theta))

    # ------------------------------------------------------------ writing
    def parameters(self) -> dict:
        """transformers' ``rope_parameters`` of this rope: rope_type, rope_theta and the
        parameters its type takes. ``dynamic``'s original length is left out: it
        belongs in ``max_position_embeddings`` (transformers warns on it here)."""
        out = {"rope_type": self.rope_type, "rope_theta": self.theta}
        required, optional = ROPE_PARAMETERS[self.rope_type]
        for key in (*required, *optional):
            value = getattr(self, key)
            if value is None or (self.rope_type == "dynamic" and key == "original_max_position_embeddings"):
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def describe(self) -> str:
        """One line for banners and logs: ``yarn theta=1e+06 factor=4 original_max_position_embeddings=32768``."""
        parts = [self.rope_type, f"theta={self.theta:g}"]
        for key, value in dataclasses.asdict(self).items():
            if key in ("rope_type", "theta") or value is None:
                continue
            if isinstance(value, (list, tuple)):
                parts.append(f"{key}=[{len(value)} values]")
            elif isinstance(value, float):
                parts.append(f"{key}={value:g}")
            else:
                parts.append(f"{key}={value}")
        return " ".join(parts)

    # ------------------------------------------------------------ computing
    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (``dynamic``, ``longrope``)."""
        return self.rope_type in ("dynamic", "longrope")

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (``yarn``, ``longrope``; else 1)."""
        if self.rope_type == "yarn":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
            return _yarn_mscale(self.factor)
        if self.rope_type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def inv_freq(self, head_dim: int, seq_len: int | None = None, device=None) -> Tensor:
        """Inverse frequencies ``(head_dim/2,)`` in float64.

        ``seq_len``: the L of the length-dependent types (``dynamic``: the base
        grows beyond the original length; ``longrope``: long factors beyond it);
        None means a sequence within the original length.
        """
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
        kind = self.rope_type
        if kind == "dynamic":
            orig = self.original_max_position_embeddings
            length = max(seq_len or orig, orig)
            base = self.theta * (self.factor * length / orig - (self.factor - 1)) ** (head_dim / (head_dim - 2))
            return base ** -exponents
        base_freq = self.theta ** -exponents
        if kind == "default":
            return base_freq
        if kind == "linear":
            return base_freq / self.factor
        if kind == "llama3":
            return self._llama3(base_freq)
        if kind == "yarn":
            return self._yarn(base_freq, head_dim)
        long = seq_len is not None and seq_len > self.original_max_position_embeddings
        ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float64, device=device)
        return base_freq / ext

    def _llama3(self, inv_freq: Tensor) -> Tensor:
        # Wavelengths shorter than original / high_freq_factor are kept, longer than
        # original / low_freq_factor divided by factor, those between interpolated.
        wavelen = 2 * math.pi / inv_freq
        low, high = self.low_freq_factor, self.high_freq_factor
        smooth = ((self.original_max_position_embeddings / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / self.factor + smooth * inv_freq

    def _yarn(self, inv_freq: Tensor, head_dim: int) -> Tensor:
        orig = self.original_max_position_embeddings

        def dim_of(rotations: float) -> float:  # the dim index that turns `rotations` times in orig
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast or 32), dim_of(self.beta_slow or 1)
        if self.truncate is None or self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device) - low)
                / (high - low)).clamp(0.0, 1.0)
        # ramp 0: high frequencies kept (extrapolated); 1: divided by factor (interpolated).
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(value, name: str, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RopeError(f"{name}={value!r} must be a number")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise RopeError(f"{name}={value!r} must be {'>' if strict else '>='} {minimum:g}")
    return float(value)


# Llama 3.1's rope: the default of our flavors.
LLAMA31_ROPE = RopeConfig(
    rope_type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=8192,
    low_freq_factor=1.0, high_freq_factor=4.0,
)


def rope_frequencies(rope: RopeConfig, head_dim: int, seq_len: int | None = None, device=None) -> Tensor:
    """Inverse frequencies ``(head_dim/2,)`` in float64 of ``rope`` (see :meth:`RopeConfig.inv_freq`)."""
    return rope.inv_freq(head_dim, seq_len, device)


def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(B, S)`` positions -> float32 ``cos, sin`` of shape ``(B, S, head_dim/2)``.

    Angles are formed in float64: at position 10^6 a float32 product would be
    off by up to 0.06 rad. ``scaling``: the rope's attention scaling (yarn,
    longrope), applied to both, as transformers does.
    """
    angles = position_ids.to(torch.float64)[..., None] * inv_freq.to(position_ids.device)
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.float(), sin.float()


def _rotate(x: Tensor, c: Tensor, s: Tensor, layout: str) -> Tensor:
    """``x`` rotated by the angles of ``c, s`` (broadcast over heads), in float32, cast back."""
    xf = x.float()
    if layout == "half":
        x0, x1 = xf.chunk(2, dim=-1)
        return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).type_as(x)
    xf = xf.unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).type_as(x)


# Heads rotated at a time: the float32 temporaries of a rotation are a few times the size of the
# heads they cover, so a group of 1/8 of the heads keeps them under its input's size (at millions of
# tokens the whole of q in float32, twice, was the peak of a layer's backward). Below
# _GROUP_MIN_BYTES of float32 at once the rotation runs whole (fewer kernel launches).
_HEAD_GROUPS = 8
_GROUP_MIN_BYTES = 1 << 26


def _rotate_by_groups(x: Tensor, c: Tensor, s: Tensor, layout: str) -> Tensor:
    # Heads are dim -2: x may be (B, S, H, D) or the Ulysses send layout (P, B, S, H/P, D).
    heads = x.shape[-2]
    step = max(1, -(-heads // _HEAD_GROUPS))
    if step >= heads or x.numel() * 4 < _GROUP_MIN_BYTES:
        return _rotate(x, c, s, layout)
    out = torch.empty_like(x)
    for h in range(0, heads, step):
        out[..., h:h + step, :] = _rotate(x[..., h:h + step, :], c, s, layout)
    return out


class _Rope(torch.autograd.Function):
    """The rotation and its gradient, the rotation by the opposite angles (bitwise what
    autograd computes through :func:`_rotate`), a group of heads at a time; keeps
    only cos and sin."""

    @staticmethod
    def forward(ctx, x, c, s, layout):
        ctx.save_for_backward(c, s)
        ctx.layout = layout
        return _rotate_by_groups(x, c, s, layout)

    @staticmethod
    def backward(ctx, grad):
        c, s = ctx.saved_tensors
        return _rotate_by_groups(grad, c, -s, ctx.layout), None, None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """Rotate pairs of dims of ``x: (B, S, H, D)`` by the angles of ``cos, sin``
    (``(B, S, D/2)``; ``x`` may have leading dims before B: the Ulysses send layout).

    ``"interleaved"``: pairs ``(x[2i], x[2i+1])`` (Meta's layout);
    ``"half"``: pairs ``(x[i], x[i + D/2])`` (Hugging Face's rotate-half layout).
    Computed in float32, a group of heads at a time, forward and backward.
    """
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if layout not in ("half", "interleaved"):
        raise ValueError(f"rope layout {layout!r} must be 'interleaved' or 'half'")
    if c.requires_grad or s.requires_grad:  # angles with a gradient: autograd's own rotation
        return _rotate(x, c, s, layout)
    return _Rope.apply(x, c, s, layout)
