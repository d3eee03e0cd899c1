"""Search: the longest sequence whose planned step fits the GPU's memory and the host's.

How it searches
---------------
Every point is a planned step (:mod:`.planner`), traced with each sequence loop at
its edge pieces, so that a point costs the same at 100K tokens as at 10M, and
during the search extrapolated from 4- and 6-block traces (the 5-block check runs
once, on the answer). Memory grows about linearly with the length (a planned peak
is the highest of many levels, each affine in the length), so the search solves
for the limit rather than walking to it: the first point's bytes that grow with the
length (activations, backward temporaries, attention workspace, inputs) against
those that do not (parameters, gradients, optimizer state, FSDP buffers) give a
first estimate; from then on the line through the two points nearest the limit.
Each next point aims a third of the precision below the estimate, so that it
fits and the estimate from it and the previous point puts the limit within the
precision above it: two to four points in all. With ``granularity`` the answer is
instead a multiple of ``granularity * sp`` whose next multiple up is planned and
does not fit.

Three ceilings: the GPU's memory (``budget_gib - headroom_gib`` of allocated
tensors), the host's (``host_budget_gib`` per GPU for offloaded activations
and, with ``memory.offload_params``, the parameter state: a length whose plan
needs more host memory than that does not fit either), and with
``memory.offload_dir`` (the disk tier) the disk's (``disk_budget_gib`` per GPU for
the offloaded activations, the host then holding only the staging area and the
parameter state). The answer names the one that binds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import pairwise

from .disk import Rates
from .plan import GIB, MemoryPlan
from .planner import _assemble, _combine, _default_world_size, _layers_to_trace, _prepare

# Host memory per GPU assumed by default: an 8-GPU node with 2 TiB of RAM is 256 GiB
# per GPU, of which 16 are kept for the OS, the data loader and the processes' own memory.
HOST_BUDGET_GIB = 240.0
# The relative precision of the answer by default: the limit lies below answer * (1 + this).
PRECISION = 0.005
# The first length planned, per sp rank: long enough that what does not grow with the
# length (a loss chunk, an MLP tile) is small beside what does.
_FIRST_PER_RANK = 131072
# Categories of a phase's peak that grow with the length (the rest does not).
_GROWS = ("Activation", "Temp", "attn_workspace", "Inputs")


@dataclass
class SeqLenSearch:
    """Result of :func:`find_max_seq_len`."""

    max_seq_len: int  # 0 if even one unit does not fit
    unit: int  # lengths searched are multiples of it (tokens)
    budget_gib: float
    headroom_gib: float
    best: MemoryPlan | None  # plan at max_seq_len
    next_up: MemoryPlan | None  # the shortest planned length that does not fit (None: predicted only)
    plans: list = field(default_factory=list)  # (seq_len, peak_bytes, extrapolated) tried, in order
    confirmed: bool = False  # the plans at the boundary traced every layer
    seconds: float = 0.0
    host_budget_gib: float | None = None  # None: no host ceiling (plans for CPU)
    binding: str | None = None  # "device", "host" or "disk": the ceiling the next length up exceeds first
    limit_below: int = 0  # the limit lies below this length (planned not to fit, or predicted)
    limit_planned: bool = False  # limit_below is a planned length (not a prediction)
    precision: float = 0.0  # limit_below / max_seq_len - 1
    traces: int = 0  # traced steps (a plan extrapolated from 4/6 blocks is two)
    host_bytes: list = field(default_factory=list)  # host bytes of each of ``plans``
    disk_budget_gib: float | None = None  # None: no disk ceiling (or no disk tier: disk_tier False)
    disk_tier: bool = False  # memory.offload_dir: the offloaded tensors planned on the disk
    disk_bytes: list = field(default_factory=list)  # disk bytes of each of ``plans``

    def to_dict(self) -> dict:
        return {
            "max_seq_len": self.max_seq_len,
            "unit": self.unit,
            "precision": round(self.precision, 5) if math.isfinite(self.precision) else None,
            "limit_below": self.limit_below,
            "limit_planned": self.limit_planned,
            "binding": self.binding,
            "budget_gib": self.budget_gib,
            "headroom_gib": self.headroom_gib,
            "host_budget_gib": self.host_budget_gib,
            "disk_tier": self.disk_tier,
            "disk_budget_gib": self.disk_budget_gib,
            "confirmed_by_full_trace": self.confirmed,
            "seconds": round(self.seconds, 1),
            "traces": self.traces,
            "tried": self.plans,
            "tried_host_bytes": self.host_bytes,
            "tried_disk_bytes": self.disk_bytes,
            "best": self.best.to_dict() if self.best else None,
            "next_up": self.next_up.to_dict() if self.next_up else None,
        }

    def answer(self) -> str:
        """The answer with its precision, e.g. ``5,242,880 tokens (5.24M ± 0.5 %)``."""
        if self.max_seq_len == 0:
            return "0 tokens: one unit of the search does not fit"
        if not self.limit_below:
            return f"{self.max_seq_len:,} tokens ({_short(self.max_seq_len)}: it fits; nothing longer was bounded)"
        pct = max(math.ceil(self.precision * 1000) / 10, 0.1)
        how = "planned" if self.limit_planned else "predicted from the planned points"
        return (f"{self.max_seq_len:,} tokens ({_short(self.max_seq_len)} ± {pct:g} %: it fits; "
                f"{self.limit_below:,} does not, {how})")


def _short(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}K"


def _unit(dims, granularity: int | None) -> int:
    """Lengths searched: multiples of ``granularity`` tokens per sp rank, or without it of
    128 per sp rank (the attention kernels' block), doubled under ring attention (its
    layout cuts a sequence into 2 x ring chunks)."""
    if granularity is not None:
        if granularity < 1:
            raise ValueError(f"granularity={granularity} must be a positive number of tokens per sp rank")
        return granularity * dims.sp
    return 128 * dims.sp * (2 if dims.ring > 1 else 1)


@dataclass
class _Point:
    k: int  # length in units
    device: int  # planned peak (bytes)
    host: int  # planned host memory (bytes)
    disk: int  # planned disk bytes (the disk tier; else 0)
    fits: bool
    plan: MemoryPlan
    trace: object  # the (extrapolated) _Trace


def _one_point_limit(p: _Point, unit: int, limit: float, host_limit: float | None,
                     disk_limit: float | None = None) -> tuple[float, float, float]:
    """(device, host, disk) limits in tokens estimated from one point: the bytes that grow
    with the length scaled to it, the rest kept (on the host the parameter state; with the
    disk tier the staging area grows, and every disk byte does)."""
    s = p.k * unit
    dev = math.inf
    for ph in p.trace.phase_peaks.values():
        grows = sum(ph["cats"].get(c, 0) for c in _GROWS)
        fixed = ph["total"] - grows
        if fixed > limit:
            return 0.0, 0.0, 0.0
        if grows > 0:
            dev = min(dev, s * (limit - fixed) / grows)
    host = math.inf
    if host_limit is not None:
        grows = p.host - p.trace.host_fixed
        if p.trace.host_fixed > host_limit:
            host = 0.0
        elif grows > 0:
            host = s * (host_limit - p.trace.host_fixed) / grows
    disk = math.inf
    if disk_limit is not None and p.disk > 0:
        disk = s * disk_limit / p.disk
    return dev, host, disk


def _device_bytes(p: _Point) -> int:
    return p.device


def _host_bytes(p: _Point) -> int:
    return p.host


def _disk_bytes(p: _Point) -> int:
    return p.disk


def _crossing(a: _Point, b: _Point, value, limit: float, unit: int) -> float:
    """Where the line through ``a`` and ``b`` (``a.k < b.k``) meets ``limit``, in tokens
    (inf if it does not rise)."""
    va, vb = value(a), value(b)
    if vb <= va:
        return math.inf if vb <= limit else 0.0
    return (a.k + (limit - va) * (b.k - a.k) / (vb - va)) * unit


def _nearest_limit(points: list[_Point], value, limit: float, unit: int) -> float | None:
    """The limit's best estimate, in tokens: where the line through the two points
    nearest it (a pair on both sides of it if there is one) meets it; None with
    fewer than two points."""
    pts = sorted(points, key=lambda p: p.k)
    if len(pts) < 2:
        return None
    pairs = [(a, b) for a, b in pairwise(pts) if value(a) <= limit < value(b)]
    if pairs:
        a, b = pairs[0]
    elif value(pts[0]) > limit:
        a, b = pts[0], pts[1]
    else:
        a, b = pts[-2], pts[-1]
    return _crossing(a, b, value, limit, unit)


def _limit_above(points: list[_Point], value, limit: float, unit: int) -> float:
    """A length the limit lies below, in tokens: where the line through the two longest
    points within it meets it (a planned peak is the highest of levels each affine in
    the length, so it grows at least as fast past them); inf without two such points."""
    within = sorted((p for p in points if value(p) <= limit), key=lambda p: p.k)
    if len(within) < 2:
        return math.inf
    return _crossing(within[-2], within[-1], value, limit, unit)


def find_max_seq_len(
    cfg,
    world_size: int | None = None,
    *,
    budget_gib: float = 80.0,
    headroom_gib: float = 6.0,
    host_budget_gib: float | None = HOST_BUDGET_GIB,
    precision: float = PRECISION,
    granularity: int | None = None,
    rows: int = 1,
    device: str = "cuda",
    layers: str = "auto",
    confirm: bool = False,
    foreach: bool | None = None,
    loops: str = "edges",
    max_units: int | None = None,
    max_plans: int = 12,
    guess: tuple[int, ...] | None = None,
    log=None,
    target=None,
    prepare=None,
    disk_budget_gib: float | None = None,
    disk_gbps: float | None = None,
    achieved_tflops=None,
) -> SeqLenSearch:
    """Longest ``seq_len`` whose planned step fits the GPU's and the host's memory (and the disk).

    Fits means ``peak <= budget_gib - headroom_gib`` and, planning for CUDA with
    ``host_budget_gib`` (default :data:`HOST_BUDGET_GIB`; None for no host
    ceiling), host memory per GPU ``<= host_budget_gib``. ``rows`` sequences per
    dp rank (default one). The answer is the longest planned length that fits,
    within ``precision`` (relative) of the limit; with ``granularity`` (tokens
    per sp rank) a multiple of ``granularity * sp`` whose next multiple up is
    planned and does not fit. See the module doc for how it searches;
    ``layers``, ``foreach`` and ``loops`` as in :func:`plan_memory`. ``confirm``
    re-plans the boundary with every layer traced when it was extrapolated.
    ``target``: the machine whose attention kernels are planned (:func:`plan_memory`).
    ``guess``: lengths (tokens) planned first, e.g. a bracket read off a nearby
    layout's answer. ``max_plans`` bounds the points planned after them (the
    answer is then the best so far, with the precision it reached). ``prepare``: what
    prepares each step to trace (default: a training step; :func:`~.grpo.prepare_grpo`
    with its options bound for a GRPO step). ``disk_budget_gib``: with ``memory.offload_dir``
    planning for CUDA, the disk per GPU for the offloaded tensors (None: no disk ceiling);
    ``disk_gbps`` and ``achieved_tflops``: what the MODELLED step time assumes
    (:func:`plan_memory`).
    """
    prepare = prepare or _prepare
    if not 0 < precision < 1:
        raise ValueError(f"precision={precision} must be a fraction between 0 and 1 (e.g. 0.005 for 0.5 %)")
    if loops not in ("edges", "all"):
        raise ValueError(f"loops={loops!r} must be 'edges' or 'all'")
    if world_size is None:
        world_size = _default_world_size(cfg)
    t0 = time.perf_counter()
    edges = loops == "edges"
    rates = Rates.of(achieved_tflops, disk_gbps)
    first = prepare(cfg, world_size, None, rows=rows, device=device, foreach=foreach, edges=edges, target=target,
                    rates=rates)
    unit = _unit(first.dims, granularity)
    if max_units is None:
        max_units = max(1, (1 << 31) // unit)
    limit = (budget_gib - headroom_gib) * GIB
    host_limit = host_budget_gib * GIB if host_budget_gib is not None and device == "cuda" else None
    disk_tier = bool(first.offload_dir)
    disk_limit = disk_budget_gib * GIB if disk_budget_gib is not None and disk_tier else None
    traced: dict = {}  # (k, how) -> (step, traces by layer count)
    points: dict[int, _Point] = {}  # the search's points (one way of tracing)
    tried: list = []
    hosts: list = []
    disks: list = []

    def plan(k: int, how: str, check: bool = False) -> _Point:
        if (k, how) not in traced:
            traced[(k, how)] = (prepare(cfg, world_size, k * unit, rows=rows, device=device, foreach=foreach,
                                         edges=edges, target=first.target, rates=rates), {})
        step, traces = traced[(k, how)]
        trace, info, notes = _combine(step, traces, how, check=check)
        pl = _assemble(step, trace, info, notes)
        fits = (pl.peak_bytes <= limit and (host_limit is None or pl.host_bytes <= host_limit)
                and (disk_limit is None or pl.disk_bytes <= disk_limit))
        p = _Point(k, pl.peak_bytes, pl.host_bytes, pl.disk_bytes, fits, pl, trace)
        if k not in points:
            tried.append((k * unit, p.device, info["extrapolated"]))
            hosts.append(p.host)
            disks.append(p.disk)
            if log is not None:
                host = f", host {p.host / GIB:.1f} GiB" if host_limit is not None else ""
                host += f", disk {p.disk / GIB:.1f} GiB" if disk_tier else ""
                made = "extrapolated" if info["extrapolated"] else "full trace"
                log(f"  seq_len {k * unit:>12,}: {p.device / GIB:8.2f} GiB{host} "
                    f"({made}, {info['seconds']:.0f} s){'' if p.fits else ': does not fit'}")
        points[k] = p
        return p

    def estimates() -> dict[str, float]:
        """Ceiling ("device", "host", "disk") -> the limit's best estimate in tokens."""
        pts = list(points.values())
        est = {"device": _nearest_limit(pts, _device_bytes, limit, unit),
               "host": math.inf if host_limit is None else _nearest_limit(pts, _host_bytes, host_limit, unit),
               "disk": math.inf if disk_limit is None else _nearest_limit(pts, _disk_bytes, disk_limit, unit)}
        if None in est.values():
            one = _one_point_limit(max(pts, key=lambda p: p.k), unit, limit, host_limit, disk_limit)
            est = {name: v if v is not None else o for (name, v), o in zip(est.items(), one)}
        return est

    def bound() -> tuple[int, int | None, float]:
        """(lo, hi, above): lo the longest planned length that fits (0: none), hi the
        shortest longer one planned not to (None: none), ``above`` (tokens) a length the
        limit lies below."""
        lo = max((p.k for p in points.values() if p.fits), default=0)
        hi = min((p.k for p in points.values() if not p.fits and p.k > lo), default=None)
        pts = list(points.values())
        above = min(hi * unit if hi is not None else math.inf, _limit_above(pts, _device_bytes, limit, unit),
                    math.inf if host_limit is None else _limit_above(pts, _host_bytes, host_limit, unit),
                    math.inf if disk_limit is None else _limit_above(pts, _disk_bytes, disk_limit, unit))
        return lo, hi, above

    def search(how: str) -> tuple[int, int | None, float]:
        """Plan lengths until the limit is bracketed within the precision (or a unit);
        :func:`bound`'s figures at the end."""
        points.clear()
        seeds = [max(1, n // unit) for n in guess] if guess else [max(1, _FIRST_PER_RANK * first.dims.sp // unit)]
        for k in sorted({min(k, max_units) for k in seeds}):
            plan(k, how)
        for _ in range(max_plans):
            lo, hi, above = bound()
            if (hi is not None and hi <= lo + 1) or lo >= max_units:
                break
            if granularity is None and lo and above <= lo * unit * (1 + precision):
                break
            # Aim a little below the estimate: the point then fits, and closes the gap from below.
            est = min(estimates().values())
            aim = est * (1 - precision / 3) if granularity is None else est
            top = hi - 1 if hi is not None else max_units
            plan(min(max(int(aim // unit), lo + 1), top), how)
        return bound()

    how = _layers_to_trace(first, layers, checked=False)
    lo, hi, above = search(how)
    # The 5-block trace at the answer: is the step linear in the block count there?
    if how == "extrapolate" and lo and not plan(lo, how, check=True).plan.trace["extrapolated"]:
        if log is not None:
            log("  the 4/5/6-block traces are not linear in the block count: searching with every block traced")
        how = "full"
        lo, hi, above = search(how)
    best = points[lo] if lo else None
    nxt = points.get(hi) if hi is not None else None
    if confirm and how == "extrapolate":
        # Every layer traced at the boundary; extrapolation is exact to a fraction of a
        # percent, so walk from it a unit at a time.
        how = "full"
        while lo >= 1 and not plan(lo, how).fits:
            lo -= 1
        hi = lo + 1
        while hi <= max_units and plan(hi, how).fits:
            lo, hi = hi, hi + 1
        best, nxt, above = (points[lo] if lo else None), points[hi], hi * unit
    planned = nxt is not None and above >= nxt.k * unit
    if planned:
        limit_below = nxt.k * unit
    elif math.isfinite(above):
        limit_below = max(math.ceil(above / unit), lo + 1) * unit
    else:
        limit_below = 0  # nothing longer planned not to fit (max_units, or max_plans ran out)
    est = estimates()
    binding = min(est, key=est.get)  # the ceiling whose limit comes first (ties: device, host, disk)
    if nxt is not None:
        over = [name for name, bytes_, cap in (("device", nxt.device, limit), ("host", nxt.host, host_limit),
                                               ("disk", nxt.disk, disk_limit)) if cap is not None and bytes_ > cap]
        if len(over) == 1:  # the next length up exceeds exactly one ceiling: that one binds
            binding = over[0]
    return SeqLenSearch(
        max_seq_len=lo * unit,
        unit=unit,
        budget_gib=budget_gib,
        headroom_gib=headroom_gib,
        best=best.plan if best else None,
        next_up=nxt.plan if nxt else None,
        plans=tried,
        confirmed=how == "full",
        seconds=time.perf_counter() - t0,
        host_budget_gib=host_budget_gib if host_limit is not None else None,
        binding=binding if lo < max_units else None,
        limit_below=limit_below,
        limit_planned=planned,
        precision=(limit_below / (lo * unit) - 1) if lo and limit_below else (math.inf if lo else 0.0),
        traces=sum(len(t) for _, t in traced.values()),
        host_bytes=hosts,
        disk_budget_gib=disk_budget_gib if disk_limit is not None else None,
        disk_tier=disk_tier,
        disk_bytes=disks,
    )
