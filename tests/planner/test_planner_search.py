"""The planner's search, resolve() and its errors."""

import dataclasses
import os
import time

import pytest

from rayspeed.config.load import load, parse
from rayspeed.config.schema import AUTO
from rayspeed.config.shape import ModelShape
from rayspeed.errors import ConfigError
from rayspeed.planner import evaluate_layout, plan_job, resolve
from rayspeed.planner.search import build_ctx, enumerate_layouts, fixed_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")
L70B = os.path.join(ROOT, "configs", "llama-70b-64xh100.yaml")
L1B = os.path.join(ROOT, "configs", "llama-1b-8xh100.yaml")

LAYOUT_FIELDS = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "grad_accum", "sequence_parallel",
                 "activation_checkpointing")


def tiny(*overrides):
    return load(TINY, list(overrides))


def no_auto(cfg):
    for section in (cfg.parallel, cfg.train):
        for f in dataclasses.fields(section):
            assert getattr(section, f.name) != AUTO, f"{f.name} still auto"


# ---------------------------------------------------------------- tiny-cpu


def test_tiny_cpu_resolves_to_pure_dp_on_2_workers():
    cfg, res = resolve(tiny("parallel.zero_stage=auto"))
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp) == (2, 1, 1)
    assert p.zero_stage in (0, 1)
    assert (p.micro_batch_size, p.grad_accum) == (8, 1)  # largest micro-batch, no accumulation
    assert p.sequence_parallel is False and p.activation_checkpointing == "none"
    assert cfg.train.precision == "fp32" and cfg.cluster.gpu == "cpu"
    no_auto(cfg)
    assert res.best["fits"] and res.best["dp"] == 2


def test_tiny_cpu_world_size_4():
    cfg, _ = resolve(tiny(), world_size=4)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (4, 1, 1)
    assert cfg.parallel.micro_batch_size * cfg.parallel.grad_accum * 4 == 16


