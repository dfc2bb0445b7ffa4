"""DeepSeek-V3 parity with transformers (DeepseekV3ForCausalLM made locally: latent attention with a q latent and
without one, interleaved RoPE under yarn with mscale, a dense first layer, eight routed experts in four groups with
the score correction, a shared expert), fp32, rtol = atol = 1e-5: logits, loss and every gradient at tp1, each
rank's at tp2 with sequence parallelism and at ep2; the FP8 form (block scales) read into the weights transformers'
dequantization gives; the export loads back with the same logits. The routers' weights are drawn wide, so the
routing is far from its ties (checked: the group and expert choices keep a 1e-4 margin)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from _hf_models import shape_of
from _hf_parity import build as _build

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH = 16, 2
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16,
              q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=64,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "rope_theta": 10000.0}, tie_word_embeddings=False)
VARIANTS = {"q-latent": {}, "no-q-latent": {"q_lora_rank": None}}


def _routing_margin(model, ids) -> float:
    """The smallest gap, over every routed token, between the last chosen and the first left-out group and expert."""
    gaps = []

    def hook(gate, args, _):
        scores = F.linear(args[0].reshape(-1, gate.hidden_dim).float(), gate.weight.float()).sigmoid()
        choice = scores + gate.e_score_correction_bias
        groups = choice.view(-1, gate.num_group, gate.num_experts // gate.num_group).topk(2, dim=-1).values.sum(-1)
        g = groups.topk(gate.topk_group + 1, dim=-1).values
        gaps.append(float((g[:, -2] - g[:, -1]).min()))
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(gate.topk_group, dim=-1).indices, 1.0).bool()
        allowed = choice.masked_fill(~keep.repeat_interleave(gate.num_experts // gate.num_group, 1), float("-inf"))
        e = allowed.topk(gate.top_k + 1, dim=-1).values
        gaps.append(float((e[:, -2] - e[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(ids[:, :-1])
    for h in handles:
        h.remove()
    return min(gaps)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**CONFIG, **VARIANTS[request.param]})).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp(request.param) / "m"
    model.save_pretrained(d)
    for seed in range(200):
        ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
        if _routing_margin(model, ids) > 1e-4:
            break
    assert _routing_margin(model, ids) > 1e-4
    logits = model(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"name": request.param, "dir": str(d), "model": model, "ids": ids, "logits": logits.detach(),
            "loss": loss.detach(), "grads": grads}


def _shape(model_dir):
    return shape_of(model_dir, SEQ)


def _reference_grad(ref, shape, name):
    """transformers' gradient of rayspeed parameter `name` (its in-memory experts are fused: gate_up, down)."""
    i = name.split(".")[1]
    prefix = f"model.layers.{i}.mlp.experts."
    f = shape.expert_ffn_hidden_size
    if name.endswith("mlp.w_gate"):
        return ref["grads"][prefix + "gate_up_proj"][:, :f]
    if name.endswith("mlp.w_up"):
        return ref["grads"][prefix + "gate_up_proj"][:, f:]
    if name.endswith("mlp.w_down"):
        return ref["grads"][prefix + "down_proj"]
    return ref["grads"][shape.family.tensor_names.hf_name(name)]


