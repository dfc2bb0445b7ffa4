"""LoRA, rsLoRA and DoRA parity with peft on the same base (a Qwen2 checkpoint made locally: q/k/v biases, so DoRA's
base output without its bias is exercised) and the same adapter weights, fp32, rtol = atol = 1e-5: logits, loss and
every adapter gradient at tp1, at tp2 with sequence parallelism (each rank's shard of each gradient) and at pp2 (the
two stages run by hand, the activation and its gradient sent between them); the PEFT folder rayspeed writes loads
in peft (PeftModel.from_pretrained) to the same logits. Dropout 0: the parity of dropout masks is not claimed
against peft (different draws), only between rayspeed's layouts: tp2 with sequence parallelism draws tp1's masks
(test_dropout_masks_are_tp1s_at_tp2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from _hf_models import QWEN, save, shape_of
from _hf_parity import TOL, build, init_deepspeed_gloo, shard, tokens

SEQ, BATCH = 16, 2
VARIANTS = {"lora": dict(), "rslora": dict(rslora=True), "dora": dict(dora=True),
            # per-role ranks and alphas (peft's rank_pattern / alpha_pattern): a row and a column layer each
            "patterns": dict(rslora=True, rank_pattern={"q": 8, "down": 2}, alpha_pattern={"v": 2.0, "down": 6.0})}


def _adapter(variant, targets=("all",)):
    from rayspeed.config.schema import AdapterConfig

    return AdapterConfig(type="lora", rank=4, alpha=8.0, targets=list(targets), **VARIANTS[variant])


def _ids():
    return tokens(256, BATCH, SEQ, 5)


def randomize_b(model) -> None:
    """Every lora_B from N(0, 0.1) drawn whole from its name (B starts at zero: its gradients alone would not
    see A), this rank's shard kept: the same adapter on every layout."""
    from rayspeed.adapters.lora import LoraAdapter
    from rayspeed.parallel.layers import full_normal

    for m in model.modules():
        if isinstance(m, LoraAdapter):
            full = full_normal((m.out_features, m.rank), 0.1, 7, m.name)
            m.lora_B.data.copy_(shard(full, 0 if (m.tp.enabled and not m.row) else None, m.tp.rank,
                                      m.tp.world_size))


def adapted(shape, model_dir, adapter, tp=None, sp=False):
    from rayspeed.adapters.attach import add_adapters

    model = build(shape, model_dir, tp, sp)
    add_adapters(model, adapter, tp, sp, seed=1)
    randomize_b(model)
    return model


def peft_reference(model_dir, state, adapter, shape):
    """peft's logits, loss and adapter gradients with rayspeed's adapter weights (whole) loaded into it."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters import peft_files

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, use_rslora=adapter.rslora, use_dora=adapter.dora,
                        target_modules=peft_files.target_modules(adapter, shape),
                        **peft_files.patterns(adapter, shape))
    peft = get_peft_model(hf, config)
    result = set_peft_model_state_dict(peft, peft_files.peft_state(state, shape))
    assert not result.unexpected_keys
    return peft_pass(peft)


def peft_pass(peft):
    """A peft model's logits, loss and adapter gradients (under their saved keys) on the tokens."""
    ids = _ids()
    logits = peft(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {_saved_key(n): p.grad.detach().clone() for n, p in peft.named_parameters() if p.requires_grad}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def tp1_against(model, ref):
    """rayspeed's logits and loss at tp1 checked against peft's `ref`; returns its adapter gradients."""
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), ref["logits"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    loss.backward()
    return _adapter_grads(model.named_parameters())


def _saved_key(name: str) -> str:
    """peft's parameter name -> its key in adapter_model.safetensors (the adapter name dropped)."""
    if name.endswith("lora_magnitude_vector.default.weight"):
        return name[: -len(".default.weight")]
    return name.replace(".default.", ".")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen") / "m"
    save(d, QWEN, seed=3)
    return str(d)


def _adapter_grads(named):
    return {n: (p.grad.detach().clone(), getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel",
                                                                                    False) else None)
            for n, p in named if p.requires_grad}


