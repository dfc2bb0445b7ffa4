"""Kills inside checkpoint writes (the drill of scripts/checkpoint_kill_drill.py, 3 rounds here; the
script runs 20): every resume starts from a complete, verified checkpoint, never the torn one."""

import json
import subprocess
import sys

from _cluster import ROOT


def test_kills_during_checkpoint_writes_resume_from_verified(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "checkpoint_kill_drill.py"), "--kills", "3",
                        "--home", str(tmp_path)], capture_output=True, text=True, timeout=900)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rounds, final = lines[:-1], lines[-1]
    assert len(rounds) == 3 and all(x["killed"] and x["torn_left_unverified"] and x["ok"] for x in rounds)
    assert rounds[2]["resumed_from"] == "checkpoint_step00000002" and rounds[2]["resumed_checkpoint_verified"]
    assert final["final_resumed_from"] == "checkpoint_step00000004" and final["final_round_rc"] == 0