def test_the_shape_is_deepseek_v3s_and_counts_every_parameter(deepseek):
    shape = _shape(deepseek["dir"])
    assert (shape.architecture, shape.num_experts, shape.moe_layers, shape.expert_ffn_hidden_size) == (
        "DeepseekV3ForCausalLM", 8, (1, 2), 16)
    assert shape.router_aux_loss_coef == 0.0 and shape.norm_topk_prob
    assert (shape.rope_type, shape.rope_mscale_all_dim, shape.family_key("n_group")) == ("yarn", 1.0, 4)
    model = _build(shape, deepseek["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params
    assert sum(p.numel() for p in deepseek["model"].parameters()) + 2 * 8 == shape.params  # + the score biases


def test_tp1_logits_loss_and_gradients_match_transformers(deepseek):
    shape = _shape(deepseek["dir"])
    model = _build(shape, deepseek["dir"])
    ids = deepseek["ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), deepseek["logits"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), deepseek["loss"], **TOL)
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, _reference_grad(deepseek, shape, name), **TOL,
                                       msg=lambda m: f"{name}: {m}")
        else:
            assert name.endswith("router.score_bias") and p.grad is None


@pytest.mark.parametrize("change", ["score_bias", "groups", "shared", "interleave", "mscale"])
def test_each_routing_and_attention_detail_changes_the_logits(deepseek, change):
    """Each matters at this size, so the parity above cannot pass with one of them ignored."""
    shape = _shape(deepseek["dir"])
    keys = dict(shape.family_keys)
    if change == "groups":
        shape = dataclasses.replace(shape, family_keys=tuple(sorted({**keys, "topk_group": 4}.items())))
    if change == "interleave":
        shape = dataclasses.replace(shape, family_keys=tuple(sorted({**keys, "rope_interleave": False}.items())))
    if change == "mscale":
        shape = dataclasses.replace(shape, rope_mscale_all_dim=0.0)
    model = _build(shape, deepseek["dir"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (change == "score_bias" and name.endswith("score_bias")) or (change == "shared" and ".shared." in name):
                p.zero_()
        logits = model(deepseek["ids"][:, :-1])
    assert (logits - deepseek["logits"]).abs().max() > 10 * TOL["atol"]  # the tiny attention moves little


def test_the_export_loads_back_with_the_same_logits(deepseek, tmp_path):
    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = _shape(deepseek["dir"])
    write_hf_dir(_build(shape, deepseek["dir"]).full_state_dict(), shape, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert back.config.q_lora_rank == shape.family_key("q_lora_rank") and back.config.first_k_dense_replace == 1
    with torch.no_grad():
        torch.testing.assert_close(back(deepseek["ids"][:, :-1]).logits, deepseek["logits"], **TOL)


def _tp2_sp(rank, world, model_dir, ids):
    from rayspeed.parallel.groups import ParallelGroups

    shape = _shape(model_dir)
    model = _build(shape, model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return logits, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def test_tp2_with_sequence_parallelism_matches_transformers(deepseek):
    shape = _shape(deepseek["dir"])
    for rank, (logits, loss, grads) in enumerate(run_distributed(_tp2_sp, 2, deepseek["dir"], deepseek["ids"])):
        torch.testing.assert_close(logits, deepseek["logits"], **TOL)
        torch.testing.assert_close(loss, deepseek["loss"], **TOL)
        for name, grad in grads.items():
            whole = _reference_grad(deepseek, shape, name)
            dim = shape.family.tensor_names.partition_dim(name)
            if name.endswith(("mlp.w_gate", "mlp.w_up")):
                dim = 1
            elif name.endswith("mlp.w_down"):
                dim = 2
            want = whole if dim is None else whole.chunk(2, dim=dim)[rank]
            torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _ep2(rank, world, model_dir, ids):
    """rank's own row through ep2 against transformers on that row; an expert's gradient gathers both ranks' rows and
    the data-parallel mean divides by 2."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rayspeed.parallel.groups import ParallelGroups

    shape = _shape(model_dir)
    groups = ParallelGroups(dp=world, tp=1, pp=1, ep=world)
    row = ids[rank:rank + 1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = hf(row[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), row[:, 1:].reshape(-1))
    want.backward()
    ref = {"grads": {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}}
    model = _build(shape, model_dir, ep=groups.ep)
    loss = model(row[:, :-1], row[:, 1:])
    loss.backward()
    held = groups.ep.local_experts(shape.num_experts)
    out = {"loss": (loss.detach(), want.detach()), "grads": {}}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = _reference_grad(ref, shape, name).contiguous()
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(g)
            g = g[held.start:held.stop] / world
        out["grads"][name] = (p.grad.detach(), g)
    return out


def test_ep2_matches_transformers_on_each_ranks_tokens(deepseek):
    for rank, out in enumerate(run_distributed(_ep2, 2, deepseek["dir"], deepseek["ids"])):
        torch.testing.assert_close(*out["loss"], **TOL)
        assert any(n.endswith("mlp.w_gate") for n in out["grads"]) and any(".shared." in n for n in out["grads"])
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_the_fp8_form_reads_into_what_transformers_dequantizes(deepseek, tmp_path):
    """Every projection of the checkpoint as float8_e4m3 with a scale per 8 x 8 block (config.json's
    quantization_config, as the published checkpoints' 128 x 128): each rank's parameters, at tp1 and tp2, are the
    slices of transformers' dequantization."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    d = tmp_path / "fp8"
    d.mkdir()
    tensors = load_file(f"{deepseek['dir']}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    want = {}
    for name in [n for n in tensors if n.endswith("proj.weight") or "proj_with_mqa" in n]:
        rows, cols = tensors[name].shape
        tensors[name] = (torch.randn(rows, cols, generator=gen) * 4).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // 8), -(-cols // 8), generator=gen) + 0.5
        tensors[name + "_scale_inv"] = scale
        want[name] = _dequantize_fp8_weight(tensors[name], scale, [8, 8], torch.float32)
    save_file(tensors, str(d / "model.safetensors"))
    hf = json.loads(open(f"{deepseek['dir']}/config.json").read())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [8, 8]}
    (d / "config.json").write_text(json.dumps(hf))
    shape = _shape(str(d))
    names = shape.family.tensor_names
    params = dict(_build(shape, str(d)).named_parameters())
    checked = 0
    for name, p in params.items():
        experts = names.expert_names(name, shape.num_experts)
        if experts:
            torch.testing.assert_close(p.detach(), torch.stack([want[e] for e in experts]), rtol=0, atol=0)
            checked += 1
        elif names.hf_name(name) in want:
            torch.testing.assert_close(p.detach(), want[names.hf_name(name)], rtol=0, atol=0)
            checked += 1
    assert checked >= 3 * shape.num_layers
    for rank, tp_params in enumerate(run_distributed(_tp2_params, 2, str(d))):
        for name, value in tp_params.items():
            dim = names.partition_dim(name)
            torch.testing.assert_close(value, params[name].detach() if dim is None else
                                       params[name].detach().chunk(2, dim=dim)[rank], rtol=0, atol=0)


def _tp2_params(rank, world, model_dir):
    from rayspeed.parallel.groups import ParallelGroups

    model = _build(_shape(model_dir), model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "mlp.w_" not in n}


def test_context_parallelism_and_adapters_are_refused_naming_why(deepseek):
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.cp \(2\): DeepseekV3ForCausalLM's attention is its own"):
        parse({"model": {"seq_len": SEQ}, "cluster": {"num_workers": 2}},
              [f"model.pretrained={deepseek['dir']}", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"model.adapter: DeepseekV3ForCausalLM's attention is its own"):
        parse({"model": {"seq_len": SEQ, "adapter": {"type": "lora"}}}, [f"model.pretrained={deepseek['dir']}"])


def test_the_router_bias_update_moves_each_correction_toward_an_even_load(deepseek):
    """model.router_bias_update: after a step, each MoE layer's correction moves by +speed for an expert that took
    fewer tokens than the mean of the step's training forwards, -speed for one that took more (evaluation forwards
    and recomputations do not count); off for a family without corrections, at ZeRO-3 and below 0 (exit 2)."""
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError
    from rayspeed.train.events import TrainState
    from rayspeed.train.router_bias import RouterBiasUpdate

    shape = _shape(deepseek["dir"])
    model = _build(shape, deepseek["dir"]).train()
    ids = deepseek["ids"]
    model(ids[:, :-1], ids[:, 1:]).backward()
    with torch.no_grad():
        model(ids[:, :-1])  # evaluation: not counted
    update = RouterBiasUpdate(model, 0.01, None)
    assert len(update.layers) == len(shape.moe_layers)
    before = {i: m.router.score_bias.detach().clone() for i, m in enumerate(update.layers)}
    loads = {i: m.step_load.clone() for i, m in enumerate(update.layers)}
    assert all(float(load.sum()) == BATCH * SEQ * shape.experts_per_token for load in loads.values())
    update.on_step_end(TrainState(max_steps=1))
    for i, m in enumerate(update.layers):
        moved = m.router.score_bias.detach() - before[i]
        want = 0.01 * torch.sign(loads[i].mean() - loads[i])
        torch.testing.assert_close(moved, want, rtol=0, atol=1e-7)
        assert m.step_load is None
    job = {"name": "t", "cluster": {"num_workers": 1}}
    for sets, said in ((["model.router_bias_update=0.001"], "routes without a score correction"),
                       ([f"model.pretrained={deepseek['dir']}", "model.router_bias_update=-1"], "must be >= 0"),
                       ([f"model.pretrained={deepseek['dir']}", "model.router_bias_update=0.001",
                         "parallel.zero_stage=3"], "ZeRO-3 partitions")):
        with pytest.raises(ConfigError, match=said):
            parse({**job, "model": {"seq_len": SEQ}}, sets)
