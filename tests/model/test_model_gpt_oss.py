"""gpt-oss parity with transformers (GptOssForCausalLM made locally: sinks, biases on q, k, v, o, a sliding layer of
window 5 and a full one, yarn RoPE past 8 positions, head_dim 16 != hidden / heads, four experts with biases, the
router's bias, a swiglu_limit the tiny model's activations reach), fp32, rtol = atol = 1e-5: logits, the loss with
the pooled balance loss, every gradient at tp1; each rank's at tp2 with sequence parallelism, at ep2 and at pp2
(DeepSpeed's pipeline); LoRA on its attention against peft; the published MXFP4 form read into the weights
transformers' own dequantization gives; the export loads back into transformers with the same logits; context
parallelism refused naming the sinks. The test tokens' top-k router margins exceed 1e-4 (routing is
discontinuous)."""

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
SEQ, BATCH, COEF = 16, 2, 0.02
CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
              rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 8, "rope_theta": 150000.0},
              swiglu_limit=0.3, router_aux_loss_coef=COEF, output_router_logits=True, tie_word_embeddings=False)


def _margin(router_logits) -> float:
    top = torch.topk(router_logits.detach().float(), 3, dim=-1).values
    return float((top[:, 1] - top[:, 2]).min())


def _shape(model_dir):
    return shape_of(model_dir, SEQ)


def _reference(model, ids):
    out = model(ids[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    return out, ce + COEF * out.aux_loss


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(3)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG, attn_implementation="eager")).float()
    with torch.no_grad():  # every bias and sink away from zero; routers far from ties
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.3)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.2)
    d = tmp_path_factory.mktemp("gpt_oss") / "m"
    model.save_pretrained(d)
    for seed in range(100):
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
        out, loss = _reference(model, ids)
        if min(_margin(r) for r in out.router_logits) > 1e-4:
            break
    assert min(_margin(r) for r in out.router_logits) > 1e-4
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"dir": str(d), "model": model, "ids": ids, "logits": out.logits.detach(), "loss": loss.detach(),
            "aux": out.aux_loss.detach(), "grads": grads}


class _Grads:
    """transformers' gradients fetched by checkpoint name, as the weights' reader fetches tensors."""

    def __init__(self, grads):
        self.grads = grads

    def __call__(self, name):
        return self.grads[name]

    def shared(self, key, make):
        return make()


def _reference_grad(ref, shape, name, experts=None):
    """transformers' gradient of rayspeed parameter `name`, whole over tp (the experts' through the same reader)."""
    from rayspeed.config.hf_checkpoint import converted_params, stored_forms
    from rayspeed.model.families.gpt_oss_decoder import GptOssWeights

    if name in converted_params(shape):
        return GptOssWeights().read(name, stored_forms(shape)[0], _Grads(ref["grads"]),
                                    experts or range(shape.num_experts), shape)
    return ref["grads"][shape.family.tensor_names.hf_name(name)]


def test_the_shape_is_gpt_oss_and_counts_every_parameter(gpt_oss):
    shape = _shape(gpt_oss["dir"])
    assert (shape.architecture, shape.head_dim, shape.num_experts, shape.experts_per_token) == (
        "GptOssForCausalLM", 16, 4, 2)
    assert (shape.sliding_window, shape.layer_types, shape.rope_type, shape.rope_truncate) == (
        5, ("sliding_attention", "full_attention"), "yarn", False)
    assert shape.family_key("swiglu_limit") == 0.3 and shape.family_key("swiglu_alpha") == 1.702
    model = _build(shape, gpt_oss["dir"])
    assert sum(p.numel() for p in model.parameters()) == shape.params


