"""Expert parallelism against the same model with every expert on every rank (2 gloo ranks, ep2, fp32, rtol = atol =
1e-5), for Qwen3-MoE (a dense layer among the sparse ones) and Mixtral: each rank's logits, loss and balance loss on
its own tokens, and every gradient: the router's and the dense weights' are the rank's own, an expert's is the mean
over the ep ranks of what each rank's tokens gave it (they all reach the rank that holds it; the data-parallel
reduction over the ranks holding the same experts completes the mean over dp). The unsharded model is itself
parity-tested against transformers (test_moe_parity.py). The group layout is checked as arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from _dist import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
SHAPES = {
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", head_dim=16, num_experts=4, expert_ffn_hidden_size=24,
                      norm_topk_prob=False, moe_layers=[0, 2]),
    "mixtral": dict(architecture="MixtralForCausalLM", num_experts=4),
}


def _shape(family):
    from rayspeed.config.shape import ModelShape

    return ModelShape.from_config(SimpleNamespace(
        hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, vocab_size=64, seq_len=16,
        tie_embeddings=False, experts_per_token=2, router_aux_loss_coef=0.1, **SHAPES[family]))


def _ep_against_unsharded(rank, world, family):
    import torch
    import torch.distributed as dist

    from rayspeed.model.moe import MoE
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.groups import ParallelGroups

    groups = ParallelGroups(dp=world, tp=1, pp=1, ep=world)
    shape = _shape(family)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(11 + rank))  # each rank its own
    ref = Transformer(shape, seed=5)
    want = ref(ids[:, :-1], ids[:, 1:])
    want.backward()
    want_logits = ref(ids[:, :-1]).detach()
    model = Transformer(shape, seed=5)
    for m in model.modules():
        if isinstance(m, MoE):
            m.shard_experts(groups.ep)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    out = {"loss": (loss.detach(), want.detach()), "aux": (model.aux_loss, ref.aux_loss),
           "logits": (model(ids[:, :-1]).detach(), want_logits), "grads": {}}
    held = groups.ep.local_experts(shape.num_experts)
    wanted = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = wanted[name].grad.clone()
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(g)  # every rank's tokens reach the experts this rank holds
            g = g[held.start:held.stop] / world
        out["grads"][name] = (p.grad.detach(), g)
    return out


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_ep2_equals_every_expert_on_every_rank(family):
    import torch

    for rank, out in enumerate(run_distributed(_ep_against_unsharded, 2, family)):
        for key in ("loss", "aux", "logits"):
            torch.testing.assert_close(*out[key], **TOL, msg=lambda m: f"rank {rank} {key}: {m}")
        assert any("w_gate" in n for n in out["grads"])
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _tp_against_unsharded(rank, world, family, ep, sp):
    import torch
    import torch.distributed as dist

    from rayspeed.model.moe import MoE
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import gather_full

    groups = ParallelGroups(dp=world // 2, tp=2, pp=1, ep=ep)
    shape = _shape(family)
    seed = torch.Generator().manual_seed(11 + groups.dp_rank)  # each data-parallel replica its own tokens
    ids = torch.randint(0, 64, (2, 17), generator=seed)
    ref = Transformer(shape, seed=5)
    want = ref(ids[:, :-1], ids[:, 1:])
    want.backward()
    want_logits = ref(ids[:, :-1]).detach()
    model = Transformer(shape, tp=groups.tp, sequence_parallel=sp, seed=5)
    for m in model.modules():
        if isinstance(m, MoE):
            m.shard_experts(groups.ep)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    out = {"loss": (loss.detach(), want.detach()), "aux": (model.aux_loss, ref.aux_loss),
           "logits": (model(ids[:, :-1]).detach(), want_logits), "grads": {}}
    held = groups.ep.local_experts(shape.num_experts)
    wanted = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = wanted[name].grad.clone()
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(g, group=groups.ep.group)  # the same tensor slice of every ep rank's tokens
            g = g[held.start:held.stop] / ep
        out["grads"][name] = (gather_full(p.grad, p, groups.tp), g)
    return out


@pytest.mark.parametrize("family,ep,sp", [("qwen3_moe", 2, False), ("mixtral", 2, True), ("qwen3_moe", 1, True)])
def test_experts_split_over_tp_equal_every_expert_whole_on_every_rank(family, ep, sp):
    """tp2 x ep2 (4 ranks: each expert's width over tp, the experts over ep) and tp2 alone, with and without
    sequence parallelism: logits, loss, balance loss and every gradient (gathered over tp) as the unsplit model."""
    import torch

    for rank, out in enumerate(run_distributed(_tp_against_unsharded, 2 * ep, family, ep, sp)):
        for key in ("loss", "aux", "logits"):
            torch.testing.assert_close(*out[key], **TOL, msg=lambda m: f"rank {rank} {key}: {m}")
        assert any("w_down" in n for n in out["grads"])
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_expert_groups_are_carved_out_of_data_parallel():
    from rayspeed.parallel.groups import layout

    g = layout(dp=4, tp=2, pp=1, ep=2)
    assert g["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]  # ep consecutive dp ranks of one tensor slice
    assert g["edp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]  # the same experts in every ep group
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        layout(dp=4, tp=1, pp=1, ep=3)


def test_an_ep_change_converts_at_zero_1_and_2_and_is_refused_elsewhere_naming_the_layout_to_resume_at():
    from rayspeed.checkpoint.resume import refuse_expert_conversion

    written = {"layout": {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 2, "cp": 1, "ep": 4}}
    refuse_expert_conversion(written, {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 2, "cp": 1, "ep": 4}, "ckpt")
    refuse_expert_conversion({"layout": {**written["layout"], "zero_stage": 0}},  # ZeRO-0: files per ep rank
                             {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 0, "cp": 1, "ep": 4}, "ckpt")
    refuse_expert_conversion({"layout": {"dp": 4, "zero_stage": 2}}, {"dp": 2, "zero_stage": 2, "ep": 1}, "ckpt")
    for now in ({"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "cp": 1, "ep": 2},  # the universal conversion
                {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 1, "cp": 1, "ep": 4}):
        refuse_expert_conversion(written, now, "ckpt")
    for before, now in ((0, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "cp": 1, "ep": 2}),
                        (2, {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "cp": 1, "ep": 4}),
                        (3, {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "cp": 1, "ep": 4})):
        with pytest.raises(RuntimeError, match="resume with parallel.zero_stage: 1 or 2 on both sides, or "
                                               "parallel.ep: 4 and parallel.dp: 4"):
            refuse_expert_conversion({"layout": {**written["layout"], "zero_stage": before}}, now, "ckpt")
    at_tp2 = {"layout": {**written["layout"], "tp": 2, "dp": 2, "ep": 2}}
    refuse_expert_conversion(at_tp2, dict(at_tp2["layout"]), "ckpt")  # the same layout: nothing converts
    with pytest.raises(RuntimeError, match="expert shards convert between layouts at tp 1 only; resume with "
                                           "parallel.ep: 2, parallel.tp: 2 and parallel.dp: 2"):
        refuse_expert_conversion(at_tp2, {**at_tp2["layout"], "dp": 4, "ep": 4}, "ckpt")


def _pretrained_under_ep(rank, world, model_dir, tp=1):
    import logging

    from rayspeed.config import parse
    from rayspeed.engine.build import build_model
    from rayspeed.parallel.groups import ParallelGroups

    cfg = parse({"name": "ep-load", "model": {"pretrained": model_dir, "seq_len": 16},
                 "train": {"global_batch_size": 4, "precision": "fp32"},
                 "parallel": dict(dp=world // tp, ep=world // tp, tp=tp, pp=1, cp=1, zero_stage=0,
                                  micro_batch_size=2, grad_accum=1),
                 "cluster": {"num_workers": world}})
    reports = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.args)
    logging.getLogger("rayspeed.engine.build").addHandler(handler)
    logging.getLogger("rayspeed.engine.build").setLevel(logging.INFO)
    model = build_model(cfg, ParallelGroups(dp=world // tp, tp=tp, pp=1, ep=world // tp))
    return {"elements": reports[-1][2], "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_a_pretrained_mixture_sharded_over_ep_reads_only_each_ranks_experts(tmp_path):
    import torch
    import transformers

    torch.manual_seed(2)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2)
    hf = transformers.MixtralForCausalLM(config)
    hf.save_pretrained(tmp_path / "mixtral")
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    hub = hf.state_dict()
    for rank, out in enumerate(run_distributed(_pretrained_under_ep, 2, str(tmp_path / "mixtral"))):
        assert out["elements"] == total - experts // 2, rank  # its two experts of four, and every other weight
        for layer in range(2):
            gate = out["params"][f"layers.{layer}.mlp.w_gate"]
            assert gate.shape[0] == 2
            fused = hub[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [experts, 2 x ffn, hidden]
            torch.testing.assert_close(gate, fused[2 * rank:2 * rank + 2, :48], rtol=0, atol=0)
    # tp2 x ep2: each rank reads its experts' rows of its tp slice (gate and up by rows, down by columns)
    for rank, out in enumerate(run_distributed(_pretrained_under_ep, 4, str(tmp_path / "mixtral"), 2)):
        ep_rank, tp_rank = rank // 2, rank % 2
        for layer in range(2):
            fused = hub[f"model.layers.{layer}.mlp.experts.gate_up_proj"][2 * ep_rank:2 * ep_rank + 2]
            down = hub[f"model.layers.{layer}.mlp.experts.down_proj"][2 * ep_rank:2 * ep_rank + 2]
            rows = slice(24 * tp_rank, 24 * tp_rank + 24)
            p = out["params"]
            torch.testing.assert_close(p[f"layers.{layer}.mlp.w_gate"], fused[:, :48][:, rows], rtol=0, atol=0)
            torch.testing.assert_close(p[f"layers.{layer}.mlp.w_up"], fused[:, 48:][:, rows], rtol=0, atol=0)
            torch.testing.assert_close(p[f"layers.{layer}.mlp.w_down"], down[:, :, rows], rtol=0, atol=0)
