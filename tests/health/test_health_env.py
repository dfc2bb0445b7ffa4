"""Environment profiles by cluster size and the env lint (and the knowledge file they read)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config.load import load
from rayspeed.config.schema import JobConfig
from rayspeed.errors import ConfigError
from rayspeed.health.envprofile import env_profile, errors, lint_env, profile
from rayspeed.health.knowledge import CATEGORIES, parse
from rayspeed.health.knowledge import load as load_kb

ROOT = Path(__file__).resolve().parents[2]


def _gpu_job(**cluster):
    cfg = load(str(ROOT / "configs" / "llama-1b-8xh100.yaml"), [])
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **cluster))


@pytest.mark.parametrize("world,expect", [
    (8, {}),
    (16, {}),  # the field guide's Tree is set only when the time model finds it faster: not here
    (64, {}),
    (128, {}),
    (200, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}),
    (512, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_CROSS_NIC": "0"}),
])
def test_profile_follows_the_communication_rule(world, expect):
    assert env_profile(_gpu_job(), world) == expect


def test_profile_matches_the_planners_rule_and_lints_clean_at_every_size():
    from rayspeed.planner import plan_job

    for world in (8, 16, 64, 128, 256, 512):
        cfg = _gpu_job()
        assert env_profile(cfg, world) == plan_job(cfg, world).best["env"]
        assert errors(lint_env(env_profile(cfg, world), production=True, world_size=world)) == []


def test_cpu_jobs_get_no_nccl_variables():
    prof = profile(JobConfig(), 2)
    assert prof["env"] == {} and prof["backend"] == "gloo"


def test_cluster_env_is_added_and_wins():
    cfg = _gpu_job(env={"NCCL_CROSS_NIC": "1", "NCCL_SOCKET_IFNAME": "eth0"})
    prof = profile(cfg, 512)
    assert prof["env"] == {"NCCL_CROSS_NIC": "1", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert prof["overridden"] == ["NCCL_CROSS_NIC"]


def test_cluster_env_is_a_job_key():
    cfg = load(str(ROOT / "configs" / "tiny-cpu.yaml"), ['cluster.env={NCCL_DEBUG: WARN}'])
    assert cfg.cluster.env == {"NCCL_DEBUG": "WARN"}
    with pytest.raises(ConfigError, match="cluster.env"):
        load(str(ROOT / "configs" / "tiny-cpu.yaml"), ["cluster.env=[1, 2]"])


@pytest.mark.parametrize("name,value,use", [
    ("NCCL_SOCKET_TIMEOUT", "600", "collective_timeout_s"),
    ("NCCL_TIMEOUT", "1800", "collective_timeout_s"),
    ("NCCL_MAX_NTHREADS", "512", "NCCL_NTHREADS"),
    ("NCCL_ASYNC_ERROR_HANDLING", "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("NCCL_BLOCKING_WAIT", "1", "TORCH_NCCL_BLOCKING_WAIT"),
    ("NCCL_DEBUG", "INFO", "NCCL_DEBUG=WARN"),
    ("NCCL_DEBUG", "TRACE", "NCCL_DEBUG=WARN"),
    ("NCCL_P2P_DISABLE", "1", "communication_data_type"),
    ("CUDA_LAUNCH_BLOCKING", "1", "unset"),
])
def test_lint_rejects_with_the_real_replacement(name, value, use):
    (f,) = lint_env({name: value})
    assert f.severity == "error" and f.category == "env_invalid"
    assert f.extra["variable"] == name and use in f.remedy
    assert f.source


def test_lint_accepts_real_settings_and_ignores_other_variables():
    env = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_NTHREADS": "256", "NCCL_ALGO": "Tree",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "HOME": "/root", "PATH": "/bin"}
    assert lint_env(env) == []


@pytest.mark.parametrize("name,value,says", [
    ("NCCL_ALGO", "Trees", "did you mean Tree?"), ("NCCL_NTHREADS", "1000", "one of 64, 128, 256, 512"),
    ("NCCL_PROTO", "LL,Fast", "LL, LL128, Simple"), ("NCCL_DEBUG", "WARNING", "did you mean WARN?"),
    ("NCCL_BUFFSIZE", "4MB", "must be an integer"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "yes", "0, 1, 2, 3"),
])
def test_lint_checks_values_not_only_names(name, value, says):
    (f,) = lint_env({name: value})
    assert f.severity == "error" and says in f.cause and f.remedy.startswith("fix the value"), f


def test_remedies_read_as_instructions():
    (f,) = lint_env({"CUDA_LAUNCH_BLOCKING": "1"})
    assert not f.remedy.startswith("use unset") and f.remedy.startswith("unset it")
    assert lint_env({"NCCL_ALGO": "^Ring,nvls", "NCCL_PROTO": "Simple", "NCCL_NTHREADS": "512"}) == []
    # NCCL reads an empty value as unset; NCCL 2.24+ takes per-collective lists
    assert lint_env({"NCCL_DEBUG": "", "NCCL_ALGO": "allreduce:tree;allgather:ring"}) == []
    assert lint_env({"NCCL_ALGO": "allreduce:trees"})[0].cause.startswith("NCCL_ALGO=allreduce:trees: not a value")


def test_debug_knobs_are_information_outside_production():
    (f,) = lint_env({"NCCL_DEBUG": "INFO"}, production=False)
    assert f.severity == "info"
    # an invented variable is wrong in any mode
    assert lint_env({"NCCL_SOCKET_TIMEOUT": "1"}, production=False)[0].severity == "error"


def test_typos_and_allocator_options():
    (f,) = lint_env({"NCCL_SOCKET_IFNAM": "eth0"})
    assert f.severity == "warn" and f.extra["use"] == "NCCL_SOCKET_IFNAME"
    (f,) = lint_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segment:True,max_split_size_mb:128"})
    assert f.severity == "error" and f.extra["use"] == "expandable_segments"


def test_async_error_handling_off_is_an_error_only_above_128_gpus():
    assert lint_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, world_size=64)[0].severity == "warn"
    assert lint_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, world_size=256)[0].severity == "error"


def test_knowledge_file_is_complete():
    kb = load_kb()
    cats = {e.category for e in kb.entries}
    for c in ("nccl_timeout", "oom", "nan_loss", "hang", "slow_throughput", "checkpoint_corrupt", "env_invalid"):
        assert c in cats
    for e in kb.entries:
        assert e.category in CATEGORIES and e.cause and e.remedy and e.source and (e.signature or e.detector)
    with pytest.raises(ValueError, match="missing"):
        parse("findings:\n  - id: x\n    category: oom\n")
    with pytest.raises(ValueError, match="needs `use`"):
        parse("env:\n  NCCL_FOO: {status: invented}\n")


def _doctor(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "rayspeed", "doctor", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=_env())


def _env():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "CUDA_LAUNCH"))}
    env["PYTHONPATH"] = str(ROOT / "platform")
    return env


def test_doctor_env_cli_rejects_invented_variables():
    r = _doctor("--env", "-", "--json", stdin="export NCCL_SOCKET_TIMEOUT=600\nNCCL_MAX_NTHREADS=64\nHOME=/x\n")
    assert r.returncode == 1, r.stderr
    found = {f["variable"]: f for f in json.loads(r.stdout)["findings"]}
    assert set(found) == {"NCCL_SOCKET_TIMEOUT", "NCCL_MAX_NTHREADS"}
    assert found["NCCL_MAX_NTHREADS"]["use"] == "NCCL_NTHREADS"
    r = _doctor("--env", "-", stdin="NCCL_DEBUG=WARN\n")
    assert r.returncode == 0 and "nothing found" in r.stdout


def test_doctor_env_with_a_job_lints_its_profile():
    r = _doctor("--env", "--json", "--config", "configs/llama-70b-64xh100.yaml", "--set",
                'cluster.env={NCCL_P2P_DISABLE: "1"}')
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert "NCCL_ALGO" not in out["env_profile"]["env"]  # 64 GPUs: the model keeps NCCL's own per-call choice
    assert [f["variable"] for f in out["findings"]] == ["NCCL_P2P_DISABLE"]


def test_config_problems_name_the_key_and_the_fix():
    from rayspeed.config.validate import health_problems as problems

    assert problems(JobConfig()) == []
    bad = ['cluster.env={NCCL_SOCKET_TIMEOUT: "600", NCCL_DEBUG: WARN}', "health.grad_norm_spike_factor=1",
           "health.slow_rank_factor=2"]
    cfg = load(str(ROOT / "configs" / "tiny-cpu.yaml"))
    cfg = dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, env={"NCCL_SOCKET_TIMEOUT": "600", "NCCL_DEBUG": "WARN"}),
        health=dataclasses.replace(cfg.health, grad_norm_spike_factor=1.0, slow_rank_factor=2.0))
    found = problems(cfg)
    assert len(found) == 3
    # Every command loads the job through the same checks: the same three problems stop it there.
    with pytest.raises(ConfigError) as e:
        load(str(ROOT / "configs" / "tiny-cpu.yaml"), bad)
    assert e.value.problems == found
    assert any(p.startswith("cluster.env.NCCL_SOCKET_TIMEOUT:") and "collective_timeout_s" in p for p in found)
    assert any(p.startswith("health.grad_norm_spike_factor") for p in found)


def test_a_log_that_only_quotes_an_oom_in_an_info_line_is_no_oom():
    from rayspeed.health.diagnosis import diagnose

    quoted = ["2026-12-01 10:00:00,123\tINFO worker.py:88 -- retry policy: on 'CUDA out of memory' lower micro-batch",
              "2026/12/01 10:00:01 INFO mlflow.tracking: note: torch.OutOfMemoryError is reported as failed",
              '{"name": "x", "status": "finished", "steps": 10}']
    assert [f.id for f in diagnose("\n".join(quoted))] == []
    real = quoted + ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.3 GiB total)"]
    assert [f.id for f in diagnose("\n".join(real))][0] == "cuda_oom"