def test_fixed_keys_are_respected():
    cfg, _ = resolve(tiny("parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "cluster.num_workers=4"))
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.zero_stage) == (1, 2, 2, 1)
    assert p.sequence_parallel is True  # auto: true iff tp > 1
    assert p.micro_batch_size * p.grad_accum == 16
    no_auto(cfg)


def test_lr_auto_is_filled_and_never_zero():
    cfg, res = resolve(tiny("train.lr=auto", "train.min_lr=1.0e-7", "cluster.num_workers=1"))
    assert cfg.train.lr == pytest.approx(1e-4 * (16 / 1024) ** 0.5 / 7)
    assert cfg.train.lr > 0 and "floored" in res.rules["lr"]


def test_elastic_uses_max_workers():
    cfg, _ = resolve(tiny("cluster.num_workers=[1,4]"))
    assert cfg.parallel.dp == 4


# ---------------------------------------------------------------- errors


def test_batch_not_divisible_names_keys_and_fix():
    with pytest.raises(ConfigError) as ei:
        resolve(tiny("cluster.num_workers=3", "parallel.micro_batch_size=2"))
    msg = ei.value.render()
    assert "train.global_batch_size (16) is not divisible by dp (3) x parallel.micro_batch_size (2)" in msg


def test_world_that_cannot_split_the_batch():
    with pytest.raises(ConfigError) as ei:
        resolve(tiny("cluster.num_workers=3"))
    assert "train.global_batch_size (16) is not divisible by dp (3)" in ei.value.render()


def test_fixed_dp_that_does_not_match_world():
    with pytest.raises(ConfigError) as ei:
        resolve(tiny("parallel.dp=3", "parallel.zero_stage=auto"), world_size=4)
    assert "parallel.dp (3)" in ei.value.render() and "world size (4)" in ei.value.render()


def test_impossible_fixed_layout_says_what_does_not_fit_and_what_would():
    cfg = load(L70B, ["parallel.tp=8", "parallel.pp=1", "parallel.zero_stage=1"])
    with pytest.raises(ConfigError) as ei:
        resolve(cfg)
    msg = ei.value.render()
    assert "does not fit in memory" in msg and "over by" in msg and "largest part gradients" in msg
    assert "what would fit" in msg and "parallel.zero_stage=" in msg


def test_model_too_big_for_the_cluster():
    with pytest.raises(ConfigError) as ei:
        plan_job(load(L70B, ["cluster.num_workers=8", "cluster.num_nodes=1"]))
    msg = ei.value.render()
    assert "does not fit in memory" in msg and "more GPUs" in msg


def test_unknown_gpu():
    with pytest.raises(ConfigError) as ei:
        plan_job(tiny("cluster.gpu=tpu-v9", "cluster.use_gpu=true"))
    assert "cluster.gpu" in ei.value.render()


# ---------------------------------------------------------------- constraints


def test_every_candidate_respects_the_constraints():
    cfg = load(L70B)
    res = plan_job(cfg, top_k=20)
    heads, kv, L = cfg.model.num_heads, ModelShape.from_config(cfg.model).num_kv_heads, cfg.model.num_layers
    for p in [res.best] + res.alternatives:
        assert p["dp"] * p["cp"] * p["tp"] * p["pp"] == 64
        assert heads % p["tp"] == 0 and kv % p["tp"] == 0 and p["tp"] <= 8
        # pp need not divide the layers (the old "pp divides layers" rule was wrong): any pp up to L, with the
        # planner's stage split adding up to the model.
        assert p["pp"] <= L and (p["pp"] == 1 or (sum(p["stage_layers"]) == L and min(p["stage_layers"]) >= 1))
        assert p["dp"] * p["micro_batch_size"] * p["grad_accum"] == 1024
        # The cap is a hypothesis: a layout beyond it is ranked only when the model disagreed with it.
        cap = res.rules["accumulation_cap"]
        assert p["grad_accum"] <= cap["max_grad_accum"] or not cap["applied"]
        assert p["pp"] == 1 or p["zero_stage"] <= 1
        assert p["fits"] and p["memory_gib_per_gpu"] <= p["usable_memory_gib"]
        assert p["sequence_parallel"] == (p["tp"] > 1)


# ---------------------------------------------------------------- big jobs


def test_70b_on_64_h100_is_sensible_and_explained():
    res = plan_job(load(L70B))
    b = res.best
    assert b["fits"] and b["tp"] <= 8 and b["memory_gib_per_gpu"] < 79.6
    assert 0.2 < b["mfu"] < 0.65
    assert b["step_time_s"] > 0 and b["tokens_per_s_per_gpu"] > 0
    assert set(b["memory_breakdown_gib"]) >= {"weights", "gradients", "optimizer_states", "activations",
                                               "logits_loss", "cuda_context", "allocator_slack"}
    assert abs(sum(b["memory_breakdown_gib"].values()) - b["memory_gib_per_gpu"]) < 0.05
    text = res.explain
    for needle in ("chosen layout", "memory per GPU", "time per step", "runner-up layouts", "strategy by size",
                   "learning rate", "accumulation cap", "communication", "precision", "topology"):
        assert needle in text
    assert res.alternatives and all(a["step_time_s"] >= b["step_time_s"] * 0.99 for a in res.alternatives)
    assert b["deepspeed"]["reduce_bucket_size"] > 0


QWEN3_MOE = os.path.join(ROOT, "configs", "models", "qwen3-30b-a3b")


# 128k: every cp x tp x pp combination is searched too; the mixture of experts adds every ep.
@pytest.mark.parametrize("seq_len,model", [(4096, None), (131072, None), (32768, QWEN3_MOE)])
def test_512_gpus_well_under_a_second(seq_len, model):
    sets = [f"model={{pretrained: {model}, init: random, seq_len: {seq_len}}}"] if model else [
        f"model.seq_len={seq_len}"]
    cfg = load(L70B, ["cluster.num_workers=512", "cluster.num_nodes=64", *sets])
    took = []
    for _ in range(3):  # the best of three: a neighbour's burst on a shared machine is not the planner's time
        t0 = time.perf_counter()
        res = plan_job(cfg)
        took.append(time.perf_counter() - t0)
    assert min(took) < 1.0, took  # every valid layout costed, above the accumulation cap too
    assert res.best["fits"] and res.best["world_size"] == 512
    # Every cp and ep value the enumeration offers is costed and reported (cp 1-64 at 128k, ep 1-128 here).
    reported = {c["key"]: {res.best[c["key"]]} | {a["value"] for a in c["alternatives"]}
                for c in res.best["claims"] if c["kind"] == "key"}
    offered = enumerate_layouts(build_ctx(cfg), fixed_keys(cfg)).layouts
    for key, least in (("cp", 8 if seq_len > 100_000 else 1), ("ep", 128 if model else 1)):
        assert reported[key] == {getattr(lay, key) for lay in offered} and max(reported[key]) >= least, key
    assert res.best["env"].get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1"


def test_small_model_on_gpus_follows_pure_dp():
    res = plan_job(load(L1B))
    assert (res.best["tp"], res.best["pp"], res.best["dp"]) == (1, 1, 8)
    assert res.rules["strategy"]["chosen_follows_rule"]


def test_tp_never_spans_nodes_in_search():
    cfg = load(L70B, ["cluster.gpus_per_node=4", "cluster.num_nodes=16"])
    res = plan_job(cfg, top_k=10)
    assert all(p["tp"] <= 4 for p in [res.best] + res.alternatives)


# ---------------------------------------------------------------- evaluate_layout


def test_evaluate_layout_fits_and_does_not_fit():
    cfg = load(L70B)
    ok = evaluate_layout(cfg, {"dp": 8, "tp": 8, "pp": 1, "zero_stage": 3, "micro_batch_size": 32, "grad_accum": 4,
                               "sequence_parallel": True, "activation_checkpointing": "full"})
    assert ok["fits"] and ok["valid"] and ok["step_time_s"] > 0
    big = evaluate_layout(cfg, {"dp": 64, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 16, "grad_accum": 1,
                                "sequence_parallel": False, "activation_checkpointing": "none"})
    assert not big["fits"] and "over by" in big["reason"] and big["memory_gib_per_gpu"] > 80
    bad = evaluate_layout(cfg, {"dp": 3, "tp": 8, "pp": 1})
    assert not bad["fits"] and not bad["valid"] and "world size" in bad["reason"]
    z2pp = evaluate_layout(cfg, {"dp": 4, "tp": 8, "pp": 2, "zero_stage": 2, "micro_batch_size": 1, "grad_accum": 256,
                                 "sequence_parallel": True, "activation_checkpointing": "full"})
    assert not z2pp["fits"] and "ZeRO 0 or 1" in z2pp["reason"] and z2pp["step_time_s"] > 0


def test_evaluate_matches_search_for_the_chosen_layout():
    cfg = load(L70B)
    res = plan_job(cfg)
    again = evaluate_layout(cfg, {k: res.best[k] for k in LAYOUT_FIELDS})
    assert again["memory_gib_per_gpu"] == pytest.approx(res.best["memory_gib_per_gpu"], rel=0.02)
    assert again["step_time_s"] == pytest.approx(res.best["step_time_s"], rel=0.02)


def test_tp_beyond_a_node_costs_more_than_inside():
    cfg = parse({"model": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "ffn_hidden_size": 11008,
                           "vocab_size": 32000, "seq_len": 4096, "tie_embeddings": False},
                 "train": {"global_batch_size": 64}, "cluster": {"num_workers": 16, "use_gpu": True}})
    lay = {"pp": 1, "zero_stage": 1, "micro_batch_size": 1, "sequence_parallel": True,
           "activation_checkpointing": "full"}
    inside = evaluate_layout(cfg, {**lay, "dp": 2, "tp": 8, "grad_accum": 32})
    across = evaluate_layout(cfg, {**lay, "dp": 1, "tp": 16, "grad_accum": 64})
    assert not across["valid"] and "spans nodes" in across["reason"]
    assert across["time_breakdown_s"]["tp_comm_s"] > 2 * inside["time_breakdown_s"]["tp_comm_s"]


