"""The loop and its listeners (rayspeed.train.loop, rayspeed.train.events).

The loop's body refers only to the batches, the step, the checkpointer (maybe_save, finish_saves) and the callback
list, and its module reaches nothing of tracking or monitoring (read from the source, with a check that the
reader finds a planted violation). A job's own callback (train.callbacks, tests/fixtures/hooks/recording_hooks.py)
hears start, step_end, log, validation, before_checkpoint, checkpoint_saved, checkpoint_committed, end and failure
in order, under --launcher local and under Ray Train (where the failure is followed by a restart from the
checkpoint and the run ends, each attempt planned once)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from _cluster import ROOT, run_job

LOOP = ROOT / "platform" / "rayspeed" / "train" / "loop.py"
HOOKS = ROOT / "tests" / "fixtures" / "hooks"
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
PARTS = {"batches", "step", "checkpointer", "callbacks", "state"}
ALLOWED_CALLS = {"checkpointer": {"maybe_save", "finish_saves"}, "callbacks": {"step_end", "failure", "end"}}


def loop_violations(source: str) -> list[str]:
    """What run_loop's body refers to besides its parts, the loop variables and the exception it re-raises."""
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "run_loop")
    local = {t.id for n in ast.walk(fn) if isinstance(n, (ast.For,)) for t in ast.walk(n.target)
             if isinstance(t, ast.Name)}
    local |= {n.name for n in ast.walk(fn) if isinstance(n, ast.ExceptHandler) and n.name}
    out = []
    for stmt in fn.body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and n.id not in PARTS | local | {"BaseException"}:
                out.append(f"line {n.lineno}: {n.id}")
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                allowed = ALLOWED_CALLS.get(n.value.id)
                if allowed is None or n.attr not in allowed:
                    out.append(f"line {n.lineno}: {n.value.id}.{n.attr}")
    return out


def rayspeed_imports(path: Path, seen: set[str] | None = None) -> set[str]:
    """Every rayspeed module `path` imports, transitively."""
    seen = set() if seen is None else seen
    for n in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module] if isinstance(n, ast.ImportFrom) and n.module else []
        for m in names:
            if m.startswith("rayspeed") and m not in seen:
                seen.add(m)
                target = ROOT / "platform" / Path(*m.split("."))
                for f in (target.with_suffix(".py"), target / "__init__.py"):
                    if f.exists():
                        rayspeed_imports(f, seen)
    return seen


def test_the_loop_body_refers_only_to_its_parts():
    assert loop_violations(LOOP.read_text()) == []


def test_the_loop_check_finds_a_planted_violation():
    planted = LOOP.read_text().replace("callbacks.step_end(state)",
                                       "callbacks.step_end(state)\n            tracker.log_metrics({})\n"
                                       "            checkpointer.save(state)")
    found = sorted(v.split(": ", 1)[1] for v in loop_violations(planted))
    assert found == ["checkpointer.save", "tracker", "tracker.log_metrics"]


def test_the_loop_reaches_nothing_of_tracking_or_monitoring():
    reached = rayspeed_imports(LOOP)
    assert "rayspeed.train.events" in reached
    assert not [m for m in reached if m.startswith(("rayspeed.tracking", "rayspeed.monitoring"))], reached


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _expected_attempt(steps, *, log_every, eval_every, ckpt_every, max_steps):
    out = []
    for s in steps:
        out.append(("step_end", s))
        if s % log_every == 0 or s == max_steps:
            out.append(("log", s))
        if (eval_every and s % eval_every == 0) or s == max_steps:
            out.append(("validation", s))
        if (ckpt_every and s % ckpt_every == 0) or s == max_steps:
            out += [("before_checkpoint", s), ("checkpoint_saved", s), ("checkpoint_committed", s)]
    return out


SETS = ["train.max_steps=4", "tracking.log_every_steps=2", "train.eval_every_steps=2",
        "resilience.checkpoint_every_steps=2", "resilience.checkpoint_mode=sync", "tracking.charts_every_checkpoints=0",
        "tracking.loss_landscape=false", "train.callbacks=[recording_hooks:Recorder]"]


def _job(tmp_path, name, launcher, extra, raise_at=None, ray_address=None):
    events = tmp_path / f"{name}.jsonl"
    env = {"PYTHONPATH": str(HOOKS), "RAYSPEED_TEST_EVENTS": str(events), "RAYSPEED_TEST_RAISE_AT": str(raise_at or "")}
    sets = [f"name={name}", *SETS, *extra]
    if launcher == "ray":  # the workers get the hook's folder and the events file through the job's environment
        sets.append("cluster.env=" + json.dumps({k: v for k, v in env.items() if v}))
    args = ["--config", TINY, *(a for s in sets for a in ("--set", s))]
    if launcher == "local":
        args += ["--launcher", "local"]
    r, summary = run_job(tmp_path, args, ray_address, env_extra=env)
    return r, summary, [(e["event"], e["step"]) for e in _events(events)]


def test_callbacks_hear_every_event_in_order_local(tmp_path):
    r, summary, got = _job(tmp_path, "cb-local", "local", ["cluster.num_workers=1"])
    assert r.returncode == 0 and summary["status"] == "finished", r.stderr[-3000:]
    expected = [("start", 0), *_expected_attempt(range(1, 5), log_every=2, eval_every=2, ckpt_every=2, max_steps=4),
                ("end", 4)]
    assert got == expected


def test_a_failure_reaches_the_callbacks_local(tmp_path):
    r, _, got = _job(tmp_path, "cb-local-fail", "local", ["cluster.num_workers=1"], raise_at=3)
    assert r.returncode != 0
    assert got[-2:] == [("step_end", 3), ("failure", 3)], got


@pytest.mark.ray
def test_callbacks_hear_failure_restart_and_end_under_ray(ray_head, tmp_path):
    r, summary, got = _job(tmp_path, "cb-ray", "ray", ["cluster.num_workers=2", "resilience.max_failures=1"],
                           raise_at=3, ray_address=ray_head.address)
    assert r.returncode == 0 and summary["status"] == "finished", (r.stdout[-3000:], r.stderr[-3000:])
    kw = dict(log_every=2, eval_every=2, ckpt_every=2, max_steps=4)
    expected = [("start", 0), *_expected_attempt(range(1, 3), **kw), ("step_end", 3), ("failure", 3),
                ("start", 2), *_expected_attempt(range(3, 5), **kw), ("end", 4)]
    assert got == expected
    # Each attempt planned once, by rank 0's count (rayspeed.train.attempt_plan; tests/train/test_attempt_plan.py)
    plan_lines = [line for line in (r.stdout + r.stderr).splitlines() if "attempt plan for 2 workers" in line]
    assert len(plan_lines) == 2, plan_lines