def _check_grads(grads, ref, shape, rank=0, world=1, where=""):
    from rayspeed.adapters import peft_files

    assert grads and all(peft_files.is_adapter(n) for n in grads)
    for name, (g, dim) in grads.items():
        want = shard(ref["grads"][peft_files.peft_key(name, shape)], dim, rank, world)
        torch.testing.assert_close(g, want, **TOL, msg=lambda m: f"{where} {name}: {m}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp1_logits_loss_and_adapter_gradients_match_peft(base, variant):
    shape = shape_of(base, SEQ)
    model = adapted(shape, base, _adapter(variant))
    ref = peft_reference(base, model.full_state_dict(), _adapter(variant), shape)
    grads = tp1_against(model, ref)
    assert len(grads) == len(ref["grads"]) == 2 * 7 * shape.num_layers + (7 * shape.num_layers if variant == "dora"
                                                                           else 0)
    _check_grads(grads, ref, shape)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the base is frozen


def _pp2(shape, model_dir, adapter):
    """pp2 by hand: stage 0 sends its activation, stage 1 computes the logits and loss and sends the activation's
    gradient back; (logits or None, loss or None, this stage's adapter gradients)."""
    import torch.distributed as dist

    from rayspeed.adapters.attach import add_adapters
    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.decoder import canonical_named_parameters
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import deferred_init

    groups = ParallelGroups(dp=1, tp=1, pp=2)
    with deferred_init():
        module = build_pipeline_module(shape, groups, num_stages=2, partition_method="type:Block")
    load_hf_weights(module, model_dir, shape)
    add_adapters(module, adapter, seed=1)
    randomize_b(module)
    ids = _ids()
    inputs, labels = ids[:, :-1], ids[:, 1:]
    logits = loss = None
    if groups.pp_rank == 0:
        out = module(inputs)
        dist.send(out.detach().contiguous(), dst=1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=1)
        out.backward(grad)
    else:
        full = torch.empty(inputs.shape[0], inputs.shape[1], shape.hidden_size)
        dist.recv(full, src=0)
        full.requires_grad_(True)
        hidden, weight = module(full)
        logits = F.linear(hidden, weight)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        dist.send(full.grad.contiguous(), dst=0)
        logits, loss = logits.detach(), loss.detach()
    return logits, loss, _adapter_grads(canonical_named_parameters(module))


def _ranks(rank, world_size, model_dir, variant):
    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    model = adapted(shape, model_dir, _adapter(variant), ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    state = model.full_state_dict()
    ids = _ids()
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    tp2 = (logits, loss.detach(), _adapter_grads(model.named_parameters()))
    return state if rank == 0 else None, tp2, _pp2(shape, model_dir, _adapter(variant))


def _all_ranks(rank, world_size, base, phi3, made):
    """Every two-rank case of this module in one gloo world (one start of two processes, not eight): each variant
    at tp2 + sp and pp2 on the Qwen2 base and Phi-3's fused projections, tp1's dropout masks at tp2, a PEFT-made
    adapter continued at tp2."""
    init_deepspeed_gloo()
    return {"qwen": {v: _ranks(rank, world_size, base, v) for v in VARIANTS},
            "phi3": {v: _ranks(rank, world_size, phi3, v) for v in ("lora", "dora")},
            "dropout": _dropout_ranks(rank, world_size, base),
            "continued": _continued(rank, world_size, base, made, "patterns")}


@pytest.fixture(scope="module")
def two_ranks(base, phi3_base, tmp_path_factory):
    """(the two ranks' results of _all_ranks, the PEFT-made adapter's folder and peft's logits with it)."""
    made = str(tmp_path_factory.mktemp("made") / "peft")
    want = _made_by_peft(base, made, _adapter("patterns"), shape_of(base, SEQ))
    return run_distributed(_all_ranks, 2, base, phi3_base, made, timeout_s=600), made, want


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_sequence_parallel_and_pp2_match_peft(base, two_ranks, variant):
    shape = shape_of(base, SEQ)
    results = [r["qwen"][variant] for r in two_ranks[0]]
    ref = peft_reference(base, results[0][0], _adapter(variant), shape)
    pp_names = set()
    for rank, (_, (logits, loss, grads), (pp_logits, pp_loss, pp_grads)) in enumerate(results):
        torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"tp2 rank {rank} logits: {m}")
        torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"tp2 rank {rank} loss: {m}")
        assert len(grads) == len(ref["grads"])
        _check_grads(grads, ref, shape, rank, 2, where=f"tp2 rank {rank}")
        _check_grads(pp_grads, ref, shape, where=f"pp2 stage {rank}")
        pp_names |= set(pp_grads)
        if rank == 1:
            torch.testing.assert_close(pp_logits, ref["logits"], **TOL)
            torch.testing.assert_close(pp_loss, ref["loss"], **TOL)
    assert len(pp_names) == len(ref["grads"])  # the two stages hold every adapter once


