"""Host memory of an asynchronous checkpoint, and the checkpoint mode it allows (pure Python).

An async save (resilience.checkpoint_mode) copies what each rank's checkpoint files hold into host memory, then
writes them in the background: the copy costs host RAM equal to the bytes the rank writes. DeepSpeed writes, per
model-parallel rank, the module's weights once (on data-parallel rank 0, ZeRO 0-2) and, with ZeRO >= 1, every
rank's partition of the fp32 master weights and Adam states (ZeRO-0: the whole optimizer state beside the weights
on data-parallel rank 0). The ranks of a node share its RAM; on CPU workers the training state itself lives there
too. `choose_mode` is the one rule, used by the plan and by the workers at their first save (with the memory they
measure then).
"""

from __future__ import annotations

from rayspeed.config.layout import Layout
from rayspeed.planner.hardware import GIB, host_memory_gib
from rayspeed.planner.inputs import Ctx
from rayspeed.planner.memory import model_state_bytes
from rayspeed.planner.model_math import stage_params

# auto is async from this many bytes written per rank: below it a synchronous save is short, and a crash right
# after a synchronous save never loses it.
ASYNC_MIN_BYTES = GIB // 2
# Share of the host's RAM (available RAM, at run time) a snapshot may take; the rest is the OS, page cache the
# writes go through, Ray's object store and the driver.
HOST_FRACTION = 0.8
# Host RAM assumed per GPU of a GPU node (HGX/DGX H100 and H200 nodes carry 2 TiB for 8 GPUs: half of that). CPU
# workers are planned with this machine's RAM. Either way each worker checks what it has at its first save.
GPU_HOST_GIB_PER_GPU = 128.0


def rank_bytes(ctx: Ctx, lay: Layout) -> tuple[float, float]:
    """(bytes written by a data-parallel rank 0, bytes written by any other rank), worst pipeline stage."""
    best = (0.0, 0.0)
    for stage in {0, lay.pp - 1}:
        n = stage_params(ctx.shape, lay.tp, lay.pp, stage, ep=lay.ep)
        ms = model_state_bytes(n, ctx.precision, ctx.grad_accum_dtype, lay.zero_stage, lay.zero_ranks)
        partition = ms["master_weights"] + ms["optimizer_states"]
        if lay.zero_stage == 0:
            writer, other = ms["weights"] + partition, 0.0
        elif lay.zero_stage < 3:
            writer, other = ms["weights"] + partition, partition
        else:  # ZeRO-3: the module file holds placeholders; every rank writes its fp32 partition and states
            writer = other = partition
        best = (max(best[0], writer), max(best[1], other))
    return best


def node_bytes(ctx: Ctx, lay: Layout) -> float:
    """Snapshot bytes on the fullest node: its ranks, of which at most one replica's tp x pp ranks write weights."""
    writer, other = rank_bytes(ctx, lay)
    ranks = min(ctx.node_size, ctx.world)
    writers = min(ranks, lay.tp * lay.pp)
    return writers * writer + (ranks - writers) * other


def choose_mode(requested: str, per_rank: float, per_node: float, available: float) -> tuple[str, str]:
    """(sync | async, one line saying why). `available`: host bytes the snapshot may use on the fullest node."""
    if requested == "sync":
        return "sync", "resilience.checkpoint_mode is sync"
    need = f"{per_node / GIB:.2f} GiB of host memory per node ({per_rank / GIB:.2f} GiB on the largest rank)"
    if per_node > available:
        return "sync", (f"resilience.checkpoint_mode {requested} -> sync: the snapshot of an async save needs {need}, "
                        f"only {available / GIB:.2f} GiB are available for it")
    if requested == "auto" and per_rank < ASYNC_MIN_BYTES:
        return "sync", (f"resilience.checkpoint_mode auto -> sync: a rank writes {per_rank / GIB:.2f} GiB, a short "
                        f"synchronous save (async from {ASYNC_MIN_BYTES / GIB:.1f} GiB per rank)")
    return "async", (f"resilience.checkpoint_mode {requested} -> async: the snapshot takes {need} of "
                     f"{available / GIB:.2f} GiB available")


def checkpoint_plan(ctx: Ctx, lay: Layout, worker_bytes: float, requested: str,
                    host_gib: float | None = None) -> dict:
    """The plan's `checkpoint` object. worker_bytes: predicted memory of one worker (on CPU it is host memory too);
    host_gib: RAM of a node (default: GPU_HOST_GIB_PER_GPU per GPU, or this host's for CPU workers)."""
    ranks = min(ctx.node_size, ctx.world)
    if host_gib is None:
        host_gib = GPU_HOST_GIB_PER_GPU * ctx.node_size if ctx.hw.is_gpu else host_memory_gib()
    host = host_gib * GIB
    training = 0.0 if ctx.hw.is_gpu else ranks * worker_bytes
    available = max(0.0, HOST_FRACTION * host - training)
    writer, _ = rank_bytes(ctx, lay)
    per_node = node_bytes(ctx, lay)
    mode, why = choose_mode(requested, writer, per_node, available)
    return {"mode_requested": requested, "mode": mode, "why": why, "host_assumed": (
                f"{GPU_HOST_GIB_PER_GPU:g} GiB per GPU" if ctx.hw.is_gpu else "this machine's RAM"),
            "snapshot_bytes_per_rank": int(writer), "snapshot_bytes_per_node": int(per_node),
            "host_memory_gib": round(host / GIB, 2), "snapshot_available_gib": round(available / GIB, 2)}


def explain_lines(plan: dict) -> list[str]:
    return ["checkpoints:",
            f"  mode {plan['mode']}: {plan['why']}",
            f"  snapshot (async): {plan['snapshot_bytes_per_rank'] / GIB:.2f} GiB on the largest rank, "
            f"{plan['snapshot_bytes_per_node'] / GIB:.2f} GiB per node; host RAM {plan['host_memory_gib']:.1f} GiB "
            f"per node ({plan['host_assumed']}; each worker checks what it has at its first save), "
            f"{plan['snapshot_available_gib']:.2f} GiB of it for the snapshot"]
