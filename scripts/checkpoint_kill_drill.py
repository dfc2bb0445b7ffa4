"""Kill the job inside checkpoint writes, again and again, and check every resume starts from a complete,
verified checkpoint.

Each round runs tiny-cpu in-process (`--launcher local`) with `chaos.kill_rank_in_checkpoint` at the next
checkpoint step: the process dies after writing its shard and before the manifest, leaving a torn
checkpoint behind. The next round resubmits the same job name; it must resume from the newest checkpoint
whose manifest verifies (never the torn one) and its loss at the resumed step must continue the curve.

    python scripts/checkpoint_kill_drill.py --kills 20 [--home /tmp/drill]
Prints one JSON line per round and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from rayspeed.checkpoint import manifest  # noqa: E402

RESUMED = re.compile(r"resumed from (checkpoint_step\d+) at step (\d+)")


def run_round(home: Path, name: str, kill_step: int, every: int, max_steps: int) -> dict:
    env = dict(os.environ, RAYSPEED_HOME=str(home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
           "--launcher", "local", "--set", f"name={name}", "--set", f"train.max_steps={max_steps}",
           "--set", f"resilience.checkpoint_every_steps={every}", "--set", "tracking.log_every_steps=1",
           "--set", "train.eval_every_steps=0", "--set", "health.preflight=false",
           "--set", "tracking.loss_landscape=false", "--set", "tracking.charts_every_checkpoints=0",
           "--set", f"chaos.kill_rank_in_checkpoint={{rank: 0, step: {kill_step}}}"]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    m = RESUMED.search(out)
    root = home / "runs" / name
    torn = root / manifest.dir_name(kill_step)
    rec = {
        "kill_step": kill_step,
        "returncode": r.returncode,
        "killed": r.returncode == -9 or "inside the checkpoint write" in out,
        "resumed_from": m.group(1) if m else None,
        "resumed_step": int(m.group(2)) if m else 0,
        "torn_left_unverified": torn.exists() and not manifest.verify(torn).ok,
        "seconds": round(time.time() - t0, 1),
    }
    if m:
        rec["resumed_checkpoint_verified"] = manifest.verify(root / m.group(1)).ok
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--home", default=None)
    a = ap.parse_args()
    home = Path(a.home or tempfile.mkdtemp(prefix="rayspeed-drill-"))
    name = "ckpt-kill-drill"
    max_steps = a.every * (a.kills + 2)
    ok = True
    prev_kill = None
    for i in range(a.kills):
        kill_step = a.every * (i + 1)
        rec = run_round(home, name, kill_step, a.every, max_steps)
        # Round i must resume from the last checkpoint that completed before the previous torn one.
        expect = None if prev_kill is None else manifest.dir_name(prev_kill - a.every) if prev_kill - a.every > 0 else None
        rec["expected_resume"] = expect
        good = rec["killed"] and rec["torn_left_unverified"] and rec["resumed_from"] == expect
        if rec["resumed_from"]:
            good = good and rec.get("resumed_checkpoint_verified", False)
        rec["ok"] = good
        ok = ok and good
        print(json.dumps(rec), flush=True)
        prev_kill = kill_step
    # A final clean round finishes the job from the newest verified checkpoint.
    env = dict(os.environ, RAYSPEED_HOME=str(home))
    env.pop("MLFLOW_TRACKING_URI", None)
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
                        "--launcher", "local", "--set", f"name={name}", "--set", f"train.max_steps={max_steps}",
                        "--set", f"resilience.checkpoint_every_steps={a.every}", "--set", "train.eval_every_steps=0",
                        "--set", "health.preflight=false", "--set", "tracking.loss_landscape=false"],
                       env=env, capture_output=True, text=True)
    m = RESUMED.search(r.stdout + r.stderr)
    final = {"final_round_rc": r.returncode, "final_resumed_from": m.group(1) if m else None,
             "kills": a.kills, "all_resumes_verified": ok, "home": str(home)}
    print(json.dumps(final), flush=True)
    return 0 if ok and r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
