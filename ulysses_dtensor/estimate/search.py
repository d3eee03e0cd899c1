"""Search: the longest sequence whose planned peak fits a memory budget."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .plan import GIB, MemoryPlan
from .planner import _default_world_size, plan_memory


@dataclass
class SeqLenSearch:
    """Result of :func:`find_max_seq_len`."""

    max_seq_len: int  # 0 if even one unit does not fit
    unit: int  # granularity of the search in tokens (granularity * sp)
    budget_gib: float
    headroom_gib: float
    best: MemoryPlan | None  # plan at max_seq_len (full trace when confirmed)
    next_up: MemoryPlan | None  # plan at max_seq_len + unit (does not fit)
    plans: list = field(default_factory=list)  # (seq_len, peak_bytes, extrapolated) tried
    confirmed: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "max_seq_len": self.max_seq_len,
            "unit": self.unit,
            "budget_gib": self.budget_gib,
            "headroom_gib": self.headroom_gib,
            "confirmed_by_full_trace": self.confirmed,
            "seconds": round(self.seconds, 1),
            "tried": self.plans,
            "best": self.best.to_dict() if self.best else None,
            "next_up": self.next_up.to_dict() if self.next_up else None,
        }


def find_max_seq_len(
    cfg,
    world_size: int | None = None,
    *,
    budget_gib: float = 80.0,
    headroom_gib: float = 6.0,
    granularity: int = 1024,
    rows: int = 1,
    device: str = "cuda",
    layers: str = "auto",
    confirm: bool = True,
    foreach: bool | None = None,
    max_units: int = 1 << 16,
    guess: tuple[int, int] | None = None,
    log=None,
) -> SeqLenSearch:
    """Longest ``seq_len`` (a multiple of ``granularity * sp``) whose planned peak fits.

    Fits means ``peak <= budget_gib - headroom_gib``. ``rows`` sequences per dp
    rank (default one). The search brackets the answer between a length that
    fits and the next multiple up that does not, by interpolation on the
    planned peaks (memory grows about linearly with the length), falling back
    to bisection; every point is a traced plan (``layers`` as in
    :func:`plan_memory`). With ``confirm``, boundary plans that were
    extrapolated are redone with full traces and the bracket is fixed up.
    ``guess``: two lengths (tokens) expected to straddle the answer; they are
    planned first and seed the bracket (a wrong guess only costs the search
    the usual extra points), which saves the long climb from one unit when a
    nearby layout's answer is known.
    """
    from ..parallel.mesh import ParallelDims
    from ..trainer.config import validate_config

    if world_size is None:
        world_size = _default_world_size(cfg)
    par = cfg.parallelism
    try:
        sp = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size, ring=par.ring, tp=par.tp).sp
    except ValueError:
        validate_config(cfg, world_size, weights=False)  # raises the ConfigError
        raise
    unit = granularity * sp
    limit = (budget_gib - headroom_gib) * GIB
    t0 = time.perf_counter()
    tried: list = []
    cache: dict[tuple[int, str], MemoryPlan] = {}

    def get(k: int, how: str) -> MemoryPlan:
        if (k, how) not in cache:
            p = plan_memory(cfg, world_size, k * unit, rows=rows, device=device, layers=how, foreach=foreach)
            cache[(k, how)] = p
            tried.append((k * unit, p.peak_bytes, p.trace["extrapolated"]))
            if log is not None:
                made = "extrapolated" if p.trace["extrapolated"] else "full trace"
                log(f"  seq_len {k * unit:>12,}: {p.peak_gib:8.2f} GiB ({made}, {p.trace['seconds']:.0f} s)")
        return cache[(k, how)]

    def search(how: str, lo: int = 0, hi: int | None = None, seeds: tuple[int, ...] = ()) -> int:
        """Largest k with a fitting plan, given lo fits (or is 0) and hi does not (or None)."""
        peaks: dict[int, int] = {}

        def fits(k: int) -> bool:
            peaks[k] = get(k, how).peak_bytes
            return peaks[k] <= limit

        for k in sorted(seeds):
            if fits(k):
                lo = max(lo, k)
            elif hi is None or k < hi:
                hi = k
        if lo == 0 and hi is None:
            if not fits(1):
                return 0
            lo = 1
        last_width = None
        while hi is None or hi - lo > 1:
            fit_ks = sorted(k for k in peaks if peaks[k] <= limit)
            confident = True
            if hi is None:
                kb = fit_ks[-1]
                # Slope over a wide span: the largest fitting point at most half of kb.
                below = [k for k in fit_ks if k <= kb // 2] or fit_ks[:-1]
                ka = below[-1] if below else None
                if ka is not None and peaks[kb] > peaks[ka]:
                    slope = (peaks[kb] - peaks[ka]) / (kb - ka)
                    pred = int(kb + (limit - peaks[kb]) / slope)
                    k = max(pred, kb + 1)
                    if k > 8 * kb:  # too far to trust: grow geometrically
                        k, confident = 8 * kb, False
                else:
                    k, confident = 4 * lo, False
                if k > max_units:
                    if lo >= max_units or fits(max_units):
                        return max_units
                    hi = max_units
                    continue
            else:
                width = hi - lo
                if lo in peaks and hi in peaks and peaks[hi] > peaks[lo] and (
                    last_width is None or width <= last_width // 2 or width <= 4
                ):
                    k = lo + int((limit - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))
                    k = min(max(k, lo + 1), hi - 1)
                else:
                    k, confident = (lo + hi) // 2, False
                last_width = width
            ok = fits(k)
            # Peak per unit of length near k, from the nearest other planned point.
            others = [j for j in peaks if j != k]
            near = min(others, key=lambda j: abs(j - k)) if others else None
            per_unit = abs(peaks[k] - peaks[near]) / abs(k - near) if near is not None else 0.0
            # Within a unit and a half of the limit: the neighbour is likely the boundary.
            close = confident and per_unit > 0 and abs(limit - peaks[k]) < 1.5 * per_unit
            if ok:
                lo = k
                if close and (hi is None or k + 1 < hi) and k + 1 <= max_units and not fits(k + 1):
                    hi = k + 1
            else:
                hi = k
                if close and k - 1 > lo and fits(k - 1):
                    lo = k - 1
        return lo

    seeds = tuple(sorted({max(1, n // unit) for n in guess})) if guess else ()
    k = search(layers, seeds=seeds)
    confirmed = all(not get(j, layers).trace["extrapolated"] for j in (k, k + 1) if j >= 1)
    how = layers
    if confirm and not confirmed:
        # Extrapolation is exact to a fraction of a percent: walk, don't search.
        how = "full"
        while k >= 1 and get(k, "full").peak_bytes > limit:
            k -= 1
        while k + 1 <= max_units and get(k + 1, "full").peak_bytes <= limit:
            k += 1
        confirmed = True
    best = get(k, how) if k >= 1 else None
    next_up = get(k + 1, how)
    return SeqLenSearch(
        max_seq_len=k * unit,
        unit=unit,
        budget_gib=budget_gib,
        headroom_gib=headroom_gib,
        best=best,
        next_up=next_up,
        plans=tried,
        confirmed=confirmed,
        seconds=time.perf_counter() - t0,
    )
