"""Uneven pipeline stages in the planner: any pp up to the layer count, the planner's split, the worst stage."""

import json
import os

import pytest

from rayspeed.cli import main as _cli
from rayspeed.config.layout import Layout
from rayspeed.config.load import load, parse
from rayspeed.planner import evaluate_layout, plan_job, resolve
from rayspeed.planner.memory import worst_stage
from rayspeed.planner.model_math import even_split, stage_params
from rayspeed.planner.partition import balance
from rayspeed.planner.search import build_ctx, evaluate


def main(argv):
    return _cli(["plan", *argv])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def _optimal(L, pp, block, e0, eL):
    """The best bottleneck by dynamic programming over the first stages' block counts."""
    import functools

    @functools.lru_cache(maxsize=None)
    def best(stage, left):  # smallest bottleneck placing `left` blocks on stages stage..pp-1
        rest = pp - stage - 1
        if rest == 0:
            return left * block + eL + (e0 if stage == 0 else 0.0)
        out = float("inf")
        for n in range(1, left - rest + 1):
            t = n * block + (e0 if stage == 0 else 0.0)
            out = min(out, max(t, best(stage + 1, left - n)))
        return out

    return best(0, L)


@pytest.mark.parametrize("L,pp,block,e0,eL", [(28, 8, 1.0, 0.1, 2.5), (80, 32, 1.0, 0.0, 0.0), (7, 3, 1.0, 0.5, 0.5),
                                              (16, 4, 1.0, 0.2, 5.0), (5, 5, 1.0, 3.0, 3.0), (9, 2, 0.3, 0.0, 1.0)])
def test_balance_is_optimal_and_covers_the_layers(L, pp, block, e0, eL):
    split = balance(L, pp, block, e0, eL)
    assert len(split) == pp and sum(split) == L and min(split) >= 1
    t = [n * block for n in split]
    t[0] += e0
    t[-1] += eL
    assert max(t) == pytest.approx(_optimal(L, pp, block, e0, eL))


def test_balance_heavy_head_gets_fewer_blocks_and_ties_spare_the_first_stage():
    assert balance(28, 8, 1.0, 0.0, 2.0) == (3, 3, 4, 4, 4, 4, 4, 2)  # the head is worth two blocks; spare room early
    assert balance(10, 4, 1.0, 0.0, 0.0)[0] == 2  # 10 = 2 + 2 + 3 + 3: the first stage holds most activations
    with pytest.raises(ValueError):
        balance(3, 4, 1.0, 0.0, 0.0)


def test_even_split_and_stage_params_with_uneven_stages():
    assert even_split(80, 32).count(3) == 16 and sum(even_split(80, 32)) == 80
    sh = build_ctx(load(TINY, ["model.num_layers=3"])).shape
    total = stage_params(sh, 1, 2, 0, 2) + stage_params(sh, 1, 2, 1, 1)
    assert total == sh.params + sh.vocab_size * sh.hidden_size  # tied head: a second copy on the last stage


def test_pp_need_not_divide_the_layers_in_search():
    # 3 layers on 2 workers: pp 2 is valid (the old "pp divides layers" rule refused it).
    cfg, res = resolve(load(TINY, ["model.num_layers=3", "parallel.pp=2", "parallel.zero_stage=0"]))
    assert cfg.parallel.pp == 2 and sorted(cfg.parallel.stage_layers) == [1, 2]
    assert res.best["stage_layers"] == cfg.parallel.stage_layers


def test_fixed_stage_layers_are_respected_and_checked():
    cfg, _ = resolve(load(TINY, ["model.num_layers=3", "parallel.stage_layers=[1,2]", "parallel.zero_stage=0"]))
    assert cfg.parallel.pp == 2 and cfg.parallel.stage_layers == [1, 2]
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError) as ei:
        load(TINY, ["model.num_layers=3", "parallel.stage_layers=[1,1]"])
    assert "parallel.stage_layers" in ei.value.render()


