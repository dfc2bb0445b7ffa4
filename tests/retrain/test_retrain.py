"""Scheduled retraining: the cron line (installed and removed idempotently in a fake crontab, never the user's),
the cycle lock, the exit codes, warm-start weight loading, and one end-to-end scenario with real MLflow (SQLite
in tmp_path) and real training jobs (--launcher local, no Ray): first cycle -> version 1 champion; changed data
-> warm start, version 2 promoted; a degraded forced cycle -> version 3 registered, tagged rejected, not
promoted; unchanged data -> skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- cron (fake crontab)


@pytest.fixture
def fake_crontab(tmp_path, monkeypatch):
    """A `crontab` that keeps the table in tmp_path/crontab.txt and counts its writes in writes.log."""
    table, writes = tmp_path / "crontab.txt", tmp_path / "writes.log"
    script = tmp_path / "fake-crontab"
    script.write_text(
        "#!/bin/sh\n"
        f'T="{table}"\n'
        'if [ "$1" = "-l" ]; then [ -f "$T" ] || { echo "no crontab for tester" >&2; exit 1; }; cat "$T"; exit 0; fi\n'
        f'if [ "$1" = "-" ]; then cat > "$T"; echo w >> "{writes}"; exit 0; fi\n'
        "exit 2\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("RAYSPEED_CRONTAB", str(script))
    return SimpleNamespace(table=table, writes=writes, cmd=str(script),
                           lines=lambda: table.read_text().splitlines() if table.exists() else [],
                           nwrites=lambda: len(writes.read_text().split()) if writes.exists() else 0)


def test_cron_line_is_exact(tmp_path):
    from rayspeed.retrain.cron import CronError, cron_line, parse_marker

    repo = tmp_path / "repo"
    repo.mkdir()
    line = cron_line("0  3 * * *", "./configs/x.yaml", str(repo), str(repo / "runs" / "retrain.log"),
                     make="/usr/bin/make", env={})
    assert line == (f"0 3 * * * cd {repo} && mkdir -p {repo}/runs && /usr/bin/make retrain CONFIG=configs/x.yaml "
                    f">> {repo}/runs/retrain.log 2>&1 # rayspeed-retrain {repo}:configs/x.yaml")
    assert parse_marker(line) == (str(repo), "configs/x.yaml")
    # ARGS and the cluster address travel in the line; '%' is escaped for cron
    line = cron_line("@daily", "configs/x.yaml", str(repo), "runs/r.log", args="--set a=5% --force",
                     make="make", env={"RAY_ADDRESS": "http://h:8265"})
    assert "RAY_ADDRESS=http://h:8265 make retrain CONFIG=configs/x.yaml ARGS='--set a=5\\% --force'" in line
    assert parse_marker(line) == (str(repo), "configs/x.yaml")
    for bad in ("", "0 3 * *", "0 3 * * * *", "@sometimes", "0 3 * * ;rm"):
        with pytest.raises(CronError):
            cron_line(bad, "c.yaml", str(repo), "l")


def test_cron_install_remove_idempotent(fake_crontab, tmp_path):
    from rayspeed.retrain.cron import cron_line, install, read_table, remove

    repo, other = tmp_path / "repo", tmp_path / "other"
    repo.mkdir()
    other.mkdir()
    user = ["MAILTO=me@example.com", "5 * * * * echo hello"]
    fake_crontab.table.write_text("\n".join(user) + "\n")

    def line(cron, cfg, r=repo):
        return cron_line(cron, cfg, str(r), str(r / "runs" / "retrain.log"), make="/usr/bin/make", env={})

    assert install(line("0 3 * * *", "configs/a.yaml")) == "installed"
    assert install(line("0 3 * * *", "configs/a.yaml")) == "unchanged"
    assert fake_crontab.nwrites() == 1  # the second install did not rewrite the table
    assert install(line("30 4 * * 1", "configs/a.yaml")) == "updated"  # same repo+config: replaced
    assert install(line("0 3 * * *", "configs/b.yaml")) == "installed"
    assert install(line("0 1 * * *", "configs/a.yaml", other)) == "installed"
    table = read_table()
    assert table[:2] == user
    assert [x.split(" # ")[-1] for x in table[2:]] == [
        f"rayspeed-retrain {repo}:configs/a.yaml", f"rayspeed-retrain {repo}:configs/b.yaml",
        f"rayspeed-retrain {other}:configs/a.yaml"]
    assert table[2].startswith("30 4 * * 1 ")

    assert remove(str(repo), "configs/a.yaml") == [line("30 4 * * 1", "configs/a.yaml")]
    assert remove(str(repo)) == [line("0 3 * * *", "configs/b.yaml")]
    n = fake_crontab.nwrites()
    assert remove(str(repo)) == [] and fake_crontab.nwrites() == n  # nothing to remove: no write
    assert fake_crontab.lines() == user + [line("0 1 * * *", "configs/a.yaml", other)]


def test_cron_cli_and_make_targets(fake_crontab, tmp_path):
    from rayspeed.cli import main as cli

    def main(argv):
        return cli(["schedule", *argv])

    # the CLI: --dry-run prints the line and writes nothing
    assert main(["install", "--cron", "0 3 * * *", "--config", "configs/tiny-cpu.yaml", "--repo", str(ROOT),
                 "--dry-run"]) == 0
    assert not fake_crontab.table.exists()
    assert main(["install", "--cron", "", "--config", "configs/tiny-cpu.yaml", "--repo", str(ROOT)]) == 2

    run = _make_runner(tmp_path, {"RAYSPEED_CRONTAB": fake_crontab.cmd})
    p = run("schedule", "CRON=0 3 * * *", "DRY_RUN=1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("0 3 * * * cd ")
    assert "retrain CONFIG=configs/tiny-cpu.yaml >> " + str(ROOT / "runs" / "retrain.log") in p.stdout
    assert p.stdout.strip().endswith(f"# rayspeed-retrain {ROOT}:configs/tiny-cpu.yaml")
    assert not fake_crontab.table.exists()
    assert run("schedule").returncode != 0  # CRON is required
    assert run("schedule", "CRON=0 3 * * *").returncode == 0
    assert run("schedule", "CRON=0 3 * * *").returncode == 0
    assert len(fake_crontab.lines()) == 1 and fake_crontab.nwrites() == 1
    p = run("unschedule")
    assert p.returncode == 0 and fake_crontab.lines() == []


def _make_runner(tmp_path, extra_env=None):
    """`make <target> ...` in the repository, with the Python running these tests (its bin/ as BIN, an up-to-date
    stamp in place of .venv's, so `setup` does nothing) and this checkout's package first on the path."""
    make = shutil.which("make")
    bindir = Path(sys.executable).parent
    if make is None or not (bindir / "rayspeed").exists():
        pytest.skip("make and the rayspeed entry point next to this Python are needed for the make targets")
    stamp = tmp_path / "installed.stamp"
    stamp.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    return lambda *a: subprocess.run([make, "--no-print-directory", f"BIN={bindir}", f"STAMP={stamp}", *a],
                                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_make_passes_schedule_values_without_a_shell(fake_crontab, tmp_path):
    """CRON, ARGS and CONFIG reach rayspeed through the environment: neither make nor bash runs what they hold."""
    run = _make_runner(tmp_path, {"RAYSPEED_CRONTAB": fake_crontab.cmd})
    marks = {k: tmp_path / f"injected-{k}" for k in ("cron", "args", "config", "retrain")}
    p = run("schedule", f"CRON=`touch {marks['cron']}` * * * *", "DRY_RUN=1")
    assert p.returncode != 0 and "CRON '`touch" in p.stderr  # rayspeed saw the text and refused it
    p = run("schedule", "CRON=0 3 * * *", f"ARGS=$(touch {marks['args']}) --force", "DRY_RUN=1")
    assert p.returncode == 0, p.stderr
    assert f"ARGS='$(touch {marks['args']}) --force'" in p.stdout  # kept as text, quoted in the line
    p = run("schedule", "CRON=0 3 * * *", f"CONFIG=configs/tiny-cpu.yaml;touch {marks['config']}", "DRY_RUN=1")
    assert p.returncode != 0 and "no such job file" in p.stderr
    p = run("retrain", f"ARGS=$(touch {marks['retrain']}) --force")  # what the cron line runs
    assert p.returncode != 0 and "unrecognized arguments: $(touch" in p.stderr
    assert not [m.name for m in marks.values() if m.exists()]
    assert not fake_crontab.table.exists()
    # A single flag is a value of --args, not an option of its own (argparse: "expected one argument").
    p = run("schedule", "CRON=0 3 * * *", "ARGS=--force", "DRY_RUN=1")
    assert p.returncode == 0 and "retrain CONFIG=configs/tiny-cpu.yaml ARGS=--force" in p.stdout, p.stderr
    p = run("retrain", "ARGS=--force", "CONFIG=configs/no-such-job.yaml")
    assert p.returncode != 0 and "expected one argument" not in p.stderr and "no-such-job.yaml" in p.stderr, p.stderr
    # Quoted words still group as in a shell.
    p = run("schedule", "CRON=0 3 * * *", "ARGS=--set a='x y' --force", "DRY_RUN=1")
    assert p.returncode == 0 and "ARGS='--set a='\"'\"'x y'\"'\"' --force'" in p.stdout


def test_no_credential_is_written_into_the_crontab(fake_crontab, tmp_path, monkeypatch):
    from rayspeed.cli import main as cli

    secret_pw, secret_token = "pw-FAKE-1234567", "tok-FAKE-7654321"
    uri = f"http://alice:{secret_pw}@mlflow.internal:5000"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret_token)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    args = ["schedule", "install", "--cron", "0 3 * * *", "--config", "configs/tiny-cpu.yaml", "--repo", str(ROOT)]
    assert cli(args) == 0
    (line,) = fake_crontab.lines()
    assert secret_pw not in line and secret_token not in line
    assert "MLFLOW_TRACKING_USERNAME=alice RAY_ADDRESS=http://head:8265 " in line  # not secrets: in the line
    env_file = Path(line.split("set -a && . ", 1)[1].split(" && set +a", 1)[0])
    assert env_file.parent == tmp_path / "xdg" / "rayspeed" and (env_file.stat().st_mode & 0o777) == 0o600
    # Sourced the way the line does, the file gives the job the values themselves.
    show = 'echo "$MLFLOW_TRACKING_URI|$MLFLOW_TRACKING_PASSWORD|$MLFLOW_TRACKING_USERNAME"'
    got = subprocess.run(["sh", "-c", f'set -a && . "{env_file}" && set +a && {show}'],
                         capture_output=True, text=True, env={"PATH": os.environ["PATH"]}).stdout.strip()
    assert got == f"{uri}|{secret_token}|"
    assert cli(args + ["--args", f"--set cluster.env='{{HF_TOKEN: {secret_token}}}'"]) == 2  # refused
    assert cli(["schedule", "remove", "--repo", str(ROOT)]) == 0
    assert fake_crontab.lines() == [] and not env_file.exists()


# ---------------------------------------------------------------- lock, decision, exit codes


def test_lock_excludes_a_second_holder(tmp_path):
    from rayspeed.retrain.lock import CycleLock, Locked

    path = tmp_path / ".retrain" / "job.lock"
    with CycleLock(path):
        with pytest.raises(Locked, match=f"pid {os.getpid()}"):
            CycleLock(path).acquire()
    with CycleLock(path) as again:  # released: free again
        assert again.held


def test_decide():
    from rayspeed.retrain.cycle import decide

    assert decide(1.0, None, 0.0, has_champion=False)[0]
    assert decide(0.9, 1.0, 0.0)[0] and not decide(1.0, 1.0, 0.0)[0]
    assert not decide(0.95, 1.0, 0.1)[0] and decide(0.89, 1.0, 0.1)[0]
    assert not decide(float("nan"), 1.0, 0.0)[0] and not decide(None, 1.0, 0.0)[0]
    assert decide(2.0, float("nan"), 0.0)[0]  # a champion without a finite val/loss is beaten by any finite one


def _corpus(dirpath: Path, names=("json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py")) -> None:
    dirpath.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for n in names:
        shutil.copy(stdlib / n, dirpath / n.replace("/", "_"))


def _job(tmp_path: Path) -> Path:
    """A tiny job on a small text corpus in tmp_path (storage and MLflow land in tmp_path via RAYSPEED_HOME)."""
    _corpus(tmp_path / "corpus")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""
name: rt
model: {{hidden_size: 32, num_layers: 1, num_heads: 2, ffn_hidden_size: 64, vocab_size: 256, seq_len: 32}}
data: {{source: files, path: "{tmp_path}/corpus/*.py", tokenizer: bytes, val_fraction: 0.05}}
train: {{global_batch_size: 8, max_steps: 6, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2, eval_every_steps: 0,
        eval_batches: 2}}
cluster: {{num_workers: 1}}
resilience: {{checkpoint_every_steps: 0}}
tracking: {{log_every_steps: 3, system_metrics: false, loss_landscape: false, charts_every_checkpoints: 0}}
health: {{preflight: false}}
""")
    return cfg


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPEED_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_exit_codes_without_training(home):
    """Bad input (2), locked (3), a failing job (1, and the data is not marked as done), a job refusing its
    input (2). The 'training job' here is a stub command, so no model trains."""
    from rayspeed.retrain.cycle import run_cycle
    from rayspeed.retrain.history import state_dir
    from rayspeed.retrain.lock import CycleLock

    cfg = str(_job(home))
    assert run_cycle(cfg, margin=1.5).exit_code == 2
    assert run_cycle(str(home / "missing.yaml")).exit_code == 2
    bad = run_cycle(cfg, ["train.max_stepz=3"])
    assert bad.exit_code == 2 and "train.max_steps" in bad.reason

    sdir = state_dir(str(home / "runs"))
    with CycleLock(sdir / "rt.lock"):
        r = run_cycle(cfg, job_cmd=[sys.executable, "-c", "raise SystemExit(0)"])
    assert (r.outcome, r.exit_code) == ("skipped", 3) and r.reason.startswith("locked")

    r = run_cycle(cfg, job_cmd=[sys.executable, "-c", "raise SystemExit(1)"], launcher="local")
    assert (r.outcome, r.exit_code) == ("failed", 1) and r.job and r.job.startswith("rt-cycle-")
    state = json.loads((sdir / "rt.json").read_text())
    assert "last_data_hash" not in state and state["history"][-1]["retrain"] == "failed"

    r = run_cycle(cfg, job_cmd=[sys.executable, "-c", "raise SystemExit(2)"], launcher="local")
    assert (r.outcome, r.exit_code) == ("bad_input", 2)

    from rayspeed.cli import main as cli

    assert cli(["retrain", "--config", cfg, "--margin", "-1"]) == 2


