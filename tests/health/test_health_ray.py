"""`rayspeed healthcheck --workers 2 --json` on the session's real Ray head (gloo on CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.errors import ConfigError
from rayspeed.health.healthcheck import parse_bytes, sizes_between

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


def _run(args, ray_address, timeout=240):
    env = dict(os.environ, RAY_ADDRESS=ray_address, RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith("NCCL_")}
    return subprocess.run([sys.executable, "-m", "rayspeed", "healthcheck", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_healthcheck_two_workers_json(ray_head):
    # 1K..4M (13 sizes): the default sweep goes to 16M; the shorter one keeps the test quick on 2 shared cores.
    r = _run(["--workers", "2", "--json", "--max-bytes", "4M"], ray_head.address)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rep = json.loads(r.stdout)
    assert rep["backend"] == "gloo"
    assert [x["rank"] for x in rep["ranks"]] == [0, 1]
    for x in rep["ranks"]:
        assert x["device"] == "cpu" and x["node"] and x["matmul_gflops"] > 0 and x["link_gbps"] > 0
    ar = rep["allreduce"]
    assert len(ar) >= 8 and all(row["busbw_gbps"] > 0 and row["ok"] for row in ar)
    assert {"bytes", "algbw_gbps", "busbw_gbps"} <= set(ar[0])
    assert [row["bytes"] for row in ar] == sorted(row["bytes"] for row in ar)
    assert len(rep["allgather"]) == len(ar) and all(row["ok"] for row in rep["allgather"])
    (node,) = rep["nodes"]
    assert node["torch"] and node["ray"] and node["deepspeed"] and "topology" in node
    assert rep["placement"]["bundle"] == {"CPU": 1.0}
    assert isinstance(rep["findings"], list)
    assert all({"category", "cause", "remedy"} <= set(f) for f in rep["findings"])


def test_bad_input_exits_2_with_one_message():
    r = subprocess.run([sys.executable, "-m", "rayspeed", "healthcheck", "--workers", "0"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--workers 0" in r.stderr and "Traceback" not in r.stderr


def test_size_arguments():
    assert parse_bytes("64K") == 65536 and parse_bytes("16M") == 16 << 20 and parse_bytes("4096") == 4096
    assert sizes_between(1024, 8192) == [1024, 2048, 4096, 8192]
    with pytest.raises(ConfigError):
        parse_bytes("lots")