def test_llama_28_layers_on_pp_8_and_80_on_pp_32():
    for L, pp, world in ((28, 8, 64), (80, 32, 256)):
        cfg = parse({"model": {"hidden_size": 4096, "num_layers": L, "num_heads": 32, "num_kv_heads": 8,
                               "ffn_hidden_size": 14336, "vocab_size": 128256, "seq_len": 4096,
                               "tie_embeddings": False},
                     "train": {"global_batch_size": 512}, "cluster": {"num_workers": world, "use_gpu": True,
                                                                        "num_nodes": world // 8}})
        p = evaluate_layout(cfg, {"dp": world // (8 * pp) or 1, "tp": 8 if world // pp >= 8 else world // pp, "pp": pp,
                                  "zero_stage": 1, "micro_batch_size": 1, "activation_checkpointing": "full"})
        assert p["valid"] and p["runnable"], p.get("reason")
        assert sum(p["stage_layers"]) == L and len(p["stage_layers"]) == pp and p["step_time_s"] > 0


def test_worst_stage_can_be_any_stage_with_an_uneven_split():
    cfg = load(TINY, ["model.num_layers=6", "cluster.num_workers=3", "train.global_batch_size=12"])
    ctx = build_ctx(cfg)
    lay = Layout(1, 1, 3, 0, 1, 12, False, "none", stage_layers=(1, 4, 1))
    stage, _ = worst_stage(ctx, lay)
    assert stage == 1
    e = evaluate(ctx, Layout(1, 1, 3, 0, 1, 12, False, "none"))
    assert sum(e.layout.stage_layers) == 6


def test_plan_layouts_accepts_uneven_layouts_with_valid_and_runnable(tmp_path, capsys):
    rows = [
        {"dp": 1, "tp": 1, "pp": 2, "zero_stage": 0, "micro_batch_size": 2, "grad_accum": 8, "stage_layers": [2, 1]},
        {"dp": 1, "tp": 1, "pp": 2, "zero_stage": 0, "micro_batch_size": 2, "grad_accum": 8},
        {"dp": 1, "tp": 1, "pp": 2, "zero_stage": 2, "micro_batch_size": 2, "grad_accum": 8},
        {"dp": 1, "tp": 1, "pp": 2, "zero_stage": 0, "micro_batch_size": 2, "grad_accum": 8, "stage_layers": [3, 1]},
    ]
    f = tmp_path / "l.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert main([TINY, "--set", "model.num_layers=3", "--layouts", str(f)]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert out[0]["valid"] and out[0]["runnable"] and out[0]["fits"] and out[0]["stage_layers"] == [2, 1]
    assert out[1]["valid"] and out[1]["runnable"] and sum(out[1]["stage_layers"]) == 3
    assert out[2]["valid"] is False and out[2]["runnable"] is False and "ZeRO 0 or 1" in out[2]["reason"]
    assert out[3]["valid"] is False and "stage_layers" in out[3]["reason"]
    for o in out[:3]:
        assert {"fits", "memory_gib_per_gpu", "memory_breakdown_gib", "step_time_s", "tokens_per_s_per_gpu",
                "mfu"} <= set(o)


def test_runnable_separates_engine_rules_from_this_runtime():
    cfg = load(TINY, ["model.vocab_size=257", "cluster.num_workers=2"])
    p = evaluate_layout(cfg, {"dp": 1, "tp": 2, "pp": 1, "zero_stage": 0, "micro_batch_size": 8, "grad_accum": 2})
    assert p["valid"] and not p["runnable"] and not p["fits"] and "vocab_size" in p["reason"]


def test_plan_search_considers_pp_that_does_not_divide_layers():
    cfg = parse({"model": {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "num_kv_heads": 4,
                           "ffn_hidden_size": 5632, "vocab_size": 32000, "seq_len": 2048, "tie_embeddings": False},
                 "train": {"global_batch_size": 512}, "cluster": {"num_workers": 8, "use_gpu": True},
                 "parallel": {"pp": 8, "zero_stage": 1}})
    res = plan_job(cfg)
    assert res.best["pp"] == 8 and sum(res.best["stage_layers"]) == 22
