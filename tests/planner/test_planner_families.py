"""`rayspeed plan` on the published shapes of 2026's families, from hand-written config.json files
(configs/models/: Qwen3-8B, Qwen3-32B, Gemma-3-27B's text model, Phi-4, Mistral-7B-v0.1 with its 4096 window, and the
mixtures of experts Qwen3-30B-A3B and Mixtral-8x7B), seq 4096, on 8 and 64 H100s: the parameter counts (total and
active) are the published ones, every family's plan answers (or says what would fit), the planner charges Gemma's
local layers for their masks, not their windows' FLOPs, and it splits the experts over ep ranks where that is faster,
saying why."""

from __future__ import annotations

import json
import os

import pytest

from rayspeed.cli import main as cli
from rayspeed.config.load import parse
from rayspeed.config.shape import ModelShape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "configs", "llama-70b-64xh100.yaml")
PUBLISHED_B = {"qwen3-8b": 8.19, "qwen3-32b": 32.76, "gemma-3-27b-text": 27.01, "mistral-7b-v0.1": 7.24,
               "phi-4": 14.66, "qwen3-30b-a3b": 30.53, "mixtral-8x7b": 46.70}
ACTIVE_B = {"qwen3-30b-a3b": 3.35, "mixtral-8x7b": 12.88}  # through the top-k experts of every layer


def _sets(model: str, gpus: int) -> list[str]:
    return ["--set", f"model={{pretrained: {ROOT}/configs/models/{model}, init: random, seq_len: 4096}}",
            "--set", f"cluster.num_workers={gpus}", "--set", f"cluster.num_nodes={gpus // 8}",
            "--set", f"train.global_batch_size={gpus * 4}"]


def _shape(model: str) -> ModelShape:
    cfg = parse({"model": {"seq_len": 4096}}, [f"model.pretrained={ROOT}/configs/models/{model}", "model.init=random"])
    return ModelShape.from_config(cfg.model)


@pytest.mark.parametrize("model", sorted(PUBLISHED_B))
def test_the_shapes_have_the_published_sizes(model):
    assert _shape(model).params / 1e9 == pytest.approx(PUBLISHED_B[model], abs=0.01)


def test_gemma3_counts_its_local_layers_windows_and_mistral_its_window_at_the_sequence():
    gemma = _shape("gemma-3-27b-text")
    assert [gemma.attention_span(i) for i in range(6)] == [1024] * 5 + [4096]
    assert gemma.q_dim == 32 * 128 and gemma.hidden_size == 5376  # the query width is not hidden
    mistral = _shape("mistral-7b-v0.1")
    assert {mistral.attention_span(i) for i in range(mistral.num_layers)} == {4096}  # a window of s: plain causal


@pytest.mark.parametrize("model", sorted(PUBLISHED_B))
@pytest.mark.parametrize("gpus", [8, 64])
def test_plan_answers_for_each_family(capsys, model, gpus):
    code = cli(["plan", JOB, "--json", "--top", "1", *_sets(model, gpus)])
    out = capsys.readouterr()
    if (model, gpus) in (("qwen3-32b", 8), ("mixtral-8x7b", 8)):
        # 16 bytes or more per parameter (every expert's included) need more than 8 x 80 GB: said, exit 2
        assert code == 2 and "does not fit in memory" in out.err + out.out and "more GPUs" in out.err + out.out
        return
    assert code == 0, out.err
    plan = json.loads(out.out)["plan"]
    assert plan["fits"] and plan["dp"] * plan["tp"] * plan["pp"] == gpus
    if (model, gpus) == ("qwen3-30b-a3b", 8):  # on one node: each expert's width split over tp,
        assert plan["tp"] > 1 and plan["zero_stage"] == 3, plan  # and sharded (tp with pp is not built for experts)


@pytest.mark.parametrize("model", sorted(ACTIVE_B))
def test_moe_shapes_count_the_active_parameters(model):
    sh = _shape(model)
    assert (sh.params - sh.inactive_params) / 1e9 == pytest.approx(ACTIVE_B[model], abs=0.01)


@pytest.mark.parametrize("model", sorted(ACTIVE_B))
def test_moe_plans_split_the_experts_and_say_why_that_ep(capsys, model):
    assert cli(["plan", JOB, "--json", "--top", "1", *_sets(model, 64)]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    # Experts split over ep (and over tp, each expert's width; tp with pp is not built for experts).
    assert plan["ep"] > 1 and plan["dp"] % plan["ep"] == 0 and plan["pp"] == 1
    assert plan["time_breakdown_s"]["ep_dispatch_s"] > 0
    assert cli(["plan", JOB, "--explain", *_sets(model, 64)]) == 0
    explained = capsys.readouterr().out
    line = next(x for x in explained.splitlines() if x.strip().startswith("- ep ="))
    assert f"ep = {plan['ep']}:" in line and "ep = 1:" in line  # the pick, and what ep 1 would cost


def test_a_mixtral_lora_job_fits_on_one_node_where_its_full_fine_tune_does_not(capsys):
    """LoRA on a mixture of experts (the attention adapted, every expert frozen in the working dtype): a
    Mixtral-8x7B LoRA job plans on 8 H100s (experts split over ep), its full fine-tune does not fit (test above)."""
    sets = ["--set", f"model={{pretrained: {ROOT}/configs/models/mixtral-8x7b, init: random, seq_len: 4096, "
                     "adapter: {type: lora}}", "--set", "cluster.num_workers=8", "--set", "cluster.num_nodes=1",
            "--set", "train.global_batch_size=32"]
    code = cli(["plan", JOB, "--json", "--top", "1", *sets])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out)["plan"]
    assert plan["fits"] and plan["dp"] * plan["tp"] * plan["pp"] == 8, plan
    assert plan["memory_breakdown_gib"]["optimizer_states"] < 1.0  # the adapters' Adam state only