# ---------------------------------------------------------------- warm-start weights


def _model_cfg(**kw):
    from rayspeed.config.schema import ModelConfig

    return ModelConfig(**{**dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                                 vocab_size=256, seq_len=16), **kw})


def _transformer(m, seed, tp=None):
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.transformer import Transformer

    return Transformer(ModelShape.from_config(m), tp=tp, seed=seed)


def test_load_initial_weights_full_and_tp_slice(tmp_path):
    import torch

    from rayspeed.model.export import export_model
    from rayspeed.model.warm_start import WarmStartError, load_initial_weights
    from rayspeed.parallel.groups import TensorParallel
    from rayspeed.tracking.model_fetch import resolve_init_from

    m = _model_cfg()
    src = _transformer(m, seed=1)
    export_model(src, SimpleNamespace(name="t", model=m, train=SimpleNamespace(seed=1, precision="fp32"),
                                      parallel=None),
                 str(tmp_path / "export"))
    model_dir = resolve_init_from(str(tmp_path / "export"))
    dst = _transformer(m, seed=2)
    report = load_initial_weights(dst, model_dir, model_cfg=_model_cfg(seq_len=64))  # seq_len may differ
    assert report["parameters"] == len(list(dst.parameters()))
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k
    # tp=2, rank 1: every sharded tensor is this rank's chunk along its partition_dim
    tp = TensorParallel(group=None, rank=1, world_size=2)
    shard = _transformer(m, seed=3, tp=tp)
    load_initial_weights(shard, model_dir, tp=tp, model_cfg=m)
    full = src.state_dict()
    sharded = 0
    for name, p in shard.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            sharded += 1
            assert torch.equal(p.detach(), full[name].chunk(2, dim=p.partition_dim)[1]), name
        else:
            assert torch.equal(p.detach(), full[name]), name
    assert sharded > 0
    with pytest.raises(WarmStartError, match=r"model\.hidden_size: saved 32, job 64.*model\.num_layers"):
        load_initial_weights(_transformer(_model_cfg(hidden_size=64, num_layers=2), 0), model_dir,
                             model_cfg=_model_cfg(hidden_size=64, num_layers=2))
    with pytest.raises(WarmStartError, match="no such directory"):
        resolve_init_from(str(tmp_path / "nope"))


