"""An attempt is planned once (rayspeed.train.attempt_plan): the planner runs one time for a fresh start, a resume
into a smaller world (tp and pp from the checkpoint) and a keep_global shrink; twice only where the first plan is an
input of the second (a playbook shrink with no checkpoint to take tp and pp from), and the notes say so. The
Ray Train side (one plan line per attempt of a two-attempt job) is in tests/train/test_callbacks.py."""

import pytest

import rayspeed.planner
from rayspeed.config.load import parse
from rayspeed.train.attempt_plan import plan_attempt


def _job(policy="playbook", **parallel):
    return parse({"model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "vocab_size": 256},
                  "train": {"global_batch_size": 16}, "parallel": parallel, "cluster": {"num_workers": [1, 4]},
                  "resilience": {"batch_policy": policy}})


@pytest.fixture
def plans(monkeypatch):
    calls = []
    real = rayspeed.planner.resolve

    def counted(job, world_size, oom=None):
        calls.append(world_size)
        return real(job, world_size=world_size, oom=oom)

    monkeypatch.setattr(rayspeed.planner, "resolve", counted)
    monkeypatch.setattr(rayspeed.planner, "plan_job", lambda *a, **k: pytest.fail("a second search"))
    return calls


META = {"layout": {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 1, "micro_batch_size": 4, "grad_accum": 1}}


@pytest.mark.parametrize("policy, meta, world", [("playbook", None, 4), ("playbook", META, 2),
                                                  ("keep_global", None, 2), ("keep_global", META, 4)])
def test_one_plan_per_attempt(plans, policy, meta, world):
    attempt = plan_attempt(_job(policy), meta, world)
    assert plans == [world] and attempt.plans_made == 1
    assert attempt.layout.dp * attempt.layout.tp * attempt.layout.pp == world
    assert attempt.cfg.parallel.dp == attempt.layout.dp  # the resolved job and the layout agree
    assert any(n.startswith("batch policy") for n in attempt.notes)


def test_a_shrink_without_a_checkpoint_plans_twice_and_says_why(plans):
    attempt = plan_attempt(_job("playbook"), None, 2)
    assert plans == [2, 2] and attempt.plans_made == 2
    assert attempt.cfg.train.global_batch_size < 16
    assert "re-planned for the new global batch (the first plan sized it)" in attempt.notes


def test_pinned_tp_and_pp_are_said():
    meta = {"layout": {**META["layout"], "tp": 2, "dp": 2}}
    attempt = plan_attempt(_job(), meta, 4)
    assert (attempt.layout.tp, attempt.layout.dp) == (2, 2)
    assert "resume: tp 2, pp 1 kept from the checkpoint" in attempt.notes


@pytest.mark.parametrize("zero, pinned", [(0, 2), (3, 2), (2, "auto")])
def test_an_experts_ep_stays_the_checkpoints_where_its_zero_stage_cannot_convert_it(zero, pinned):
    from rayspeed.train.attempt_plan import pin_model_parallel

    job = parse({"model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "vocab_size": 256,
                           "architecture": "MixtralForCausalLM", "num_experts": 4},
                 "train": {"global_batch_size": 16}, "cluster": {"num_workers": [2, 4]}})
    meta = {"layout": {**META["layout"], "zero_stage": zero, "ep": 2}}
    assert pin_model_parallel(job, meta).parallel.ep == pinned
    assert pin_model_parallel(job, {"layout": {**META["layout"], "zero_stage": zero}}).parallel.ep == "auto"
