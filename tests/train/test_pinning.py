"""On resume the workers keep the checkpoint's tp, pp and ZeRO stage (where the job leaves them auto) and re-plan
dp and accumulation; a ZeRO stage that no longer fits the new world is re-planned, and the attempt's notes (logged
once per attempt) say so."""

from rayspeed.config.load import parse
from rayspeed.train.attempt_plan import pin_model_parallel, plan_attempt


def _job(**parallel):
    return parse({"model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "vocab_size": 256},
                  "train": {"global_batch_size": 16}, "parallel": parallel, "cluster": {"num_workers": [1, 4]}})


def test_zero_stage_tp_and_pp_follow_the_checkpoint():
    meta = {"layout": {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 1, "micro_batch_size": 4, "grad_accum": 1}}
    cfg = plan_attempt(_job(), meta, 2).cfg
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage, cfg.parallel.dp) == (1, 1, 1, 2)
    # a key the job fixes is the job's
    assert pin_model_parallel(_job(zero_stage=2), meta).parallel.zero_stage == 2
    assert pin_model_parallel(_job(), None).parallel.zero_stage == "auto"


def test_a_zero_stage_that_no_longer_fits_is_replanned_and_said():
    # ZeRO-0 over dp: the whole model state on every rank. A 1-worker world of a model that needs partitioning:
    # pinning ZeRO-0 cannot fit, so the planner chooses, and the log says so.
    job = parse({"model": {"hidden_size": 4096, "num_layers": 16, "num_heads": 32, "vocab_size": 32000},
                 "train": {"global_batch_size": 8}, "cluster": {"num_workers": [1, 8], "use_gpu": True,
                                                                "gpu": "a100-40gb"}})
    meta = {"layout": {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "micro_batch_size": 1, "grad_accum": 1}}
    cfg = plan_attempt(job, meta, 8).cfg
    assert cfg.parallel.zero_stage == 3
    meta0 = {"layout": {**meta["layout"], "zero_stage": 0}}
    attempt = plan_attempt(job, meta0, 8)
    assert attempt.cfg.parallel.zero_stage > 0
    assert any("ZeRO-0 of the checkpoint does not fit 8 workers" in n for n in attempt.notes)
