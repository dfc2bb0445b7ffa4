"""The rules of context parallelism that the job checks, the planner and the worker share (torch-free).

Each sequence is cut into 2 x cp chunks and cp rank r holds chunks r and 2cp-1-r (rayspeed.parallel.context_parallel):
with causal attention the early chunks see few keys and the late ones many, so pairing them gives every rank the same
attention work. A plain contiguous split would leave rank 0 waiting on rank cp-1 for most of each layer.
"""

from __future__ import annotations

from typing import Any, Optional

from rayspeed import families

SCHEMES = ("ulysses", "ring")
# Below this many tokens per rank the block's GEMMs get thin and the exchange costs more than it saves: `cp: auto`
# considers cp only while every rank keeps at least this much of the sequence.
MIN_TOKENS_PER_RANK = 2048


def heads_split(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> bool:
    """Whether Ulysses can give each cp rank whole heads: the query heads of a tp rank divide by cp, and its kv heads
    divide by cp or divide cp (fewer kv heads than cp are repeated)."""
    q, kv = num_heads // tp, num_kv_heads // tp
    return q % cp == 0 and (kv % cp == 0 or cp % kv == 0)


def scheme_for(num_heads: int, num_kv_heads: int, tp: int, cp: int, requested: str) -> str:
    """parallel.cp_scheme resolved: as set, or (auto) ulysses where the heads split, else ring."""
    if requested in SCHEMES:
        return requested
    return "ulysses" if heads_split(num_heads, num_kv_heads, tp, cp) else "ring"


def cp_problem(seq_len: int, num_heads: int, num_kv_heads: int, tp: int, cp: int, scheme: str) -> Optional[str]:
    """Why this cp cannot split this model's sequences (None: it can)."""
    if cp <= 1:
        return None
    if seq_len % (2 * cp):
        return (f"parallel.cp ({cp}) cuts each sequence into 2 x cp = {2 * cp} balanced chunks, but model.seq_len "
                f"({seq_len}) does not divide by {2 * cp}; use a seq_len that is a multiple of {2 * cp}")
    if scheme == "ulysses" and not heads_split(num_heads, num_kv_heads, tp, cp):
        return (f"parallel.cp_scheme ulysses splits the heads over cp: the {num_heads // tp} heads and "
                f"{num_kv_heads // tp} kv heads of a tp rank do not split over cp ({cp}); use cp_scheme ring (or auto)")
    return None


def auto_degrees(seq_len: int, room: int) -> list[int]:
    """The cp degrees `cp: auto` weighs: 1, and the powers of two dividing `room` (the ranks left beside tp) that keep
    MIN_TOKENS_PER_RANK tokens per rank and split the sequence into balanced chunks."""
    out, c = [1], 2
    while c <= room:
        if room % c == 0 and seq_len % (2 * c) == 0 and seq_len // c >= MIN_TOKENS_PER_RANK:
            out.append(c)
        c *= 2
    return out


def cp_candidates(shape: Any, room: int) -> list[int]:
    """The cp degrees `cp: auto` weighs for a ModelShape: none but 1 for a family whose attention has no
    context-parallel form."""
    return auto_degrees(shape.seq_len, room) if has_context_parallel_form(shape.family) else [1]


def has_context_parallel_form(family: Any) -> bool:
    """Whether the family's attention runs under context parallelism (not sinks, not latent attention yet)."""
    return not family.attention.sinks and family.attention.params is None


def context_problems(m, par, num_kv_heads: int, world: Optional[int] = None) -> list[str]:
    """The job's parallel.cp and parallel.cp_scheme against its model, the other degrees set (auto ones are the
    planner's to choose) and the world size (None: elastic, checked per attempt)."""
    cp, tp = par.cp, par.tp
    if not isinstance(cp, int):
        return []
    if cp < 1:
        return [f"parallel.cp: must be >= 1 or auto, got {cp}"]
    if cp == 1:
        return []
    if world and world % cp:  # said alone: no seq_len makes it divide
        return [f"parallel.cp ({cp}) does not divide the world size ({world} workers, cluster.num_workers); use a "
                f"cp that divides {world} (or auto)"]
    family = families.find(getattr(m, "architecture", None))
    if family is not None and not has_context_parallel_form(family):
        form = ("attention sinks have no context-parallel form yet (the sink logit would have to join ring "
                "attention's merge)" if family.attention.sinks else "attention is its own, not the shared one context "
                "parallelism splits (for latent attention: Ulysses after its up-projections is not built)")
        return [f"parallel.cp ({cp}): {family.architecture}'s {form}; use parallel.cp: 1"]
    out = []
    why = cp_problem(m.seq_len, m.num_heads, num_kv_heads, tp if isinstance(tp, int) and tp >= 1 else 1, cp,
                     par.cp_scheme)
    if why:
        out.append(why)
    if par.sequence_parallel is True and isinstance(tp, int) and tp > 1 and (m.seq_len // cp) % tp:
        out.append(f"parallel.sequence_parallel: true splits each rank's {m.seq_len // cp} tokens (seq_len / cp) "
                   f"over tp ({tp}), which does not divide them; leave it auto or pick a seq_len that does")
    return out