@pytest.mark.parametrize("variant", ["dora", "patterns"])
def test_the_peft_folder_loads_in_peft_to_the_same_logits(base, tmp_path, variant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters.peft_files import write_peft_dir

    shape = shape_of(base, SEQ)
    adapter = _adapter(variant, targets=("q", "v", "down"))
    model = adapted(shape, base, adapter).eval()
    write_peft_dir(model.full_state_dict(), adapter, shape, str(tmp_path / "peft"), base)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(tmp_path / "peft")).eval()
    ids = _ids()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), **TOL)
    assert sorted(loaded.peft_config["default"].target_modules) == ["down_proj", "q_proj", "v_proj"]
    if variant == "patterns":  # peft read the per-module ranks and alphas from adapter_config.json
        q = loaded.base_model.model.model.layers[0].self_attn.q_proj
        assert q.r["default"] == 8 and loaded.base_model.model.model.layers[0].mlp.down_proj.r["default"] == 2
        assert loaded.base_model.model.model.layers[0].self_attn.v_proj.scaling["default"] == 2.0 / 2.0


def _dropout_run(model, ids):
    model.train()
    torch.manual_seed(3)  # every rank's generator, as the job seeds it
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), _adapter_grads(model.named_parameters())


def _dropout_ranks(rank, world_size, model_dir):
    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    adapter = _adapter("lora")
    adapter.dropout = 0.3
    return _dropout_run(adapted(shape, model_dir, adapter, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True), _ids())


def test_dropout_masks_are_tp1s_at_tp2(base, two_ranks):
    shape = shape_of(base, SEQ)
    adapter = _adapter("lora")
    adapter.dropout = 0.3
    loss, grads = _dropout_run(adapted(shape, base, adapter), _ids())
    with torch.no_grad():
        plain = adapted(shape, base, _adapter("lora"))(_ids()[:, :-1], _ids()[:, 1:])
    assert abs(loss - plain) > 1e-4  # dropout changed the loss
    for rank, (loss2, grads2) in enumerate(r["dropout"] for r in two_ranks[0]):
        torch.testing.assert_close(loss2, loss, **TOL)
        for name, (g, dim) in grads2.items():
            torch.testing.assert_close(g, shard(grads[name][0], dim, rank, 2), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("trainable", [["embed", "norms"], ["head"]])
def test_modules_trained_in_full_go_to_peft_as_modules_to_save(tmp_path, trainable):
    """A tied embedding (and so the head) and every norm trained in full: peft's modules_to_save, the tie kept."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from _hf_models import LLAMA_TIED
    from rayspeed.adapters.peft_files import write_peft_dir
    from rayspeed.config.schema import AdapterConfig

    d = tmp_path / "tied"
    save(d, LLAMA_TIED, seed=4)
    shape = shape_of(str(d), SEQ)
    adapter = AdapterConfig(type="lora", rank=4, alpha=8.0, targets=["q", "v"], trainable=trainable)
    model = adapted(shape, str(d), adapter).eval()
    with torch.no_grad():  # what training in full would have changed
        model.embed.weight.add_(0.05)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "norms" in trainable:
                p.mul_(1.5)
    write_peft_dir(model.full_state_dict(), adapter, shape, str(tmp_path / "peft"), str(d))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32),
                                       str(tmp_path / "peft")).eval()
    ids = _ids()[:, :-1]
    with torch.no_grad():  # (only the tied head trained: the embedding is the same matrix, saved once with its tie)
        torch.testing.assert_close(loaded(ids).logits, model(ids), **TOL)
    assert loaded.peft_config["default"].modules_to_save  # written, not dropped


def _made_by_peft(model_dir, out, adapter, shape):
    """An adapter peft made and saved itself (random A and B: init_lora_weights=False), as a TRL or Axolotl run
    leaves one; its logits on the tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters import peft_files

    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(hf, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, use_rslora=adapter.rslora,
                                         target_modules=peft_files.target_modules(adapter, shape),
                                         init_lora_weights=False, **peft_files.patterns(adapter, shape)))
    peft.save_pretrained(out)
    with torch.no_grad():
        return peft.eval()(_ids()[:, :-1]).logits


