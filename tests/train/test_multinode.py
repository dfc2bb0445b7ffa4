"""A real multi-host Ray cluster on this machine: three "hosts" in network namespaces made by the test itself
(tests/_netns.py: veth pairs to a bridge, 10.77.0.0/24, a hostname each), started with the commands of
docs/MULTINODE.md (`ray start --head` on the head, `ray start --address` on the workers, token auth on).

    head   10.77.0.1   GCS, dashboard, the driver (python jobs/train.py), Ray Train's controller; no trainer slots
    node1  10.77.0.2   2 CPUs, {"trainer": 2}
    node2  10.77.0.3   2 CPUs, {"trainer": 2}

1. `rayspeed healthcheck --workers 4` runs across node1 and node2 (gloo over the veths) and reports each
   rank's node and link bandwidth; the test prints the per-node figures.
2. The unchanged job file (configs/tiny-cpu.yaml, overrides on the command line only) trains with tp=2 inside
   each node and dp=2 across them (4 workers, elastic [2, 4]); the preflight measures the tp (intra-node) and
   dp (cross-node) groups. Mid-run the cable of the host of rank 0 is pulled (its switch port goes down: the
   host keeps running, unreachable). Ray declares the node dead, Ray Train restarts the group on the other
   host and the job finishes with tp=2, dp=1: resilience/world_size goes 4 -> 2 in MLflow, the summary says
   finished, the MLflow server (on the head) got metrics and artifacts from ranks on the worker hosts.

Traffic goes only to loopback and to the namespaces' own addresses; every namespace, process and file the
test creates is removed at the end, on failure too. Skipped (with the reason) when not root or when network
namespaces are unavailable. About 3-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _netns
from _cluster import ROOT, metric_history

pytestmark = pytest.mark.ray

VENV_BIN = Path(sys.executable).parent
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
GCS_PORT = 6379
DASHBOARD_PORT = 8265
MLFLOW_PORT = 5000
# Ray declares a node dead after health_check_failure_threshold missed checks, health_check_period_ms apart
# (defaults: about 30 s). Shorter here so the drill spends its time training, not waiting.
HEAD_SYSTEM_CONFIG = {"health_check_period_ms": 2000, "health_check_timeout_ms": 4000,
                      "health_check_failure_threshold": 4}


def _wait_for(pred, timeout, what, proc=None, log=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            tail = Path(log).read_text()[-4000:] if log else ""
            pytest.fail(f"{what}: the process exited ({proc.returncode}) first\n{tail}")
        time.sleep(0.5)
    tail = Path(log).read_text()[-4000:] if log else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")


class LabRayCluster:
    """`ray start --head` in the head namespace, `ray start --address` in each worker namespace."""

    def __init__(self, lab: _netns.NetnsLab, workdir: Path):
        self.lab = lab
        self.workdir = workdir
        self.temp_dir = f"/tmp/{lab.tag}"  # short: Ray's unix socket paths must stay under 107 characters
        self.address = f"{lab.ip['head']}:{GCS_PORT}"
        env = dict(os.environ, RAY_AUTH_MODE="token", PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   # Every worker inherits its raylet's environment: gloo binds the lab interface, as
                   # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME do on a real cluster with several NICs.
                   GLOO_SOCKET_IFNAME=_netns.IFNAME)
        for k in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_API_SERVER_ADDRESS"):
            env.pop(k, None)
        self.env = env

    def _ray_start(self, host: str, args: list[str]) -> None:
        log = self.workdir / f"ray-start-{host}.log"
        with open(log, "w") as fh:
            # Not --block: `ray start` returns once the node is registered; its daemons live on in the
            # namespace (and die with it).
            p = self.lab.popen(host, [str(VENV_BIN / "ray"), "start", *args, "--node-ip-address", self.lab.ip[host],
                                      "--temp-dir", self.temp_dir, "--object-store-memory", str(100 << 20),
                                      "--disable-usage-stats"],
                               env=self.env, stdout=fh, stderr=subprocess.STDOUT)
            try:
                rc = p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0:
            raise RuntimeError(f"ray start on {host} failed ({rc}):\n{log.read_text()[-3000:]}")

    def start(self) -> None:
        # The cluster's token, shared by every node (here: one filesystem); created if this machine has none.
        if not (Path.home() / ".ray" / "auth_token").exists():
            subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], env=self.env, check=True,
                           capture_output=True, timeout=120)
        self._ray_start("head", ["--head", "--port", str(GCS_PORT), "--num-cpus", "1",
                                 "--dashboard-host", "0.0.0.0", "--dashboard-port", str(DASHBOARD_PORT),
                                 "--system-config", json.dumps(HEAD_SYSTEM_CONFIG)])
        for host in ("node1", "node2"):
            # One at a time: the nodes share this machine's /tmp and pick their socket names in turn.
            self._ray_start(host, ["--address", self.address, "--num-cpus", "2",
                                   "--resources", json.dumps({"trainer": 2})])
        nodes = self.alive_nodes(expect=3)
        assert sorted(nodes) == ["10.77.0.1", "10.77.0.2", "10.77.0.3"], nodes
        # One MLflow server on the head that every node reaches (rank 0 may run on any node); its SQLite
        # store is read directly by the assertions (self.mlflow_home / "mlflow.db").
        self.mlflow_home = self.workdir / "mlflow"
        self.mlflow_home.mkdir()
        self.tracking_uri = f"http://{self.lab.ip['head']}:{MLFLOW_PORT}"
        with open(self.workdir / "mlflow-server.log", "w") as fh:
            self.lab.popen("head", [str(VENV_BIN / "mlflow"), "server", "--host", self.lab.ip["head"],
                                    "--port", str(MLFLOW_PORT), "--workers", "1",
                                    "--backend-store-uri", f"sqlite:///{self.mlflow_home / 'mlflow.db'}",
                                    "--artifacts-destination", str(self.mlflow_home / "artifacts")],
                           env=dict(self.env, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"), stdout=fh,
                           stderr=subprocess.STDOUT)
        r = self.run_in_head([sys.executable, str(ROOT / "scripts" / "wait_services.py"), "--mlflow",
                              self.tracking_uri, "--timeout", "180"], capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr + (self.workdir / "mlflow-server.log").read_text()[-3000:]

    def run_in_head(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        env = dict(self.env, RAY_ADDRESS=self.address, **kw.pop("env_extra", {}))
        return self.lab.run("head", cmd, env=env, **kw)

    def alive_nodes(self, expect: int | None = None, timeout: float = 120) -> list[str]:
        code = ("import json, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
                "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))")
        deadline = time.time() + timeout
        while True:
            r = self.run_in_head([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            nodes = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else []
            if expect is None or len(nodes) == expect or time.time() > deadline:
                return nodes
            time.sleep(2)

    def save_logs(self, dest: Path) -> None:
        src = Path(self.temp_dir) / "session_latest" / "logs"
        if src.is_dir():
            shutil.copytree(src, dest / "ray-logs", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("events", "export_events", "old", "*.pid"))

    def remove_files(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def remove_stale_files() -> None:
        """Ray temp dirs of earlier runs whose test process was killed before it could clean up."""
        for d in Path("/tmp").glob(f"{_netns.PREFIX}*"):
            pid = d.name[len(_netns.PREFIX):]
            if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def lab_cluster(tmp_path_factory):
    reason = _netns.available()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    work = tmp_path_factory.mktemp("multinode")
    LabRayCluster.remove_stale_files()
    with _netns.NetnsLab(["head", "node1", "node2"]) as lab:
        cluster = LabRayCluster(lab, work)
        try:
            cluster.start()
            yield cluster
        finally:
            lab.close()  # kills every process in the namespaces, removes them
            cluster.save_logs(work)
            cluster.remove_files()
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(lab.tag)], "namespaces left behind"


def _per_node(ranks: list[dict], key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in ranks:
        if r.get(key) is not None:
            out.setdefault(r["node"], []).append(float(r[key]))
    return out


def test_healthcheck_across_nodes(lab_cluster):
    r = lab_cluster.run_in_head(
        [sys.executable, "-m", "rayspeed", "healthcheck", "--workers", "4", "--json", "--cpu", "--config", TINY,
         "--set", "cluster.resources_per_worker={trainer: 1}", "--max-bytes", "1M", "--timeout", "180"],
        capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["cluster"]["nodes"] == 3 and rep["cluster"]["nodes_used"] == 2, rep["cluster"]
    ranks = rep["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1, 2, 3]
    # A node's ranks are consecutive (tp stays inside a node); two ranks on each worker host.
    assert [x["node"] for x in ranks] == ["10.77.0.2", "10.77.0.2", "10.77.0.3", "10.77.0.3"], ranks
    assert {x["host"] for x in ranks} == {"node1", "node2"}
    assert all(x["link_gbps"] > 0 for x in ranks)
    assert rep["allreduce"] and all(row["ok"] and row["busbw_gbps"] > 0 for row in rep["allreduce"])
    assert {n["ip"] for n in rep["nodes"]} == {"10.77.0.1", "10.77.0.2", "10.77.0.3"}
    # One entry per namespace node: the two worker hosts with their ranks and figures, the head without ranks.
    per_node = {n["node"]: n for n in rep["per_node"]}
    assert sorted(per_node) == ["10.77.0.1", "10.77.0.2", "10.77.0.3"], rep["per_node"]
    assert per_node["10.77.0.1"]["ranks"] == [] and per_node["10.77.0.1"]["link_gbps"] is None
    assert per_node["10.77.0.2"]["ranks"] == [0, 1] and per_node["10.77.0.3"]["ranks"] == [2, 3]
    for ip in ("10.77.0.2", "10.77.0.3"):
        n = per_node[ip]
        assert n["intra_busbw_gbps"] > 0 and n["link_gbps"] > 0 and n["cross_busbw_gbps"] > 0, n
    links = _per_node(ranks, "link_gbps")
    print("\nhealthcheck per node (link to the next rank, GB/s): "
          + "; ".join(f"{n}: {', '.join(f'{v:.3g}' for v in vs)}" for n, vs in sorted(links.items()))
          + f"; all-reduce busbw at {rep['allreduce'][-1]['bytes']} B over 2 nodes: "
          f"{rep['allreduce'][-1]['busbw_gbps']:.3g} GB/s")
    print("healthcheck per_node: " + "; ".join(
        f"{ip} ranks {n['ranks']} intra {n['intra_busbw_gbps']} link {n['link_gbps']} cross {n['cross_busbw_gbps']}"
        for ip, n in sorted(per_node.items()) if n["ranks"]))


def _progress(exp_dir: Path) -> int:
    try:
        return json.loads((exp_dir / ".resilience" / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_tp_in_node_dp_across_nodes_survives_a_cut_node(lab_cluster, tmp_path):
    shared = tmp_path / "shared"  # what every host sees: this machine's filesystem stands in for NFS
    storage = shared / "runs"
    name = "multinode"
    exp = storage / name
    log_path = tmp_path / "job.log"
    args = [sys.executable, str(ROOT / "jobs" / "train.py"), "--config", TINY,
            "--set", f"name={name}", "--set", f"storage.path={storage}",
            "--set", "cluster.num_workers=[2, 4]", "--set", "resilience.stability_threshold=0.5",
            "--set", "cluster.resources_per_worker={trainer: 1}",
            "--set", "cluster.cpus_per_worker=1", "--set", "cluster.gpus_per_node=2",
            "--set", "cluster.placement_strategy=PACK", "--set", "parallel.tp=2",
            "--set", "train.max_steps=120", "--set", "train.eval_every_steps=0",
            "--set", "resilience.checkpoint_every_steps=10", "--set", "resilience.elastic_monitor_interval_s=10",
            "--set", "resilience.worker_start_timeout_s=20", "--set", "resilience.collective_timeout_s=120",
            "--set", "tracking.log_every_steps=5", "--set", "tracking.loss_landscape=false"]
    env = dict(lab_cluster.env, RAY_ADDRESS=lab_cluster.address, RAYSPEED_HOME=str(shared),
               MLFLOW_TRACKING_URI=lab_cluster.tracking_uri)
    with open(log_path, "w") as log:
        proc = lab_cluster.lab.popen("head", args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    t0 = time.time()
    try:
        _wait_for(lambda: _progress(exp) >= 25, 360, "25 steps on 4 workers (2 nodes)", proc, log_path)
        t_train = time.time() - t0
        cut_at = _progress(exp)
        # Cut the host of rank 0 (the harder case: the rendezvous address and the MLflow logger go with it).
        m = re.search(r"\(ip=(10\.77\.0\.\d+), pid=\d+\) world_rank=0,", log_path.read_text())
        by_ip = {ip: host for host, ip in lab_cluster.lab.ip.items()}
        victim = by_ip.get(m.group(1), "node2") if m else "node2"
        survivor = "node1" if victim == "node2" else "node2"
        lab_cluster.lab.cut(victim)
        t_cut = time.time()
        _wait_for(lambda: _progress(exp) >= cut_at + 15 and "resumed from" in log_path.read_text(), 300,
                  f"training to continue on {survivor} after {victim} was cut off", proc, log_path)
        t_back = time.time()
        rc = proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text()
    assert rc == 0, out[-6000:]
    summary = json.loads((exp / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 120, summary
    assert summary["world_size"] == 2 and summary["layout"]["tp"] == 2 and summary["layout"]["dp"] == 1, summary
    rid = summary["mlflow_run_id"]
    world = [int(v) for _, v in metric_history(lab_cluster.mlflow_home, rid, "resilience/world_size")]
    phases = [w for i, w in enumerate(world) if i == 0 or world[i - 1] != w]
    assert phases[:2] == [4, 2], world
    assert {v for _, v in metric_history(lab_cluster.mlflow_home, rid, "train/global_batch_size")} == {16.0}
    # The preflight of the 4-worker attempt measured tp (inside a node) and dp (across the nodes).
    pre = re.search(r"preflight ok in [\d.]+ s: all-reduce busbw ([\d.e+-]+) GB/s at [^,]+ over 4 ranks, "
                    r"tp ([\d.e+-]+) GB/s, dp ([\d.e+-]+) GB/s", out)
    assert pre, "no preflight line for the 4-rank world in the job log"
    # ... and logged each node's figures (ranks 0,1 on one host, 2,3 on the other).
    node_lines = re.findall(r"preflight node (\S+): ranks ([\d,]+); intra-node all-reduce busbw ([\d.e+-]+) GB/s; "
                            r"link to the other nodes ([\d.e+-]+) GB/s", out)
    # (Ray's log stream can deliver a line twice when a node's log files are re-read after the cut.)
    per_node = {n: ranks for n, ranks, *_ in node_lines}
    assert sorted(per_node) == ["node1", "node2"], node_lines
    assert sorted(per_node.values()) == ["0,1", "2,3"], node_lines
    # Artifacts travel through the MLflow server too (rank 0 ran on a worker host, the store is on the head).
    assert list((lab_cluster.mlflow_home / "artifacts").rglob("preflight.json")), "no health/preflight.json artifact"
    recov = [v for _, v in metric_history(lab_cluster.mlflow_home, rid, "resilience/recovery_s")]
    print(f"\nmultinode drill: 4 workers on 2 nodes reached step {cut_at} in {t_train:.0f} s; {victim} (rank 0) "
          f"cut off, training again on {survivor} (tp2 dp1) {t_back - t_cut:.0f} s later; recovery_s {recov[:1]}; "
          f"preflight world busbw {pre.group(1)} GB/s, tp (intra-node) {pre.group(2)} GB/s, "
          f"dp (cross-node) {pre.group(3)} GB/s; total {time.time() - t0:.0f} s")
