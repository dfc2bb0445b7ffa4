"""Config loading: types, unknown keys, overrides, cross-field checks, and the CLI's exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayspeed.config import describe_keys, flatten, load, parse, to_dict
from rayspeed.config.chaos_keys import KillAt, OomAt
from rayspeed.config.schema import JobConfig
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
EXAMPLE = ROOT / "configs" / "job.example.yaml"


def problems(data=None, overrides=()):
    with pytest.raises(ConfigError) as ei:
        parse(data if data is not None else {}, list(overrides))
    return ei.value.problems


def test_tiny_cpu_loads_and_is_typed():
    cfg = load(TINY)
    assert cfg.name == "tiny-cpu"
    assert cfg.model.hidden_size == 64 and cfg.model.num_kv_heads == 2
    assert cfg.parallel.tp == "auto"
    assert cfg.cluster.num_workers == 2 and not cfg.cluster.elastic


def test_interface_example_loads():
    cfg = load(str(EXAMPLE))
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.chaos.kill_rank_at_step is None


def test_every_config_in_repo_loads(examples_home, monkeypatch):
    # The shipped examples' inputs as `make examples` makes them, in a launch home of the test's own.
    monkeypatch.setenv("RAYSPEED_HOME", str(examples_home[0]))
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        load(str(p))


def test_a_shipped_config_whose_inputs_are_not_made_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as e:
        load(str(ROOT / "configs" / "tiny-chat-finetune-cpu.yaml"))
    msg = str(e.value)
    assert f"model.pretrained: {tmp_path}/runs/examples/tiny-chat/model: no such directory" in msg
    assert "`make examples`" in msg


def test_relative_inputs_are_anchored_at_the_launch_home(examples_home, monkeypatch, tmp_path):
    home, made = examples_home
    monkeypatch.setenv("RAYSPEED_HOME", str(home))
    monkeypatch.chdir(tmp_path)  # the driver under `ray job submit --working-dir` runs from a temporary copy
    cfg = load(str(ROOT / "configs" / "tiny-chat-finetune-cpu.yaml"))
    assert cfg.model.pretrained == made["model"]
    assert cfg.data.path == f"{made['chats']}/*.jsonl"
    monkeypatch.delenv("RAYSPEED_HOME")
    cfg = parse({"data": {"source": "files", "path": ["./a/*.txt", "/abs/b.txt", "c.txt"]}})
    assert cfg.data.path == [f"{tmp_path}/a/*.txt", "/abs/b.txt", "c.txt"]


def test_unknown_key_names_the_dotted_key_and_suggests():
    (p,) = problems({"model": {"hiden_size": 3}})
    assert p.startswith("model.hiden_size: unknown key") and "model.hidden_size" in p


def test_unknown_section_lists_allowed():
    (p,) = problems({"modle": {}})
    assert "modle" in p and "'model'" in p


def test_wrong_types_are_all_reported_together():
    ps = problems({"train": {"lr": "fast", "max_steps": 1.5}, "cluster": {"use_gpu": "yes"}})
    assert len(ps) == 3
    assert any(p.startswith("train.lr: expected float | auto") for p in ps)
    assert any(p.startswith("train.max_steps: expected int") for p in ps)
    assert any(p.startswith("cluster.use_gpu: expected bool") for p in ps)


def test_bool_is_not_an_int():
    (p,) = problems({"train": {"max_steps": True}})
    assert "train.max_steps" in p


def test_literal_values_listed():
    (p,) = problems({"parallel": {"activation_checkpointing": "some"}})
    assert "auto | none | selective | full" in p


def test_set_overrides_are_yaml():
    cfg = parse({}, ["cluster.num_workers=[1, 2]", "chaos.kill_rank_at_step={rank: 1, step: 12}", "train.lr=auto",
                     "parallel.tp=2", "model.num_heads=4"])
    assert cfg.cluster.num_workers == [1, 2] and cfg.cluster.elastic
    assert cfg.chaos.kill_rank_at_step == KillAt(rank=1, step=12)
    assert cfg.train.lr == "auto" and cfg.parallel.tp == 2


def test_checkpoint_kill_drills_take_one_or_a_list_with_distinct_steps():
    one = parse({}, ["chaos.kill_rank_in_checkpoint={rank: 1, step: 8, point: after_shards}"])
    assert one.chaos.kill_rank_in_checkpoint == KillAt(rank=1, step=8, point="after_shards")
    many = parse({}, ["chaos.kill_rank_in_checkpoint=[{rank: 1, step: 8}, {rank: 0, step: 12, point: before_shards}]"])
    assert many.chaos.kill_rank_in_checkpoint == [KillAt(1, 8), KillAt(0, 12, "before_shards")]
    (p,) = problems({"chaos": {"kill_rank_in_checkpoint": [{"rank": 1, "step": 8}, {"rank": 0, "step": 8}]}})
    assert p == "chaos.kill_rank_in_checkpoint: each drill of the list needs its own step, got steps [8, 8]"
    (p,) = problems({"chaos": {"kill_rank_in_checkpoint": [{"rank": 1, "step": 8}, {"rank": 7, "step": 9}]}})
    assert p.startswith("chaos.kill_rank_in_checkpoint: rank 7 does not exist")


def test_the_out_of_memory_drill_and_its_budget():
    cfg = parse({}, ["chaos.oom_at_step={rank: 1, step: 3, attempts: all}"])
    assert cfg.chaos.oom_at_step == OomAt(rank=1, step=3, attempts="all") and cfg.resilience.oom_replans == 2
    assert parse({}, ["chaos.oom_at_step={rank: 0, step: 3}"]).chaos.oom_at_step.attempts == 1
    (p,) = problems({"resilience": {"oom_replans": -1}})
    assert p.startswith("resilience.oom_replans: must be >= 0")
    (p,) = problems({"chaos": {"oom_at_step": {"rank": 9, "step": 3}}})
    assert p.startswith("chaos.oom_at_step: rank 9 does not exist")


def test_yaml_11_exponent_floats_are_numbers():
    assert parse({}, ["train.lr=1e-4"]).train.lr == 1e-4
    assert parse({"train": {"min_lr": "3e-5"}}).train.min_lr == 3e-5


def test_set_unknown_and_malformed():
    ps = problems({}, ["train.max_stepz=3", "nonsense", "train.lr=[1,", "train.max_steps.x=1"])
    assert len(ps) == 4
    assert "did you mean 'train.max_steps'" in ps[0]
    assert "KEY=VALUE" in ps[1]
    assert "not valid YAML" in ps[2]
    assert "is a value, not a section" in ps[3]


def test_cross_field_checks_collected():
    ps = problems(
        {"model": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 3},
         "parallel": {"tp": 8, "pp": 2, "zero_stage": 3},
         "resilience": {"keep_checkpoints": 1}}
    )
    text = "\n".join(ps)
    assert "model.num_kv_heads (3) must be >= 1 and divide model.num_heads (4)" in text
    assert "parallel.tp (8) must divide model.num_heads" in text
    assert "parallel.zero_stage (3) with parallel.pp (2)" in text
    assert "resilience.keep_checkpoints: never fewer than 2" in text
    assert len(ps) >= 4


def test_storage_path_must_be_absolute_and_name_safe():
    ps = problems({"name": "a b", "storage": {"path": "relative/dir"}})
    assert any(p.startswith("name:") for p in ps)
    assert any(p.startswith("storage.path: must be absolute") for p in ps)
    parse({"storage": {"path": "s3://bucket/x"}})


def test_yaml_syntax_error_has_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nmodel:\n  hidden_size: [1\n")
    with pytest.raises(ConfigError) as ei:
        load(str(f))
    assert "YAML syntax error at line" in ei.value.render()


def test_missing_file():
    with pytest.raises(ConfigError) as ei:
        load("/nonexistent/job.yaml")
    assert "no such file" in ei.value.render()


def test_every_field_is_documented():
    keys = describe_keys()
    assert len(keys) > 60
    undocumented = [k for k, _, doc in keys if not doc]
    assert undocumented == []


def test_flatten_roundtrip():
    flat = flatten(to_dict(JobConfig()))
    assert flat["model.hidden_size"] == 64 and flat["cluster.num_workers"] == 2
    assert parse(to_dict(load(TINY))) == load(TINY)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config", "/nonexistent.yaml"], "no such file"),
        (["--config", TINY, "--set", "model.hiden_size=8"], "model.hidden_size"),
        (["--config", TINY, "--set", "train.global_batch_size=15", "--set", "parallel.micro_batch_size=2"],
         "global_batch_size"),
        (["--config", TINY, "--set", "cluster.num_workers=64"], "cluster.num_workers: no valid layout for 64 workers"),
        # A local Ray that can hold 4 single-CPU workers, asked for 8.
        (["--config", TINY, "--set", "cluster.num_workers=8", "--set", "cluster.local_num_cpus=4"],
         "the Ray cluster has 4 CPU"),
    ],
)
def test_train_cli_bad_input_exits_2_without_traceback_or_writes(tmp_path, args, needle):
    env = dict(os.environ, RAYSPEED_HOME=str(tmp_path), PYTHONPATH=str(ROOT / "platform"))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), *args], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and needle in r.stderr
    assert "config error" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no mlflow.db, no runs/


def test_a_bare_off_is_off(tmp_path):
    """YAML 1.1 reads `watchdog: off` as false: a key whose values include off takes it as off; a key that does
    not still names the values."""
    job = tmp_path / "job.yaml"
    job.write_text("name: bare-off\nhealth:\n  watchdog: off\n")
    assert load(str(job)).health.watchdog == "off"
    with pytest.raises(ConfigError) as e:
        parse({"resilience": {"checkpoint_mode": False}})
    assert "resilience.checkpoint_mode: expected auto | sync | async, got False" in str(e.value)


def test_a_cp_that_does_not_divide_the_world_says_so_and_nothing_about_seq_len():
    (msg,) = problems({"cluster": {"num_workers": 2}, "parallel": {"cp": 3}})
    assert msg.startswith("parallel.cp (3) does not divide the world size (2 workers, cluster.num_workers)")
    assert "seq_len" not in msg


def test_seq_len_past_the_context_names_both_routes():
    (msg,) = problems({"model": {"seq_len": 256, "max_position_embeddings": 64}})
    assert "lower model.seq_len" in msg and "model.max_position_embeddings to at least 256" in msg
    assert "model.rope_scaling (e.g. {rope_type: yarn, factor: 4})" in msg
