"""The plan of head chunks (:mod:`.head_chunks`): how many a call runs, and which query
and kv heads each chunk holds.

Chunks follow the kv groups (GQA): with ``hk`` kv heads per rank, a count divides ``hk``,
or is ``hk`` times a divisor of the group size ``hq / hk`` (a group's query heads split over
several chunks, its k/v exchanged with the first of them). ``None`` picks one query head
per chunk where one layer's exchanged attention tensors pass :data:`AUTO_MIN_BYTES`, none
below.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mesh import divisors

__all__ = ["AUTO_MIN_BYTES", "Chunk", "auto_head_chunks", "check_head_chunks", "chunk_plan", "recomputes_in_chunks",
           "resolve_head_chunks", "valid_head_chunks"]

# Auto chunks when one layer's exchanged attention tensors and their gradients exceed this
# per rank: Llama-3-8B on sp 8 reaches it at about 210K tokens.
AUTO_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class Chunk:
    """One chunk: its query heads and kv heads among this rank's (``[start, stop)``),
    whether its k/v are exchanged with it (a group's first chunk) and whether their
    gradients go back after it (a group's last)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    kv_first: bool = True
    kv_last: bool = True


def valid_head_chunks(q_heads: int, kv_heads: int) -> list[int]:
    """Chunk counts over ``q_heads`` query and ``kv_heads`` kv heads (per rank) that follow the kv groups."""
    group = q_heads // kv_heads
    return sorted(set(divisors(kv_heads)) | {kv_heads * d for d in divisors(group)})


def check_head_chunks(value, q_heads: int, kv_heads: int, where: str = "head_chunks") -> int | None:
    """``value`` if it is None (auto) or a count :func:`valid_head_chunks` allows, else ValueError."""
    if value is None:
        return None
    valid = valid_head_chunks(q_heads, kv_heads)
    if isinstance(value, bool) or not isinstance(value, int) or value not in valid:
        raise ValueError(
            f"{where}={value!r}: a rank holds {q_heads} query and {kv_heads} kv heads after the exchange, and "
            f"chunks follow the kv groups; valid: {valid} (1: no chunks), or None for a count from the shapes"
        )
    return value


def recomputes_in_chunks(head_chunks: int | None, backend: str, patterns) -> bool:
    """Whether chunks may run a kernel without a split backward (:class:`~.head_chunk_kernels.RecomputeSplit`:
    soft-capping or sinks, ``flex``, ``flash_attn``, ``cudnn`` with a mask), which torch.compile
    cannot trace in one graph: the blocks are then compiled with graph breaks allowed."""
    if head_chunks == 1:
        return False
    return bool({"softcap", "sinks"} & set(patterns)) or backend in ("flex", "flash_attn", "cudnn")


def chunk_plan(chunks: int, q_heads: int, kv_heads: int) -> tuple[Chunk, ...]:
    """The chunks of ``q_heads`` / ``kv_heads`` per rank, in order."""
    check_head_chunks(chunks, q_heads, kv_heads)
    nq = q_heads // chunks
    if chunks <= kv_heads:
        nk = kv_heads // chunks
        return tuple(Chunk((c * nq, (c + 1) * nq), (c * nk, (c + 1) * nk)) for c in range(chunks))
    per_group = chunks // kv_heads
    return tuple(Chunk((c * nq, (c + 1) * nq), (c // per_group, c // per_group + 1), c % per_group == 0,
                       c % per_group == per_group - 1) for c in range(chunks))


def auto_head_chunks(batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, v_head_dim: int,
                     element_size: int) -> int:
    """One query head per chunk when q, k, v, the output and their gradients, for this rank's
    heads over the whole sequence (``seq`` tokens), exceed :data:`AUTO_MIN_BYTES`; else 1."""
    working = 2 * batch * seq * element_size * (q_heads + kv_heads) * (head_dim + v_head_dim)
    return q_heads if working >= AUTO_MIN_BYTES else 1


def resolve_head_chunks(setting: int | None, batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int,
                        v_head_dim: int, element_size: int) -> int:
    """The chunk count a call runs: ``setting``, or :func:`auto_head_chunks` for None."""
    if setting is not None:
        return check_head_chunks(setting, q_heads, kv_heads)
    return auto_head_chunks(batch, seq, q_heads, kv_heads, head_dim, v_head_dim, element_size)