def test_tp1_logits_loss_and_gradients_match_transformers(gpt_oss):
    shape = _shape(gpt_oss["dir"])
    model = _build(shape, gpt_oss["dir"])
    ids = gpt_oss["ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), gpt_oss["logits"], **TOL)
    torch.testing.assert_close(model.aux_loss, gpt_oss["aux"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), gpt_oss["loss"], **TOL)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _reference_grad(gpt_oss, shape, name), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("change", ["limit", "sinks", "window"])
def test_the_clamp_the_sinks_and_the_window_each_change_the_logits(gpt_oss, change):
    """Each matters at this size, so the parity above cannot pass with one of them ignored."""
    shape = _shape(gpt_oss["dir"])
    if change == "limit":
        shape = dataclasses.replace(shape, family_keys=(("swiglu_limit", 100.0),))
    if change == "window":
        shape = dataclasses.replace(shape, sliding_window=None, layer_types=())
    model = _build(shape, gpt_oss["dir"])
    if change == "sinks":
        with torch.no_grad():
            for block in model.layers:
                block.attn.sinks.fill_(-1e4)
    with torch.no_grad():
        logits = model(gpt_oss["ids"][:, :-1])
    assert (logits - gpt_oss["logits"]).abs().max() > 1e-3


def _pack_mxfp4(dense, gen):
    """Random MXFP4 blocks and scales of a [experts, out, in] shape (the values are whatever they decode to)."""
    e, rows, cols = dense
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_the_mxfp4_form_reads_into_what_transformers_dequantizes(gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shape = _shape(gpt_oss["dir"])
    d = tmp_path / "mxfp4"
    d.mkdir()
    tensors = load_file(f"{gpt_oss['dir']}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    e, h, f = shape.num_experts, shape.hidden_size, shape.expert_ffn_hidden_size
    want = {}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        for proj, dense in (("gate_up_proj", (e, 2 * f, h)), ("down_proj", (e, h, f))):
            del tensors[p + proj]
            blocks, scales = _pack_mxfp4(dense, gen)
            tensors[p + proj + "_blocks"], tensors[p + proj + "_scales"] = blocks, scales
            want[p + proj] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(json.loads(open(f"{gpt_oss['dir']}/config.json").read())))
    model = _build(shape, str(d))
    params = dict(model.named_parameters())
    for i in range(shape.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up, down = want[p + "gate_up_proj"], want[p + "down_proj"]
        torch.testing.assert_close(params[f"layers.{i}.mlp.w_gate"].detach(), gate_up[:, :, 0::2].transpose(1, 2))
        torch.testing.assert_close(params[f"layers.{i}.mlp.w_up"].detach(), gate_up[:, :, 1::2].transpose(1, 2))
        torch.testing.assert_close(params[f"layers.{i}.mlp.w_down"].detach(), down.transpose(1, 2))
    # A checkpoint with neither form whole is refused, naming both.
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(d / "model.safetensors"))
    from rayspeed.config.hf_checkpoint import weight_problems

    problems = weight_problems(str(d), shape)
    assert problems and "stored forms" in problems[0] and "down_proj_blocks" in problems[0]


def test_the_export_is_transformers_form_and_loads_to_the_same_logits(gpt_oss, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayspeed.model.hf_export import write_hf_dir

    shape = _shape(gpt_oss["dir"])
    write_hf_dir(_build(shape, gpt_oss["dir"]).full_state_dict(), shape, str(tmp_path / "out"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f, \
            safe_open(gpt_oss["dir"] + "/model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                attn_implementation="eager").eval()
    assert back.config.swiglu_limit == 0.3 and back.config.layer_types == CONFIG["layer_types"]
    with torch.no_grad():
        torch.testing.assert_close(back(gpt_oss["ids"][:, :-1]).logits, gpt_oss["logits"], **TOL)


def _tp2_sp(rank, world, model_dir, ids):
    from rayspeed.parallel.groups import ParallelGroups

    shape = _shape(model_dir)
    model = _build(shape, model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return logits, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_tp2_with_sequence_parallelism_matches_transformers(gpt_oss):
    shape = _shape(gpt_oss["dir"])
    results = run_distributed(_tp2_sp, 2, gpt_oss["dir"], gpt_oss["ids"])
    for rank, (logits, loss, grads) in enumerate(results):
        torch.testing.assert_close(logits, gpt_oss["logits"], **TOL)
        torch.testing.assert_close(loss, gpt_oss["loss"], **TOL)
        for name, grad in grads.items():
            whole = _reference_grad(gpt_oss, shape, name)
            dim = shape.family.tensor_names.partition_dim(name)
            want = whole if dim is None else whole.chunk(2, dim=dim)[rank]
            torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _ep2(rank, world, model_dir, ids):
    """rank's own row through ep2 against transformers on that row; an expert's gradient gathers both ranks' rows
    and the data-parallel mean divides by 2 (as test_expert_parallel's reference)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rayspeed.config.hf_checkpoint import converted_params
    from rayspeed.parallel.groups import ParallelGroups

    shape = _shape(model_dir)
    groups = ParallelGroups(dp=world, tp=1, pp=1, ep=world)
    row = ids[rank:rank + 1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    _, want = _reference(hf, row)
    want.backward()
    ref = {"grads": {n: p.grad.detach().clone() for n, p in hf.named_parameters()}}
    model = _build(shape, model_dir, ep=groups.ep)
    loss = model(row[:, :-1], row[:, 1:])
    loss.backward()
    held = groups.ep.local_experts(shape.num_experts)
    out = {"loss": (loss.detach(), want.detach()), "grads": {}}
    for name, p in model.named_parameters():
        g = _reference_grad(ref, shape, name).contiguous()
        if name in converted_params(shape):
            dist.all_reduce(g)
            g = g[held.start:held.stop] / world
        out["grads"][name] = (p.grad.detach(), g)
    return out


def test_ep2_matches_transformers_on_each_ranks_tokens(gpt_oss):
    for rank, out in enumerate(run_distributed(_ep2, 2, gpt_oss["dir"], gpt_oss["ids"])):
        torch.testing.assert_close(*out["loss"], **TOL)
        assert any(n.endswith("b_gate") for n in out["grads"])
        for name, (got, want) in out["grads"].items():
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def _pp2(rank, world, model_dir, ids):
    """DeepSpeed's pipeline engine over the two blocks: eval_batch's loss (every stage), then one train_batch (lr 0)
    for this stage's gradients as they accumulate, by Transformer name (the stages send the router statistics
    beside the hidden states: _hf_parity's stage-by-stage logits do not apply)."""
    import deepspeed

    from _hf_parity import init_deepspeed_gloo
    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.decoder import canonical_named_parameters
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import deferred_init

    init_deepspeed_gloo()
    shape = _shape(model_dir)
    with deferred_init():
        module = build_pipeline_module(shape, ParallelGroups(dp=1, tp=1, pp=2), num_stages=2,
                                       partition_method="type:Block")
    load_hf_weights(module, model_dir, shape)
    batch = (ids[:, :-1], ids[:, 1:])
    config = {"train_micro_batch_size_per_gpu": ids.shape[0], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                           config=config)
    loss = engine.eval_batch(iter([batch])).detach().float().reshape(())
    grads: dict = {}
    for name, p in canonical_named_parameters(module):
        p.register_post_accumulate_grad_hook(lambda q, k=name: grads.__setitem__(k, q.grad.detach().clone()))
    engine.train_batch(iter([batch]))
    return loss, grads


def test_pp2_matches_transformers(gpt_oss):
    """DeepSpeed's pipeline, one block a stage: every stage's loss (the language model's: evaluation adds no balance
    loss) and every stage's gradients of a training step (the balance loss pooled over both stages' routers, as
    transformers pools it)."""
    shape = _shape(gpt_oss["dir"])
    logits = gpt_oss["logits"]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), gpt_oss["ids"][:, 1:].reshape(-1))
    seen = set()
    for rank, (loss, grads) in enumerate(run_distributed(_pp2, 2, gpt_oss["dir"], gpt_oss["ids"])):
        torch.testing.assert_close(loss, ce, **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, _reference_grad(gpt_oss, shape, name), **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        seen |= set(grads)
    assert seen == {n for n in _build(shape, gpt_oss["dir"]).state_dict()}


def test_context_parallelism_and_foreign_family_keys_are_refused_naming_why(gpt_oss):
    from rayspeed.config.load import parse
    from rayspeed.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.cp \(2\): GptOssForCausalLM's attention sinks"):
        parse({"model": {"seq_len": SEQ}, "cluster": {"num_workers": 2}},
              [f"model.pretrained={gpt_oss['dir']}", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"model.family_keys: 'swiglu_limit' is not a key LlamaForCausalLM reads"):
        parse({"model": {"seq_len": SEQ, "family_keys": {"swiglu_limit": 1.0}}})


def test_lora_on_its_attention_matches_peft(gpt_oss):
    """`targets: all` adapts q, k, v and o of every block (the experts and routers stay frozen, as for every MoE
    family); logits, language + balance loss and every adapter gradient equal peft's on transformers' model."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters import peft_files
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.adapters.lora import LoraAdapter
    from rayspeed.config.schema import AdapterConfig

    shape, adapter = _shape(gpt_oss["dir"]), AdapterConfig(type="lora", rank=4, alpha=8.0, targets=["all"])
    model = _build(shape, gpt_oss["dir"])
    assert sorted(add_adapters(model, adapter, seed=1)) == sorted(
        f"layers.{i}.attn.{w}" for i in range(shape.num_layers) for w in ("wq", "wk", "wv", "wo"))
    with torch.no_grad():  # B starts at zero: its gradients alone would not see A
        for m in model.modules():
            if isinstance(m, LoraAdapter):
                m.lora_B.normal_(0.0, 0.1)
    hf = AutoModelForCausalLM.from_pretrained(gpt_oss["dir"], dtype=torch.float32, attn_implementation="eager")
    peft = get_peft_model(hf, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha,
                                         target_modules=peft_files.target_modules(adapter, shape)))
    assert not set_peft_model_state_dict(peft, peft_files.peft_state(model.full_state_dict(), shape)).unexpected_keys
    ids = gpt_oss["ids"]
    out, want = _reference(peft, ids)
    assert min(_margin(r) for r in out.router_logits) > 1e-4
    want.backward()
    ref = {n.replace(".default.", "."): p.grad for n, p in peft.named_parameters() if p.requires_grad}
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), out.logits.detach(), **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), want.detach(), **TOL)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and len(grads) == len(ref)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[peft_files.peft_key(n, shape)], **TOL, msg=lambda m: f"{n}: {m}")
