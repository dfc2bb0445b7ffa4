"""`rayspeed doctor` on sample logs of each category (tests/fixtures/logs)."""

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayspeed.cli import main as _cli
from rayspeed.config.load import load
from rayspeed.errors import ConfigError
from rayspeed.health import doctor


def _doctor_cli(argv):
    return _cli(["doctor", *argv])

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "fixtures" / "logs"


def _diagnose(name, **kw):
    return doctor.diagnose((LOGS / name).read_text(), log_dir=LOGS, **kw)


@pytest.mark.parametrize("log,category,remedy", [
    ("nccl_timeout.log", "nccl_timeout", "resilience.collective_timeout_s"),
    ("oom.log", "oom", "parallel.zero_stage"),
    ("oom_fragmentation.log", "oom", "expandable_segments:True"),
    ("nan_loss.log", "nan_loss", "health.watchdog"),
    ("grad_explosion.log", "grad_explosion", "health.watchdog"),
    ("hang.log", "hang", "NCCL_NTHREADS"),
    ("slow_throughput.log", "slow_throughput", "numactl"),
    ("checkpoint_corrupt.log", "checkpoint_corrupt", "storage.path"),
    ("env_invalid.log", "env_invalid", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
])
def test_each_sample_log_gets_its_category_first_with_a_remedy(log, category, remedy):
    found = _diagnose(log)
    assert found, f"nothing found in {log}"
    assert found[0].category == category, [(f.category, f.id) for f in found]
    assert {f.category for f in found} == {category}, [(f.category, f.id) for f in found]
    assert any(remedy in f.remedy for f in found), [f.remedy for f in found]
    assert all(f.cause and f.source and f.evidence for f in found)


def test_a_healthy_log_has_no_findings():
    assert _diagnose("healthy.log") == []


def test_env_invalid_names_each_variable_once_with_its_replacement():
    found = {f.extra["variable"]: f for f in _diagnose("env_invalid.log")}
    assert set(found) == {"NCCL_SOCKET_TIMEOUT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_MAX_NTHREADS", "NCCL_DEBUG"}
    assert found["NCCL_MAX_NTHREADS"].extra["use"] == "NCCL_NTHREADS"
    assert "collective_timeout_s" in found["NCCL_SOCKET_TIMEOUT"].remedy
    assert found["NCCL_SOCKET_TIMEOUT"].evidence[0].startswith("line 1:")


def test_prose_that_mentions_a_variable_is_not_a_setting():
    # PyTorch's messages say "(TORCH_NCCL_ENABLE_MONITORING=0)" and "run with NCCL_DEBUG=INFO": not the job's env
    text = ("[rank0]: ... disable the heartbeat monitor (TORCH_NCCL_ENABLE_MONITORING=0).\n"
            "NCCL error in: x.cpp:1, unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n")
    assert doctor.env_from_log(text.splitlines()) == {}
    assert doctor.env_from_log(["(pid=1) [rayspeed rank 0] env profile for 16 workers, 8-64 GPUs: NCCL_ALGO=Tree",
                                "runtime_env={'env_vars': {'NCCL_TIMEOUT': '60'}}",
                                "NCCL_SOCKET_TIMEOUT=5 python train.py"]) == {
        "NCCL_ALGO": ("Tree", 0), "NCCL_TIMEOUT": ("60", 1), "NCCL_SOCKET_TIMEOUT": ("5", 2)}


def test_oom_gets_the_planners_view_from_the_config_in_the_log():
    (f,) = _diagnose("oom.log")
    view = f.extra["planner"]
    assert view["ran"]["zero_stage"] == 0 and view["ran"]["fits"] is False
    assert view["best"]["fits"] is True and view["best"]["memory_gib_per_gpu"] < view["ran"]["memory_gib_per_gpu"]
    assert "not fragmentation" in f.cause and "step 1" in f.remedy
    # the same advice from an explicit --config, with a log that does not name it
    text = (LOGS / "oom.log").read_text().replace("--config configs/llama-7b-16xh200.yaml", "")
    cfg = load(str(ROOT / "configs" / "llama-7b-16xh200.yaml"), [])
    (f,) = doctor.diagnose(text, cfg=cfg)
    assert f.extra["planner"]["best"]["fits"] is True


def test_the_plan_line_with_every_degree_is_read_as_the_older_one():
    old = (LOGS / "oom.log").read_text()
    new = old.replace("plan: dp=16 tp=1 pp=1 zero=0", "plan: dp=8 cp=2 tp=1 pp=1 ep=1 zero=0")
    assert new != old
    ran_old, ran_new = (_only(doctor.diagnose(text)).extra["planner"]["ran"] for text in (old, new))
    assert (ran_old["dp"], ran_old["cp"]) == (16, 1) and (ran_new["dp"], ran_new["cp"], ran_new["ep"]) == (8, 2, 1)


def _only(findings):
    (f,) = findings
    return f


def test_fragmentation_is_told_apart():
    (f,) = _diagnose("oom_fragmentation.log")
    assert f.cause.startswith("fragmentation") and f.extra["oom"]["reserved_unallocated_gib"] == pytest.approx(11.1)


def test_throughput_and_grad_norm_detectors():
    series = [(i, v) for i, v in enumerate([5, 10, 10, 11, 10, 10, 10, 10, 10])]
    assert doctor.throughput_drop(series) is None
    drop = doctor.throughput_drop(series[:5] + [(i, 5.0) for i in range(5, 11)])
    assert drop and drop["sustained"]
    lines = [f"grad_norm: {v}" for v in (1.0, 1.1, 0.9, 1.0, 30.0, 1.0)]
    assert [i for i, _, _ in doctor.grad_norm_spikes(lines)] == [4]


@pytest.mark.ray
def test_job_id_reads_the_ray_jobs_api(ray_head, monkeypatch):
    """A real job on the session's Ray head prints a sample log; the doctor reads it back by id through Ray's own
    JobSubmissionClient at the dashboard address a user passes with --address."""
    from ray.dashboard.utils import get_address_for_submission_client
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Both would override the address the doctor is given (Ray reads them first).
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    dashboard = get_address_for_submission_client(ray_head.address)
    client = JobSubmissionClient(dashboard)
    job_id = client.submit_job(entrypoint=f"cat {LOGS / 'nan_loss.log'}")
    deadline = time.time() + 60
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.time() < deadline, f"job {job_id} still {status} after 60 s"
        time.sleep(0.5)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)[-2000:]
    text, source = doctor.read_source(job_id, address=dashboard)
    # The driver log is the job's output beside Ray's own lines about setting the job up (Ray may write its
    # "Running entrypoint" line after the output: seen once in a loaded CI run).
    assert source == f"ray job {job_id}" and (LOGS / "nan_loss.log").read_text() in text
    assert doctor.diagnose(text)[0].category == "nan_loss"
    with pytest.raises(ConfigError, match=f"the Ray Jobs API at {dashboard} has no such job"):
        doctor.read_source("raysubmit_NoSuchJob0", address=dashboard)
    with pytest.raises(ConfigError, match="no such file"):
        doctor.read_source("missing/file.log")


def test_stdin_and_exit_codes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO((LOGS / "hang.log").read_text()))
    assert _doctor_cli(["-", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0]["category"] == "hang" and {"category", "cause", "remedy"} <= set(out["findings"][0])
    assert _doctor_cli([str(LOGS / "healthy.log")]) == 0
    assert "nothing found" in capsys.readouterr().out
    assert _doctor_cli([str(LOGS / "slow_throughput.log")]) == 0  # a warning is not an error
    assert _doctor_cli([]) == 2
    assert _doctor_cli(["/no/such.log"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_console_script():
    r = subprocess.run([sys.executable, "-m", "rayspeed", "doctor", str(LOGS / "nccl_timeout.log"), "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["findings"][0]["category"] == "nccl_timeout"
