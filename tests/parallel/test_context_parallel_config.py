"""parallel.cp and parallel.cp_scheme from the job file to the plan: the checks that refuse what cannot split (exit 2,
naming the key and the fix), the planner's pick for a 256k-token Llama-3-8B shape on 8 H100s (cp > 1, fits, and
--explain says why that cp), the partition key a checkpoint is tied to, and a job that trains longer than its
checkpoint's positions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayspeed.config import load, parse
from rayspeed.config.layout import Layout
from rayspeed.errors import ConfigError
from rayspeed.planner import plan_job

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
LLAMA3_8B = dict(architecture="LlamaForCausalLM", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 ffn_hidden_size=14336, vocab_size=128256, rope_theta=500000.0)


def _problems(overrides):
    with pytest.raises(ConfigError) as e:
        load(TINY, overrides)
    return "\n".join(e.value.problems)


@pytest.mark.parametrize("overrides, says", [
    (["parallel.cp=0"], "parallel.cp: must be >= 1 or auto"),
    (["parallel.cp=3", "cluster.num_workers=3"], "2 x cp = 6 balanced chunks"),
    (["parallel.cp=3"], "parallel.cp (3) does not divide the world size (2 workers"),
    (["parallel.cp=4", "cluster.num_workers=4", "parallel.cp_scheme=ulysses", "model.num_heads=2",
      "model.num_kv_heads=2", "model.hidden_size=64"], "use cp_scheme ring"),
    (["parallel.cp_scheme=zigzag"], "parallel.cp_scheme"),
])
def test_a_cp_that_cannot_split_the_model_is_refused_naming_the_key(overrides, says):
    assert says in _problems(overrides)


def test_cp_with_pp_is_accepted_and_planned_as_set():
    cfg = load(TINY, ["cluster.num_workers=4", "parallel.dp=1", "parallel.cp=2", "parallel.pp=2",
                      "parallel.zero_stage=1", "parallel.tp=1"])
    b = plan_job(cfg).best
    assert (b["dp"], b["cp"], b["tp"], b["pp"], b["zero_stage"]) == (1, 2, 1, 2, 1), b


def test_the_cli_refuses_it_with_exit_2_and_no_traceback(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSPEED_HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT / "platform")}
    r = subprocess.run([sys.executable, "-m", "rayspeed", "plan", TINY, "--set", "parallel.cp=3"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "parallel.cp (3)" in r.stderr + r.stdout


def _long_job(seq_len, **parallel):
    return parse({"name": "long", "model": {**LLAMA3_8B, "seq_len": seq_len},
                  "train": {"global_batch_size": 8, "max_steps": 10},
                  "parallel": parallel,
                  "cluster": {"num_workers": 8, "use_gpu": True, "gpu": "h100-sxm-80gb"}})


def test_a_256k_token_llama3_8b_job_on_8_h100s_plans_with_cp_and_fits():
    res = plan_job(_long_job(262144))
    b = res.best
    assert b["cp"] > 1 and b["fits"] and b["fits_with_margin"], b
    assert b["dp"] * b["cp"] * b["tp"] * b["pp"] == 8
    assert b["cp_scheme"] == "ulysses"  # 32 heads and 8 kv heads split over cp 8 or less
    text = res.explain
    assert f"cp = {b['cp']}:" in text and "cp_exchange_s" in text
    print(f"\n256k tokens on 8 x H100: dp{b['dp']} cp{b['cp']} tp{b['tp']} zero{b['zero_stage']} "
          f"ckpt={b['activation_checkpointing']}: {b['memory_gib_per_gpu']:.1f} GiB, {b['step_time_s']:.1f} s/step")
    # Held at cp 1 the sequence fits only at tp >= 4 with full recomputation (the loss is tiled at every tp, so the
    # vocabulary's logits are not what stops it), and the step is slower than the chosen cp's.
    one = plan_job(_long_job(262144, cp=1)).best
    assert one["cp"] == 1 and one["tp"] >= 4 and one["activation_checkpointing"] == "full", one
    assert one["step_time_s"] > b["step_time_s"]


def test_short_sequences_keep_cp_1():
    assert plan_job(_long_job(4096)).best["cp"] == 1


def test_a_checkpoint_is_tied_to_dp_x_cp():
    from rayspeed.checkpoint.resume import needs_universal

    old = {"layout": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}}  # written before cp existed: cp 1
    assert Layout.from_record(old["layout"] | {"micro_batch_size": 1, "grad_accum": 1}).cp == 1
    assert not needs_universal(old, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "cp": 1})
    assert needs_universal(old, {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 2, "cp": 2})
    assert Layout(1, 1, 1, 2, 1, 1, cp=2).partition()["cp"] == 2


def _pretrained_job(tmp_path, model):
    from _hf_models import tiny

    model_dir = tmp_path / "tiny-64"
    tiny.main([str(model_dir), "--max-positions", "64"])
    job = yaml.safe_load((ROOT / "configs" / "tiny-pretrained-cpu.yaml").read_text())
    job["model"] = {"pretrained": str(model_dir), **model}
    return job


def test_a_job_may_stretch_its_checkpoints_context_but_not_only_its_rope(tmp_path):
    job = _pretrained_job(tmp_path, {"seq_len": 256, "max_position_embeddings": 256,
                                     "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    cfg = parse(job)
    assert cfg.model.max_position_embeddings == 256 and cfg.model.rope_scaling["factor"] == 4.0
    job["model"] = {"pretrained": job["model"]["pretrained"], "seq_len": 64,
                    "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    with pytest.raises(ConfigError) as e:
        parse(job)
    text = "\n".join(e.value.problems)
    assert "model.rope_scaling" in text and "set model.max_position_embeddings above them" in text
