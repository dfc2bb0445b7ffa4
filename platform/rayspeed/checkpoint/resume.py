"""Which checkpoint to resume from, and whether its ZeRO state must be converted for a new layout.

DeepSpeed refuses to load ZeRO-1/2/3 optimizer partitions at a different data-parallel size. When the
world changed (elastic shrink or grow), the verified checkpoint is converted once with DeepSpeed's
universal-checkpoint tool and loaded with `checkpoint.load_universal`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from rayspeed.checkpoint import manifest
from rayspeed.config.layout import PARTITION_KEYS, RECORD_DEFAULTS, Layout
from rayspeed.engine.deepspeed_state import UNIVERSAL_TAG, universal_command

log = logging.getLogger(__name__)

_DONE = ".converted"
_FAILED = ".conversion_failed"


def choose(root: str | Path, deep: bool = True) -> Path | str | None:
    """The checkpoint to resume from: the newest verified one under root. Unverified candidates are logged with
    the reason and never loaded.

    `root` may be a URI (returned paths are then URIs). deep=False checks the manifest and sizes only: for an
    object store, where hashing means downloading, the sha256s are checked on the staged copy instead
    (rayspeed.checkpoint.staging.fetch)."""
    found, skipped = manifest.latest_verified(root, deep=deep)
    for s in skipped:
        log.warning("checkpoint rejected: %s", s)
    return found


def layout_of(cfg: Any) -> dict[str, Any]:
    lay = Layout.from_parallel(cfg.parallel)
    out: dict[str, Any] = lay.partition()
    if lay.stage_layers is not None:
        out["stage_layers"] = list(lay.stage_layers)
    return out


def needs_universal(manifest: dict[str, Any], layout: dict[str, Any]) -> bool:
    """ZeRO partitions (stages 1-3) are tied to the data-parallel size they were written at (dp x cp: a manifest
    without cp was written at cp 1), and to the parameters of each pipeline stage (a different stage split moves
    blocks between optimizer partitions)."""
    old = manifest.get("layout") or {}
    if int(old.get("zero_stage", 0)) == 0 and int(layout.get("zero_stage", 0)) == 0:
        return False
    if any(int(old.get(k, RECORD_DEFAULTS.get(k, -1))) != int(layout.get(k, RECORD_DEFAULTS.get(k, -1)))
           for k in PARTITION_KEYS):
        return True
    before, now = old.get("stage_layers"), layout.get("stage_layers")
    return bool(before and now and [int(n) for n in before] != [int(n) for n in now])


def refuse_expert_conversion(manifest: dict[str, Any], layout: dict[str, Any], name: str) -> None:
    """Raise when resuming would convert a mixture of experts' shards in a way that is not built: the universal
    conversion carries them between ep and dp degrees at ZeRO-1 and 2 on both sides (the expert stacks concatenated
    in ep rank order, every other weight taken once: engine.deepspeed_state.expert_universal_info). ZeRO-0 files
    hold each ep rank's module and optimizer whole (any dp restores them at the same ep, no other ep), and ZeRO-3
    partitions each rank's experts apart from DeepSpeed's universal reader of them."""
    old = manifest.get("layout") or {}
    old_ep, new_ep = int(old.get("ep", 1)), int(layout.get("ep", 1))
    if old_ep == 1 and new_ep == 1:
        return
    if old_ep == new_ep and not needs_universal(manifest, layout):
        return
    tps = (int(old.get("tp", 1)), int(layout.get("tp", 1)))
    if max(tps) > 1:  # the universal record takes every weight but the experts as whole on each piece (tp 1 only)
        raise RuntimeError(
            f"resume from {name}: it was written at ep {old_ep}, tp {tps[0]}, dp {old.get('dp')} and this attempt "
            f"runs ep {new_ep}, tp {tps[1]}, dp {layout.get('dp')}: expert shards convert between layouts at tp 1 "
            f"only; resume with parallel.ep: {old_ep}, parallel.tp: {tps[0]} and parallel.dp: {old.get('dp')}")
    stages = (int(old.get("zero_stage", 0)), int(layout.get("zero_stage", 0)))
    if all(z in (1, 2) for z in stages):
        return
    raise RuntimeError(
        f"resume from {name}: it was written at ep {old_ep}, dp {old.get('dp')}, ZeRO-{stages[0]} and this attempt "
        f"runs ep {new_ep}, dp {layout.get('dp')}, ZeRO-{stages[1]}: expert shards convert between layouts at "
        f"ZeRO-1 and 2 only; resume with parallel.zero_stage: 1 or 2 on both sides, or parallel.ep: {old_ep} and "
        f"parallel.dp: {old.get('dp')} (at ZeRO-0 any dp that ep divides)")


def conversion_workers() -> int:
    """Worker processes for DeepSpeed's extract and merge phases: the node's cores, up to 8 (the phases are
    I/O- and unpickling-bound; more workers than that only add memory)."""
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def convert_to_universal(ckpt_dir: str | Path) -> str:
    """Convert `<ckpt>/ds` into `<ckpt>/ds_universal` once (idempotent; one converter per copy). Returns the tag.

    The conversion runs in a subprocess (DeepSpeed's tool uses worker pools and prints a lot), with its parallel
    extract and merge workers. It ends with a done-marker, or a failure marker carrying the reason: the other
    ranks wait for one of the two (`wait_converted`), outside any collective, so a conversion longer than the
    process-group timeout cannot tear the group down half-way."""
    ckpt_dir = Path(ckpt_dir)
    out = ckpt_dir / UNIVERSAL_TAG
    if (out / _DONE).exists():
        return UNIVERSAL_TAG
    (ckpt_dir / _FAILED).unlink(missing_ok=True)
    workers = conversion_workers()
    cmd = universal_command(ckpt_dir, workers)
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-3000:]
        reason = f"universal checkpoint conversion of {ckpt_dir.name} failed:\n{tail}"
        (ckpt_dir / _FAILED).write_text(reason)
        raise RuntimeError(reason)
    (out / _DONE).write_text("ok")
    log.info("converted %s to a universal checkpoint for the new layout (%s extract/merge workers)",
             ckpt_dir.name, workers)
    return UNIVERSAL_TAG


def wait_converted(ckpt_dir: str | Path, timeout_s: float, poll_s: float = 1.0) -> None:
    """Block until the converter of this copy finished (its done-marker) or failed (its failure marker: raise with
    its reason), at most timeout_s. Polls the folder; no collective is involved."""
    ckpt_dir = Path(ckpt_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        if (ckpt_dir / UNIVERSAL_TAG / _DONE).exists():
            return
        failed = ckpt_dir / _FAILED
        if failed.exists():
            raise RuntimeError(failed.read_text()[:3000])
        if time.monotonic() > deadline:
            raise TimeoutError(f"universal conversion of {ckpt_dir.name} not done after {timeout_s:.0f} s "
                               "(resilience.conversion_timeout_s)")
        time.sleep(poll_s)