# ---------------------------------------------------------------- calibration


# H200 anchor (docs/PLANNER.md): GPT-2 shapes, seq 1024, bf16, one GPU, DeepSpeed ZeRO-1/2 and eager torch.
ANCHOR = [  # (hidden, layers, heads, batch, zero, measured step s)
    (768, 12, 12, 32, 1, 0.0758),
    (1280, 36, 20, 16, 1, 0.2075),
    (1280, 36, 20, 16, 2, 0.1992),
    (1600, 48, 25, 8, 1, 0.2017),
]


def _anchor_plan(h, L, a, b, z):
    cfg = parse({"model": {"hidden_size": h, "num_layers": L, "num_heads": a, "ffn_hidden_size": 8 * h // 3,
                           "vocab_size": 50304, "seq_len": 1024, "tie_embeddings": True},
                 "train": {"global_batch_size": b, "precision": "bf16"},
                 "cluster": {"num_workers": 1, "use_gpu": True, "gpu": "h200"}})
    return evaluate_layout(cfg, {"dp": 1, "tp": 1, "pp": 1, "zero_stage": z, "micro_batch_size": b,
                                 "grad_accum": 1, "sequence_parallel": False, "activation_checkpointing": "none"})


@pytest.mark.parametrize("h,L,a,b,z,measured", ANCHOR)
def test_step_time_within_20_percent_of_h200_anchor(h, L, a, b, z, measured):
    assert _anchor_plan(h, L, a, b, z)["step_time_s"] == pytest.approx(measured, rel=0.20)


# The same anchor's DeepSpeed runs, the caching allocator at the peak (GiB): (hidden, layers, heads, batch, zero,
# peak allocated, peak reserved). What it reserved beyond what it allocated is the allocator's slack.
ANCHOR_MEMORY = [
    (768, 12, 12, 32, 1, 24.707, 27.029),
    (1280, 36, 20, 16, 1, 38.922, 42.176),
    (1280, 36, 20, 16, 2, 49.009, 52.266),
    (1280, 36, 20, 16, 3, 61.467, 65.342),
]


def test_the_allocator_slack_margin_is_the_h200_anchors_measured_error():
    """The slack's uncertainty covers the largest relative excess of the measured slack over the planner's slack
    term on the anchor's DeepSpeed rows, and is at most 10 points above it."""
    from rayspeed.planner.margin import UNCERTAINTY

    errors = []
    for h, L, a, b, z, allocated, reserved in ANCHOR_MEMORY:
        predicted = _anchor_plan(h, L, a, b, z)["memory_breakdown_gib"]["allocator_slack"]
        errors.append((reserved - allocated) / predicted - 1)
    assert max(errors) <= UNCERTAINTY["allocator_slack"] <= max(errors) + 0.10, errors
