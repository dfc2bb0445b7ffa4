"""The planner's adapter terms: what trains and what is frozen per rank equals the model rayspeed builds (tp1 and a
tp2 rank's shards), the frozen base keeps its weights only (ZeRO-3 shards them), its backward has no weight-gradient
GEMMs, MFU counts the job's own FLOPs, and the user's question: a Llama-3-70B-shaped LoRA job plans on 8 H100s
while the same full fine-tune is refused with the existing message."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rayspeed.config.load import load, parse
from rayspeed.config.shape import ModelShape
from rayspeed.errors import ConfigError
from rayspeed.planner.adapter_terms import trained_and_frozen
from rayspeed.planner.search import build_ctx

ROOT = Path(__file__).resolve().parents[2]
SEVENTY_B = ["cluster.num_workers=8", "train.global_batch_size=64"]
LORA = {"type": "lora", "rank": 8, "targets": ["all"]}


def _job(adapter=LORA, **parallel):
    return parse({"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 256,
                            "tie_embeddings": False, "adapter": adapter},
                  "parallel": {"dp": 1, "pp": 1, "zero_stage": 2, "micro_batch_size": 1, **parallel},
                  "cluster": {"num_workers": parallel.get("tp", 1)}})


@pytest.mark.parametrize("tp, trainable, ranks", [(1, [], {}), (2, [], {}), (1, ["head", "norms"], {}),
                                                  (2, ["embed"], {}), (2, [], {"q": 16, "down": 2}),
                                                  (2, [], "phi3")])
def test_trained_and_frozen_counts_are_the_models(tp, trainable, ranks):
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.groups import TensorParallel

    if ranks == "phi3":  # fused projections: one A per qkv_proj and gate_up_proj
        cfg = _job(LORA, tp=tp)
        cfg.model.architecture = "Phi3ForCausalLM"
    else:
        cfg = _job({**LORA, "trainable": trainable, "rank_pattern": ranks}, tp=tp)
    model = Transformer(ModelShape.from_config(cfg.model), tp=TensorParallel(rank=0, world_size=tp) if tp > 1 else None)
    add_adapters(model, cfg.model.adapter, model.tp)
    for p in model.parameters():  # what the engine's transform lets train in full
        name = next(n for n, q in model.named_parameters() if q is p)
        if ("embed" in trainable and name.startswith("embed.")) or ("head" in trainable and name.startswith("head.")) \
                or ("norms" in trainable and "norm" in name):
            p.requires_grad_(True)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    ctx = build_ctx(cfg)
    lay = dataclasses.replace(_layout(cfg), tp=tp)
    assert trained_and_frozen(ctx, lay, 0, 2) == (pytest.approx(trained), pytest.approx(frozen))


def _layout(cfg):
    from rayspeed.planner.plan import plan_job

    return plan_job(cfg).layout


def test_the_frozen_base_keeps_its_weights_only_and_zero3_shards_them():
    from rayspeed.planner.memory import stage_breakdown

    cfg = _job(zero_stage=3)
    ctx, lay = build_ctx(cfg), dataclasses.replace(_layout(cfg), dp=4, zero_stage=3)
    full = dataclasses.replace(ctx, adapter=None)
    a, f = stage_breakdown(ctx, lay, 0), stage_breakdown(full, lay, 0)
    trained, frozen = trained_and_frozen(ctx, lay, 0, 2)
    assert a["weights"] == pytest.approx((trained + frozen) * 4 / 4)  # fp32 on CPU, ZeRO-3 over dp 4
    assert a["optimizer_states"] == pytest.approx(trained * 8 / 4)
    assert f["optimizer_states"] == pytest.approx((trained + frozen - _adapters(ctx, lay)) * 8 / 4)  # a full fine-tune
    assert a["gradients"] == pytest.approx(trained * 4 / 4)


def _adapters(ctx, lay):
    from rayspeed.planner.adapter_terms import layer_adapter_params

    return 2 * layer_adapter_params(ctx.shape, ctx.adapter, lay.tp)


def test_backward_skips_the_frozen_weight_gradients():
    from rayspeed.planner.timing import block_cost, dense_gemm_s

    cfg = _job()
    ctx, lay = build_ctx(cfg), _layout(cfg)
    full = dataclasses.replace(ctx, adapter=None)
    a, f = block_cost(ctx, lay), block_cost(full, lay)
    dense = dense_gemm_s(full, lay)
    assert a.fwd > f.fwd  # the adapters' GEMMs
    assert a.bwd < f.bwd and f.bwd - a.bwd < dense * 1.01 * ctx.hw.work_scale_bwd  # at most one dense pass less


def test_mfu_counts_the_jobs_own_flops():
    from rayspeed.config import adapter

    cfg = _job()
    shape = ModelShape.from_config(cfg.model)
    n_adapter = adapter.adapter_params(shape, cfg.model.adapter)
    # 2 layers x rank 8 x (in + out): q and o 64 + 64, k and v 64 + 32 (2 kv heads), gate, up and down 64 + ffn
    assert n_adapter == 2 * 8 * (2 * 128 + 2 * 96 + 3 * (64 + shape.ffn_hidden_size))
    assert adapter.flops_per_token(shape, cfg.model.adapter) == pytest.approx(
        shape.flops_per_token - 2 * shape.non_embedding_params + 6 * n_adapter)


def test_a_70b_lora_job_plans_on_8_h100s_and_its_full_fine_tune_does_not():
    from rayspeed.planner.plan import plan_job

    path = str(ROOT / "configs" / "llama-70b-64xh100.yaml")
    res = plan_job(load(path, SEVENTY_B + ["model.adapter.type=lora"]))
    assert res.layout.world_size == 8 and res.best["fits_with_margin"]
    with pytest.raises(ConfigError, match="does not fit in memory on 8 x h100-sxm-80gb"):
        plan_job(load(path, SEVENTY_B))


def test_the_search_never_gives_dora_zero3():
    from rayspeed.planner.search import enumerate_layouts

    for dora, zeros in ((True, {0, 1, 2}), (False, {0, 1, 2, 3})):
        cfg = parse({"model": {"adapter": {"type": "lora", "dora": dora}}, "cluster": {"num_workers": 2}})
        assert {lay.zero_stage for lay in enumerate_layouts(build_ctx(cfg), {}).layouts} == zeros


def test_qlora_holds_half_a_byte_per_base_weight_and_never_gets_zero3():
    from rayspeed.planner.adapter_terms import linear_weights
    from rayspeed.planner.memory import stage_breakdown
    from rayspeed.planner.search import enumerate_layouts

    nf4 = {**LORA, "base_precision": "nf4"}
    for double_quant, tp, per_weight in ((True, 1, 0.5 + 1 / 64 + 4 / (64 * 256)), (False, 1, 0.5 + 4 / 64),
                                         (True, 2, 0.5 + 4 / 64)):
        cfg = _job({**nf4, "double_quant": double_quant}, tp=tp)
        ctx, lay = build_ctx(cfg), dataclasses.replace(_layout(cfg), tp=tp)
        trained, frozen = trained_and_frozen(ctx, lay, 0, 2)
        packed = 2 * linear_weights(ctx.shape, tp)
        want = trained * 4 + packed * per_weight + (frozen - packed) * 4  # fp32 on CPU: embeddings, norms, head
        assert stage_breakdown(ctx, lay, 0)["weights"] == pytest.approx(want)
        assert stage_breakdown(ctx, lay, 0)["nf4_dequantized"] == pytest.approx(64 * ctx.shape.ffn_hidden_size * 4 / tp)
    cfg = parse({"model": {"adapter": nf4}, "cluster": {"num_workers": 2}})
    assert {lay.zero_stage for lay in enumerate_layouts(build_ctx(cfg), {}).layouts} == {0, 1, 2}


def test_a_70b_qlora_job_plans_on_one_h100_where_lora_does_not():
    from rayspeed.planner.plan import plan_job

    path = str(ROOT / "configs" / "llama-70b-64xh100.yaml")
    one = ["cluster.num_workers=1", "train.global_batch_size=8", "model.adapter.type=lora"]
    res = plan_job(load(path, one + ["model.adapter.base_precision=nf4"]))
    assert res.layout.world_size == 1 and res.best["fits_with_margin"]
    with pytest.raises(ConfigError, match="does not fit in memory on 1 x h100-sxm-80gb"):
        plan_job(load(path, one))