def _continued(rank, world_size, model_dir, folder, variant):
    from rayspeed.adapters.peft_files import load_peft_dir
    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    tp = ParallelGroups(dp=1, tp=2, pp=1).tp
    model = adapted(shape, model_dir, _adapter(variant), tp, sp=True)
    assert load_peft_dir(model, folder, shape, tp) == 2 * 7 * shape.num_layers
    with torch.no_grad():
        return model.eval()(_ids()[:, :-1])


def test_an_adapter_peft_made_continues_in_rayspeed_at_tp1_and_tp2(base, two_ranks):
    """train.init_from a PEFT folder: its tensors go into rayspeed's adapters (each rank's shard) and give peft's
    logits."""
    from rayspeed.adapters.peft_files import load_peft_dir

    shape = shape_of(base, SEQ)
    results, made, want = two_ranks
    model = adapted(shape, base, _adapter("patterns"))
    load_peft_dir(model, made, shape)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(_ids()[:, :-1]), want, **TOL)
    for r in results:
        torch.testing.assert_close(r["continued"], want, **TOL)


@pytest.fixture(scope="module")
def phi3_base(tmp_path_factory):
    from _hf_models import PHI3

    d = tmp_path_factory.mktemp("phi3") / "m"
    save(d, PHI3, seed=3)
    return str(d)


def _fused_want(ref, name, shape):
    """peft's gradient for rayspeed parameter `name`: of a fused projection (Phi-3's qkv_proj), the one A's, or this
    part's rows of its B and magnitude."""
    from rayspeed.adapters import peft_files
    from rayspeed.config import adapter as spec

    g = ref["grads"][peft_files.peft_key(name, shape)]
    layer, _, kind = name.partition(".adapter.")
    names = shape.family.tensor_names
    parts = [p[: -len(".weight")] for p in names.fused_parts(names.hf_name(f"{layer}.weight"))]
    if not parts or kind == "lora_A":
        return g
    rows = [spec.role_dims(shape)[spec.role_of(p)][1] for p in parts]
    return g.split(rows, dim=0)[parts.index(layer)]


def _check_fused(grads, ref, shape, rank=0, world=1, where=""):
    assert sum(n.endswith("lora_A") for n in grads) == 4 * shape.num_layers  # qkv_proj, o, gate_up_proj, down
    for name, (g, dim) in grads.items():
        want = shard(_fused_want(ref, name, shape), dim, rank, world)
        torch.testing.assert_close(g, want, **TOL, msg=lambda m: f"{where} {name}: {m}")


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_phi3s_fused_projections_carry_peft_one_adapter_each(phi3_base, two_ranks, variant):
    """Phi-3 fuses q, k, v (qkv_proj) and gate, up (gate_up_proj): peft has one adapter on each; rayspeed's parts
    share its A and hold their rows of its B, the same function at tp1, tp2 + sp and pp2."""
    shape = shape_of(phi3_base, SEQ)
    model = adapted(shape, phi3_base, _adapter(variant))
    ref = peft_reference(phi3_base, model.full_state_dict(), _adapter(variant), shape)
    _check_fused(tp1_against(model, ref), ref, shape, where="tp1")
    for rank, (_, (logits, loss, grads), (pp_logits, pp_loss, pp_grads)) in enumerate(
            r["phi3"][variant] for r in two_ranks[0]):
        torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"tp2 rank {rank} logits: {m}")
        torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"tp2 rank {rank} loss: {m}")
        _check_fused(grads, ref, shape, rank, 2, where=f"tp2 rank {rank}")
        for name, (g, dim) in pp_grads.items():
            torch.testing.assert_close(g, _fused_want(ref, name, shape), **TOL, msg=lambda m: f"pp2 {name}: {m}")
        if rank == 1:
            torch.testing.assert_close(pp_logits, ref["logits"], **TOL)
            torch.testing.assert_close(pp_loss, ref["loss"], **TOL)


