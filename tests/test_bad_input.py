"""Bad input is exit 2 with one message and no traceback, in every command that reads a job file, and nothing is
written."""

import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config.load import load, parse
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def _cli(*args, home):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAYSPEED_HOME": str(home), "PYTHONPATH": str(ROOT / "platform")}
    return subprocess.run([sys.executable, "-m", "rayspeed", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("bad", ["directory", "non-utf8"])
def test_every_command_says_what_is_wrong_with_the_job_file(tmp_path, bad):
    path = tmp_path / "job.yaml"
    if bad == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"name: x\nmodel: {hidden_size: 64}\n# caf\xe9 latin-1\n")
    for args in (["plan", str(path)], ["train", "--config", str(path)], ["healthcheck", "--config", str(path)],
                 ["doctor", "--env", "--config", str(path)], ["retrain", "--config", str(path)]):
        r = _cli(*args, home=tmp_path)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        expected = "is a directory" if bad == "directory" else "not UTF-8"
        assert expected in r.stderr + r.stdout, (args, r.stderr, r.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"], "nothing may be written"


def test_an_unwritable_storage_path_is_exit_2_not_a_permission_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for path in (str(blocker / "runs"), "/sys/rayspeed-test-runs"):
        r = _cli("train", "--config", TINY, "--set", f"storage.path={path}", "--launcher", "local", home=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("config error: storage.path:"), r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_job_name_must_match_whole():
    with pytest.raises(ConfigError, match="name:"):
        parse({"name": "abc\n"})
    assert parse({"name": "abc-1.2_x"}).name == "abc-1.2_x"


def test_lr_auto_keeps_the_rule_but_warns_outside_published_recipes_and_never_overrides_min_lr():
    from rayspeed.planner import plan_job, resolve

    one_b = str(ROOT / "configs" / "llama-1b-8xh100.yaml")
    res = plan_job(load(one_b))
    lr = res.rules["lr"]
    assert lr["applied"] and lr["lr"] < 1.5e-4 and "published recipes" in lr["warning"]
    assert "WARNING" in res.explain and "docs/PLANNER.md" in lr["warning"]
    cfg, _ = resolve(load(one_b))
    assert cfg.train.min_lr == pytest.approx(cfg.train.lr / 10)  # min_lr auto: lr / 10
    # A min_lr the user set above what the rule gives is a conflict, not something to lower silently.
    with pytest.raises(ConfigError, match="train.min_lr"):
        resolve(load(one_b, ["train.min_lr=3e-4"]))
    # An explicit lr is the user's: the rule is shown, not applied, and nothing is warned about.
    res = plan_job(load(one_b, ["train.lr=3e-4"]))
    assert not res.rules["lr"]["applied"] and "WARNING" not in res.explain


def test_activation_checkpointing_claims_only_what_is_applied():
    import json

    from rayspeed.planner import plan_job

    res = plan_job(load(str(ROOT / "configs" / "llama-70b-64xh100.yaml")))
    text = json.dumps(res.to_json())
    for claim in ('"contiguous_memory_optimization": true', '"partition_activations": true',
                  "contiguous_memory_optimization True"):
        assert claim not in text and claim not in res.explain
    assert "torch.utils.checkpoint" in res.rules["checkpointing"]["template"]


def test_shipped_configs_run_or_say_they_are_planning_examples(examples_home, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(examples_home[0]))
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        head = p.read_text().splitlines()[0]
        cfg = load(str(p))
        if cfg.cluster.use_gpu:
            assert head.startswith("# PLANNING EXAMPLE"), p.name
        else:
            assert cfg.data.source == "python-stdlib" or cfg.data.path, p.name
