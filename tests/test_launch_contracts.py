"""Contracts of the launch under bad input (issue: exit 2 before anything is written, the dry run checks what the
launch checks, secrets masked in errors). In-process through the CLI's entry point: a subprocess proves nothing
more here (tests/test_bad_input.py keeps the subprocess cases for "no traceback, nothing written")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from rayspeed.cli import main
from rayspeed.config.load import load, parse
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("RAYSPEED_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return home


def _train(capsys, *args):
    rc = main(["train", "--config", TINY, *args], prog="jobs/train.py")
    out = capsys.readouterr()
    return rc, out.out, out.err


def _nothing_written(home: Path, tmp: Path) -> None:
    assert list(home.iterdir()) == [], sorted(p.name for p in home.iterdir())
    assert not (tmp / "cache").exists()


@pytest.mark.parametrize("sets, key", [
    (["train.init_from=/no/such/export"], "train.init_from: /no/such/export: no such directory"),
    (["train.init_from=models:/rayspeed-nope@champion"], "no version of 'rayspeed-nope' carries the alias"),
    (["train.init_from=models:/rayspeed-nope/3"], "'rayspeed-nope' has no version 3"),
    (["cluster.use_gpu=true", "--launcher", "local"], "cluster.use_gpu: true, but this machine has no GPU"),
    (["cluster.use_gpu=true"], "cluster.use_gpu: true, but the Ray cluster started here"),
    (["tracking.uri=nonsense://x"], "tracking.uri: 'nonsense://x': MLflow has no store for nonsense://"),
    (["storage.path=/proc/rayspeed-runs"], "storage.path:"),
    (["data.source=files", "data.path=/no/such/*.jsonl"], "data.path: no files match '/no/such/*.jsonl'"),
    (["data.source=tokens", "data.path=/no/such/*.rstok"], "data.path: no files match '/no/such/*.rstok'"),
    (["data.cache_dir=relative/cache"], "data.cache_dir: must be an absolute local path"),
])
def test_launch_and_dry_run_exit_2_before_anything_is_written(home, tmp_path, capsys, sets, key):
    args = []
    for s in sets:
        args += [s] if s.startswith("--") or args and args[-1] == "--launcher" else ["--set", s]
    for dry in ([], ["--dry-run"]):
        rc, out, err = _train(capsys, *args, *dry)
        assert rc == 2, (dry, out, err)
        assert key in err and "Traceback" not in err, (dry, err)
        _nothing_written(home, tmp_path)


def test_the_dry_run_reports_every_problem_at_once(home, tmp_path, capsys):
    rc, _, err = _train(capsys, "--dry-run", "--set", "data.source=files", "--set", "data.path=/no/such/*.txt",
                        "--set", f"data.tokenizer={tmp_path}/no-tokenizer", "--set", "tracking.uri=nonsense://x")
    assert rc == 2 and err.startswith("config error: 3 problems"), err
    for key in ("data.path:", "data.tokenizer:", "tracking.uri:"):
        assert f"  - {key}" in err, err
    _nothing_written(home, tmp_path)


def test_a_dry_run_of_a_good_job_passes_and_warmup_past_max_steps_is_a_warning(home, tmp_path, capsys):
    rc, out, err = _train(capsys, "--dry-run", "--set", "train.max_steps=3", "--set", "train.warmup_steps=10")
    assert rc == 0, err
    assert "name: tiny-cpu" in out
    (warning,) = [line for line in err.splitlines() if "warmup_steps" in line]
    assert "train.warmup_steps (10) is longer than train.max_steps (3)" in warning
    _nothing_written(home, tmp_path)


def test_a_dry_run_says_the_tracking_server_does_not_answer(home, tmp_path, capsys):
    rc, out, err = _train(capsys, "--dry-run", "--set", "tracking.uri=http://127.0.0.1:9")  # discard port
    assert rc == 0, err  # not a problem: a launch trains and tracking waits for the server
    (line,) = [x for x in err.splitlines() if "does not answer" in x]
    assert "tracking: the MLflow server at http://127.0.0.1:9 does not answer" in line
    _nothing_written(home, tmp_path)


def test_config_errors_on_the_command_line_are_masked(home, tmp_path, capsys):
    for sets, secret in ((["storage.path=ftp://u:Sup3rSecretPW@host/x"], "Sup3rSecretPW"),
                         (["storage.path=s3://AKIAKEYID0:Sup3rSecretPW@minio:9/b"], "Sup3rSecretPW"),
                         (["cluster.env={HF_TOKEN: [hf_Sup3rSecretPW]}"], "hf_Sup3rSecretPW")):
        rc, out, err = _train(capsys, *[x for s in sets for x in ("--set", s)])
        assert rc == 2 and secret not in err and secret not in out, err
        assert "AKIAKEYID0" not in err
    _nothing_written(home, tmp_path)


@pytest.mark.parametrize("key, value", [
    ("train.lr", math.nan), ("train.lr", math.inf), ("train.lr", "1e400"), ("train.adam_beta1", 1.5),
    ("train.adam_beta2", -0.1), ("train.weight_decay", -0.1), ("model.init_std", -0.02), ("model.rope_theta", -1.0),
    ("train.grad_clip", -1.0), ("train.eval_every_steps", -5), ("tracking.charts_every_checkpoints", -1),
    ("train.seed", -1), ("model.norm_eps", 0.0), ("resilience.elastic_monitor_interval_s", 0.0),
])
def test_numbers_out_of_range_name_their_key(key, value):
    section, name = key.split(".")
    raw = yaml.safe_load(f"{name}: {value}") if isinstance(value, str) else {name: value}
    with pytest.raises(ConfigError) as e:
        parse({section: raw})
    assert e.value.problems[0].startswith(f"{key}: must be"), e.value.problems


@pytest.mark.parametrize("name", ["a/b", "team:model", ""])
def test_registered_model_names_follow_mlflows_rule(name):
    with pytest.raises(ConfigError, match="tracking.register_model"):
        parse({"tracking": {"register_model": name}})


@pytest.mark.parametrize("name, says", [
    (".git", "must start with an ASCII letter or digit"), ("-rf", "must start with an ASCII letter or digit"),
    ("café", "may hold only ASCII letters"), ("x" * 256, "bytes; at most"),
    ("run.superseded-20261201-093000", "set aside by --fresh"),
])
def test_job_names(name, says):
    with pytest.raises(ConfigError) as e:
        parse({"name": name})
    assert says in e.value.render(), e.value.render()


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n\n"])
def test_an_empty_job_file_is_not_the_default_job(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="the job file is empty"):
        load(str(p))


def test_init_pretrained_without_a_model_is_exit_2(tmp_path, home, capsys):
    p = tmp_path / "job.yaml"
    p.write_text("name: x\nmodel: {init: pretrained}\n")
    with pytest.raises(ConfigError, match="model.init: pretrained needs model.pretrained"):
        load(str(p))
    with pytest.raises(ConfigError, match="model.init: pretrained needs model.pretrained"):
        load(TINY, ["model.init=pretrained"])
    rc, _, err = _train(capsys, "--set", "model.init=pretrained")
    assert rc == 2 and "model.init" in err
    assert load(TINY).model.init == "pretrained"  # the default, unset: a random model of the shape given


def test_a_hub_id_without_network_says_so_at_once(home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: like a machine without network
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    rc = main(["plan", TINY, "--set", "model.pretrained=tiny-org/tiny-model"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err  # one line: no retry chatter
    assert "not in the local Hugging Face cache, and the hub cannot be reached (127.0.0.1:" in err
    assert "HF_HUB_OFFLINE=1" in err and "local model directory" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["plan", TINY, "--set", "model.pretrained=tiny-org/tiny-model"])
    err = capsys.readouterr().err
    assert rc == 2 and "HF_HUB_OFFLINE is set" in err, err


def _nine_heads(**parallel):
    return parse({"name": "nine", "model": {"hidden_size": 72, "num_layers": 2, "num_heads": 9, "num_kv_heads": 3,
                                            "ffn_hidden_size": 192, "vocab_size": 258, "seq_len": 256},
                  "train": {"global_batch_size": 3}, "cluster": {"num_workers": 3},
                  "parallel": {"tp": 3, **parallel}})


def test_a_tp_that_does_not_split_the_sequence_plans_without_sequence_parallelism():
    from rayspeed.config.shape import ModelShape
    from rayspeed.config.validate import shape_split_problems
    from rayspeed.planner import plan_job, resolve

    cfg, plan = resolve(_nine_heads(), world_size=3)
    assert cfg.parallel.tp == 3 and cfg.parallel.sequence_parallel is False
    assert "model.seq_len (256) does not divide by tp (3)" in plan_job(_nine_heads()).explain
    # what the workers' model builder checks is what the planner checked
    assert shape_split_problems(ModelShape.from_config(cfg.model), 3, cfg.parallel.sequence_parallel) == []
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: true splits each sequence"):
        _nine_heads(sequence_parallel=True)


def test_a_dumped_random_init_config_loads_again(tmp_path):
    from rayspeed.config.load import to_yaml

    p = tmp_path / "resolved.yaml"
    p.write_text(to_yaml(load(TINY)))
    assert load(str(p)).model.init == "pretrained" and load(str(p)).model.pretrained is None