def test_a_phi3_adapter_peft_made_continues_and_merges(phi3_base, tmp_path):
    from rayspeed.adapters.merge import merged
    from rayspeed.adapters.peft_files import load_peft_dir
    from rayspeed.model.hf_weights import read_whole

    shape = shape_of(phi3_base, SEQ)
    want = _made_by_peft(phi3_base, str(tmp_path / "made"), _adapter("lora"), shape)
    model = adapted(shape, phi3_base, _adapter("lora"))
    load_peft_dir(model, str(tmp_path / "made"), shape)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(_ids()[:, :-1]), want, **TOL)
    state = {n: p.detach() for n, p in model.named_parameters() if ".adapter." in n}  # one A per fused projection
    assert "layers.0.attn.wk.adapter.lora_A" not in state and "layers.0.attn.wk.adapter.lora_B" in state
    whole = merged({**read_whole(phi3_base, shape), **state}, _adapter("lora"), shape.family)
    a, b = state["layers.0.attn.wq.adapter.lora_A"], state["layers.0.attn.wk.adapter.lora_B"]
    torch.testing.assert_close(whole["layers.0.attn.wk.weight"],
                               read_whole(phi3_base, shape)["layers.0.attn.wk.weight"] + 2.0 * b @ a, **TOL)


def test_a_peft_adapter_with_modules_trained_in_full_continues(base, tmp_path):
    """train.init_from a PEFT adapter with modules_to_save (the embedding and every norm trained in full, as peft
    saves them): rayspeed takes them into the job's modules trained in full and gives peft's logits; a job that
    trains other modules in full than the adapter did is exit 2 naming model.adapter.trainable."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rayspeed.adapters.peft_files import load_peft_dir
    from rayspeed.config.adapter import init_adapter_problems
    from rayspeed.config.schema import AdapterConfig

    shape = shape_of(base, SEQ)
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"],
                                         modules_to_save=["embed_tokens", "norm"], init_lora_weights=False))
    with torch.no_grad():  # what training them in full changed: peft's trained copies only
        for name, p in peft.named_parameters():
            if "modules_to_save" in name:
                p.mul_(1.5).add_(0.01)
    made = str(tmp_path / "made")
    peft.save_pretrained(made)
    ids = _ids()[:, :-1]
    with torch.no_grad():
        want = peft.eval()(ids).logits
    adapter = AdapterConfig(type="lora", rank=4, alpha=8.0, targets=["q", "v"], trainable=["embed", "norms"])
    job = SimpleNamespace(train=SimpleNamespace(init_from=made),
                          model=SimpleNamespace(adapter=adapter, pretrained=base))
    assert init_adapter_problems(job, shape) == []
    model = adapted(shape, base, adapter)
    full = {n: p for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B"))}
    copied = load_peft_dir(model, made, shape, full_params=full)
    norms = 2 * shape.num_layers + 1
    assert copied == 2 * 2 * shape.num_layers + 1 + norms  # A and B of q, v per layer; the embedding; the norms
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), want, **TOL)
    other = SimpleNamespace(train=job.train, model=SimpleNamespace(adapter=AdapterConfig(
        type="lora", rank=4, alpha=8.0, targets=["q", "v"], trainable=["norms"]), pretrained=base))
    (problem,) = init_adapter_problems(other, shape)
    assert problem.startswith("model.adapter.trainable: ['norms'] here, ['embed', 'norms'] trained in full"), problem
