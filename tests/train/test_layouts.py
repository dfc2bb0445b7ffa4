"""Every layout trains the same model to the same loss (fp32, gloo): per-step train/loss equals the single-worker
run (tp1 pp1 ZeRO-0) within 1e-3 relative over 8 steps; and the planner's model-state bytes equal the real engine's.

Each layout runs the worker path (re-plan, data, Trainer, MLflow logging, export) in local processes joined by gloo
(tests/_inprocess.py); one, with tensor and pipeline parallelism over 4 workers, runs through the real entry point
(`python jobs/train.py` on the session's Ray cluster), proving Ray's part (placement, the tp-within-a-node check,
the launcher's result) gives the same curve."""

import pytest

from _cluster import ROOT, metric_history, run_job
from _inprocess import run_inprocess

pytestmark = pytest.mark.ray
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
STEPS = 8

LAYOUTS = {
    "reference": ["cluster.num_workers=1", "parallel.zero_stage=0"],
    "dp2-zero1": ["cluster.num_workers=2", "parallel.dp=2", "parallel.zero_stage=1"],
    "dp2-zero3": ["cluster.num_workers=2", "parallel.dp=2", "parallel.zero_stage=3"],
    "tp2": ["cluster.num_workers=2", "parallel.tp=2", "parallel.zero_stage=0"],
    "pp2": ["cluster.num_workers=2", "parallel.pp=2", "parallel.zero_stage=0"],
    "tp2xpp2-zero1": ["cluster.num_workers=4", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1"],
    "dp2xtp2-zero2": ["cluster.num_workers=4", "parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2"],
}
UNDER_RAY = "tp2xpp2-zero1"


@pytest.fixture(scope="module")
def runs(ray_head, tmp_path_factory):
    home = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, sets in LAYOUTS.items():
        items = [f"name=layout-{name}", f"train.max_steps={STEPS}", "tracking.log_every_steps=1",
                 "resilience.checkpoint_every_steps=0", "train.eval_every_steps=0", "train.warmup_steps=2", *sets]
        if name == UNDER_RAY:
            r, summary = run_job(home, ["--config", TINY, *(a for s in items for a in ("--set", s))], ray_head.address)
            assert r.returncode == 0 and summary and summary["status"] == "finished", (name, r.stdout[-4000:],
                                                                                       r.stderr[-4000:])
        else:
            workers = int(sets[0].split("=")[1])
            summary = run_inprocess(home, TINY, items, workers)
            assert summary["status"] == "finished", (name, summary)
        out[name] = (summary, metric_history(home, summary["mlflow_run_id"], "train/loss"))
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "reference"])
def test_layout_matches_single_worker_loss(runs, name):
    ref = runs["reference"][1]
    got = runs[name][1]
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    for (s, a), (_, b) in zip(ref, got):
        assert b == pytest.approx(a, rel=1e-3), f"{name} step {s}: {b} vs single-worker {a}"
    assert got[-1][1] < got[0][1]  # and it trains


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_model_state_bytes_match_engine(runs, name):
    from rayspeed.config import load
    from rayspeed.planner import evaluate_layout

    summary = runs[name][0]
    lay = dict(summary["layout"])
    lay.update(sequence_parallel=lay["tp"] > 1, activation_checkpointing="none")
    sets = [s for s in LAYOUTS[name]]
    cfg = load(TINY, sets)
    plan = evaluate_layout(cfg, lay, world_size=summary["world_size"])
    measured = summary["model_state_bytes"]
    for part in ("weights", "master_weights", "optimizer_states"):
        assert measured[part] == pytest.approx(plan["model_state_bytes"][part], rel=0.02), (name, part, measured,
                                                                                            plan["model_state_bytes"])