# ---------------------------------------------------------------- end to end


def _integrated() -> bool:
    import rayspeed.engine.build as build

    return "warm_start" in Path(build.__file__).read_text()


def test_retrain_cycles_end_to_end(home, capfd):
    """Four cycles against a fresh MLflow store (about 3 training jobs of 6 steps each)."""
    if not _integrated():
        pytest.skip("rayspeed.engine.build does not call rayspeed.model.warm_start yet (lead integration pending)")
    from mlflow.tracking import MlflowClient

    from rayspeed.retrain.cycle import run_cycle

    cfg = str(_job(home))
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    name = "rayspeed-rt"

    def show(label, r):
        with capfd.disabled():
            print(f"\n{label}: {r.outcome} (exit {r.exit_code}) version {r.version} champion {r.champion_before} -> "
                  f"{r.champion_after}, {r.seconds} s: {r.reason}")

    r1 = run_cycle(cfg, launcher="local")
    show("cycle 1", r1)
    assert (r1.outcome, r1.exit_code, r1.version, r1.champion_after) == ("promoted", 0, "1", "1"), r1.reason
    assert r1.warm_start_from is None

    _corpus(home / "corpus", ("textwrap.py",))  # new data: the next cycle runs without --force
    r2 = run_cycle(cfg, launcher="local")
    show("cycle 2 (new data, warm start)", r2)
    assert (r2.outcome, r2.exit_code, r2.version, r2.champion_after) == ("promoted", 0, "2", "2"), r2.reason
    assert r2.warm_start_from == f"models:/{name}/1"
    assert "re-evaluated on the current held-out split" in r2.baseline
    assert "warm start from models:/rayspeed-rt/1" in capfd.readouterr().err
    versions = sorted(int(v.version) for v in c.search_model_versions(f"name = '{name}'"))
    assert [m.name for m in c.search_registered_models()] == [name] and versions == [1, 2]
    assert str(c.get_model_version_by_alias(name, "champion").version) == "2"

    r3 = run_cycle(cfg, ["train.lr=3.0", "train.warmup_steps=0"], force=True, launcher="local")
    show("cycle 3 (degraded, forced)", r3)
    assert (r3.outcome, r3.exit_code, r3.version, r3.champion_after) == ("rejected", 4, "3", "2"), r3.reason
    assert r3.warm_start_from == f"models:/{name}/2"
    tags = c.get_model_version(name, "3").tags
    assert tags["rayspeed.retrain.decision"] == "rejected"
    assert "does not improve" in tags["rejected"] or "not a finite number" in tags["rejected"]
    assert c.get_model_version(name, "2").tags["rayspeed.retrain.decision"] == "promoted"
    assert str(c.get_model_version_by_alias(name, "champion").version) == "2"

    r4 = run_cycle(cfg, launcher="local")
    show("cycle 4 (unchanged data)", r4)
    assert (r4.outcome, r4.exit_code) == ("skipped", 3) and "data unchanged" in r4.reason
    assert len(c.search_model_versions(f"name = '{name}'")) == 3
    assert len(c.search_registered_models()) == 1
